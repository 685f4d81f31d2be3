"""Which kernel CUDA's scaled_dot_product_attention runs for a call (flash, efficient, cudnn or math), and a mode that
makes a step on fake CUDA tensors run that kernel and names it.

PyTorch picks the kernel of each `F.scaled_dot_product_attention` call at run time (`select_sdp_backend` in
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): it tries the backends in its priority order and takes the
first whose checks pass. `chosen_kernel` follows it:
- the order is flash, memory-efficient, math, cuDNN; cuDNN comes first on compute capability 9.x and 10.x when the
  runtime cuDNN is newer than 9.15.0 (`check_prefer_cudnn_attention`; TORCH_CUDNN_SDPA_DEPRIORITIZED=1 turns that
  off);
- each fused backend's own checks (dtypes, head dimension, grouped-query attention, mask, dropout, alignment,
  layout) are PyTorch's, run through `torch.backends.cuda.can_use_flash_attention`, `can_use_efficient_attention`
  and `can_use_cudnn_attention` for the device this torch sees;
- the hardware ranges are applied for the capability asked for: flash and cuDNN on sm80 to sm121, memory-efficient
  on sm50 to sm121 (`check_flash_attention_hardware_support`, `check_mem_efficient_hardware_support`).
Limitations: where the capability asked for differs from the device torch sees (the fake-CUDA environment's stubs
describe compute capability 9.0), only the hardware ranges and the cuDNN preference follow the capability; the
checks that also depend on it inside PyTorch (cuDNN's head-dimension limit on sm90/sm10x, flash's head dimensions
above 192 in training on sm86-89 and sm120) are those of the device torch sees.

`SdpaKernelChoice` is a TorchFunctionMode: inside it, each CUDA call of `F.scaled_dot_product_attention` runs under
`torch.nn.attention.sdpa_kernel([the chosen backend])`, so that a fake-tensor step allocates what that kernel
allocates (its output, logsumexp, and in backward its gradients), and the names are kept in `kernels`. Under CUDA's
autocast the inputs are first cast as autocast casts them (the operator is on its lower-precision list: a model
whose rotary embedding hands it float32 queries and keys runs it in float16), and the kernel is chosen for those.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

KERNEL_NAMES = ("flash", "efficient", "cudnn", "math")
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # at::Context's default sdp priority order
CUDNN_PREFERRED_ABOVE = 91500  # cuDNN 9.15.0: check_prefer_cudnn_attention
# the compute capabilities each fused kernel runs on (sdp_utils.cpp's hardware checks), inclusive
HARDWARE_RANGES = {"flash": ((8, 0), (12, 1)), "efficient": ((5, 0), (12, 1)), "cudnn": ((8, 0), (12, 1))}

_SDPA_SIGNATURE = inspect.Signature([
    inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
    for name, default in (("query", inspect.Parameter.empty), ("key", inspect.Parameter.empty),
                          ("value", inspect.Parameter.empty), ("attn_mask", None), ("dropout_p", 0.0),
                          ("is_causal", False), ("scale", None), ("enable_gqa", False))])


def priority_order(capability: tuple[int, int], cudnn_version: int | None) -> list[str]:
    """The order in which PyTorch tries the kernels on a device of `capability` with runtime cuDNN `cudnn_version`
    (e.g. 92000 for 9.20.0; None: no cuDNN)."""
    deprioritized = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes")
    if cudnn_version and cudnn_version > CUDNN_PREFERRED_ABOVE and capability[0] in (9, 10) and not deprioritized:
        return ["cudnn", "flash", "efficient", "math"]
    return list(DEFAULT_ORDER)


def runs_on(kernel: str, capability: tuple[int, int]) -> bool:
    """Whether `kernel` runs on a device of `capability` (math runs everywhere)."""
    if kernel not in HARDWARE_RANGES:
        return True
    low, high = HARDWARE_RANGES[kernel]
    return low <= tuple(capability) <= high


def _passes_checks(kernel: str, params) -> bool:
    """PyTorch's own checks of `kernel` for these SDPA parameters, on the device torch sees (debug off)."""
    check = {"flash": torch.backends.cuda.can_use_flash_attention,
             "efficient": torch.backends.cuda.can_use_efficient_attention,
             "cudnn": torch.backends.cuda.can_use_cudnn_attention}.get(kernel)
    return True if check is None else bool(check(params, False))


