"""CuTe-DSL MLA decode for Hopper, 16-bit caches, staggered ("seesaw") schedule (sm_90a).

Same grid, work items, Q load, masking and epilogue as ``kernel.Sm90MlaDecode`` (the lock-step schedule); what
differs is who computes what, so one consumer group's softmax runs while the other group's wgmmas keep the
tensor cores busy (the design FlashMLA's SM90 decode uses; docs/design/cute_sm90_v4.md):

* Tiles come in pairs: tile A = 2i in stage 0, tile B = 2i + 1 in stage 1 (a split with an odd tile count gets
  a last tile B past its end, which TMA fills with zeros and the mask removes).
* The left group (warp group 1) owns output columns 0..255 and computes S_A = Q K_A^T over the whole 64-key
  tile; the right group (warp group 2) owns columns 256..511 and computes S_B. Both share one running row
  maximum: left posts m_A (``SCALE_A``), right folds S_B in and posts m_B (``SCALE_B``).
* Each group multiplies its own P by its half of V straight from registers (RS wgmma) and the other group's P
  from shared memory (SS): left writes P_A (already rescaled to m_B) to sP0, right writes P_B to sP1
  (``P_FULL``). sP1 is the shared memory of Q's rope chunk, which both groups keep in registers.
* The three meeting points are full two-sided barriers (``bar.sync`` by both groups), each placed where the
  group that arrives first has already issued its wgmmas, so the tensor cores stay busy while it waits. A
  one-sided ``bar.arrive`` would let that group run on, but compute-sanitizer's racecheck then reports
  hazards on the exchanged maxima (even across later full barriers), and the project keeps racecheck clean.
* Each stage is filled and released in halves: chunks 0-3 (left's V) and chunks 4-8 (right's V and the rope
  columns), one full and one empty mbarrier each. Left computes Q K^T over chunks 0-3 first, right over 4-8
  first, which is the order the halves free up, so the next tile's loads start before the current pair's
  last P V has finished. The producer loads a pair in the order A0-3, B4-8, A4-8, B0-3: every half it waits
  for is released by consumer work that needs no later load (no cycle, no deadlock).
* KV multicast (``Variant.kv_multicast``): the m-block CTAs 2k and 2k + 1 of a work item form a cluster; each
  producer loads the chunks of its rank's parity into both CTAs (TMA multicast), each consumer warp releases a half
  at both CTAs' empty barriers (16 arrivals) but for the split's last pair (which nobody refills, so no remote
  arrive can reach a CTA that has exited), and each CTA prefetches one tile of the next pair into L2.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from mla_backend_plugin.kernels.cute_common.barriers import MbarrierRing, Sm90DecodeBarrier, consumer_sync
from mla_backend_plugin.kernels.cute_common.compat import LayoutEnum, SmemAllocator
from mla_backend_plugin.kernels.cute_common.epilogue import load_scales
from mla_backend_plugin.kernels.cute_sm90.config import (
    BLOCK_M,
    BLOCK_N,
    KV_CLUSTER,
    NUM_THREADS,
    REGS_CONSUMER,
    REGS_PRODUCER_TMA,
    Variant,
)
from mla_backend_plugin.kernels.cute_sm90.kernel import (
    D_NOPE,
    D_QK,
    K_CHUNKS,
    Sm90MlaDecode,
    exp_base,
    moved_max,
    scale_mask_max,
)

# the halves of a stage: chunks [0, 4) (V columns 0..255) and [4, 9) (V columns 256..511 and the rope)
HALF_CHUNKS = ((0, 4), (4, K_CHUNKS))
# (tile of the pair, half) in the producer's order: A 0-3, B 4-8, A 4-8, B 0-3 (module docstring)
LOAD_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))
K_STEPS_PER_CHUNK = 4  # 64 columns / k16


class Sm90MlaDecodeSeesaw(Sm90MlaDecode):
    """The seesaw schedule for 16-bit caches (bf16 / fp16)."""

    def __init__(self, variant: Variant, use_pdl: bool = True):
        super().__init__(variant, use_pdl)
        if variant.kv_dtype == "fp8":
            raise ValueError("the seesaw schedule is for 16-bit caches (fp8 caches: kernel_fp8mma.py)")
        self.chunk_bytes = BLOCK_N * 64 * self.cdtype.width // 8  # one 64x64 chunk of a tile: 8 KB

    # ------------------------------------------------------------------------------------------------
    # host side
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
        RMEM = warpgroup.OperandSource.RMEM
        # S = Q K^T over a whole tile by one group (128 threads): Q from shared memory, and its rope chunk from
        # registers
        qk_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 1, 1),
                                                   (BLOCK_M, BLOCK_N))
        # a second copy for the k-steps that accumulate: each copy's ACCUMULATE field is set once, at the top of
        # the consumer (a set() inside a dynamic branch fails the DSL's dominance check)
        qk_acc_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 1, 1),
                                                       (BLOCK_M, BLOCK_N))
        qk_rs_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 1, 1),
                                                      (BLOCK_M, BLOCK_N), RMEM)
        # O += P V: two atoms along N, group 1 columns 0..255 and group 2 columns 256..511; P from the group's
        # registers (its own tile) or from shared memory (the other group's tile)
        pv_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, MN_MAJOR, cutlass.Float32, (1, 2, 1),
                                                   (BLOCK_M, D_NOPE // 2))
        pv_rs_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, K_MAJOR, MN_MAJOR, cutlass.Float32, (1, 2, 1),
                                                      (BLOCK_M, D_NOPE // 2), RMEM)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), cd, 1)
        # one 64x64 P tile (K-major, 128B swizzle): the same bytes as one 64-column chunk of Q
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N), cd, 1)
        kv_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), cd, 2)
        v_layout_one = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N), cd, 1)
        v_outer = cute.append(cute.select(v_layout_one.outer, mode=[0, 1]),
                              cute.make_layout(2, stride=BLOCK_N * D_QK))

        g_kv = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        box_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cd),
            (self.box_rows, 64), order=(0, 1))
        # with the KV multicast each box lands in both CTAs of the cluster (its mask names both): the atom keeps
        # the whole box, and each CTA issues every other chunk (produce)
        tma_op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if self.v.kv_multicast
                  else cpasync.CopyBulkTensorTileG2SOp())
        tma_atom, tma_tensor = cpasync.make_tiled_tma_atom(tma_op, g_kv, box_layout, (self.box_rows, 64))

        @cute.struct
        class SharedStorage:
            # full[stage][half] (TMA bytes), then empty[stage][half] (8 consumer warps)
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 8]
            # running row maxima after tile A / after tile B, one buffer per pair parity: a pair's write never
            # meets the previous pair's read of the same word
            max_a: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            max_b: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            row_sum_x: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            sP0: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(p_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(q_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[cd, cute.cosize(kv_layout)], 1024]

        self.shared_storage = SharedStorage
        m_blocks = (self.rows + BLOCK_M - 1) // BLOCK_M
        # the KV multicast pairs m-blocks 2k and 2k + 1 of a work item (adjacent in x) into one cluster
        cluster = {"cluster": (KV_CLUSTER, 1, 1)} if self.v.kv_multicast else {}
        self.kernel(qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, pv_rs_mma, tma_atom, tma_tensor, mQn, mQp, mKV, mBT, mSeq,
                    mRowKv, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2,
                    mWork, mCombineCtr, fuse_combine, q_layout, kv_layout,
                    p_layout,
                    v_layout_one.inner, v_outer).launch(
            grid=(m_blocks, grid_items, 1), block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1,
            use_pdl=self.use_pdl, **cluster)

    # ------------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, qk_acc_mma: cute.TiledMma, qk_rs_mma: cute.TiledMma, pv_mma: cute.TiledMma,
               pv_rs_mma: cute.TiledMma, tma_atom, tma_tensor, mQn: cute.Tensor, mQp: cute.Tensor,
               mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor, mRowKv: cute.Tensor, mOut: cute.Tensor,
               mLse: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor, mQScale: cute.Tensor,
               mKVScale: cute.Tensor, q_scale: cutlass.Float32, kv_scale: cutlass.Float32,
               sm_scale_log2: cutlass.Float32, mWork: cute.Tensor, mCombineCtr: cute.Tensor,
               fuse_combine: cutlass.Int32, q_layout: cute.ComposedLayout,
               kv_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout, v_swizzle, v_outer: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        mblk, w, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sKV = storage.sKV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sP0 = storage.sP0.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        # sP1 = Q's rope chunk (chunk 8, 1 KB-aligned), free once both groups hold it in registers
        sP1 = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr() + (K_CHUNKS - 1) * BLOCK_M * 64,
                                               p_layout.inner), p_layout.outer)
        sMaxA = storage.max_a.get_tensor(cute.make_layout(2 * BLOCK_M))
        sMaxB = storage.max_b.get_tensor(cute.make_layout(2 * BLOCK_M))
        sSumX = storage.row_sum_x.get_tensor(cute.make_layout(2 * BLOCK_M))
        sV = cute.make_tensor(cute.recast_ptr(sKV.iterator, v_swizzle), v_outer)
        bars = storage.kv_mbar.data_ptr()
        # one use per pair of tiles: ring of 1 slot, use i = pair i. With the KV multicast a stage's half is
        # written into both CTAs by both producers, so it may be refilled only once the consumer warps of both
        # CTAs released it: 16 arrivals (each warp arrives here and at the peer's barrier)
        mc = self.v.kv_multicast
        full = [[MbarrierRing(bars + 2 * s + h, 1, 1) for h in range(2)] for s in range(2)]
        empty = [[MbarrierRing(bars + 4 + 2 * s + h, 1, 8 * (KV_CLUSTER if mc else 1)) for h in range(2)]
                 for s in range(2)]
        rank = 0
        if cutlass.const_expr(mc):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        if tidx == 0:
            for s in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    full[s][h].init()
                    empty[s][h].init()
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(mc):
            # the peer's first loads and releases reach this CTA's barriers only once they are initialised
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)

        # everything below may read what the previous kernel in the stream wrote
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()

        b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, slot = self.scheduler.read_item(mWork, w)
        n_pairs = (n_tiles + 1) // 2
        if b1 > 0:  # else: past the end of the schedule
            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER_TMA)
                if warp_idx == 0:
                    self.produce(tma_atom, tma_tensor, sKV, full, empty, mKV, mBT, b, kv_start, kv_end, n_pairs,
                                 rank)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                self.consume_seesaw(qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, pv_rs_mma, full, empty, sQ, sKV, sV, sP0,
                                    sP1, sMaxA, sMaxB, sSumX, storage.sQ.data_ptr(), mQn, mQp, mRowKv, mOut, mLse,
                                    mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits, b,
                                    mblk, slot, seq_len, kv_start, kv_end, n_pairs, tidx - 128, wg - 1, rank)
                if fuse_combine != 0 and n_splits > 1:
                    self.combine_in_kernel(mCombineCtr, mPartO, mPartLse, mOut, mLse, mQScale, mKVScale, q_scale,
                                           kv_scale, b, mblk, slot0, n_splits, fuse_combine, tidx - 128,
                                           storage.sQ.data_ptr())
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom, tma_tensor, sKV, full, empty, mKV, mBT, b, kv_start, kv_end, n_pairs, rank):
        rb = self.box_rows
        s_boxes = cute.flat_divide(sKV, (rb, 64))
        g_boxes = cute.flat_divide(tma_tensor, (rb, 64))
        tKs, tKg = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s_boxes, 0, 2),
                                         cute.group_modes(g_boxes, 0, 2))
        num_blocks = mKV.shape[0]
        ahead = self.v.l2_prefetch
        for i in cutlass.range(n_pairs, unroll=1):
            # the order of the halves is what keeps the consumers' waits acyclic (module docstring)
            for n in cutlass.range_constexpr(4):
                tile_in_pair, h = LOAD_ORDER[n]
                self.load_half(tma_atom, tKg, tKs, full[tile_in_pair][h], empty[tile_in_pair][h], mBT,
                               num_blocks, b, kv_start, kv_end, 2 * i + tile_in_pair, i, tile_in_pair, h, rank)
            if cutlass.const_expr(ahead > 0):
                # pair i + ahead into L2 once pair i is issued (the pairs between at the first pair): HBM works
                # on the pairs the two-stage ring has no room for, and their TMA loads later read L2
                first = i + ahead
                if i == 0:
                    first = 1
                for pair in cutlass.range(first, i + ahead + 1, unroll=1):
                    if pair < n_pairs:
                        for t in cutlass.range_constexpr(2):
                            # with the KV multicast each CTA of the pair prefetches one tile of the pair
                            if not self.v.kv_multicast or rank == t:
                                self.prefetch_tile_l2(mKV, mBT, b, kv_start + (2 * pair + t) * BLOCK_N, kv_end,
                                                      num_blocks)

    @cute.jit
    def load_half(self, tma_atom, tKg, tKs, full, empty, mBT, num_blocks, b, kv_start, kv_end, tile, use,
                  stage: cutlass.Constexpr, half: cutlass.Constexpr, rank):
        """Half ``half`` of tile ``tile`` into ``stage`` once the consumers released the previous pair's (with
        the KV multicast: both CTAs' consumers). The full barrier expects the whole half's bytes, with the
        multicast half of them from the peer's loads (which may land before this arrive: the phase cannot
        complete before it, its one arrival)."""
        c0, c1 = HALF_CHUNKS[half]
        tile_start = kv_start + tile * BLOCK_N
        first_page = self.page_of(mBT, b, tile_start, kv_end, num_blocks)
        empty.wait_released(use)
        with cute.arch.elect_one():
            full.arrive_expect_tx(use, (c1 - c0) * self.chunk_bytes)
        self.tma_tile(tma_atom, tKg, tKs, mBT, b, tile_start, kv_end, num_blocks, first_page, stage, full.slot(use),
                      c0, c1, rank)

    @cute.jit
    def issue_qk_half(self, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, stage: cutlass.Constexpr,
                      half: cutlass.Constexpr, first: cutlass.Constexpr):
        """Issue (not wait for) the k-steps of S = Q K^T over one half of the tile in ``stage``; the rope chunk
        (the last) takes Q from registers. ``first``: this half starts the accumulation."""
        c0, c1 = HALF_CHUNKS[half]
        warpgroup.fence()
        for k in cutlass.range_constexpr(c0 * K_STEPS_PER_CHUNK, c1 * K_STEPS_PER_CHUNK):
            if cutlass.const_expr(k >= (K_CHUNKS - 1) * K_STEPS_PER_CHUNK):
                cute.gemm(qk_rs_mma, acc_s, tSrQreg[(None, None, k - (K_CHUNKS - 1) * K_STEPS_PER_CHUNK)],
                          tSrK[(None, None, k, stage)], acc_s)
            elif cutlass.const_expr(first and k == c0 * K_STEPS_PER_CHUNK):
                cute.gemm(qk_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
            else:
                cute.gemm(qk_acc_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def issue_qk_tile(self, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, full, use,
                      stage: cutlass.Constexpr, first_half: cutlass.Constexpr):
        """S over the whole tile of pair ``use`` in ``stage``: each half as soon as it has landed, ``first_half``
        first (the one its owner frees first)."""
        for n in cutlass.range_constexpr(2):
            half = first_half ^ n
            full[stage][half].wait_filled(use)
            self.issue_qk_half(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, stage, half, n == 0)

    @cute.jit
    def issue_pv(self, mma, acc_o, tOrP, tOrV, stage: cutlass.Constexpr, from_registers: cutlass.Constexpr):
        warpgroup.fence()
        for k in cutlass.range_constexpr(BLOCK_N // 16):
            if cutlass.const_expr(from_registers):
                cute.gemm(mma, acc_o, tOrP[(None, None, k)], tOrV[(None, None, k, stage)], acc_o)
            else:
                cute.gemm(mma, acc_o, tOrP[(None, None, k, 0)], tOrV[(None, None, k, stage)], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def release(self, ring, use, lane, peer, more):
        """One arrive per warp of a consumer group (the ring counts 8: both groups' warps). With the KV multicast
        the warp also arrives at the peer CTA's barrier (``peer``: its rank; the ring counts 16), unless this is
        the split's last pair (``more`` false): no producer waits for that release, and skipping it is what lets
        either CTA exit without waiting for the other (no remote arrive can reach a CTA that has left)."""
        # two flat ``lane == 0`` tests, not one nested under the other: the nested form made ptxas serialise every
        # wgmma of the kernel (docs/perf/cute_sm90_bf16.md, the KV multicast)
        if lane == 0:
            ring.arrive(use)
        if cutlass.const_expr(self.v.kv_multicast):
            if lane == 0 and more:
                ring.arrive_peer(use, peer)

    @cute.jit
    def consume_seesaw(self, qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, pv_rs_mma, full, empty, sQ, sKV, sV, sP0, sP1,
                       sMaxA, sMaxB, sSumX, stage_ptr, mQn, mQp, mRowKv, mOut, mLse, mPartO, mPartLse, mQScale,
                       mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits, b, mblk, slot, seq_len, kv_start, kv_end,
                       n_pairs, ctid, grp, rank):
        """``grp`` (warp-uniform, from make_warp_uniform): 0 = left (tiles A, output columns 0..255), 1 = right
        (tiles B, columns 256..511). ptxas must see the branch on it as uniform, or it serialises every wgmma
        (C7518, "WG.DP in divergent path")."""
        cd = self.cdtype
        gtid = ctid % 128
        lane = ctid % 32
        peer = rank ^ 1  # the other CTA of the cluster (read only with the KV multicast)

        qk_mma.set(warpgroup.Field.ACCUMULATE, False)
        qk_acc_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        self.load_q(sQ, mQn, mQp, b, mblk, ctid)
        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        scale_log2 = sm_scale_log2 * qscale * kscale

        qk_thr = qk_mma.get_slice(gtid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sKV))
        # Q's rope chunk as register A fragments (its shared memory becomes sP1)
        qk_rs_thr = qk_rs_mma.get_slice(gtid)
        tSsQ_rs = qk_rs_thr.partition_A(sQ)
        tSrQreg = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, K_STEPS_PER_CHUNK), stride=((1, 2, 4), 0, 8)),
                                        cd)
        for k in cutlass.range_constexpr(K_STEPS_PER_CHUNK):
            cute.autovec_copy(tSsQ_rs[(None, 0, (K_CHUNKS - 1) * K_STEPS_PER_CHUNK + k, 0)], tSrQreg[(None, 0, k)])
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((BLOCK_M, BLOCK_N)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))
        tSsP0 = qk_thr.partition_C(sP0[(None, None, 0)])
        tSsP1 = qk_thr.partition_C(sP1[(None, None, 0)])

        pv_thr = pv_mma.get_slice(ctid)
        tOrP0 = pv_thr.make_fragment_A(pv_thr.partition_A(sP0))
        tOrP1 = pv_thr.make_fragment_A(pv_thr.partition_A(sP1))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
        pv_rs_thr = pv_rs_mma.get_slice(ctid)
        tOrVrs = pv_rs_thr.make_fragment_B(pv_rs_thr.partition_B(sV))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((BLOCK_M, D_NOPE)))
        acc_o.fill(0.0)
        # this group's P as the A operand of P V: the S accumulator's 32 values in the same order (the C layout
        # of m64n64 and the A layout of four m64k16 steps hold the same (row, key) per value index)
        r_p = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, BLOCK_N // 16), stride=((1, 2, 4), 0, 8)), cd)

        # the running maximum (both groups), the sum over this group's keys, the key limit, per row
        row_max, row_sum, row_limit = self.row_state(mRowKv, b, mblk, tScS, seq_len, kv_end)

        if grp == 0:
            if n_pairs > 0:
                self.issue_qk_tile(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, full, 0, 0, 0)
            for i in cutlass.range(n_pairs, unroll=1):
                tile_start = kv_start + 2 * i * BLOCK_N
                more = i + 1 < n_pairs
                warpgroup.wait_group(0)  # S_A (and the previous pair's P_B V_B)
                self.zero_tail_v(sKV, 0, kv_end - tile_start, gtid)
                self.release(empty[0][1], i, lane, peer, more)  # tile A's chunks 4-8: read by S_A only
                self.release(empty[1][1], i, lane, peer, more)  # tile B's chunks 4-8: never read by this group
                m_a = self.scaled_row_max(acc_s, tScS, row_limit, scale_log2, tile_start)
                alpha = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
                m_use = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
                self.left_running_max(sMaxA, i, tScS, m_a, row_max, alpha, m_use, lane, self.v.max_slack)
                self.exp_and_sum(acc_s, r_p, row_sum, alpha, m_use)
                self.rescale_o(acc_o, alpha)
                self.issue_pv(pv_rs_mma, acc_o, r_p, tOrVrs, 0, True)
                consumer_sync(Sm90DecodeBarrier.SCALE_A)
                # m_B from the right group: P_A goes to it rescaled to m_B
                consumer_sync(Sm90DecodeBarrier.SCALE_B)
                self.left_p_at_right_max(sMaxB, i, tScS, m_a, row_max, alpha, acc_s, tSsP0)
                consumer_sync(Sm90DecodeBarrier.P_FULL)  # sP0 and sP1 written
                warpgroup.wait_group(0)  # P_A V_A,left
                self.release(empty[0][0], i, lane, peer, more)  # tile A's chunks 0-3: S_A and P_A V_A,left are done
                for half in cutlass.range_constexpr(2):
                    row_sum[half] = row_sum[half] * alpha[half]
                self.rescale_o(acc_o, alpha)
                self.issue_pv(pv_mma, acc_o, tOrP1, tOrV, 1, False)
                if i + 1 < n_pairs:
                    full[0][0].wait_filled(i + 1)
                    self.issue_qk_half(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, 0, 0, True)
                    warpgroup.wait_group(1)  # P_B V_B,left
                    self.release(empty[1][0], i, lane, peer, more)
                    full[0][1].wait_filled(i + 1)
                    self.issue_qk_half(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, 0, 1, False)
                else:
                    warpgroup.wait_group(0)
                    self.release(empty[1][0], i, lane, peer, more)
        else:
            if n_pairs > 0:
                self.issue_qk_tile(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, full, 0, 1, 1)
            for i in cutlass.range(n_pairs, unroll=1):
                tile_start = kv_start + (2 * i + 1) * BLOCK_N
                more = i + 1 < n_pairs
                warpgroup.wait_group(0)  # S_B (the previous pair's P V were retired at its end)
                self.zero_tail_v(sKV, 1, kv_end - tile_start, gtid)
                self.release(empty[1][0], i, lane, peer, more)  # tile B's chunks 0-3: read by S_B only here
                self.release(empty[0][0], i, lane, peer, more)  # tile A's chunks 0-3: never read by this group
                tile_max = self.scaled_row_max(acc_s, tScS, row_limit, scale_log2, tile_start)
                consumer_sync(Sm90DecodeBarrier.SCALE_A)
                self.right_softmax(sMaxA, sMaxB, i, tScS, tile_max, row_max, row_sum, acc_s, r_p, tSsP1, acc_o, lane)
                self.issue_pv(pv_rs_mma, acc_o, r_p, tOrVrs, 1, True)
                consumer_sync(Sm90DecodeBarrier.P_FULL)  # sP0 and sP1 written
                self.issue_pv(pv_mma, acc_o, tOrP0, tOrV, 0, False)
                warpgroup.wait_group(1)  # P_B V_B,right
                self.release(empty[1][1], i, lane, peer, more)
                warpgroup.wait_group(0)  # P_A V_A,right
                self.release(empty[0][1], i, lane, peer, more)
                if i + 1 < n_pairs:
                    self.issue_qk_tile(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, full, i + 1, 1, 1)

        self.store_result(acc_o, row_max, row_sum, tScS, pv_thr, sSumX, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                          mPartLse, kscale, 1.0, n_splits, b, mblk, slot)

    @cute.jit
    def scaled_row_max(self, acc_s, tScS, row_limit, scale_log2, tile_start):
        """Scale S into the log2 domain in place, mask keys past each row's limit (a NaN there becomes -inf
        too), and return the tile's row maxima (quad-reduced: the 4 threads of a row agree)."""
        m_loc = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        row_scale = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            m_loc[half] = -cutlass.Float32.inf
            row_scale[half] = scale_log2
        scale_mask_max(acc_s, tScS, row_scale, row_limit, tile_start, m_loc)
        for half in cutlass.range_constexpr(2):
            m_loc[half] = cute.arch.warp_reduction_max(m_loc[half], threads_in_group=4)
        return m_loc

    # The max exchange of the two groups, shared by the seesaw (pair i of tiles) and fp8 design C: the exchange
    # buffers hold one entry per row for each parity of i. Each writes its results into the
    # register tensors it is given (in place: what a nested jit call can hand back besides its return value).

    @cute.jit
    def left_running_max(self, sMaxA, i, tScS, m_a, row_max, alpha, m_use, lane, slack=0.0):
        """The left group, after its S: ``m_a`` holds its tile's row maxima and becomes m_A = max(running max,
        them), posted to ``sMaxA``; ``m_use`` its exp base, ``alpha`` the rescale of its O and l. ``slack`` > 0
        (log2 units): the running max stays where it is unless the tile's exceeds it by more than ``slack``
        (``moved_max``), so P may reach 2^slack and most tiles need no rescale."""
        for half in cutlass.range_constexpr(2):
            m = moved_max(row_max[half], m_a[half], slack)
            m_a[half] = m
            m_use[half] = exp_base(m)
            alpha[half] = cute.math.exp2(row_max[half] - m_use[half], fastmath=True)
            if lane % 4 == 0:
                sMaxA[(i % 2) * BLOCK_M + tScS[2 * half][0]] = m

    @cute.jit
    def right_softmax(self, sMaxA, sMaxB, i, tScS, tile_max, row_max, row_sum, acc_s, r_p, tSsP, acc_o, lane):
        """The right group, after ``SCALE_A``: m_B = max(m_A, its tile max) posted to ``sMaxB`` and kept as the
        running max; then, after ``SCALE_B``, its P = exp2(S - m_B) (``acc_s``, ``r_p``) into shared memory
        (``tSsP``) for the left group's P V, fenced, and its O and l rescaled by the left group's two factors
        (old max -> m_A -> m_B), computed from the same values."""
        alpha = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        m_use = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        self.right_running_max(sMaxA, sMaxB, i, tScS, tile_max, row_max, alpha, m_use, lane,
                               slack=self.v.max_slack)
        consumer_sync(Sm90DecodeBarrier.SCALE_B)
        self.exp_and_sum(acc_s, r_p, row_sum, alpha, m_use)
        cute.autovec_copy(r_p, tSsP)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.rescale_o(acc_o, alpha)

    @cute.jit
    def right_running_max(self, sMaxA, sMaxB, i, tScS, tile_max, row_max, alpha, m_use, lane, to_a=None, to_b=None,
                          slack=0.0):
        """The right group, after ``SCALE_A``: m_B = max(m_A, its tile max) posted to ``sMaxB`` and kept as the
        running max (``row_max``); ``m_use`` its exp base, ``alpha`` the rescale of its O and l by the left
        group's two factors (old max -> m_A -> m_B), also given one by one when ``to_a`` / ``to_b`` are."""
        for half in cutlass.range_constexpr(2):
            after_a = sMaxA[(i % 2) * BLOCK_M + tScS[2 * half][0]]
            mu_a = exp_base(after_a)
            m = moved_max(after_a, tile_max[half], slack)
            mu_b = exp_base(m)
            if lane % 4 == 0:
                sMaxB[(i % 2) * BLOCK_M + tScS[2 * half][0]] = m
            f_a = cute.math.exp2(row_max[half] - mu_a, fastmath=True)
            f_b = cute.math.exp2(after_a - mu_b, fastmath=True)
            alpha[half] = f_a * f_b
            if cutlass.const_expr(to_a is not None):
                to_a[half] = f_a
                to_b[half] = f_b
            m_use[half] = mu_b
            row_max[half] = m

    @cute.jit
    def left_factor_to_right_max(self, sMaxB, i, tScS, m_a, row_max, alpha):
        """The left group, after ``SCALE_B``: ``alpha`` = the factor from its m_A (``m_a``) to the right group's
        m_B, and ``row_max`` = m_B."""
        for half in cutlass.range_constexpr(2):
            m_b = sMaxB[(i % 2) * BLOCK_M + tScS[2 * half][0]]
            alpha[half] = cute.math.exp2(m_a[half] - exp_base(m_b), fastmath=True)
            row_max[half] = m_b

    @cute.jit
    def left_p_at_right_max(self, sMaxB, i, tScS, m_a, row_max, alpha, acc_s, tSsP):
        """The left group, after ``SCALE_B``: its P (fp32 in ``acc_s``) rescaled from m_A to the right group's m_B
        into shared memory (``tSsP``) for the right group's P V, fenced for the async proxy; ``alpha`` = that
        factor (for its own O and l), ``row_max`` = m_B."""
        self.left_factor_to_right_max(sMaxB, i, tScS, m_a, row_max, alpha)
        p_other = cute.make_rmem_tensor(acc_s.layout, self.cdtype)
        for v in cutlass.range_constexpr(cute.size(acc_s)):
            p_other[v] = (acc_s[v] * alpha[(v >> 1) & 1]).to(self.cdtype)
        cute.autovec_copy(p_other, tSsP)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def exp_and_sum(self, acc_s, r_p, row_sum, alpha, m_use):
        """P = exp2(S - m) (kept in fp32 in acc_s and as the compute dtype in r_p); l = l alpha + sum P."""
        for half in cutlass.range_constexpr(2):
            row_sum[half] = row_sum[half] * alpha[half]
        for v in cutlass.range_constexpr(cute.size(acc_s)):
            half = (v >> 1) & 1
            p = cute.math.exp2(acc_s[v] - m_use[half], fastmath=True)
            acc_s[v] = p
            row_sum[half] = row_sum[half] + p
            r_p[v] = p.to(self.cdtype)

    @cute.jit
    def rescale_o(self, acc_o, alpha):
        # once the running maxima settle (most tiles of a long sequence) alpha is exactly 1 for every row of
        # the warp: skip the 128 multiplies
        if cute.arch.vote_any_sync(alpha[0] != 1.0 or alpha[1] != 1.0):
            for v in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[v] = acc_o[v] * alpha[(v >> 1) & 1]

    @cute.jit
    def zero_tail_v(self, sKV, stage: cutlass.Constexpr, valid, gtid):
        """The owning group zeroes the V columns of keys >= ``valid`` (0 < valid < 64: the split's last tile
        ends inside it). TMA loads whole page slices, so those slots hold whatever the block held before, NaN
        included, and P = 0 times V = NaN is NaN in P V. Before either group's P V of the tile: the owner's
        fence follows, and the other group reads the tile after the owner's P*_FULL signal."""
        if valid < BLOCK_N:
            if valid > 0:
                chunks = D_NOPE // 8  # 16-byte pieces of a row's V
                for i in cutlass.range(gtid, (BLOCK_N - valid) * chunks, 128, unroll=1):
                    row = valid + i // chunks
                    dst = cute.local_tile(sKV[(row, None, stage)], (8,), (i % chunks,))
                    dst.store(cute.zeros_like(dst.load()))
                cute.arch.fence_proxy("async.shared", space="cta")
