"""CuTe-DSL MLA decode kernel for Blackwell (sm_100f: B200 and B300): tcgen05 2-CTA MMA, TMEM accumulators, TMA.

Design and budgets: docs/design/sm100_cute_mla.md. In short:

* A cluster of two CTAs owns 128 query rows (q_len x heads folded into M; CTA v holds rows 64 v .. 64 v + 63)
  of one work item of the balanced split plan, and walks the item's keys in tiles of 128. The leader CTA's MMA
  warp issues ``tcgen05.mma.cta_group::2`` for the pair: S = Q K^T (M=128, N=128 keys, K = 576 in 9 chunks
  of 64 columns; CTA v supplies keys 64 v .. 64 v + 63 of B) and O += P V (M=128, N=256 output columns per
  instruction, two D tiles; CTA v supplies columns 128 v .. 128 v + 127 of each). S (2 stages x 64 columns) and
  O (256 columns) live in tensor memory.
* Warps: 0-3 softmax (TMEM lane t = row t % 64, keys 64 (t // 64) .. + 63 of S), 4-7 correction (Q load, O
  rescale in TMEM, epilogue), 8 MMA, 9 TMA (K and V tiles page by page through the block table), 10-11 idle.
* fp8 caches: kind::f8f6f4 e4m3 MMAs; a 16-bit q is split into e4m3 hi + lo with a per-row scale (two
  products into one accumulator); P is stored as e4m3(P x 256).
* The NaN rule: V rows past the item's end are never loaded from the cache (the straddling V slice is
  issued as 8- and 1-key boxes, the rest zero-filled from an out-of-range page); K rows there may be loaded
  but their logits are masked by a select before the row maximum.
* Split items write fp32 partials to their slot of the workspace (kernels/combine merges them); PDL waits
  before the first global read.

Checked at trace time (every compile): each MMA shared-memory layout and the (row, column) view that thread
stores and TMA boxes use address the same bytes; every thread's TMEM lane / column map is the one the softmax and
epilogue assume; the shared-storage struct is config.dynamic_shared_bytes. Nothing here has run on a Blackwell GPU;
what is checked without one is listed in cute_sm100/build.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05

from mla_backend_plugin.kernels.cute_common.barriers import Sm100DecodeBarrier as Bar
from mla_backend_plugin.kernels.cute_common.compat import SmemAllocator, TmemAllocator
from mla_backend_plugin.kernels.cute_common.epilogue import LN2, OutputStore, load_scales
from mla_backend_plugin.kernels.cute_common.fake_tensors import DTYPES
from mla_backend_plugin.kernels.cute_common.scheduler import BalancedScheduler
from mla_backend_plugin.kernels.cute_sm100.config import (
    BLOCK_M,
    BLOCK_N,
    CLUSTER,
    COR_STAGES,
    CTA_KEYS,
    CTA_ROWS,
    D_TILE,
    D_TILES,
    K_CHUNK,
    K_CHUNKS,
    MMA_WARP,
    NUM_THREADS,
    O_STAGES,
    P_SCALE_FP8,
    P_STAGES,
    Q_FP8_TARGET,
    REGS_CORRECTION,
    REGS_OTHER,
    REGS_SOFTMAX,
    S_STAGES,
    TMA_WARP,
    TMEM_ALLOC_COLS,
    TMEM_O_OFFSET,
    V_KEYS,
    V_STAGES_PER_TILE,
    Variant,
    dynamic_shared_bytes,
    kv_stages,
    rescale_threshold,
    stage_bytes,
)

D_NOPE = 512
F8 = cutlass.Float8E4M3FN
FLOAT_INF = float("inf")
SOFTMAX_THREADS = 128
CORRECTION_THREADS = 128


class Sm100MlaDecode:
    def __init__(self, variant: Variant, use_pdl: bool = True):
        self.v = variant
        self.use_pdl = use_pdl
        self.ab = DTYPES[variant.kv_dtype]  # the MMA operand dtype of Q, K, V and P
        self.q_in = DTYPES[variant.q_dtype]
        self.out_dtype = DTYPES[variant.out_dtype]
        self.fp8 = variant.fp8
        self.q_parts = variant.q_parts
        self.rows = variant.rows
        self.stages = kv_stages(variant)
        self.tx_bytes = CLUSTER * stage_bytes(variant)  # the leader's barrier counts both CTAs' bytes
        elem = self.ab.width // 8
        self.mma_k = 16 if elem == 2 else 32  # K of one MMA instruction
        self.rb = min(variant.block_size, CTA_KEYS)  # keys of one K box (a page slice)
        self.rbv = min(variant.block_size, V_KEYS)  # keys of one V box
        self.vw = 128 // elem  # columns of one V box: one 128-byte swizzle row
        self.threshold = rescale_threshold(variant)
        self.p_scale = P_SCALE_FP8 if self.fp8 else 1.0
        self.scheduler = BalancedScheduler(BLOCK_N)
        self.output = OutputStore(variant.num_heads, variant.q_len, BLOCK_M)

    # ------------------------------------------------------------------------------------------------
    # host side: MMA atoms, shared-memory layouts, TMA descriptors, launch
    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQn: cute.Tensor, mQp: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor,
                 mSeq: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor,
                 mPartLse: cute.Tensor, mQScale: cute.Tensor, mKVScale: cute.Tensor, q_scale: cutlass.Float32,
                 kv_scale: cutlass.Float32, sm_scale_log2: cutlass.Float32, mSplitIndex: cute.Tensor,
                 num_splits: cutlass.Int32, min_chunk: cutlass.Int32, work_target: cutlass.Int32,
                 grid_items: cutlass.Int32, stream: cuda.CUstream):
        ab = self.ab
        k_major = cute.nvgpu.OperandMajorMode.K
        mn_major = cute.nvgpu.OperandMajorMode.MN
        pair = tcgen05.CtaGroup.TWO
        qk_mma = sm100_utils.make_trivial_tiled_mma(ab, ab, k_major, k_major, cutlass.Float32, pair,
                                                    (BLOCK_M, BLOCK_N))
        # V is the first 512 columns of the cache read MN-major (output columns contiguous): no transpose,
        # for e4m3 too
        pv_mma = sm100_utils.make_trivial_tiled_mma(ab, ab, k_major, mn_major, cutlass.Float32, pair,
                                                    (BLOCK_M, D_TILE))
        # MMA-shaped layouts (what the smem descriptors are made from); Q "stages" = part * 9 + chunk
        q_layout = sm100_utils.make_smem_layout_a(qk_mma, (BLOCK_M, BLOCK_N, K_CHUNK), ab, K_CHUNKS * self.q_parts)
        k_layout = sm100_utils.make_smem_layout_b(qk_mma, (BLOCK_M, BLOCK_N, K_CHUNK), ab, self.stages)
        v_layout = sm100_utils.make_smem_layout_b(pv_mma, (BLOCK_M, D_TILE, V_KEYS), ab, self.stages)
        p_layout = sm100_utils.make_smem_layout_a(pv_mma, (BLOCK_M, D_TILE, BLOCK_N), ab, P_STAGES)
        # the same bytes as (row, column, stage) views: Q and P are written by threads, K and V by TMA boxes
        k_atom = tcgen05.make_smem_layout_atom(
            tcgen05.SmemLayoutAtomKind.K_SW64 if self.fp8 else tcgen05.SmemLayoutAtomKind.K_SW128, ab)
        p_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, ab)
        v_atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.MN_SW128, ab)
        q_view = cute.tile_to_shape(k_atom, (CTA_ROWS, K_CHUNK, K_CHUNKS * self.q_parts), order=(0, 1, 2))
        k_view = cute.tile_to_shape(k_atom, (CTA_KEYS, K_CHUNK, self.stages), order=(0, 1, 2))
        p_view = cute.tile_to_shape(p_atom, (CTA_ROWS, BLOCK_N, P_STAGES), order=(0, 1, 2))
        v_view = cute.tile_to_shape(v_atom, (D_TILE // CLUSTER, V_KEYS, self.stages), order=(1, 0, 2))
        check_same_bytes("Q", q_layout, q_view, CTA_ROWS, K_CHUNK, K_CHUNKS * self.q_parts)
        check_same_bytes("K", k_layout, k_view, CTA_KEYS, K_CHUNK, self.stages)
        check_same_bytes("P", p_layout, p_view, CTA_ROWS, BLOCK_N, P_STAGES)
        check_same_bytes("V", v_layout, v_view, D_TILE // CLUSTER, V_KEYS, self.stages)
        check_same_size(k_layout, v_layout)
        check_tmem_lane_map(qk_mma, pv_mma)

        # TMA: K boxes (rb keys x 64 columns) from the (block_size, 576, pages) view; V boxes (vw columns x
        # keys) from the MN view of the first 512 columns; V tails in boxes of 8 and 1 keys
        bs = self.v.block_size
        tma_op = cpasync.CopyBulkTensorTileG2SOp(pair)
        g_k = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        k_box = cute.tile_to_shape(k_atom, (self.rb, K_CHUNK), order=(0, 1))
        tma_k, tma_k_t = cpasync.make_tiled_tma_atom(tma_op, g_k, k_box, (self.rb, K_CHUNK))
        g_v = cute.make_tensor(mKV.iterator, cute.make_layout((D_NOPE, bs, mKV.shape[0]),
                                                             stride=(1, mKV.stride[1], mKV.stride[0])))
        v_box = cute.tile_to_shape(v_atom, (self.vw, self.rbv), order=(1, 0))
        tma_v, tma_v_t = cpasync.make_tiled_tma_atom(tma_op, g_v, v_box, (self.vw, self.rbv))
        v_box8 = cute.tile_to_shape(v_atom, (self.vw, 8), order=(1, 0))
        tma_v8, tma_v8_t = cpasync.make_tiled_tma_atom(tma_op, g_v, v_box8, (self.vw, 8))
        v_box1 = cute.make_composed_layout(v_atom.inner, 0, cute.make_layout((self.vw, 1), stride=(1, self.vw)))
        tma_v1, tma_v1_t = cpasync.make_tiled_tma_atom(tma_op, g_v, v_box1, (self.vw, 1))

        stages = self.stages

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2 * S_STAGES]
            p_mbar: cute.struct.MemRange[cutlass.Int64, 2 * P_STAGES]
            cor_mbar: cute.struct.MemRange[cutlass.Int64, 2 * COR_STAGES]
            o_mbar: cute.struct.MemRange[cutlass.Int64, 2 * O_STAGES]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_addr: cutlass.Int32
            row_x: cute.struct.MemRange[cutlass.Float32, 2 * SOFTMAX_THREADS]  # row max/sum exchange
            alpha: cute.struct.MemRange[cutlass.Float32, COR_STAGES * CTA_ROWS]  # per-tile rescale factors
            final_m: cute.struct.MemRange[cutlass.Float32, CTA_ROWS]
            final_l: cute.struct.MemRange[cutlass.Float32, CTA_ROWS]
            q_rscale: cute.struct.MemRange[cutlass.Float32, CTA_ROWS]  # 1 / (hi + lo scale) per row
            sQ: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(q_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(p_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(k_layout)], 1024]

        self.shared_storage = SharedStorage
        check_shared_bytes(SharedStorage.size_in_bytes(), dynamic_shared_bytes(self.v))
        m_blocks = (self.rows + BLOCK_M - 1) // BLOCK_M
        self.kernel(qk_mma, pv_mma, tma_k, tma_k_t, tma_v, tma_v_t, tma_v8, tma_v8_t, tma_v1, tma_v1_t,
                    mQn, mQp, mKV, mBT, mSeq, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale,
                    kv_scale, sm_scale_log2, mSplitIndex, num_splits, min_chunk, work_target,
                    q_layout, k_layout, v_layout, p_layout, q_view, k_view, v_view, p_view).launch(
            # grid (2 x m-blocks, work items): the two CTAs of a cluster are one m-block, and the m-blocks of a
            # work item are adjacent in launch order (all but the first read the item's KV from L2)
            grid=(CLUSTER * m_blocks, grid_items, 1), block=[NUM_THREADS, 1, 1], cluster=(CLUSTER, 1, 1),
            stream=stream, min_blocks_per_mp=1, use_pdl=self.use_pdl)

    # ------------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_k, tma_k_t, tma_v, tma_v_t, tma_v8,
               tma_v8_t, tma_v1, tma_v1_t, mQn: cute.Tensor, mQp: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor,
               mSeq: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor,
               mQScale: cute.Tensor, mKVScale: cute.Tensor, q_scale: cutlass.Float32, kv_scale: cutlass.Float32,
               sm_scale_log2: cutlass.Float32, mSplitIndex: cute.Tensor, num_splits: cutlass.Int32,
               min_chunk: cutlass.Int32, work_target: cutlass.Int32, q_layout: cute.ComposedLayout,
               k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
               q_view: cute.ComposedLayout, k_view: cute.ComposedLayout, v_view: cute.ComposedLayout,
               p_view: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == TMA_WARP:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            cpasync.prefetch_descriptor(tma_v8)
            cpasync.prefetch_descriptor(tma_v1)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tmem = TmemAllocator(storage.tmem_addr.ptr,
                             barrier_for_retrieve=pipeline.NamedBarrier(
                                 barrier_id=int(Bar.TMEM_PTR), num_threads=32 + SOFTMAX_THREADS + CORRECTION_THREADS),
                             allocator_warp_id=MMA_WARP, is_two_cta=True,
                             two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr)
        cta_layout_vmnk = cute.tiled_divide(cute.make_layout((CLUSTER, 1, 1)), (qk_mma.thr_id.shape,))
        pipes = self.make_pipelines(storage, cta_layout_vmnk)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(CLUSTER, 1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sQv = storage.sQ.get_tensor(q_view.outer, swizzle=q_view.inner)
        sK = storage.sKV.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sKv = storage.sKV.get_tensor(k_view.outer, swizzle=k_view.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, v_layout.inner), v_layout.outer)
        sVv = cute.make_tensor(cute.recast_ptr(sK.iterator, v_view.inner), v_view.outer)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sPv = storage.sP.get_tensor(p_view.outer, swizzle=p_view.inner)
        sRowX = storage.row_x.get_tensor(cute.make_layout(2 * SOFTMAX_THREADS))
        sAlpha = storage.alpha.get_tensor(cute.make_layout(COR_STAGES * CTA_ROWS))
        sFinalM = storage.final_m.get_tensor(cute.make_layout(CTA_ROWS))
        sFinalL = storage.final_l.get_tensor(cute.make_layout(CTA_ROWS))
        sQs = storage.q_rscale.get_tensor(cute.make_layout(CTA_ROWS))

        pipeline.pipeline_init_wait(cluster_shape_mn=(CLUSTER, 1, 1))

        # everything below may read what the previous kernel in the stream wrote; the next kernel may start
        # its prologue now (its own griddepcontrol.wait still waits for this grid to finish)
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        # Each role sets its register budget first and derives the work item after it: nothing computed here is
        # live across setmaxnreg (ptxas spills such values). Both CTAs of the pair derive the same item.
        sched = (mSeq, mSplitIndex, num_splits, min_chunk, work_target)
        if warp_idx < 4:
            cute.arch.setmaxregister_increase(REGS_SOFTMAX)
            item = self.work_item(*sched)
            if item.b1 > 0:  # else: past the end of the schedule (the whole pair)
                self.softmax_role(qk_mma, pipes, tmem, sPv, sRowX, sAlpha, sFinalM, sFinalL, sQs, mQScale,
                                  mKVScale, q_scale, kv_scale, sm_scale_log2, item, tidx)
        elif warp_idx < 8:
            cute.arch.setmaxregister_increase(REGS_CORRECTION)
            item = self.work_item(*sched)
            if item.b1 > 0:
                self.correction_role(pv_mma, pipes, tmem, sQv, sAlpha, sFinalM, sFinalL, sQs, mQn, mQp, mOut,
                                     mLse, mPartO, mPartLse, mKVScale, kv_scale, item, tidx - SOFTMAX_THREADS)
        else:
            cute.arch.setmaxregister_decrease(REGS_OTHER)
            if warp_idx == MMA_WARP:
                item = self.work_item(*sched)
                if item.b1 > 0:
                    self.mma_role(qk_mma, pv_mma, pipes, tmem, sQ, sK, sV, sP, item)
            elif warp_idx == TMA_WARP:
                item = self.work_item(*sched)
                if item.b1 > 0:
                    self.load_role(pipes, tma_k, tma_k_t, tma_v, tma_v_t, tma_v8, tma_v8_t, tma_v1, tma_v1_t,
                                   sKv, sVv, mKV, mBT, item)
        # no CTA of the pair leaves while the other may still signal one of its barriers
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def work_item(self, mSeq, mSplitIndex, num_splits, min_chunk, work_target):
        """This CTA's work item of the balanced plan (the pair's: both CTAs have the same blockIdx.y). Only
        thread 0 of CTA 0 of m-block 0 writes the split list (plan_item's tidx == 0 and m-block 0)."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, w, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())  # 0: leader, 1: peer
        b1, b, seq_len, n_splits, _, kv_start, kv_end, n_tiles = self.scheduler.plan_item(
            mSeq, mSplitIndex, w, bx, tidx, num_splits, min_chunk, work_target)
        return WorkItem(b1=b1, b=b, seq_len=seq_len, n_splits=n_splits, kv_start=kv_start, kv_end=kv_end,
                        n_tiles=n_tiles, w=w, mblk=bx // CLUSTER, rank=rank)

    def make_pipelines(self, storage, cta_layout_vmnk):
        thread = pipeline.Agent.Thread
        one = pipeline.CooperativeGroup(thread, 1)
        both_softmax = pipeline.CooperativeGroup(thread, SOFTMAX_THREADS * CLUSTER)
        both_correction = pipeline.CooperativeGroup(thread, CORRECTION_THREADS * CLUSTER)
        return Sm100Pipes(
            # correction threads of both CTAs wrote Q -> the leader's MMA
            q=pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.q_mbar.data_ptr(), num_stages=1, producer_group=both_correction,
                consumer_group=one, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True),
            # TMA warp of each CTA -> MMA; the leader expects both CTAs' bytes
            kv=pipeline.PipelineTmaUmma.create(
                barrier_storage=storage.kv_mbar.data_ptr(), num_stages=self.stages, producer_group=one,
                consumer_group=one, tx_count=self.tx_bytes, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True),
            # S in TMEM -> softmax threads of both CTAs
            s=pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.s_mbar.data_ptr(), num_stages=S_STAGES, producer_group=one,
                consumer_group=both_softmax, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True),
            # P in shared memory (both CTAs) -> MMA
            p=pipeline.PipelineAsyncUmma.create(
                barrier_storage=storage.p_mbar.data_ptr(), num_stages=P_STAGES, producer_group=both_softmax,
                consumer_group=one, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True),
            # the tile's rescale factors: softmax -> correction of the same CTA
            cor=pipeline.PipelineAsync.create(
                barrier_storage=storage.cor_mbar.data_ptr(), num_stages=COR_STAGES,
                producer_group=pipeline.CooperativeGroup(thread, SOFTMAX_THREADS),
                consumer_group=pipeline.CooperativeGroup(thread, CORRECTION_THREADS), defer_sync=True),
            # O after P V(j - 1) -> correction threads of both CTAs (rescale), whose release lets P V(j) issue
            o=pipeline.PipelineUmmaAsync.create(
                barrier_storage=storage.o_mbar.data_ptr(), num_stages=O_STAGES, producer_group=one,
                consumer_group=both_correction, cta_layout_vmnk=cta_layout_vmnk, defer_sync=True),
        )

    # ---- TMA warp -------------------------------------------------------------------------------------
    @cute.jit
    def page_ids(self, mBT, b, tile_start, kv_end, num_blocks):
        """Lane l < 8 holds the page of keys tile_start + 16 l .. + 15 (every K or V box starts at one of
        them); a 16-key group at or past the item's end gets the out-of-range page num_blocks (TMA zero fill)."""
        lane = cute.arch.lane_idx()
        tok = tile_start + 16 * lane
        page = num_blocks
        if lane < BLOCK_N // 16 and tok < kv_end:
            page = mBT[b, tok // self.v.block_size]
        return page

    @cute.jit
    def load_role(self, pipes, tma_k, tma_k_t, tma_v, tma_v_t, tma_v8, tma_v8_t, tma_v1, tma_v1_t, sKv, sVv, mKV,
                  mBT, item):
        rb, rbv, vw = self.rb, self.rbv, self.vw
        one = cute.make_layout(1)
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(cute.flat_divide(sKv, (rb, K_CHUNK)), 0, 2),
                                         cute.group_modes(cute.flat_divide(tma_k_t, (rb, K_CHUNK)), 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(cute.flat_divide(sVv, (vw, rbv)), 0, 2),
                                         cute.group_modes(cute.flat_divide(tma_v_t, (vw, rbv)), 0, 2))
        tV8s, tV8g = cpasync.tma_partition(tma_v8, 0, one, cute.group_modes(cute.flat_divide(sVv, (vw, 8)), 0, 2),
                                           cute.group_modes(cute.flat_divide(tma_v8_t, (vw, 8)), 0, 2))
        tV1s, tV1g = cpasync.tma_partition(tma_v1, 0, one, cute.group_modes(cute.flat_divide(sVv, (vw, 1)), 0, 2),
                                           cute.group_modes(cute.flat_divide(tma_v1_t, (vw, 1)), 0, 2))
        vt = VTma(tma_v, tVs, tVg, tma_v8, tV8s, tV8g, tma_v1, tV1s, tV1g)
        num_blocks = mKV.shape[0]
        kv_start, kv_end, n_tiles, rank = item.kv_start, item.kv_end, item.n_tiles, item.rank
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        pages = self.page_ids(mBT, item.b, kv_start, kv_end, num_blocks)
        pages_prev = pages
        # ring order: K(0), then K(j), V(j - 1) for j >= 1, then V(n - 1): what the MMA warp consumes
        for j in cutlass.range(n_tiles, unroll=1):
            tile_start = kv_start + j * BLOCK_N
            pages_next = self.page_ids(mBT, item.b, tile_start + BLOCK_N, kv_end, num_blocks)  # a tile ahead
            state = self.load_k_tile(pipes, tma_k, tKs, tKg, pages, tile_start, state, rank)
            if j > 0:
                state = self.load_v_tile(pipes, vt, pages_prev, tile_start - BLOCK_N, kv_end, num_blocks, state, rank)
            pages_prev = pages
            pages = pages_next
        if n_tiles > 0:
            state = self.load_v_tile(pipes, vt, pages_prev, kv_start + (n_tiles - 1) * BLOCK_N, kv_end, num_blocks,
                                     state, rank)
        pipes.kv.producer_tail(state)

    @cute.jit
    def load_k_tile(self, pipes, tma_k, tKs, tKg, pages, tile_start, state, rank):
        """This CTA's 64 keys of the tile (its half of B's N for S), 9 stages of 64 columns."""
        bs = self.v.block_size
        rb = self.rb
        for c in cutlass.range(K_CHUNKS, unroll=1):
            pipes.kv.producer_acquire(state)
            bar = pipes.kv.producer_get_barrier(state)
            for p in cutlass.range_constexpr(CTA_KEYS // rb):
                tok = tile_start + rank * CTA_KEYS + p * rb
                page = cute.arch.shuffle_sync(pages, (tok - tile_start) // 16)
                cute.copy(tma_k, tKg[(None, (tok % bs) // rb, c, page)], tKs[(None, p, 0, state.index)],
                          tma_bar_ptr=bar)
            state.advance()
        return state

    @cute.jit
    def load_v_tile(self, pipes, vt, pages, tile_start, kv_end, num_blocks, state, rank):
        """V of the tile for this CTA: for each 32-key block and D tile (8 stages), this CTA's 128 output columns
        of all the block's keys (MN-major). A box that straddles the item's end loads its valid keys as 8- and
        1-key boxes and the rest from the out-of-range page (zeros): no slot past the end reaches shared memory."""
        bs = self.v.block_size
        rbv, vw = self.rbv, self.vw
        for vs in cutlass.range(V_STAGES_PER_TILE, unroll=1):
            kb = vs // D_TILES
            n = vs % D_TILES
            pipes.kv.producer_acquire(state)
            bar = pipes.kv.producer_get_barrier(state)
            col_box = (n * D_TILE + rank * (D_TILE // CLUSTER)) // vw  # this CTA's first vw-column box
            for p in cutlass.range_constexpr(V_KEYS // rbv):
                tok = tile_start + kb * V_KEYS + p * rbv
                page = cute.arch.shuffle_sync(pages, (tok - tile_start) // 16)
                if tok < kv_end and kv_end < tok + rbv:
                    for d in cutlass.range_constexpr((D_TILE // CLUSTER) // vw):
                        self.load_v_tail(vt, page, num_blocks, tok % bs, kv_end - tok, p * rbv, col_box + d, d,
                                         state.index, bar)
                else:
                    for d in cutlass.range_constexpr((D_TILE // CLUSTER) // vw):
                        cute.copy(vt.tma_v, vt.tVg[(None, col_box + d, (tok % bs) // rbv, page)],
                                  vt.tVs[(None, d, p, state.index)], tma_bar_ptr=bar)
            state.advance()
        return state

    @cute.jit
    def load_v_tail(self, vt, page, num_blocks, key0, n_valid, row0, gcol, scol, stage, bar):
        """One straddling V box: keys key0 .. key0 + n_valid - 1 of ``page`` into stage rows row0 .., the rest of
        the box's rows from the out-of-range page. Boxes of 8 keys start at multiples of 8 (so do key0 and
        row0: page slices are >= 16 keys), single keys fill the remainder."""
        full8 = n_valid // 8
        for g in cutlass.range(full8, unroll=1):
            cute.copy(vt.tma_v8, vt.tV8g[(None, gcol, key0 // 8 + g, page)],
                      vt.tV8s[(None, scol, row0 // 8 + g, stage)], tma_bar_ptr=bar)
        for i in cutlass.range(full8 * 8, n_valid, unroll=1):
            cute.copy(vt.tma_v1, vt.tV1g[(None, gcol, key0 + i, page)], vt.tV1s[(None, scol, row0 + i, stage)],
                      tma_bar_ptr=bar)
        zero_end8 = cutlass.min((n_valid + 7) // 8 * 8, self.rbv)
        for i in cutlass.range(n_valid, zero_end8, unroll=1):
            cute.copy(vt.tma_v1, vt.tV1g[(None, gcol, 0, num_blocks)], vt.tV1s[(None, scol, row0 + i, stage)],
                      tma_bar_ptr=bar)
        for g in cutlass.range(zero_end8 // 8, self.rbv // 8, unroll=1):
            cute.copy(vt.tma_v8, vt.tV8g[(None, gcol, 0, num_blocks)], vt.tV8s[(None, scol, row0 // 8 + g, stage)],
                      tma_bar_ptr=bar)

    # ---- MMA warp -------------------------------------------------------------------------------------
    @cute.jit
    def mma_role(self, qk_mma, pv_mma, pipes, tmem, sQ, sK, sV, sP, item):
        n_tiles = item.n_tiles
        tmem.allocate(TMEM_ALLOC_COLS)
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
        if item.rank == 0:  # the leader issues every MMA of the pair
            tSrQ = qk_mma.make_fragment_A(sQ)
            tSrK = qk_mma.make_fragment_B(sK)
            tOrP = pv_mma.make_fragment_A(sP)
            tOrV = pv_mma.make_fragment_B(sV)
            tStS, tOtO = self.tmem_tensors(qk_mma, pv_mma, tmem_ptr)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S_STAGES)
            p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, P_STAGES)
            o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, O_STAGES)
            if n_tiles > 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                pipes.q.consumer_wait(q_state)
            # the MMA atoms carry their ACCUMULATE field: threaded through the loops as values
            for j in cutlass.range(n_tiles, unroll=1):
                qk_mma, kv_state, s_state = self.mma_qk(qk_mma, pipes, tSrQ, tSrK, tStS, kv_state, s_state)
                if j > 0:
                    pv_mma, kv_state, p_state, o_state = self.mma_pv(pv_mma, pipes, tOrP, tOrV, tOtO, j - 1,
                                                                     kv_state, p_state, o_state)
            if n_tiles > 0:
                pv_mma, kv_state, p_state, o_state = self.mma_pv(pv_mma, pipes, tOrP, tOrV, tOtO, n_tiles - 1,
                                                                 kv_state, p_state, o_state)
            # every S and O buffer released by both CTAs' consumers: TMEM is no longer read
            pipes.s.producer_tail(s_state)
            pipes.o.producer_tail(o_state)
        tmem.relinquish_alloc_permit()
        tmem.free(tmem_ptr)

    def tmem_tensors(self, qk_mma, pv_mma, tmem_ptr, o_only: bool = False):
        """S: S_STAGES accumulators of 64 columns; O: the two D tiles of 128 columns after them."""
        tStS = None
        if not o_only:
            s_shape = qk_mma.partition_shape_C((BLOCK_M, BLOCK_N))
            tStS = cute.make_tensor(tmem_ptr, qk_mma.make_fragment_C(cute.append(s_shape, S_STAGES)).layout)
        o_frag = pv_mma.make_fragment_C(pv_mma.partition_shape_C((BLOCK_M, D_TILE)))
        o_layout = cute.append(o_frag.layout, cute.make_layout(D_TILES, stride=D_TILE // CLUSTER))
        tOtO = cute.make_tensor(tmem_ptr + TMEM_O_OFFSET, o_layout)
        return tStS, tOtO

    @cute.jit
    def mma_qk(self, qk_mma, pipes, tSrQ, tSrK, tStS, kv_state, s_state):
        """S(j) = Q K^T into S stage j % 2: 9 ring stages of 64 columns, each (hi and lo for a 16-bit q on an
        fp8 cache) in k-steps of 16 (32 for e4m3)."""
        pipes.s.producer_acquire(s_state)
        tS = tStS[(None, None, None, s_state.index)]
        for c in cutlass.range_constexpr(K_CHUNKS):
            pipes.kv.consumer_wait(kv_state)
            for qp in cutlass.range_constexpr(self.q_parts):
                for k in cutlass.range_constexpr(K_CHUNK // self.mma_k):
                    qk_mma.set(tcgen05.Field.ACCUMULATE, c != 0 or qp != 0 or k != 0)
                    cute.gemm(qk_mma, tS, tSrQ[(None, None, k, qp * K_CHUNKS + c)],
                              tSrK[(None, None, k, kv_state.index)], tS)
            pipes.kv.consumer_release(kv_state)
            kv_state.advance()
        pipes.s.producer_commit(s_state)
        s_state.advance()
        return qk_mma, kv_state, s_state

    @cute.jit
    def mma_pv(self, pv_mma, pipes, tOrP, tOrV, tOtO, j, kv_state, p_state, o_state):
        """O += P(j) V(j): waits for P in shared memory (both CTAs) and for the correction warps to have rescaled
        O for tile j; 4 blocks of 32 keys x 2 D tiles, in the producer's order."""
        pipes.o.producer_acquire(o_state)
        pipes.p.consumer_wait(p_state)
        k_per_stage = V_KEYS // self.mma_k
        for kb in cutlass.range_constexpr(BLOCK_N // V_KEYS):
            for n in cutlass.range_constexpr(D_TILES):
                pipes.kv.consumer_wait(kv_state)
                tO = tOtO[(None, None, None, n)]
                for k in cutlass.range_constexpr(k_per_stage):
                    if cutlass.const_expr(kb == 0 and k == 0):
                        pv_mma.set(tcgen05.Field.ACCUMULATE, j > 0)
                    else:
                        pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                    cute.gemm(pv_mma, tO, tOrP[(None, None, kb * k_per_stage + k, p_state.index)],
                              tOrV[(None, None, k, kv_state.index)], tO)
                pipes.kv.consumer_release(kv_state)
                kv_state.advance()
        pipes.p.consumer_release(p_state)
        p_state.advance()
        pipes.o.producer_commit(o_state)
        o_state.advance()
        return pv_mma, kv_state, p_state, o_state

    # ---- softmax warps --------------------------------------------------------------------------------
    @cute.jit
    def softmax_role(self, qk_mma, pipes, tmem, sPv, sRowX, sAlpha, sFinalM, sFinalL, sQs, mQScale, mKVScale,
                     q_scale, kv_scale, sm_scale_log2, item, tidx):
        seq_len, kv_start, kv_end, n_tiles = item.seq_len, item.kv_start, item.kv_end, item.n_tiles
        mblk, rank = item.mblk, item.rank
        H = self.v.num_heads
        QL = self.v.q_len
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
        s_shape = qk_mma.partition_shape_C((BLOCK_M, BLOCK_N))
        tStS = cute.make_tensor(tmem_ptr, qk_mma.make_fragment_C(cute.append(s_shape, S_STAGES)).layout)
        cS = cute.make_identity_tensor((CTA_ROWS, BLOCK_N))
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        tAcc0 = tStS[((None, None), 0, 0, 0)]
        tiled_ld = tcgen05.make_tmem_copy(load_atom, tAcc0)
        thr_ld = tiled_ld.get_slice(tidx)
        tTR_c = thr_ld.partition_D(cS)
        rS = cute.make_fragment_like(tTR_c, cutlass.Float32)
        n_vals = cute.size(rS)
        row = tTR_c[0][0]  # this thread's row of the CTA (0..63)
        key0 = tTR_c[0][1]  # its first key of the tile (0 or 64)
        half = tidx // CTA_ROWS

        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        r = self.output.row(mblk, rank * CTA_ROWS + row)
        # causal inside the q block: token t of the request sees seq_len - q_len + t + 1 keys
        limit = cutlass.min(seq_len - QL + 1 + r // H, kv_end)
        if r >= self.rows:
            limit = 0
        # per-row scale of Q, written by the correction warps with Q
        pipeline.NamedBarrier(barrier_id=int(Bar.Q_READY), num_threads=SOFTMAX_THREADS + CORRECTION_THREADS
                              ).arrive_and_wait()
        row_scale = sm_scale_log2 * qscale * kscale * sQs[row]

        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S_STAGES)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, P_STAGES)
        c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, COR_STAGES)
        row_bar = pipeline.NamedBarrier(barrier_id=int(Bar.SOFTMAX_ROWS), num_threads=SOFTMAX_THREADS)
        m_run = -cutlass.Float32.inf  # the maximum P is computed against (log2 domain, scaled)
        l_run = cutlass.Float32(0.0)  # this thread's half of the row sum
        cw = 16 // (self.ab.width // 8)  # P values per 16-byte store
        for j in cutlass.range(n_tiles, unroll=1):
            tile_start = kv_start + j * BLOCK_N
            pipes.s.consumer_wait(s_state)
            tAcc = tStS[((None, None), 0, 0, s_state.index)]
            cute.copy(tiled_ld, thr_ld.partition_S(tAcc), rS)
            cute.arch.fence_view_async_tmem_load()
            pipes.s.consumer_release(s_state)
            s_state.advance()

            # scale, mask (a select, so garbage K rows past the end give -inf, never NaN), row max
            m_tile = -cutlass.Float32.inf
            needs_mask = tile_start + BLOCK_N > limit
            for i in cutlass.range_constexpr(n_vals):
                s = rS[i] * row_scale
                if needs_mask:
                    if tile_start + tTR_c[i][1] >= limit:
                        s = -cutlass.Float32.inf
                rS[i] = s
                m_tile = cute.arch.fmax(m_tile, s)
            buf = (j % 2) * SOFTMAX_THREADS
            sRowX[buf + tidx] = m_tile
            row_bar.arrive_and_wait()
            m_tile = cute.arch.fmax(m_tile, sRowX[buf + (tidx ^ CTA_ROWS)])
            # raise the running maximum only when it moves by more than the threshold (exact either way)
            alpha = cutlass.Float32(1.0)
            if m_tile > m_run + self.threshold:
                if m_run != -cutlass.Float32.inf:
                    alpha = cute.math.exp2(m_run - m_tile, fastmath=True)
                m_run = m_tile
            m_use = m_run
            if m_run == -cutlass.Float32.inf:
                m_use = 0.0  # no key seen yet: P = exp2(-inf) = 0

            pipes.p.producer_acquire(p_state)
            l_tile = cutlass.Float32(0.0)
            rP = cute.make_rmem_tensor(cute.make_layout(n_vals), self.ab)
            for i in cutlass.range_constexpr(n_vals):
                p = cute.math.exp2(rS[i] - m_use, fastmath=True)
                l_tile = l_tile + p
                if cutlass.const_expr(self.p_scale != 1.0):
                    p = p * self.p_scale
                rP[i] = p.to(self.ab)
            for c in cutlass.range_constexpr(n_vals // cw):
                dst = cute.local_tile(sPv[(row, None, p_state.index)], (cw,), ((key0 + c * cw) // cw,))
                dst.store(cute.local_tile(rP, (cw,), (c,)).load())
            cute.arch.fence_view_async_shared()  # P (generic stores) -> the MMA (async proxy)
            pipes.p.producer_commit(p_state)
            p_state.advance()
            l_run = l_run * alpha + l_tile

            pipes.cor.producer_acquire(c_state)
            if half == 0:
                sAlpha[c_state.index * CTA_ROWS + row] = alpha
            pipes.cor.producer_commit(c_state)
            c_state.advance()

        # the row's final maximum and sum (both halves) for the epilogue, through the exchange buffer the last
        # tile did not use (the partner may still be reading the other)
        buf = (n_tiles % 2) * SOFTMAX_THREADS
        sRowX[buf + tidx] = l_run
        row_bar.arrive_and_wait()
        l_total = l_run + sRowX[buf + (tidx ^ CTA_ROWS)]
        if half == 0:
            sFinalM[row] = m_run
            sFinalL[row] = l_total
        pipeline.NamedBarrier(barrier_id=int(Bar.FINAL_STATS), num_threads=SOFTMAX_THREADS + CORRECTION_THREADS
                              ).arrive()

    # ---- correction warps -----------------------------------------------------------------------------
    @cute.jit
    def load_q(self, sQv, sQs, mQn, mQp, b, mblk, rank, ctid):
        """Q (this CTA's 64 rows x 576) -> shared memory in the MMA dtype, 2 threads per row; an fp8 cache with a
        16-bit q gets e4m3 hi (stages 0..8) and lo (stages 9..17) with the per-row scale s = 448 / max|q_row|
        (sQs[row] = 1 / s). Rows past q_len x H are zeros."""
        H = self.v.num_heads
        QL = self.v.q_len
        row = ctid // 2
        col_half = ctid % 2
        r = self.output.row(mblk, rank * CTA_ROWS + row)
        tok = b * QL + r // H
        h = r % H
        valid = r < self.rows
        n_chunks = (576 // 2) // 8  # 36 vectors of 8 per thread
        sc = cutlass.Float32(1.0)
        if cutlass.const_expr(self.q_parts == 2):
            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(n_chunks):
                x = self.q_vec(mQn, mQp, tok, h, col_half * 288 + 8 * i, valid)
                for e in cutlass.range_constexpr(8):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(x[e], -x[e]))
            amax = cute.arch.warp_reduction_max(amax, threads_in_group=2)
            if amax > 0.0:
                sc = Q_FP8_TARGET / amax
        for i in cutlass.range_constexpr(n_chunks):
            col = col_half * 288 + 8 * i
            x = self.q_vec(mQn, mQp, tok, h, col, valid)
            chunk = col // K_CHUNK
            dst = cute.local_tile(sQv[(row, None, chunk)], (8,), ((col % K_CHUNK) // 8,))
            if cutlass.const_expr(self.q_parts == 2):
                y = x.load() * sc
                hi = y.to(F8)
                dst.store(hi)
                dst_lo = cute.local_tile(sQv[(row, None, K_CHUNKS + chunk)], (8,), ((col % K_CHUNK) // 8,))
                dst_lo.store((y - hi.to(cutlass.Float32)).to(F8))
            else:
                dst.store(x.load().to(self.ab))
        if col_half == 0:
            sQs[row] = 1.0 / sc
        cute.arch.fence_proxy("async.shared", space="cta")  # Q (generic stores) -> the MMA (async proxy)

    @cute.jit
    def q_vec(self, mQn, mQp, tok, h, col, valid):
        """Columns col .. col + 7 of q row (tok, h) as fp32 (zeros for a padded row)."""
        x = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
        x.fill(0.0)
        if valid:
            if col < D_NOPE:
                x.store(cute.local_tile(mQn[(tok, h, None)], (8,), (col // 8,)).load().to(cutlass.Float32))
            else:
                x.store(cute.local_tile(mQp[(tok, h, None)], (8,), ((col - D_NOPE) // 8,)).load().to(cutlass.Float32))
        return x

    @cute.jit
    def correction_role(self, pv_mma, pipes, tmem, sQv, sAlpha, sFinalM, sFinalL, sQs, mQn, mQp, mOut, mLse, mPartO,
                        mPartLse, mKVScale, kv_scale, item, ctid):
        b, n_tiles, mblk, rank = item.b, item.n_tiles, item.mblk, item.rank
        if n_tiles > 0:
            self.load_q(sQv, sQs, mQn, mQp, b, mblk, rank, ctid)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipes.q.producer_acquire(q_state)
            pipes.q.producer_commit(q_state)
        else:
            if ctid < CTA_ROWS:
                sQs[ctid] = 1.0
        # the per-row q scales are written: signal the softmax warps (they wait; we do not, so the order of this
        # barrier and TMEM_PTR below cannot deadlock the two warp groups)
        pipeline.NamedBarrier(barrier_id=int(Bar.Q_READY), num_threads=SOFTMAX_THREADS + CORRECTION_THREADS
                              ).arrive()
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
        _, tOtO = self.tmem_tensors(pv_mma, pv_mma, tmem_ptr, o_only=True)
        cO = cute.make_identity_tensor((CTA_ROWS, D_TILE))
        # 32 columns per tcgen05.ld / st: a D tile is 4 chunks of this thread's 128 columns
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
        tO0 = tOtO[((None, None), 0, 0, 0)]
        tiled_ld = tcgen05.make_tmem_copy(load_atom, tO0)
        tiled_st = tcgen05.make_tmem_copy(store_atom, tO0)
        thr_ld = tiled_ld.get_slice(ctid)
        thr_st = tiled_st.get_slice(ctid)
        tTR_c = thr_ld.partition_D(cO)  # ((32, 1), 1, 4): this thread's row, columns ascending
        n_chunks = cute.size(tTR_c, mode=[2])
        rC = cute.make_fragment_like(tTR_c[(None, None, 0)], cutlass.Float32)
        row = tTR_c[0][0]

        c_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, COR_STAGES)
        o_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, O_STAGES)
        for j in cutlass.range(n_tiles, unroll=1):
            pipes.cor.consumer_wait(c_state)
            alpha = sAlpha[c_state.index * CTA_ROWS + row]
            pipes.cor.consumer_release(c_state)
            c_state.advance()
            if j > 0:
                # O holds P V up to tile j - 1: rescale it before P V(j) adds to it; skipped (warp-uniformly:
                # tcgen05.ld/st are warp-collective) when all the warp's rows kept their maximum
                pipes.o.consumer_wait(o_state)
                if cute.arch.vote_any_sync(alpha != 1.0):
                    for n in cutlass.range_constexpr(D_TILES):
                        tOn = tOtO[((None, None), 0, 0, n)]
                        src = thr_ld.partition_S(tOn)
                        dst = thr_st.partition_D(tOn)
                        for q in cutlass.range_constexpr(n_chunks):
                            cute.copy(tiled_ld, src[(None, None, q)], rC)
                            cute.arch.fence_view_async_tmem_load()
                            for i in cutlass.range_constexpr(cute.size(rC)):
                                rC[i] = rC[i] * alpha
                            cute.copy(tiled_st, rC, dst[(None, None, q)])
                    cute.arch.fence_view_async_tmem_store()
                pipes.o.consumer_release(o_state)
                o_state.advance()

        pipeline.NamedBarrier(barrier_id=int(Bar.FINAL_STATS), num_threads=SOFTMAX_THREADS + CORRECTION_THREADS
                              ).arrive_and_wait()
        m_fin = sFinalM[row]
        l_fin = sFinalL[row]
        kscale = kv_scale
        if cutlass.const_expr(self.v.kv_scale_is_ptr):
            kscale = mKVScale[0]
        if n_tiles > 0:
            pipes.o.consumer_wait(o_state)  # P V of the last tile done
        self.epilogue(tiled_ld, thr_ld, tOtO, tTR_c, rC, mOut, mLse, mPartO, mPartLse, m_fin, l_fin, kscale, item,
                      ctid)
        if n_tiles > 0:
            cute.arch.fence_view_async_tmem_load()
            pipes.o.consumer_release(o_state)

    @cute.jit
    def epilogue(self, tiled_ld, thr_ld, tOtO, tTR_c, rC, mOut, mLse, mPartO, mPartLse, m_fin, l_fin, kscale, item,
                 ctid):
        """Thread c: row c % 64 of the CTA, output columns 256 n + 128 (c // 64) .. + 127 of D tiles n = 0, 1, in
        chunks of 32. An unsplit item writes out (x kv_scale / l) and the natural-log LSE; a split item its fp32
        partial O / l and log2 LSE to slot w. A row without keys (l = 0) writes 0 / -inf by a select, whatever
        TMEM holds (no MMA wrote it when the item has no key)."""
        row = tTR_c[0][0]
        r = self.output.row(item.mblk, item.rank * CTA_ROWS + row)
        has_keys = l_fin > 0.0
        inv = cutlass.Float32(0.0)
        lse2 = -cutlass.Float32.inf
        if has_keys:
            inv = (1.0 / self.p_scale) / l_fin
            lse2 = m_fin + cute.math.log2(l_fin, fastmath=False)
        if item.n_splits == 1:
            inv = inv * kscale
        valid_row = r < self.rows
        r_safe = cutlass.min(r, self.rows - 1)  # addresses only; padded rows store nothing
        tok, h = self.output.final_index(item.b, r_safe)
        part = self.output.partial_index(item.w, r_safe)
        n_chunks = cute.size(tTR_c, mode=[2])
        width = cute.size(rC)
        for n in cutlass.range_constexpr(D_TILES):
            src = thr_ld.partition_S(tOtO[((None, None), 0, 0, n)])
            for q in cutlass.range_constexpr(n_chunks):
                if item.n_tiles > 0:  # uniform: the whole pair has no key otherwise
                    cute.copy(tiled_ld, src[(None, None, q)], rC)
                    cute.arch.fence_view_async_tmem_load()
                col0 = n * D_TILE + tTR_c[(0, 0, q)][1]
                if item.n_splits == 1:
                    rOut = cute.make_rmem_tensor(cute.make_layout(width), self.out_dtype)
                    for i in cutlass.range_constexpr(width):
                        o = cutlass.Float32(0.0)
                        if has_keys:
                            o = rC[i] * inv
                        rOut[i] = o.to(self.out_dtype)
                    if valid_row:
                        cute.autovec_copy(rOut, cute.local_tile(mOut[(tok, h, None)], (width,), (col0 // width,)))
                else:
                    rPart = cute.make_rmem_tensor(cute.make_layout(width), cutlass.Float32)
                    for i in cutlass.range_constexpr(width):
                        o = cutlass.Float32(0.0)
                        if has_keys:
                            o = rC[i] * inv
                        rPart[i] = o
                    if valid_row:
                        cute.autovec_copy(rPart, cute.local_tile(mPartO[(part, None)], (width,), (col0 // width,)))
        if valid_row and ctid < CTA_ROWS:
            if item.n_splits == 1:
                mLse[(tok, h)] = lse2 * LN2
            else:
                mPartLse[part] = lse2


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One CTA's share of a work item: request b (b1 = b + 1, 0 past the schedule's end), its length and splits,
    the item's KV range and tiles, the partial slot w, the pair's m-block and this CTA's rank in the pair."""

    b1: Any
    b: Any
    seq_len: Any
    n_splits: Any
    kv_start: Any
    kv_end: Any
    n_tiles: Any
    w: Any
    mblk: Any
    rank: Any


@dataclasses.dataclass(frozen=True)
class VTma:
    """The V loads: full boxes, and the 8- and 1-key boxes of a straddling slice (atom, smem and gmem views)."""

    tma_v: Any
    tVs: Any
    tVg: Any
    tma_v8: Any
    tV8s: Any
    tV8g: Any
    tma_v1: Any
    tV1s: Any
    tV1g: Any


@dataclasses.dataclass(frozen=True)
class Sm100Pipes:
    """The kernel's six pipelines (see make_pipelines). Frozen: the DSL passes it through dynamic loops as is."""

    q: Any
    kv: Any
    s: Any
    p: Any
    cor: Any
    o: Any


def tmem_load_copy(mma, tile_mn):
    """The 32x32b, 32-column TMEM load of one accumulator tile (``tile_mn`` of the pair): thread t of a warp
    group reads TMEM lane t."""
    acc = mma.make_fragment_C(mma.partition_shape_C(tile_mn))
    atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), cutlass.Float32)
    return tcgen05.make_tmem_copy(atom, acc[((None, None), 0, 0)])


def check_tmem_lane_map(qk_mma, pv_mma) -> None:
    """At trace time: the softmax and correction warps rely on data-path layout B: thread t holds row t % 64 of
    its CTA and the columns 64 (t // 64) .. (S, 128 keys) or 128 (t // 64) .. (an O tile of 256 columns), in
    ascending order, 32 per load. Checked on the tiled copies the kernel uses, for every thread."""
    for mma, cols in ((qk_mma, BLOCK_N), (pv_mma, D_TILE)):
        tiled = tmem_load_copy(mma, (BLOCK_M, cols))
        coords = cute.make_identity_tensor((CTA_ROWS, cols))
        half = cols // 2
        for t in range(SOFTMAX_THREADS):
            c = tiled.get_slice(t).partition_D(coords)
            for q in range(half // 32):
                for i in (0, 31):
                    got = c[(i, 0, q)]
                    want = (t % CTA_ROWS, half * (t // CTA_ROWS) + 32 * q + i)
                    if tuple(got) != want:
                        raise ValueError(f"TMEM lane map: thread {t} value {i} of chunk {q} holds {got}, "
                                         f"the kernel assumes {want}")


def check_shared_bytes(struct_bytes: int, planned: int) -> None:
    """At trace time: config.py's budget (what the CPU tests hold to the limit) is the struct the kernel gets."""
    if struct_bytes != planned:
        raise ValueError(f"shared storage is {struct_bytes} B but config.dynamic_shared_bytes plans {planned} B")


def check_same_size(k_layout, v_layout) -> None:
    if cute.cosize(k_layout) != cute.cosize(v_layout):
        raise ValueError("K and V ring stages must be the same size (one ring)")


def check_same_bytes(what: str, mma_layout, view, mn: int, k: int, stages: int) -> None:
    """At trace time: the (mn, k, stage) view a thread store or a TMA box uses must address the same bytes as
    the MMA-shaped layout the smem descriptor is built from (same swizzle, same offset for every element), or
    the kernel would silently multiply the wrong numbers."""
    if str(mma_layout.inner) != str(view.inner):
        raise ValueError(f"{what}: swizzle {mma_layout.inner} of the MMA layout != {view.inner} of the view")
    shape0 = mma_layout.outer.shape[0]
    mn_atom = cute.size(shape0[0])
    k_atom = cute.size(shape0[1])
    for s in sorted({0, stages - 1}):
        for x in range(0, mn, 7):
            for y in range(0, k, 5):
                coord = ((x % mn_atom, y % k_atom), x // mn_atom, y // k_atom, s)
                a = cute.crd2idx(coord, mma_layout.outer)
                b = cute.crd2idx((x, y, s), view.outer)
                if a != b:
                    raise ValueError(f"{what}: element ({x}, {y}, stage {s}) is at {a} for the MMA but at {b} "
                                     "in the view")
