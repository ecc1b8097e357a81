"""Minimal CUDA driver-API access through ctypes: load a cubin and launch its kernels on torch's stream.

Nothing here links against torch's C++ ABI or needs a compiler at import time, so a cubin built by nvcc for one
architecture can be launched from any torch version. Kept generic: any CUDA C++ kernel of this package whose
parameters are one by-value struct (or a list of scalars/pointers) can use ``CudaModule`` and ``launch``.

Contexts: modules belong to a CUDA context; we use the device's primary context, the one torch's runtime API
uses, so device pointers from torch tensors are valid in it. ``current_context`` makes it current on the
calling thread if no context is (a thread that never touched the runtime API).
"""

from __future__ import annotations

import ctypes
import threading

CUDA_SUCCESS = 0
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class CudaDriverError(RuntimeError):
    pass


class CUlaunchAttribute(ctypes.Structure):
    # cuda.h: { CUlaunchAttributeID id; char pad[8 - sizeof(id)]; CUlaunchAttributeValue value; }, where the
    # value is a 64-byte union; programmaticStreamSerializationAllowed is its first int.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(CUlaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_LIB = None
_LIB_LOCK = threading.Lock()


def _lib():
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise CudaDriverError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from e
            vp, pp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
            signatures = {
                "cuInit": [ctypes.c_uint],
                "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
                "cuCtxGetCurrent": [pp],
                "cuCtxSetCurrent": [vp],
                "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
                "cuDevicePrimaryCtxRetain": [pp, ctypes.c_int],
                "cuModuleLoadData": [pp, ctypes.c_char_p],
                "cuModuleGetFunction": [pp, vp, ctypes.c_char_p],
                "cuFuncSetAttribute": [vp, ctypes.c_int, ctypes.c_int],
                "cuLaunchKernelEx": [ctypes.POINTER(CUlaunchConfig), vp, pp, pp],
            }
            for name, argtypes in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            _check(lib, lib.cuInit(0), "cuInit")
            _LIB = lib
        return _LIB


def _check(lib, res: int, what: str) -> None:
    if res != CUDA_SUCCESS:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(res, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise CudaDriverError(f"{what} failed: CUDA error {res} ({text})")


def current_context(device_index: int) -> int:
    """The current CUDA context (as an int handle); the device's primary context is made current if none is.

    The caller must already have selected ``device_index`` in torch (``torch.cuda.device``), so that the
    current context, when there is one, is that device's primary context.
    """
    lib = _lib()
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx.value


class CudaModule:
    """A cubin loaded into one context, with its kernels looked up by (unmangled) name."""

    def __init__(self, image: bytes, context: int):
        self.context = context
        self._image = image  # the driver may keep referring to it until the module is loaded; keep it alive
        lib = _lib()
        mod = ctypes.c_void_p()
        _check(lib, lib.cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        self.handle = mod.value
        self._functions: dict[str, int] = {}

    def function(self, name: str, max_dynamic_smem: int = 0) -> int:
        fn = self._functions.get(name)
        if fn is None:
            lib = _lib()
            f = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(f), ctypes.c_void_p(self.handle), name.encode()),
                   f"cuModuleGetFunction({name})")
            if max_dynamic_smem > 48 * 1024:  # above 48 KB a kernel must opt in
                _check(lib, lib.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   max_dynamic_smem),
                       f"cuFuncSetAttribute({name}, max dynamic smem {max_dynamic_smem})")
            fn = self._functions[name] = f.value
        return fn


def launch(function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
           stream: int, params, pdl: bool = False) -> None:
    """cuLaunchKernelEx of ``function``.

    ``params``: a ctypes object passed by value as the kernel's only parameter (a ``ctypes.Structure``
    mirroring a C struct), or a list of ctypes objects, one per kernel parameter. ``pdl`` adds the
    programmatic-stream-serialization attribute (programmatic dependent launch: the kernel may start before
    its predecessor in the stream finishes and must ``griddepcontrol.wait`` before reading its results).
    """
    lib = _lib()
    objs = list(params) if isinstance(params, (list, tuple)) else [params]
    arg_ptrs = (ctypes.c_void_p * len(objs))(*[ctypes.cast(ctypes.pointer(o), ctypes.c_void_p) for o in objs])
    attrs = (CUlaunchAttribute * 1)()
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value[0] = 1
    cfg = CUlaunchConfig(grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_bytes,
                         ctypes.c_void_p(stream), attrs if pdl else None, 1 if pdl else 0)
    _check(lib, lib.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(function),
                                     ctypes.cast(arg_ptrs, ctypes.POINTER(ctypes.c_void_p)), None),
           "cuLaunchKernelEx")
