"""The split planner: how a decode call's KV sequences are split across CTAs (the Python twin of the device plans).

Split-KV planning is two-level so that it stays correct under graph replay: the host fixes the grid from
shapes alone (vLLM captures one graph per batch size), the device decides from seq_lens. Two device plans exist:

* the uniform plan (``balanced=False``; xqa_sm120, and Triton with CUTE_MLA_TRITON_SPLITS=uniform): the host's
  ``num_splits(batch, q_len)`` is the grid's z size, 1 once the batch fills the GPU, and each request takes
  ``min(num_splits, cdiv(seq_len, min_chunk))`` of those splits (``uniform_request_splits``);
* the balanced plan (``balanced=True``; cute_sm90 and Triton): the grid enumerates work items, every CTA reads all
  seq_lens and derives the same schedule, which gives each request a number of equal chunks proportional to
  its share of the batch's KV tiles, so one long request in a batch of short ones is split even at large
  batch sizes while a uniform batch that fills the GPU is not split at all (``balanced_schedule`` documents
  the exact integer formula every kernel must reproduce); a step-planned kernel may run the share plan instead
  (``share_schedule``, ``step_schedule``).

``plan_splits`` is the host half (``SplitPlan``, with the combine's tile from ``combine_tiles``); the schedules are
the device half's reference, bit for bit. The buffers a plan needs live in ops/workspace.py (``MLAWorkspace``);
the CPU model of a plan's step time (makespans) is testing/schedule_model.py.
"""

from __future__ import annotations

import dataclasses

from mla_backend_plugin.ops.constants import KV_LORA_RANK, SHARE_REQUEST_COST

# Split the KV sequence until the grid has this many CTAs per SM: the Triton, CuTe and XQA tiles each fill an
# SM's shared memory, so one CTA is resident per SM (measured against 2 and 4: docs/perf/triton.md).
TARGET_CTAS_PER_SM = 1
MAX_SPLITS = 32
# The most splits per request any plan may use (LaunchConfig.max_splits <= 64: the CuTe schedule packs
# 128 x max_splits into 16 bits).
SPLIT_CAPACITY = 64
# What a step-planned kernel's device plan may be (SplitPlan.device_plan)
DEVICE_PLANS = ("balanced", "shares", "auto")
# Smallest KV chunk (tokens) worth a split of its own: below it the combine and the prologue cost more
# than the parallelism gains.
MIN_CHUNK_TOKENS = 128
# Elements of one (rows, splits, columns) tile of partials a combine CTA loads per round beyond 16 x 128
# row-requests (``combine_tiles``): 64 fp32 registers per thread at the combine's 4 warps.
COMBINE_TILE_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    rows_per_cta: int  # query rows (q_len * heads are folded into M) one CTA of the split kernel owns
    num_splits: int  # uniform: grid z, fixed per batch size; balanced: the cap on splits per request
    min_chunk: int  # tokens; the smallest chunk a request is split into
    # --- balanced plan only (balanced=False leaves the defaults) ---
    balanced: bool = False
    work_target: int = 0  # W: work items per m-block the device plan aims at (~ one wave of the GPU)
    grid_items: int = 0  # G: the split kernel's grid is (m_blocks, G); items past the schedule's end exit
    max_split_requests: int = 0  # J_max: most requests that can be split; the combine's grid is (.., J_max)
    max_slots: int = 0  # most partial slots (one per split item): partial rows needed = max_slots * q_len * H
    combine_rows: int = 2  # query rows one combine CTA merges (power of 2)
    combine_col_blocks: int = 1  # column blocks of the 512 output columns, one combine CTA each (power of 2)
    combine_split_block: int = 1  # splits one combine CTA loads per round (power of 2)
    # balanced plans only: which schedule a step-planned kernel (cute_sm90) writes: "balanced"
    # (``balanced_schedule``), "shares" (``share_schedule``: the same bounds and grid, requests split at the
    # boundaries of W equal shares of the step's tiles) or "auto" (``step_schedule``: shares when
    # ``prefers_shares``)
    device_plan: str = "balanced"
    # balanced plans: the cap of a request whose items at ``num_splits`` would be the step's critical path
    # (``balanced_schedule``); 0 = ``num_splits`` for every request
    long_splits: int = 0

    @property
    def request_split_limit(self) -> int:
        """The most splits the plan gives any request: the long cap when there is one, else the cap."""
        return self.long_splits or self.num_splits

    @property
    def has_combine(self) -> bool:
        return self.max_split_requests > 0 if self.balanced else self.num_splits > 1


