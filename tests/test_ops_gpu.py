"""GPU tests: every decode kernel against the float32 torch reference (``pytest -m gpu tests/``).

Each test runs once per kernel of ``registry.KERNELS`` (the reference excepted) and skips for a kernel that
cannot run on this GPU (``unsupported_reason``); ``MLA_TEST_KERNELS=cute_sm90,triton`` narrows the list.

Every call writes into NaN-poisoned ``out``/``lse`` so an element the kernel forgets to write fails, and the
inputs come from ``make_decode_inputs`` (permuted pages, garbage block-table padding pointing at spare pages,
NaN or +-inf in every KV slot no request may read, q_pe as a strided view). The axes (batch, KV length, q_len,
heads, block size, dtypes, scale forms) are covered by several small grids instead of their full product, to keep
the file to a few minutes:

* ``test_batch_seq_grid``: every (batch, seq_len) pair, bf16, q_len 1, 128 heads, block 64;
* ``test_qlen_heads_dtype_block``: every (q_len, heads, KV dtype, block size) at batch 3, ~300 tokens, with
  the fp8 cases cycling through the q forms and scale forms (float / tensor, (1, 1) and (2, 3));
* ``test_long_seq_spec_decode``: 4K and 33K tokens with q_len > 1 and other head counts at small batch;
* ``test_fp8_scales`` / ``test_fp16``: every scale form and dtype combination at one shape;
* padded requests, block size 128, q forms, kernel="auto", workspaces and a CUDA-graph replay test.

The total KV per case is bounded (``MAX_TOTAL_TOKENS``): at large batch x long length only some requests are
long. Triton compiles one kernel per (heads, q_len, block size, split count, dtypes, scale form); most of
the runtime is those compiles.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch

from mla_backend_plugin import envs
from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops import MLAWorkspace, mla_decode, prepare_args, registry, select_kernel
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, WORK_ITEM_INTS
from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY, BalancedSchedule, ShareSchedule, step_schedule
from mla_backend_plugin.testing import (
    assert_close_decode,
    capture_graph,
    draw_seq_lens,
    make_decode_inputs,
    select_kernel_for_test,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
KERNEL = "triton"  # set per test by the kernel_under_test fixture
GPU_KERNELS = tuple(k for k in registry.KERNELS if k != "reference")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, FP8_DTYPE
MAX_TOTAL_TOKENS = 1_300_000  # KV tokens per case (about 1.5 GB in bf16)

BATCHES = (1, 3, 32, 129)
SEQ_LENS = (1, 17, 1000, 4096, 33000)
Q_LENS = (1, 2, 4)
HEADS = (16, 128)
BLOCK_SIZES = (16, 32, 64)

KERNEL_ENV_VAR = "CUTE_MLA_KERNEL"


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV_VAR, raising=False)


@pytest.fixture(autouse=True, params=GPU_KERNELS)
def kernel_under_test(request, monkeypatch):
    return select_kernel_for_test(request.param, globals(), monkeypatch, DEVICE)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _poison(seed: int) -> str:
    """NaN or +-inf in every slot no request may read (the tail of each last page, spare pages that the
    block-table padding points at), alternating by case."""
    return ("nan", "inf")[seed % 2]


def _sync() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _describe(inp) -> str:
    lens = inp.seq_lens_list
    return (f"B={inp.batch} q_len={inp.q_len} H={inp.num_heads} bs={inp.kv_cache.shape[1]} "
            f"kv={inp.kv_cache.dtype} q={'pair' if isinstance(inp.q, tuple) else inp.q.dtype} "
            f"q_scale={inp.q_scale} kv_scale={inp.kv_scale} seq_lens[min={min(lens)}, max={max(lens)}, "
            f"first={lens[:6]}]")


def _check(inp, *, scales_as_tensor=False, kernel=None, workspace=None, msg=""):
    """Run mla_decode into NaN-poisoned outputs and compare with the reference."""
    out, lse = inp.poisoned_outputs()
    r_out, r_lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse,
                              kernel=kernel or KERNEL, workspace=workspace, **inp.scale_kwargs(scales_as_tensor))
    assert r_out is out and r_lse is lse
    _sync()
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, inp.kv_cache.dtype, msg=f"{msg} {_describe(inp)}".strip())
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# every (batch, seq_len) pair
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", SEQ_LENS, ids=lambda s: f"S{s}")
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{b}")
def test_batch_seq_grid(batch, seq):
    bs = 64
    lens = draw_seq_lens(batch, seq, block_size=bs, seed=_seed(batch, seq), max_total_tokens=MAX_TOTAL_TOKENS)
    seed = _seed("grid", batch, seq)
    inp = make_decode_inputs(batch, lens, 1, 128, bs, BF16, "pair", DEVICE, seed, poison=_poison(seed))
    _check(inp)


# ---------------------------------------------------------------------------------------------------------
# every (q_len, heads, KV dtype, block size) at a small batch
# ---------------------------------------------------------------------------------------------------------

# (q form, q_scale, kv_scale, scales as tensors) for the fp8-cache cases, cycled over the grid below
_FP8_VARIANTS = (
    ("pair", None, 1.0, False),
    ("pair", None, 3.0, True),
    ("fp8", 2.0, 3.0, False),
    ("fp8", 2.0, 3.0, True),
    ("fp8", 1.0, 1.0, False),
    ("cat", None, 3.0, False),
)


def _combo_params():
    params = []
    for iq, q_len in enumerate(Q_LENS):
        for ih, heads in enumerate(HEADS):
            for ib, bs in enumerate(BLOCK_SIZES):
                for kv in ("bf16", "fp8"):
                    if kv == "fp8":
                        q_form, q_scale, kv_scale, as_tensor = _FP8_VARIANTS[(3 * iq + ib + 2 * ih) % 6]
                        tag = f"fp8-{q_form}-s{q_scale or 1:g}x{kv_scale:g}-{'tensor' if as_tensor else 'float'}"
                    else:
                        q_form = "pair" if (iq + ib) % 2 == 0 else "cat"
                        q_scale, kv_scale, as_tensor = None, None, False
                        tag = f"bf16-{q_form}"
                    params.append(pytest.param(q_len, heads, bs, kv, q_form, q_scale, kv_scale, as_tensor,
                                               id=f"q{q_len}-h{heads}-bs{bs}-{tag}"))
    return params


@pytest.mark.parametrize("q_len,heads,bs,kv,q_form,q_scale,kv_scale,as_tensor", _combo_params())
def test_qlen_heads_dtype_block(q_len, heads, bs, kv, q_form, q_scale, kv_scale, as_tensor):
    seed = _seed("combo", q_len, heads, bs, kv)
    a, b = draw_seq_lens(2, 300, block_size=bs, seed=seed)
    short = q_len - 1 if q_len > 1 else 1  # with q_len > 1 the first rows of this request see no key
    lens = [a, short, b]
    inp = make_decode_inputs(3, lens, q_len, heads, bs, FP8 if kv == "fp8" else BF16, q_form, DEVICE, seed,
                             q_scale=q_scale, kv_scale=kv_scale, poison=_poison(seed))
    _check(inp, scales_as_tensor=as_tensor)


# ---------------------------------------------------------------------------------------------------------
# long sequences with speculative tokens and the other head counts, at small batch
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,seq,q_len,heads,bs,kv_dtype,q_form,q_scale,kv_scale,as_tensor", [
    pytest.param(1, 33000, 4, 128, 64, FP8, "pair", None, 3.0, True, id="B1-S33000-q4-h128-fp8kv"),
    pytest.param(3, 33000, 4, 32, 64, FP8, "fp8", 2.0, 3.0, False, id="B3-S33000-q4-h32-fp8q"),
    pytest.param(2, 33000, 1, 16, 16, BF16, "pair", None, None, False, id="B2-S33000-q1-h16-bs16"),
    pytest.param(3, 4096, 2, 16, 16, BF16, "pair", None, None, False, id="B3-S4096-q2-h16"),
    pytest.param(1, 4096, 3, 64, 32, BF16, "cat", None, None, False, id="B1-S4096-q3-h64"),
    pytest.param(3, 1000, 4, 128, 32, BF16, "pair", None, None, False, id="B3-S1000-q4-h128"),
])
def test_long_seq_spec_decode(batch, seq, q_len, heads, bs, kv_dtype, q_form, q_scale, kv_scale, as_tensor):
    seed = _seed("long", batch, seq, q_len, heads)
    lens = draw_seq_lens(batch, seq, block_size=bs, seed=seed, max_total_tokens=MAX_TOTAL_TOKENS)
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, kv_dtype, q_form, DEVICE, seed,
                             q_scale=q_scale, kv_scale=kv_scale)
    _check(inp, scales_as_tensor=as_tensor)


# ---------------------------------------------------------------------------------------------------------
# fp8 scales (Python floats and 1-element float32 device tensors) and fp16
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_form,kv_dtype,q_scale,kv_scale,as_tensor", [
    pytest.param("pair", FP8, None, 1.0, False, id="kv8-1-float"),
    pytest.param("pair", FP8, None, 3.0, False, id="kv8-3-float"),
    pytest.param("pair", FP8, None, 3.0, True, id="kv8-3-tensor"),
    pytest.param("fp8", FP8, 1.0, 1.0, False, id="q8kv8-1x1-float"),
    pytest.param("fp8", FP8, 1.0, 1.0, True, id="q8kv8-1x1-tensor"),
    pytest.param("fp8", FP8, 2.0, 3.0, False, id="q8kv8-2x3-float"),
    pytest.param("fp8", FP8, 2.0, 3.0, True, id="q8kv8-2x3-tensor"),
    pytest.param("fp8", FP8, 2.0, 3.0, (True, False), id="q8kv8-2x3-qtensor-kvfloat"),
    pytest.param("fp8", BF16, 2.0, None, False, id="q8kv16-2-float"),
    pytest.param("fp8", BF16, 2.0, None, True, id="q8kv16-2-tensor"),
])
def test_fp8_scales(q_form, kv_dtype, q_scale, kv_scale, as_tensor):
    seed = _seed("scales", q_form, str(kv_dtype), q_scale, kv_scale)
    lens = draw_seq_lens(3, 700, block_size=64, seed=seed)
    inp = make_decode_inputs(3, lens, 2, 128, 64, kv_dtype, q_form, DEVICE, seed, q_scale=q_scale,
                             kv_scale=kv_scale)
    _check(inp, scales_as_tensor=as_tensor)


def test_zero_dim_scale_tensors():
    """vLLM hands the fp8 scales over as 0-d tensors (layer._k_scale); they are read on the device."""
    seed = _seed("scales-0d")
    inp = make_decode_inputs(3, [300, 1, 700], 1, 128, 64, FP8, "fp8", DEVICE, seed, q_scale=2.0, kv_scale=3.0)
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel=KERNEL,
               q_scale=torch.tensor(2.0, device=DEVICE), kv_scale=torch.tensor(3.0, device=DEVICE))
    _sync()
    assert_close_decode(out, lse, *inp.reference(), FP8, msg="0-d scales")


@pytest.mark.parametrize("kv_dtype,bs", [(FP8, 64), (BF16, 16)], ids=["fp8-bs64", "bf16-bs16"])
def test_cache_larger_than_2gib(kv_dtype, bs):
    """Pages past the first 2 GiB of the cache (B=128 x 32k tokens of fp8 is 2.4 GB): a 32-bit page offset
    wraps around and reads someone else's memory (an illegal address on the H100 before the fix)."""
    seed = _seed("big-cache", str(kv_dtype), bs)
    inp = make_decode_inputs(2, [700, 301], 2, 128, bs, kv_dtype, "pair", DEVICE, seed,
                             kv_scale=2.0 if kv_dtype == FP8 else None)
    small = inp.kv_cache
    page_bytes = small[0].numel() * small.element_size()
    n_big = (2**31 + 2**27) // page_bytes + small.shape[0]
    big = torch.zeros((n_big,) + tuple(small.shape[1:]), dtype=small.dtype, device=DEVICE)
    offset = n_big - small.shape[0]
    big[offset:] = small  # every page the requests own lies past 2 GiB
    table = inp.block_table.clone()
    table[table < small.shape[0]] += offset  # garbage ids past each request's pages stay garbage
    out, lse = inp.poisoned_outputs()
    mla_decode(inp.q, big, table, inp.seq_lens, softmax_scale=inp.softmax_scale, out=out, lse=lse,
               kernel=KERNEL, **inp.scale_kwargs(False))
    _sync()
    assert_close_decode(out, lse, *inp.reference(), kv_dtype, msg="cache > 2 GiB")
    del big


