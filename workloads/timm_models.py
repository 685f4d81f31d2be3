"""`timm:<model>`: any image classifier of timm, randomly initialised, trained on random images (nothing downloaded).

`timm:resnet18`, `timm:vit_small_patch16_224:img_size=128`, `timm:model=convnext_tiny:num_classes=1000`: the
bare part after the name is the model (`timm.list_models()` lists them). timm is an optional dependency: this
module imports without it, and naming the workload then says, in one line, how to install it.

Checkpoint units: the model's trunk of blocks, found by name (`blocks`, `stages`, `layers`, `features`, or
numbered children such as a ResNet's `layer1..layer4`), plain Sequentials flattened into their blocks, and stages
(holding `blocks`, or only numbered blocks) opened into them. Whether the units chain (`units_chain`) is not guessed
per architecture: it is checked once per model by a one-image forward in which the whole chain runs as one group,
as checkpointing runs a segment. When that changes the output, the stages are kept whole, and if even those do not
chain each unit is checkpointed on its own. A model without a trunk uses its own children if they chain, else it has
no units (checkpointing is then `unsupported`). That check compares numbers: a model whose tensors have none (the meta
device, fake tensors: predict's engines, the fake-CUDA run) has its units planned on a CPU copy, outside those modes.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import re
import sys
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from bench.core.errors import UsageError
from workloads import Workload, register_workload, tensors_of
from workloads.framework.torchvision_ops import torchvision_stand_ins

INSTALL_HINT = "pip install 'membench[timm]' (in a checkout: make install)"
TRUNK_NAMES = ("blocks", "stages", "layers", "features")  # timm's names for the container of a model's blocks
NUMBERED = re.compile(r"^([A-Za-z_]+?)(\d+)$")  # `layer1`, `s2`: numbered stages that are direct children
DEFAULT_INPUT_SIZE = (3, 224, 224)  # for a model whose pretrained config names none

_torchvision_stand_ins: list[torch.library.Library] = []  # kept alive: a Library's definitions die with it
_unit_plans: dict[tuple, tuple[tuple[str, ...], bool]] = {}  # settings -> (unit names, whether they chain)


# --- importing timm ------------------------------------------------------------------------------------------

def import_timm():
    """The timm module; a one-line UsageError saying how to install it when it is missing or cannot import."""
    try:
        import timm
    except ModuleNotFoundError as error:
        if error.name in (None, "timm"):
            raise UsageError(f"workload 'timm' needs the timm package, not installed: {INSTALL_HINT}") from None
        raise UsageError(f"timm is installed but its dependency {error.name!r} is not: {INSTALL_HINT}") from None
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        timm = _import_timm_beside_torchvision_without_ops(error)
    return timm


def _import_timm_beside_torchvision_without_ops(error: RuntimeError):
    """timm, imported after declaring the torchvision operators whose compiled code did not load.

    PyPI's torchvision for x86_64 is built against CUDA torch; beside a CPU build of the same torch release its
    compiled operators do not load, and `import torchvision` (so `import timm`, which imports torchvision's Python
    code: FrozenBatchNorm2d, transforms) fails with "operator torchvision::nms does not exist". timm's models call
    none of those operators, so declaring the two that torchvision's import registers fake kernels for lets both
    import; calling torchvision.ops.nms still fails, as it did before. No warning: membench never calls them, and
    the line would precede every run and every one-line error in such an environment.
    """
    for name in [n for n in sys.modules if n.split(".")[0] in ("timm", "torchvision")]:
        del sys.modules[name]  # the halves of the failed import
    try:
        library = torchvision_stand_ins()
        import timm
    except Exception as again:  # noqa: BLE001 - whatever it is, the user's fix is the same
        raise UsageError(f"timm cannot import beside torch {torch.__version__} ({error}; then {again}); install the "
                         "torchvision release built for this torch") from None
    _torchvision_stand_ins.append(library)
    return timm


def unknown_model_error(timm, model: str) -> UsageError:
    """A one-line UsageError naming `model`, with the closest names and a `timm.list_models` pattern to try."""
    close = difflib.get_close_matches(model, timm.list_models(), n=3, cutoff=0.75)
    pattern = (re.match(r"[A-Za-z]*", model).group()[:4] or model)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return UsageError(f"unknown timm model {model!r}{hint} (timm {timm.__version__} lists its models with "
                      f"timm.list_models('*{pattern}*'))")


# --- checkpoint units --------------------------------------------------------------------------------------

def _flatten(module: nn.Module) -> list[nn.Module]:
    """A plain Sequential's or ModuleList's blocks, flattened (Sequential calls them in order); else the module."""
    plain = type(module) is nn.ModuleList or (isinstance(module, nn.Sequential)
                                             and type(module).forward is nn.Sequential.forward)
    return [unit for child in module.children() for unit in _flatten(child)] if plain else [module]


def _numbered_run(children: dict[str, nn.Module]) -> list[nn.Module]:
    """The longest run of children numbered consecutively under one prefix (`layer1..layer4`), in number order."""
    runs: dict[str, list[tuple[int, nn.Module]]] = {}
    for name, child in children.items():
        if match := NUMBERED.match(name):
            runs.setdefault(match.group(1), []).append((int(match.group(2)), child))
    ordered = [sorted(run, key=lambda item: item[0]) for run in runs.values() if len(run) >= 2]
    ordered = [run for run in ordered if [n for n, _ in run] == list(range(run[0][0], run[0][0] + len(run)))]
    return [child for _, child in max(ordered, key=len)] if ordered else []


def trunk(model: nn.Module) -> list[nn.Module]:
    """The containers of the model's blocks, in order: its `blocks`, `stages`, `layers` or `features` child, else
    its longest run of numbered children that hold blocks (a ResNet's `layer1..layer4`, a RegNet's `s1..s4`)."""
    children = dict(model.named_children())
    for name in TRUNK_NAMES:
        if name in children:
            return [children[name]]
    run = _numbered_run(children)
    return run if all(len(list(child.children())) >= 1 for child in run) else []


def _is_stage(unit: nn.Module) -> bool:
    """A stage of blocks: holds `blocks` (ConvNeXt, Swin, MaxViT) or only numbered children (RegNet's `b1..bN`)."""
    children = dict(unit.named_children())
    return "blocks" in children or (len(children) >= 2 and len(_numbered_run(children)) == len(children))


def candidate_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """The unit lists to try, finest first, each with whether it is used even if its units do not chain: stages
    opened into their blocks, then the trunk's blocks; for a model without a trunk, its children, if they chain."""
    blocks = [unit for container in trunk(model) for unit in _flatten(container)]
    if not blocks:
        return [([unit for child in model.children() for unit in _flatten(child)], False)]
    opened = [part for unit in blocks
              for part in ([p for child in unit.children() for p in _flatten(child)] if _is_stage(unit) else [unit])]
    return [(opened, False), (blocks, True)] if len(opened) > len(blocks) else [(blocks, True)]


def _outputs_match(a: Any, b: Any) -> bool:
    a, b = tensors_of(a), tensors_of(b)
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True)
                                    for x, y in zip(a, b))


