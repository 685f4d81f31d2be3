"""The optimizer: another implementation of the workload's (foreach, for_loop, fused), or another algorithm."""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from bench.core.errors import Unsupported, UsageError
from bench.core.memory_categories import UNIFIED_MEMORY, allocating, one_fused_kernel
from bench.core.quiet_import import import_torchao
from strategies import Strategy, register_strategy
from strategies.framework import bitsandbytes_adamw, compiled_update

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor,
}
# name -> the class of torchao.optim keeping AdamW's two moments in 8 or 4 bits per value, a float32 scale per block
LOW_BIT_OPTIMIZERS: dict[str, str] = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
LOW_BIT_INSTALL_HINT = "pip install 'membench[hf]' (in a checkout: make install)"
# impl -> the constructor's (foreach, fused); None lets PyTorch choose (foreach on CUDA, for_loop on the CPU)
IMPLEMENTATIONS: dict[str, tuple[bool | None, bool | None]] = {
    "default": (None, None), "foreach": (True, None), "for_loop": (False, None), "fused": (None, True),
}
# the implementations of a low-bit name beside torchao's (impl=default): name -> the names that have it
LOW_BIT_IMPLEMENTATIONS: dict[str, tuple[str, ...]] = {"bitsandbytes": ("adamw8bit",)}
# bitsandbytes' paged optimizers (Optimizer8bit.get_state_buffer) page the state of a parameter of at least this many
# values; a smaller one's state is an ordinary device tensor
PAGED_MIN_VALUES = bitsandbytes_adamw.PAGED_MIN_VALUES


def implementation(optimizer: torch.optim.Optimizer) -> str:
    """Which implementation `optimizer.step()` runs: fused, foreach or for_loop (PyTorch's choice resolved)."""
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        params = [p for g in optimizer.param_groups for p in g["params"]]
        return "foreach" if _default_to_fused_or_foreach(params, False, False)[1] else "for_loop"
    return "foreach" if group["foreach"] else "for_loop"