@pytest.mark.parametrize("batch,seq,q_len,heads,bs,q_form,kv_dtype,q_scale,kv_scale,as_tensor", [
    pytest.param(32, 1000, 1, 128, 16, "pair", FP16, None, None, False, id="fp16q-fp16kv-B32"),
    pytest.param(1, 4096, 2, 128, 64, "cat", FP16, None, None, False, id="fp16q-cat-fp16kv-B1-S4096"),
    pytest.param(3, 500, 4, 16, 32, "pair", FP8, None, 3.0, True, id="fp16q-fp8kv-tensor"),
    pytest.param(3, 700, 2, 128, 64, "fp8", FP8, 2.0, 3.0, False, id="fp8q-fp8kv-fp16out"),
    pytest.param(3, 700, 1, 128, 64, "fp8", FP16, 2.0, None, True, id="fp8q-fp16kv-fp16out"),
])
def test_fp16(batch, seq, q_len, heads, bs, q_form, kv_dtype, q_scale, kv_scale, as_tensor):
    seed = _seed("fp16", batch, seq, q_len, heads, q_form, str(kv_dtype))
    lens = draw_seq_lens(batch, seq, block_size=bs, seed=seed)
    q_dtype = None if q_form == "fp8" else FP16
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, kv_dtype, q_form, DEVICE, seed, q_dtype=q_dtype,
                             out_dtype=FP16, q_scale=q_scale, kv_scale=kv_scale)
    assert inp.out_dtype == FP16
    out, _ = _check(inp, scales_as_tensor=as_tensor)
    assert out.dtype == FP16


