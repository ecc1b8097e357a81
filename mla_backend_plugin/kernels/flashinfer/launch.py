"""Registry entry points of the FlashInfer adapters: support checks, configs, the shared scratch, the call.

``trtllm_batch_decode_with_kv_cache_mla(query [B, q_len, H, 576], kv_cache, workspace_buffer, qk_nope_head_dim,
kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=, bmm1_scale=, bmm2_scale=, enable_pdl=,
backend=, lse=, return_lse=, cute_dsl_impl=)`` in every FlashInfer the engines pin: 0.6.14 (vLLM 0.26), 0.6.15.post1
(SGLang 0.5.17), 0.7.2 (vLLM 0.33, SGLang 0.5.23). A query of q_len > 1 is one fixed-q block per request: both
kernels fold its q_len x H rows into their M tiles (cute-dsl: ceil(q_len * H / 128) tiles) under the causal rule.
What 0.7 changed, read from the installed signature (``api_parameters``):

* ``multi_ctas_kv_counter_buffer``: trtllm-gen's semaphores moved out of the head of ``workspace_buffer`` into a
  buffer of their own, which FlashInfer allocates on every call unless the caller passes one (an allocation per
  launch, and new memory under CUDA-graph capture). Ours is the head of the shared scratch, zeroed once.
* ``return_lse_base="basee"``: trtllm-gen writes a natural-log LSE itself (0.6 writes base 2, scaled here after
  the call).
* trtllm-gen takes a block table of any width (0.6 and cute-dsl: a multiple of 128 tokens).
* ``enable_dcp=, cp_world=, cp_rank=, causal_seqlens_kv_global=``: cute-dsl's decode context parallelism (DCP)
  mode, a rank-local state with its LSE: rank r of cp_world (a compile-time constant) holds the global positions
  p with p % cp_world == r (cyclic, interleave 1) and ``causal_seqlens_kv_global`` (int32 [B]) is each request's
  global length. It is how flashinfer_cute_dsl serves ``row_kv_lens``, given with mla_decode's ``dcp`` layout.

``xqa_batch_decode_with_kv_cache_mla(query [B, 1, H, 576], kv_cache, workspace_buffer, qk_nope_head_dim,
kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, max_seq_len, out=, bmm1_scale=, bmm2_scale=, sinks=,
enable_pdl=)`` (``flashinfer.decode``), the same in 0.6.14 and 0.7.2: FlashInfer's SM120/SM121 MLA decode, which
writes no LSE (0.7.2's ``trtllm_batch_decode_with_kv_cache_mla(backend="xqa")`` raises on ``return_lse``).

Importing this module imports no FlashInfer; ``unsupported_reason_*`` import it once, only on SM100/SM103 (SM120/
SM121 for XQA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_HEAD_DIM, QK_ROPE_HEAD_DIM
from mla_backend_plugin.ops.manifest import LaunchConfig

SCRATCH_KEY = "flashinfer"
# trtllm-gen keeps per-(request, head) semaphores at the head of its workspace: 8192 requests x 256 heads x 4 B.
# They must be zero before its first launch; the kernel resets them at the end of every launch.
COUNTER_BYTES = 8 * 2**20
# What vLLM 0.26 gives FlashInfer's MLA decode when it asks for the LSE (FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE):
# semaphores, softmax statistics and split-KV partials of either kernel (cute-dsl's largest need, B * q_len * H *
# splits * 513 * 4 B with B * q_len * splits <= SMs / 2, is ~20 MB on 148 SMs).
SHARED_BYTES = 256 * 2**20
# DeepSeek's q/k "nope" width before W_UK is absorbed; the dense decode paths ignore it, FlashInfer's API asks it.
DEEPSEEK_QK_NOPE_HEAD_DIM = 128
# trtllm-gen writes the LSE in base 2 by default (vLLM's FlashInferMLAImpl: lse_base_on_e = False); the monolithic
# cute-dsl kernel converts to natural log before its store. mla_decode returns natural-log LSE.
LSE_IN_LOG2 = {"cute-dsl": False, "trtllm-gen": True}
SM100_FAMILY = 10
SM120_FAMILY = 12
# FlashInfer's XQA MLA decode: one JIT-compiled kernel per (dtype, page size) for 128 heads (HEAD_GRP_SIZE), one
# query token per request, q and cache both bf16 or both e4m3 (flashinfer.xqa.gen_xqa_module_mla; what
# _common_reason lets through: bf16 output, q in the cache's dtype), page size 16/32/64/128 (every one mla_decode
# takes, ops/constants.py SUPPORTED_BLOCK_SIZES)
XQA_NUM_HEADS = 128


@functools.cache
def api_parameters() -> frozenset[str]:
    """The parameters of the installed ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla``."""
    flashinfer_mla = importlib.import_module("flashinfer.mla")
    return frozenset(inspect.signature(flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla).parameters)


def separate_counters() -> bool:
    """FlashInfer >= 0.7: trtllm-gen's semaphores are a buffer of their own (``multi_ctas_kv_counter_buffer``)."""
    return "multi_ctas_kv_counter_buffer" in api_parameters()


