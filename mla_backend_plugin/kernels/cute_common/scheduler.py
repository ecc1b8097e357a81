"""The balanced split-KV plan as a CuTe kernel computes it on the device (``BalancedScheduler``, ``StepPlanKernel``).

ops/plan.py ``balanced_schedule`` is the Python reference; this is the same integer formula, bit for bit
(tests/test_planner_balanced.py emulates the warp algorithm on CPU against it; the GPU tests check the split
list and the work items written on the device). A split kernel's grid is (m-blocks, work items). Two ways to
get a CTA's item, both from seq_lens on the device, so a captured CUDA graph replays correctly with new lengths:

* ``plan_item``: every warp of the split kernel derives its item from all of seq_lens on its own (cute_sm100);
* ``StepPlanKernel`` + ``read_item``: one small kernel (a warp per item) writes every item of the step into the
  workspace's ``work_items`` once, and every layer's split kernel loads its own (cute_sm90). The split kernel
  then holds none of the schedule's code (~1500 instructions fetched cold per CTA) and starts its KV loads one
  dependent load after its PDL wait instead of three passes over seq_lens (docs/perf/split_plan.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from mla_backend_plugin.kernels.cute_common.compat import SHFL_UP_CLAMP
from mla_backend_plugin.ops.constants import SHARE_REQUEST_COST, WORK_ITEM_INTS


@cute.jit
def warp_inclusive_sum(x, lane):
    """Inclusive prefix sum of ``x`` over the warp's lanes (5 shuffles)."""
    incl = x
    for d in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << d, mask_and_clamp=SHFL_UP_CLAMP)
        if lane >= (1 << d):
            incl = incl + up
    return incl