# ---------------------------------------------------------------------------------------------------------
# padded requests, block size 128
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch,q_len,heads,bs", [
    pytest.param(129, 1, 128, 64, id="B129-q1-nosplit"),
    pytest.param(32, 1, 128, 64, id="B32-q1-split"),
    pytest.param(3, 4, 16, 16, id="B3-q4-split"),
])
def test_padded_requests(batch, q_len, heads, bs):
    """seq_len 0 (a CUDA-graph padding slot) and seq_len < q_len: rows without a key give out 0, lse -inf."""
    seed = _seed("pad", batch, q_len)
    lens = draw_seq_lens(batch, 300, block_size=bs, seed=seed)
    for i in range(3, batch, 3):
        lens[i] = 0
    lens[-1] = 0
    lens[1] = 1  # with q_len > 1: fewer keys than query tokens, the first rows see none
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, BF16, "pair", DEVICE, seed)
    out, lse = _check(inp)
    assert torch.isneginf(lse[(batch - 1) * q_len:]).all() and (out[(batch - 1) * q_len:] == 0).all()
    # the whole batch padded
    inp = make_decode_inputs(batch, [0] * batch, q_len, heads, bs, BF16, "pair", DEVICE, seed + 1)
    out, lse = _check(inp)
    assert torch.isneginf(lse).all() and (out == 0).all()


