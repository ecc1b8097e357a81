"""CuTe-DSL MLA decode kernel for Hopper (sm_90a): TMA + wgmma, warp-specialised, split-KV.

One CTA = one work item of the balanced split plan (a request, or one equal chunk of a long request) x 64
query rows (q_len x heads folded into M, row r = token r // H, head r % H). The grid is (m-blocks, work
items) and is fixed by shapes alone; every CTA derives its item from all of seq_lens on the device
(``work_item``, the formula of ops/plan.py ``balanced_schedule``), so a captured CUDA graph replays
correctly with new lengths, and one long request among short ones is split even when the batch fills the GPU.
384 threads:

* warp group 0 produces KV tiles of 64 keys x 576 into a 2-stage ring. 16-bit caches: warp 0 issues TMA
  boxes of (min(block_size, 64) rows x 64 columns) page by page through the block table (9 boxes per page
  slice, one per 64-column chunk of the 128B-swizzled K-major tile). fp8 caches: all 128 threads load the
  tile with 16-byte global loads and widen e4m3 to the 16-bit compute dtype in shared memory (exact; the
  scales are folded into the softmax scale and the output), so the MMA path is the same as for bf16.
* warp groups 1 and 2 are consumers. For S = Q K^T group 1 computes the tile's keys 0..31 and group 2 keys
  32..63 (SS wgmma, K = 576, the last Q_REG_CHUNKS chunks of Q from registers); they exchange per-row maxima
  through shared memory, each writes its half of P (16-bit) to shared memory, and each computes P V for its
  256 of the 512 output columns (SS wgmma; V is the KV stage read through an MN-major view, no copy).
* Q (64 x 576) is loaded once by the consumers into 128B-swizzled shared memory (fp8 q widened there).

Softmax runs in the log2 domain with the q/kv dequantisation scales folded into the logit scale; out is
multiplied by kv_scale. An unsplit item writes out (bf16/fp16) and the natural-log LSE; a split item writes
its partial (normalised O in the output dtype, fp32 log2 LSE) to its slot of the workspace, and the
balanced combine kernel (kernels/combine) merges them using the split list this kernel writes; when the
whole grid fits on the GPU at once (small batches), the split CTAs of a request merge them themselves at the
end (cute_common/epilogue.py ``fused_combine``) and no combine kernel runs. PDL: griddepcontrol.wait before
the first global read, launch_dependents after the last store.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from mla_backend_plugin.kernels.cute_common.barriers import consumer_barrier
from mla_backend_plugin.kernels.cute_common.compat import LayoutEnum, SmemAllocator
from mla_backend_plugin.kernels.cute_common.epilogue import LN2, OutputStore, fused_combine, load_scales
from mla_backend_plugin.kernels.cute_common.fake_tensors import DTYPES
from mla_backend_plugin.kernels.cute_common.scheduler import BalancedScheduler
from mla_backend_plugin.kernels.cute_sm90.config import (
    BLOCK_M,
    BLOCK_N,
    KV_CLUSTER,
    KV_STAGES,
    NUM_THREADS,
    Q_REG_CHUNKS,
    REGS_CONSUMER,
    REGS_CONSUMER_FP8,
    REGS_PRODUCER_FP8,
    REGS_PRODUCER_TMA,
    STAGE_ROW,
    Variant,
)

D_NOPE = 512
D_ROPE = 64
D_QK = D_NOPE + D_ROPE
K_CHUNKS = D_QK // 64  # 64-column (128-byte) chunks of one cache row
# Q's 64 x 576 tile as pieces of 8 elements per consumer thread (256 threads): 16 of q_nope, 2 of q_pe
Q_NOPE_PIECES = BLOCK_M * (D_NOPE // 8) // 256
Q_ROPE_PIECES = BLOCK_M * (D_ROPE // 8) // 256
assert Q_NOPE_PIECES * 256 == BLOCK_M * (D_NOPE // 8) and Q_ROPE_PIECES * 256 == BLOCK_M * (D_ROPE // 8)


@dsl_user_op
def prefetch_l2(addr, nbytes: int, *, loc=None, ip=None):
    """``cp.async.bulk.prefetch.L2.global``: ``nbytes`` (a multiple of 16) from global address ``addr`` (16-byte
    aligned) into L2, with no shared memory, barrier or register written."""
    llvm.inline_asm(
        None, [cutlass.Int64(addr).ir_value(loc=loc, ip=ip)],
        f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};", "l", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def exp_base(m):
    """What exp2(s - m) subtracts for a running row maximum ``m``: m itself, or 0 while the row has seen no key
    (m = -inf), which keeps the row's zero state instead of making -inf - -inf = NaN."""
    base = m
    if m == -cutlass.Float32.inf:
        base = 0.0
    return base


@cute.jit
def moved_max(m, tile_max, slack):
    """A row's running max after a tile whose max is ``tile_max``: max(m, tile_max), but with a ``slack`` > 0 (log2
    units; a Python 0.0 compiles the plain max, a runtime value may be 0) ``m`` stays unless the tile's max exceeds
    it by more than ``slack`` (then P = exp2(s - m) reaches at most 2^slack and the O rescale is skipped on most
    tiles: config.MAX_SLACK). -inf (no key yet) always moves to a finite tile max."""
    new = cute.arch.fmax(m, tile_max)
    if cutlass.const_expr(not (isinstance(slack, float) and slack == 0.0)):
        if tile_max <= m + slack:
            new = m
    return new


