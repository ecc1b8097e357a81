"""GPU tests of decode context parallelism (DCP) on one GPU: every kernel on simulated ranks.

Each request's KV is split the way vLLM shards it across a DCP group (``cp_kv_cache_interleave_size`` 1 and
the page size; mla_backend_plugin/testing/dcp.py), every rank's shard gets its own paged cache (permuted pages,
NaN/inf in unread slots), the kernel runs once per shard through ``mla_decode(kernel=..., row_kv_lens=...)``
with the same q (all heads, as vLLM gathers them), the partial results are merged with vLLM's own merge
(``correct_attn_out``, what ``cp_lse_ag_out_rs`` runs, natural-log LSE) and compared with the float32 reference
over the unsplit cache. bf16 and fp8 caches, q_len 1..4, ragged lengths with empty shards, DCP 2 and 4; one
CUDA-graph replay with new lengths and per-row limits per kernel.

    MLA_TEST_KERNELS=cute_sm90,triton,xqa_sm120 pytest -m gpu tests/test_dcp_gpu.py
"""

from __future__ import annotations

import importlib.util
import math
import zlib

import pytest
import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops import MLAWorkspace, mla_decode, registry
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK
from mla_backend_plugin.ops.serving import dcp_row_kv_lens
from mla_backend_plugin.testing import (
    assert_close_decode,
    capture_graph,
    draw_seq_lens,
    make_decode_inputs,
    select_kernel_for_test,
)
from mla_backend_plugin.testing.dcp import shard_decode_inputs, vllm_merge

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (its DCP merge) is needed")]

DEVICE = "cuda"
KERNEL = "triton"  # set per test by the kernel_under_test fixture
GPU_KERNELS = tuple(k for k in registry.KERNELS if k != "reference")
BF16 = torch.bfloat16
GROUPS = [(2, 1), (2, "page"), (4, 1), (4, "page")]  # (DCP size, cp_kv_cache_interleave_size)


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch):
    monkeypatch.delenv("CUTE_MLA_KERNEL", raising=False)


@pytest.fixture(autouse=True, params=GPU_KERNELS)
def kernel_under_test(request, monkeypatch):
    return select_kernel_for_test(request.param, globals(), monkeypatch, DEVICE)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _run_ranks(inp, world: int, interleave: int, seed: int, *, check_shards: bool = True):
    """Every rank's (out, lse) from the kernel under test on its shard (NaN-poisoned outputs)."""
    outs, lses = [], []
    for rank in range(world):
        shard = shard_decode_inputs(inp, world, rank, interleave, seed=seed + rank, poison=("nan", "inf")[rank % 2])
        out, lse = shard.poisoned_outputs()
        mla_decode(*shard.call_args(), softmax_scale=shard.softmax_scale, out=out, lse=lse, kernel=KERNEL,
                   row_kv_lens=shard.row_kv_lens, **shard.scale_kwargs(rank % 2 == 1))
        torch.cuda.synchronize()
        if check_shards:  # the kernel on its own shard, with the per-row limits
            assert_close_decode(out, lse, *shard.reference(), inp.kv_dtype,
                                msg=f"rank {rank}/{world} interleave {interleave} local lens {shard.seq_lens_list}")
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("world,interleave", GROUPS, ids=lambda x: str(x))
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_dcp_ranks_merge_to_the_unsplit_result(kv, q_len, world, interleave):
    bs = 64
    interleave = bs if interleave == "page" else interleave
    seed = _seed("dcp", kv, q_len, world, interleave)
    # ragged: a request shorter than one interleave cycle (empty shards on some ranks), odd lengths, one long
    lens = draw_seq_lens(6, 1000, block_size=bs, seed=seed)
    lens[0] = q_len
    lens[1] = max(q_len, world * interleave - 1)
    lens[2] = 9000 + 3 * q_len
    fp8 = kv == "fp8"
    q_form = "fp8" if fp8 and q_len == 2 else "pair"  # an fp8 q (vLLM with CUTE_MLA_FP8_QUERY=1) once
    inp = make_decode_inputs(len(lens), lens, q_len, 128, bs, FP8_DTYPE if fp8 else BF16, q_form, DEVICE, seed,
                             q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None)
    outs, lses = _run_ranks(inp, world, interleave, seed)
    out, lse = vllm_merge(outs, lses, is_lse_base_on_e=True)
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, inp.kv_dtype,
                        msg=f"{KERNEL} DCP {world} interleave {interleave} q_len {q_len} {kv} lens {lens}")


@pytest.mark.parametrize("heads,bs,q_len", [(16, 16, 4), (32, 32, 2), (64, 16, 3)])
def test_dcp_other_heads_and_pages(heads, bs, q_len):
    """Fewer gathered heads (TP8 x DCP 1/2/4) and small pages, interleave 1 and the page size."""
    for world, interleave in ((2, bs), (4, 1)):
        seed = _seed("heads", heads, bs, q_len, world, interleave)
        lens = draw_seq_lens(5, 700, block_size=bs, seed=seed)
        lens[0] = q_len
        inp = make_decode_inputs(len(lens), lens, q_len, heads, bs, BF16, "pair", DEVICE, seed)
        out, lse = vllm_merge(*_run_ranks(inp, world, interleave, seed))
        assert_close_decode(out, lse, *inp.reference(), BF16, msg=f"{KERNEL} h{heads} bs{bs} DCP {world}")


