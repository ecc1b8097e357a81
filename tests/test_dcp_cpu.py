"""Decode context parallelism (DCP) on the CPU: the per-row limits in local positions, splitting a decode call
the way vLLM shards the KV cache, merging the ranks' results by their LSE, and the kernel API's row_kv_lens.

The vLLM builder's metadata under DCP is tested in tests/vllm_cpu_harness.py (scenarios dcp_decode and
dcp_refusals); vLLM's own slot mapping and merge kernels and our Triton kernel per shard run through Triton's
interpreter in dcp_interpret_check.py. GPU: tests/test_dcp_gpu.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from mla_backend_plugin.ops import DcpLayout, MLAWorkspace, mla_decode, prepare_args, registry, select_kernel, serving
from mla_backend_plugin.testing import assert_close_decode, compare_decode, make_decode_inputs
from mla_backend_plugin.testing.dcp import (
    local_positions,
    merge_partials,
    rank_of,
    shard_decode_inputs,
    shard_row_kv_lens,
)

HERE = os.path.dirname(os.path.abspath(__file__))
FP8 = torch.float8_e4m3fn
GROUPS = [(2, 1), (2, 16), (4, 1), (4, 64), (8, 1), (8, 16)]  # (DCP size, interleave)
LENS = [0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 33, 64, 100, 127, 128, 129, 255, 1000, 4097]


def test_local_lengths_match_vllm():
    """Our closed form of a rank's share is vLLM's get_dcp_local_seq_lens, and the token count."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    lens = torch.tensor(LENS, dtype=torch.int32)
    for world, interleave in GROUPS:
        for rank in range(world):
            ours = serving.dcp_local_kv_lens(lens, world, rank, interleave)
            assert ours.dtype == torch.int32
            assert torch.equal(ours, get_dcp_local_seq_lens(lens, world, rank, interleave)), (world, interleave)
            assert ours.tolist() == [len(local_positions(s, world, rank, interleave)) for s in LENS]


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_row_limits_in_local_positions(q_len):
    """Row t sees this rank's tokens below seq_len - q_len + 1 + t: the closed form equals the token count, the
    last row sees every local key, and the limits are not the local causal rule local_len - q_len + 1 + t."""
    naive_differs = False
    for world, interleave in GROUPS:
        for rank in range(world):
            expected = shard_row_kv_lens(LENS, q_len, world, rank, interleave)
            got = serving.dcp_row_kv_lens(torch.tensor(LENS, dtype=torch.int32), q_len, world, rank, interleave)
            assert got.dtype == torch.int32 and got.tolist() == expected, (world, interleave, rank)
            local = serving.dcp_local_kv_lens(torch.tensor(LENS), world, rank, interleave).tolist()
            for row, n in zip(expected, local):
                assert row[-1] == n and row == sorted(row)
                assert all(n - (q_len - 1 - t) <= row[t] <= n for t in range(q_len))  # never fewer than the rule
                naive_differs |= row != [max(n - q_len + 1 + t, 0) for t in range(q_len)]
            out = torch.full((len(LENS), q_len), -5, dtype=torch.int32)
            assert serving.dcp_row_kv_lens(torch.tensor(LENS), q_len, world, rank, interleave, out=out) is out
            assert out.tolist() == expected
    assert naive_differs == (q_len > 1)


