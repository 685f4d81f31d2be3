"""What each stub CUDA library of the fake-CUDA environment says: its C source (the calls answered with success, the
device it describes, a "not supported" error from every other function) and its linker version script.
bench.measure.cuda_stubs reads which libraries and symbols torch imports and compiles these.
"""

from __future__ import annotations

from collections import defaultdict

# The "not supported" status of each library (what a stub that is not in ANSWERS returns), from each library's
# header: cudaErrorNotSupported, CUDA_ERROR_NOT_SUPPORTED, CUBLAS_STATUS_NOT_SUPPORTED, CUDNN_STATUS_NOT_SUPPORTED
# (cuDNN 9), CUFFT_NOT_SUPPORTED, CURAND_STATUS_NOT_INITIALIZED, CUSOLVER_STATUS_NOT_SUPPORTED,
# CUSPARSE_STATUS_NOT_SUPPORTED, ncclInvalidUsage, NVRTC_ERROR_INTERNAL_ERROR, CUPTI_ERROR_NOT_SUPPORTED.
ERROR_CODES = {
    "libcudart": 801, "libcuda": 801, "libcublas": 15, "libcublasLt": 15, "libcudnn": 3000, "libcufft": 16,
    "libcurand": 201, "libcusolver": 7, "libcusparse": 10, "libcusparseLt": 10, "libnccl": 5, "libnvrtc": 11,
    "libcupti": 27,
}
DEFAULT_ERROR_CODE = 1

