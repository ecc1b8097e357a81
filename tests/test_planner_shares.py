"""The share plan (ops/plan.py ``share_schedule``, cute_sm90 ``split_plan="shares"``): its bounds against the
host's buffers, a transcription of the device's warp algorithm (kernels/cute_common/scheduler.py
``ShareScheduler.write_piece``) against the reference, and its modelled step on the ragged batches it is for."""

from __future__ import annotations

import random

import pytest
from test_planner_balanced import BLOCK_N, NUM_SMS, ROWS, _bench_long_tail, _random_lens

from mla_backend_plugin.ops.constants import SHARE_REQUEST_COST, WORK_ITEM_INTS
from mla_backend_plugin.ops.plan import (
    MAX_SPLITS,
    ShareSchedule,
    balanced_schedule,
    plan_splits,
    prefers_shares,
    share_schedule,
    step_schedule,
)
from mla_backend_plugin.testing.schedule_model import ideal_makespan, makespan, plan_cta_costs


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


CASES = [(128, 1, 132, MAX_SPLITS, 64), (128, 4, 132, MAX_SPLITS, 64), (16, 1, 132, 64, 64), (64, 2, 78, 16, 32),
         (32, 3, 8, MAX_SPLITS, 16), (128, 1, 1, MAX_SPLITS, 64), (128, 2, 132, 2, 64), (16, 2, 170, 64, 32)]


@pytest.mark.parametrize("heads,q_len,num_sms,max_splits,block_n", CASES)
def test_share_schedule_invariants_and_bounds(heads, q_len, num_sms, max_splits, block_n):
    """For random seq_lens: the pieces tile every request exactly once, in request order, each within one share;
    splits, slots, split requests and pieces stay within the balanced plan's bounds (the buffers and grid the host
    sized); the launch order is a permutation, longest first."""
    rng = random.Random(hash((heads, q_len, num_sms, max_splits, block_n, 1)) & 0xFFFF)
    rows = min(ROWS, heads)
    for _ in range(150):
        batch = rng.choice([1, 2, 3, 7, 31, 65, 66, 130, 131, 200, 600])
        lens = _random_lens(rng, batch)
        plan = plan_splits(batch, q_len, heads, rows, num_sms, max_splits=max_splits, balanced=True,
                           device_plan="shares")
        s = share_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
        assert s.per_share >= _cdiv(plan.min_chunk, block_n)
        assert [p[0] for p in s.pieces] == sorted(p[0] for p in s.pieces)
        by_request = {}
        for b, k, t0, t1 in s.pieces:
            by_request.setdefault(b, []).append((k, t0, t1))
            assert t1 - t0 <= s.per_share
        assert sorted(by_request) == list(range(batch))
        for b, pieces in by_request.items():
            assert [k for k, _, _ in pieces] == list(range(len(pieces))) == list(range(s.splits[b]))
            assert pieces[0][1] == 0 and pieces[-1][2] == s.tiles[b]
            assert all(t0 < t1 for _, t0, t1 in pieces)
            assert all(pieces[i][2] == pieces[i + 1][1] for i in range(len(pieces) - 1))
            assert 1 <= s.splits[b] <= max_splits
        assert s.split_requests == [b for b in range(batch) if s.splits[b] > 1]
        slots = [s.piece_slot(i) for i in range(len(s.pieces)) if s.splits[s.pieces[i][0]] > 1]
        assert slots == list(range(s.num_slots))
        assert len(s.pieces) <= plan.grid_items, (len(s.pieces), plan)
        assert s.num_slots <= plan.max_slots and len(s.split_requests) <= plan.max_split_requests
        order = s.longest_first()
        assert sorted(order) == list(range(len(s.pieces)))
        assert all((-s.piece_tiles(a), a) < (-s.piece_tiles(b), b) for a, b in zip(order, order[1:]))