@cute.jit
def scale_mask_max(acc_s, tScS, row_scale, row_limit, tile_start, m_loc):
    """S x the row's scale, in place; keys at or past the row's limit become -inf (a NaN read there too); m_loc
    (per row half, in and out) takes the maxima of this thread's values. (A branch without the compare for
    tiles inside every row's limit measured no faster on the H100: docs/perf/cute_sm90_bf16.md.)"""
    for v in cutlass.range_constexpr(cute.size(tScS)):
        half = (v >> 1) & 1
        s = acc_s[v] * row_scale[half]
        if tile_start + tScS[v][1] >= row_limit[half]:
            s = -cutlass.Float32.inf
        acc_s[v] = s
        m_loc[half] = cute.arch.fmax(m_loc[half], s)


class Sm90MlaDecode:
    def __init__(self, variant: Variant, use_pdl: bool = True):
        self.v = variant
        self.use_pdl = use_pdl
        self.cdtype = DTYPES[variant.compute_dtype]
        self.kv_dtype = DTYPES[variant.kv_dtype]
        self.q_dtype = DTYPES[variant.q_dtype]
        self.out_dtype = DTYPES[variant.out_dtype]
        self.fp8_kv = variant.kv_dtype == "fp8"
        self.rows = variant.q_len * variant.num_heads
        self.box_rows = min(variant.block_size, BLOCK_N)
        self.regs_consumer = REGS_CONSUMER_FP8 if self.fp8_kv else REGS_CONSUMER
        self.regs_producer = REGS_PRODUCER_FP8 if self.fp8_kv else REGS_PRODUCER_TMA
        self.tile_bytes = BLOCK_N * D_QK * self.cdtype.width // 8
        self.scheduler = BalancedScheduler(BLOCK_N)
        self.output = OutputStore(variant.num_heads, variant.q_len, BLOCK_M)

    # ------------------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptor, launch
    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor,
                 mSeq: cute.Tensor, mRowKv: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor,
                 mPartLse: cute.Tensor, mQScale: cute.Tensor, mKVScale: cute.Tensor, q_scale: cutlass.Float32,
                 kv_scale: cutlass.Float32, sm_scale_log2: cutlass.Float32, mWork: cute.Tensor,
                 grid_items: cutlass.Int32, mCombineCtr: cute.Tensor, fuse_combine: cutlass.Int32,
                 stream: cuda.CUstream):
        cd = self.cdtype
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        # two atoms along N in both products: for S = Q K^T consumer group 1 owns keys 0..31 of the tile and
        # group 2 keys 32..63; for O += P V group 1 owns output columns 0..255 and group 2 columns 256..511
        qk_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 2, 1),
                                                   (BLOCK_M, BLOCK_N // 2))
        # the same product with A (Q) from registers, for the last Q_REG_CHUNKS 64-column chunks of Q: an SS
        # wgmma re-reads its 64x16 A slice from shared memory for every instruction, and shared-memory
        # bandwidth, not the tensor cores, bounds this loop
        qk_rs_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 2, 1),
                                                      (BLOCK_M, BLOCK_N // 2), warpgroup.OperandSource.RMEM)
        pv_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, MN_MAJOR, cutlass.Float32, (1, 2, 1),
                                                   (BLOCK_M, D_NOPE // 2))
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), cd, 1)
        # P (64 rows x 64 keys, 16-bit): each group writes its 32 key columns, both read all 64 as the A of P V
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N), cd, 1)
        kv_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), cd,
                                                  KV_STAGES)
        # V = the first 512 columns of the same tile, read MN-major: with the atoms tiled K-first this view
        # addresses exactly the bytes of the K-major tile (64-column chunks 4096 elements apart).
        v_layout_one = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N),
                                                     cd, 1)
        kv_stage_stride = BLOCK_N * D_QK
        v_outer = cute.append(cute.select(v_layout_one.outer, mode=[0, 1]),
                              cute.make_layout(KV_STAGES, stride=kv_stage_stride))

        tma_atom = None
        tma_tensor = None
        if cutlass.const_expr(not self.fp8_kv):
            # (block_size, 576, num_blocks): one TMA box = box_rows tokens x 64 columns of one page
            g_kv = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
            box_layout = cute.tile_to_shape(
                warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cd),
                (self.box_rows, 64), order=(0, 1))
            tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g_kv,
                                                               box_layout, (self.box_rows, 64))

        @cute.struct
        class SharedStorage:
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES]
            # per-row partial softmax statistics exchanged between the two consumer groups
            row_max_x: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            row_sum_x: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            sP: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(p_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(q_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(kv_layout)], 1024]

        self.shared_storage = SharedStorage
        m_blocks = (self.rows + BLOCK_M - 1) // BLOCK_M
        self.kernel(qk_mma, qk_rs_mma, pv_mma, tma_atom, tma_tensor, mQn, mQp, mKV, mBT, mSeq, mRowKv, mOut, mLse,
                    mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, mWork, mCombineCtr,
                    fuse_combine, q_layout, kv_layout, p_layout,
                    v_layout_one.inner, v_outer).launch(
            # grid (m-blocks, work items of the balanced plan): the m-blocks of one work item are adjacent in
            # launch order, so they run at the same time and all but the first read the item's KV from L2
            # (at 128 heads 2 m-blocks, 4 with q_len 2: half / a quarter of the HBM traffic of an item-major
            # order)
            grid=(m_blocks, grid_items, 1), block=[NUM_THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1, use_pdl=self.use_pdl)

    # ------------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, qk_rs_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_atom, tma_tensor,
               mQn: cute.Tensor, mQp: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
               mRowKv: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
               mQScale: cute.Tensor,
               mKVScale: cute.Tensor,
               q_scale: cutlass.Float32, kv_scale: cutlass.Float32, sm_scale_log2: cutlass.Float32,
               mWork: cute.Tensor, mCombineCtr: cute.Tensor, fuse_combine: cutlass.Int32,
               q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout, v_swizzle, v_outer: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        mblk, w, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sKV = storage.sKV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sMaxX = storage.row_max_x.get_tensor(cute.make_layout(2 * BLOCK_M))
        sSumX = storage.row_sum_x.get_tensor(cute.make_layout(2 * BLOCK_M))
        sV = cute.make_tensor(cute.recast_ptr(sKV.iterator, v_swizzle), v_outer)

        if cutlass.const_expr(self.fp8_kv):
            kv_pipe = pipeline.PipelineAsync.create(
                num_stages=KV_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
                barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True)
        else:
            kv_pipe = pipeline.PipelineTmaAsync.create(
                num_stages=KV_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),  # one arrive per warp
                tx_count=self.tile_bytes, barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True)
        kv_producer, _ = kv_pipe.make_participants()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(not self.fp8_kv):
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom)

        # everything below may read what the previous kernel in the stream wrote
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()

        b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, slot = self.scheduler.read_item(mWork, w)
        if b1 > 0:  # else: past the end of the schedule
            if wg == 0:
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if cutlass.const_expr(self.fp8_kv):
                    self.produce_fp8(kv_producer, sKV, mKV, mBT, b, kv_start, kv_end, n_tiles, tidx)
                else:
                    if warp_idx == 0:
                        self.produce_tma(kv_producer, tma_atom, tma_tensor, sKV, mKV, mBT, b, kv_start,
                                         kv_end, n_tiles)
            else:
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume(qk_mma, qk_rs_mma, pv_mma, kv_pipe, sQ, sKV, sV, sP, sMaxX, sSumX,
                             storage.sQ.data_ptr(), mQn, mQp, mBT, mRowKv, mOut, mLse, mPartO, mPartLse, mQScale,
                             mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits, b, mblk, slot, seq_len, kv_start,
                             kv_end, n_tiles, tidx - 128)
                if fuse_combine != 0 and n_splits > 1:
                    self.combine_in_kernel(mCombineCtr, mPartO, mPartLse, mOut, mLse, mQScale, mKVScale, q_scale,
                                           kv_scale, b, mblk, slot0, n_splits, fuse_combine, tidx - 128,
                                           storage.sQ.data_ptr())
        # after the fused combine's wait: a dependent launched earlier could hold the SMs our CTAs still need
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def produce_tma(self, kv_producer, tma_atom, tma_tensor, sKV, mKV, mBT, b, kv_start, kv_end, n_tiles):
        rb = self.box_rows
        # smem: (rb, 64, 64 / rb, 9, stages); gmem: (rb, 64, bs / rb, 9, num_blocks)
        s_boxes = cute.flat_divide(sKV, (rb, 64))
        g_boxes = cute.flat_divide(tma_tensor, (rb, 64))
        tKs, tKg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s_boxes, 0, 2),
                                         cute.group_modes(g_boxes, 0, 2))
        num_blocks = mKV.shape[0]
        for j in cutlass.range(n_tiles, unroll=1):
            tile_start = kv_start + j * BLOCK_N
            first_page = self.page_of(mBT, b, tile_start, kv_end, num_blocks)
            handle = kv_producer.acquire_and_advance()
            self.tma_tile(tma_atom, tKg, tKs, mBT, b, tile_start, kv_end, num_blocks, first_page, handle.index,
                          handle.barrier, 0, K_CHUNKS)

    @cute.jit
    def page_of(self, mBT, b, tok, kv_end, num_blocks):
        """The cache block of request ``b`` holding token ``tok``; past the split's end an out-of-range block,
        which TMA fills with zeros, so no stale or garbage block-table entry is ever dereferenced.

        The three producers (lock step, seesaw, fp8 design B) read a tile's first page id before they wait for
        its stage, so the load's round trip overlaps the wait; measured neutral (2026-11-27: the producer runs
        far enough ahead that the refills never waited on it), kept as the one page walk all producers share."""
        page = num_blocks
        if tok < kv_end:
            page = mBT[b, tok // self.v.block_size]
        return page

    @cute.jit
    def prefetch_tile_l2(self, mKV, mBT, b, tile_start, kv_end, num_blocks):
        """Prefetch the 64-key tile at ``tile_start`` into L2, page slice by page slice (each slice is contiguous:
        its rows x 576 values); slices past the split's end are skipped. Its TMA load later reads L2, not HBM."""
        rb = self.box_rows
        for p in cutlass.range(BLOCK_N // rb, unroll=1):
            tok = tile_start + p * rb
            if tok < kv_end:
                page = self.page_of(mBT, b, tok, kv_end, num_blocks)
                prefetch_l2(mKV[(page, tok % self.v.block_size, None)].iterator.toint(),
                            rb * D_QK * self.cdtype.width // 8)

    @cute.jit
    def tma_tile(self, tma_atom, tKg, tKs, mBT, b, tile_start, kv_end, num_blocks, first_page, stage, bar,
                 c0: cutlass.Constexpr, c1: cutlass.Constexpr, rank=0):
        """Chunks [c0, c1) of the 64-key tile at ``tile_start`` into ``stage``, page slice by page slice (one
        slice when a page holds the whole tile); ``first_page`` is the first slice's, read ahead (page_of).
        A dynamic loop over the other slices: unrolled, 16-token pages keep 4 page ids and their coordinates
        live and spill in the producer's 24 registers. With the KV multicast (the seesaw's ``kv_multicast``)
        this CTA (``rank`` in its cluster) issues the chunks c with c % KV_CLUSTER == rank, each into every CTA
        of the cluster."""
        rb = self.box_rows
        self.tma_slice(tma_atom, tKg, tKs, first_page, tile_start, 0, stage, bar, c0, c1, rank)
        if cutlass.const_expr(BLOCK_N // rb > 1):
            for p in cutlass.range(1, BLOCK_N // rb, unroll=1):
                tok = tile_start + p * rb
                self.tma_slice(tma_atom, tKg, tKs, self.page_of(mBT, b, tok, kv_end, num_blocks), tok, p, stage,
                               bar, c0, c1, rank)

    @cute.jit
    def tma_slice(self, tma_atom, tKg, tKs, page, tok, p, stage, bar, c0: cutlass.Constexpr,
                  c1: cutlass.Constexpr, rank=0):
        row_box = (tok % self.v.block_size) // self.box_rows
        # with the KV multicast, CTA ``rank`` of the cluster loads every KV_CLUSTER-th chunk into all of its CTAs
        mcast = {"mcast_mask": cutlass.Int16((1 << KV_CLUSTER) - 1)} if self.v.kv_multicast else {}
        for c in cutlass.range_constexpr(c0, c1):
            if cutlass.const_expr(not self.v.kv_multicast) or rank == c % KV_CLUSTER:
                cute.copy(tma_atom, tKg[(None, row_box, c, page)], tKs[(None, p, c, stage)], tma_bar_ptr=bar, **mcast)

    @cute.jit
    def produce_fp8(self, kv_producer, sKV, mKV, mBT, b, kv_start, kv_end, n_tiles, tidx):
        # thread t owns half a cache row: row t // 2, bytes [288 * (t % 2), +288) = 18 groups of 16 fp8
        # values, read with 16-byte loads (one block-table lookup per thread and tile) in 3 batches of 6 so
        # the loads of a batch are in flight together within the producer's small register budget
        bs = self.v.block_size
        cd = self.cdtype
        row = tidx // 2
        col0 = (tidx % 2) * (D_QK // 2)
        for j in cutlass.range(n_tiles, unroll=1):
            handle = kv_producer.acquire_and_advance()
            tok = kv_start + j * BLOCK_N + row
            stage_row = sKV[(row, None, handle.index)]
            if tok < kv_end:
                page = mBT[b, tok // bs]
                src_row = mKV[(page, tok % bs, None)]
                for batch in cutlass.range_constexpr(3):
                    regs = [None] * 6
                    for i in cutlass.range_constexpr(6):
                        g = (col0 // 16) + batch * 6 + i
                        regs[i] = cute.local_tile(src_row, (16,), (g,)).load()
                    for i in cutlass.range_constexpr(6):
                        g = (col0 // 16) + batch * 6 + i
                        cute.local_tile(stage_row, (16,), (g,)).store(regs[i].to(cutlass.Float32).to(cd))
            else:
                # keys past the split's end: zeros (finite, and masked by the consumers anyway)
                for i in cutlass.range_constexpr(18):
                    dst = cute.local_tile(stage_row, (16,), ((col0 // 16) + i,))
                    dst.store(cute.zeros_like(dst.load()))
            # make the generic-proxy stores visible to wgmma (async proxy) before signalling the stage full
            cute.arch.fence_proxy("async.shared", space="cta")
            handle.commit()

    @cute.jit
    def issue_qk(self, qk_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, stage):
        """Issue (do not wait for) S = Q K^T of this group's 32 keys of the tile in ``stage``: the first k-steps
        with Q from shared memory, the last ``Q_REG_CHUNKS`` chunks with Q from registers."""
        k_steps = cute.size(tSrQ, mode=[2])
        k_smem = k_steps - Q_REG_CHUNKS * 4
        warpgroup.fence()
        for k in cutlass.range_constexpr(k_smem):
            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(qk_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
        qk_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(k_smem, k_steps):
            cute.gemm(qk_rs_mma, acc_s, tSrQreg[(None, None, k - k_smem)], tSrK[(None, None, k, stage)], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def load_q(self, sQ, mQn, mQp, b, mblk, ctid):
        """Both consumer groups (256 threads) copy the CTA's 64 query rows into 128B-swizzled shared memory in
        the compute dtype (an fp8 q widened), zero rows past q_len x H, and meet once it is visible to wgmma.

        Every thread issues all its 18 global loads before its first shared store, so the CTA pays one global
        round trip before its first wgmma: with a branch per piece (rows past q_len x H) ptxas kept loads and
        stores interleaved, 6 round trips at the start of every CTA (B=1: 11% of the samples,
        docs/perf/cute_sm90_bf16.md). A thread keeps one column piece of 64 consecutive ones and walks rows, so the
        loads need no branch: a row past the end reads the last valid row (in bounds) and is stored as zeros."""
        H = self.v.num_heads
        QL = self.v.q_len
        cd = self.cdtype
        rows = self.rows
        nope_cols = D_NOPE // 8  # 64 pieces per row: thread t keeps column t % 64, rows t // 64 + 4 k
        rope_cols = D_ROPE // 8  # 8 pieces per row: column t % 8, rows t // 8 + 32 k
        pieces = cute.make_rmem_tensor(cute.make_layout((8, Q_NOPE_PIECES + Q_ROPE_PIECES)), mQn.element_type)
        for k in cutlass.range_constexpr(Q_NOPE_PIECES + Q_ROPE_PIECES):
            nope = k < Q_NOPE_PIECES
            if cutlass.const_expr(nope):
                row = ctid // nope_cols + (256 // nope_cols) * k
            else:
                row = ctid // rope_cols + (256 // rope_cols) * (k - Q_NOPE_PIECES)
            r = cutlass.min(mblk * BLOCK_M + row, rows - 1)
            tok = b * QL + r // H
            h = r % H
            if cutlass.const_expr(nope):
                src = cute.local_tile(mQn[(tok, h, None)], (8,), (ctid % nope_cols,))
            else:
                src = cute.local_tile(mQp[(tok, h, None)], (8,), (ctid % rope_cols,))
            pieces[(None, k)].store(src.load())
        for k in cutlass.range_constexpr(Q_NOPE_PIECES + Q_ROPE_PIECES):
            nope = k < Q_NOPE_PIECES
            if cutlass.const_expr(nope):
                row = ctid // nope_cols + (256 // nope_cols) * k
                dst = cute.local_tile(sQ[(row, None, 0)], (8,), (ctid % nope_cols,))
            else:
                row = ctid // rope_cols + (256 // rope_cols) * (k - Q_NOPE_PIECES)
                dst = cute.local_tile(sQ[(row, None, 0)], (8,), (nope_cols + ctid % rope_cols,))
            if mblk * BLOCK_M + row < rows:
                dst.store(pieces[(None, k)].load().to(cutlass.Float32).to(cd))
            else:
                dst.store(cute.zeros_like(dst.load()))
        cute.arch.fence_proxy("async.shared", space="cta")
        consumer_barrier()

    @cute.jit
    def split_key_operands(self, qk_mma, qk_rs_mma, pv_mma, sQ, sKV, sV, sP, ctid):
        """A consumer thread's operands when the groups split each tile's keys for S (this kernel's layouts): the
        P V slice, Q's fragments (the last Q_REG_CHUNKS chunks loaded into registers once), K, P and V, the zeroed
        O accumulator, the S accumulator, this thread's (row, key) coordinates in the tile and its elements of P in
        shared memory."""
        cd = self.cdtype
        qk_thr = qk_mma.get_slice(ctid)
        pv_thr = pv_mma.get_slice(ctid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        qk_rs_thr = qk_rs_mma.get_slice(ctid)
        tSsQ_rs = qk_rs_thr.partition_A(sQ)
        k_smem = cute.size(tSsQ_rs, mode=[2]) - Q_REG_CHUNKS * 4
        # the 64x16 A operand of one k-step: 8 values per thread, ((2,2,2), 1) as wgmma numbers them
        tSrQreg = cute.make_rmem_tensor(
            cute.make_layout(((2, 2, 2), 1, Q_REG_CHUNKS * 4), stride=((1, 2, 4), 0, 8)), cd)
        for k in cutlass.range_constexpr(Q_REG_CHUNKS * 4):
            cute.autovec_copy(tSsQ_rs[(None, 0, k_smem + k, 0)], tSrQreg[(None, 0, k)])
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sKV))
        tOrP = pv_thr.make_fragment_A(pv_thr.partition_A(sP))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((BLOCK_M, D_NOPE)))
        acc_o.fill(0.0)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((BLOCK_M, BLOCK_N)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))
        tSsP = qk_thr.partition_C(sP[(None, None, 0)])
        return pv_thr, tSrQ, tSrQreg, tSrK, tOrP, tOrV, acc_o, acc_s, tScS, tSsP

    @cute.jit
    def consume(self, qk_mma, qk_rs_mma, pv_mma, kv_pipe, sQ, sKV, sV, sP, sMaxX, sSumX, stage_ptr, mQn, mQp, mBT,
                mRowKv, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits,
                b, mblk, slot, seq_len, kv_start, kv_end, n_tiles, ctid):
        cd = self.cdtype
        grp = ctid // 128  # 0: keys 0..31 of each tile and output columns 0..255; 1: keys 32..63, columns 256..

        self.load_q(sQ, mQn, mQp, b, mblk, ctid)

        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        scale_log2 = sm_scale_log2 * qscale * kscale

        (pv_thr, tSrQ, tSrQreg, tSrK, tOrP, tOrV, acc_o, acc_s, tScS,
         tSsP) = self.split_key_operands(qk_mma, qk_rs_mma, pv_mma, sQ, sKV, sV, sP, ctid)

        row_max, row_sum, row_limit = self.row_state(mRowKv, b, mblk, tScS, seq_len, kv_end)
        lane = ctid % 32
        row_scale = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)  # logit scale of each row
        for half in cutlass.range_constexpr(2):
            row_scale[half] = scale_log2

        # Both groups walk the tiles in step. With two 72 KB stages S_{j+1} cannot be issued before P_j V_j
        # (its stage is the one P_{j-1} V_{j-1} reads until then), so the loop is: S_j, softmax, P_j V_j, and
        # the producer fills the other stage meanwhile. What the groups share per tile: their partial row
        # maxima (A) and the two halves of P_j in shared memory (C).
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        for j in cutlass.range(n_tiles, unroll=1):
            stage = read_state.index
            kv_pipe.consumer_wait(read_state)
            self.issue_qk(qk_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, stage)
            warpgroup.wait_group(0)
            if cutlass.const_expr(not self.fp8_kv):
                # TMA loads whole page slices, so the slots of the last page past seq_len (whatever the block
                # held before, NaN included) reach shared memory. P is 0 there, but 0 x NaN = NaN in P V: zero
                # those rows of V first (the fp8 producer never loads them).
                valid = kv_end - (kv_start + j * BLOCK_N)
                if valid < BLOCK_N:
                    self.zero_v_rows(sKV, stage, valid, grp, ctid % 128)

            self.softmax_step(acc_s, acc_o, tScS, tSsP, row_max, row_sum, row_limit, row_scale, sMaxX, grp, lane,
                              kv_start + j * BLOCK_N, cd, 1.0)

            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            self.pv_from_smem_and_release(pv_mma, acc_o, tOrP, tOrV, 0, BLOCK_N // 16, kv_pipe, read_state)
            read_state.advance()

        self.store_result(acc_o, row_max, row_sum, tScS, pv_thr, sSumX, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                          mPartLse, kscale, 1.0, n_splits, b, mblk, slot)

    @cute.jit
    def row_state(self, mRowKv, b, mblk, tScS, seq_len, kv_end, scale_log2=None, sQs=None):
        """The two query rows this thread holds (accumulator values v with (v >> 1) & 1 == half): their running
        max (-inf), their sum over this group's keys (0) and their key limit (``row_kv_limit``); with ``sQs``
        (fp8 design B: each row's 1 / q scale) also each row's logit scale, ``scale_log2 * sQs[row]``."""
        row_max = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        row_sum = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        row_limit = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
        row_scale = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            row_max[half] = -cutlass.Float32.inf
            row_sum[half] = 0.0
            r = tScS[2 * half][0]
            row_limit[half] = self.row_kv_limit(mRowKv, b, mblk * BLOCK_M + r, seq_len, kv_end)
            if cutlass.const_expr(sQs is not None):
                row_scale[half] = scale_log2 * sQs[r]
        if cutlass.const_expr(sQs is not None):
            return row_max, row_sum, row_limit, row_scale
        return row_max, row_sum, row_limit

    @cute.jit
    def pv_from_smem_and_release(self, pv_mma, acc_o, tOrP, tOrV, k0, k_steps: cutlass.Constexpr, kv_pipe,
                                 read_state):
        """O += P V over k-steps [k0, k0 + k_steps) of the tile in ``read_state``'s stage, P from shared memory;
        waits for it and releases the stage. The caller advances ``read_state``: CuTe-DSL hands a pipeline state
        to a nested jit call as its values, so an advance here would move a copy
        (docs/perf/cute_sm90_bf16.md)."""
        stage = read_state.index
        warpgroup.fence()
        for k in cutlass.range_constexpr(k_steps):
            cute.gemm(pv_mma, acc_o, tOrP[(None, None, k0 + k, 0)], tOrV[(None, None, k0 + k, stage)], acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        kv_pipe.consumer_release(read_state)

    @cute.jit
    def row_kv_limit(self, mRowKv, b, r, seq_len, kv_end):
        """The keys query row ``r`` (q_len x heads folded) of request ``b`` sees, capped at the item's end: causal
        inside the q block (token t sees seq_len - q_len + t + 1 keys), or, for a row_kv_lens variant, the
        count given for (b, t) (a sharded cache under decode context parallelism), at most seq_len; 0 for the
        padding rows past q_len * H. Shared by both designs."""
        H = self.v.num_heads
        QL = self.v.q_len
        limit = seq_len - QL + 1 + r // H
        if cutlass.const_expr(self.v.row_kv_lens):
            limit = seq_len
            if r < self.rows:
                limit = cutlass.min(mRowKv[b * QL + r // H], seq_len)
        limit = cutlass.min(limit, kv_end)
        if r >= self.rows:
            limit = 0
        return limit

    @cute.jit
    def zero_v_rows(self, sKV, stage, first, grp, gtid):
        """Zero the V columns (0..511) of the keys >= ``first`` among this group's 32 keys of the tile. This group
        alone read those rows (its Q K^T, finished); the other group's P V reads them after barrier C, which
        softmax_step reaches after its async-proxy fence, so the zeros are visible to that wgmma."""
        chunks = D_NOPE // 8  # 16-byte chunks of a row's V
        half = BLOCK_N // 2
        for i in cutlass.range(gtid, half * chunks, 128, unroll=1):
            row = grp * half + i // chunks
            if row >= first:
                dst = cute.local_tile(sKV[(row, None, stage)], (8,), (i % chunks,))
                dst.store(cute.zeros_like(dst.load()))

    @cute.jit
    def softmax_step(self, acc_s, acc_o, tScS, tSsP, row_max, row_sum, row_limit, row_scale, sMaxX, grp, lane,
                     tile_start, p_dtype: cutlass.Constexpr, p_scale: cutlass.Constexpr):
        """Online softmax of one tile, shared by both designs: scale and mask this group's S (32 keys), exchange
        the row maxima with the other group (barrier A), write P x ``p_scale`` as ``p_dtype`` to shared memory,
        rescale O, and meet the other group at barrier C, after which all of P_j is in shared memory."""
        n_s = cute.size(tScS)
        n_o = cute.size(acc_o)
        m_loc = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            m_loc[half] = row_max[half]
        scale_mask_max(acc_s, tScS, row_scale, row_limit, tile_start, m_loc)
        for half in cutlass.range_constexpr(2):
            m_loc[half] = cute.arch.warp_reduction_max(m_loc[half], threads_in_group=4)
            if lane % 4 == 0:
                sMaxX[grp * BLOCK_M + tScS[2 * half][0]] = m_loc[half]
        # (A) both groups' row maxima are posted; both groups also finished P_{j-1} V_{j-1} (waited
        # below before they got here), so P_j may overwrite P_{j-1}
        consumer_barrier()
        alpha = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        m_use = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            m = cute.arch.fmax(m_loc[half], sMaxX[(1 - grp) * BLOCK_M + tScS[2 * half][0]])
            mu = exp_base(m)
            m_use[half] = mu
            alpha[half] = cute.math.exp2(row_max[half] - mu, fastmath=True)
            row_max[half] = m
            row_sum[half] = row_sum[half] * alpha[half]
        r_p = cute.make_rmem_tensor(acc_s.layout, p_dtype)
        for v in cutlass.range_constexpr(n_s):
            half = (v >> 1) & 1
            p = cute.math.exp2(acc_s[v] - m_use[half], fastmath=True)
            row_sum[half] = row_sum[half] + p
            if cutlass.const_expr(p_scale != 1.0):
                p = p * p_scale
            r_p[v] = p.to(p_dtype)
        cute.autovec_copy(r_p, tSsP)
        cute.arch.fence_proxy("async.shared", space="cta")
        # once the running maxima settle (most tiles of a long sequence) alpha is exactly 1 for every row
        # of the warp: skip the 128 multiplies
        if cute.arch.vote_any_sync(alpha[0] != 1.0 or alpha[1] != 1.0):
            for v in cutlass.range_constexpr(n_o):
                acc_o[v] = acc_o[v] * alpha[(v >> 1) & 1]
        consumer_barrier()  # (C) all of P_j is in shared memory

    @cute.jit
    def store_result(self, acc_o, row_max, row_sum, tScS, pv_thr, sSumX, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                     mPartLse, kscale, o_scale: cutlass.Constexpr, n_splits, b, mblk, slot):
        """Epilogue of both consumer groups (every design): add the other group's half of each row sum, then
        an unsplit item writes out (x kv_scale) and the natural-log LSE, a split item its partial (O / l in the
        output dtype, fp32 log2 LSE) to ``slot``. ``o_scale`` undoes a scale the accumulated O carries (design
        B's P x 256).

        The 64 x 512 tile goes through shared memory at ``stage_ptr`` (Q's buffer and the KV ring after it,
        free once both groups' wgmmas have retired: they did before the row-sum barrier) and leaves as whole
        rows of 16-byte stores in a loop. Stored straight from the accumulators, the epilogue was ~3000
        instructions of unrolled scalar stores run once per CTA, and its instruction fetches (stall "no
        instruction") were most of a short item's time (docs/perf/cute_sm90_bf16.md)."""
        n_o = cute.size(acc_o)
        inv, lse2 = self.final_row_stats(row_max, row_sum, tScS, sSumX, grp, ctid % 32, kscale, o_scale, n_splits)
        for v in cutlass.range_constexpr(n_o):
            acc_o[v] = acc_o[v] * inv[(v >> 1) & 1]
        s_out = self.staged_tile(stage_ptr, self.out_dtype)
        pv_thr.partition_C(s_out).store(acc_o.load().to(self.out_dtype))
        consumer_barrier()
        self.store_staged(s_out, lse2, tScS, ctid, mOut, mLse, mPartO, mPartLse, n_splits, b, mblk, slot)

    @cute.jit
    def final_row_stats(self, row_max, row_sum, tScS, sSumX, grp, lane, kscale, o_scale: cutlass.Constexpr,
                        n_splits, lse_shift: cutlass.Constexpr = 0.0):
        """The epilogue's per-row numbers for this thread's two rows (``tScS`` of the 64 x 64 S layout): adds the
        other group's half of each row sum (``sSumX``), then returns the output factor (``o_scale`` / l, x kv_scale
        for an unsplit item) and the log2 LSE (less ``lse_shift``: the log2 of a scale the row sums carry)."""
        for half in cutlass.range_constexpr(2):
            row_sum[half] = cute.arch.warp_reduction_sum(row_sum[half], threads_in_group=4)
            if lane % 4 == 0:
                sSumX[grp * BLOCK_M + tScS[2 * half][0]] = row_sum[half]
        consumer_barrier()
        for half in cutlass.range_constexpr(2):
            row_sum[half] = row_sum[half] + sSumX[(1 - grp) * BLOCK_M + tScS[2 * half][0]]
        out_scale = cutlass.Float32(1.0)
        if n_splits == 1:
            out_scale = kscale
        inv = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        lse2 = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            total = row_sum[half]
            i_v = 0.0
            l_v = -cutlass.Float32.inf
            if total > 0.0:
                i_v = o_scale / total
                l_v = row_max[half] + cute.math.log2(total, fastmath=False)
                if cutlass.const_expr(lse_shift != 0.0):
                    l_v = l_v - lse_shift
            inv[half] = i_v * out_scale
            lse2[half] = l_v
        return inv, lse2

    @cute.jit
    def store_staged(self, s_out, lse2, tScS, ctid, mOut, mLse, mPartO, mPartLse, n_splits, b, mblk, slot):
        """The staged 64 x 512 tile (``s_out``, complete: after a consumer barrier) as whole rows of 16-byte
        stores, and this thread's rows' LSE (natural log for an unsplit item, log2 for a partial)."""
        lane = ctid % 32
        rows = self.output.rows
        vec = 16 * 8 // self.out_dtype.width
        pieces = D_NOPE // vec
        if n_splits == 1:
            for i in cutlass.range(ctid, BLOCK_M * pieces, 256, unroll=4):
                row = i // pieces
                r = self.output.row(mblk, row)
                if r < rows:
                    tok, h = self.output.final_index(b, r)
                    dst = cute.local_tile(mOut[(tok, h, None)], (vec,), (i % pieces,))
                    dst.store(cute.local_tile(s_out[(row, None)], (vec,), (i % pieces,)).load())
            if ctid < 128 and lane % 4 == 0:
                for half in cutlass.range_constexpr(2):
                    r = self.output.row(mblk, tScS[2 * half][0])
                    if r < rows:
                        mLse[self.output.final_index(b, r)] = lse2[half] * LN2
        else:
            for i in cutlass.range(ctid, BLOCK_M * pieces, 256, unroll=4):  # the item's slot of the plan
                row = i // pieces
                r = self.output.row(mblk, row)
                if r < rows:
                    dst = cute.local_tile(mPartO[(self.output.partial_index(slot, r), None)], (vec,), (i % pieces,))
                    dst.store(cute.local_tile(s_out[(row, None)], (vec,), (i % pieces,)).load())
            if ctid < 128 and lane % 4 == 0:
                for half in cutlass.range_constexpr(2):
                    r = self.output.row(mblk, tScS[2 * half][0])
                    if r < rows:
                        mPartLse[self.output.partial_index(slot, r)] = lse2[half]

    @cute.jit
    def combine_in_kernel(self, mCtr, mPartO, mPartLse, mOut, mLse, mQScale, mKVScale, q_scale, kv_scale, b, mblk,
                          slot0, n_splits, mode, ctid, smem_ptr):
        """The fused combine (cute_common/epilogue.py ``fused_combine``) by the 256 consumer threads, in the
        shared memory at Q's buffer (free since the epilogue's staging tile has been stored)."""
        _, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                mKVScale)
        fused_combine(self.output, mCtr, mPartO, mPartLse, mOut, mLse, kscale, b, mblk, slot0, n_splits, mode, ctid,
                      smem_ptr, consumer_barrier, 256)

    @staticmethod
    def staged_tile(stage_ptr, dtype):
        """The epilogue's 64 x 512 staging tile in shared memory, rows STAGE_ROW elements apart (config.py)."""
        return cute.make_tensor(cute.recast_ptr(stage_ptr, dtype=dtype),
                                cute.make_layout((BLOCK_M, D_NOPE), stride=(STAGE_ROW, 1)))