def test_row_kv_lens_of_the_causal_rule_changes_nothing():
    """row_kv_lens equal to seq_len - q_len + 1 + t gives bit for bit what the kernel gives without it."""
    for kv in (BF16, FP8_DTYPE):
        seed = _seed("same", str(kv))
        lens = draw_seq_lens(5, 3000, block_size=64, seed=seed)
        inp = make_decode_inputs(5, lens, 3, 128, 64, kv, "pair", DEVICE, seed, kv_scale=3.0 if kv != BF16 else None)
        t = torch.arange(3, dtype=torch.int32, device=DEVICE)
        rule = (inp.seq_lens[:, None] - 2 + t[None, :]).clamp(min=0).to(torch.int32).contiguous()
        plain = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel=KERNEL, **inp.scale_kwargs())
        given = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel=KERNEL, row_kv_lens=rule,
                           **inp.scale_kwargs())
        torch.cuda.synchronize()
        assert torch.equal(plain[0], given[0]) and torch.equal(plain[1], given[1]), str(kv)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_dcp_cuda_graph_replay(kv):
    """One rank's decode captured once with its per-row limits (a persistent buffer, as the vLLM builder keeps
    it), replayed with new global lengths, local lengths, limits, block tables and KV."""
    world, rank, interleave, q_len, heads, bs, batch = 4, 1, 1, 3, 128, 64, 8
    width = 64
    max_local = width * bs
    fp8 = kv == "fp8"
    kv_dtype = FP8_DTYPE if fp8 else BF16
    num_blocks = batch * width + 37
    ws = MLAWorkspace(DEVICE, max_batch=16, max_q_len=4, num_heads=heads)

    def fresh(global_lens, seed):
        full = make_decode_inputs(batch, global_lens, q_len, heads, bs, kv_dtype, "pair", DEVICE, seed,
                                  kv_scale=3.0 if fp8 else None)
        shard = shard_decode_inputs(full, world, rank, interleave, seed=seed + 1)
        # the static tensors of the graph have fixed shapes: re-lay the shard into num_blocks x width
        fixed = make_decode_inputs(batch, shard.seq_lens_list, q_len, heads, bs, kv_dtype, "pair", DEVICE, seed + 2,
                                   kv_scale=3.0 if fp8 else None, num_blocks=num_blocks, max_blocks=width)
        raw, src = fixed.kv_cache.view(torch.int8), shard.kv_cache.view(torch.int8)
        for b, n in enumerate(shard.seq_lens_list):
            for j in range(0, n, bs):
                raw[fixed.block_table[b, j // bs]] = src[shard.block_table[b, j // bs]]
        return full, fixed

    first, static = fresh(draw_seq_lens(batch, 900, block_size=bs, seed=1), 11)
    q_nope, q_pe = static.q
    q_nope.copy_(first.q[0])
    q_pe.copy_(first.q[1])
    kv_cache, block_table, seq_lens = static.kv_cache, static.block_table, static.seq_lens
    global_lens = first.seq_lens.clone()
    row_kv_lens = torch.zeros(16 * 4, dtype=torch.int32, device=DEVICE)[:batch * q_len].view(batch, q_len)
    dcp_row_kv_lens(global_lens, q_len, world, rank, interleave, out=row_kv_lens)
    out = torch.empty(batch * q_len, heads, KV_LORA_RANK, dtype=BF16, device=DEVICE)
    lse = torch.empty(batch * q_len, heads, dtype=torch.float32, device=DEVICE)
    kv_scale = torch.tensor([3.0], device=DEVICE) if fp8 else None

    def run():
        mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale=static.softmax_scale,
                   kv_scale=kv_scale, out=out, lse=lse, workspace=ws, kernel=KERNEL, row_kv_lens=row_kv_lens)

    graph = capture_graph(lambda _: run())
    rounds = [[q_len, 5, 17, 64, 130, 333, 1000, 2001],
              draw_seq_lens(batch, world * max_local - 400, block_size=bs, seed=3, max_len=world * max_local - 64),
              [q_len, q_len + 1, 4, 3, 7, q_len, 9, 10]]
    for i, lens in enumerate(rounds):
        full, fixed = fresh(lens, 100 + i)
        q_nope.copy_(full.q[0])
        q_pe.copy_(full.q[1])
        kv_cache.copy_(fixed.kv_cache)
        block_table.copy_(fixed.block_table)
        seq_lens.copy_(fixed.seq_lens)
        global_lens.copy_(full.seq_lens)
        dcp_row_kv_lens(global_lens, q_len, world, rank, interleave, out=row_kv_lens)  # what the builder does
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref = mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, q_len, static.softmax_scale,
                                   None, kv_scale, row_kv_lens=row_kv_lens)
        assert_close_decode(out, lse, *ref, kv_dtype, msg=f"replay {i}: global lens {lens}")
