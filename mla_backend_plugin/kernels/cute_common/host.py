"""Host-side helpers of the CuTe-DSL families that must work without the DSL installed."""

from __future__ import annotations

import functools
import importlib.util

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE

# The split kernels' fused-combine modes (their ``fuse_combine`` argument; 0: the combine kernel merges after
# them; cute_common/epilogue.py ``fused_combine``)
COOPERATIVE = 1  # every CTA of a request merges a slice of its rows once all are written (one wave only)
LAST_CTA = 2  # the request's last CTA to finish merges every row; the others do not wait (any grid)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", FP8_DTYPE: "fp8"}


@functools.cache
def dsl_missing() -> str | None:
    """None when the DSL can compile here; else what is missing (prebuilt libraries may still run)."""
    for mod, dist in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"),
                      ("cuda.bindings", "cuda-python")):
        try:
            if importlib.util.find_spec(mod) is not None:
                continue
        except (ImportError, ValueError):
            pass
        return f"Python package {mod!r} is not installed (pip install {dist})"
    return None


def aligned_rows_reason(args, outputs: bool = False) -> str | None:
    """TMA descriptors and 16-byte vector loads need 16-byte aligned rows of q and the cache; with ``outputs``,
    also of ``out`` (a kernel whose epilogue writes whole output rows with 16-byte stores asks)."""
    tensors = [("kv_cache", args.kv_cache), ("q_nope", args.q_nope), ("q_pe", args.q_pe)]
    if outputs:
        tensors.append(("out", args.out))
    for name, t in tensors:
        if t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
            return f"{name} needs 16-byte aligned rows (strides {t.stride()}, {t.element_size()}-byte elements)"
    return None


def scale_launch_args(args, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(q_scale tensor, kv_scale tensor, q_scale value, kv_scale value) as the compiled kernels take them: a
    scale given as a device tensor is read in the kernel (its value argument is 1), one given as a float is a
    value (its tensor argument is ``dummy``, never read). Shapes are (1,) (prepare_args)."""
    q_t = args.q_scale if isinstance(args.q_scale, torch.Tensor) else dummy
    kv_t = args.kv_scale if isinstance(args.kv_scale, torch.Tensor) else dummy
    q_v = 1.0 if args.q_scale is None or isinstance(args.q_scale, torch.Tensor) else float(args.q_scale)
    kv_v = 1.0 if args.kv_scale is None or isinstance(args.kv_scale, torch.Tensor) else float(args.kv_scale)
    return q_t, kv_t, q_v, kv_v


def current_cu_stream(device: torch.device):
    """The device's current CUDA stream as the compiled CuTe functions take it. The raw handle comes from the call
    Triton's launcher uses too: ``torch.cuda.current_stream(device)`` builds a Stream object per call, which costs
    an eager decode (once per layer) several microseconds for nothing."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch._C._cuda_getCurrentRawStream(device.index))
