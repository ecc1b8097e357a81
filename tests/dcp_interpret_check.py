"""Decode context parallelism on the CPU with vLLM's own pieces and our real Triton kernel, through Triton's
interpreter (run by tests/test_dcp_cpu.py; TRITON_INTERPRET=1 and an empty CUDA_VISIBLE_DEVICES, which keeps
vLLM's Triton wrappers live on a machine without a GPU, must be set before Triton is imported).

1. vLLM's slot-mapping kernel (v1/worker/block_table.py) stores each token on the rank and at the local
   position that mla_backend_plugin.testing.dcp assumes, for every rank, interleave size and block size;
2. vLLM's DCP merge kernel (what correct_attn_out launches for cp_lse_ag_out_rs; on vLLM < 0.32 also the function
   itself) equals testing.dcp.merge_partials, including rows some or all ranks saw no key of (LSE -inf, NaN);
3. our Triton decode kernel on every rank's shard, with the per-row limits in local positions, merged by
   vLLM's merge, equals the float32 reference over the unsplit cache (fp16 and fp8 caches, q_len 1..4, ragged
   lengths, interleave 1 and the page size); each case with q_len > 1 tells the rules apart: the reference
   kernel per shard with the naive local rule (seq_len - q_len + 1 + t), merged, is far from it, so a kernel
   that ignored the limits would fail. (The naive rule runs on the reference kernel and the torch merge, which
   check_merge ties to vLLM's: in the interpreter, Triton launches are most of this check's time.)

Prints PASS when every check holds.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from mla_backend_plugin.kernels.triton_decode.config import config_for  # noqa: E402
from mla_backend_plugin.kernels.triton_decode.kernel import launch  # noqa: E402
from mla_backend_plugin.ops.api import mla_decode, prepare_args  # noqa: E402
from mla_backend_plugin.ops.manifest import LaunchConfig  # noqa: E402
from mla_backend_plugin.ops.workspace import MLAWorkspace  # noqa: E402
from mla_backend_plugin.testing import compare_decode, make_decode_inputs  # noqa: E402
from mla_backend_plugin.testing.dcp import (  # noqa: E402
    local_positions,
    merge_partials,
    rank_of,
    shard_decode_inputs,
    vllm_merge,
)


def _slot_mapping(length, positions, block_table, width, block_size, slots, world, rank, interleave, pad):
    """vLLM's slot-mapping kernel for one request of ``length`` tokens (its signature changed in 0.32)."""
    import vllm.v1.worker.block_table as vllm_block_table

    common = dict(TOTAL_CP_WORLD_SIZE=world, TOTAL_CP_RANK=rank, CP_KV_CACHE_INTERLEAVE_SIZE=interleave, PAD_ID=pad,
                  BLOCK_SIZE=64, KV_CACHE_BLOCK_SIZE=block_size)
    qsl = torch.tensor([0, length], dtype=torch.int32)
    if hasattr(vllm_block_table, "ComputeSlotMappingKernel"):  # vLLM >= 0.32
        vllm_block_table.ComputeSlotMappingKernel.kernel[(2,)](
            length, slots.numel(), qsl, positions, block_table, width, slots, **common)
    else:
        vllm_block_table._compute_slot_mapping_kernel[(2,)](
            length, slots.numel(), qsl, positions, block_table, width, block_size, slots, BLOCKS_PER_KV_BLOCK=1,
            **common)


def check_slot_mapping() -> None:
    pad = -1
    for world, interleave, block_size in ((2, 1, 16), (2, 16, 16), (4, 1, 16), (4, 8, 32), (8, 64, 64)):
        length = 3 * world * block_size + 5
        positions = torch.arange(length, dtype=torch.int64)
        width = length // block_size + 2
        block_table = torch.arange(width, dtype=torch.int32)[None].repeat(2, 1)  # local page i = page id i
        for rank in range(world):
            slots = torch.full((length + 8,), -7, dtype=torch.int64)
            _slot_mapping(length, positions, block_table, width, block_size, slots, world, rank, interleave, pad)
            expected = [pad] * length
            for j, p in enumerate(local_positions(length, world, rank, interleave)):
                expected[p] = j  # identity block table: the slot id is the local position
            assert slots[:length].tolist() == expected, (world, interleave, block_size, rank)
            assert all(rank_of(p, world, interleave) == rank for p in range(length) if expected[p] != pad)
    print("slot mapping: ok")


def _vllm_merge_kernel():
    """vLLM's DCP merge kernel (the Triton function correct_attn_out launches)."""
    try:  # vLLM >= 0.32: behind a JIT-warmup launcher the interpreter cannot drive
        from vllm.v1.attention.ops.dcp import CorrectAttnCPOutKernel

        return CorrectAttnCPOutKernel.kernel
    except ImportError:
        from vllm.v1.attention.ops.common import _correct_attn_cp_out_kernel

        return _correct_attn_cp_out_kernel


