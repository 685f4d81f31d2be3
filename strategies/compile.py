"""`torch.compile` with AOTAutograd's activation memory budget: the compiler chooses what to recompute.

`torch._functorch.config.activation_memory_budget` (0 to 1) tells the min-cut partitioner how much of the
activations the compiled forward may save for backward, relative to saving everything the default partition
saves: at 1.0 it saves what it must for speed, lower it recomputes the cheapest ops (by its runtime estimate) until
the saved bytes fit. Unlike eager checkpointing, the plan is per operator and fused into the compiled kernels.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch._subclasses.fake_tensor import is_fake

from bench.core.errors import Unsupported, UsageError, choices_error
from strategies import Strategy, Tolerance, differs, register_strategy
from strategies.grad_accumulation import batch_statistics_modules
from strategies.framework.inductor_plan import predicted_inductor

# Backends whose graphs go through the min-cut partitioner (where the budget applies): inductor, and
# aot_eager_decomp_partition (the same partition run by eager kernels: no C++ compiler, cheap to test with).
BACKENDS = ("inductor", "aot_eager_decomp_partition")
# what is compiled: the whole model (one graph where dynamo can), or each of the workload's layers (its checkpoint
# units) on its own, as torchtune's compile_model does
SCOPES = ("model", "layers")


def cpu_compiler() -> str | None:
    """The C++ compiler inductor would use on the CPU (its own search: $CXX, then g++), or None when there is none."""
    from torch._inductor import cpp_builder, exc

    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return None


@register_strategy
class Compile(Strategy):
    """The model under `torch.compile(backend=...)`, compiled with `activation_memory_budget=budget`.

    Options: `budget` (a fraction in (0, 1], default 1.0: the partitioner's usual plan), `backend` (`inductor`,
    the default, or `aot_eager_decomp_partition`), `scope` (`model`, the default: the whole model; `layers`: each of
    the workload's layers, its checkpoint units, compiled on its own, as torchtune's `compile_model` does) and `loss`
    (true: the loss compiled too, as torchtune's `compile_loss`; default false). Compilation happens in the first forward and backward of each
    pass (dynamo's caches are reset first, so a previous case's compiled code, built under another budget, is never
    reused); those calls fall in the warm-up steps, so the step time is the compiled step's. The row's
    `compile_time_ms` is how much longer that first forward and backward took than the last ones of the timing pass
    (inductor keeps compiled kernels in an on-disk cache: the verification pass compiles first, so the timing pass
    may find them there, as a user's second run would).

    Memory: on CUDA `max_memory_allocated` measures the compiled step. On the CPU the memory pass counts at the
    allocator (`cpu_memory_count`: torch.profiler's memory events, `memory_method` `cpu_allocator_events`), which
    sees inductor's buffers as they are; the live-tensor tracker (a TorchDispatchMode that lets torch.compile compile
    under it, `ignore_compile_internals`) sees the operators the compiled code runs, which for
    `aot_eager_decomp_partition` are all of its memory, but not the buffers inductor's C++ wrapper allocates. `inductor`
    on the CPU compiles C++: without a C++ compiler the row is `unsupported` and says so.

    Prediction (`predict`, on fake tensors): the model compiles under the fake tensors as it would for real, and its
    compiled graphs run on them. Inductor's kernels cannot (they read and write real memory), so inductor is
    predicted from its own generated code (`strategies.framework.inductor_plan`): inductor's partition, then each graph
    lowered by inductor for the CPU from fake inputs of its shapes up to its wrapper (the C++ kernels are never
    compiled), and the wrapper's buffers made and freed in their
    order while the graph's arithmetic counts as one kernel; a graph with a kernel that allocates its own output
    (attention) runs as its partition on eager kernels. On the CPU both predictions equal their measurements
    (tests/test_compile_prediction.py).

    Tolerance: fused kernels reorder float arithmetic. Loss within 1e-4; gradients within 1e-2 relative norm per
    parameter, since the baseline's own float32 gradients are off from the true ones by the same order where
    BatchNorm leaves a gradient small (captcha ResNet, batch 32: eager float32 is up to 1.9e-3 from a float64 step;
    inductor's CPU kernels up to 6.4e-3, on BatchNorm biases, and 3.4e-3 to 6.3e-3 from the baseline over two
    runs: less accurate than eager, within float32 reordering). The weights after one optimizer step
    are not compared: the step is the baseline's own optimizer, which the compiler does not touch, and Adam's first
    step moves a weight by about the learning rate whatever the size of its gradient, so a gradient at rounding
    level whose sign the reordering flips moves its weight by twice that (0.3 relative norm on timm's
    zero-initialised BatchNorm weights, 2.6e-3 on the captcha ResNet at batch 2). A model with dropout cannot
    match: compiled dropout draws its masks from another random stream than eager dropout (the row says so).

    Limitations: on the CPU its memory is counted at the allocator (profiler events), not by the exact
    live-tensor tracker the other strategies' CPU rows use. A prediction of `inductor` counts the buffers of its
    generated code, not its kernels' own work areas, and runs a graph whose kernel allocates its own output
    (attention) as its partition on eager kernels (its `prediction_note`). A model with dropout differs by
    design; the weights after one step are not compared. `inductor` on the CPU without a C++ compiler is an
    `unsupported` row. `compile_time_ms` is a difference of step times, smaller where inductor's on-disk cache already
    held the kernels. The planner never tries it (`plan_excluded`).
    """

    name = "compile"
    row_columns = ("compile_time_ms",)
    description = "torch.compile with AOTAutograd's activation_memory_budget (the partitioner recomputes to fit)"
    options = {"budget": 1.0, "backend": "inductor", "scope": "model", "loss": False}
    phases = ("train",)
    cpu_memory_count = "allocator_events"
    priority = 70  # compiles the model as the other strategies left it
    plan_excluded = ("the planner's time model counts eager operators, not compiled kernels: measure it with compare "
                     "(predict predicts its memory)")
    layer_kinds_traced_whole = ("each of the four traces compiles its graphs anew, and llama-3.1-8b's at 4096 tokens "
                                "(lora+checkpoint+compile:scope=layers:loss=true, 25+7 layers) made no template: "
                                "28.7 s against the full trace's 18")
    prediction_note = ("inductor predicted from its generated code (each graph compiled for the CPU: its buffers, "
                       "not its kernels' work areas); a graph with a kernel that allocates its own output (attention) "
                       "as its partition on eager kernels")
    tolerance = Tolerance(loss_rtol=1e-4, grad_rtol=1e-2, step_rtol=float("inf"))
    expected_with = {"dropout": differs("another random stream than eager dropout")}
    # inductor compiles C++ for ~30 s per pass on a 2-core CPU; the eager partition backend runs the same
    # partitioned graphs. Its memory is counted at the allocator on the CPU (the tracker cannot see compiled
    # steps): pinned in tests/test_activation_memory.py.
    test_spec = "compile:backend=aot_eager_decomp_partition"

    def __init__(self, **options):
        super().__init__(**options)
        if not 0 < self.settings["budget"] <= 1:
            raise UsageError(f"compile:budget={self.settings['budget']} must be a fraction in (0, 1]")
        if self.settings["backend"] not in BACKENDS:
            raise choices_error("compile backend", self.settings["backend"], BACKENDS)
        if self.settings["scope"] not in SCOPES:
            raise choices_error("compile scope", self.settings["scope"], SCOPES)
        if self.settings["backend"] != "inductor":
            self.prediction_note = None  # the partition backend's prediction is what it runs
        self._call_ms: list[float] = []  # forward + backward of each step of the current session, in order
        self._has_dropout = False
        self.compile_time_ms: float | None = None

    def check(self, context):
        super().check(context)
        if context.device == "cpu" and self.settings["backend"] == "inductor" and cpu_compiler() is None:
            raise Unsupported("compile:backend=inductor on the CPU compiles C++ and no C++ compiler was found "
                              "(inductor uses $CXX, or g++ when it is unset): install one, or use "
                              "backend=aot_eager_decomp_partition")

    @contextlib.contextmanager
    def session(self):
        torch._dynamo.reset()
        self._call_ms = []
        with torch._functorch.config.patch(activation_memory_budget=float(self.settings["budget"])):
            yield
        if self.compile_time_ms is None and len(self._call_ms) >= 4:  # the timing pass: a compiling step and more
            first, last = self._call_ms[0] + self._call_ms[1], self._call_ms[-2] + self._call_ms[-1]
            self.compile_time_ms = first - last

    def prepare_model(self, model, units):
        self._has_dropout = "dropout" in batch_statistics_modules(model)
        self._backend = self.backend_for(model)
        if self.settings["scope"] == "layers":
            for unit in units:  # compiled in place: the model calls each unit's compiled forward
                unit.compile(backend=self._backend)
            return model
        return torch.compile(model, backend=self._backend)

    def prepare_loss(self, loss):
        """With `loss=true`, the loss compiled too (torchtune's compile_loss): its graph partitioned and fused as the
        model's."""
        return torch.compile(loss, backend=self._backend) if self.settings["loss"] else loss

    def backend_for(self, model):
        """The backend the model compiles with: the setting's, but on fake or meta parameters (predict) inductor's
        memory plan read from its generated code (`strategies.framework.inductor_plan`), since its kernels read and
        write real memory."""
        backend = self.settings["backend"]
        if backend == "inductor" and any(is_fake(p) or p.is_meta for p in model.parameters()):
            return predicted_inductor()
        return backend

    @contextlib.contextmanager
    def forward(self):
        started = time.perf_counter()
        yield
        self._call_ms.append((time.perf_counter() - started) * 1e3)

    def backward(self, loss):
        started = time.perf_counter()
        loss.backward()
        self._call_ms.append((time.perf_counter() - started) * 1e3)

    def differs_by_design(self):
        if self._has_dropout:
            return "compiled dropout draws its masks from another random stream than eager dropout"
        return None

    def columns(self):
        return {"compile_time_ms": self.compile_time_ms}
