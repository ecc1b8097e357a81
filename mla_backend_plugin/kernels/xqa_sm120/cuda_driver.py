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
# cuda.h enums of cuTensorMapEncodeTiled
CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
CU_TENSOR_MAP_DATA_TYPE_UINT16 = 1
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_32B = 0, 1
CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_SWIZZLE_128B = 2, 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zeros
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64


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
                "cuTensorMapEncodeTiled": [vp, ctypes.c_int, ctypes.c_uint, vp, ctypes.POINTER(ctypes.c_uint64),
                                           ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint),
                                           ctypes.POINTER(ctypes.c_uint), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int],
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


class TensorMap:
    """A CUtensorMap (128 opaque bytes, 64-byte aligned as the driver requires) encoded by cuTensorMapEncodeTiled.

    ``param`` is a ctypes object over the aligned bytes, to pass by value as a ``const __grid_constant__
    CUtensorMap`` kernel parameter (``launch(..., params=[struct, tmap.param])``). The map holds the global
    address: it stays valid as long as that memory does, and a CUDA graph that captured a launch keeps its own
    copy of the bytes (kernel parameters are captured by value).
    """

    def __init__(self, data_type: int, global_address: int, dims, strides_bytes, box, swizzle: int,
                 l2_promotion: int = CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 oob_fill: int = CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE):
        rank = len(dims)
        if not (len(strides_bytes) == rank - 1 and len(box) == rank):
            raise ValueError(f"tensor map of rank {rank} needs {rank - 1} strides and {rank} box sizes")
        self.dims, self.strides, self.box, self.swizzle = tuple(dims), tuple(strides_bytes), tuple(box), swizzle
        self._buf = ctypes.create_string_buffer(TENSOR_MAP_BYTES + TENSOR_MAP_ALIGN)
        addr = ctypes.addressof(self._buf)
        addr += -addr % TENSOR_MAP_ALIGN
        self.param = (ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8)).from_address(addr)
        lib = _lib()
        u64, u32 = ctypes.c_uint64, ctypes.c_uint
        _check(lib, lib.cuTensorMapEncodeTiled(
            ctypes.c_void_p(addr), data_type, rank, ctypes.c_void_p(global_address), (u64 * rank)(*dims),
            (u64 * max(rank - 1, 1))(*strides_bytes), (u32 * rank)(*box), (u32 * rank)(*([1] * rank)),
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2_promotion, oob_fill),
            f"cuTensorMapEncodeTiled(dims={list(dims)}, strides={list(strides_bytes)}, box={list(box)}, "
            f"swizzle={swizzle})")

    def raw(self) -> bytes:
        return bytes(self.param)
