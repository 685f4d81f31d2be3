"""Inductor's memory plan for a compiled graph on fake tensors: the buffers its generated wrapper allocates and frees.

Inductor's kernels cannot run on fake tensors (they read and write real memory), so a prediction cannot run the code
it generates. It can read it: inductor compiles a graph from fake inputs (that is how torch.compile calls it), and its
generated wrapper's `call` says every buffer it allocates (`empty_strided_*`), hands over (`# reuse`) and frees
(`del`), and which it returns. `predicted_inductor` is a torch.compile backend for predictions: AOTAutograd with
inductor's decompositions and partition (its joint-graph passes, then the min-cut: what the forward saves for
backward is inductor's choice), each forward and backward graph compiled by inductor for the CPU on fake inputs of
the same shapes (a graph traced for CUDA is moved to the CPU first: CUDA's code generator needs triton; its wrapper's
buffers are taken to be the CPU's, as the H200 found them for torchao's compiled update,
strategies/framework/compiled_update.py, not checked on a GPU for a model's graphs). When the
graph runs, its wrapper's buffers are made and freed in their order, the graph's arithmetic runs inside
`one_fused_kernel()` (counted as nothing), its inputs are released where the wrapper releases them, and its outputs
are counted from its return. A graph whose wrapper gets a buffer another way (a kernel that allocates its own output,
such as attention's) runs as the partition on eager kernels (`aot_eager_decomp_partition`'s way) instead: nothing of
it is guessed. On the CPU, `compile:scope=layers:loss=true` of gpt2 (2 layers, 4 x 1024 tokens) measured 3,818,700,920
B at the allocator, as predicted here; the partition on eager kernels predicted 5,298,574,456 B (+38.7%: the compiled
loss's backward, one fused kernel where eager kernels make several logits-sized temporaries).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import warnings

import torch
from torch.utils._python_dispatch import _disable_current_modes

from bench.core.memory_categories import made_now, one_fused_kernel
from strategies.framework.compiled_update import DELETE, read_buffer_line

ASSIGNED = re.compile(r"^\s*(\w+) = (.*)$")
INPUTS = re.compile(r"^\s*([\w, ]+?),? = args\s*$")
RETURNED = re.compile(r"(?:reinterpret_tensor\()?(\w+)")


@dataclasses.dataclass(frozen=True)
class WrapperPlan:
    """What a generated wrapper's `call` does with memory, in order: ("alloc", buffer, bytes), ("free", buffer,
    bytes) and ("release", input index, 0) events; and the buffers it returns (not freed by it)."""

    events: tuple[tuple[str, str | int, int], ...]
    returned: frozenset[str]


def wrapper_plan(code: str) -> WrapperPlan | None:
    """The memory events of the wrapper in `code`, or None where a buffer is made otherwise than by `empty_strided`
    (a kernel's own output: its size is not in the code)."""
    body = code[code.index("def call("):].splitlines()[1:]
    inputs: list[str] = []
    live: dict[str, tuple[str, int]] = {}  # a name in the code -> (the buffer it was made as, its bytes)
    events: list[tuple[str, str | int, int]] = []
    for line in body:
        text = line.strip()
        if text.startswith("return"):
            returned = {live[name][0] for name in RETURNED.findall(text[len("return"):]) if name in live}
            return WrapperPlan(tuple(events), frozenset(returned))
        if not inputs and (match := INPUTS.match(line)):
            inputs = [name.strip() for name in match[1].split(",") if name.strip()]
        elif read_buffer_line(line, live, events):
            continue
        elif match := DELETE.match(line):
            if match[1] in live:
                events.append(("free", *live.pop(match[1])))
            elif match[1] in inputs:
                events.append(("release", inputs.index(match[1]), 0))
        elif (match := ASSIGNED.match(line)) and not match[2].startswith(("reinterpret_tensor(", "args")):
            if match[1] != "_" and "=" not in match[1]:
                return None  # a buffer made by a kernel: its size is not in the wrapper
    return None


def _to_cpu(value):
    if isinstance(value, torch.device) and value.type != "cpu":
        return torch.device("cpu")
    return value


class _WrapperWritten(Exception):
    """Raised once inductor has written a graph's wrapper: what follows (loading the module, which compiles its C++
    kernels with the system's compiler, a precompiled header of 150 MB first) is not needed to read its plan."""


def wrapper_code(gm: torch.fx.GraphModule, example_inputs: list) -> str:
    """Inductor's generated wrapper for `gm` compiled for the CPU, from fake inputs of the shapes of `example_inputs`
    (outside the caller's modes). Inductor stops once it has written the wrapper: its C++ kernels are never
    compiled (about 10 s of llama-3.1-8b's `compile:scope=layers:loss=true` prediction on a new machine, with
    nothing in inductor's on-disk cache), nor run."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = copy.deepcopy(gm)
    for node in graph.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, _to_cpu)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, _to_cpu)
    graph.recompile()
    wrapper: list[str] = []

    def written(code: str):
        if "def call(" in code:
            wrapper.append(code)
            raise _WrapperWritten

    saved = GraphLowering.save_output_code
    with _disable_current_modes():
        mode = FakeTensorMode()
        with mode:
            inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                      if isinstance(t, torch.Tensor) else t for t in example_inputs]
        GraphLowering.save_output_code = staticmethod(written)
        try:  # the FX graph cache would hand a compiled graph back without generating (and showing) its wrapper
            with tracing(TracingContext(mode)), torch._inductor.config.patch(fx_graph_cache=False):
                compile_fx_inner(graph, inputs)
        except Exception:
            if not wrapper:  # raised before the wrapper was written: inductor's own error (inductor wraps ours)
                raise
        finally:
            GraphLowering.save_output_code = saved
    if not wrapper:
        raise RuntimeError("inductor generated no wrapper for a graph")
    return wrapper[0]


# graph code and input layouts -> (its wrapper's plan or None, why inductor failed or ""): a model's identical layers
# (`compile:scope=layers`) are compiled once
_PLANS: dict[tuple, tuple[WrapperPlan | None, str]] = {}


def _plan_of(gm: torch.fx.GraphModule, example_inputs: list) -> tuple[WrapperPlan | None, str]:
    """`wrapper_plan` of inductor's code for `gm`, once per graph code and input layout; (None, "") for a graph whose
    wrapper gets a buffer otherwise, (None, why) where inductor could not compile it here."""
    # as text: a recompiled graph's sizes may be symbolic (SymInts hash only once they are known)
    key = (gm.code, tuple(repr((t.shape, t.stride(), t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
                          for t in example_inputs))
    if key not in _PLANS:
        try:
            _PLANS[key] = wrapper_plan(wrapper_code(gm, example_inputs)), ""
        except Exception as error:  # noqa: BLE001 - inductor could not compile it here: the partition, eagerly
            _PLANS[key] = None, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    return _PLANS[key]


def _replayed(gm: torch.fx.GraphModule, example_inputs: list):
    """The boxed callable AOTAutograd runs for `gm`: its wrapper's memory plan where inductor's wrapper allocates
    every buffer, else `gm` on eager kernels."""
    from torch._dynamo.backends.debugging import boxed_nop

    if not any(node.op == "call_function" for node in gm.graph.nodes):
        return boxed_nop(gm, example_inputs)  # nothing to compute (inductor generates no wrapper for it)
    plan, why = _plan_of(gm, example_inputs)
    if why:
        warnings.warn(f"inductor could not compile a graph on the CPU for its memory plan ({why}): predicted as its "
                      "partition on eager kernels", stacklevel=2)
    if plan is None:
        return boxed_nop(gm, example_inputs)  # each input freed at its last use, as inductor's wrapper frees it

    def run(args: list):
        device = next((t.device for t in args if isinstance(t, torch.Tensor)), torch.device("cpu"))
        with one_fused_kernel():  # the graph's arithmetic: one kernel's, its intermediates no memory
            outputs = gm(*args)
        buffers: dict[str, torch.Tensor] = {}
        for kind, name, size in plan.events:
            if kind == "alloc":
                buffers[name] = torch.empty(size, dtype=torch.uint8, device=device)
            elif kind == "free":
                buffers.pop(name, None)
            else:
                args[name] = None  # the wrapper's `del` of an input: the caller's list is its last holder
        buffers.clear()  # the returned buffers: the outputs below, counted from here
        args.clear()
        made_now(t for t in outputs if isinstance(t, torch.Tensor))
        return outputs

    run._boxed_call = True  # AOTAutograd calls it with its argument list, which it may clear (as inductor's does)
    return run


def _inductor_partition(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partition (`torch._inductor.compile_fx.partition_fn`): its joint-graph passes (pattern rewrites,
    random operators replaced by seeds), then the min-cut. The passes' patterns are traced once a process, for the
    CPU and outside the engine's modes: for CUDA they would make example tensors on the device, which the fake-CUDA
    environment's stub libraries cannot."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.fx_passes import joint_graph

    with _disable_current_modes():
        joint_graph.lazy_init(torch.device("cpu"))
    # without constant folding, which runs the constants' operators for real (on the fake-CUDA stubs they cannot)
    with torch._inductor.config.patch(joint_graph_constant_folding=False):
        gm = _recursive_joint_graph_passes(gm, skip_invoke_subgraph=True, input_device=torch.device("cpu"))
    return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)


@functools.cache
def predicted_inductor():
    """The torch.compile backend a prediction runs for inductor (see the module)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import select_decomp_table
    from torch._inductor.virtualized import V

    compile_graph = aot_autograd(fw_compiler=_replayed, bw_compiler=_replayed, decompositions=select_decomp_table(),
                                 partition_fn=_inductor_partition)

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        with V.set_fake_mode(detect_fake_mode(example_inputs)):  # as compile_fx sets it for its passes
            return compile_graph(gm, example_inputs)

    return backend
