"""Registry entry points of the xqa_sm120 kernel: ``unsupported_reason(args, cc)`` and ``launch(args, workspace)``.

Importable without a GPU or nvcc. ``launch`` builds the cubin for the device's architecture on first use
(build.py), loads it with the driver API (cuda_driver.py) into torch's context, and launches the split kernel
and, when the plan splits the KV, the combine kernel on torch's current stream. Nothing is allocated and
nothing synchronises, so a call is CUDA-graph safe once the cubin is loaded (the first call, eager, loads it).

PDL (programmatic dependent launch) follows the launch config (default: ``CUTE_MLA_PDL``, on); the kernels are
correct either way (griddepcontrol.wait is a no-op without it). The split plan is the uniform one, planned for
the kernel's own 32-row tile.

The split kernels read the KV cache by TMA through a CUtensorMap (``kv_tensor_map``): a 4-D view of the cache
[pages, tokens, 9 chunks, 64 columns] with one box per page slice, swizzled. Encoding one costs a driver call,
so maps are cached by the cache tensor's (device, address, shape, strides, dtype); a captured CUDA graph keeps
the map's bytes by value, so it stays valid for as long as the cache tensor lives (vLLM's caches live for the
whole run).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.kernels.xqa_sm120 import MANIFEST, build
from mla_backend_plugin.ops.arch import arch_for_cc
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK
from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile

_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# the kernel's tile (csrc/xqa_mla/xqa_mla_params.h XQA_MLA_BLOCK_M / _N; a CPU test checks they agree)
BLOCK_M = 32
BLOCK_N = 32


class XqaMlaParams(ctypes.Structure):
    """Mirror of ``struct XqaMlaParams`` in csrc/xqa_mla/xqa_mla_params.h (same order, no padding)."""

    _fields_ = (
        [(n, ctypes.c_void_p) for n in ("q_nope", "q_pe", "kv", "block_table", "seq_lens", "row_kv_lens", "out",
                                          "lse", "part_out", "part_lse", "q_scale_ptr", "kv_scale_ptr")]
        + [(n, ctypes.c_int64) for n in ("stride_qn_t", "stride_qn_h", "stride_qp_t", "stride_qp_h",
                                         "stride_kv_blk_bytes", "stride_kv_tok_bytes", "stride_bt",
                                         "stride_o_t", "stride_o_h", "stride_lse_t", "stride_lse_h")]
        + [(n, ctypes.c_float) for n in ("q_scale_val", "kv_scale_val", "sm_scale")]
        + [(n, ctypes.c_int) for n in ("num_heads", "q_len", "page_size", "num_splits", "min_chunk", "q_fp8",
                                       "out_bf16", "out_vec2")]
    )


def arch_for(cc: tuple[int, int] | None) -> str | None:
    """The cubin's architecture for a device of compute capability ``cc`` (None: not built for it)."""
    arch = arch_for_cc(cc)
    return arch.name if arch is not None and arch.name in MANIFEST.archs else None


def default_config(args, cc) -> LaunchConfig:
    return LaunchConfig(split_plan="uniform", enable_pdl=envs.CUTE_MLA_PDL)


def configs(args, cc) -> list[LaunchConfig]:
    first = default_config(args, cc)
    return [first, LaunchConfig(split_plan="uniform", enable_pdl=not first.enable_pdl)]


def plan_tile(num_heads: int, smem_per_block, config) -> PlanTile:
    return PlanTile(rows_per_cta=BLOCK_M, block_n=BLOCK_N)


def unsupported_reason(args, cc: tuple[int, int] | None) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if arch_for(cc) is None:
        return (f"needs compute capability 9.0 or 12.x (sm_90a/sm_120a/sm_121a builds), device has "
                f"{cc[0]}.{cc[1]}")
    if build.find_nvcc() is None:
        return "nvcc not found (the kernel is compiled from CUDA C++ on first use; set CUDA_HOME or CUTE_MLA_NVCC)"
    if args.compute_dtype not in _DTYPE_NAME:
        return f"compute dtype {args.compute_dtype} not supported (bf16/fp16)"
    if args.out.dtype not in _DTYPE_NAME:
        return f"out dtype {args.out.dtype} not supported (bf16/fp16)"
    kv = args.kv_cache
    es = kv.element_size()
    if kv.data_ptr() % 16 or (kv.stride(0) * es) % 16 or (kv.stride(1) * es) % 16:
        return "kv_cache must be 16-byte aligned with 16-byte aligned page and token strides (TMA loads)"
    if kv.shape[1] not in TMA_PAGE_SIZES:
        return f"block size {kv.shape[1]} not supported (TMA page slices need one of {TMA_PAGE_SIZES})"
    return None