@pytest.mark.parametrize("batch,q_len,heads,kv_kind", [
    pytest.param(129, 1, 128, "bf16", id="B129-q1-h128-bf16"),
    pytest.param(40, 2, 128, "fp8", id="B40-q2-h128-fp8"),
    pytest.param(8, 1, 16, "bf16", id="B8-q1-h16-bf16"),
])
def test_one_long_request_among_short_ones(batch, q_len, heads, kv_kind):
    """A 33k-token request in a batch of ~200-token ones (and a padded slot): correct output, and for the
    kernels that run the balanced split plan the split list the kernel wrote for the combine is exactly
    ops/plan.py balanced_schedule's (the long request split even when the batch fills the GPU)."""
    bs = 64
    seed = _seed("one-long", batch, q_len, heads, kv_kind)
    lens = draw_seq_lens(batch, 200, block_size=bs, seed=seed)
    lens[batch // 2] = 33001
    lens[1] = 0
    fp8 = kv_kind == "fp8"
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, "pair", DEVICE, seed,
                             kv_scale=3.0 if fp8 else None)
    sched, _ = _check_balanced_split_list(inp, lens, q_len, heads)
    if sched is not None:
        assert sched.splits[batch // 2] > 1, sched.splits


def _check_balanced_split_list(inp, lens, q_len, heads, split_capacity=None):
    """Runs ``inp`` on a fresh workspace (room for ``split_capacity`` splits per request; the serving backends
    make theirs with SPLIT_CAPACITY) against the reference; for cute_sm90 also checks that the split list the
    kernel wrote for the combine and its step table are exactly the reference's (ops/plan.py
    ``step_schedule`` under CUTE_MLA_SM90_PLAN, with the caps cute_sm90's launch gives the default config):
    returns (schedule, plan)."""
    from types import SimpleNamespace

    from mla_backend_plugin.kernels.cute_sm90 import launch as cute_launch
    from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_M as CUTE_BLOCK_M
    from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_N as CUTE_BLOCK_N

    batch = len(lens)
    ws = MLAWorkspace(DEVICE, max_batch=batch, max_q_len=q_len, num_heads=heads, split_capacity=split_capacity)
    ws.split_index.fill_(-7)
    _check(inp, workspace=ws)
    if KERNEL != "cute_sm90":
        return None, None  # triton's list is checked bit for bit in the interpreter (tests/test_planner_balanced.py)
    mode = envs.CUTE_MLA_SM90_PLAN  # the whole file may run under any (docs/perf/split_plan.md)
    shape = SimpleNamespace(batch=batch, q_len=q_len)
    config = cute_launch.wave_filling_config(shape, ws, LaunchConfig(split_plan=mode))
    plan = ws.plan_for(shape, PlanTile(CUTE_BLOCK_M, CUTE_BLOCK_N), config)
    sched = step_schedule(lens, CUTE_BLOCK_N, plan, mode)
    if isinstance(sched, ShareSchedule):
        return _check_share_table(ws, lens, plan, sched), plan
    expected = [len(sched.split_requests)]
    for b in sched.split_requests:
        expected += [b, sched.slot_base[b], sched.splits[b]]
    assert ws.split_index[:len(expected)].tolist() == expected
    # the step's table: the items longest first (BalancedSchedule.longest_first), each with its own slot w; the
    # places past the schedule's end say so (request + 1 = 0)
    table = ws.work_items[:plan.grid_items * WORK_ITEM_INTS].view(plan.grid_items, WORK_ITEM_INTS).tolist()
    for r, w in enumerate(sched.longest_first()):
        b, s = sched.items[w]
        chunk, n = sched.chunk[b], sched.splits[b]
        start, end = s * chunk, min((s + 1) * chunk, lens[b])
        want = [b + 1, b, lens[b], n, w - s, start, end, -(-max(end - start, 0) // CUTE_BLOCK_N), w]
        assert table[r] == want, (r, table[r], want)
    assert all(row[0] == 0 for row in table[len(sched.items):])
    return sched, plan


def _check_share_table(ws, lens, plan, sched):
    """cute_sm90 under the share plan: the split list and the step's table (the pieces longest first, each with
    its slot; exits past them) the plan kernel wrote are exactly ops/plan.py share_schedule's."""
    from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_N as CUTE_BLOCK_N

    expected = [len(sched.split_requests)]
    for b in sched.split_requests:
        expected += [b, sched.slot_base[b], sched.splits[b]]
    assert ws.split_index[:len(expected)].tolist() == expected
    table = ws.work_items[:plan.grid_items * WORK_ITEM_INTS].view(plan.grid_items, WORK_ITEM_INTS).tolist()
    for r, i in enumerate(sched.longest_first()):
        b, k, t0, t1 = sched.pieces[i]
        start, end = t0 * CUTE_BLOCK_N, min(t1 * CUTE_BLOCK_N, lens[b])
        slot0 = sched.slot_base[b] if sched.splits[b] > 1 else 0
        want = [b + 1, b, lens[b], sched.splits[b], slot0, start, end, -(-max(end - start, 0) // CUTE_BLOCK_N),
                slot0 + k]
        assert table[r] == want, (r, table[r], want)
    assert all(row[0] == 0 for row in table[len(sched.pieces):])
    return sched


@pytest.mark.parametrize("kv_kind,q_form,q_len", [("bf16", "pair", 1), ("fp8", "fp8", 1), ("fp8", "pair", 2),
                                                  ("bf16", "pair", 4)])
def test_share_plan_splits_at_share_boundaries(kv_kind, q_form, q_len, monkeypatch):
    """cute_sm90 with CUTE_MLA_SM90_PLAN=shares on the batches it is for: a long tail (lengths 0 and 1 among
    them) and one long request, so requests are split where share boundaries cross them (pieces of unequal
    length, merged by the combine: fused at batch 3, the combine kernel at batch 70). Correct output in every
    design (bf16 seesaw, fp8 q design B, bf16 q on an fp8 cache: design A at batch 3, B at 70; q_len 4), and the
    table is the reference's."""
    if KERNEL != "cute_sm90":
        pytest.skip("the share plan is cute_sm90's")
    monkeypatch.setenv("CUTE_MLA_SM90_PLAN", "shares")
    heads, bs = 128, 64
    seed = _seed("shares", kv_kind, q_form, q_len)
    rng = random.Random(seed)
    fp8 = kv_kind == "fp8"
    for batch in (3, 70):
        lens = [min(9000, max(1, int(rng.lognormvariate(math.log(700), 1.1)))) for _ in range(batch)]
        lens[0], lens[1], lens[-1] = 0, 1, 20000 + batch
        inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, q_form, DEVICE, seed + batch,
                                 q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None,
                                 poison=_poison(seed + batch))
        sched, _ = _check_balanced_split_list(inp, lens, q_len, heads)
        assert isinstance(sched, ShareSchedule)
        assert len(sched.split_requests) >= 1 and len(sched.pieces) > batch
        if batch == 70:  # short requests split at a share boundary, not only the long one
            assert len(sched.split_requests) > 1


@pytest.mark.parametrize("kv_kind,q_form,q_len", [("bf16", "pair", 1), ("fp8", "fp8", 1), ("fp8", "pair", 1),
                                                  ("bf16", "pair", 2)])
def test_long_request_takes_the_long_cap(kv_kind, q_form, q_len):
    """The benchmark's one-long cell at B=8 (one ~32k request among ~1k ones, one of length 1) on a serving
    workspace (split capacity 64): on a 132-SM H100 at q_len 1 the long request takes more than the default cap of
    32 items (52 of 10 tiles, ops/plan.py balanced_schedule's long cap) and the combine kernel merges more
    splits than its block of LSEs (two rounds). Correct output in every design (bf16 seesaw, fp8 q design B, bf16 q
    on an fp8 cache: design B at B=8; q_len 2: 4 m-blocks, W = 33, the cap does not bind), and the table the plan
    kernel wrote is the reference's."""
    if KERNEL != "cute_sm90":
        pytest.skip("the long cap is cute_sm90's")
    heads, bs, batch = 128, 64, 8
    seed = _seed("long-cap", kv_kind, q_form, q_len)
    lens = [32768 - 37] + [1000 + 29 * i for i in range(batch - 1)]
    lens[5] = 1
    fp8 = kv_kind == "fp8"
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, q_form, DEVICE, seed,
                             q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None,
                             poison=_poison(seed))
    sched, plan = _check_balanced_split_list(inp, lens, q_len, heads, split_capacity=SPLIT_CAPACITY)
    assert plan.long_splits == SPLIT_CAPACITY
    if isinstance(sched, BalancedSchedule) and plan.work_target == 66:  # 132 SMs at q_len 1: what this is for
        assert sched.splits[0] > plan.num_splits, sched.splits


@pytest.mark.parametrize("kv_kind,q_form,batch,long_requests", [("bf16", "pair", 32, 1), ("fp8", "fp8", 128, 1),
                                                                  ("fp8", "pair", 128, 1), ("bf16", "pair", 128, 24)])
def test_combine_merges_few_split_requests_of_many_splits(kv_kind, q_form, batch, long_requests):
    """The benchmark's one-long cells at B=32 and 128 (one ~32k request among <= 1k ones; one of length 1): one
    split request (J = 1) of 14-32 splits under a combine grid shaped for J_max = 32-65 split requests (its tile:
    ops/plan.py combine_tiles, several load rounds at B=128); with 24 long requests J = 24. Correct output
    (outputs NaN first, poisoned unread slots) on a serving workspace; for cute_sm90 under the balanced plan, J
    as its plan kernel wrote it."""
    heads, bs, q_len = 128, 64, 1
    seed = _seed("combine-few", kv_kind, q_form, batch, long_requests)
    lens = [1024 - (37 * i) % 300 for i in range(batch)]
    for i in range(long_requests):
        lens[i * (batch // long_requests)] = 32768 - 61 * i
    lens[3] = 1
    fp8 = kv_kind == "fp8"
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, q_form, DEVICE, seed,
                             q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None,
                             poison=_poison(seed))
    ws = MLAWorkspace(DEVICE, max_batch=batch, max_q_len=q_len, num_heads=heads, split_capacity=SPLIT_CAPACITY)
    ws.split_index.fill_(-7)
    _check(inp, workspace=ws)
    if KERNEL == "cute_sm90" and envs.CUTE_MLA_SM90_PLAN == "balanced":
        assert (int(ws.split_index[0]) == 1) == (long_requests == 1), ws.split_index[:4].tolist()


@pytest.mark.parametrize("kv_kind,q_form,q_len", [("bf16", "pair", 1), ("fp8", "fp8", 1), ("fp8", "fp8", 2)])
def test_auto_plan_takes_shares_for_a_wave_gap(kv_kind, q_form, q_len, monkeypatch):
    """CUTE_MLA_SM90_PLAN=auto on one long request among short ones (the benchmark's one-long cells at 8k): the
    balanced plan's items would be W + a few of equal length, so the plan kernel takes the share plan; on a
    uniform batch it keeps the balanced one. Correct output and the reference's table either way."""
    if KERNEL != "cute_sm90":
        pytest.skip("the auto plan is cute_sm90's")
    monkeypatch.setenv("CUTE_MLA_SM90_PLAN", "auto")
    heads, bs = 128, 64
    batch = 64 if q_len == 1 else 32
    seed = _seed("auto", kv_kind, q_form, q_len)
    fp8 = kv_kind == "fp8"
    for lens in ([8192] + [1000 + (7 * i) % 30 for i in range(batch - 1)], [1000] * batch):
        inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, q_form, DEVICE, seed,
                                 q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None,
                                 poison=_poison(seed))
        sched, plan = _check_balanced_split_list(inp, lens, q_len, heads)
        if plan.work_target == 132 // (q_len * heads // 64):  # a 132-SM H100: the cases this test is for
            assert isinstance(sched, ShareSchedule) == (lens[0] == 8192), (plan, sched)


@pytest.mark.parametrize("kv_kind,q_form", [("bf16", "pair"), ("fp8", "pair"), ("fp8", "fp8")])
def test_long_tail_batch_runs_longest_first(kv_kind, q_form):
    """130 requests of log-normal lengths (median 512, up to 8k; one of length 0, one of 1): more work items than
    the GPU has slots, so cute_sm90's table runs them longest first (not in the schedule's order) while the
    partial slots and the combine stay the schedule's. Correct output, and the table is the reference's."""
    batch, q_len, heads, bs = 130, 1, 128, 64
    seed = _seed("long-tail", kv_kind, q_form)
    rng = random.Random(seed)
    lens = [min(8192, max(1, int(rng.lognormvariate(math.log(512), 1.2)))) for _ in range(batch)]
    lens[0], lens[3], lens[7] = 8192, 0, 1
    fp8 = kv_kind == "fp8"
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, q_form, DEVICE, seed,
                             q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if fp8 else None)
    sched, _ = _check_balanced_split_list(inp, lens, q_len, heads)
    if isinstance(sched, BalancedSchedule):
        assert sched.longest_first() != list(range(len(sched.items)))  # the case this test is for


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_near_uniform_batch_takes_one_wave(kv_kind):
    """8 requests of 65 tiles at 128 heads: on an H100 (W = 66) cdiv(T, W) = 8 tiles per item would make 72
    items for one wave of 66, so the plan's one-wave search takes 9 (64 items); the kernel must derive the same
    schedule."""
    batch, q_len, heads, bs = 8, 1, 128, 64
    seed = _seed("one-wave", kv_kind)
    lens = [4097 + (37 * i + seed) % 64 for i in range(batch)]  # 65 tiles each, not a multiple of the tile
    fp8 = kv_kind == "fp8"
    inp = make_decode_inputs(batch, lens, q_len, heads, bs, FP8 if fp8 else BF16, "pair", DEVICE, seed,
                             kv_scale=3.0 if fp8 else None)
    sched, plan = _check_balanced_split_list(inp, lens, q_len, heads)
    if isinstance(sched, BalancedSchedule) and plan.work_target == 66:  # 132 SMs: the case this test is for
        assert sched.per_work == 9 and len(sched.items) == 64, sched


@pytest.mark.parametrize("q_form,kv_dtype,q_len", [("pair", BF16, 1), ("fp8", FP8, 2)])
def test_block_size_128(q_form, kv_dtype, q_len):
    seed = _seed("bs128", q_form)
    lens = draw_seq_lens(3, 1000, block_size=128, seed=seed)
    inp = make_decode_inputs(3, lens, q_len, 128, 128, kv_dtype, q_form, DEVICE, seed,
                             q_scale=2.0 if q_form == "fp8" else None, kv_scale=3.0 if kv_dtype == FP8 else None)
    _check(inp)


# ---------------------------------------------------------------------------------------------------------
# q forms, output forms, cache forms
# ---------------------------------------------------------------------------------------------------------


def test_q_pair_16bit_and_fp8_cat():
    """16-bit q as (q_nope, strided q_pe) and as one [T, H, 576] tensor; fp8 q as one tensor with
    out_dtype=bf16 and a q_scale; a [num_blocks, block_size, 1, 576] cache and an ``out`` that is a view."""
    batch, q_len, heads, bs = 3, 2, 128, 64
    seed = _seed("forms")
    lens = draw_seq_lens(batch, 700, block_size=bs, seed=seed)

    pair = make_decode_inputs(batch, lens, q_len, heads, bs, BF16, "pair", DEVICE, seed)
    q_nope, q_pe = pair.q
    assert not q_pe.is_contiguous()
    out_pair, lse_pair = _check(pair, msg="pair")
    # the same values as one tensor, and as views into it
    q_cat = torch.cat([q_nope, q_pe], dim=-1)
    out_cat, lse_cat = mla_decode(q_cat, pair.kv_cache, pair.block_table, pair.seq_lens,
                                  softmax_scale=pair.softmax_scale, kernel=KERNEL)
    out_views, lse_views = mla_decode((q_cat[..., :KV_LORA_RANK], q_cat[..., KV_LORA_RANK:]), pair.kv_cache,
                                      pair.block_table, pair.seq_lens, softmax_scale=pair.softmax_scale,
                                      kernel=KERNEL)
    _sync()
    for o, lse_o in ((out_cat, lse_cat), (out_views, lse_views)):
        torch.testing.assert_close(o.float(), out_pair.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(lse_o, lse_pair, rtol=0, atol=1e-3)

    # fp8 q in the cat form: out_dtype given (no out), q_scale as a float and as a tensor
    f8 = make_decode_inputs(batch, lens, q_len, heads, bs, BF16, "fp8", DEVICE, seed + 1, q_scale=2.0)
    ref_out, ref_lse = f8.reference()
    for q_scale in (2.0, torch.tensor([2.0], device=DEVICE)):
        out, lse = mla_decode(f8.q, f8.kv_cache, f8.block_table, f8.seq_lens, softmax_scale=f8.softmax_scale,
                              q_scale=q_scale, out_dtype=BF16, kernel=KERNEL)
        _sync()
        assert out.dtype == BF16 and lse.dtype == torch.float32
        assert_close_decode(out, lse, ref_out, ref_lse, BF16, msg=f"fp8 q cat, q_scale={q_scale}")

    # 4-D cache (one latent head) and an out/lse that are views into larger poisoned buffers
    big_out = torch.full((batch * q_len, heads, 2 * KV_LORA_RANK), math.nan, dtype=BF16, device=DEVICE)
    big_lse = torch.full((batch * q_len, heads + 8), math.nan, dtype=torch.float32, device=DEVICE)
    out_v, lse_v = big_out[..., KV_LORA_RANK:], big_lse[:, 8:]
    r_out, r_lse = mla_decode(pair.q, pair.kv_cache.unsqueeze(2), pair.block_table, pair.seq_lens,
                              softmax_scale=pair.softmax_scale, out=out_v, lse=lse_v, kernel=KERNEL)
    _sync()
    assert r_out is out_v and r_lse is lse_v
    assert torch.isnan(big_out[..., :KV_LORA_RANK].float()).all() and torch.isnan(big_lse[:, :8]).all(), \
        "the kernel wrote outside the out/lse views"
    ref_out, ref_lse = pair.reference()
    assert_close_decode(out_v, lse_v, ref_out, ref_lse, BF16, msg="4-D cache, out/lse views")


# ---------------------------------------------------------------------------------------------------------
# kernel selection and workspaces
# ---------------------------------------------------------------------------------------------------------


def test_auto_picks_first_supported(kernel_under_test):
    """kernel="auto" takes the first kernel of AUTO_ORDER that supports the call, and gives its exact result."""
    if kernel_under_test != "triton":
        pytest.skip("kernel selection is tested once")
    cc = torch.cuda.get_device_capability()
    seed = _seed("auto")
    lens = draw_seq_lens(3, 1000, block_size=64, seed=seed)
    cases = [make_decode_inputs(3, lens, 1, 128, 64, BF16, "pair", DEVICE, seed)]
    if cc >= (8, 9):
        cases.append(make_decode_inputs(3, lens, 1, 128, 64, FP8, "fp8", DEVICE, seed, q_scale=2.0, kv_scale=3.0))
    for inp in cases:
        kw = inp.scale_kwargs(False)
        args = prepare_args(*inp.call_args(), softmax_scale=inp.softmax_scale, out_dtype=BF16, **kw)
        expected = next(k for k in registry.AUTO_ORDER[cc[0]]
                        if registry.KERNELS[k].unsupported_reason(args, registry.device_capability(args.q_nope.device))
                        is None)
        assert select_kernel(args, "auto").name == expected, f"compute capability {cc}"
        out_auto, lse_auto = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out_dtype=BF16, **kw)
        out_exp, lse_exp = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out_dtype=BF16,
                                      kernel=expected, **kw)
        _sync()
        assert torch.equal(out_auto, out_exp) and torch.equal(lse_auto, lse_exp)
        _check(inp, kernel="auto")


