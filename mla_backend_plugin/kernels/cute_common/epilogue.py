"""The global-memory half of a CuTe decode epilogue, and the dequantisation scales as a kernel reads them.

A CTA owns ``block_m`` query rows of one request (rows = q_len x heads folded into M: row r is token
r // H, head r % H) for one work item of the split plan. An unsplit item writes the final output (x kv_scale,
in the output dtype) and the natural-log LSE; a split item writes its partial O / l (cute_sm90: in the output
dtype; cute_sm100: fp32; ``Workspace.partials_as``) and fp32 log2 LSE to slot w of the workspace
(``part = w * q_len * H + r``), which kernels/combine merges. Each arch keeps its own
loop over its accumulator layout and addresses through ``OutputStore``; ``lse2 * LN2`` turns a log2-domain LSE
into the natural-log one the API returns.

``fused_combine`` merges a split request's partials inside the split kernel itself (no second launch), for
grids whose CTAs are all resident at once (the host decides: cute_sm90 launch.py).
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute

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


# Shared memory the fused combine needs (bytes): the (row, split) weights of one CTA's slice, at most
# ceil(64 / n) rows x n splits <= 64 + n - 1 < 128 for n <= 64 (the workspace's split capacity), then the ticket.
FUSED_COMBINE_SMEM_FLOATS = 128
FUSED_COMBINE_SMEM_BYTES = 4 * FUSED_COMBINE_SMEM_FLOATS + 4
# Partials one thread loads per round of the merge: their loads are independent, so they are all in flight at
# once (one L2 round trip per round; the first version, with 2 loads per round, cost B=1 S=8k 1.7 us).
FUSED_COMBINE_SPLIT_ROUND = 16


@cute.jit
def fused_combine(output: OutputStore, mCtr: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
                  mOut: cute.Tensor, mLse: cute.Tensor, kscale, b, mblk, slot0, n_splits, ctid, smem_ptr,
                  barrier: cutlass.Constexpr, num_threads: cutlass.Constexpr):
    """The last step of a split work item when the combine is fused (``output``: the kernel's OutputStore):
    after this CTA wrote its partial (slot ``slot0`` + its split index), the ``n_splits`` CTAs of (request
    ``b``, m-block ``mblk``) each merge an equal slice of the m-block's rows over all their partials and write
    out (x ``kscale``) and the natural-log LSE, as the separate combine kernel (kernels/combine) would.

    Who merges what: a ticket from ``mCtr[b * m_blocks + mblk]`` (atomic add, acq_rel at GPU scope after the
    CTA barrier that follows the partial stores: CUTLASS's generic-barrier pattern); ticket t merges rows
    [t * rows / n, (t + 1) * rows / n) once the counter reaches n, i.e. once every partial of the request is
    written. The CTAs wait for each other, so this is correct only when every CTA of the grid can be resident
    at the same time (one CTA per SM here: the host fuses only when the grid is at most the SM count) and the
    kernel lets its dependents launch only after this step. A second round of adds counts the CTAs past
    their wait; the last one (it reads 2 n - 1) resets the counter to 0, so each launch and every graph replay
    starts from a zero counter without a host-side reset.

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
        seen = ticket + 1
        while seen < n_splits:
            seen = cute.arch.load(ctr, cutlass.Int32, sem="acquire", scope="gpu")
        s_ticket[0] = ticket
    barrier()  # thread 0's acquire orders every thread's partial loads below after the other CTAs' stores
    ticket = s_ticket[0]
    valid = cutlass.min(output.block_m, output.rows - mblk * output.block_m)
    r_lo = ticket * valid // n_splits
    n_rows = (ticket + 1) * valid // n_splits - r_lo

    # per row, one warp: lane l holds splits l and l + 32; the weights exp2(lse_s - max) x kscale / sum go to
    # shared memory, the merged LSE to the output
    lane = ctid % 32
    for r in cutlass.range(ctid // 32, n_rows, num_threads // 32, unroll=1):
        row = output.row(mblk, r_lo + r)
        lse_s = [None, None]
        for k in cutlass.range_constexpr(2):
            v = -cutlass.Float32.inf
            if lane + 32 * k < n_splits:
                v = mPartLse[output.partial_index(slot0 + lane + 32 * k, row)]
            lse_s[k] = v
        m = cute.arch.warp_reduction_max(cute.arch.fmax(lse_s[0], lse_s[1]))
        if m == -cutlass.Float32.inf:
            m = cutlass.Float32(0.0)
        e = [cute.math.exp2(lse_s[k] - m, fastmath=True) for k in range(2)]
        total = cute.arch.warp_reduction_sum(e[0] + e[1])
        inv = cutlass.Float32(0.0)
        lse = -cutlass.Float32.inf
        if total > 0.0:
            inv = kscale / total
            lse = (m + cute.math.log2(total, fastmath=False)) * LN2
        for k in cutlass.range_constexpr(2):
            if lane + 32 * k < n_splits:
                s_w[r * n_splits + lane + 32 * k] = e[k] * inv
        if lane == 0:
            mLse[output.final_index(b, row)] = lse
    barrier()
    # the rows, one 16-byte piece of a partial row per thread and item (4 fp32 or 8 16-bit columns): the
    # weighted sum over the splits' partials, SPLIT_ROUND independent 16-byte loads in flight per thread (a
    # round past n_splits re-reads the last split, weight 0)
    vec = 128 // mPartO.element_type.width
    per_row = mOut.shape[2] // vec
    acc = cute.make_rmem_tensor(cute.make_layout(vec), cutlass.Float32)
    for i in cutlass.range(ctid, n_rows * per_row, num_threads, unroll=1):
        r = i // per_row
        c = i - r * per_row
        row = output.row(mblk, r_lo + r)
        acc.fill(0.0)
        for s0 in cutlass.range(0, n_splits, FUSED_COMBINE_SPLIT_ROUND, unroll=1):
            for u in cutlass.range_constexpr(FUSED_COMBINE_SPLIT_ROUND):
                s = cutlass.min(s0 + u, n_splits - 1)
                wt = s_w[r * n_splits + s]
                if s0 + u >= n_splits:
                    wt = cutlass.Float32(0.0)
                part = cute.local_tile(mPartO[(output.partial_index(slot0 + s, row), None)], (vec,), (c,)).load()
                acc.store(acc.load() + part.to(cutlass.Float32) * wt)
        tok, h = output.final_index(b, row)
        cute.local_tile(mOut[(tok, h, None)], (vec,), (c,)).store(acc.load().to(mOut.element_type))
    barrier()
    if ctid == 0:
        if cute.arch.atomic_add(ctr, cutlass.Int32(1), sem="relaxed", scope="gpu") == 2 * n_splits - 1:
            cute.arch.store(ctr, cutlass.Int32(0), sem="relaxed", scope="gpu")


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