class BalancedScheduler:
    """Work items of the balanced plan for a kernel whose KV tile is ``block_n`` keys (the plan's unit)."""

    def __init__(self, block_n: int):
        self.block_n = block_n

    @cute.jit
    def plan_item(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, w, mblk, tidx, num_splits, min_chunk,
                  work_target):
        """This CTA's work item: (request + 1, or 0 past the schedule's end; request b; its seq_len; its splits;
        the partial slot of its split 0 (= w - split: a split request's slots are consecutive); the item's KV
        range [kv_start, kv_end) and tiles). The CTAs of m-block 0 also write the combine's list
        (ops/plan.py balanced_schedule): J, then (b, S_b, n_b) of each split request."""
        b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, _, _ = self.plan_item_and_totals(
            mSeq, mSplitIndex, w, mblk, tidx, num_splits, min_chunk, work_target)
        return b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles

    @cute.jit
    def plan_item_and_totals(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, w, mblk, tidx, num_splits,
                             min_chunk, work_target, per_work=None, long_splits=None):
        """``plan_item``'s tuple, then the schedule's p (tiles per item) and NS (partial slots). ``per_work``: p
        when the caller has it (the auto plan), else derived here; ``long_splits``: the plan's long cap (None:
        none, as for a zero SplitPlan.long_splits)."""
        b1, split, n_splits, chunk, j, num_split, per_work, num_slots = self.work_item(
            mSeq, w, num_splits, min_chunk, work_target, per_work, long_splits)
        if tidx == 0 and mblk == 0:
            if w == 0:
                mSplitIndex[0] = num_split
            if split == 0 and n_splits > 1:
                mSplitIndex[1 + 3 * j] = b1 - 1
                mSplitIndex[2 + 3 * j] = w
                mSplitIndex[3 + 3 * j] = n_splits
        b = cutlass.max(b1 - 1, 0)  # request 0 stands in past the end (never used there)
        seq_len = mSeq[b]
        kv_start = split * chunk
        kv_end = cutlass.min(kv_start + chunk, seq_len)
        n_tiles = cutlass.max(kv_end - kv_start + self.block_n - 1, 0) // self.block_n
        return b1, b, seq_len, n_splits, w - split, kv_start, kv_end, n_tiles, per_work, num_slots

    @cute.jit
    def write_item(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, mWork: cute.Tensor, w, lane, num_splits,
                   min_chunk, work_target, per_work=None, long_splits=None):
        """Work item w as ``plan_item`` derives it (the split list too) and w itself (its partial slot), stored
        by lane 0 in the order ``read_item`` loads it at the item's rank in the longest-first launch order
        (``launch_rank``); items past the schedule's end store b1 = 0 at their own index (the ranks of the
        schedule's N items are 0..N-1)."""
        b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, per_work, num_slots = self.plan_item_and_totals(
            mSeq, mSplitIndex, w, 0, lane, num_splits, min_chunk, work_target, per_work, long_splits)
        rank = w
        if b1 > 0:  # warp-uniform
            rank = self.launch_rank(mSeq, w, cutlass.max(n_tiles, 1), per_work, num_splits, num_slots, long_splits)
        if lane == 0:
            item = (b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, w)
            for i in cutlass.range_constexpr(len(item)):
                mWork[rank * WORK_ITEM_INTS + i] = item[i]

    @cute.jit
    def launch_rank(self, mSeq: cute.Tensor, w, key, per_work, num_splits, num_slots, long_splits=None):
        """Position of item w, of ``key`` tiles, in the launch order (ops/plan.py
        ``BalancedSchedule.longest_first``): the items with more tiles, plus those with as many and a smaller
        index. Request b's n_b items start at index f_b (S_b when split, else NS + #unsplit requests before b)
        and have ct_b tiles but the last, which has tiles_b - (n_b - 1) ct_b (ct_b when unsplit), so each lane
        counts its requests' items in closed form: one more pass over seq_lens, as pass 3 of ``work_item``."""
        batch = mSeq.shape[0]
        lane = cute.arch.lane_idx()
        lane_rank = cutlass.Int32(0)
        slots_so_far = cutlass.Int32(0)
        splits_so_far = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            n, chunk, slots_before, splits_before, step_slots, step_splits = self.schedule_step(
                mSeq, base, batch, per_work, num_splits, lane, long_splits)
            for u in cutlass.range_constexpr(4):
                b = base + 4 * lane + u
                if n[u] > 0:  # inside the batch
                    tiles = cutlass.max((mSeq[b] + self.block_n - 1) // self.block_n, 1)
                    ct = chunk[u] // self.block_n
                    last = tiles - (n[u] - 1) * ct
                    first = self.first_item(n[u], b, slots_so_far + slots_before[u], splits_so_far + splits_before[u],
                                            num_slots)
                    if ct > key:
                        lane_rank = lane_rank + n[u] - 1
                    if ct == key:
                        lane_rank = lane_rank + cutlass.max(cutlass.min(w - first, n[u] - 1), 0)
                    if last > key:
                        lane_rank = lane_rank + 1
                    if last == key:
                        if first + n[u] - 1 < w:
                            lane_rank = lane_rank + 1
            slots_so_far = slots_so_far + step_slots
            splits_so_far = splits_so_far + step_splits
        return cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_rank))

    @cute.jit
    def read_item(self, mWork: cute.Tensor, w):
        """The item CTA column w runs: ``plan_item``'s tuple and the item's partial slot, from the step's table
        (``StepPlanKernel`` wrote it in launch order): 9 independent loads, no pass over seq_lens."""
        item = [None] * WORK_ITEM_INTS
        for i in cutlass.range_constexpr(WORK_ITEM_INTS):
            item[i] = mWork[w * WORK_ITEM_INTS + i]
        return item[0], item[1], item[2], item[3], item[4], item[5], item[6], item[7], item[8]

    @cute.jit
    def work_item(self, mSeq: cute.Tensor, w, num_splits, min_chunk, work_target, per_work=None, long_splits=None):
        """Work item w of the balanced plan -> (request + 1, or 0 past the schedule's end; split; splits of the
        request; its chunk in tokens; its index j among split requests; J, the number of split requests; p, the
        tiles per item; NS, the partial slots).

        The integer formula is ops/plan.py ``balanced_schedule`` (the Triton kernel derives the same).
        Every warp derives it on its own from all of seq_lens (no shared memory or barrier), 128 requests per
        step: lane l holds requests 4l..4l+3 of the step, so one warp scan per step gives every request's count
        of earlier split requests and partial slots, and each lane has its 4 loads in flight at once (dependent
        global loads are slow while the other SMs stream KV: docs/perf/split_plan.md)."""
        batch = mSeq.shape[0]
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(per_work is None):
            per_work = self.per_work(mSeq, batch, lane, num_splits, min_chunk, work_target, long_splits)

        # pass 2: items of split requests come first (w = S_b + split, S_b = partial slots of earlier split
        # requests), in order of b; totals NS (slots) and J (split requests)
        hit_b1 = cutlass.Int32(0)
        hit_split = cutlass.Int32(0)
        hit_n = cutlass.Int32(0)
        hit_chunk = cutlass.Int32(0)
        hit_j = cutlass.Int32(0)
        num_slots = cutlass.Int32(0)
        num_split = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            n, chunk, slots_before, splits_before, step_slots, step_splits = self.schedule_step(
                mSeq, base, batch, per_work, num_splits, lane, long_splits)
            for u in cutlass.range_constexpr(4):
                first = num_slots + slots_before[u]
                if n[u] > 1 and first <= w and w < first + n[u]:
                    hit_b1 = base + 4 * lane + u + 1
                    hit_split = w - first
                    hit_n = n[u]
                    hit_chunk = chunk[u]
                    hit_j = num_split + splits_before[u]
            num_slots = num_slots + step_slots
            num_split = num_split + step_splits
        # pass 3, for CTAs past the split items: one item per unsplit request (w = NS + #unsplit requests
        # before b = NS + b - #split requests before b), in order of b
        if w >= num_slots:
            splits_so_far = cutlass.Int32(0)
            for base in cutlass.range(0, batch, 128, unroll=1):
                n, chunk, slots_before, splits_before, step_slots, step_splits = self.schedule_step(
                    mSeq, base, batch, per_work, num_splits, lane, long_splits)
                for u in cutlass.range_constexpr(4):
                    b = base + 4 * lane + u
                    if b < batch and n[u] == 1 and self.first_item(1, b, 0, splits_so_far + splits_before[u],
                                                                   num_slots) == w:
                        hit_b1 = b + 1
                        hit_n = 1
                        hit_chunk = chunk[u]
                splits_so_far = splits_so_far + step_splits
        # at most one lane holds the hit (none past the schedule's end: every lane's zeros are the answer)
        hits = cute.arch.vote_ballot_sync(hit_b1 > 0)
        src = cutlass.min(cute.arch.popc((hits & (0 - hits)) - 1), 31)  # the lowest set bit's lane
        return (cute.arch.shuffle_sync(hit_b1, src), cute.arch.shuffle_sync(hit_split, src),
                cute.arch.shuffle_sync(hit_n, src), cute.arch.shuffle_sync(hit_chunk, src),
                cute.arch.shuffle_sync(hit_j, src), num_split, per_work, num_slots)

    @cute.jit
    def first_item(self, n, b, slots_before, splits_before, num_slots):
        """Index w of request b's first work item, from the counts before it in order of b: a split request's
        items come first (w = S_b, the partial slots before it), an unsplit request's come after all NS of them
        (w = NS + #unsplit requests before b). Pass 3 of ``work_item`` and ``launch_rank`` share it."""
        first = num_slots + b - splits_before
        if n > 1:
            first = slots_before
        return first

    @cute.jit
    def per_work(self, mSeq: cute.Tensor, batch, lane, num_splits, min_chunk, work_target, long_splits=None):
        """p, the tiles per work item, with the one-wave search (ops/plan.py balanced_schedule)."""
        return self.per_work_and_total(mSeq, batch, lane, num_splits, min_chunk, work_target, long_splits)[0]

    @cute.jit
    def per_work_and_total(self, mSeq: cute.Tensor, batch, lane, num_splits, min_chunk, work_target,
                           long_splits=None):
        """(p, T): the tiles per work item, with the one-wave search (ops/plan.py balanced_schedule), and the
        batch's tiles. The search runs only for a batch of fewer requests than the wave whose items could
        overflow it; its bisection steps re-read seq_lens from L1."""
        # T = sum_b tiles_b, the shortest and the longest request's tiles
        lane_total = cutlass.Int32(0)
        lane_min = cutlass.Int32(1 << 30)
        lane_max = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            for u in cutlass.range_constexpr(4):
                b = base + 4 * lane + u
                if b < batch:
                    tiles = cutlass.max((mSeq[b] + self.block_n - 1) // self.block_n, 1)
                    lane_total = lane_total + tiles
                    lane_min = cutlass.min(lane_min, tiles)
                    lane_max = cutlass.max(lane_max, tiles)
        # warp-uniform hints: the search's branches and loop then stay convergent for ptxas (without them it
        # fenced the later warp-synchronous instructions: 55 more WARPSYNC/collective ops in fp8 design B)
        total = cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_total))
        min_tiles = cute.arch.make_warp_uniform(cute.arch.warp_reduction(lane_min, cutlass.min))
        max_tiles = cute.arch.make_warp_uniform(cute.arch.warp_reduction_max(lane_max))
        p = cutlass.max((min_chunk + self.block_n - 1) // self.block_n, (total + work_target - 1) // work_target)
        if batch < work_target and 2 * min_tiles >= p and batch * ((max_tiles + p - 1) // p) > work_target:
            # I(p) > W? then I(hi) <= W for hi bounded by 1.5 p? then bisect: a small state machine around one
            # evaluation of I, so the kernel holds one copy of its code (three inlined copies added ~1600
            # instructions; docs/perf/split_plan.md)
            lo = p
            hi = cutlass.min((total - batch + work_target - batch - 1) // (work_target - batch), max_tiles)
            hi = cutlass.min(hi, 3 * p // 2)
            x = p
            state = cutlass.Int32(0)  # 0: test p, 1: test hi, 2: bisect, 3: done
            for _ in cutlass.range(0, 34, unroll=1):  # 2 tests + at most 31 bisection steps over int32
                if state < 3:
                    fits = self.num_items(mSeq, batch, lane, x, num_splits, long_splits) <= work_target
                    if state == 2:
                        if fits:
                            hi = x
                        else:
                            lo = x
                    if state == 1:
                        state = 3
                        if fits:
                            state = 2
                    if state == 0:
                        state = 1
                        if fits:
                            state = 3
                        x = hi
                    if state == 2:
                        if hi - lo > 1:
                            x = (lo + hi) // 2
                        else:
                            state = 3
                            p = hi
        return p, total

    @cute.jit
    def leaves_wave_gap(self, mSeq: cute.Tensor, batch, lane, per_work, total, num_splits, work_target,
                        long_splits=None):
        """Whether the balanced plan's items with p = ``per_work`` (T = ``total`` tiles) leave a wave gap the
        share plan closes (ops/plan.py ``prefers_shares``): more than W items of at least cdiv(4 T, 5 W)
        tiles. One pass over seq_lens (request b has n_b - 1 items of ct_b tiles and a last one)."""
        wide = (4 * total + 5 * work_target - 1) // (5 * work_target)
        lane_count = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            for u in cutlass.range_constexpr(4):
                b = base + 4 * lane + u
                if b < batch:
                    seq_len = mSeq[b]
                    tiles = cutlass.max((seq_len + self.block_n - 1) // self.block_n, 1)
                    n, chunk = self.request_chunks(seq_len, per_work, num_splits, long_splits)
                    ct = chunk // self.block_n
                    if ct >= wide:
                        lane_count = lane_count + n - 1
                    if tiles - (n - 1) * ct >= wide:
                        lane_count = lane_count + 1
        count = cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_count))
        return count > work_target

    @cute.jit
    def num_items(self, mSeq: cute.Tensor, batch, lane, per_work, num_splits, long_splits=None):
        """I(p): the work items of the schedule with p tiles per item (the whole warp gets the sum)."""
        lane_items = cutlass.Int32(0)
        for b in cutlass.range(lane, batch, 32, unroll=1):  # batch < W: a few requests per lane, one code copy
            lane_items = lane_items + self.request_chunks(mSeq[b], per_work, num_splits, long_splits)[0]
        return cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_items))

    @cute.jit
    def request_chunks(self, seq_len, per_work, num_splits, long_splits=None):
        """(n_b, chunk_b in tokens) of one request; ``long_splits``: the long cap of a request whose items at
        ``num_splits`` would hold over 1.5 p tiles (ops/plan.py balanced_schedule)."""
        tiles = cutlass.max((seq_len + self.block_n - 1) // self.block_n, 1)
        cap = num_splits
        if cutlass.const_expr(long_splits is not None):
            if long_splits > num_splits and tiles > num_splits * (3 * per_work // 2):
                cap = long_splits
        n = cutlass.min((tiles + per_work - 1) // per_work, cap)
        ct = (tiles + n - 1) // n
        return (tiles + ct - 1) // ct, ct * self.block_n

    @cute.jit
    def schedule_step(self, mSeq: cute.Tensor, base, batch, per_work, num_splits, lane, long_splits=None):
        """Requests base + 4 lane + u (u < 4) of one 128-request step of the balanced plan: their splits n_b
        (0 past the batch) and chunks, the partial slots and split requests before each within the step, and
        the step's totals. One warp scan of (slots | split requests << 16): a step has at most
        128 * max(num_splits, long_splits) < 2^16 slots."""
        n = [None] * 4
        chunk = [None] * 4
        lens = [None] * 4
        for u in cutlass.range_constexpr(4):
            seq_len = cutlass.Int32(-1)  # past the batch
            if base + 4 * lane + u < batch:
                seq_len = mSeq[base + 4 * lane + u]
            lens[u] = seq_len
        packed_before = [None] * 4
        own = cutlass.Int32(0)
        for u in cutlass.range_constexpr(4):
            n_u = cutlass.Int32(0)
            chunk_u = cutlass.Int32(0)
            if lens[u] >= 0:
                n_u, chunk_u = self.request_chunks(lens[u], per_work, num_splits, long_splits)
            n[u] = n_u
            chunk[u] = chunk_u
            packed_before[u] = own
            if n_u > 1:
                own = own + n_u + (1 << 16)
        incl = warp_inclusive_sum(own, lane)
        step = cute.arch.shuffle_sync(incl, 31)
        slots_before = [None] * 4
        splits_before = [None] * 4
        for u in cutlass.range_constexpr(4):
            before = incl - own + packed_before[u]
            slots_before[u] = before & 0xFFFF
            splits_before[u] = before >> 16
        return n, chunk, slots_before, splits_before, step & 0xFFFF, step >> 16


class ShareScheduler:
    """The share plan on the device (ops/plan.py ``share_schedule``, bit for bit): warp i of the plan kernel
    finds piece i (request order), writes it as a work item at its rank in the longest-first launch order (its
    partial slot as the 9th int, as ``BalancedScheduler.write_item``) and, for a split request's first piece, its
    entry of the split list. Three passes over seq_lens, lane l holding requests 4 l .. 4 l + 3 of each
    128-request step: the line's length, the piece's request (two warp scans per step), the piece's rank."""

    def __init__(self, block_n: int):
        self.block_n = block_n

    @cute.jit
    def tiles(self, seq_len):
        return cutlass.max((seq_len + self.block_n - 1) // self.block_n, 1)

    @cute.jit
    def per_share(self, mSeq: cute.Tensor, batch, lane, shares, num_splits, min_chunk):
        """P: units of the line per share."""
        lane_line = cutlass.Int32(0)
        lane_max = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            for u in cutlass.range_constexpr(4):
                b = base + 4 * lane + u
                if b < batch:
                    t = self.tiles(mSeq[b])
                    lane_line = lane_line + t + SHARE_REQUEST_COST
                    lane_max = cutlass.max(lane_max, t)
        line = cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_line))
        max_tiles = cute.arch.make_warp_uniform(cute.arch.warp_reduction_max(lane_max))
        p = cutlass.max((min_chunk + self.block_n - 1) // self.block_n, (line + shares - 1) // shares)
        return cutlass.max(p, (max_tiles + num_splits - 2) // (num_splits - 1))

    @cute.jit
    def share_step(self, mSeq: cute.Tensor, base, batch, lane, per_share, line_before):
        """Requests base + 4 lane + u of one 128-request step: (seq_len or -1 past the batch, s_b, first share,
        pieces n_b (0 past the batch), and the pieces / split pieces / split requests before each within the step
        as one packed int: pieces | split pieces << 11 | split requests << 22), then the step's line length and
        packed totals. A step has at most 128 + W - 1 pieces, 2 (W - 1) split pieces and 128 split requests."""
        lens = [None] * 4
        cost_before = [None] * 4
        own = cutlass.Int32(0)
        for u in cutlass.range_constexpr(4):
            seq_len = cutlass.Int32(-1)
            if base + 4 * lane + u < batch:
                seq_len = mSeq[base + 4 * lane + u]
            lens[u] = seq_len
            cost_before[u] = own
            if seq_len >= 0:
                own = own + self.tiles(seq_len) + SHARE_REQUEST_COST
        incl = warp_inclusive_sum(own, lane)
        starts = [None] * 4
        first = [None] * 4
        n = [None] * 4
        packed_before = [None] * 4
        own2 = cutlass.Int32(0)
        for u in cutlass.range_constexpr(4):
            s0 = line_before + incl - own + cost_before[u] + SHARE_REQUEST_COST
            lo = s0 // per_share
            n_u = cutlass.Int32(0)
            if lens[u] >= 0:
                n_u = (s0 + self.tiles(lens[u]) - 1) // per_share - lo + 1
            starts[u] = s0
            first[u] = lo
            n[u] = n_u
            packed_before[u] = own2
            own2 = own2 + n_u
            if n_u > 1:
                own2 = own2 + (n_u << 11) + (1 << 22)
        incl2 = warp_inclusive_sum(own2, lane)
        for u in cutlass.range_constexpr(4):
            packed_before[u] = packed_before[u] + incl2 - own2
        return (lens, starts, first, n, packed_before, cute.arch.shuffle_sync(incl, 31),
                cute.arch.shuffle_sync(incl2, 31))

    @cute.jit
    def write_piece(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, mWork: cute.Tensor, i, lane, shares,
                    num_splits, min_chunk):
        batch = mSeq.shape[0]
        per_share = self.per_share(mSeq, batch, lane, shares, num_splits, min_chunk)
        # pass 2: piece i's request; the totals (pieces, split requests)
        line_before = cutlass.Int32(0)
        pieces_before = cutlass.Int32(0)
        slots_before = cutlass.Int32(0)
        splits_before = cutlass.Int32(0)
        hit_b1 = cutlass.Int32(0)
        hit_k = cutlass.Int32(0)
        hit_n = cutlass.Int32(0)
        hit_len = cutlass.Int32(0)
        hit_start = cutlass.Int32(0)
        hit_slot0 = cutlass.Int32(0)
        hit_j = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            lens, starts, first, n, before, step_line, step = self.share_step(mSeq, base, batch, lane, per_share,
                                                                               line_before)
            for u in cutlass.range_constexpr(4):
                piece0 = pieces_before + (before[u] & 0x7FF)
                if piece0 <= i and i < piece0 + n[u]:
                    hit_b1 = base + 4 * lane + u + 1
                    hit_k = i - piece0
                    hit_n = n[u]
                    hit_len = lens[u]
                    hit_start = starts[u]
                    hit_slot0 = slots_before + ((before[u] >> 11) & 0x7FF)
                    hit_j = splits_before + (before[u] >> 22)
            line_before = line_before + step_line
            pieces_before = pieces_before + (step & 0x7FF)
            slots_before = slots_before + ((step >> 11) & 0x7FF)
            splits_before = splits_before + (step >> 22)
        if i == 0 and lane == 0:
            mSplitIndex[0] = splits_before
        hits = cute.arch.vote_ballot_sync(hit_b1 > 0)
        src = cutlass.min(cute.arch.popc((hits & (0 - hits)) - 1), 31)  # the lowest set bit's lane (none: 31)
        b1 = cute.arch.make_warp_uniform(cute.arch.shuffle_sync(hit_b1, src))
        if b1 > 0:
            k = cute.arch.shuffle_sync(hit_k, src)
            n = cute.arch.shuffle_sync(hit_n, src)
            seq_len = cute.arch.shuffle_sync(hit_len, src)
            s0 = cute.arch.shuffle_sync(hit_start, src)
            slot0 = cute.arch.shuffle_sync(hit_slot0, src)
            j = cute.arch.shuffle_sync(hit_j, src)
            t = self.tiles(seq_len)
            c = s0 // per_share + k
            t0 = cutlass.max(s0, c * per_share) - s0
            t1 = cutlass.min(s0 + t, (c + 1) * per_share) - s0
            kv_start = t0 * self.block_n
            kv_end = cutlass.min(t1 * self.block_n, seq_len)
            n_tiles = (cutlass.max(kv_end - kv_start, 0) + self.block_n - 1) // self.block_n
            if n == 1:
                slot0 = cutlass.Int32(0)
            rank = self.launch_rank(mSeq, batch, lane, per_share, i, t1 - t0)
            if lane == 0:
                item = (b1, b1 - 1, seq_len, n, slot0, kv_start, kv_end, n_tiles, slot0 + k)
                for f in cutlass.range_constexpr(len(item)):
                    mWork[rank * WORK_ITEM_INTS + f] = item[f]
                if k == 0 and n > 1:
                    mSplitIndex[1 + 3 * j] = b1 - 1
                    mSplitIndex[2 + 3 * j] = slot0
                    mSplitIndex[3 + 3 * j] = n
        else:
            if lane == 0:  # past the schedule's end: the CTA at this place exits
                mWork[i * WORK_ITEM_INTS] = 0

    @cute.jit
    def launch_rank(self, mSeq: cute.Tensor, batch, lane, per_share, i, key):
        """Position of piece i, of ``key`` tiles, in the launch order (``ShareSchedule.longest_first``): the
        pieces with more tiles, plus those with as many and a smaller index. A request's n_b pieces are its first
        (to the end of its first share), n_b - 2 whole shares and its last, so each lane counts in closed form."""
        line_before = cutlass.Int32(0)
        pieces_before = cutlass.Int32(0)
        lane_rank = cutlass.Int32(0)
        for base in cutlass.range(0, batch, 128, unroll=1):
            lens, starts, first, n, before, step_line, step = self.share_step(mSeq, base, batch, lane, per_share,
                                                                               line_before)
            for u in cutlass.range_constexpr(4):
                if n[u] > 0:
                    t = self.tiles(lens[u])
                    piece0 = pieces_before + (before[u] & 0x7FF)
                    head = cutlass.min(t, (first[u] + 1) * per_share - starts[u])  # the first piece (all if n = 1)
                    tail = starts[u] + t - (first[u] + n[u] - 1) * per_share  # the last (n > 1)
                    if head > key or (head == key and piece0 < i):
                        lane_rank = lane_rank + 1
                    if n[u] > 1:
                        if tail > key or (tail == key and piece0 + n[u] - 1 < i):
                            lane_rank = lane_rank + 1
                        if per_share > key:
                            lane_rank = lane_rank + n[u] - 2
                        if per_share == key:
                            lane_rank = lane_rank + cutlass.min(cutlass.max(i - piece0 - 1, 0), n[u] - 2)
            line_before = line_before + step_line
            pieces_before = pieces_before + (step & 0x7FF)
        return cute.arch.make_warp_uniform(cute.arch.warp_reduction_sum(lane_rank))


class StepPlanKernel:
    """Writes every work item of one decode step's plan and the combine's split list into the workspace: grid
    (G,), one warp per item. ``shares`` = 0: the balanced plan (``BalancedScheduler.write_item``); W: the share
    plan (``ShareScheduler.write_piece``); -W: the share plan when the balanced one leaves a wave gap
    (``BalancedScheduler.leaves_wave_gap``; every warp decides alike). Launched before the first layer's split
    kernel of a step (ops/workspace.py ``StepPlans`` says when; its launch is captured with that layer's in a
    CUDA graph). With PDL it lets the split kernel launch at once: the split kernel's ``griddepcontrol.wait``
    waits for this grid to complete, so its prologue (barriers, TMA descriptors) overlaps the planning."""

    def __init__(self, block_n: int, use_pdl: bool = True):
        self.scheduler = BalancedScheduler(block_n)
        self.shares = ShareScheduler(block_n)
        self.use_pdl = use_pdl

    @cute.jit
    def __call__(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, mWork: cute.Tensor, num_splits: cutlass.Int32,
                 long_splits: cutlass.Int32, min_chunk: cutlass.Int32, work_target: cutlass.Int32,
                 grid_items: cutlass.Int32, shares: cutlass.Int32, stream):
        self.kernel(mSeq, mSplitIndex, mWork, num_splits, long_splits, min_chunk, work_target, shares).launch(
            grid=(grid_items, 1, 1), block=[32, 1, 1], stream=stream, use_pdl=self.use_pdl)

    @cute.kernel
    def kernel(self, mSeq: cute.Tensor, mSplitIndex: cute.Tensor, mWork: cute.Tensor, num_splits: cutlass.Int32,
               long_splits: cutlass.Int32, min_chunk: cutlass.Int32, work_target: cutlass.Int32,
               shares: cutlass.Int32):
        w, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()  # seq_lens may come from the previous kernel
        # the balanced plan's p first, in every mode (auto decides with it; one copy of each path's code: this
        # kernel's time is mostly its cold instruction fetch, docs/perf/split_plan.md)
        per_work, total = self.scheduler.per_work_and_total(mSeq, mSeq.shape[0], lane, num_splits, min_chunk,
                                                            work_target, long_splits)
        use_shares = shares > 0
        if shares < 0:
            use_shares = self.scheduler.leaves_wave_gap(mSeq, mSeq.shape[0], lane, per_work, total, num_splits,
                                                        work_target, long_splits)
        if use_shares:
            self.shares.write_piece(mSeq, mSplitIndex, mWork, w, lane, work_target, num_splits, min_chunk)
        else:
            self.scheduler.write_item(mSeq, mSplitIndex, mWork, w, lane, num_splits, min_chunk, work_target, per_work,
                                      long_splits)