@register_strategy
class Optimizer(Strategy):
    """Replaces the workload's optimizer with another implementation or another algorithm.

    `impl`: `for_loop` steps one parameter at a time; `foreach` runs each operation over every parameter at once
    (faster, but its temporaries exist for all parameters together); `fused` is one kernel per group. The same
    arithmetic: the row must match the baseline. `name`: SGD (no state), Adam and AdamW (two moments: twice the
    weights), Adafactor (factored second moments: a row and a column per matrix), each with PyTorch's default
    hyperparameters; an algorithm other than the workload's changes the weights' update, so that row does not
    match the baseline, by design. Training only (eval has no step).

    `name=adamw8bit`, `name=adamw4bit`: torchao's low-bit AdamW (`torchao.optim.AdamW8bit`, `AdamW4bit`; the `hf`
    extra installs torchao), with the workload's lr, betas, eps and weight decay. Each moment of a parameter of at
    least 4096 values is stored as 8-bit (4-bit) codes of a dynamic-exponent map plus a float32 scale per block of
    256 (128) values, about 1/4 (1/8) of AdamW's float32 state; smaller parameters keep float32 moments. The first
    step updates from the unrounded moments, so it matches AdamW to float rounding; later steps differ by design.
    torchao compiles each parameter's update with `torch.compile` (a few seconds per parameter shape, on the first
    step). Limitations: under the live-tensor tracker the step runs outside the tracker's dispatch mode (torch.compile
    refuses to run under one), so the optimizer stage's peak counts the state, updated in place, and not the
    compiled kernel's own buffers; on fake tensors (predict) it cannot be compiled, so each update counts the buffers
    inductor's generated code for it allocates (read from that code compiled on the CPU at a small size:
    `strategies.framework.compiled_update`; an H200 measured the same blocks) and runs in place as one kernel. The
    state counts by its real storage (uint8 codes and scales), not its float32 face.

    `impl=bitsandbytes` (with `name=adamw8bit`): bitsandbytes' `AdamW8bit` in place of torchao's, as
    `strategies.framework.bitsandbytes_adamw` emulates it from bitsandbytes' source: its state as bitsandbytes lays it
    out (uint8 codes made with `torch.zeros_like` in the caching allocator, one float32 block maximum per 2048 values,
    the last block ragged; float32 moments for a parameter under 4096 values; the instance's two 256-value maps) and
    its update as its one in-place kernel (`optimizer_update_8bit_blockwise`: no temporaries counted,
    `memory_categories.one_fused_kernel`). Exact on the CPU and predicted on fake CUDA (PyTorch arithmetic;
    torchao's dynamic map); refused on a real GPU, where that arithmetic would allocate temporaries the kernel does
    not. With `paged=true` it is `PagedAdamW8bit`, the moments of a parameter of at least 100,000 values made in
    unified memory (fake CUDA only).

    `paged=true` (with a low-bit `name`) predicts bitsandbytes' paged optimizers (`PagedAdamW8bit`): their
    `get_state_buffer` makes the uint8 state of every parameter of at least 100,000 values with `cudaMallocManaged`
    (CUDA unified memory), outside PyTorch's caching allocator, so `torch.cuda.memory_stats` (allocated, active,
    reserved) never counts it; the block scales and smaller parameters' state stay device tensors. Its update is one
    kernel (`optimizer_update_8bit_blockwise`) that updates weight, codes and scales in place, so torchao's
    arithmetic that stands for it counts no temporaries (`memory_categories.one_fused_kernel`). Predicted only (fake
    CUDA): the codes are filed as unified memory, which the allocator model leaves out; a real step would keep
    torchao's codes in the caching allocator, so it is refused there, and on the CPU.
    """

    name = "optimizer"
    description = ("the workload's optimizer with another implementation (impl=), or another algorithm (name=, "
                   "including torchao's 8-bit and 4-bit AdamW)")
    phases = ("train",)
    options = {"name": "workload", "impl": "default", "paged": False}
    priority = 30  # before optimizer_in_backward, which splits whatever optimizer this makes

    # The workload's optimizer in each implementation, and plain SGD, with less state (another update:
    # differs_by_design, so out of an answer unless --allow-different). Not Adafactor nor torchao's 8-bit and 4-bit
    # AdamW: fake tensors cannot run their steps, so each prediction would cost a real one (at a language model's
    # full size, one that does not fit in this machine's memory).
    plan_options = ({"impl": "foreach"}, {"impl": "for_loop"}, {"impl": "fused"}, {"name": "sgd"})
    # The workload's Adam in PyTorch's choice of implementation (for_loop on the CPU) is the baseline itself
    memory_effect = {}  # no band on captcha_resnet18: see above

    def __init__(self, **options):
        super().__init__(**options)
        if self.settings["name"] not in ("workload", *OPTIMIZERS, *LOW_BIT_OPTIMIZERS):
            raise UsageError(f"optimizer:name={self.settings['name']!r}; valid choices: workload, "
                             f"{', '.join([*OPTIMIZERS, *LOW_BIT_OPTIMIZERS])}")
        impl = self.settings["impl"]
        if impl not in IMPLEMENTATIONS and impl not in LOW_BIT_IMPLEMENTATIONS:
            raise UsageError(f"optimizer:impl={impl!r}; valid choices: "
                             f"{', '.join([*IMPLEMENTATIONS, *LOW_BIT_IMPLEMENTATIONS])}")
        if impl in LOW_BIT_IMPLEMENTATIONS and self.settings["name"] not in LOW_BIT_IMPLEMENTATIONS[impl]:
            raise UsageError(f"optimizer:impl={impl} implements name={'/'.join(LOW_BIT_IMPLEMENTATIONS[impl])}, "
                             f"not name={self.settings['name']}")
        if self.settings["paged"] and self.settings["name"] not in LOW_BIT_OPTIMIZERS:
            raise UsageError(f"optimizer:paged=true pages a low-bit optimizer's state (name="
                             f"{'/'.join(LOW_BIT_OPTIMIZERS)}), not name={self.settings['name']}")
        self.replaced: str | None = None  # the workload's optimizer's class name, when name= replaced it
        self.resolved = {"name": self.settings["name"], "impl": self.settings["impl"]}
        # another implementation of the workload's algorithm keeps its state (fused's step counts are on the device
        # too: more, never less); another algorithm keeps other state
        self.keeps_training_state = self.settings["name"] == "workload"

    def bind(self, context):
        super().bind(context)
        name = self.settings["name"]
        if name == "workload" or context.workload is None:
            return
        # whether name= replaces the workload's optimizer, known before any step: a plan's replayed candidate is bound
        # and never wraps one, and its row must still say that it changes the update (differs_by_design)
        try:
            workload_class = type(context.workload.make_optimizer(torch.nn.Linear(1, 1)))
        except Exception:  # noqa: BLE001 - a workload whose optimizer needs its own model: known once wrapped
            return
        cls = OPTIMIZERS.get(name)
        self.replaced = workload_class.__name__ if cls is not workload_class else None
        if cls is not None:
            self.resolved = {**self.resolved, "name": cls.__name__}

    def check(self, context):
        super().check(context)
        name = self.settings["name"]
        if name in LOW_BIT_OPTIMIZERS:
            low_bit_class(name)  # Unsupported, naming the extra, when torchao is missing
            if self.settings["impl"] not in ("default", *LOW_BIT_IMPLEMENTATIONS):
                raise Unsupported(f"optimizer:name={name} has one implementation (torchao's), not "
                                  f"impl={self.settings['impl']}")
            if self.settings["paged"] and context.device != "cuda":
                raise Unsupported(f"optimizer:paged=true keeps the state in CUDA unified memory: it needs device "
                                  f"cuda, not {context.device}")

    def wrap_optimizer(self, optimizer, model):
        name = self.settings["name"]
        if name in LOW_BIT_OPTIMIZERS:
            return self._low_bit(optimizer, name)
        cls = type(optimizer) if name == "workload" else OPTIMIZERS[name]
        foreach, fused = IMPLEMENTATIONS[self.settings["impl"]]
        accepted = inspect.signature(cls).parameters
        if fused and "fused" not in accepted:
            raise Unsupported(f"{cls.__name__} has no fused implementation")
        chosen = {key: value for key, value in (("foreach", foreach), ("fused", fused)) if key in accepted}
        groups = [{**({k: v for k, v in group.items() if k != "params"} if cls is type(optimizer) else {}),
                   "params": group["params"], **chosen} for group in optimizer.param_groups]
        replacement = cls(groups)
        self.replaced = type(optimizer).__name__ if cls is not type(optimizer) else None
        self.resolved = {"name": cls.__name__, "impl": implementation(replacement)}
        return replacement

    def _low_bit(self, optimizer: torch.optim.Optimizer, name: str) -> torch.optim.Optimizer:
        """torchao's low-bit AdamW (impl=bitsandbytes: bitsandbytes' AdamW8bit, emulated) over the workload's parameter
        groups, with the workload's hyperparameters that it takes (lr, betas, eps, weight_decay): only the storage of
        the moments changes."""
        if self.settings["impl"] == "bitsandbytes":
            cls = bitsandbytes_adamw.adamw8bit_class(paged=self.settings["paged"])
            resolved = {"name": f"bitsandbytes.optim.{cls.__name__}", "impl": "bitsandbytes (one in-place kernel)"}
        else:
            cls = _tracked_step_class(low_bit_class(name), paged=self.settings["paged"])
            resolved = {"name": f"torchao.optim.{cls.__name__}", "impl": "torch.compile"}
        accepted = set(inspect.signature(cls).parameters) - {"params"}
        groups = [{key: value for key, value in group.items() if key == "params" or key in accepted}
                  for group in optimizer.param_groups]
        replacement = cls(groups)
        self.replaced = type(optimizer).__name__
        self.resolved = resolved
        if self.settings["paged"]:
            self.resolved["state"] = "paged (CUDA unified memory)"
        return replacement

    def describe(self):
        return {f"optimizer.{key}": value for key, value in self.resolved.items()}

    def differs_by_design(self):
        if self.replaced is None:
            return None
        if self.settings["name"] in LOW_BIT_OPTIMIZERS:
            bits = 8 if self.settings["name"] == "adamw8bit" else 4
            return (f"{self.resolved['name']} replaces the workload's {self.replaced}: its moments are stored in "
                    f"{bits} bits per value (a float32 scale per block), so each step after the first updates the "
                    "weights from rounded moments")
        return f"{self.resolved['name']} replaces the workload's {self.replaced}: another update of the weights"