# Calls answered with success: one device (index 0), its primary context active, no stream capture, the library
# versions torch was built against (filled in from torch's pinned dependencies), synchronisation that returns at
# once. Each body may use {versions}. Signatures as in the CUDA 12/13 headers; pointers as void*.
ANSWERS = {
    # CUDA runtime
    "cudaGetDeviceCount": "int cudaGetDeviceCount(int *count) { *count = 1; return 0; }",
    "cudaGetDevice": "int cudaGetDevice(int *device) { *device = 0; return 0; }",
    "cudaSetDevice": "int cudaSetDevice(int device) { return device == 0 ? 0 : 101; }",  # cudaErrorInvalidDevice
    "cudaInitDevice": "int cudaInitDevice(int device, unsigned a, unsigned b) { return device == 0 ? 0 : 101; }",
    "cudaGetLastError": "int cudaGetLastError(void) { return 0; }",
    "cudaPeekAtLastError": "int cudaPeekAtLastError(void) { return 0; }",
    "cudaGetErrorString": 'const char *cudaGetErrorString(int e) { return "membench fake CUDA: not supported"; }',
    "cudaGetErrorName": 'const char *cudaGetErrorName(int e) { return "membenchFakeCudaNotSupported"; }',
    "cudaRuntimeGetVersion": "int cudaRuntimeGetVersion(int *v) { *v = {cuda_version}; return 0; }",
    "cudaDriverGetVersion": "int cudaDriverGetVersion(int *v) { *v = {cuda_version}; return 0; }",
    "cudaDeviceSynchronize": "int cudaDeviceSynchronize(void) { return 0; }",
    "cudaStreamSynchronize": "int cudaStreamSynchronize(void *stream) { return 0; }",
    "cudaStreamIsCapturing": "int cudaStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }",
    "cudaStreamGetCaptureInfo": ("int cudaStreamGetCaptureInfo(void *stream, int *status, unsigned long long *id,"
                                 " void *a, void *b, void *c, void *d) { *status = 0; if (id) *id = 0; return 0; }"),
    "cudaThreadExchangeStreamCaptureMode": "int cudaThreadExchangeStreamCaptureMode(int *mode) { return 0; }",
    # cudaDevAttrMultiProcessorCount 16, ComputeCapabilityMajor 75 and Minor 76 as PROPERTIES says; others 0
    "cudaDeviceGetAttribute": ("int cudaDeviceGetAttribute(int *value, int attr, int device)"
                               " { *value = attr == 16 ? 132 : attr == 75 ? 9 : 0; return 0; }"),
    "cudaGetDeviceProperties": "int cudaGetDeviceProperties(void *prop, int device) { return fake_properties(prop); }",
    "cudaGetDeviceProperties_v2": ("int cudaGetDeviceProperties_v2(void *prop, int device)"
                                   " { return fake_properties(prop); }"),
    "cudaDeviceCanAccessPeer": "int cudaDeviceCanAccessPeer(int *can, int a, int b) { *can = 0; return 0; }",
    "cudaFree": "int cudaFree(void *pointer) { return 0; }",  # cudaFree(0) is how torch creates a context
    "cudaDeviceGetStreamPriorityRange": ("int cudaDeviceGetStreamPriorityRange(int *least, int *greatest)"
                                         " { if (least) *least = 0; if (greatest) *greatest = -5; return 0; }"),
    # streams and events (FSDP2 all-gathers on its own streams, synchronised by events; DDP's reducer times its
    # steps with events): distinct non-null handles, work always complete, every interval 0 ms (no kernel runs)
    "cudaStreamCreate": ("int cudaStreamCreate(void **stream)"
                         " { static unsigned long made; *stream = (void *)(0x1000 + 16 * ++made); return 0; }"),
    "cudaStreamCreateWithFlags": ("int cudaStreamCreateWithFlags(void **stream, unsigned flags)"
                                  " { static unsigned long made; *stream = (void *)(0x100000 + 16 * ++made);"
                                  " return 0; }"),
    "cudaStreamCreateWithPriority": ("int cudaStreamCreateWithPriority(void **stream, unsigned flags, int priority)"
                                     " { static unsigned long made; *stream = (void *)(0x200000 + 16 * ++made);"
                                     " return 0; }"),
    "cudaStreamGetPriority": "int cudaStreamGetPriority(void *stream, int *priority) { *priority = 0; return 0; }",
    "cudaStreamDestroy": "int cudaStreamDestroy(void *stream) { return 0; }",
    "cudaStreamQuery": "int cudaStreamQuery(void *stream) { return 0; }",
    "cudaStreamWaitEvent": "int cudaStreamWaitEvent(void *stream, void *event, unsigned flags) { return 0; }",
    "cudaEventCreate": ("int cudaEventCreate(void **event)"
                        " { static unsigned long made; *event = (void *)(0x1000 + 16 * ++made); return 0; }"),
    "cudaEventCreateWithFlags": ("int cudaEventCreateWithFlags(void **event, unsigned flags)"
                                 " { static unsigned long made; *event = (void *)(0x100000 + 16 * ++made);"
                                 " return 0; }"),
    "cudaEventRecord": "int cudaEventRecord(void *event, void *stream) { return 0; }",
    "cudaEventRecordWithFlags": "int cudaEventRecordWithFlags(void *event, void *stream, unsigned flags) { return 0; }",
    "cudaEventQuery": "int cudaEventQuery(void *event) { return 0; }",
    "cudaEventSynchronize": "int cudaEventSynchronize(void *event) { return 0; }",
    "cudaEventDestroy": "int cudaEventDestroy(void *event) { return 0; }",
    "cudaEventElapsedTime": "int cudaEventElapsedTime(float *ms, void *start, void *end) { *ms = 0; return 0; }",
    # kernels and device variables register at load time; nothing to keep
    "__cudaRegisterFatBinary": "void **__cudaRegisterFatBinary(void *binary) { return 0; }",
    "__cudaRegisterFatBinaryEnd": "void __cudaRegisterFatBinaryEnd(void **handle) { }",
    "__cudaUnregisterFatBinary": "void __cudaUnregisterFatBinary(void **handle) { }",
    "__cudaRegisterFunction": "void __cudaRegisterFunction(void) { }",
    "__cudaRegisterVar": "void __cudaRegisterVar(void) { }",
    # CUDA driver: the primary context of device 0 is active (the autograd engine asks before running backward)
    "cuDevicePrimaryCtxGetState": ("int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active)"
                                   " { if (flags) *flags = 0; *active = device == 0; return 0; }"),
    "cuDriverGetVersion": "int cuDriverGetVersion(int *v) { *v = {cuda_version}; return 0; }",
    "cuInit": "int cuInit(unsigned flags) { return 0; }",
    "cuGetErrorString": ('int cuGetErrorString(int e, const char **s)'
                         ' { *s = "membench fake CUDA: not supported"; return 0; }'),
    # libraries' version queries, which torch compares with the versions it was built with
    "cudnnGetVersion": "unsigned long cudnnGetVersion(void) { return {cudnn_version}; }",
    "cudnnGetProperty": ("int cudnnGetProperty(int type, int *value) { *value = type == 0 ? {cudnn_major}"
                         " : type == 1 ? {cudnn_minor} : {cudnn_patch}; return 0; }"),  # MAJOR, MINOR, PATCH_LEVEL
    "cudnnGetCudartVersion": "unsigned long cudnnGetCudartVersion(void) { return {cuda_version}; }",
    "cudnnGetErrorString": 'const char *cudnnGetErrorString(int e) { return "membench fake cuDNN: not supported"; }',
    "ncclGetVersion": "int ncclGetVersion(int *v) { *v = {nccl_version}; return 0; }",
    "ncclGetErrorString": 'const char *ncclGetErrorString(int e) { return "membench fake NCCL: not supported"; }',
    "ncclGetLastError": 'const char *ncclGetLastError(void *comm) { return "membench fake NCCL: not supported"; }',
    "nvrtcGetErrorString": 'const char *nvrtcGetErrorString(int e) { return "membench fake NVRTC: not supported"; }',
    "cublasGetStatusString": 'const char *cublasGetStatusString(int e) { return "membench fake cuBLAS: not supported"; }',
    "cublasLtGetStatusString": ('const char *cublasLtGetStatusString(int e)'
                                ' { return "membench fake cuBLASLt: not supported"; }'),
    "cusparseGetErrorString": ('const char *cusparseGetErrorString(int e)'
                               ' { return "membench fake cuSPARSE: not supported"; }'),
}