def merge_with_vllm_kernel(outs, lses):
    """What vllm_merge computes, launching vLLM's merge kernel directly (as correct_attn_out does): each rank's
    output rescaled in its dtype with the gathered LSEs, then summed."""
    kernel = _vllm_merge_kernel()
    lses_all = torch.stack([x.float().contiguous() for x in lses])
    total = lse = None
    for r, o in enumerate(outs):
        o = o.clone()
        tokens, heads, dim = o.shape
        lse = torch.empty_strided((tokens, heads), lses_all.stride()[1:], dtype=torch.float32)
        kernel[(tokens, heads, 1)](o, o, lses_all, lse, *o.stride(), *lses_all.stride(), r, HEAD_DIM=dim,
                                   N_ROUNDED=len(outs), IS_BASE_E=True)
        total = o.float() if total is None else total + o.float()
    return total, lse


def check_merge() -> None:
    g = torch.Generator().manual_seed(0)
    for world in (2, 4):
        tokens, heads = 6, 16
        outs = [torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16) for _ in range(world)]
        lses = [torch.randn(tokens, heads, generator=g) * 4 for _ in range(world)]
        for r in range(world):  # row 0: no rank saw a key
            lses[r][0] = -math.inf
            outs[r][0] = 0
        lses[world - 1][1] = -math.inf  # row 1: one rank saw none
        outs[world - 1][1] = 0
        lses[0][2] = math.nan  # treated as no key, as vLLM's merge does
        ours, ours_lse = merge_partials(outs, lses)
        merges = [merge_with_vllm_kernel(outs, lses)]
        with contextlib.suppress(AttributeError):  # the function itself (vLLM < 0.32 in the interpreter)
            merges.append(vllm_merge(outs, lses))
        for theirs, theirs_lse in merges:
            torch.testing.assert_close(theirs, ours, rtol=1e-2, atol=2e-2)  # vLLM rescales in bf16
            assert torch.equal(torch.isneginf(theirs_lse), torch.isneginf(ours_lse))
            live = torch.isfinite(ours_lse)
            torch.testing.assert_close(theirs_lse[live], ours_lse[live], rtol=0, atol=1e-5)
            assert (theirs[0] == 0).all()
    print(f"merge: ok ({len(merges)} forms)")


CASES = [  # (kv dtype, global seq_lens, q_len, dcp world, interleave, block size)
    (torch.float16, [1, 9, 70, 131], 1, 2, 1, 16),
    (torch.float16, [2, 9, 70, 131], 2, 2, 1, 16),
    (torch.float16, [3, 33, 200], 3, 4, 1, 16),
    (torch.float16, [4, 5, 47, 131], 4, 2, 16, 16),
    (torch.float8_e4m3fn, [2, 30, 150], 2, 4, 32, 32),
]


def check_kernel_per_shard() -> None:
    for i, (kv_dtype, lens, q_len, world, interleave, bs) in enumerate(CASES):
        fp8 = kv_dtype == torch.float8_e4m3fn
        inp = make_decode_inputs(len(lens), lens, q_len, 16, bs, kv_dtype, "pair", "cpu", 100 + i,
                                 q_dtype=torch.float16, kv_scale=2.0 if fp8 else None)
        cfg = config_for(16)
        ref = inp.reference()
        shards = [shard_decode_inputs(inp, world, rank, interleave, seed=7 * i + rank) for rank in range(world)]
        outs, lses = [], []
        for shard in shards:
            args = prepare_args(*shard.call_args(), softmax_scale=shard.softmax_scale, q_scale=shard.q_scale,
                                kv_scale=shard.kv_scale, row_kv_lens=shard.row_kv_lens)
            ws = MLAWorkspace("cpu", max_batch=len(lens), max_q_len=q_len, num_heads=16, num_sms=64,
                              max_splits=4, rows_per_cta=cfg.block_m)
            args.out.fill_(math.nan)
            args.lse.fill_(math.nan)
            launch(args, ws, LaunchConfig(split_plan="balanced", enable_pdl=False, tile=cfg.tile))
            outs.append(args.out)
            lses.append(args.lse)
        rows = compare_decode(*merge_with_vllm_kernel(outs, lses), *ref, kv_dtype)
        assert rows.ok, f"case {i}: {rows.summary()}"
        note = ""
        if q_len > 1:  # a row missing one key of ~100 can hide in the fp8 tolerance: compare with the right rule
            naive = compare_decode(*merge_partials(*zip(*(
                mla_decode(*s.call_args(), softmax_scale=s.softmax_scale, kernel="reference", **s.scale_kwargs())
                for s in shards))), *ref, kv_dtype)
            assert naive.max_abs_err > 4 * rows.max_abs_err, (
                f"case {i}: the naive local rule should not match (max |err| {naive.max_abs_err:.3g} against the "
                f"right rule's {rows.max_abs_err:.3g})")
            note = f"; naive local rule {naive.max_abs_err:.3g}"
        print(f"case {i}: ok (max |err| {rows.max_abs_err:.3g}{note})")


def main() -> None:
    check_slot_mapping()
    check_merge()
    check_kernel_per_shard()
    print("PASS")


if __name__ == "__main__":
    sys.exit(main())