def low_bit_class(name: str) -> type[torch.optim.Optimizer]:
    """torchao's optimizer class for `name` (LOW_BIT_OPTIMIZERS); Unsupported naming the extra without torchao."""
    try:
        module = import_torchao("torchao.optim")
    except ImportError:
        raise Unsupported(f"optimizer:name={name} needs torchao, not installed: {LOW_BIT_INSTALL_HINT}") from None
    cls = getattr(module, LOW_BIT_OPTIMIZERS[name], None)
    if cls is None:
        raise Unsupported(f"optimizer:name={name}: this torchao has no torchao.optim.{LOW_BIT_OPTIMIZERS[name]}")
    return cls


@contextlib.contextmanager
def _compilable_step(params: list[torch.Tensor]):
    """Where torchao's step (a `torch.compile`d function per parameter) can run compiled.

    Under a TorchDispatchMode (the live-tensor tracker) torch.compile refuses to run: the step runs outside the
    modes, compiled as in a timed step, and the tracker sees the state tensors it updates in place, not the fused
    kernel's own buffers (as for any kernel's workspace). On fake tensors (predict) it runs eagerly inside them."""
    if _get_current_dispatch_mode() is None:
        yield
    elif any(is_fake(p) for p in params):
        with torch.compiler.set_stance("force_eager"):
            yield
    else:
        with _disable_current_modes():
            yield