# The device the stubs describe: an H100-like card (compute capability 9.0, 132 SMs, 80 GiB), so that torch picks
# the code paths of a current GPU (cuDNN, SDPA's backends, float16 autocast). Only the first fields of
# cudaDeviceProp are written, laid out as in CUDA 13's driver_types.h (CUDA 12 had clockRate before totalConstMem):
# `build` refuses another CUDA major version. The caller's struct is zero-filled.
DEVICE_PROPERTIES_CUDA_MAJOR = 13
PROPERTIES = """
#include <stddef.h>
struct fake_device_prop {
    char name[256]; char uuid[16]; char luid[8]; unsigned luidDeviceNodeMask;
    size_t totalGlobalMem, sharedMemPerBlock; int regsPerBlock, warpSize; size_t memPitch;
    int maxThreadsPerBlock, maxThreadsDim[3], maxGridSize[3]; size_t totalConstMem;
    int major, minor; size_t textureAlignment, texturePitchAlignment; int multiProcessorCount;
};

static int fake_properties(struct fake_device_prop *prop) {
    strcpy(prop->name, "membench fake CUDA device");
    prop->totalGlobalMem = 80ULL << 30;
    prop->sharedMemPerBlock = 48 << 10;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024; prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 2147483647; prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->totalConstMem = 64 << 10;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    return 0;
}
"""

PRELUDE = """/* generated by bench/measure/cuda_stubs.py for torch {torch_version}: a stub of {soname} */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void trace(const char *name) {{
    if (getenv("MEMBENCH_FAKE_CUDA_TRACE")) fprintf(stderr, "membench fake CUDA: %s\\n", name);
}}
"""


def c_source(soname: str, symbols: dict[str, tuple[str | None, str]], numbers: dict[str, int],
             torch_version: str) -> str:
    """The C source of one stub library: ANSWERS where they apply, an error-returning function for the rest."""
    error = ERROR_CODES.get(soname.split(".so")[0], DEFAULT_ERROR_CODE)
    parts = [PRELUDE.format(torch_version=torch_version, soname=soname)]
    answered = [name for name in symbols if name in ANSWERS]
    if any("Properties" in name for name in answered):
        parts.append(PROPERTIES)
    for name in sorted(symbols):
        kind = symbols[name][1]
        if kind == "OBJECT":
            parts.append(f"char {name}[256];")
        elif name in ANSWERS:
            body = ANSWERS[name]
            for key, value in numbers.items():
                body = body.replace("{" + key + "}", str(value))
            if not name.startswith("__cudaRegister") and not name.startswith("__cudaUnregister"):
                head, brace, rest = body.partition("{")  # the trace call goes first in the body
                body = f'{head}{brace} trace("{name}");{rest}'
            parts.append(body)
        else:
            parts.append(f'int {name}(void) {{ trace("{name}"); return {error}; }}')
    return "\n".join(parts) + "\n"


def version_script(symbols: dict[str, tuple[str | None, str]]) -> str | None:
    """The linker version script that gives the symbols their version tag (None when torch imports them untagged)."""
    tags = defaultdict(list)
    for name, (version, _) in symbols.items():
        if version:
            tags[version].append(name)
    if not tags:
        return None
    return "".join(f"{tag} {{ global: {'; '.join(sorted(names))}; }};\n" for tag, names in sorted(tags.items()))