def test_shard_holds_the_ranks_tokens():
    inp = make_decode_inputs(3, [40, 7, 0], 2, 16, 16, torch.bfloat16, "pair", "cpu", 1)
    world, interleave = 4, 2
    rows = inp.kv_cache.view(torch.int16)
    for rank in range(world):
        shard = shard_decode_inputs(inp, world, rank, interleave, seed=rank)
        assert shard.q is inp.q and shard.seq_lens_list == [len(local_positions(s, world, rank, interleave))
                                                            for s in inp.seq_lens_list]
        for b, s in enumerate(inp.seq_lens_list):
            for j, p in enumerate(local_positions(s, world, rank, interleave)):
                assert rank_of(p, world, interleave) == rank
                mine = shard.kv_cache.view(torch.int16)[shard.block_table[b, j // 16], j % 16]
                theirs = rows[inp.block_table[b, p // 16], p % 16]
                assert torch.equal(mine, theirs)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_reference_per_shard_merges_to_the_unsplit_result(kv_dtype, q_len):
    """Every rank's decode (the reference kernel through mla_decode, with its row_kv_lens) merged by the LSE is
    attention over the whole cache; with the naive local rule it is not (q_len > 1)."""
    lens = [q_len, 5, 17, 64, 129, 300]
    fp8 = kv_dtype == FP8
    inp = make_decode_inputs(len(lens), lens, q_len, 16, 16, kv_dtype, "pair", "cpu", q_len,
                             kv_scale=2.0 if fp8 else None)
    ref = inp.reference()
    for world, interleave in GROUPS[:4]:
        results = {}
        for rule in ("rows", "naive"):
            outs, lses = [], []
            for rank in range(world):
                shard = shard_decode_inputs(inp, world, rank, interleave, seed=rank)
                out, lse = mla_decode(*shard.call_args(), softmax_scale=shard.softmax_scale, kernel="reference",
                                      row_kv_lens=shard.row_kv_lens if rule == "rows" else None,
                                      **shard.scale_kwargs())
                outs.append(out)
                lses.append(lse)
            results[rule] = compare_decode(*merge_partials(outs, lses), *ref, kv_dtype)
        rows, naive = results["rows"], results["naive"]
        assert rows.ok, f"world {world} interleave {interleave}: {rows.summary()}"
        # a row missing one key can hide in the fp8 tolerance: compare the errors themselves
        assert (naive.max_abs_err > 4 * rows.max_abs_err) == (q_len > 1), (world, interleave, naive)


def test_dcp_through_triton_and_vllm_in_the_interpreter():
    """vLLM's slot mapping and merge kernels, our Triton kernel per shard (dcp_interpret_check.py)."""
    pytest.importorskip("triton")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from cuda_driver_stub import env_with_driver

    env = dict(env_with_driver(), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "dcp_interpret_check.py")], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


# ---- the kernel API's row_kv_lens ----


def _call(row_kv_lens, q_len=2):
    q = torch.zeros(2 * q_len, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    return prepare_args(q, kv, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 20], dtype=torch.int32),
                        softmax_scale=0.1, row_kv_lens=row_kv_lens)


@pytest.mark.parametrize("bad,match", [
    (torch.ones(2, 2, dtype=torch.int64), r"row_kv_lens: must be an int32 tensor \[batch, q_len\] = \[2, 2\]"),
    (torch.ones(2, 3, dtype=torch.int32), r"row_kv_lens: must be an int32 tensor .* got torch.int32 \(2, 3\)"),
    (torch.ones(4, dtype=torch.int32), r"row_kv_lens: must be an int32 tensor"),
    ([[1, 2], [3, 4]], r"row_kv_lens: .* got list"),
    (torch.ones(2, 4, dtype=torch.int32)[:, ::2], r"row_kv_lens: must be contiguous"),
])
def test_row_kv_lens_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        _call(bad)


def test_row_kv_lens_reaches_the_kernel_and_is_capped_at_seq_len():
    inp = make_decode_inputs(2, [20, 9], 3, 16, 16, torch.bfloat16, "pair", "cpu", 5)
    limits = torch.tensor([[3, 30, 20], [0, 9, 9]], dtype=torch.int32)  # 30 > seq_len 20: capped
    args = prepare_args(*inp.call_args(), softmax_scale=inp.softmax_scale, row_kv_lens=limits)
    assert args.row_kv_lens is limits
    out, lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference", row_kv_lens=limits)
    expected = dataclasses.replace(inp, row_kv_lens=torch.tensor([[3, 20, 20], [0, 9, 9]], dtype=torch.int32))
    assert_close_decode(out, lse, *expected.reference(), torch.bfloat16)
    assert torch.isneginf(lse[3]).all() and (out[3] == 0).all()  # request 1, row 0 sees no key
    default = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference")
    rule = torch.tensor([[18, 19, 20], [7, 8, 9]], dtype=torch.int32)
    given = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference", row_kv_lens=rule)
    assert torch.equal(default[0], given[0]) and torch.equal(default[1], given[1])


def test_registry_refuses_a_family_without_row_kv_lens():
    args = _call(torch.ones(2, 2, dtype=torch.int32))
    for name in ("reference", "triton", "cute_sm90", "xqa_sm120"):
        assert registry.KERNELS[name].supports_row_kv_lens, name
    legacy = dataclasses.replace(registry.KERNELS["reference"], name="legacy", supports_row_kv_lens=False)
    assert "does not support row_kv_lens" in registry.unsupported_reason(legacy, args, None)
    assert registry.unsupported_reason(legacy, _call(None), None) is None
    assert select_kernel(args, "reference").name == "reference"


def test_decode_runner_passes_row_kv_lens(monkeypatch):
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    inp = make_decode_inputs(2, [20, 9], 2, 16, 16, torch.bfloat16, "cat", "cpu", 6)
    shard = shard_decode_inputs(inp, 2, 1, 1, seed=1)
    ws = MLAWorkspace("cpu", max_batch=4, max_q_len=2, num_heads=16, num_sms=8, out_dtype=torch.bfloat16)
    runner = serving.DecodeRunner(inp.softmax_scale, "auto")
    out, lse = runner.decode(shard.q, shard.kv_cache, shard.block_table, shard.seq_lens, ws,
                             row_kv_lens=shard.row_kv_lens)
    assert_close_decode(out, lse, *shard.reference(), torch.bfloat16)


def test_decode_runner_passes_the_dcp_layout_sliced_with_the_batch(monkeypatch):
    """DecodeRunner hands mla_decode the layout next to row_kv_lens; a batch past the workspace runs in slices,
    each with its requests' global lengths."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    inp = make_decode_inputs(2, [20, 9], 2, 16, 16, torch.bfloat16, "cat", "cpu", 6)
    shard = shard_decode_inputs(inp, 2, 1, 1, seed=1)
    layout = DcpLayout(2, 1, 1, torch.tensor([20, 9], dtype=torch.int32))
    calls = []

    def recording(*a, **kw):
        calls.append(kw["dcp"])
        return mla_decode(*a, **kw)

    monkeypatch.setattr(serving, "mla_decode", recording)
    runner = serving.DecodeRunner(inp.softmax_scale, "auto")
    for max_batch, expected in ((4, [[20, 9]]), (1, [[20], [9]])):
        calls.clear()
        ws = MLAWorkspace("cpu", max_batch=max_batch, max_q_len=2, num_heads=16, num_sms=8,
                          out_dtype=torch.bfloat16)
        out, lse = runner.decode(shard.q, shard.kv_cache, shard.block_table, shard.seq_lens, ws,
                                 row_kv_lens=shard.row_kv_lens, dcp=layout)
        assert [c.global_seq_lens.tolist() for c in calls] == expected
        assert all((c.world, c.rank, c.interleave) == (2, 1, 1) for c in calls)
        assert_close_decode(out, lse, *shard.reference(), torch.bfloat16)


def test_check_num_heads_counts_the_gathered_heads():
    assert serving.check_num_heads(64, 2) == 128 and serving.check_num_heads(16) == 16
    with pytest.raises(ValueError, match=r"24 attention heads per rank x decode_context_parallel_size 2 = 48 query "
                                         r"heads per decode call is not supported; allowed: \(16, 32, 64, 128\)"):
        serving.check_num_heads(24, 2)
    with pytest.raises(ValueError, match=r"40 attention heads per rank is not supported"):
        serving.check_num_heads(40)


def test_cute_sm90_variant_and_prebuilt_list():
    from mla_backend_plugin.kernels.cute_sm90 import build, launch

    args = _call(torch.ones(2, 2, dtype=torch.int32))
    v = launch.variant_for(args, launch.default_config(args, (9, 0)))
    assert v.row_kv_lens and " row_kv_lens" in v.name
    assert not launch.variant_for(_call(None), launch.default_config(args, (9, 0))).row_kv_lens
    assert any(v.row_kv_lens and v.kv_dtype == "fp8" and v.fp8_mma for v in build.serving_variants())
