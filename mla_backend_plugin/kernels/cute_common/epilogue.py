"""The global-memory half of a CuTe decode epilogue, and the dequantisation scales as a kernel reads them.

A CTA owns ``block_m`` query rows of one request (rows = q_len x heads folded into M: row r is token
r // H, head r % H) for one work item of the split plan. An unsplit item writes the final output (x kv_scale,
in the output dtype) and the natural-log LSE; a split item writes its fp32 partial (O / l) and log2 LSE to
slot w of the workspace (``part = w * q_len * H + r``), which kernels/combine merges. Each arch keeps its own
loop over its accumulator layout and addresses through ``OutputStore``; ``lse2 * LN2`` turns a log2-domain LSE
into the natural-log one the API returns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

LN2 = 0.6931471805599453


class OutputStore:
    """Where row ``r_tile`` of a CTA's tile goes. Plain methods that return coordinates (pure index math, inlined
    into the caller's trace): the caller keeps the store and its ``if`` inline, which lets the compiler hoist
    the tensors' strides and pair the stores exactly as it would for hand-written indexing."""

    def __init__(self, num_heads: int, q_len: int, block_m: int):
        self.num_heads = num_heads
        self.q_len = q_len
        self.block_m = block_m
        self.rows = num_heads * q_len

    def row(self, mblk, r_tile):
        """The row of the request (q_len x heads folded): valid when ``< self.rows``."""
        return mblk * self.block_m + r_tile

    def final_index(self, b, r):
        """(token, head) of request ``b``'s row ``r`` in the final output and LSE."""
        return b * self.q_len + r // self.num_heads, r % self.num_heads

    def partial_index(self, w, r):
        """Row of the workspace's partials for work item (slot) ``w``."""
        return w * self.rows + r


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