def test_explicit_workspace():
    seed = _seed("ws")
    lens = draw_seq_lens(3, 1000, block_size=64, seed=seed)
    inp = make_decode_inputs(3, lens, 1, 128, 64, BF16, "pair", DEVICE, seed)
    out_default, lse_default = _check(inp)  # cached default workspace
    ws = MLAWorkspace(DEVICE, max_batch=64, max_q_len=4, num_heads=128)
    out_ws, lse_ws = _check(inp, workspace=ws)
    assert torch.equal(out_ws, out_default) and torch.equal(lse_ws, lse_default)
    small = MLAWorkspace(DEVICE, max_batch=2, max_q_len=1, num_heads=128)
    with pytest.raises(ValueError, match=r"batch 3 exceeds the workspace's max_batch=2"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel=KERNEL, workspace=small)
    other_heads = MLAWorkspace(DEVICE, max_batch=8, max_q_len=1, num_heads=16)
    with pytest.raises(ValueError, match=r"workspace was made for num_heads=16, inputs have 128"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel=KERNEL, workspace=other_heads)


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: capture once, replay with new lengths, block tables, KV content and scales
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_cuda_graph_replay(kv_kind):
    batch, q_len, heads, bs = 8, 2, 128, 64
    width = 64  # block-table columns: at most width * bs = 4096 tokens per request
    max_len = width * bs
    num_blocks = batch * width + 37
    kv_dtype = FP8 if kv_kind == "fp8" else BF16
    fp8 = kv_dtype == FP8
    ws = MLAWorkspace(DEVICE, max_batch=32, max_q_len=4, num_heads=heads)  # larger than this graph needs

    def fresh(lens, seed, kv_scale):
        return make_decode_inputs(batch, lens, q_len, heads, bs, kv_dtype, "pair", DEVICE, seed,
                                  kv_scale=kv_scale if fp8 else None, num_blocks=num_blocks, max_blocks=width)

    capture_lens = draw_seq_lens(batch, 500, block_size=bs, seed=_seed("graph", kv_kind))
    static = fresh(capture_lens, _seed("graph-static", kv_kind), 3.0)
    q_nope, q_pe = static.q
    kv_cache, block_table, seq_lens = static.kv_cache, static.block_table, static.seq_lens
    kv_scale = torch.tensor([3.0], dtype=torch.float32, device=DEVICE) if fp8 else None
    out = torch.empty(batch * q_len, heads, KV_LORA_RANK, dtype=BF16, device=DEVICE)
    lse = torch.empty(batch * q_len, heads, dtype=torch.float32, device=DEVICE)

    def run():
        mla_decode((q_nope, q_pe), kv_cache, block_table, seq_lens, softmax_scale=static.softmax_scale,
                   kv_scale=kv_scale, out=out, lse=lse, workspace=ws, kernel=KERNEL)

    graph = capture_graph(lambda _: run())

    rounds = [
        ("new-content", capture_lens, 3.0),
        ("much-longer", draw_seq_lens(batch, max_len - 300, block_size=bs, seed=2, max_len=max_len), 2.0),
        ("much-shorter", [1, 0, q_len - 1, 2, 5, 17, 33, 64], 0.5),
        ("mixed", [max_len, 1, 2000, 129, 0, 3000, 65, max_len - 1], 3.0),
    ]
    for i, (name, lens, scale) in enumerate(rounds):
        assert max(lens) <= max_len
        new = fresh(lens, _seed("graph-round", kv_kind, i), scale)
        q_nope.copy_(new.q[0])
        q_pe.copy_(new.q[1])
        kv_cache.copy_(new.kv_cache)
        block_table.copy_(new.block_table)
        seq_lens.copy_(new.seq_lens)
        if fp8:
            kv_scale.fill_(scale)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, q_len,
                                                static.softmax_scale, None, kv_scale)
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype,
                            msg=f"graph replay round {name}: seq_lens={lens}, kv_scale={scale if fp8 else None}")
