"""The global-memory half of a CuTe decode epilogue, and the dequantisation scales as a kernel reads them.

A CTA owns ``block_m`` query rows of one request (rows = q_len x heads folded into M: row r is token
r // H, head r % H) for one work item of the split plan. An unsplit item writes the final output (x kv_scale,
in the output dtype) and the natural-log LSE; a split item writes its partial O / l (cute_sm90: in the output
dtype; cute_sm100: fp32; ``Workspace.partials_as``) and fp32 log2 LSE to slot w of the workspace
(``part = w * q_len * H + r``), which kernels/combine merges. Each arch keeps its own
loop over its accumulator layout and addresses through ``OutputStore``; ``lse2 * LN2`` turns a log2-domain LSE
into the natural-log one the API returns.

``fused_combine`` merges a split request's partials inside the split kernel itself (no second launch): shared
among the request's CTAs for grids whose CTAs are all resident at once (``COOPERATIVE``), or by the request's last
CTA to finish, for any grid (``LAST_CTA``); the host decides (cute_sm90 launch.py).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute

from mla_backend_plugin.kernels.cute_common.host import COOPERATIVE

LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class OutputStore:
    """Where row ``r_tile`` of a CTA's tile goes. Plain methods that return coordinates (pure index math, inlined
    into the caller's trace): the caller keeps the store and its ``if`` inline, which lets the compiler hoist
    the tensors' strides and pair the stores exactly as it would for hand-written indexing. Frozen: the DSL
    passes it through dynamic loops unchanged."""

    num_heads: int
    q_len: int
    block_m: int

    @property
    def rows(self) -> int:
        return self.num_heads * self.q_len

    def row(self, mblk, r_tile):
        """The row of the request (q_len x heads folded): valid when ``< self.rows``."""
        return mblk * self.block_m + r_tile

    def final_index(self, b, r):
        """(token, head) of request ``b``'s row ``r`` in the final output and LSE."""
        return b * self.q_len + r // self.num_heads, r % self.num_heads

    def partial_index(self, w, r):
        """Row of the workspace's partials for work item (slot) ``w``."""
        return w * self.rows + r

    @property
    def m_blocks(self) -> int:
        return -(-self.rows // self.block_m)


# Shared memory the fused combine needs (bytes): the (row, split) weights of the rows one CTA merges, at most
# 64 rows x 64 splits (the workspace's split capacity) for the last CTA, then the ticket. Every kernel calling it
# passes its Q buffer, 36 KB or more.
FUSED_COMBINE_SMEM_FLOATS = 64 * 64
FUSED_COMBINE_SMEM_BYTES = 4 * FUSED_COMBINE_SMEM_FLOATS + 4
# Partials one thread loads per round of the merge (items x splits, ``_merge_items``): their loads are
# independent, so they are all in flight at once (one L2 round trip per round; the first version, with 2 loads
# per round, cost B=1 S=8k 1.7 us); and rows whose LSEs one warp loads at once.
FUSED_COMBINE_LOADS_IN_FLIGHT = 16
FUSED_COMBINE_ROWS_IN_FLIGHT = 4


@cute.jit
def fused_combine(output: OutputStore, mCtr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
                  mOut: cute.Tensor, mLse: cute.Tensor, kscale, b, mblk, slot0, n_splits, mode, ctid, smem_ptr,
                  barrier: cutlass.Constexpr, num_threads: cutlass.Constexpr):
    """The last step of a split work item when the combine is fused (``output``: the kernel's OutputStore):
    after this CTA wrote its partial (slot ``slot0`` + its split index), the ``n_splits`` CTAs of (request
    ``b``, m-block ``mblk``) each merge an equal slice of the m-block's rows over all their partials and write
    out (x ``kscale``) and the natural-log LSE, as the separate combine kernel (kernels/combine) would.

    Who merges what: a ticket from ``mCtr[b * m_blocks + mblk]`` (atomic add, acq_rel at GPU scope after the
    CTA barrier that follows the partial stores: CUTLASS's generic-barrier pattern).
    ``mode`` COOPERATIVE: ticket t merges rows [t * rows / n, (t + 1) * rows / n) once the counter reaches n,
    i.e. once every partial of the request is written. The CTAs wait for each other, so this is correct only
    when every CTA of the grid can be resident at the same time (one CTA per SM here: the host fuses so only
    when the grid is at most the SM count) and the kernel lets its dependents launch only after this step. A
    second round of adds counts the CTAs past their wait; the last one (it reads 2 n - 1) resets the counter.
    ``mode`` LAST_CTA: the CTA drawing ticket n - 1 is the last whose partial was written (its acquire sees
    the others' stores); it resets the counter and merges every row, the others merge nothing and wait for
    nobody, so any grid may run so. Either way each launch and every graph replay starts from a zero counter
    without a host-side reset.

    ``barrier`` synchronises the ``num_threads`` threads that call this (``ctid`` in 0..num_threads-1);
    ``smem_ptr`` points to FUSED_COMBINE_SMEM_BYTES of shared memory this CTA no longer uses."""
    ctr = mCtr.iterator + (b * output.m_blocks + mblk)
    s_w = cute.make_tensor(cute.recast_ptr(smem_ptr, dtype=cutlass.Float32),
                           cute.make_layout(FUSED_COMBINE_SMEM_FLOATS))
    s_ticket = cute.make_tensor(cute.recast_ptr(s_w.iterator + FUSED_COMBINE_SMEM_FLOATS, dtype=cutlass.Int32),
                                cute.make_layout(1))
    barrier()  # every thread's partial stores precede thread 0's release below
    if ctid == 0:
        ticket = cute.arch.atomic_add(ctr, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if mode == COOPERATIVE:
            seen = ticket + 1
            while seen < n_splits:
                seen = cute.arch.load(ctr, cutlass.Int32, sem="acquire", scope="gpu")
        elif ticket == n_splits - 1:  # every other CTA of the request has drawn its ticket: none reads it again
            cute.arch.store(ctr, cutlass.Int32(0), sem="relaxed", scope="gpu")
        s_ticket[0] = ticket
    barrier()  # thread 0's acquire orders every thread's partial loads below after the other CTAs' stores
    ticket = s_ticket[0]
    valid = cutlass.min(output.block_m, output.rows - mblk * output.block_m)
    r_lo = ticket * valid // n_splits
    n_rows = (ticket + 1) * valid // n_splits - r_lo
    if mode != COOPERATIVE:
        r_lo = cutlass.Int32(0)
        n_rows = cutlass.Int32(0)
        if ticket == n_splits - 1:
            n_rows = valid

    # per row, one warp: lane l holds splits l and l + 32; the weights exp2(lse_s - max) x kscale / sum go to
    # shared memory, the merged LSE to the output. A warp loads FUSED_COMBINE_ROWS_IN_FLIGHT rows' LSEs at once
    # (one L2 round trip for them, where a row at a time cost one per row: 8 for the last CTA's 64 rows)
    lane = ctid % 32
    warps = num_threads // 32
    for r0 in cutlass.range(ctid // 32, n_rows, warps * FUSED_COMBINE_ROWS_IN_FLIGHT, unroll=1):
        lse_s = [[None, None] for _ in range(FUSED_COMBINE_ROWS_IN_FLIGHT)]
        for j in cutlass.range_constexpr(FUSED_COMBINE_ROWS_IN_FLIGHT):
            row = output.row(mblk, r_lo + cutlass.min(r0 + j * warps, n_rows - 1))
            for k in cutlass.range_constexpr(2):
                v = -cutlass.Float32.inf
                if lane + 32 * k < n_splits:
                    v = mPartLse[output.partial_index(slot0 + lane + 32 * k, row)]
                lse_s[j][k] = v
        for j in cutlass.range_constexpr(FUSED_COMBINE_ROWS_IN_FLIGHT):
            r = r0 + j * warps
            m = cute.arch.warp_reduction_max(cute.arch.fmax(lse_s[j][0], lse_s[j][1]))
            if m == -cutlass.Float32.inf:
                m = cutlass.Float32(0.0)
            e = [cute.math.exp2(lse_s[j][k] - m, fastmath=True) for k in range(2)]
            total = cute.arch.warp_reduction_sum(e[0] + e[1])
            inv = cutlass.Float32(0.0)
            lse = -cutlass.Float32.inf
            if total > 0.0:
                inv = kscale / total
                lse = (m + cute.math.log2(total, fastmath=False)) * LN2
            if r < n_rows:
                for k in cutlass.range_constexpr(2):
                    if lane + 32 * k < n_splits:
                        s_w[r * n_splits + lane + 32 * k] = e[k] * inv
                if lane == 0:
                    mLse[output.final_index(b, output.row(mblk, r_lo + r))] = lse
    barrier()
    # the rows, one 16-byte piece of a partial row per thread and item (4 fp32 or 8 16-bit columns): the weighted
    # sum over the splits' partials, FUSED_COMBINE_LOADS_IN_FLIGHT independent 16-byte loads per thread in each
    # round, spread over items and splits by the split count (few splits: more items per round)
    n_items = n_rows * (mOut.shape[2] // (128 // mPartO.element_type.width))
    if n_splits <= 2:
        _merge_items(output, mPartO, mOut, s_w, b, mblk, r_lo, slot0, n_splits, n_items, ctid, num_threads,
                     FUSED_COMBINE_LOADS_IN_FLIGHT // 2, 2)
    elif n_splits <= 4:
        _merge_items(output, mPartO, mOut, s_w, b, mblk, r_lo, slot0, n_splits, n_items, ctid, num_threads,
                     FUSED_COMBINE_LOADS_IN_FLIGHT // 4, 4)
    elif n_splits <= 8:
        _merge_items(output, mPartO, mOut, s_w, b, mblk, r_lo, slot0, n_splits, n_items, ctid, num_threads,
                     FUSED_COMBINE_LOADS_IN_FLIGHT // 8, 8)
    else:
        _merge_items(output, mPartO, mOut, s_w, b, mblk, r_lo, slot0, n_splits, n_items, ctid, num_threads,
                     FUSED_COMBINE_LOADS_IN_FLIGHT // 16, 16)
    barrier()
    if ctid == 0 and mode == COOPERATIVE:
        if cute.arch.atomic_add(ctr, cutlass.Int32(1), sem="relaxed", scope="gpu") == 2 * n_splits - 1:
            cute.arch.store(ctr, cutlass.Int32(0), sem="relaxed", scope="gpu")


@cute.jit
def _merge_items(output: OutputStore, mPartO: cute.Tensor, mOut: cute.Tensor, s_w: cute.Tensor, b, mblk, r_lo, slot0,
                 n_splits, n_items, ctid, num_threads: cutlass.Constexpr, items: cutlass.Constexpr,
                 splits: cutlass.Constexpr):
    """``fused_combine``'s merge: item i is 16-byte piece i % per_row of row r_lo + i // per_row; a thread takes
    ``items`` items at a time and reads ``splits`` splits of each per round, all loads of a round in flight
    together (a slot past n_splits re-reads the last split with weight 0; an item past the last is clamped to it
    and not stored)."""
    vec = 128 // mPartO.element_type.width
    per_row = mOut.shape[2] // vec
    accs = [cute.make_rmem_tensor(cute.make_layout(vec), cutlass.Float32) for _ in range(items)]
    for i0 in cutlass.range(ctid, n_items, num_threads * items, unroll=1):
        for g in cutlass.range_constexpr(items):
            accs[g].fill(0.0)
        for s0 in cutlass.range(0, n_splits, splits, unroll=1):
            for g in cutlass.range_constexpr(items):
                i = cutlass.min(i0 + g * num_threads, n_items - 1)
                r = i // per_row
                row = output.row(mblk, r_lo + r)
                for u in cutlass.range_constexpr(splits):
                    s = cutlass.min(s0 + u, n_splits - 1)
                    wt = s_w[r * n_splits + s]
                    if s0 + u >= n_splits:
                        wt = cutlass.Float32(0.0)
                    part = cute.local_tile(mPartO[(output.partial_index(slot0 + s, row), None)], (vec,),
                                           (i - r * per_row,)).load()
                    accs[g].store(accs[g].load() + part.to(cutlass.Float32) * wt)
        for g in cutlass.range_constexpr(items):
            i = i0 + g * num_threads
            if i < n_items:
                r = i // per_row
                tok, h = output.final_index(b, output.row(mblk, r_lo + r))
                cute.local_tile(mOut[(tok, h, None)], (vec,), (i - r * per_row,)).store(
                    accs[g].load().to(mOut.element_type))


@cute.jit
def load_scales(q_scale_is_ptr: cutlass.Constexpr, kv_scale_is_ptr: cutlass.Constexpr, q_scale, kv_scale,
                mQScale: cute.Tensor, mKVScale: cute.Tensor):
    """(q scale, kv scale): each read from its 1-element device tensor when the variant says so (vLLM's
    scales live on the device; reading them here needs no host sync), else the value argument."""
    qscale = q_scale
    if cutlass.const_expr(q_scale_is_ptr):
        qscale = mQScale[0]
    kscale = kv_scale
    if cutlass.const_expr(kv_scale_is_ptr):
        kscale = mKVScale[0]
    return qscale, kscale