# Page sizes the kernel's tile of 32 keys splits into whole TMA boxes (one box of 32 rows, or two of 16).
TMA_PAGE_SIZES = (16, 32, 64, 128)
KV_COLUMN_CHUNK = 64  # columns per swizzle row: 128 B (16-bit) or 64 B (fp8), the swizzle span


def kv_tensor_map_spec(kv: torch.Tensor, block_n: int = 32) -> dict:
    """Arguments of cuTensorMapEncodeTiled for the KV cache ``[num_blocks, page_size, 576]`` (no driver needed).

    Dimensions, innermost first: 64 columns, 9 chunks of them, tokens of a page, pages. A box is one page slice
    of min(page_size, block_n) tokens x all 576 columns; it lands in shared memory as dense rows of 576
    values, each 64-column chunk swizzled (128 B swizzle for 16-bit rows, 64 B for fp8 ones) so that ldmatrix
    over 8 consecutive keys is conflict-free. Page coordinate -1 (or any out-of-range page) loads zeros.
    """
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver as cd

    num_blocks, page_size, width = kv.shape
    es = kv.element_size()
    if width % KV_COLUMN_CHUNK or kv.stride(2) != 1:
        raise ValueError(f"kv_cache rows must be {KV_COLUMN_CHUNK}-column chunks with a contiguous last dim")
    fp8 = kv.dtype == FP8_DTYPE
    return {
        "data_type": cd.CU_TENSOR_MAP_DATA_TYPE_UINT8 if fp8 else cd.CU_TENSOR_MAP_DATA_TYPE_UINT16,
        "dims": (KV_COLUMN_CHUNK, width // KV_COLUMN_CHUNK, page_size, num_blocks),
        "strides_bytes": (KV_COLUMN_CHUNK * es, kv.stride(1) * es, kv.stride(0) * es),
        "box": (KV_COLUMN_CHUNK, width // KV_COLUMN_CHUNK, min(page_size, block_n), 1),
        "swizzle": cd.CU_TENSOR_MAP_SWIZZLE_64B if fp8 else cd.CU_TENSOR_MAP_SWIZZLE_128B,
    }


_TMAPS: dict[tuple, object] = {}  # (device, address, shape, strides, dtype) -> cuda_driver.TensorMap
_TMAPS_MAX = 4096  # one per layer's cache in a model; cleared when full (captured graphs keep their own copies)


def tensor_map_key(kv: torch.Tensor) -> tuple:
    return (kv.device.index, kv.data_ptr(), tuple(kv.shape), tuple(kv.stride()), kv.dtype)


def kv_tensor_map(kv: torch.Tensor, block_n: int = 32):
    """The cached CUtensorMap of ``kv`` (encoded on first use)."""
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    key = tensor_map_key(kv) + (block_n,)
    tmap = _TMAPS.get(key)
    if tmap is None:
        with _LOCK:
            tmap = _TMAPS.get(key)
            if tmap is None:
                if len(_TMAPS) >= _TMAPS_MAX:
                    _TMAPS.clear()
                tmap = _TMAPS[key] = cuda_driver.TensorMap(global_address=kv.data_ptr(),
                                                           **kv_tensor_map_spec(kv, block_n))
    return tmap


def split_kernel_name(compute_dtype: torch.dtype, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> str:
    """The split kernel for a call: 16-bit caches by compute dtype (an fp8 q is widened); fp8 caches by q."""
    kv8 = kv_dtype == FP8_DTYPE
    q8 = kv8 and q_dtype == FP8_DTYPE
    return build.SPLIT_KERNELS[(_DTYPE_NAME[compute_dtype], kv8, q8)]


class _Loaded:
    def __init__(self, module: build.BuildResult, cuda_module):
        self.build = module
        self.module = cuda_module
        smem = build.header_constants()["XQA_MLA_SMEM_BYTES"]
        self.split = {name: cuda_module.function(name, smem) for name in set(build.SPLIT_KERNELS.values())}
        self.combine = cuda_module.function(build.COMBINE_KERNEL)
        self.smem = smem


_MODULES: dict[tuple[int, str], _Loaded] = {}  # (context handle, arch) -> loaded cubin
_LOCK = threading.Lock()
_CONSTS: dict[str, int] = {}


def _consts() -> dict[str, int]:
    if not _CONSTS:
        _CONSTS.update(build.header_constants())
    return _CONSTS


def load(device: torch.device) -> _Loaded:
    """Build (if not cached) and load the cubin for ``device`` into its primary context."""
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(index)
    arch = arch_for(cc)
    if arch is None:
        raise RuntimeError(f"xqa_sm120: compute capability {cc[0]}.{cc[1]} is not supported; built for "
                           f"{', '.join(build.ARCHS)}")
    with torch.cuda.device(index):
        ctx = cuda_driver.current_context(index)
        key = (ctx, arch)
        loaded = _MODULES.get(key)
        if loaded is None:
            with _LOCK:
                loaded = _MODULES.get(key)
                if loaded is None:
                    res = build.build(arch)
                    loaded = _MODULES[key] = _Loaded(res, cuda_driver.CudaModule(res.cubin.read_bytes(), ctx))
    return loaded


def _scale(scale) -> tuple[int, float]:
    """(device pointer or 0, value): a 1-element device tensor is read by the kernel (no host sync)."""
    if isinstance(scale, torch.Tensor):
        return scale.data_ptr(), 1.0
    return 0, 1.0 if scale is None else float(scale)


def launch(args, workspace, config: LaunchConfig) -> None:
    """Run the XQA decode on validated ``DecodeArgs`` (ops/api.py), writing args.out and args.lse."""
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    if config.balanced:
        raise ValueError("xqa_sm120: config: split_plan must be 'uniform' (the kernel's split layout)")
    device = args.q_nope.device
    loaded = load(device)
    c = _consts()
    pdl = config.enable_pdl
    batch, q_len, heads = args.batch, args.q_len, args.num_heads
    plan = workspace.plan_for(args, PlanTile(c["XQA_MLA_BLOCK_M"], c["XQA_MLA_BLOCK_N"]), config)
    rows = q_len * heads
    kv, out, lse = args.kv_cache, args.out, args.lse
    q_ptr, q_val = _scale(args.q_scale)
    kv_ptr, kv_val = _scale(args.kv_scale)
    out_vec2 = out.data_ptr() % 4 == 0 and out.stride(0) % 2 == 0 and out.stride(1) % 2 == 0
    p = XqaMlaParams(
        args.q_nope.data_ptr(), args.q_pe.data_ptr(), kv.data_ptr(), args.block_table.data_ptr(),
        args.seq_lens.data_ptr(), args.row_kv_lens.data_ptr() if args.row_kv_lens is not None else 0,
        out.data_ptr(), lse.data_ptr(), workspace.partial_out.data_ptr(),
        workspace.partial_lse.data_ptr(), q_ptr, kv_ptr,
        args.q_nope.stride(0), args.q_nope.stride(1), args.q_pe.stride(0), args.q_pe.stride(1),
        kv.stride(0) * kv.element_size(), kv.stride(1) * kv.element_size(), args.block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        q_val, kv_val, args.softmax_scale,
        heads, q_len, kv.shape[1], plan.num_splits, plan.min_chunk,
        int(args.q_dtype == FP8_DTYPE), int(out.dtype == torch.bfloat16), int(out_vec2),
    )
    assert out.shape[-1] == KV_LORA_RANK
    fn = loaded.split[split_kernel_name(args.compute_dtype, kv.dtype, args.q_dtype)]
    stream = torch.cuda.current_stream(device).cuda_stream
    m_blocks = -(-rows // c["XQA_MLA_BLOCK_M"])
    with torch.cuda.device(device):
        tmap = kv_tensor_map(kv, c["XQA_MLA_BLOCK_N"])
        cuda_driver.launch(fn, (m_blocks, plan.num_splits, batch), (c["XQA_MLA_THREADS"], 1, 1), loaded.smem,
                           stream, [p, tmap.param], pdl=pdl)
        if plan.num_splits > 1:
            cuda_driver.launch(loaded.combine, (rows, batch, 1), (c["XQA_MLA_COMBINE_THREADS"], 1, 1), 0, stream,
                               p, pdl=pdl)