def runs_as_one_chain(model: nn.Module, units: list[nn.Module], x: torch.Tensor, expected: Any) -> bool:
    """Whether `model(x)` still gives `expected` when the first unit runs all units in turn and the others pass
    their input through: what checkpointing does to a segment of units that chain."""
    if len({id(unit) for unit in units}) != len(units):
        return False
    forwards = [unit.forward for unit in units]
    own_forwards = [unit.__dict__.get("forward") for unit in units]  # set on the instance before us: rare
    chain_outputs: list[Any] = []

    def run_chain(*args, **kwargs):
        out = forwards[0](*args, **kwargs)
        for forward in forwards[1:]:
            out = forward(out)
        chain_outputs.append(out)
        return out

    def passed_through(value, *rest, **kwargs):
        if rest or kwargs or not chain_outputs or chain_outputs[-1] is not value:
            raise LookupError("not called with the previous unit's output")
        return value

    units[0].forward = run_chain
    for unit in units[1:]:
        unit.forward = passed_through
    try:
        return _outputs_match(model(x), expected)
    except Exception:  # noqa: BLE001 - a unit fed something else (LookupError, a shape error): not a chain
        return False
    finally:
        for unit, own in zip(units, own_forwards):
            if own is None:
                del unit.forward  # back to the class's forward
            else:
                unit.forward = own


def plan_units(model: nn.Module, input_size: tuple[int, ...]) -> tuple[tuple[str, ...], bool]:
    """(names of the checkpoint units, whether they chain), from one-image forwards in eval mode."""
    names = {id(module): name for name, module in model.named_modules()}
    candidates = candidate_units(model)
    fallback = next(((units, False) for units, alone in candidates if alone), ([], False))
    parameter = next(model.parameters(), None)
    x = (torch.zeros((1, *input_size)) if parameter is None
         else torch.zeros((1, *input_size), device=parameter.device, dtype=parameter.dtype))
    was_training = model.training
    model.eval()  # no BatchNorm statistics updated, no dropout drawn
    try:
        with torch.no_grad():
            expected = model(x)
            chain = next(((units, True) for units, _ in candidates
                          if len(units) >= 2 and runs_as_one_chain(model, units, x, expected)), fallback)
    except Exception:  # noqa: BLE001 - the model's own failure shows again, with its message, in the run itself
        chain = fallback
    finally:
        model.train(was_training)
    units, chains = chain
    return tuple(names[id(unit)] for unit in units), chains


