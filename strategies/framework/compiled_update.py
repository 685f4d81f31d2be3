"""The memory of torchao's compiled optimizer update: the buffers inductor's generated code allocates for it.

torchao's low-bit AdamW runs each parameter's update (`torchao.optim.adam.single_param_adam`) through
`torch.compile(fullgraph=True, dynamic=False)`. Inductor fuses the arithmetic into a few kernels; what the caching
allocator sees is the buffers its generated wrapper allocates (`empty_strided_*`) between them. For AdamW8bit over a
bfloat16 parameter those are the new float32 moments (both read by the blockwise absmax reduction and by the weight's
update: 2 x 4 bytes a value) and their block scales; AdamW4bit adds their int64 codes before packing (2 x 8 bytes a
value). An H200 measured exactly these blocks at the peak of such a step (results/reference/gpu/h200-20261127).

On fake tensors the update cannot be compiled (predict runs it eagerly, `torch.compiler.set_stance("force_eager")`),
and eager arithmetic allocates other temporaries (+50% on torchao's 7B anchor at 2 layers). So the prediction makes
and frees the compiled wrapper's buffers in its order, then runs the update as one kernel (`memory_categories.one_fused_kernel`:
the state written in place, nothing of its own counted). The buffers are read from inductor itself: the same update
compiled on the CPU for a small parameter of the same dtype and state layout, at two sizes, its wrapper's allocations
and frees in order (`wrapper_events`), each buffer's bytes a line through its two sizes. CPU and CUDA wrappers
allocate the same buffers for this update (the H200's blocks equal the CPU code's).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from typing import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from bench.core.memory_categories import one_fused_kernel
from bench.core.quiet_import import import_torchao

BUFFER = re.compile(r"^\s*(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")
# a buffer handed over to another name: `buf6 = buf5; del buf5  # reuse`, or as a view of it (`reinterpret_tensor`)
REUSE = re.compile(r"^\s*(\w+) = (?:reinterpret_tensor\()?(\w+)(?:,[^;]*\))?; del (\w+)\s*# reuse")
DELETE = re.compile(r"^\s*del (\w+)\s*$")
# the two calibration sizes: multiples of every low-bit block size (torchao quantizes a parameter of at least 4096
# values whose size its block divides), and sizes below 4096 for the parameters it keeps in float32
QUANTIZED_SIZES = (256 * 1024, 512 * 1024)
FLOAT32_SIZES = (1024, 2048)


def wrapper_events(code: str) -> list[tuple[str, str, int]]:
    """The buffers the generated wrapper's `call` allocates and frees, in order: ("alloc" or "free", the name it was
    made as, bytes). Its `empty_strided` allocations, `# reuse` hand-overs (no event: the storage takes another name)
    and `del`s; what is still held when it returns is freed then, in the order it was made."""
    body = code[code.index("def call("):]
    live: dict[str, tuple[str, int]] = {}  # a name in the code -> (the buffer it was made as, its bytes)
    events: list = []
    for line in body.splitlines()[1:]:
        if line.strip().startswith("return"):
            break
        if not read_buffer_line(line, live, events) and (match := DELETE.match(line)) and match[1] in live:
            events.append(("free", *live.pop(match[1])))
    return events + [("free", *buffer) for buffer in live.values()]


def read_buffer_line(line: str, live: dict[str, tuple[str, int]], events: list) -> bool:
    """Whether `line` of a wrapper makes a buffer (recorded in `live` under its name and in `events` as ("alloc",
    name, bytes)) or hands one over to another name (`live` updated); False for any other line."""
    if match := REUSE.match(line):
        if match[2] in live:
            live[match[1]] = live.pop(match[2])
        return True
    if match := BUFFER.match(line):
        shape = [int(size) for size in match[2].split(",") if size.strip()]
        live[match[1]] = (match[1], math.prod(shape) * getattr(torch, match[3]).itemsize)
        events.append(("alloc", *live[match[1]]))
        return True
    return False


def peak_bytes(events: list[tuple[str, str, int]]) -> int:
    """The most bytes held at once over `events`."""
    total = peak = 0
    for kind, _, size in events:
        total += size if kind == "alloc" else -size
        peak = max(peak, total)
    return peak


def compiled_buffer_plan(optimizer_class: type, dtype: torch.dtype, quantized: bool
                         ) -> tuple[tuple[str, str, float, float], ...]:
    """The compiled update's buffers for a parameter of `dtype` whose moments `optimizer_class` quantizes
    (`quantized`) or keeps in float32: each event of its wrapper (kind, buffer, bytes per value, constant bytes), from
    inductor's wrapper for that update compiled on the CPU at two sizes (`wrapper_events`), a line through each
    buffer's two sizes."""
    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import _disable_current_modes

    sizes = QUANTIZED_SIZES if quantized else FLOAT32_SIZES
    plans = []
    with _disable_current_modes(), torch.compiler.set_stance("default"):
        for size in sizes:
            param = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
            param.grad = torch.zeros_like(param)
            _, codes = run_and_get_code(optimizer_class([param], lr=1e-3).step)
            plans.append([event for code in codes if "def call(" in code for event in wrapper_events(code)])
    small, large = plans
    if [(kind, name) for kind, name, _ in small] != [(kind, name) for kind, name, _ in large]:
        raise RuntimeError("inductor's wrapper for the update differs between two parameter sizes")
    plan = []
    for (kind, name, first), (_, _, second) in zip(small, large):
        per_value = (second - first) / (sizes[1] - sizes[0])
        plan.append((kind, name, per_value, first - per_value * sizes[0]))
    return tuple(plan)