@functools.cache
def import_failure() -> str | None:
    """None when ``import flashinfer.mla`` works (it needs a GPU), else why not; tried once per process."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed"
    try:
        importlib.import_module("flashinfer.mla")
    except Exception as e:  # noqa: BLE001 - any import failure makes the kernels unavailable, with its reason
        return f"import flashinfer.mla failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def cubins_missing() -> str | None:
    """None when trtllm-gen's cubins are on this machine (flashinfer-cubin, or FLASHINFER_CUBIN_DIR non-empty)."""
    if importlib.util.find_spec("flashinfer_cubin") is not None:
        return None
    cubin_dir = envs.FLASHINFER_CUBIN_DIR
    if cubin_dir and os.path.isdir(cubin_dir) and os.listdir(cubin_dir):
        return None
    return ("trtllm-gen's cubins are not installed (pip install flashinfer-cubin, or FLASHINFER_CUBIN_DIR); "
            "FlashInfer would download them")


def _common_reason(backend: str, args, cc, family: int = 10,
                   devices: str = "SM100/SM103 (B200, GB200, B300)") -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc[0] != family:
        return (f"FlashInfer's {backend} MLA decode runs on {devices}, device has compute "
                f"capability {cc[0]}.{cc[1]}")
    failure = import_failure()
    if failure:
        return failure
    if args.out.dtype != torch.bfloat16:
        return f"writes bf16 output only, out is {str(args.out.dtype).replace('torch.', '')}"
    if args.q_dtype != args.kv_dtype:
        return (f"needs q in the cache's dtype (q is {str(args.q_dtype).replace('torch.', '')}, cache "
                f"{str(args.kv_dtype).replace('torch.', '')}); with an fp8 cache pass an fp8 q "
                "(vLLM: CUTE_MLA_FP8_QUERY=1)")
    for name in ("q_scale", "kv_scale"):
        if isinstance(getattr(args, name), torch.Tensor):
            return (f"takes its scales as host floats (fused into bmm1/bmm2 on the host); {name} is a device "
                    "tensor, which would have to be read back (a sync)")
    if not (args.out.is_contiguous() and args.lse.is_contiguous()):
        return "needs contiguous out and lse"
    return None


