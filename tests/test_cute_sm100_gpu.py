"""GPU tests aimed at what is particular to cute_sm100 (the CuTe-DSL Blackwell kernel), against the float32
reference. They run on an SM100/SM103 GPU only and skip elsewhere with the kernel's reason (e.g. "is built for
sm_100 family ... device has compute capability 9.0"). Every generic case (batch x length grid, q_len x heads
x dtype x block size, scales, CUDA graphs) is in tests/test_ops_gpu.py, which runs cute_sm100 too.

Written before any Blackwell GPU was available to the project: nothing here has run yet.

* the V tail: a request whose length ends inside a V box (its last page slice) is loaded as 8- and 1-key boxes,
  the rest zero-filled; every remainder mod 8 and every block size, with NaN / inf in the unread slots;
* the 2-CTA row split: padded rows (16 heads), two m-blocks (q_len 3 at 64 heads, q_len 4 at 128 heads);
* split-KV on the balanced plan with the shared combine (one long request among short ones), and the split list
  the kernel writes;
* fp8 caches with a bf16 q (e4m3 hi + lo) and with an fp8 q;
* PDL on and off give bit-identical results.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend_plugin.ops import LaunchConfig, MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.plan import balanced_schedule
from mla_backend_plugin.testing import assert_close_decode, make_decode_inputs, select_kernel_for_test

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
KERNEL = "cute_sm100"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def only_on_sm100(monkeypatch):
    monkeypatch.delenv("CUTE_MLA_KERNEL", raising=False)
    return select_kernel_for_test(KERNEL, globals(), monkeypatch, DEVICE)


def _run(inp, *, config=None, workspace=None, as_tensor=False):
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel=KERNEL,
               workspace=workspace, config=config, **inp.scale_kwargs(as_tensor))
    torch.cuda.synchronize()
    return out, lse


def _check(inp, **kw):
    out, lse = _run(inp, **kw)
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, inp.kv_cache.dtype,
                        msg=f"B={inp.batch} q_len={inp.q_len} H={inp.num_heads} bs={inp.kv_cache.shape[1]} "
                            f"lens={inp.seq_lens_list[:6]}")
    return out, lse


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_v_tail_never_reads_unwritten_slots(bs, poison):
    """Lengths ending at every remainder mod 8 inside a V box, and on a box boundary."""
    lens = [128 * 3 + 32 * k + r for k in range(2) for r in range(8)] + [bs, 2 * bs + 1, 1, 7]
    inp = make_decode_inputs(len(lens), lens, 1, 16, bs, BF16, "pair", DEVICE, seed=bs, poison=poison)
    _check(inp)


@pytest.mark.parametrize("heads,q_len", [(16, 1), (16, 4), (32, 3), (64, 3), (128, 4)])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_rows_across_the_pair_and_m_blocks(heads, q_len, kv):
    lens = [q_len - 1 if q_len > 1 else 1, 300, 1029]  # the first request: some rows see no key
    inp = make_decode_inputs(3, lens, q_len, heads, 64, FP8_DTYPE if kv == "fp8" else BF16, "pair", DEVICE,
                             seed=heads * 10 + q_len, kv_scale=3.0 if kv == "fp8" else None)
    _check(inp, as_tensor=kv == "fp8")


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_balanced_split_and_combine(batch):
    """One 33k-token request among short ones is split into slots; the kernel writes the combine's split list."""
    lens = [33_000] + [200 + 37 * i for i in range(batch - 1)]
    inp = make_decode_inputs(batch, lens, 2, 128, 64, BF16, "pair", DEVICE, seed=batch)
    ws = MLAWorkspace(DEVICE, max_batch=batch, max_q_len=2, num_heads=128)
    _check(inp, workspace=ws)
    plan = ws.plan(batch, 2, balanced=True, rows_per_cta=64)
    sched = balanced_schedule(lens, 128, plan.min_chunk, plan.work_target, plan.num_splits)
    index = ws.split_index.tolist()
    assert index[0] == len(sched.split_requests) >= 1
    for j, b in enumerate(sched.split_requests):
        assert index[1 + 3 * j: 4 + 3 * j] == [b, sched.slot_base[b], sched.splits[b]]


@pytest.mark.parametrize("q_form,q_scale", [("pair", None), ("cat", None), ("fp8", 2.0)])
@pytest.mark.parametrize("bs", [16, 64])
def test_fp8_cache_q_forms(q_form, q_scale, bs):
    lens = [2000, 4097, 33]
    inp = make_decode_inputs(3, lens, 2, 128, bs, FP8_DTYPE, q_form, DEVICE, seed=bs, q_scale=q_scale,
                             kv_scale=2.5)
    _check(inp, as_tensor=True)


def test_pdl_on_and_off_agree_bit_for_bit():
    inp = make_decode_inputs(4, [5000, 77, 1024, 129], 1, 128, 64, BF16, "pair", DEVICE, seed=5)
    on = _run(inp, config=LaunchConfig(enable_pdl=True))
    off = _run(inp, config=LaunchConfig(enable_pdl=False))
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