@functools.lru_cache(maxsize=None)
def cached_plan(optimizer_class: type, dtype: torch.dtype, quantized: bool) -> tuple[tuple | None, str | None]:
    """`compiled_buffer_plan` once per optimizer, dtype and layout: (the plan, None), or (None, why inductor could
    not compile the update on the CPU), so that a machine without a C++ compiler tries once, not per parameter."""
    try:
        return compiled_buffer_plan(optimizer_class, dtype, quantized), None
    except Exception as error:  # noqa: BLE001 - any failure of inductor here: the update is predicted eagerly
        return None, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def compiled_buffer_events(optimizer_class: type, param: torch.Tensor, exp_avg: torch.Tensor
                           ) -> list[tuple[str, str, int]] | None:
    """The compiled update's buffer events for `param`, or None (with a warning) where inductor could not compile
    it here; `exp_avg` (its first moment) says the state's layout: torchao's quantized state is a tensor subclass,
    the float32 state of a small parameter a plain (fake) tensor."""
    quantized = type(exp_avg) not in (torch.Tensor, FakeTensor)
    plan, why = cached_plan(optimizer_class, param.dtype, quantized)
    if plan is None:
        warnings.warn(f"torchao's compiled update could not be read from inductor on the CPU ({why}): predicted "
                      f"eagerly, which counts temporaries the compiled update does not make (an over-estimate)",
                      stacklevel=3)
        return None
    return [(kind, name, max(0, round(per_value * param.numel() + constant)))
            for kind, name, per_value, constant in plan]


@contextlib.contextmanager
def update_as_compiled(optimizer_class: type) -> Iterator[None]:
    """While entered (around a step on fake tensors only: torch.compile would trace this wrapper on real ones), each
    call of torchao's `single_param_adam` runs as the compiled update's memory: the wrapper's buffers
    (`compiled_buffer_events`) made and freed on the parameter's device, then the update in place as one kernel."""
    adam = import_torchao("torchao.optim.adam")
    update: Callable | None = getattr(adam, "single_param_adam", None)
    if update is None:
        yield
        return

    def as_compiled(p, grad, step, exp_avg, *args, **kwargs):
        adam.single_param_adam = update  # the calibration compiles torchao's own function
        try:
            events = compiled_buffer_events(optimizer_class, p, exp_avg)
        finally:
            adam.single_param_adam = as_compiled
        if events is None:
            return update(p, grad, step, exp_avg, *args, **kwargs)
        # the wrapper's buffers, made and freed in its order (the update's in-place writes change no sizes, so it
        # runs after them, as one kernel)
        buffers = {}
        for kind, name, size in events:
            if kind == "alloc":
                buffers[name] = torch.empty(size, dtype=torch.uint8, device=p.device)
            else:
                buffers.pop(name, None)
        with one_fused_kernel():
            return update(p, grad, step, exp_avg, *args, **kwargs)

    adam.single_param_adam = as_compiled
    try:
        yield
    finally:
        adam.single_param_adam = update
