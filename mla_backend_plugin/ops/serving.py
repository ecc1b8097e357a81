"""The engine-neutral half of a serving backend (vLLM's ``vllm/backend.py``, SGLang's ``sglang/backend.py``).

What every engine's MLA decode backend needs from us, apart from the engine's own classes: the supported
settings and the words that refuse the others, the workspace sized from the engine's limits (allocated once,
before CUDA-graph capture), the cache and scale forms the kernels take, and the decode call that returns views
of the workspace's output buffers (no allocation per step).
"""

from __future__ import annotations

import torch

from mla_backend_plugin import BACKEND_NAME, envs
from mla_backend_plugin.ops.api import mla_decode
from mla_backend_plugin.ops.constants import (
    FP8_DTYPE,
    KV_LORA_RANK,
    MAX_Q_LEN,
    OUT_DTYPES,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_NUM_HEADS,
    dtype_names,
)
from mla_backend_plugin.ops.workspace import MLAWorkspace

MIN_COMPUTE_CAPABILITY = (9, 0)
# KV-cache dtype names as engines spell them ("auto" = the model dtype)
KV_CACHE_DTYPE_NAMES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def max_decode_q_len(num_speculative_tokens: int | None) -> int:
    """Query tokens per request in a decode step: 1 plus the speculative (MTP / draft) tokens."""
    num_spec = num_speculative_tokens or 0
    q_len = 1 + num_spec
    if q_len > MAX_Q_LEN:
        raise ValueError(
            f"{BACKEND_NAME}: num_speculative_tokens={num_spec} gives {q_len} query tokens per decode step; "
            f"{BACKEND_NAME} supports at most {MAX_Q_LEN} (num_speculative_tokens <= {MAX_Q_LEN - 1})")
    return q_len


def check_num_heads(num_heads: int, dcp_world_size: int = 1) -> int:
    """The query heads of one decode call, refused unless a kernel supports them: the rank's heads, times the
    decode-context-parallel size (the engine gathers the q heads of the DCP group before decode)."""
    total = num_heads * dcp_world_size
    if total not in SUPPORTED_NUM_HEADS:
        if dcp_world_size > 1:
            raise ValueError(
                f"{BACKEND_NAME}: {num_heads} attention heads per rank x decode_context_parallel_size "
                f"{dcp_world_size} = {total} query heads per decode call is not supported; allowed: "
                f"{SUPPORTED_NUM_HEADS}")
        raise ValueError(f"{BACKEND_NAME}: {num_heads} attention heads per rank is not supported; "
                         f"allowed: {SUPPORTED_NUM_HEADS}")
    return total


def dcp_local_kv_lens(global_lens: torch.Tensor, world: int, rank: int, interleave: int) -> torch.Tensor:
    """Decode context parallelism: how many of a request's first ``global_lens`` tokens rank ``rank`` of the
    ``world`` ranks stores, when the tokens are dealt out ``interleave`` at a time (token p lives on rank
    (p // interleave) % world, at local position (p // (world * interleave)) * interleave + p % interleave;
    vLLM's cp_kv_cache_interleave_size). Elementwise on an integer tensor of any shape (int32 result);
    negative lengths count as 0. No host sync."""
    n = global_lens.to(torch.int32).clamp(min=0)
    cycle = world * interleave
    full = torch.div(n, cycle, rounding_mode="floor")
    return (full * interleave + (n - full * cycle - rank * interleave).clamp(0, interleave)).to(torch.int32)


