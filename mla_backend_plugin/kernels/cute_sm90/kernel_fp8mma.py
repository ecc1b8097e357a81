"""fp8 "design B" of the CuTe-DSL SM90 MLA decode kernel: fp8 e4m3 wgmma on an fp8 KV cache (sm_90a).

Same grid, split handling, softmax and epilogue as ``kernel.Sm90MlaDecode`` (design A, which widens the fp8
cache to bf16 in shared memory and runs bf16 wgmma); what differs:

* warp 0 of the producer warp group loads each 64-key x 576 fp8 tile with TMA straight from the paged cache
  (boxes of min(block_size, 64) rows x 64 bytes, 64B swizzle, page by page through the block table; no
  widening). The whole producer warp group then transposes V (the first 512 columns) into a separate
  K-major buffer V^T (512 x 64 keys) with 16-byte shared loads, byte permutes (prmt) and 4-byte stores,
  bank-conflict free on both sides (the thread -> (keys, columns) map and the order of each thread's loads
  and stores are chosen for that; the permutes absorb the order).
* Q (bf16) is quantised once per CTA to two e4m3 parts with a per-row scale s = 448 / max|q_row|:
  hi = e4m3(q s), lo = e4m3(q s - hi); S = (Q_hi + Q_lo) K^T / s (two fp8 SS wgmma per k-step of 32,
  m64n32k32, into one accumulator). An fp8 q is used as it is (one product, q_scale folded into the logit
  scale). Q_hi alone failed the LSE tolerance (0.165 against 0.05: docs/perf/cute_sm90_fp8.md).
* P is quantised to e4m3 as P * 256 (the 1/256 is folded into the output normalisation) and stored in
  shared memory; O += P V^T as fp8 SS wgmma m64n256k32 (each consumer group its 256 output columns).

Four mbarrier rings of STAGES slots (cute_common.barriers.MbarrierRing): full_k (TMA bytes), full_v (128
producer threads: V^T written), empty_k (256 consumer threads after Q K^T + 128 producer threads after the
transpose: the K tile may be overwritten), empty_v (256 consumer threads after P V: the V^T stage may be
overwritten). The consumers issue P V of tile j and Q K^T of tile j + 1 as one wgmma group.

Speed and accuracy against design A, and why Q_lo is needed: docs/perf/cute_sm90_fp8.md.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from mla_backend_plugin.kernels.cute_common.barriers import MbarrierRing, consumer_barrier
from mla_backend_plugin.kernels.cute_common.compat import LayoutEnum, SmemAllocator
from mla_backend_plugin.kernels.cute_common.epilogue import load_scales
from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_M, BLOCK_N, NUM_THREADS, P_SCALE_FP8, Variant
from mla_backend_plugin.kernels.cute_sm90.kernel import D_NOPE, D_QK, K_CHUNKS, Sm90MlaDecode

F8 = cutlass.Float8E4M3FN
STAGES = 2  # K and V^T rings (a third K stage, in the room a one-part Q leaves, was slower: docs/perf/cute_sm90_fp8.md)
REGS_CONSUMER_B = 216
REGS_PRODUCER_B = 72  # 2 x 216 + 72 = 504 = 65536 / 384 rounded down to 8: setmaxnreg.inc waits forever past that
P_SCALE = P_SCALE_FP8  # P is stored as e4m3(P * 256): probabilities down to 2^-14 stay normal
Q_FP8_TARGET = 448.0  # per-row q scale: max |q_row| -> 448 (e4m3 max)
K_STAGE_BYTES = BLOCK_N * D_QK  # 36864
VT_STAGE_BYTES = D_NOPE * BLOCK_N  # 32768


# ---------------------------------------------------------------------------------------------------------
# raw shared-memory access and byte permutes (the V transpose)
# ---------------------------------------------------------------------------------------------------------
@dsl_user_op
def _lds128(addr, *, loc=None, ip=None):
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()]),
        [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _sts32(addr, val, *, loc=None, ip=None):
    llvm.inline_asm(
        None,
        [cutlass.Int32(addr).ir_value(loc=loc, ip=ip), cutlass.Int32(val).ir_value(loc=loc, ip=ip)],
        "st.shared.b32 [$0], $1;", "r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _prmt(a, b, sel, *, loc=None, ip=None):
    return cutlass.Int32(llvm.inline_asm(
        T.i32(),
        [cutlass.Int32(a).ir_value(loc=loc, ip=ip), cutlass.Int32(b).ir_value(loc=loc, ip=ip),
         cutlass.Int32(sel).ir_value(loc=loc, ip=ip)],
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dataclasses.dataclass(frozen=True)
class Fp8Rings:
    full_k: MbarrierRing  # TMA landed the K tile (expect-tx bytes)
    full_v: MbarrierRing  # the producer warp group wrote V^T
    empty_k: MbarrierRing  # consumers (Q K^T) and producers (transpose) are done with the K tile
    empty_v: MbarrierRing  # consumers (P V) are done with the V^T stage


class Sm90MlaDecodeFp8Mma(Sm90MlaDecode):
    """Design B: fp8 wgmma for both products (fp8 KV cache only)."""

    def __init__(self, variant: Variant, use_pdl: bool = True):
        super().__init__(variant, use_pdl)
        if variant.kv_dtype != "fp8":
            raise ValueError("design B is for fp8 caches only")
        self.q_fp8 = variant.q_dtype == "fp8"
        # an fp8 q is exact in e4m3: one product, no lo part
        self.q_parts = 1 if self.q_fp8 else 2

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
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        # S = Q K^T: group 1 keys 0..31 of the tile, group 2 keys 32..63 (m64n32k32 e4m3 x e4m3)
        qk_mma = sm90_utils.make_trivial_tiled_mma(F8, F8, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 2, 1),
                                                   (BLOCK_M, BLOCK_N // 2))
        # O += P V: group 1 output columns 0..255, group 2 256..511 (m64n256k32, V^T K-major)
        pv_mma = sm90_utils.make_trivial_tiled_mma(F8, F8, K_MAJOR, K_MAJOR, cutlass.Float32, (1, 2, 1),
                                                   (BLOCK_M, D_NOPE // 2))
        # Q: "stage" 0 = hi, 1 = lo (64 x 576 e4m3 each, 64B swizzle)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), F8,
                                                 self.q_parts)
        p_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N), F8, 1)
        # K tile (64 keys x 576, K-major, 64B swizzle: 64-column chunks of 4 KB): byte (key n, column c) of
        # stage s at s * 36864 + (c // 64) * 4096 + n * 64 + (c % 64), 16-byte unit ^= (n >> 1) & 3
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), F8,
                                                 STAGES)
        # V^T (512 columns x 64 keys, K-major, 64B swizzle): byte (column d, key k) of stage s at
        # s * 32768 + d * 64 + k, 16-byte unit ^= (d >> 1) & 3
        vt_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, D_NOPE, BLOCK_N), F8,
                                                  STAGES)

        tma_atom, tma_tensor = self.fp8_kv_tma(mKV)

        @cute.struct
        class SharedStorage:
            full_k: cute.struct.MemRange[cutlass.Int64, STAGES]
            full_v: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty_k: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty_v: cute.struct.MemRange[cutlass.Int64, STAGES]
            row_max_x: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            row_sum_x: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            q_rscale: cute.struct.MemRange[cutlass.Float32, BLOCK_M]
            sP: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(p_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(q_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(k_layout)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(vt_layout)], 1024]

        self.shared_storage = SharedStorage
        m_blocks = (self.rows + BLOCK_M - 1) // BLOCK_M
        self.kernel_b(qk_mma, pv_mma, tma_atom, tma_tensor, mQn, mQp, mKV, mBT, mSeq, mRowKv, mOut, mLse, mPartO,
                      mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, mWork, mCombineCtr,
                      fuse_combine, q_layout, k_layout, vt_layout,
                      p_layout).launch(
            grid=(m_blocks, grid_items, 1), block=[NUM_THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1, use_pdl=self.use_pdl)

    def fp8_kv_tma(self, mKV: cute.Tensor):
        """(Traced from ``__call__``.) The TMA atom and coordinate tensor of the fp8 cache: boxes of box_rows
        tokens x 64 bytes of one page, 64-byte swizzle."""
        g_kv = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        box_layout = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, F8),
            (self.box_rows, 64), order=(0, 1))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), g_kv, box_layout, (self.box_rows, 64))

    # ------------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel_b(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_atom, tma_tensor, mQn: cute.Tensor,
                 mQp: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor, mRowKv: cute.Tensor,
                 mOut: cute.Tensor,
                 mLse: cute.Tensor, mPartO: cute.Tensor, mPartLse: cute.Tensor, mQScale: cute.Tensor,
                 mKVScale: cute.Tensor, q_scale: cutlass.Float32, kv_scale: cutlass.Float32,
                 sm_scale_log2: cutlass.Float32, mWork: cute.Tensor, mCombineCtr: cute.Tensor,
                 fuse_combine: cutlass.Int32, q_layout: cute.ComposedLayout,
                 k_layout: cute.ComposedLayout, vt_layout: cute.ComposedLayout,
                 p_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        mblk, w, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sVt = storage.sVt.get_tensor(vt_layout.outer, swizzle=vt_layout.inner)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sMaxX = storage.row_max_x.get_tensor(cute.make_layout(2 * BLOCK_M))
        sSumX = storage.row_sum_x.get_tensor(cute.make_layout(2 * BLOCK_M))
        sQs = storage.q_rscale.get_tensor(cute.make_layout(BLOCK_M))
        rings = Fp8Rings(full_k=MbarrierRing(storage.full_k.data_ptr(), STAGES, 1),
                         full_v=MbarrierRing(storage.full_v.data_ptr(), STAGES, 128),
                         empty_k=MbarrierRing(storage.empty_k.data_ptr(), STAGES, 384),
                         empty_v=MbarrierRing(storage.empty_v.data_ptr(), STAGES, 256))

        if tidx == 0:
            rings.full_k.init()
            rings.full_v.init()
            rings.empty_k.init()
            rings.empty_v.init()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)

        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()

        b1, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, slot = self.scheduler.read_item(mWork, w)
        if b1 > 0:  # else: past the end of the schedule
            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER_B)
                self.produce_b(tma_atom, tma_tensor, sK, sVt, rings, mKV, mBT, b, kv_start, kv_end, n_tiles,
                               tidx, warp_idx)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER_B)
                self.consume_b(qk_mma, pv_mma, rings, sQ, sK, sVt, sP, sMaxX, sSumX, sQs, storage.sQ.data_ptr(), mQn,
                               mQp, mRowKv, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale,
                               sm_scale_log2, n_splits, b, mblk, slot, seq_len, kv_start, kv_end, n_tiles, tidx - 128)
                if fuse_combine != 0 and n_splits > 1:
                    self.combine_in_kernel(mCombineCtr, mPartO, mPartLse, mOut, mLse, mQScale, mKVScale, q_scale,
                                           kv_scale, b, mblk, slot0, n_splits, fuse_combine, tidx - 128,
                                           storage.sQ.data_ptr())
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def issue_tma(self, tma_atom, tKg, tKs, rings, mBT, num_blocks, b, kv_start, kv_end, j):
        """Warp 0: wait until tile j's stage (j modulo the ring's stages) is free, then load tile j (64 keys) into
        it, page slice by slice (``rings``: anything with ``full_k`` and ``empty_k`` rings, as design C's)."""
        tile_start = kv_start + j * BLOCK_N
        first_page = self.page_of(mBT, b, tile_start, kv_end, num_blocks)
        rings.empty_k.wait_released(j)
        with cute.arch.elect_one():
            rings.full_k.arrive_expect_tx(j, K_STAGE_BYTES)
        self.tma_tile(tma_atom, tKg, tKs, mBT, b, tile_start, kv_end, num_blocks, first_page,
                      j % rings.full_k.stages, rings.full_k.slot(j), 0, K_CHUNKS)

    @cute.jit
    def tma_partitions(self, tma_atom, tma_tensor, sK):
        """The TMA views of the K ring (boxes of box_rows x 64 bytes) and of the cache, for ``issue_tma``."""
        rb = self.box_rows
        s_boxes = cute.flat_divide(sK, (rb, 64))
        g_boxes = cute.flat_divide(tma_tensor, (rb, 64))
        return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(s_boxes, 0, 2),
                                     cute.group_modes(g_boxes, 0, 2))

    @cute.jit
    def produce_b(self, tma_atom, tma_tensor, sK, sVt, rings, mKV, mBT, b, kv_start, kv_end, n_tiles, tidx,
                  warp_idx):
        tKs, tKg = self.tma_partitions(tma_atom, tma_tensor, sK)
        num_blocks = mKV.shape[0]

        # ---- transpose map (see the module docstring). Lane bits: b0 -> which of two adjacent 16-column
        # units, b1..b4 -> key group g (keys 4g..4g+3). Each warp covers 2 units x 64 keys per step, 4 steps
        # per tile (warp w: units 8w..8w+7 = columns 128w..128w+127).
        lane = tidx % 32
        wq = tidx // 32
        b0 = lane & 1
        g = lane >> 1
        q = (g >> 1) & 1  # keys are read in the order i ^ q (quarter warps hit both row parities)
        sel_lo = cutlass.Int32(0x5140)
        sel_hi = cutlass.Int32(0x7362)
        if q == 1:
            sel_lo = cutlass.Int32(0x1504)
            sel_hi = cutlass.Int32(0x3726)
        sel_e = cutlass.Int32(0x5410)  # columns are stored in the order jj ^ b0 (both row parities per warp)
        sel_o = cutlass.Int32(0x7632)
        if b0 == 1:
            sel_e = cutlass.Int32(0x7632)
            sel_o = cutlass.Int32(0x5410)
        k_base = sK.iterator.toint()
        vt_base = sVt.iterator.toint()
        # per-thread read offsets of the 4 keys (for unit parity; the XOR by the unit is applied per step)
        keys = [4 * g + (q ^ i) for i in range(4)]

        if warp_idx == 0:
            if n_tiles > 0:
                self.issue_tma(tma_atom, tKg, tKs, rings, mBT, num_blocks, b, kv_start, kv_end, 0)
        for j in cutlass.range(n_tiles, unroll=1):
            s = j % STAGES
            if warp_idx == 0:
                if j + 1 < n_tiles:
                    self.issue_tma(tma_atom, tKg, tKs, rings, mBT, num_blocks, b, kv_start, kv_end, j + 1)
            rings.empty_v.wait_released(j)  # V^T stage free (P V of tile j - 2 done)
            rings.full_k.wait_filled(j)  # K tile landed
            kst = k_base + s * K_STAGE_BYTES
            vst = vt_base + s * VT_STAGE_BYTES
            # keys past the item's end: TMA loaded whole page slices, so the last page's slots past seq_len
            # (NaN possible) are in the K tile; P is 0 there but 0 x NaN = NaN, so V^T gets zeros for them
            valid = kv_end - (kv_start + j * BLOCK_N)
            if valid >= BLOCK_N:
                self.transpose_v(kst, vst, keys, wq, b0, g, sel_lo, sel_hi, sel_e, sel_o, valid, False)
            else:
                self.transpose_v(kst, vst, keys, wq, b0, g, sel_lo, sel_hi, sel_e, sel_o, valid, True)
            # V^T stores (generic proxy) must be visible to wgmma (async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            rings.full_v.arrive(j)
            rings.empty_k.arrive(j)

    @cute.jit
    def transpose_v(self, kst, vst, keys, wq, b0, g, sel_lo, sel_hi, sel_e, sel_o, valid,
                    masked: cutlass.Constexpr):
        """This thread's share of V^T for one tile (see the map in produce_b): 4 units x 4 keys x 16 columns.
        ``masked``: keys >= ``valid`` are written as zeros (only the tile that holds the item's end)."""
        for t in cutlass.range_constexpr(4):
            u = wq * 8 + 2 * t + b0  # 16-column unit 0..31
            c = u >> 2
            uu = u & 3
            words = []
            for i in cutlass.range_constexpr(4):
                k = keys[i]
                addr = kst + c * 4096 + k * 64 + ((uu ^ ((k >> 1) & 3)) << 4)
                w4 = _lds128(addr)
                if cutlass.const_expr(masked):
                    keep = 0 - cutlass.Int32(k < valid)  # all ones for a key inside the item, else 0
                    w4 = [x & keep for x in w4]
                words.append(w4)
            for wi in cutlass.range_constexpr(4):
                lo_ab = _prmt(words[0][wi], words[1][wi], sel_lo)
                hi_ab = _prmt(words[0][wi], words[1][wi], sel_hi)
                lo_cd = _prmt(words[2][wi], words[3][wi], sel_lo)
                hi_cd = _prmt(words[2][wi], words[3][wi], sel_hi)
                outs = (_prmt(lo_ab, lo_cd, sel_e), _prmt(lo_ab, lo_cd, sel_o),
                        _prmt(hi_ab, hi_cd, sel_e), _prmt(hi_ab, hi_cd, sel_o))
                for jj in cutlass.range_constexpr(4):
                    d = u * 16 + 4 * wi + (jj ^ b0)
                    x = ((4 * wi + jj) >> 1) & 3  # == (d >> 1) & 3
                    addr = vst + d * 64 + (((g >> 2) ^ x) << 4) + (g & 3) * 4
                    _sts32(addr, outs[jj])

    @cute.jit
    def issue_pv(self, pv_mma, acc_o, tOrP, tOrV, rings, pv_steps: cutlass.Constexpr, j):
        """O += P_j V_j once the producer wrote V^T of tile j (P_j is in shared memory: barrier C)."""
        rings.full_v.wait_filled(j)
        for k in cutlass.range_constexpr(pv_steps):
            cute.gemm(pv_mma, acc_o, tOrP[(None, None, k, 0)], tOrV[(None, None, k, j % STAGES)], acc_o)

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def load_q(self, sQ, sQs, mQn, mQp, b, mblk, ctid):
        """Q (64 rows x 576) -> e4m3 hi (+ lo) in shared memory, 4 threads per row; sQs[row] = 1 / s."""
        H = self.v.num_heads
        QL = self.v.q_len
        row = ctid // 4
        part = ctid % 4
        r = mblk * BLOCK_M + row
        tok = b * QL + r // H
        h = r % H
        valid = r < self.rows
        if cutlass.const_expr(self.q_fp8):
            for i in cutlass.range_constexpr(18):
                c8 = part * 18 + i
                dst = cute.local_tile(sQ[(row, None, 0)], (8,), (c8,))
                if valid:
                    if c8 < D_NOPE // 8:
                        dst.store(cute.local_tile(mQn[(tok, h, None)], (8,), (c8,)).load())
                    else:
                        dst.store(cute.local_tile(mQp[(tok, h, None)], (8,), (c8 - D_NOPE // 8,)).load())
                else:
                    dst.store(cute.zeros_like(dst.load()))
            if part == 0:
                sQs[row] = 1.0
        else:
            amax = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(18):
                c8 = part * 18 + i
                x = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                x.fill(0.0)
                if valid:
                    if c8 < D_NOPE // 8:
                        x.store(cute.local_tile(mQn[(tok, h, None)], (8,), (c8,)).load().to(cutlass.Float32))
                    else:
                        x.store(cute.local_tile(mQp[(tok, h, None)], (8,), (c8 - D_NOPE // 8,)).load().to(
                            cutlass.Float32))
                for e in cutlass.range_constexpr(8):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(x[e], -x[e]))
            amax = cute.arch.warp_reduction_max(amax, threads_in_group=4)
            sc = cutlass.Float32(1.0)
            if amax > 0.0:
                sc = Q_FP8_TARGET / amax
            for i in cutlass.range_constexpr(18):
                c8 = part * 18 + i
                dst_hi = cute.local_tile(sQ[(row, None, 0)], (8,), (c8,))
                y = cute.make_rmem_tensor(cute.make_layout(8), cutlass.Float32)
                y.fill(0.0)
                if valid:
                    if c8 < D_NOPE // 8:
                        y.store(cute.local_tile(mQn[(tok, h, None)], (8,), (c8,)).load().to(cutlass.Float32))
                    else:
                        y.store(cute.local_tile(mQp[(tok, h, None)], (8,), (c8 - D_NOPE // 8,)).load().to(
                            cutlass.Float32))
                yv = y.load() * sc
                hi = yv.to(F8)
                dst_hi.store(hi)
                if cutlass.const_expr(self.q_parts == 2):
                    dst_lo = cute.local_tile(sQ[(row, None, 1)], (8,), (c8,))
                    dst_lo.store((yv - hi.to(cutlass.Float32)).to(F8))
            if part == 0:
                sQs[row] = 1.0 / sc
        cute.arch.fence_proxy("async.shared", space="cta")
        consumer_barrier()

    @cute.jit
    def consume_b(self, qk_mma, pv_mma, rings, sQ, sK, sVt, sP, sMaxX, sSumX, sQs, stage_ptr, mQn, mQp, mRowKv,
                  mOut, mLse,
                  mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits, b, mblk, slot,
                  seq_len, kv_start, kv_end, n_tiles, ctid):
        grp = ctid // 128

        self.load_q(sQ, sQs, mQn, mQp, b, mblk, ctid)

        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        scale_log2 = sm_scale_log2 * kscale
        if cutlass.const_expr(self.q_fp8):
            scale_log2 = scale_log2 * qscale

        qk_thr = qk_mma.get_slice(ctid)
        pv_thr = pv_mma.get_slice(ctid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        tOrP = pv_thr.make_fragment_A(pv_thr.partition_A(sP))
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sVt))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((BLOCK_M, D_NOPE)))
        acc_o.fill(0.0)
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((BLOCK_M, BLOCK_N)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))
        tSsP = qk_thr.partition_C(sP[(None, None, 0)])
        k_steps = cute.size(tSrQ, mode=[2])
        pv_steps = cute.size(tOrP, mode=[2])

        row_max, row_sum, row_limit, row_scale = self.row_state(mRowKv, b, mblk, tScS, seq_len, kv_end,
                                                                scale_log2, sQs)
        lane = ctid % 32

        # Step i issues P V of tile i - 1 and Q K^T of tile i back to back and waits for both (one wgmma
        # round trip per tile instead of two; acc_s is free once the softmax of tile i - 1 stored P), then
        # runs the softmax of tile i. Steps 0 and n_tiles are the half-steps (no P V / no Q K^T); an item with
        # no tiles (a request of length 0) takes no step.
        # (Each branch commits its own group: ptxas fills a commit after the join with a dummy HGMMA.)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)  # here: set inside a branch, the DSL loses the value
        n_steps = n_tiles + cutlass.Int32(n_tiles > 0)
        for i in cutlass.range(n_steps, unroll=1):
            warpgroup.fence()
            if i < n_tiles:
                if i > 0:
                    self.issue_pv(pv_mma, acc_o, tOrP, tOrV, rings, pv_steps, i - 1)
                rings.full_k.wait_filled(i)
                for qp in cutlass.range_constexpr(self.q_parts):
                    for k in cutlass.range_constexpr(k_steps):
                        qk_mma.set(warpgroup.Field.ACCUMULATE, qp != 0 or k != 0)
                        cute.gemm(qk_mma, acc_s, tSrQ[(None, None, k, qp)],
                                  tSrK[(None, None, k, i % STAGES)], acc_s)
                warpgroup.commit_group()
            else:
                self.issue_pv(pv_mma, acc_o, tOrP, tOrV, rings, pv_steps, i - 1)
                warpgroup.commit_group()
            warpgroup.wait_group(0)
            if i > 0:
                rings.empty_v.arrive(i - 1)
            if i < n_tiles:
                rings.empty_k.arrive(i)  # this thread is done with the K tile
                # barrier A inside: both groups retired P_{i-1} V_{i-1} before either overwrites P
                self.softmax_step(acc_s, acc_o, tScS, tSsP, row_max, row_sum, row_limit, row_scale, sMaxX, grp,
                                  lane, kv_start + i * BLOCK_N, F8, P_SCALE)

        # O carries the P scale
        self.store_result(acc_o, row_max, row_sum, tScS, pv_thr, sSumX, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                          mPartLse, kscale, 1.0 / P_SCALE, n_splits, b, mblk, slot)