def chosen_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False,
                  capability: tuple[int, int] | None = None, cudnn_version: int | None = None) -> str:
    """The kernel CUDA runs for this call on a device of `capability` (default: the device torch sees) with cuDNN
    `cudnn_version` (default: this torch's): the first of `priority_order` that runs there and passes its checks."""
    capability = tuple(capability or torch.cuda.get_device_capability(0))
    cudnn_version = cudnn_version if cudnn_version is not None else torch.backends.cudnn.version()
    params = torch.backends.cuda.SDPAParams(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                                            bool(enable_gqa))
    for kernel in priority_order(capability, cudnn_version):
        if runs_on(kernel, capability) and _passes_checks(kernel, params):
            return kernel
    return "math"


def _backend(kernel: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]


class SdpaKernelChoice(TorchFunctionMode):
    """Inside, each CUDA call of `F.scaled_dot_product_attention` runs the kernel `chosen_kernel` names for
    `capability` (default: the device torch sees), and `kernels` lists the names, one per call."""

    def __init__(self, capability: tuple[int, int] | None = None):
        super().__init__()
        self.capability = capability
        self.kernels: list[str] = []
        self._preference = None

    def __enter__(self):
        # A torch-function mode is this thread's: a call made on another thread -- a checkpoint's recomputation on
        # autograd's backward thread -- does not come here. PyTorch's backend flags and priority order are the
        # process's, so while the mode is on they say the same thing for every thread: only the kernels that run
        # on `capability`, in its priority order, up to math (which always runs: a kernel after it is never
        # reached). The recomputed call then takes the forward's kernel (flash's logsumexp and RNG state, not
        # cuDNN's, which the stubs' sm90 device would prefer), as on the GPU.
        from torch.nn.attention import sdpa_kernel

        capability = tuple(self.capability or torch.cuda.get_device_capability(0))
        order = priority_order(capability, torch.backends.cudnn.version())
        order = [k for k in order[:order.index("math") + 1] if runs_on(k, capability)]
        self._preference = sdpa_kernel([_backend(k) for k in order], set_priority=True)
        self._preference.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._preference.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _SDPA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if not (isinstance(a["query"], torch.Tensor) and a["query"].is_cuda):
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cuda"):
            # CUDA's autocast runs this operator in its lower precision: the kernel is chosen for the cast inputs.
            # The casts are made here, as autocast makes them (one copy of each floating-point input not already
            # in that dtype, float64 left alone), and autocast then has nothing left to cast.
            dtype = torch.get_autocast_dtype("cuda")
            for name in ("query", "key", "value", "attn_mask"):
                t = a[name]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64):
                    a[name] = t.to(dtype)
            args = (a["query"], a["key"], a["value"])
            kwargs = {name: value for name, value in a.items() if name not in ("query", "key", "value")}
        kernel = chosen_kernel(a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"], a["is_causal"],
                               a["enable_gqa"], self.capability)
        self.kernels.append(kernel)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([_backend(kernel)]):
            return func(*args, **kwargs)

    def summary(self) -> str:
        """The kernels used, each once, in the order first used (`math`; `cudnn,math` when calls differ)."""
        return ",".join(dict.fromkeys(self.kernels))


class SdpaCalls(TorchFunctionMode):
    """Inside, counts the calls of `F.scaled_dot_product_attention` on any device (`calls`): a CUDA step traced on
    the CPU's operators runs the CPU's attention kernel, not the one CUDA would choose, and says so."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))