def plan_splits(batch: int, q_len: int, num_heads: int, rows_per_cta: int, num_sms: int,
                max_splits: int = MAX_SPLITS, min_chunk: int = MIN_CHUNK_TOKENS,
                balanced: bool = False, device_plan: str = "balanced", long_splits: int = 0) -> SplitPlan:
    """Host half of split planning: depends only on shapes known at graph-capture time.

    Uniform (default): ``num_splits`` is the grid's z size, 1 once ``batch * m_blocks`` CTAs fill the GPU.

    Balanced: W = cdiv(TARGET_CTAS_PER_SM * num_sms, m_blocks) work items per m-block (one wave), grid
    (m_blocks, G) with G = min(batch + W - 1, batch * max_splits) items, which bounds the schedule of
    ``balanced_schedule`` for every seq_lens: sum_b cdiv(tiles_b, p) < T / p + batch <= W + batch. So at most
    W - 1 CTAs per m-block exit at once (about one per SM, whatever the batch) - the trade-off against a
    (batch, m_blocks, Z) grid, whose batch * m_blocks * (Z - 1) empty CTAs cost measurably at large batches of
    short requests (docs/perf/split_plan.md). Split requests each have tiles_b > p >= T / W, so there are at most
    J_max = min(batch, W - 1) of them (J of them), and their items (the partial slots) number
    NS <= sum_split (tiles_b + p - 1) / p <= (T - (batch - J) + J (p - 1)) / p <= W + J - batch / p < W + J,
    so max_slots = min(W + J_max - 1, batch * max_splits): no more than the uniform plan's worst case.

    ``device_plan`` "shares" / "auto" (``balanced=True``): the same numbers, which bound ``share_schedule`` too.
    ``long_splits`` (balanced, > max_splits): a long request's cap (``balanced_schedule``); the bounds above then
    hold with max_splits = long_splits.
    """
    if device_plan not in DEVICE_PLANS:
        raise ValueError(f"plan_splits: device_plan {device_plan!r}; allowed: {', '.join(DEVICE_PLANS)}")
    shares = device_plan != "balanced"
    if shares and not balanced:
        raise ValueError(f"plan_splits: device_plan={device_plan!r} needs balanced=True (the share plan has the "
                         "balanced plan's bounds)")
    if shares and max_splits < 2:
        raise ValueError(f"plan_splits: the share plan splits requests at share boundaries: max_splits must "
                         f"be >= 2, got {max_splits}")
    if long_splits and not (balanced and max_splits <= long_splits <= SPLIT_CAPACITY):
        raise ValueError(f"plan_splits: long_splits must be 0 or in max_splits..{SPLIT_CAPACITY} with "
                         f"balanced=True, got {long_splits} (max_splits {max_splits}, balanced {balanced})")
    m_blocks = -(-(q_len * num_heads) // rows_per_cta)
    ctas = batch * m_blocks
    want = TARGET_CTAS_PER_SM * num_sms
    if not balanced:
        splits = 1 if ctas >= want else min(max_splits, -(-want // ctas))
        return SplitPlan(rows_per_cta=rows_per_cta, num_splits=max(1, splits), min_chunk=min_chunk)
    work = max(1, -(-want // m_blocks))
    long_splits = long_splits if long_splits > max_splits else 0
    most_splits = long_splits or max_splits
    j_max = 0 if most_splits <= 1 else min(batch, work - 1)
    slots = 0 if j_max == 0 else min(work + j_max - 1, batch * most_splits)
    items = batch if j_max == 0 else min(batch + work - 1, batch * most_splits)
    tiles = combine_tiles(q_len * num_heads, j_max, max_splits, num_sms)
    return SplitPlan(rows_per_cta=rows_per_cta, num_splits=max(1, max_splits), min_chunk=min_chunk, balanced=True,
                     work_target=work, grid_items=items, max_split_requests=j_max, max_slots=slots,
                     device_plan=device_plan, long_splits=long_splits, **tiles)


def combine_tiles(rows: int, j_max: int, max_splits: int, num_sms: int) -> dict:
    """The balanced combine's tile (SplitPlan's combine_* fields) for ``rows`` = q_len * H query rows of up to
    ``j_max`` split requests (the grid is rows / combine_rows x J_max x combine_col_blocks) of up to
    ``max_splits`` splits each. Measured on an H100 over the benchmark cells' split lists (docs/perf/combine.md):

    * Up to 16 x 128 row-requests (rows x J_max): 2 rows of all 512 columns a CTA, the more splits a round the
      fewer requests. A tile of fewer than 1024 outputs leaves the 128 threads fewer columns than their 8-wide
      loads cover, so the sum over splits crosses warps: the 1-row and column-split tiles these shapes took before
      spent 10 us where 2 rows take 3 (B=4, q_len 1; B=2, q_len 2; the Triton kernel's B=1-2 steps).
    * Beyond: as before, ~2 waves of CTAs of up to 16 rows and 16 / rows splits a round, so the grid stays ~500
      CTAs (it launches whole for a step of J = 0). A step with one long request among short ones then merges its
      splits with Q_LEN * H / 16 CTAs one round after another (10-19 us at B=64-128 S=32k where 2-row tiles take
      3-5): a second, few-request tile chosen by the device's J measured that, but its kernels made other cells
      up to 1.6x slower (docs/perf/combine.md), so it is not here."""
    row_requests = rows * j_max
    tile_rows = 2
    if row_requests <= 16 * 128:
        split_block = 16 if row_requests <= 4 * 128 else 8 if row_requests <= 8 * 128 else 4
    else:  # past 4 x num_sms row-requests (any GPU of <= 512 SMs) the old rule's tiles had >= 2 rows, all columns
        while tile_rows < 16 and rows % (2 * tile_rows) == 0 and row_requests // (2 * tile_rows) >= 2 * num_sms:
            tile_rows *= 2
        split_block = COMBINE_TILE_ELEMENTS // (tile_rows * KV_LORA_RANK)  # as many splits as fill one tile
    return dict(combine_rows=tile_rows, combine_col_blocks=1,
                combine_split_block=min(split_block, _pow2_at_least(max_splits)))


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def uniform_request_splits(seq_len: int, num_splits: int, min_chunk: int, block_n: int) -> tuple[int, int]:
    """(splits, chunk tokens) of one request under the uniform plan; reference of ``_request_splits``."""
    n = min(max(_cdiv(seq_len, min_chunk), 1), num_splits)
    chunk = max(_cdiv(_cdiv(seq_len, n), block_n), 1) * block_n
    return max(min(n, _cdiv(seq_len, chunk)), 1), chunk


@dataclasses.dataclass(frozen=True)
class BalancedSchedule:
    tiles: list[int]  # tiles_b
    total_tiles: int  # T
    per_work: int  # p
    splits: list[int]  # n_b
    chunk: list[int]  # chunk_b, tokens (a multiple of block_n)
    slot_base: list[int]  # S_b: the first partial slot (= work item) of a split request; -1 for others
    num_slots: int  # NS: items (and partial slots) of split requests
    split_requests: list[int]  # b of every split request, in order (the combine's list)
    items: list[tuple[int, int]]  # work item w -> (request, split), in order; w is also the item's partial slot
    block_n: int  # the plan's tile (keys)

    def item_tiles(self, w: int) -> int:
        """Tiles of work item w as the launch order counts them: min(ct_b, tiles_b - s ct_b), so a request of
        length 0 counts its one tile."""
        b, s = self.items[w]
        ct = self.chunk[b] // self.block_n
        return min(ct, self.tiles[b] - s * ct)

    def longest_first(self) -> list[int]:
        """The launch order of a step-planned kernel (cute_sm90's ``StepPlanKernel``): work items by tiles,
        longest first, ties in order of w. CTAs start in launch order, so this is greedy longest-processing-time
        list scheduling: a long unsplit request no longer starts in the last wave of a batch with more items than
        SMs (long-tail B=128: 1.5x shorter modelled step, docs/perf/split_plan.md). Position r of the
        step's table holds item ``longest_first()[r]``."""
        return sorted(range(len(self.items)), key=lambda w: (-self.item_tiles(w), w))


def balanced_schedule(seq_lens, block_n: int, min_chunk: int, work_target: int, max_splits: int,
                      long_splits: int = 0) -> BalancedSchedule:
    """The balanced device plan, the Python reference every kernel must agree with bit for bit.

    All integer arithmetic, with cdiv(a, b) = (a + b - 1) // b, over the B entries of seq_lens::

        tiles_b = max(cdiv(seq_len_b, BLOCK_N), 1)          # a padded request (seq_len 0) counts 1 tile
        T       = sum_b tiles_b
        p       = max(cdiv(MIN_CHUNK, BLOCK_N), cdiv(T, W))  # tiles per work item; W = plan.work_target
        n_b(p)  = min(cdiv(tiles_b, p), cap_b(p))            # NUM_SPLITS = plan.num_splits (the cap)
        cap_b(p) = LONG_SPLITS if tiles_b > NUM_SPLITS (3 p // 2) else NUM_SPLITS   # LONG = plan.long_splits
        ct_b(p) = cdiv(tiles_b, n_b(p));  n_b(p) = cdiv(tiles_b, ct_b(p))   # equal chunks, no empty last one
        I(p)    = sum_b n_b(p)                                # work items (non-increasing in p)
        if B < W and 2 * min_b tiles_b >= p and B * cdiv(max_b tiles_b, p) > W and I(p) > W:   # one wave
            lo, hi = p, min(cdiv(T - B, W - B), max_b tiles_b, 3 p // 2)
            if I(hi) <= W:                                     # then I(lo) > W >= I(hi)
                while hi - lo > 1:  mid = (lo + hi) // 2;  (hi if I(mid) <= W else lo) = mid
                p = hi
        n_b = n_b(p);  chunk_b = ct_b(p) * BLOCK_N             # split s covers [s * chunk_b, min((s+1) chunk_b, len))

    One wave: W items per m-block fill the GPU once, and cdiv(T, W) tiles per item can make up to B - 1 items
    more (each request's last chunk). When every item is about p tiles (no request under half of p), those
    extra items are a whole second wave: B=8 x 32k keys on 132 SMs made 72 items of 57 tiles for 66 slots.
    The smallest p that fits one wave is found by bisection (I(p) <= sum_b cdiv(tiles_b, p) <= (T + B (p - 1)) / p,
    which is <= W from p = cdiv(T - B, W - B) on, and I(max_b tiles_b) = B < W) and taken unless it is more than
    1.5 p (8 x 64 tiles, one wave, 0.56x of the modelled step: tests/test_planner_balanced.py); bounding the
    search by 1.5 p from the start costs a batch whose answer would be refused one pass instead of a bisection.
    The third condition, an upper bound of I(p) (exact for a uniform batch), spares most batches the pass that
    counts I(p).

    The long cap (``long_splits`` > NUM_SPLITS; 0 = none): a request whose items at the cap would hold more than
    1.5 p tiles (cdiv(tiles_b, NUM_SPLITS) > 3 p // 2, one multiply on the device) is the step's critical path
    while every other item holds about p (one 32k request among 1k ones at B=8: 32 items of 16 tiles, the rest
    8), so it may take up to LONG_SPLITS items (52 of 10). Only such a request: raising the cap for every request
    cost 4-9% where it moved p by one tile and added partials (docs/perf/split_plan.md). cap_b is
    non-increasing in p, so I(p) stays non-increasing and the bisection holds.

    Request b is *split* iff n_b > 1. Work items (the grid's second axis, w = program id 1; the first axis is
    the m-block so both halves of a request run side by side) come in this order: first every item of the
    split requests, request by request in order of b (w = S_b + s, S_b = sum of n_b' over split b' < b), then
    one item per unsplit request in order of b (w = NS + #unsplit b' < b, NS = sum of n_b over split b);
    w >= NS + #unsplit exits at once. A split item stores its partial (O / l, log2 LSE) in slot w:
    ``part = w * (q_len * H) + row``; an unsplit item writes the final output. The CTA (m_blk 0, split 0) of
    the j-th split request writes ``index[1 + 3 j : 4 + 3 j] = (b, S_b, n_b)`` and the CTA (m_blk 0, w 0)
    writes ``index[0] = J`` (the number of split requests), which is all the combine reads.

    Launch order: a kernel that derives its item from seq_lens (Triton, cute_sm100) runs item w as CTA column w.
    A step-planned kernel (cute_sm90) runs the items longest first (``BalancedSchedule.longest_first``): its plan
    kernel writes item w at its rank in that order, with w as the item's slot, so the slots, the split list and
    the combine are the same either way.
    """
    tiles = [max(_cdiv(int(x), block_n), 1) for x in seq_lens]
    total, batch, w = sum(tiles), len(tiles), work_target
    p = max(_cdiv(min_chunk, block_n), _cdiv(total, w))

    def request_chunks(t: int, per_work: int) -> tuple[int, int]:  # (n_b, ct_b)
        cap = long_splits if long_splits > max_splits and t > max_splits * (3 * per_work // 2) else max_splits
        ct = _cdiv(t, min(_cdiv(t, per_work), cap))
        return _cdiv(t, ct), ct

    def num_items(per_work: int) -> int:
        return sum(request_chunks(t, per_work)[0] for t in tiles)

    if batch < w and 2 * min(tiles) >= p and batch * _cdiv(max(tiles), p) > w and num_items(p) > w:
        lo, hi = p, min(_cdiv(total - batch, w - batch), max(tiles), 3 * p // 2)
        if num_items(hi) <= w:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if num_items(mid) <= w:
                    hi = mid
                else:
                    lo = mid
            p = hi
    splits, chunk = [], []
    for t in tiles:
        n, ct = request_chunks(t, p)
        splits.append(n)
        chunk.append(ct * block_n)
    slot_base, items, split_requests, ns = [], [], [], 0
    for b, n in enumerate(splits):
        if n > 1:
            slot_base.append(ns)
            split_requests.append(b)
            items.extend((b, s) for s in range(n))
            ns += n
        else:
            slot_base.append(-1)
    items.extend((b, 0) for b, n in enumerate(splits) if n == 1)
    return BalancedSchedule(tiles=tiles, total_tiles=total, per_work=p, splits=splits, chunk=chunk,
                            slot_base=slot_base, num_slots=ns, split_requests=split_requests, items=items,
                            block_n=block_n)


@dataclasses.dataclass(frozen=True)
class ShareSchedule:
    tiles: list[int]  # tiles_b
    per_share: int  # P: units of the line per share
    pieces: list[tuple[int, int, int, int]]  # work item i -> (request, split, first tile, end tile), request order
    splits: list[int]  # n_b: pieces of request b
    slot_base: list[int]  # S_b: the first partial slot of a split request; -1 for others
    num_slots: int  # NS: partial slots (pieces of split requests)
    split_requests: list[int]  # b of every split request, in order (the combine's list)
    block_n: int

    def piece_tiles(self, i: int) -> int:
        """Tiles of piece i as the launch order counts them (a request of length 0 counts its one tile)."""
        _, _, t0, t1 = self.pieces[i]
        return t1 - t0

    def piece_slot(self, i: int) -> int:
        """Partial slot of piece i (a split request's pieces have consecutive slots from S_b); 0 when unsplit
        (the slot is not read then)."""
        b, k, _, _ = self.pieces[i]
        return self.slot_base[b] + k if self.splits[b] > 1 else 0

    def longest_first(self) -> list[int]:
        """The launch order (as ``BalancedSchedule.longest_first``): pieces by tiles, longest first, ties in
        order of i. Position r of the step's table holds piece ``longest_first()[r]``."""
        return sorted(range(len(self.pieces)), key=lambda i: (-self.piece_tiles(i), i))


def share_schedule(seq_lens, block_n: int, min_chunk: int, shares: int, max_splits: int) -> ShareSchedule:
    """The share plan (cute_sm90 ``split_plan="shares"``), the Python reference of the device's
    (kernels/cute_common/scheduler.py ``ShareScheduler``), bit for bit.

    The requests' tiles are laid end to end on one line, each after a fixed cost of SHARE_REQUEST_COST (F)
    tiles, and the line is cut into W equal shares (W = the plan's work_target, one wave of CTAs per m-block):
    a request is split where a share boundary crosses it, into pieces, one work item each. So a long request
    spreads over consecutive shares and short requests are not split unless a boundary falls inside them,
    which is FlashMLA's SM90 scheduler's split (written from its description, not its code) without its
    persistent CTAs: the items run longest first, one CTA each, and the GPU's block scheduler packs several
    short pieces into one SM's time while a long one runs (modelled within 0.5% of persistent CTAs that each run
    one share, docs/perf/split_plan.md)::

        tiles_b = max(cdiv(seq_len_b, BLOCK_N), 1)
        s_b     = sum_{b' < b} (tiles_b' + F) + F          # request b's tiles are [s_b, s_b + tiles_b) of the line
        P       = max(cdiv(MIN_CHUNK, BLOCK_N), cdiv(s_B, W), cdiv(max_b tiles_b, NUM_SPLITS - 1))
        pieces of b: shares c = s_b // P .. (s_b + tiles_b - 1) // P, piece c covering tiles
        [max(s_b, c P) - s_b, min(s_b + tiles_b, (c + 1) P) - s_b) of the request

    n_b <= (tiles_b - 1) // P + 2 <= NUM_SPLITS (the third bound of P). Each of the W - 1 share boundaries splits
    at most one request, so there are at most B + W - 1 pieces, J <= min(B, W - 1) split requests and
    NS <= W - 1 + J partial slots: the balanced plan's bounds (``plan_splits``), so its grid, buffers and combine
    serve this plan unchanged. Pieces are numbered in request order (i); a split request's pieces take
    consecutive partial slots S_b + k (S_b = pieces of earlier split requests); the split list is the balanced
    plan's (index[0] = J, index[1 + 3 j : 4 + 3 j] = (b, S_b, n_b)); the table holds the pieces longest first
    (``longest_first``), each with its slot, and past its end b + 1 = 0."""
    if max_splits < 2:
        raise ValueError(f"the share plan splits requests at share boundaries: max_splits must be >= 2, "
                         f"got {max_splits}")
    tiles = [max(_cdiv(int(x), block_n), 1) for x in seq_lens]
    starts, line = [], 0
    for t in tiles:
        starts.append(line + SHARE_REQUEST_COST)
        line += t + SHARE_REQUEST_COST
    per_share = max(_cdiv(min_chunk, block_n), _cdiv(line, shares), _cdiv(max(tiles), max_splits - 1))
    pieces, splits, slot_base, split_requests, ns = [], [], [], [], 0
    for b, (t, s) in enumerate(zip(tiles, starts)):
        c_lo, c_hi = s // per_share, (s + t - 1) // per_share
        n = c_hi - c_lo + 1
        splits.append(n)
        slot_base.append(ns if n > 1 else -1)
        if n > 1:
            split_requests.append(b)
            ns += n
        for k, c in enumerate(range(c_lo, c_hi + 1)):
            pieces.append((b, k, max(s, c * per_share) - s, min(s + t, (c + 1) * per_share) - s))
    return ShareSchedule(tiles=tiles, per_share=per_share, pieces=pieces, splits=splits, slot_base=slot_base,
                         num_slots=ns, split_requests=split_requests, block_n=block_n)


def prefers_shares(sched: BalancedSchedule, work_target: int) -> bool:
    """The auto plan's choice (cute_sm90 ``split_plan="auto"``; the device's ``BalancedScheduler.
    leaves_wave_gap``, bit for bit): the share plan when the balanced plan's items leave a wave gap, i.e. more
    than W of them have at least a = cdiv(4 T, 5 W) tiles. Two of those W + 1 items then share an SM, so the
    step takes at least 2 a >= 1.6 T / W (a pigeonhole bound), where the share plan's pieces pack to about T / W:
    one long request among short ones at 8k (71 items of 16 tiles for 66 slots at B=64). Elsewhere the balanced
    plan's items already pack (long tails, uniform batches) and the share plan's extra splits and combine cost
    more than they gain (docs/perf/split_plan.md: never chosen in a measured cell where it lost)."""
    wide = _cdiv(4 * sched.total_tiles, 5 * work_target)
    return sum(1 for w in range(len(sched.items)) if sched.item_tiles(w) >= wide) > work_target


def step_schedule(seq_lens, block_n: int, plan: SplitPlan, split_plan: str):
    """The schedule a step-planned kernel (cute_sm90) runs under ``split_plan`` ("balanced", "shares" or
    "auto"): a BalancedSchedule or a ShareSchedule (both have ``longest_first``, ``split_requests``,
    ``slot_base`` and ``splits``)."""
    if split_plan == "shares":
        return share_schedule(seq_lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
    sched = balanced_schedule(seq_lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits,
                              plan.long_splits)
    if split_plan == "auto" and prefers_shares(sched, plan.work_target):
        return share_schedule(seq_lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
    return sched