def dcp_row_kv_lens(global_seq_lens: torch.Tensor, q_len: int, world: int, rank: int, interleave: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_decode``'s ``row_kv_lens`` ([B, q_len] int32) on rank ``rank`` of a decode-context-parallel group:
    row t of a request sees the global keys below ``seq_len - q_len + 1 + t``, and this rank holds
    ``dcp_local_kv_lens`` of them. That is not ``local_len - q_len + 1 + t``: the q block's new tokens are
    dealt out across the ranks too (the last row's count is the local length). Written into ``out`` when given
    (a persistent buffer that a CUDA graph reads); device ops only, no host sync."""
    t = torch.arange(q_len, dtype=torch.int32, device=global_seq_lens.device)
    lens = dcp_local_kv_lens(global_seq_lens.to(torch.int32)[:, None] - (q_len - 1) + t[None, :], world, rank,
                             interleave)
    if out is None:
        return lens
    out.copy_(lens)
    return out


def check_mla_dims(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    if (kv_lora_rank, qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        raise ValueError(f"{BACKEND_NAME} needs kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim={QK_ROPE_HEAD_DIM} "
                         f"(DeepSeek-V2/V3/R1), got {kv_lora_rank} and {qk_rope_head_dim}")


def check_attention_features(alibi_slopes=None, sliding_window=None, logits_soft_cap=None) -> None:
    if any(x is not None and x is not False and x != 0 for x in (alibi_slopes, sliding_window, logits_soft_cap)):
        raise NotImplementedError(f"{BACKEND_NAME} does not support alibi_slopes, sliding_window or "
                                  "logits_soft_cap")


def check_block_size(block_size: int) -> None:
    """For engines that pass the page size straight to the kernel (SGLang); vLLM splits its blocks."""
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{BACKEND_NAME}: page size {block_size} is not supported; allowed: "
                         f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")


def unsupported_reasons(*, head_size=None, dtype=None, kv_cache_dtype=None, block_size=None,
                        compute_capability=None, sparse=None) -> dict[str, str]:
    """The refusal of each setting, naming the value and what is allowed (keyed like vLLM's generic reasons,
    so the vLLM backend can substitute them; other engines pick the ones they check)."""
    cc = compute_capability
    cc_str = f"{cc[0]}.{cc[1]}" if cc is not None else "unknown"
    return {
        "head_size not supported": (
            f"head_size {head_size} not supported: {BACKEND_NAME} needs DeepSeek MLA dims "
            f"(kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim {QK_ROPE_HEAD_DIM} = {QK_HEAD_DIM})"),
        "dtype not supported": f"dtype {dtype} not supported; allowed: {dtype_names(OUT_DTYPES)}",
        "kv_cache_dtype not supported": (
            f"kv_cache_dtype {kv_cache_dtype!r} not supported; allowed: {', '.join(KV_CACHE_DTYPE_NAMES)}"),
        "block_size not supported": (
            f"block_size {block_size} not supported; allowed: multiples of {min(SUPPORTED_BLOCK_SIZES)} (kernel "
            f"block sizes {SUPPORTED_BLOCK_SIZES})"),
        "compute capability not supported": (
            f"compute capability {cc_str} not supported; {BACKEND_NAME} needs >= "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (Hopper, Blackwell)"),
        "sparse not supported": f"sparse MLA (DeepSeek-V3.2 indexer) is not supported by {BACKEND_NAME}",
    }


def make_workspace(device, *, max_num_seqs: int, num_speculative_tokens: int | None, num_heads: int,
                   out_dtype: torch.dtype) -> MLAWorkspace:
    """The workspace of one engine: split-KV partials for up to ``max_num_seqs`` requests of the decode q_len,
    and the output buffers decode returns views of. Make it before warm-up and CUDA-graph capture.
    ``num_heads``: the query heads of one decode call (under DCP the rank's heads x the DCP size)."""
    check_num_heads(num_heads)
    return MLAWorkspace(device, max_batch=max_num_seqs, max_q_len=max_decode_q_len(num_speculative_tokens),
                        num_heads=num_heads, out_dtype=out_dtype)


def kernel_cache(kv_cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """The cache as the kernels take it: an fp8 cache that the engine stores as bytes, viewed as e4m3."""
    if kv_cache_dtype.startswith("fp8") and kv_cache.dtype == torch.uint8:
        return kv_cache.view(FP8_DTYPE)
    return kv_cache


def dequant_scale(scale) -> torch.Tensor | float:
    """An engine's dequantisation scale (real = stored * scale) as mla_decode takes it: a device tensor stays
    one (read in the kernel: no host sync), None means 1."""
    return 1.0 if scale is None else scale


class DecodeRunner:
    """One layer's decode: which kernel (``CUTE_MLA_KERNEL``, read once), the cache dtype, the softmax scale;
    ``decode`` writes into the workspace's output buffers and returns views of them."""

    def __init__(self, softmax_scale: float, kv_cache_dtype: str):
        self.softmax_scale = float(softmax_scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8_kv_cache = kv_cache_dtype.startswith("fp8")
        self.kernel = envs.CUTE_MLA_KERNEL

    def decode(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               workspace: MLAWorkspace, *, q_scale=None, kv_scale=None,
               row_kv_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        q_is_fp8 = isinstance(q, torch.Tensor) and q.dtype == FP8_DTYPE
        num_tokens = (q[0] if isinstance(q, (tuple, list)) else q).shape[0]
        out, lse = workspace.output_views(num_tokens)
        mla_decode(q, kernel_cache(kv_cache, self.kv_cache_dtype), block_table, seq_lens,
                   softmax_scale=self.softmax_scale,
                   q_scale=dequant_scale(q_scale) if q_is_fp8 else None,
                   kv_scale=dequant_scale(kv_scale) if self.is_fp8_kv_cache else None,
                   out=out, lse=lse, workspace=workspace, kernel=self.kernel, row_kv_lens=row_kv_lens)
        return out, lse