def holds_values(model: nn.Module) -> bool:
    """Whether the model's tensors hold numbers: not on the meta device, not fake tensors."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor is None or not (tensor.is_meta or isinstance(tensor, FakeTensor))


@contextlib.contextmanager
def real_cpu_tensors() -> Iterator[None]:
    """Inside, tensors are real and made on the CPU: every dispatch mode (a fake mode, a tracker, placeholder
    answers) is set aside, the default device is the CPU, and the random state is restored on exit."""
    with _disable_current_modes(), torch.device("cpu"), torch.random.fork_rng(devices=[]):
        yield


# --- the workload ------------------------------------------------------------------------------------------

@register_workload
class TimmWorkload(Workload):
    """A timm image classifier, random weights, on random images and labels; cross-entropy, Adam."""

    name = "timm"
    description = "any timm image classifier (timm:<model>), random weights, random images and labels, Adam"
    default_batch_size = 32
    data_sources = ("synthetic",)
    positional_option = "model"
    # img_size 0: the model's own input size (its pretrained config's, e.g. 224 for resnet18, 384 for *_384)
    options = {"model": "resnet18", "num_classes": 10, "img_size": 0}
    # at 32x32 and batch 2 the last BatchNorms see 2 values: bf16 diverges
    small = ("timm:test_resnet:img_size=64", 4)
    small_for = {"loop": ("timm:test_resnet:img_size=32", 2), "emulated16": ("timm:test_resnet:img_size=64", 2),
                 "fake_cuda": ("timm:resnet18", 2)}  # the model bench/suites/models.yaml runs
    requires = "timm"

    def __init__(self, **options):
        super().__init__(**options)
        timm = import_timm()  # here, so that a missing timm or a bad name fails before any run starts
        if not timm.is_model(self.settings["model"]):
            raise unknown_model_error(timm, self.settings["model"])
        try:
            self.input_size()
        except RuntimeError as error:  # a known architecture with an unknown pretrained tag (`resnet18.nope`)
            raise UsageError(f"timm model {self.settings['model']!r}: {error}") from None
        if self.settings["num_classes"] < 1 or self.settings["img_size"] < 0:
            raise UsageError(f"workload {self.spec()!r}: num_classes must be at least 1 and img_size at least 0")

    def input_size(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        config = import_timm().get_pretrained_cfg(self.settings["model"])
        channels, height, width = (config.input_size if config is not None and config.input_size
                                   else DEFAULT_INPUT_SIZE)
        size = self.settings["img_size"]
        return (channels, size, size) if size else (channels, height, width)

    def build_model(self) -> nn.Module:
        timm = import_timm()
        arguments = {"pretrained": False, "num_classes": self.settings["num_classes"]}
        if self.settings["img_size"]:
            try:
                torch.manual_seed(self.seed)
                return timm.create_model(self.settings["model"], img_size=self.settings["img_size"], **arguments)
            except TypeError as error:
                if "img_size" not in str(error):
                    raise
                # a model without `img_size` (a CNN with global pooling) takes any size: only the batch has it
        torch.manual_seed(self.seed)
        return timm.create_model(self.settings["model"], **arguments)

    def make_batch(self, batch_size: int, data: str = "synthetic") -> tuple[torch.Tensor, torch.Tensor]:
        self.check_data(data)
        gen = torch.Generator().manual_seed(self.seed)
        images = torch.randn((batch_size, *self.input_size()), generator=gen)  # as if normalised
        labels = torch.randint(self.settings["num_classes"], (batch_size,), generator=gen)
        return images, labels

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = output[0] if isinstance(output, (tuple, list)) else output  # e.g. a distilled model's two heads
        return nn.functional.cross_entropy(logits, target)

    def _plan_key(self) -> tuple:
        return tuple(sorted(self.settings.items()))

    def checkpoint_units(self, model: nn.Module) -> list[nn.Module]:
        key = self._plan_key()
        if key not in _unit_plans:
            if holds_values(model):
                _unit_plans[key] = plan_units(model, self.input_size())
            else:  # whether the units chain is decided by numbers: on a real copy
                with real_cpu_tensors():
                    _unit_plans[key] = plan_units(self.build_model(), self.input_size())
        return [model.get_submodule(name) for name in _unit_plans[key][0]]

    @property
    def units_chain(self) -> bool:
        """Whether this model's units chain, as `checkpoint_units` found; a module-level record, since the runner
        asks another instance of the same spec. False (each unit alone, always correct) before it was found."""
        plan = _unit_plans.get(self._plan_key())
        return plan[1] if plan is not None else False

    def describe(self) -> dict[str, Any]:
        return {**self.settings, "input_size": "x".join(map(str, self.input_size()))}