def _block_table_reason(args) -> str | None:
    if args.block_table.shape[1] % (128 // args.block_size):  # block sizes are 16..128
        return (f"needs a block table covering a multiple of 128 tokens; it has {args.block_table.shape[1]} "
                f"columns of {args.block_size}-token blocks")
    return None


def installed_version() -> str:
    """The installed FlashInfer's version (for reasons; the features are read from ``api_parameters``)."""
    return str(getattr(importlib.import_module("flashinfer"), "__version__", "of unknown version"))


def has_dcp_mode() -> bool:
    """FlashInfer >= 0.7: cute-dsl's DCP mode (``enable_dcp``, ``cp_world``, ``cp_rank``,
    ``causal_seqlens_kv_global``)."""
    return "enable_dcp" in api_parameters()


def _dcp_reason(args) -> str | None:
    """cute-dsl takes per-row key counts only as its DCP mode, which derives them from the layout itself."""
    if args.row_kv_lens is None:
        return None
    dcp = getattr(args, "dcp", None)
    if dcp is None:
        return ("takes row_kv_lens only in FlashInfer's DCP mode, which needs the layout they come from "
                "(mla_decode's dcp=DcpLayout(world, rank, interleave, global_seq_lens))")
    if dcp.interleave != 1:
        return f"FlashInfer's DCP mode shards cyclically (interleave 1); got {dcp.interleave}"
    if not has_dcp_mode():
        return (f"FlashInfer {installed_version()} has no DCP mode (enable_dcp, cp_world, cp_rank, "
                "causal_seqlens_kv_global: FlashInfer >= 0.7)")
    return None


def unsupported_reason_cute_dsl(args, cc) -> str | None:
    return _common_reason("cute-dsl", args, cc) or _block_table_reason(args) or _dcp_reason(args)


def unsupported_reason_trtllm(args, cc) -> str | None:
    why = _common_reason("trtllm-gen", args, cc)
    if why:
        return why
    if args.block_size not in (32, 64):
        return f"trtllm-gen needs block size 32 or 64, the cache has {args.block_size}"
    if not separate_counters():  # FlashInfer < 0.7 pads nothing: the table must cover whole 128-token tiles
        why = _block_table_reason(args)
        if why:
            return why
    return cubins_missing()


def scratch(cc, max_batch: int, max_q_len: int, num_heads: int, num_sms: int) -> tuple[str, int] | None:
    """The scratch the adapters share, in every workspace for an SM100/SM103 or SM120/SM121 device with FlashInfer
    installed: [semaphores + split-KV region: SHARED_BYTES][q staging: max tokens x H x 576 x 2 B]."""
    if cc is None or cc[0] not in (SM100_FAMILY, SM120_FAMILY) or importlib.util.find_spec("flashinfer") is None:
        return None
    staging = max_batch * max_q_len * num_heads * QK_HEAD_DIM * 2
    return SCRATCH_KEY, SHARED_BYTES + staging


def default_config(args, cc) -> LaunchConfig:
    return LaunchConfig(enable_pdl=envs.CUTE_MLA_PDL)


def configs(args, cc) -> list[LaunchConfig]:
    first = default_config(args, cc)
    return [first, LaunchConfig(enable_pdl=not first.enable_pdl)]


def config_label(config: LaunchConfig) -> str:
    return "pdl" if config.enable_pdl else "no-pdl"


def joined_query(args) -> torch.Tensor | None:
    """``[B, q_len, H, 576]`` as a view when q_nope and q_pe are the two parts of one tensor, else None."""
    q_nope, q_pe = args.q_nope, args.q_pe
    if (q_pe.data_ptr() != q_nope.data_ptr() + KV_LORA_RANK * q_nope.element_size()
            or q_nope.stride() != q_pe.stride() or q_nope.stride(1) != QK_HEAD_DIM
            or q_nope.stride(0) != args.num_heads * QK_HEAD_DIM):
        return None
    return torch.as_strided(q_nope, (args.batch, args.q_len, args.num_heads, QK_HEAD_DIM),
                            (args.q_len * args.num_heads * QK_HEAD_DIM, args.num_heads * QK_HEAD_DIM, QK_HEAD_DIM, 1))


def staged_query(args, buf: torch.Tensor) -> torch.Tensor:
    """``[B, q_len, H, 576]``: a view of q when it is one tensor, else vLLM's (q_nope, q_pe) pair joined in the
    staging area of the shared scratch ``buf``, where FlashInfer can read it."""
    query = joined_query(args)
    if query is not None:
        return query
    nbytes = args.batch * args.q_len * args.num_heads * QK_HEAD_DIM * args.q_nope.element_size()
    if SHARED_BYTES + nbytes > buf.numel():
        raise ValueError(f"mla_decode: workspace: FlashInfer's q staging holds {buf.numel() - SHARED_BYTES} "
                         f"bytes, this call needs {nbytes}")
    query = buf[SHARED_BYTES:SHARED_BYTES + nbytes].view(args.q_nope.dtype).view(
        args.batch, args.q_len, args.num_heads, QK_HEAD_DIM)
    flat = query.view(-1, args.num_heads, QK_HEAD_DIM)
    flat[..., :KV_LORA_RANK].copy_(args.q_nope)
    flat[..., KV_LORA_RANK:].copy_(args.q_pe)
    return query


def call_kwargs(args, workspace, backend: str, config: LaunchConfig) -> dict:
    """The keywords of ``trtllm_batch_decode_with_kv_cache_mla`` for one of our calls (no allocation: views of
    args and of the workspace's scratch; a q pair is copied into the staging area)."""
    buf = workspace.scratch_for(SCRATCH_KEY)
    query = staged_query(args, buf)
    counters = backend == "trtllm-gen" and separate_counters()
    # trtllm-gen < 0.7 finds its semaphores at the head of the region; cute-dsl never touches them
    region = buf[:SHARED_BYTES] if backend == "trtllm-gen" and not counters else buf[COUNTER_BYTES:SHARED_BYTES]
    q_scale = 1.0 if args.q_scale is None else float(args.q_scale)
    kv_scale = 1.0 if args.kv_scale is None else float(args.kv_scale)
    kwargs = dict(
        query=query, kv_cache=args.kv_cache, workspace_buffer=region.view(torch.int8),
        qk_nope_head_dim=DEEPSEEK_QK_NOPE_HEAD_DIM, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        block_tables=args.block_table, seq_lens=args.seq_lens,
        # an upper bound known from shapes alone, so the call is the same in every replay of a CUDA graph
        max_seq_len=args.block_table.shape[1] * args.block_size,
        out=args.out.view(args.batch, args.q_len, args.num_heads, KV_LORA_RANK),
        bmm1_scale=args.softmax_scale * q_scale * kv_scale, bmm2_scale=kv_scale,
        enable_pdl=bool(config.enable_pdl), backend=backend, lse=args.lse, return_lse=True)
    if backend == "cute-dsl":
        kwargs["cute_dsl_impl"] = "monolithic"  # the implementation that writes the LSE (and the one with DCP)
        if args.row_kv_lens is not None:  # served only with the layout (_dcp_reason): the kernel applies the rule
            kwargs.update(enable_dcp=True, cp_world=args.dcp.world, cp_rank=args.dcp.rank,
                          causal_seqlens_kv_global=args.dcp.global_seq_lens)
    if counters:
        kwargs["multi_ctas_kv_counter_buffer"] = buf[:COUNTER_BYTES]
    if "return_lse_base" in api_parameters():
        kwargs["return_lse_base"] = "basee"
    return kwargs


def lse_in_log2(backend: str) -> bool:
    """Whether the kernel leaves a base-2 LSE for us to convert (trtllm-gen before FlashInfer 0.7)."""
    return LSE_IN_LOG2[backend] and "return_lse_base" not in api_parameters()


def _launch(backend: str, args, workspace, config: LaunchConfig) -> None:
    flashinfer_mla = importlib.import_module("flashinfer.mla")
    flashinfer_mla.trtllm_batch_decode_with_kv_cache_mla(**call_kwargs(args, workspace, backend, config))
    if lse_in_log2(backend):
        args.lse.mul_(math.log(2.0))


def launch_cute_dsl(args, workspace, config: LaunchConfig) -> None:
    _launch("cute-dsl", args, workspace, config)


def launch_trtllm(args, workspace, config: LaunchConfig) -> None:
    _launch("trtllm-gen", args, workspace, config)


# --------------------------------------------------------------------------------------------------------
# FlashInfer's SM120/SM121 XQA MLA decode (flashinfer.decode.xqa_batch_decode_with_kv_cache_mla)
# --------------------------------------------------------------------------------------------------------

def unsupported_reason_xqa(args, cc) -> str | None:
    why = _common_reason("XQA", args, cc, SM120_FAMILY, "SM120/SM121 (RTX PRO 6000 Blackwell, RTX 50, DGX Spark)")
    if why:
        return why
    if args.num_heads != XQA_NUM_HEADS:
        return f"XQA's MLA kernel is built for {XQA_NUM_HEADS} heads, the call has {args.num_heads}"
    if args.q_len != 1:
        return f"XQA's MLA kernel takes one query token per request, the call has q_len {args.q_len}"
    return _block_table_reason(args)  # FlashInfer checks the table as trtllm-gen 0.6's (whole 128-token tiles)


def xqa_call_kwargs(args, workspace, config: LaunchConfig) -> dict:
    """The keywords of ``xqa_batch_decode_with_kv_cache_mla`` for one of our calls. Its workspace is the shared
    scratch's head: XQA's 8 MiB of semaphores first (zero at allocation; the kernel leaves them zero, as
    trtllm-gen's), its split-KV partials after them.

    Scales, read from its kernel (csrc/xqa/mla_sm120.cu): the logits are scaled by ``bmm1_scale * bmm2_scale``
    (its q scale times its KV scale) and the output by ``bmm2_scale``, so ``bmm1_scale`` takes the softmax scale
    times q's scale and ``bmm2_scale`` the cache's scale (not trtllm-gen's bmm1 = softmax x q x kv)."""
    buf = workspace.scratch_for(SCRATCH_KEY)
    q_scale = 1.0 if args.q_scale is None else float(args.q_scale)
    kv_scale = 1.0 if args.kv_scale is None else float(args.kv_scale)
    return dict(
        query=staged_query(args, buf), kv_cache=args.kv_cache, workspace_buffer=buf[:SHARED_BYTES],
        qk_nope_head_dim=DEEPSEEK_QK_NOPE_HEAD_DIM, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        block_tables=args.block_table, seq_lens=args.seq_lens,
        max_seq_len=args.block_table.shape[1] * args.block_size,
        out=args.out.view(args.batch, args.num_heads, KV_LORA_RANK),
        bmm1_scale=args.softmax_scale * q_scale, bmm2_scale=kv_scale, enable_pdl=bool(config.enable_pdl))


def launch_xqa(args, workspace, config: LaunchConfig) -> None:
    """Writes ``args.out`` only: XQA's MLA kernel has no LSE output (the manifest says ``writes_lse=False``)."""
    flashinfer_decode = importlib.import_module("flashinfer.decode")
    flashinfer_decode.xqa_batch_decode_with_kv_cache_mla(**xqa_call_kwargs(args, workspace, config))
