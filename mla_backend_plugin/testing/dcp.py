"""Decode context parallelism (DCP) on one device: split a decode call's KV the way vLLM shards it across the
ranks of a DCP group, run a kernel per shard, merge the partial results with their LSE.

vLLM (``cp_kv_cache_interleave_size`` = I, ``decode_context_parallel_size`` = N) deals a request's tokens out
I at a time: global token p lives on rank (p // I) % N at local position (p // (N * I)) * I + p % I (vLLM's
``_compute_slot_mapping_kernel``, v1/worker/block_table.py), so each rank's paged cache holds its tokens
densely and decode gets the local lengths. Every rank attends with the same q (all heads of the group) over
its shard; vLLM merges the outputs with the LSEs (``cp_lse_ag_out_rs`` -> ``correct_attn_out``,
v1/attention/ops/common.py). With q_len > 1, row t of a request sees the global keys below
seq_len - q_len + 1 + t: on a shard that is the count of the rank's tokens below that position
(``shard_row_kv_lens``, counted here token by token; ``ops.serving.dcp_row_kv_lens`` is the closed form the
backend uses).

* ``shard_decode_inputs``: one rank's ``DecodeInputs`` (its own permuted pages, poisoned unread slots, the
  shared q, ``row_kv_lens``);
* ``merge_partials``: the float32 LSE merge of the ranks' (out, lse), what vLLM's merge computes;
* ``vllm_merge``: vLLM's own merge function (its Triton kernel: a GPU, or TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.inputs import DecodeInputs, make_decode_inputs


def rank_of(pos: int, world: int, interleave: int) -> int:
    """The rank that stores global token ``pos``."""
    return (pos // interleave) % world


def local_positions(global_len: int, world: int, rank: int, interleave: int) -> list[int]:
    """The global positions of the first ``global_len`` tokens that ``rank`` stores, in local order."""
    return [p for p in range(max(global_len, 0)) if rank_of(p, world, interleave) == rank]


def shard_row_kv_lens(seq_lens: list[int], q_len: int, world: int, rank: int, interleave: int) -> list[list[int]]:
    """[B][q_len]: how many of this rank's tokens row t of each request sees (its global keys are those below
    seq_len - q_len + 1 + t), counted token by token."""
    return [[sum(1 for p in range(max(s - q_len + 1 + t, 0)) if rank_of(p, world, interleave) == rank)
             for t in range(q_len)] for s in seq_lens]


def _gather_rows(inp: DecodeInputs, b: int, length: int) -> torch.Tensor:
    """Request b's first ``length`` cache rows in token order (raw bits: fp8 and 16-bit values copy exactly)."""
    bs = inp.kv_cache.shape[1]
    bits = torch.uint8 if inp.kv_dtype == FP8_DTYPE else torch.int16
    pages = inp.block_table[b, :-(-length // bs)].long()
    return inp.kv_cache.view(bits)[pages].reshape(-1, inp.kv_cache.shape[-1])[:length]


def shard_decode_inputs(inp: DecodeInputs, world: int, rank: int, interleave: int, *, seed: int,
                        poison: str | None = "nan") -> DecodeInputs:
    """Rank ``rank``'s view of ``inp`` under DCP: its tokens in a paged cache of its own (permuted pages, spare
    pages, poisoned unread slots, as ``make_decode_inputs`` lays them out) with the local lengths, the same q
    and scales, and ``row_kv_lens`` (the per-row limits in local positions; for q_len 1 they equal seq_lens)."""
    if inp.kv_caches[1:]:
        raise ValueError("shard_decode_inputs takes inputs with one KV copy")
    positions = [local_positions(s, world, rank, interleave) for s in inp.seq_lens_list]
    local_lens = [len(p) for p in positions]
    q_is_fp8 = inp.q_nope.dtype == FP8_DTYPE
    local = make_decode_inputs(
        inp.batch, local_lens, inp.q_len, inp.num_heads, inp.kv_cache.shape[1], inp.kv_dtype,
        "fp8" if q_is_fp8 else "cat", inp.device, seed, q_dtype=None if q_is_fp8 else inp.q_nope.dtype,
        q_scale=inp.q_scale, kv_scale=inp.kv_scale, out_dtype=inp.out_dtype, softmax_scale=inp.softmax_scale,
        poison=poison)
    bs = local.kv_cache.shape[1]
    bits = torch.uint8 if local.kv_dtype == FP8_DTYPE else torch.int16
    raw = local.kv_cache.view(bits)
    for b, pos in enumerate(positions):
        if not pos:
            continue
        rows = _gather_rows(inp, b, inp.seq_lens_list[b])[torch.tensor(pos, device=inp.device)]
        j = torch.arange(len(pos), device=inp.device)
        pages = local.block_table[b].long()[j // bs]
        raw[pages, j % bs] = rows
    row_kv_lens = torch.tensor(shard_row_kv_lens(inp.seq_lens_list, inp.q_len, world, rank, interleave),
                               dtype=torch.int32, device=inp.device).reshape(inp.batch, inp.q_len)
    return dataclasses.replace(local, q=inp.q, q_scale=inp.q_scale, row_kv_lens=row_kv_lens, _fp8_query=None)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (out [T, H, D], lse [T, H]) of the ranks' partial results merged by their natural-log LSE, as
    vLLM's merge does: a NaN or +inf LSE counts as -inf (a rank that saw no key), rows no rank saw give 0, -inf."""
    lse = torch.stack([x.float() for x in lses])  # [N, T, H]
    lse = torch.where(torch.isnan(lse) | torch.isposinf(lse), -math.inf, lse)
    total = torch.logsumexp(lse, dim=0)
    weight = torch.exp(lse - torch.where(torch.isneginf(total), 0.0, total)[None])  # 0 where a rank saw nothing
    out = torch.zeros_like(outs[0], dtype=torch.float32)
    for w, o in zip(weight, outs):
        out += torch.where(w[..., None] == 0, 0.0, w[..., None] * o.float())
    return out, total


def vllm_merge(outs: list[torch.Tensor], lses: list[torch.Tensor], *,
               is_lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own DCP merge, as its MLA backends reach it (``cp_lse_ag_out_rs``): every rank corrects its output
    with the all-gathered LSEs (``correct_attn_out``, in the output's dtype), then the corrected outputs are
    summed (the reduce-scatter; here in float32). Returns (out float32, lse)."""
    try:  # vLLM >= 0.32
        from vllm.v1.attention.ops.dcp import CPTritonContext, correct_attn_out
    except ImportError:  # 0.26 .. 0.31
        from vllm.v1.attention.ops.common import CPTritonContext, correct_attn_out

    lses_all = torch.stack([x.float().contiguous() for x in lses])  # [N, T, H], the all-gather
    total = None
    lse = None
    for r, o in enumerate(outs):
        corrected, lse = correct_attn_out(o.clone(), lses_all, r, CPTritonContext(),
                                          is_lse_base_on_e=is_lse_base_on_e)
        total = corrected.float() if total is None else total + corrected.float()
    return total, lse