@contextlib.contextmanager
def _update_as_one_kernel(paged: bool):
    """With `paged` (bitsandbytes' paged optimizer): each parameter's update, torchao's arithmetic run eagerly on fake
    tensors, counts as bitsandbytes' `optimizer_update_8bit_blockwise` kernel, which reads the gradient and updates
    the weight, the codes and the block scales in place, its intermediates in registers
    (`memory_categories.one_fused_kernel`): no float32 copy of the weight, gradient or moments. The state is made
    before the update (torchao's initialisation, tracked as usual)."""
    if not paged:
        yield
        return
    adam = import_torchao("torchao.optim.adam")
    update = getattr(adam, "single_param_adam", None)
    if update is None:
        raise Unsupported("optimizer:paged=true: this torchao has no torchao.optim.adam.single_param_adam to run as "
                          "bitsandbytes' kernel")

    def as_one_kernel(*args, **kwargs):
        with one_fused_kernel():
            return update(*args, **kwargs)

    adam.single_param_adam = as_one_kernel
    try:
        yield
    finally:
        adam.single_param_adam = update


def _tracked_step_class(cls: type[torch.optim.Optimizer], paged: bool = False) -> type[torch.optim.Optimizer]:
    """`cls` whose step runs where it can be compiled (`_compilable_step`); `paged`: whose uint8 state of each
    parameter of at least PAGED_MIN_VALUES values is made in CUDA unified memory (bitsandbytes' paged state)."""

    class LowBitOptimizer(cls):
        def step(self, closure=None):
            params = [p for group in self.param_groups for p in group["params"]]
            # on fake tensors (predict) the update runs eagerly: counted as torch.compile's would be
            predicting = not paged and any(is_fake(p) for p in params)
            compiled = compiled_update.update_as_compiled(cls) if predicting else contextlib.nullcontext()
            with _compilable_step(params), warnings.catch_warnings(), _update_as_one_kernel(paged), compiled:
                # torchao's state subclasses lack a hash for AOTAutograd's cache: a warning per shape, nothing wrong
                warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
                return super().step(closure)

        def _new_buffer(self, p, signed):
            if not paged or p.numel() < PAGED_MIN_VALUES:
                return super()._new_buffer(p, signed)
            if not is_fake(p):
                raise Unsupported("optimizer:paged=true is predicted on fake CUDA only: torchao's state of a real step "
                                  "lives in the caching allocator (bitsandbytes' PagedAdamW8bit is what pages it)")
            # the codes (uint8) are what bitsandbytes pages; the float32 block scales stay device tensors
            with allocating(UNIFIED_MEMORY, dtypes=(torch.uint8,)):
                return super()._new_buffer(p, signed)

    LowBitOptimizer.__name__ = LowBitOptimizer.__qualname__ = cls.__name__
    return LowBitOptimizer