def _write_piece_transcribed(lens, block_n, min_chunk, shares, num_splits, i, table, split_index):
    """kernels/cute_common/scheduler.py ``ShareScheduler.write_piece`` for warp i, lane by lane: 4 requests per
    lane and 128-request step, two warp scans per step (the line; pieces | split pieces << 11 | split requests
    << 22 packed in one int32), the piece's request, then its rank by the closed-form count."""
    batch, F = len(lens), SHARE_REQUEST_COST

    def tiles(x):
        return max((x + block_n - 1) // block_n, 1)

    line = sum(tiles(x) + F for x in lens)
    per_share = max(_cdiv(min_chunk, block_n), _cdiv(line, shares), _cdiv(max(tiles(x) for x in lens), num_splits - 1))

    def steps():
        line_before = pieces_before = slots_before = splits_before = 0
        for base in range(0, batch, 128):
            lane_lens = [[lens[base + 4 * lane + u] if base + 4 * lane + u < batch else -1 for u in range(4)]
                         for lane in range(32)]
            owns, cost_before = [], []
            for lane in range(32):
                own, cb = 0, []
                for x in lane_lens[lane]:
                    cb.append(own)
                    own += tiles(x) + F if x >= 0 else 0
                owns.append(own)
                cost_before.append(cb)
            incl = [sum(owns[:lane + 1]) for lane in range(32)]
            rows, owns2 = [], []
            for lane in range(32):
                own2, row = 0, []
                for u, x in enumerate(lane_lens[lane]):
                    s0 = line_before + incl[lane] - owns[lane] + cost_before[lane][u] + F
                    n = (s0 + tiles(x) - 1) // per_share - s0 // per_share + 1 if x >= 0 else 0
                    row.append([x, s0, s0 // per_share, n, own2])
                    own2 += n + ((n << 11) + (1 << 22) if n > 1 else 0)
                rows.append(row)
                owns2.append(own2)
            incl2 = [sum(owns2[:lane + 1]) for lane in range(32)]
            assert incl2[-1] < 1 << 31
            for lane in range(32):
                for u, r in enumerate(rows[lane]):
                    before = incl2[lane] - owns2[lane] + r[4]
                    yield (base + 4 * lane + u, r[0], r[1], r[2], r[3], pieces_before + (before & 0x7FF),
                           slots_before + ((before >> 11) & 0x7FF), splits_before + (before >> 22))
            line_before += incl[-1]
            pieces_before += incl2[-1] & 0x7FF
            slots_before += (incl2[-1] >> 11) & 0x7FF
            splits_before += incl2[-1] >> 22
        yield None, splits_before

    hit = None
    for row in steps():
        if row[0] is None:
            if i == 0:
                split_index[0] = row[1]
            break
        b, x, s0, first, n, piece0, slot0, j = row
        if piece0 <= i < piece0 + n:
            hit = (b, i - piece0, n, x, s0, slot0, j)
    if hit is None:
        table[i * WORK_ITEM_INTS] = 0
        return
    b, k, n, x, s0, slot0, j = hit
    c = s0 // per_share + k
    t0 = max(s0, c * per_share) - s0
    t1 = min(s0 + tiles(x), (c + 1) * per_share) - s0
    kv_start, kv_end = t0 * block_n, min(t1 * block_n, x)
    if n == 1:
        slot0 = 0
    key, rank = t1 - t0, 0
    for row in steps():
        if row[0] is None:
            break
        _, y, s1, first, m, p0, _, _ = row
        if m == 0:
            continue
        t = tiles(y)
        head = min(t, (first + 1) * per_share - s1)
        tail = s1 + t - (first + m - 1) * per_share
        rank += head > key or (head == key and p0 < i)
        if m > 1:
            rank += tail > key or (tail == key and p0 + m - 1 < i)
            rank += m - 2 if per_share > key else 0
            rank += min(max(i - p0 - 1, 0), m - 2) if per_share == key else 0
    item = [b + 1, b, x, n, slot0, kv_start, kv_end, (max(kv_end - kv_start, 0) + block_n - 1) // block_n, slot0 + k]
    table[rank * WORK_ITEM_INTS:(rank + 1) * WORK_ITEM_INTS] = item
    if k == 0 and n > 1:
        split_index[1 + 3 * j:4 + 3 * j] = [b, slot0, n]


@pytest.mark.parametrize("heads,q_len,num_sms,max_splits,block_n", CASES)
def test_device_algorithm_matches_reference(heads, q_len, num_sms, max_splits, block_n):
    """The plan kernel's warps (one per work item of the grid), transcribed, write exactly the reference's pieces
    in its launch order, the exits past them, and its split list."""
    rng = random.Random(hash((heads, q_len, num_sms, max_splits, block_n, 2)) & 0xFFFF)
    rows = min(ROWS, heads)
    for _ in range(12):
        batch = rng.choice([1, 2, 3, 7, 31, 66, 130, 131, 300])
        lens = _random_lens(rng, batch)
        if rng.random() < 0.3:  # many pieces of equal length: the ties of the launch order
            lens = [rng.choice([64, 4096]) for _ in range(batch)]
        plan = plan_splits(batch, q_len, heads, rows, num_sms, max_splits=max_splits, balanced=True,
                           device_plan="shares")
        s = share_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
        table = [-1] * (plan.grid_items * WORK_ITEM_INTS)
        split_index = [-1] * (1 + 3 * plan.max_split_requests)
        for i in range(plan.grid_items):
            _write_piece_transcribed(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits, i, table,
                                     split_index)
        for r, i in enumerate(s.longest_first()):
            b, k, t0, t1 = s.pieces[i]
            start, end = t0 * block_n, min(t1 * block_n, lens[b])
            slot0 = s.slot_base[b] if s.splits[b] > 1 else 0
            want = [b + 1, b, lens[b], s.splits[b], slot0, start, end, _cdiv(max(end - start, 0), block_n), slot0 + k]
            assert table[r * WORK_ITEM_INTS:(r + 1) * WORK_ITEM_INTS] == want, (r, i, want)
        assert all(table[r * WORK_ITEM_INTS] == 0 for r in range(len(s.pieces), plan.grid_items))
        expected = [len(s.split_requests)]
        for b in s.split_requests:
            expected += [b, s.slot_base[b], s.splits[b]]
        assert split_index[:len(expected)] == expected


@pytest.mark.parametrize("kind,batch,seq_len", [("one-long", 64, 8192), ("one-long", 128, 32768),
                                                ("one-long", 32, 8192), ("long-tail", 64, 32768),
                                                ("long-tail", 32, 32768)])
def test_share_plan_shortens_ragged_steps(kind, batch, seq_len):
    """The ragged cells the balanced plan leaves far from the ideal (its items are whole requests or equal
    chunks, so 63 requests of 16 tiles and one of 128 on 66 slots take two waves): pieces cut at share boundaries,
    longest first, bring the modelled step within 1.35x of the ideal and below the balanced plan's (longest
    first). (At B <= 8 with one 32k request the split cap binds both plans: P >= cdiv(512, 31) tiles.)"""
    lens = ([seq_len] + [seq_len // 8] * (batch - 1) if kind == "one-long" else _bench_long_tail(batch, seq_len))
    bal = plan_splits(batch, 1, 128, ROWS, NUM_SMS, balanced=True)
    per = plan_splits(batch, 1, 128, ROWS, NUM_SMS, balanced=True, device_plan="shares")
    lpt = makespan(plan_cta_costs(bal, lens, 1, 128, BLOCK_N, longest_first=True), NUM_SMS)
    shares = makespan(plan_cta_costs(per, lens, 1, 128, BLOCK_N, longest_first=True), NUM_SMS)
    ideal = ideal_makespan(lens, 1, 128, ROWS, BLOCK_N, NUM_SMS)
    print(f"{kind} B={batch} S={seq_len}: balanced {lpt:.1f}, shares {shares:.1f}, ideal {ideal:.1f}")
    assert shares < lpt and shares <= 1.35 * ideal, (lpt, shares, ideal)


def test_share_plan_needs_two_splits():
    with pytest.raises(ValueError, match="max_splits must be >= 2"):
        share_schedule([100], 64, 128, 66, 1)
    with pytest.raises(ValueError, match="max_splits must be >= 2"):
        plan_splits(4, 1, 128, 64, 132, max_splits=1, balanced=True, device_plan="shares")


def _leaves_wave_gap_transcribed(lens, block_n, per_work, num_splits, work_target) -> bool:
    """kernels/cute_common/scheduler.py ``BalancedScheduler.leaves_wave_gap``: T, then the count of items of at
    least cdiv(4 T, 5 W) tiles, request by request (n_b - 1 items of ct_b tiles and a last one)."""
    tiles = [max((x + block_n - 1) // block_n, 1) for x in lens]
    wide = (4 * sum(tiles) + 5 * work_target - 1) // (5 * work_target)
    count = 0
    for t in tiles:
        ct = _cdiv(t, min(_cdiv(t, per_work), num_splits))
        n = _cdiv(t, ct)
        count += (n - 1) * (ct >= wide) + (t - (n - 1) * ct >= wide)
    return count > work_target


@pytest.mark.parametrize("heads,q_len,num_sms,max_splits,block_n", CASES)
def test_auto_choice_matches_reference(heads, q_len, num_sms, max_splits, block_n):
    """The plan kernel's choice (every warp decides alike, from the balanced plan's p) equals ``prefers_shares``
    on random batches, and ``step_schedule`` returns the chosen schedule."""
    rng = random.Random(hash((heads, q_len, num_sms, max_splits, block_n, 3)) & 0xFFFF)
    rows = min(ROWS, heads)
    picked = 0
    for _ in range(200):
        batch = rng.choice([1, 2, 3, 7, 31, 65, 66, 130, 300])
        lens = _random_lens(rng, batch)
        if rng.random() < 0.4:  # one long request among short ones: the batches the choice is for
            lens = [rng.randint(64, 70_000)] + [rng.randint(900, 1100) for _ in range(batch - 1)]
        plan = plan_splits(batch, q_len, heads, rows, num_sms, max_splits=max_splits, balanced=True,
                           device_plan="auto")
        bal = balanced_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
        want = prefers_shares(bal, plan.work_target)
        assert _leaves_wave_gap_transcribed(lens, block_n, bal.per_work, plan.num_splits, plan.work_target) == want
        chosen = step_schedule(lens, block_n, plan, "auto")
        assert chosen.splits == (share_schedule(lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
                                 if want else bal).splits
        picked += want
    if num_sms == 132 and heads == 128 and max_splits >= 16:
        assert 0 < picked < 200  # both choices occur


@pytest.mark.parametrize("kind,batch,seq_len,q_len,shares", [
    ("one-long", 32, 8192, 1, True), ("one-long", 64, 8192, 1, True), ("one-long", 32, 8192, 2, True),
    ("one-long", 128, 8192, 1, False), ("one-long", 32, 32768, 1, False), ("long-tail", 128, 8192, 1, False),
    ("long-tail", 64, 32768, 1, False), ("none", 128, 1024, 1, False), ("none", 32, 8192, 1, False),
    ("none", 1, 32768, 4, False)])
def test_auto_choice_on_the_measured_cells(kind, batch, seq_len, q_len, shares):
    """The choice on the benchmark's cells measured both ways on the H100 (docs/perf/split_plan.md):
    shares where it was 8-25% faster (one long request among 1k ones at 8k: the balanced items are W + a few of
    16 tiles), balanced where shares was slower or even (uniform batches: up to 1.31x slower at B=128 S=1k; long
    tails; the split cap binding at 32k)."""
    lens = [seq_len] * batch if kind == "none" else (
        [seq_len] + [1024] * (batch - 1) if kind == "one-long" else _bench_long_tail(batch, seq_len))
    plan = plan_splits(batch, q_len, 128, ROWS, NUM_SMS, balanced=True, device_plan="auto")
    assert isinstance(step_schedule(lens, BLOCK_N, plan, "auto"), ShareSchedule) == shares
