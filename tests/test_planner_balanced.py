"""The balanced split plan (ops/plan.py): its bounds, its makespan against the uniform plan on a model
of an H100, and the real Triton kernels running it through Triton's CPU interpreter."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest

from mla_backend_plugin.ops.constants import SUPPORTED_NUM_HEADS, SUPPORTED_Q_LENS
from mla_backend_plugin.ops.plan import (
    MAX_SPLITS,
    MIN_CHUNK_TOKENS,
    balanced_schedule,
    plan_splits,
    uniform_request_splits,
)
from mla_backend_plugin.ops.workspace import MLAWorkspace
from mla_backend_plugin.testing.schedule_model import ideal_makespan, makespan, plan_cta_costs

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_SMS = 132  # H100 SXM
ROWS, BLOCK_N = 64, 64  # the H100 Triton tile (and cute_sm90's)


def long_tail(batch: int, seed: int) -> list[int]:
    """Lengths from a long-tailed (log-normal, median 1500) distribution, capped at 64k."""
    rng = random.Random(seed)
    return [min(65536, max(1, int(rng.lognormvariate(math.log(1500), 1.2)))) for _ in range(batch)]


def step_makespans(seq_lens, q_len=1, heads=128):
    """(uniform, balanced, ideal) modelled step times in KV tiles (1.5 tiles per CTA, 0.15 per empty CTA)."""
    batch = len(seq_lens)
    res = []
    for balanced in (False, True):
        plan = plan_splits(batch, q_len, heads, ROWS, NUM_SMS, balanced=balanced)
        res.append(makespan(plan_cta_costs(plan, seq_lens, q_len, heads, BLOCK_N), NUM_SMS))
    return res[0], res[1], ideal_makespan(seq_lens, q_len, heads, ROWS, BLOCK_N, NUM_SMS)


RAGGED = {
    "B=8: 32768 + 7 x 1024": [32768] + [1024] * 7,
    "B=128: 32768 + 127 x 1024": [32768] + [1024] * 127,
    "B=128: 127 x 1024 + 32768": [1024] * 127 + [32768],
    "B=64 long-tail": long_tail(64, seed=1),
    "B=256 long-tail": long_tail(256, seed=2),
}


@pytest.mark.parametrize("name", list(RAGGED))
def test_makespan_ragged(name):
    old, new, ideal = step_makespans(RAGGED[name])
    print(f"{name}: uniform {old:.1f}, balanced {new:.1f}, ideal {ideal:.1f} tiles")
    assert new <= 0.65 * old, f"{name}: balanced {new:.1f} not much better than uniform {old:.1f}"
    assert new <= 2.0 * ideal + 4, f"{name}: balanced {new:.1f} far from the ideal {ideal:.1f}"


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 64, 66, 128, 256, 1024])
@pytest.mark.parametrize("seq_len", [1, 200, 1024, 8192, 32768])
@pytest.mark.parametrize("q_len", [1, 2])
def test_makespan_uniform_no_worse(batch, seq_len, q_len):
    old, new, _ = step_makespans([seq_len] * batch, q_len)
    assert new <= old * 1.02 + 0.2, f"uniform batch {batch} x {seq_len}: balanced {new:.1f} > uniform {old:.1f}"


@pytest.mark.parametrize("q_len", [1, 2])
def test_uniform_batches_of_the_standard_grid_take_whole_waves(q_len):
    """The benchmark's standard cells with 1 < B < one wave (B=1 is bound by the split cap and the smallest
    chunk): a uniform batch's items fill the GPU's slots in one wave, so the modelled step stays within 10%
    (+ one CTA's overhead) of the ideal. Before the one-wave search,
    B=8 x 32k made 72 items of 57 tiles for 66 slots: 116 tiles against an ideal 62."""
    for batch in (8, 32, 64):
        for seq_len in (1024, 4096, 8192, 32768):
            _, new, ideal = step_makespans([seq_len] * batch, q_len)
            assert new <= 1.1 * ideal + 3, (batch, seq_len, new, ideal)


def _one_wave_per_work_by_enumeration(seq_lens, block_n, min_chunk, work_target, max_splits, long_splits=0):
    """The one-wave rule of balanced_schedule's docstring, by trying every p instead of bisecting."""
    tiles = [max(-(-x // block_n), 1) for x in seq_lens]
    batch, w = len(tiles), work_target
    p = max(-(-min_chunk // block_n), -(-sum(tiles) // w))

    def cap(t, q):  # the long cap: a request whose items at max_splits would exceed 1.5 q tiles
        return long_splits if long_splits > max_splits and 2 * -(-t // max_splits) > 3 * q else max_splits

    def items(q):
        n = [min(-(-t // q), cap(t, q)) for t in tiles]
        return sum(-(-t // -(-t // m)) for t, m in zip(tiles, n))

    if batch < w and 2 * min(tiles) >= p and batch * -(-max(tiles) // p) > w and items(p) > w:
        fits = [q for q in range(p + 1, 3 * p // 2 + 1) if items(q) <= w]
        if fits:
            return fits[0]
    return p


@pytest.mark.parametrize("seed", range(4))
def test_one_wave_search_matches_enumeration(seed):
    """The bisection bounded by 1.5 p finds what trying every p finds (near-uniform, bimodal and long-tail
    batches on small pretend GPUs, where the search runs often)."""
    rng = random.Random(seed)
    searched = 0
    for case in range(300):
        batch = rng.randint(2, 40)
        base = rng.choice([300, 2000, 9000, 40000])
        kind = case % 3
        if kind == 0:
            lens = [base + rng.randint(0, base // 8) for _ in range(batch)]
        elif kind == 1:
            lens = [rng.choice([base, base * 3]) for _ in range(batch)]
        else:
            lens = long_tail(batch, seed * 1000 + case)
        work_target = rng.randint(batch + 1, 4 * batch + 8)
        block_n, min_chunk, max_splits = 64, rng.choice([64, 256, 512]), rng.choice([8, 32, 64])
        long_splits = rng.choice([0, 0, 64])
        want = _one_wave_per_work_by_enumeration(lens, block_n, min_chunk, work_target, max_splits, long_splits)
        got = balanced_schedule(lens, block_n, min_chunk, work_target, max_splits, long_splits).per_work
        assert got == want, (lens, work_target, min_chunk, max_splits, long_splits)
        plain = max(-(-min_chunk // block_n), -(-sum(max(-(-x // block_n), 1) for x in lens) // work_target))
        searched += got != plain
    assert searched > 20  # the search changed p often enough for the comparison to mean something


@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
def test_uniform_batch_that_fills_gpu_is_not_split(heads, q_len):
    rows = min(ROWS, heads)
    m_blocks = -(-(q_len * heads) // rows)
    fills = -(-NUM_SMS // m_blocks)
    for batch in (fills, fills + 1, 2 * fills, 1000):
        plan = plan_splits(batch, q_len, heads, rows, NUM_SMS, balanced=True)
        for seq_len in (1, 63, 64, 1000, 8192, 100_000):
            sched = balanced_schedule([seq_len] * batch, BLOCK_N, plan.min_chunk, plan.work_target, plan.num_splits)
            assert sched.splits == [1] * batch and sched.num_slots == 0


def test_small_uniform_batches_plan_like_before():
    """Up to rounding, the balanced plan splits a uniform batch no more than the uniform plan did."""
    for batch in (1, 2, 4, 8, 16, 32, 64):
        uni = plan_splits(batch, 1, 128, ROWS, NUM_SMS)
        bal = plan_splits(batch, 1, 128, ROWS, NUM_SMS, balanced=True)
        for seq_len in (1, 100, 1024, 8192, 32768):
            n_old = uniform_request_splits(seq_len, uni.num_splits, uni.min_chunk, BLOCK_N)[0]
            n_new = balanced_schedule([seq_len] * batch, BLOCK_N, bal.min_chunk, bal.work_target,
                                      bal.num_splits).splits[0]
            assert n_new <= n_old and (n_new >= n_old // 2 or n_new * batch * 2 >= NUM_SMS), (batch, seq_len)


def test_long_request_split_at_large_batch():
    for batch in (128, 256, 1024):
        plan = plan_splits(batch, 1, 128, ROWS, NUM_SMS, balanced=True)
        lens = [32768] + [1024] * (batch - 1)
        sched = balanced_schedule(lens, BLOCK_N, plan.min_chunk, plan.work_target, plan.num_splits)
        assert sched.splits[0] >= 2 and set(sched.splits[1:]) == {1}
        assert plan_splits(batch, 1, 128, ROWS, NUM_SMS).num_splits == 1  # the uniform plan would not


def _random_lens(rng: random.Random, batch: int) -> list[int]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randint(0, 70_000) for _ in range(batch)]
    if kind == 1:
        return [rng.choice([1, 64, 65, 4096, 33_000]) for _ in range(batch)]
    if kind == 2:
        return long_tail(batch, rng.randrange(1 << 30))
    n = rng.randint(1, 100_000)
    return [n + rng.randint(0, 3) for _ in range(batch)]


@pytest.mark.parametrize("heads,q_len,num_sms,max_splits,block_n,long_splits", [
    (128, 1, 132, MAX_SPLITS, 64, 0), (128, 4, 132, MAX_SPLITS, 64, 0), (16, 1, 132, 64, 64, 0),
    (64, 2, 78, 16, 32, 0), (32, 3, 8, MAX_SPLITS, 16, 0), (128, 1, 1, MAX_SPLITS, 64, 0), (128, 2, 132, 1, 64, 0),
    (16, 2, 170, 64, 32, 0), (128, 1, 132, MAX_SPLITS, 64, 64), (64, 2, 78, 16, 32, 48), (128, 2, 132, 1, 64, 8),
])
def test_schedule_invariants_and_bounds(heads, q_len, num_sms, max_splits, block_n, long_splits):
    """For random seq_lens: chunks tile each request exactly, items enumerate every (request, split) once in
    the documented order, and the host's grid / slot / list sizes are upper bounds (with a long cap too)."""
    rng = random.Random(hash((heads, q_len, num_sms, max_splits, block_n, long_splits)) & 0xFFFF)
    rows = min(ROWS, heads)
    for _ in range(150):
        batch = rng.choice([1, 2, 3, 7, 31, 65, 66, 130, 131, 200, 600])
        lens = _random_lens(rng, batch)
        plan = plan_splits(batch, q_len, heads, rows, num_sms, max_splits=max_splits, balanced=True,
                           long_splits=long_splits)
        s = balanced_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits, plan.long_splits)
        assert s.per_work >= -(-MIN_CHUNK_TOKENS // block_n)
        for b, (x, n, c) in enumerate(zip(lens, s.splits, s.chunk)):
            assert 1 <= n <= max(max_splits, long_splits) and c % block_n == 0
            assert (n - 1) * c < max(x, 1) <= n * c or (x == 0 and n == 1), (b, x, n, c)
        split_items = [(b, k) for b in s.split_requests for k in range(s.splits[b])]
        assert s.items == split_items + [(b, 0) for b, n in enumerate(s.splits) if n == 1]
        assert s.num_slots == len(split_items)
        for b in s.split_requests:
            assert s.items[s.slot_base[b]] == (b, 0)
        assert len(s.items) <= plan.grid_items, (lens, len(s.items), plan)
        assert s.num_slots <= plan.max_slots and len(s.split_requests) <= plan.max_split_requests
        assert plan.grid_items - len(s.items) <= max(plan.work_target - 1, 0) or plan.max_split_requests == 0


def _launch_rank_closed_form(s, w: int) -> int:
    """kernels/cute_common/scheduler.py ``launch_rank`` in Python: item w's place in the longest-first order,
    counted per request in closed form (request b's items start at f_b and have ct_b tiles but the last)."""
    key = s.item_tiles(w)
    first_unsplit = s.num_slots
    rank = 0
    for b, (t, n, c) in enumerate(zip(s.tiles, s.splits, s.chunk)):
        ct = c // s.block_n
        last = t - (n - 1) * ct
        if n > 1:
            first = s.slot_base[b]
        else:
            first, first_unsplit = first_unsplit, first_unsplit + 1
        rank += (n - 1) * (ct > key) + (ct == key) * max(min(w - first, n - 1), 0)
        rank += (last > key) + (last == key and first + n - 1 < w)
    return rank


@pytest.mark.parametrize("heads,q_len,num_sms,max_splits,block_n,long_splits", [
    (128, 1, 132, MAX_SPLITS, 64, 0), (128, 2, 132, 64, 64, 0), (16, 4, 132, MAX_SPLITS, 32, 0), (64, 1, 8, 8, 16, 0),
    (128, 1, 132, MAX_SPLITS, 64, 64), (64, 1, 8, 8, 16, 16),
])
def test_longest_first_order(heads, q_len, num_sms, max_splits, block_n, long_splits):
    """The step-planned launch order: a permutation of the items, tiles never increasing, ties in order of w,
    and the device's closed-form rank of every item is its position (what ``StepPlanKernel`` writes; the GPU
    test compares the table it wrote). Uniform batches whose items are equal keep the order of w."""
    rng = random.Random(hash((heads, q_len, num_sms, max_splits, block_n, long_splits)) & 0xFFFF)
    rows = min(ROWS, heads)
    reordered = 0
    for _ in range(120):
        batch = rng.choice([1, 2, 7, 31, 65, 66, 130, 200])
        lens = _random_lens(rng, batch)
        plan = plan_splits(batch, q_len, heads, rows, num_sms, max_splits=max_splits, balanced=True,
                           long_splits=long_splits)
        s = balanced_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits, plan.long_splits)
        order = s.longest_first()
        assert sorted(order) == list(range(len(s.items)))
        keys = [(-s.item_tiles(w), w) for w in order]
        assert keys == sorted(keys)
        position = {w: r for r, w in enumerate(order)}
        assert [_launch_rank_closed_form(s, w) for w in range(len(s.items))] == [position[w] for w in range(len(order))]
        reordered += order != list(range(len(order)))
    assert reordered > 10  # the order changed often enough for the comparison to mean something
    for seq_len in (1, 64, 8192, 32768):
        for batch in (1, 8, 64, 128):
            plan = plan_splits(batch, 1, 128, ROWS, NUM_SMS, balanced=True)
            s = balanced_schedule([seq_len] * batch, BLOCK_N, plan.min_chunk, plan.work_target, plan.num_splits)
            if len({s.item_tiles(w) for w in range(len(s.items))}) == 1:
                assert s.longest_first() == list(range(len(s.items)))


@pytest.mark.parametrize("name", ["B=64 long-tail", "B=256 long-tail", "bench long-tail B=128", "bench long-tail B=32"])
def test_longest_first_shortens_long_tail_steps(name):
    """Batches with more items than the GPU has slots: in the order of w a long unsplit request can start in the
    last wave; longest first (greedy LPT) is never worse and, once the batch alone passes one wave (W = 66 here),
    brings the modelled step within 10% of the ideal. The bench's long-tail cells (request 0 of 32k, the others
    log-normal with median 2k) are the ones this was made for (B=128: 235 -> 154.5 tiles, ideal 144.6)."""
    lens = {"bench long-tail B=128": _bench_long_tail(128), "bench long-tail B=32": _bench_long_tail(32)}.get(
        name) or RAGGED[name]
    plan = plan_splits(len(lens), 1, 128, ROWS, NUM_SMS, balanced=True)
    by_w, lpt = (makespan(plan_cta_costs(plan, lens, 1, 128, BLOCK_N, longest_first=o), NUM_SMS) for o in (False, True))
    ideal = ideal_makespan(lens, 1, 128, ROWS, BLOCK_N, NUM_SMS)
    print(f"{name}: order of w {by_w:.1f}, longest first {lpt:.1f}, ideal {ideal:.1f} tiles")
    assert lpt < by_w, (by_w, lpt)
    if len(lens) > plan.work_target:
        assert lpt <= 1.1 * ideal + 3, (by_w, lpt, ideal)


def test_long_cap_splits_only_the_critical_request():
    """The long cap (SplitPlan.long_splits, what cute_sm90 runs from B=3 on): one 32k request among seven 1k ones
    at B=8 had 32 items of 16 tiles while every other item held 8 (p = 10): it now takes 52 items of 10 tiles, the
    others unchanged, and the modelled step is shorter with the grid as it was. Where its items at the cap stay
    within 1.5 p (one-long B=16 at 32k: 16 tiles against p = 12; one-long B=8 at 8k; uniform batches) nothing
    changes, which is where raising the cap for every request cost 4-9% (docs/perf/split_plan.md)."""
    def plans(lens):
        base = plan_splits(len(lens), 1, 128, ROWS, NUM_SMS, balanced=True)
        long = plan_splits(len(lens), 1, 128, ROWS, NUM_SMS, balanced=True, long_splits=64)
        assert (long.grid_items, long.max_slots, long.max_split_requests) == (
            base.grid_items, base.max_slots, base.max_split_requests)
        return [(p, balanced_schedule(lens, BLOCK_N, p.min_chunk, p.work_target, p.num_splits, p.long_splits))
                for p in (base, long)]

    (base, before), (long, after) = plans([32768] + [1024] * 7)
    assert before.per_work == after.per_work == 10
    assert (before.splits[0], before.chunk[0]) == (32, 16 * BLOCK_N)
    assert (after.splits[0], after.chunk[0]) == (52, 10 * BLOCK_N)
    assert after.splits[1:] == before.splits[1:] == [2] * 7
    assert len(after.items) <= long.work_target
    steps = [makespan(plan_cta_costs(p, [32768] + [1024] * 7, 1, 128, BLOCK_N, longest_first=True), NUM_SMS)
             for p in (base, long)]
    assert steps[1] < steps[0] - 4, steps
    for lens in ([32768] + [1024] * 15, [8192] + [1024] * 7, [8192] * 8, [32768] * 8, [1024] * 128,
                 _bench_long_tail(128)):
        (_, before), (_, after) = plans(lens)
        assert (after.splits, after.chunk, after.per_work) == (before.splits, before.chunk, before.per_work), lens


def _bench_long_tail(batch: int, max_len: int = 32768, seed: int = 0) -> list[int]:
    """benchmarks/bench_decode.py ``ragged_seq_lens("long-tail", ...)``: the same draw."""
    rng = random.Random(seed * 1_000_003 + batch * 7919 + max_len)
    return [max_len] + [min(max_len, max(1, int(rng.lognormvariate(math.log(max_len / 16), 1.2))))
                        for _ in range(batch - 1)]


@pytest.mark.parametrize("heads", SUPPORTED_NUM_HEADS)
@pytest.mark.parametrize("q_len", SUPPORTED_Q_LENS)
def test_combine_tiles_cover_whole_rows(heads, q_len):
    """Every balanced plan's combine tile (ops/plan.py combine_tiles): at least 2 rows of all 512 columns
    (fewer leave the 128 threads' 8-wide loads crossing warps in the sum over splits, 2-4x slower on an H100) that
    divide q_len x H, a power-of-2 split block within the cap, at most 2 x 16 x 512 partials a round, and no fewer
    splits a round for a plan shaped for fewer split requests."""
    rows = q_len * heads
    for num_sms in (8, 78, 132, 148):
        for max_splits, long_splits in ((1, 0), (2, 0), (8, 0), (32, 0), (32, 64), (64, 0)):
            last = None
            for batch in (1, 2, 3, 4, 8, 16, 32, 64, 128, 256):
                plan = plan_splits(batch, q_len, heads, ROWS, num_sms, max_splits=max_splits, balanced=True,
                                   long_splits=long_splits)
                r, sb = plan.combine_rows, plan.combine_split_block
                note = (batch, num_sms, max_splits, plan)
                assert r >= 2 and rows % r == 0 and plan.combine_col_blocks == 1, note
                assert sb & (sb - 1) == 0 and sb < 2 * max_splits and r * sb <= 32, note
                if last is not None and plan.max_split_requests >= last[0]:
                    assert sb <= last[1], note
                last = (plan.max_split_requests, sb)


def test_combine_tiles_of_the_benchmark_shapes():
    """The shapes the combine tiles were measured for (H100, 128 heads, q_len 1, docs/perf/combine.md):
    B=4 (J_max 4) 2 rows x 16 splits a round; B=128 (J_max 65) 16 rows x 1 (a grid of 520 CTAs)."""
    small = plan_splits(4, 1, 128, ROWS, NUM_SMS, max_splits=32, balanced=True)
    large = plan_splits(128, 1, 128, ROWS, NUM_SMS, max_splits=32, balanced=True, long_splits=64)
    assert (small.combine_rows, small.combine_split_block) == (2, 16)
    assert (large.max_split_requests, large.combine_rows, large.combine_split_block) == (65, 16, 1)


def test_workspace_holds_balanced_plan():
    ws = MLAWorkspace("cpu", max_batch=300, max_q_len=4, num_heads=128, num_sms=NUM_SMS)
    assert len(ws.plan_rows) > 1  # every family's tile
    for rows in ws.plan_rows:
        for q_len in range(1, 5):
            for batch in range(1, 301):
                plan = ws.plan(batch, q_len, balanced=True, rows_per_cta=rows)
                assert plan.max_slots * q_len * 128 <= ws.partial_out.shape[0] == ws.partial_lse.shape[0]
                assert 1 + 3 * plan.max_split_requests <= ws.split_index.numel()
    assert ws.partial_rows_balanced <= ws.partial_out.shape[0]
    # the balanced plan needs no more than the uniform one's worst case, plus a few slots
    assert ws.partial_rows_balanced <= ws.partial_rows + 2 * 4 * 128


def test_balanced_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "triton_interpret_balanced_check.py")], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_balanced_kernels_compile_for_sm90():
    """The balanced split and combine kernels build for sm_90a with no GPU; the split kernel stays within the
    H100's shared memory."""
    pytest.importorskip("triton")
    from mla_backend_plugin.kernels.combine import kernel as combine_kernels
    from mla_backend_plugin.kernels.triton_decode import kernel as k
    from mla_backend_plugin.kernels.triton_decode.build import build_triton, triton_split_spec
    from mla_backend_plugin.kernels.triton_decode.config import config_for
    from mla_backend_plugin.ops.constants import KV_LORA_RANK

    cfg = config_for(128, 232_448)
    pointers, constexprs, options = triton_split_spec(cfg, 128, 1, "bf16", MAX_SPLITS, 90)
    pointers = {**pointers, "split_index_ptr": "*i32"}
    constexprs = {**constexprs, "WORK": 66, "SCAN": 128}
    split = build_triton(k._mla_decode_split_balanced_kernel, pointers, constexprs, options, cc=90)
    assert split.metadata.shared <= 232_448
    combine = build_triton(
        combine_kernels.combine_balanced_kernel,
        {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
         "split_index_ptr": "*i32", "kv_scale_ptr": "*fp32", "kv_scale_val": "fp32"},
        {"NUM_HEADS": 128, "Q_LEN": 1, "ROWS": 2, "KV_SCALE_IS_PTR": True, "D_NOPE": KV_LORA_RANK, "SPLITS_P2": 64,
         "USE_PDL": True, "D_BLOCK": 512, "SPLIT_BLOCK": 16},
        {"num_warps": 4}, cc=90)
    assert combine.metadata.shared >= 0
