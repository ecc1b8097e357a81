"""fp8 "design C" of the CuTe-DSL SM90 MLA decode (sm_90a): fp8 wgmma on the seesaw schedule, O^T = V^T P^T.

docs/design/sm90_decode_budget.md sections 2, 3 and 7 (C2). An fp8 q and an fp8 KV cache only
(``fp8_design="fp8seesaw"``; `auto`'s choice from launch.FP8_SEESAW_MIN_BATCH; docs/perf/cute_sm90_fp8.md). What it
shares:

* the seesaw's pair schedule (kernel_seesaw.py): the left group (warp group 1) computes S_A = Q K_A^T over the whole
  64-key tile A = 2i, the right group S_B for B = 2i + 1; the running row maxima meet through shared
  memory (``left_running_max``, ``right_running_max``) and both P tiles are in shared memory after P_FULL;
* design B's TMA producer (kernel_fp8mma.py ``issue_tma``, warp 0, boxes of min(block_size, 64) rows x 64 bytes,
  64-byte swizzle) and its fp8 Q load (``load_q``), and P as e4m3(256 P) (here the 256 enters the exp,
  exp2(s - (m - 8)), and leaves through the LSE).

What is new: no V^T buffer and no transpose. Each group computes its 256 latent columns transposed,
O^T[256 x 64 rows] += V^T[256 x 64 keys] P^T[64 keys x 64 rows], as 2 k-steps x 4 m-tiles of
``wgmma.m64n64k32.e4m3`` with V^T the **register** A operand, loaded from the K tile as TMA left it by
``ldmatrix.trans.x4`` (key rows, 16-bit pairs) + ``prmt`` (``load_vt``), and P^T the K-major shared-memory B
operand, stored by the softmax in the permuted key order those fragments need (``store_p_t``). The index
arithmetic is fp8seesaw_layout.py, which tests/test_cute_fp8seesaw_cpu.py emulates on the CPU. Each warp releases
a stage as soon as it has loaded its fragments (the wgmma reads registers), so 5 stages of 36 KB fit beside Q
(36 KB) and three 4 KB P^T tiles: sPA (P_A at m_A) and P_B at m_B in sP1 (Q's rope chunk, which both groups keep
in registers) for even pairs and sPB (right after Q) for odd ones: 232,448 bytes, the most a CTA may have.

Per pair i: the left group posts m_A (mbarrier ``m_a``: the right group waits for nothing else of it before
P_FULL), computes and writes P_A at m_A, rescales its O^T to m_A and issues P_A V_A; the right group, once m_A is
posted, posts m_B (``m_b``: the left group needs it only after its P_A V_A is issued), writes P_B at m_B, then
computes O = (O f_A + P_A V_A) f_B + P_B V_B (f_A: old max -> m_A, f_B: m_A -> m_B, each a factor per query row =
per O^T column, exchanged through shared memory, ``rescale_o_t``); the left group adds P_B V_B after rescaling to
m_B. The right group signals ``pa_free`` once its P_A V_A retired, before the left group overwrites sPA. With P_B
in two buffers (and the right group's factors in two sets) neither group waits for its previous P_B V_B before its
softmax: the wgmma runs on while the group computes its tile's max, P and P's stores, and is retired before the
group touches O^T or the fragment registers (the writes of pair i + 1 into pair i - 1's buffers follow P_FULL of
pair i, which both groups reach after that retirement). The
one-way signals are mbarriers completed by all 128 threads of the signalling group, and so is the left group's
own meeting before its P_A V_A (``left_p``): with named barriers of 128 threads for either (``bar.arrive`` /
``bar.sync``, a second thread count beside the consumers' 256), compute-sanitizer's racecheck reported hazards
across every later 256-thread consumer barrier of the epilogue, which no output ever showed and the bf16 seesaw and
design B (256-thread named barriers only) never got; with mbarriers it reports none (H100, 2026-11-28,
benchmarks/results/fp8seesaw_h100/racecheck).
Each P V loads and issues one k-step (16 fragment registers) at a time, with a wait between the two: 32
fragment registers next to O^T (128), S (32) and Q's rope (8) made ptxas serialise every wgmma (C7511) at 240
registers. Each group issues its next tile's S between its P_A V_A k-steps, so the S runs on the tensor pipe
while the groups exchange maxima and write P, and is done when the next pair starts. P_A V_A's first k-step
fragments are loaded before the group waits for P_A (``load_first_step``: they need the tile, not P), so the
loads and permutes run in the wait rather than after it.

Keys past the split's end (TMA loads whole page slices; NaN possible there) are masked in S and zeroed byte by
byte in the V^T fragments. The accumulator's O^T rows are latent columns in the order ``latent_of_row``; the
epilogue stages the tile in shared memory in natural order (values m and m + 8 of O^T are adjacent latent columns of
one row: one 4-byte store each, at immediate offsets from one base, ``stage_thread_base``) and reuses the common
stores.
"""

from __future__ import annotations

import dataclasses
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from mla_backend_plugin.kernels.cute_common.barriers import (
    MbarrierRing,
    Sm90DecodeBarrier,
    consumer_barrier,
    consumer_sync,
)
from mla_backend_plugin.kernels.cute_common.compat import LayoutEnum, SmemAllocator
from mla_backend_plugin.kernels.cute_common.epilogue import load_scales
from mla_backend_plugin.kernels.cute_sm90.config import (
    BLOCK_M,
    BLOCK_N,
    MAX_SLACK_FROM_PAIR,
    NUM_THREADS,
    REGS_CONSUMER_C,
    REGS_PRODUCER_C,
    STAGE_ROW,
    STAGES_C,
    p_scale_for,
)
from mla_backend_plugin.kernels.cute_sm90.fp8seesaw_layout import (
    CHUNK_BYTES,
    PRMT_HI,
    PRMT_LO,
    fragment_key,
    ldsm_immediate,
    ldsm_thread_base,
    ot_column_index,
    p_thread_base,
    p_value_terms,
    p_word_values,
    stage_thread_base,
    stage_value_offset,
)
from mla_backend_plugin.kernels.cute_sm90.kernel import D_NOPE, D_QK, K_CHUNKS
from mla_backend_plugin.kernels.cute_sm90.kernel_fp8mma import (
    F8,
    K_STAGE_BYTES,
    Sm90MlaDecodeFp8Mma,
    _prmt,
)
from mla_backend_plugin.kernels.cute_sm90.kernel_seesaw import Sm90MlaDecodeSeesaw
from mla_backend_plugin.ops.constants import WORK_ITEM_INTS

# tiles the producer issues before the consumers' Q has landed (produce_c)
Q_FIRST_TILES = 1
K_STEPS = D_QK // 32  # k-steps of S = Q K^T (m64n64k32)
ROPE_STEP = (K_CHUNKS - 1) * 2  # the rope chunk's two k-steps take Q from registers
PV_STEPS = BLOCK_N // 32
M_TILES = D_NOPE // 2 // 64  # a group's 256 latent columns as m64 tiles of O^T
BYTE_MASKS = (0xFF, 0xFF00, 0xFF0000, -0x1000000)  # byte q of a 32-bit register (the last as a signed int32)
# the row-factor exchange (sAlpha): each group's factors from its old max to m_A and from m_A to m_B; the epilogue
# reuses the first 128 entries for the row sums and the next 64 for each row's output factor
LEFT_TO_A, LEFT_TO_B, RIGHT_TO_A, RIGHT_TO_B = 0, BLOCK_M, 2 * BLOCK_M, 3 * BLOCK_M
# the right group's two factors of pair i sit at RIGHT_TO_A / RIGHT_TO_B + (i % 2) RIGHT_PARITY: a right warp may
# post pair i's while another right warp still reads pair i - 1's (nothing orders them but P_FULL of pair i)
RIGHT_PARITY = 2 * BLOCK_M
# after the six factor sets, a flag per set and warp of the posting group: 1.0 when a factor of the warp's 16 rows is
# not 1 (``post_factors``), so a reader skips its 16 factor loads and compares unless a flag of the set is up
MOVED = 6 * BLOCK_M
ALPHA_ENTRIES = MOVED + 6 * 4


@dsl_user_op
def _ldsm_t4(addr, imm: int, *, loc=None, ip=None):
    """``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` at ``addr + imm`` (an immediate offset: the compiler
    keeps no per-fragment address registers): lane l gives the row address of row l % 8 of matrix l // 8;
    returns this lane's 4 registers (one per matrix)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()]),
        [cutlass.Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{$0, $1, $2, $3}}, [$4+{imm}];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [cutlass.Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def _st_e4m3x4(base, xor: int, imm: int, b0, b1, b2, b3, *, loc=None, ip=None):
    """Four fp32 values as e4m3 (round to nearest, saturating) into the 4 bytes at shared address
    ``(base ^ xor) + imm`` (4-byte aligned), ``b0`` in the lowest byte (fp8seesaw_layout.p_thread_base and
    p_word_values: the XOR and the offset are immediates inside the asm, so no per-value address is hoisted into
    a register). One ``st.shared.b32`` where two ``st.shared.b16`` of e4m3 pairs were (the same bytes)."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(base).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (b0, b1, b2, b3)],
        f"{{ .reg .b16 t0, t1; .reg .b32 a, w; cvt.rn.satfinite.e4m3x2.f32 t0, $2, $1; "
        f"cvt.rn.satfinite.e4m3x2.f32 t1, $4, $3; mov.b32 w, {{t0, t1}}; xor.b32 a, $0, {xor}; "
        f"st.shared.b32 [a+{imm}], w; }}",
        "r,f,f,f,f", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _st_16x2(base, imm: int, lo, hi, fp16: bool, *, loc=None, ip=None):
    """Two fp32 values rounded to bf16 (fp16 when ``fp16``) into the 4 bytes at shared address ``base + imm``,
    ``lo`` in the lower half: one ``st.shared.b32``."""
    kind = "f16x2" if fp16 else "bf16x2"
    llvm.inline_asm(
        None,
        [cutlass.Int32(base).ir_value(loc=loc, ip=ip)]
        + [cutlass.Float32(x).ir_value(loc=loc, ip=ip) for x in (lo, hi)],
        f"{{ .reg .b32 w; cvt.rn.{kind}.f32 w, $2, $1; st.shared.b32 [$0+{imm}], w; }}",
        "r,f,f", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _tree_max(vals):
    """The max of a list of values as a balanced tree of fmax (depth log2 n, not a chain of n - 1)."""
    if len(vals) == 1:
        return vals[0]
    half = len(vals) // 2
    return cute.arch.fmax(_tree_max(vals[:half]), _tree_max(vals[half:]))


@dataclasses.dataclass(frozen=True)
class KRings:
    full_k: MbarrierRing  # TMA landed the tile (expect-tx bytes)
    empty_k: MbarrierRing  # all 8 consumer warps are past their last read of the tile
    # one-way signals between the consumer groups, a phase per pair (each completed by the 128 threads of the
    # signalling group, each of which releases its own shared-memory writes; the other group waits for the pair's
    # phase and only there): m_A posted (left -> right), m_B posted (right -> left), the right group's P_A V_A
    # retired so sPA may be rewritten (right -> left). A group runs at most one pair ahead of the other (P_FULL).
    m_a: MbarrierRing
    m_b: MbarrierRing
    pa_free: MbarrierRing
    left_p: MbarrierRing  # the left group's 128 threads wrote P_A and its row factors -> its P_A V_A
    q_ready: MbarrierRing  # the consumers' Q loads landed (one arrival): the producer's first-tiles gate


class Sm90MlaDecodeFp8Seesaw(Sm90MlaDecodeFp8Mma):
    """Design C: fp8 wgmma on the seesaw schedule, P V as O^T = V^T P^T with V^T in registers."""

    left_running_max = Sm90MlaDecodeSeesaw.left_running_max
    right_running_max = Sm90MlaDecodeSeesaw.right_running_max
    left_factor_to_right_max = Sm90MlaDecodeSeesaw.left_factor_to_right_max

    @property
    def p_scale(self) -> float:
        """P's e4m3 scale for the variant's running-max slack (config.MAX_SLACK: P reaches 2^max_slack)."""
        return p_scale_for(self.v.max_slack)

    @property
    def log2_p_scale(self) -> float:
        """log2 of ``p_scale`` (a power of two): the softmax computes p_scale P as exp2(s - (m - log2_p_scale)),
        so the row sums carry the scale too and P goes to e4m3 with no multiply (``exp_and_sum``)."""
        return float(math.log2(self.p_scale))

    @cute.jit
    def tile_row_max(self, acc_s, tScS, row_limit, scale_log2, tile_start):
        """The tile's row maxima in the log2 domain (quad-reduced: the 4 threads of a row agree) from the raw S,
        which stays unscaled (``exp_and_sum`` scales it inside its FMA): with scale_log2 > 0 (``positive_scale``)
        and rounding monotone, max(S) x scale rounded is max(S x scale rounded), the value the scaled-then-compared
        form gave. Keys at or past a row's limit become -inf first (a NaN read there too), on a tile that holds
        such a key for some row of the warp only (a warp-uniform branch: the split's last tile or two); each row's
        maximum is a tree of 16 values, not a chain."""
        need = cutlass.Int32(0)
        for half in cutlass.range_constexpr(2):
            need = need | cutlass.Int32(tile_start + BLOCK_N > row_limit[half])
        if cute.arch.vote_any_sync(need != 0):
            for v in cutlass.range_constexpr(cute.size(tScS)):
                if tile_start + tScS[v][1] >= row_limit[(v >> 1) & 1]:
                    acc_s[v] = -cutlass.Float32.inf
        m = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            top = _tree_max([acc_s[v] for v in range(cute.size(tScS)) if (v >> 1) & 1 == half])
            m[half] = cute.arch.warp_reduction_max(top, threads_in_group=4) * scale_log2
        return m

    @cute.jit
    def exp_and_sum(self, acc_s, row_sum, alpha, m_use, scale_log2):
        """P x p_scale = exp2(S x scale - (m_use - log2_p_scale)) in place of the raw S (one FMA and the exp a
        value; the exp base lowered by ``log2_p_scale``, exact: a small integer); l = l alpha + sum P."""
        base = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        for half in cutlass.range_constexpr(2):
            row_sum[half] = row_sum[half] * alpha[half]
            base[half] = m_use[half] - self.log2_p_scale
        for v in cutlass.range_constexpr(cute.size(acc_s)):
            half = (v >> 1) & 1
            p = cute.math.exp2(acc_s[v] * scale_log2 - base[half], fastmath=True)
            acc_s[v] = p
            row_sum[half] = row_sum[half] + p

    @cute.jit
    def positive_scale(self, scale_log2):
        """The logit scale, or NaN when it is not positive (a q or KV scale tensor <= 0; float scales are refused
        by the API): the max of the raw S (``tile_row_max``) holds for a positive scale only, and a NaN output
        says so where a wrong finite one would not."""
        s = scale_log2
        if not (scale_log2 > 0.0):
            s = cutlass.Float32.nan
        return s

    @cute.jit
    def slack_at(self, i):
        """The running max's slack at pair ``i`` of a split: none over its first MAX_SLACK_FROM_PAIR pairs (there the
        max still moves on most tiles and a short split keeps every row's largest P exact), then max_slack."""
        if cutlass.const_expr(self.v.max_slack == 0.0):
            return 0.0
        slack = cutlass.Float32(0.0)
        if i >= MAX_SLACK_FROM_PAIR:
            slack = cutlass.Float32(self.v.max_slack)
        return slack

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
        SMEM, RMEM = warpgroup.OperandSource.SMEM, warpgroup.OperandSource.RMEM

        def e4m3_mma(a_source):  # one warp group's m64n64k32 e4m3 x e4m3 -> fp32, both operands K-major
            k_major = cute.nvgpu.OperandMajorMode.K
            return sm90_utils.make_trivial_tiled_mma(F8, F8, k_major, k_major, cutlass.Float32, (1, 1, 1), (64, 64),
                                                     a_source)

        # S = Q K^T over a whole tile by one group: the first k-step, the accumulating ones, and the rope chunk's
        # with Q from registers (each copy's ACCUMULATE is set once, at the top of the consumer)
        qk_mma, qk_acc_mma, qk_rs_mma = e4m3_mma(SMEM), e4m3_mma(SMEM), e4m3_mma(RMEM)
        # O^T += V^T P^T: M = latent columns (V^T from registers), N = query rows, K = keys (P^T K-major)
        pv_mma = e4m3_mma(RMEM)
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), F8, 1)
        # P^T: 64 rows (N) x 64 key slots (K), K-major, 64-byte swizzle (fp8seesaw_layout.p_offset)
        pt_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, BLOCK_M, BLOCK_N), F8, 1)
        pb_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, BLOCK_M, BLOCK_N), F8, 2)
        # the K ring (64 keys x 576 per stage, fp8seesaw_layout.tile_offset)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, D_QK), F8, STAGES_C)

        tma_atom, tma_tensor = self.fp8_kv_tma(mKV)

        @cute.struct
        class SharedStorage:
            # full[STAGES_C] (TMA bytes), empty[STAGES_C] (8 consumer warps), then m_a, m_b, pa_free, left_p,
            # q_ready (KRings)
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * STAGES_C + 5]
            max_a: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            max_b: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            alpha: cute.struct.MemRange[cutlass.Float32, ALPHA_ENTRIES]
            sPA: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(pt_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(q_layout)], 1024]
            # P_B of odd pairs, right after Q's rope chunk (P_B of even pairs): one 2-stage P^T tensor (pb_layout)
            sPB: cute.struct.MemRange[F8, cute.cosize(pt_layout)]
            sK: cute.struct.Align[cute.struct.MemRange[F8, cute.cosize(k_layout)], 1024]

        self.shared_storage = SharedStorage
        m_blocks = (self.rows + BLOCK_M - 1) // BLOCK_M
        self.kernel_c(qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, tma_atom, tma_tensor, mQn, mQp, mKV, mBT, mRowKv, mOut,
                      mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, mWork,
                      mCombineCtr, fuse_combine, q_layout, k_layout, pt_layout, pb_layout).launch(
            grid=(m_blocks, grid_items, 1), block=[NUM_THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1, use_pdl=self.use_pdl)

    # ------------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel_c(self, qk_mma: cute.TiledMma, qk_acc_mma: cute.TiledMma, qk_rs_mma: cute.TiledMma,
                 pv_mma: cute.TiledMma, tma_atom, tma_tensor, mQn: cute.Tensor, mQp: cute.Tensor, mKV: cute.Tensor,
                 mBT: cute.Tensor, mRowKv: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPartO: cute.Tensor,
                 mPartLse: cute.Tensor, mQScale: cute.Tensor, mKVScale: cute.Tensor, q_scale: cutlass.Float32,
                 kv_scale: cutlass.Float32, sm_scale_log2: cutlass.Float32, mWork: cute.Tensor,
                 mCombineCtr: cute.Tensor, fuse_combine: cutlass.Int32, q_layout: cute.ComposedLayout,
                 k_layout: cute.ComposedLayout, pt_layout: cute.ComposedLayout, pb_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        mblk, w, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sPA = storage.sPA.get_tensor(pt_layout.outer, swizzle=pt_layout.inner)
        # sP1 = Q's rope chunk (chunk 8, 1 KB-aligned), free once both groups hold it in registers: P_B of even
        # pairs; sPB (next to it) P_B of odd pairs, so that a group's softmax need not wait for the previous P_B V_B
        sP1 = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr() + (K_CHUNKS - 1) * CHUNK_BYTES,
                                               pb_layout.inner), pb_layout.outer)
        sMaxA = storage.max_a.get_tensor(cute.make_layout(2 * BLOCK_M))
        sMaxB = storage.max_b.get_tensor(cute.make_layout(2 * BLOCK_M))
        sAlpha = storage.alpha.get_tensor(cute.make_layout(ALPHA_ENTRIES))
        bars = storage.kv_mbar.data_ptr()
        rings = KRings(full_k=MbarrierRing(bars, STAGES_C, 1), empty_k=MbarrierRing(bars + STAGES_C, STAGES_C, 8),
                       m_a=MbarrierRing(bars + 2 * STAGES_C, 1, 128), m_b=MbarrierRing(bars + 2 * STAGES_C + 1, 1, 128),
                       pa_free=MbarrierRing(bars + 2 * STAGES_C + 2, 1, 128),
                       left_p=MbarrierRing(bars + 2 * STAGES_C + 3, 1, 128),
                       q_ready=MbarrierRing(bars + 2 * STAGES_C + 4, 1, 1))
        if tidx == 0:
            for ring in (rings.full_k, rings.empty_k, rings.m_a, rings.m_b, rings.pa_free, rings.left_p, rings.q_ready):
                ring.init()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)

        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_wait()

        # each role reads its work item after the register split (read before it, a value live into the 24-register
        # producer spilled with 16-token pages); an odd tile count gets a last tile B past the split's end
        # (zero-filled by TMA, masked)
        if mWork[w * WORK_ITEM_INTS] > 0:  # else: past the end of the schedule
            if wg == 0:
                cute.arch.setmaxregister_decrease(REGS_PRODUCER_C)
                if warp_idx == 0:
                    _, b, _, _, _, kv_start, kv_end, n_tiles, _ = self.scheduler.read_item(mWork, w)
                    self.produce_c(tma_atom, tma_tensor, sK, rings, mKV, mBT, b, kv_start, kv_end, (n_tiles + 1) // 2)
            else:
                cute.arch.setmaxregister_increase(REGS_CONSUMER_C)
                _, b, seq_len, n_splits, slot0, kv_start, kv_end, n_tiles, slot = self.scheduler.read_item(mWork, w)
                n_pairs = (n_tiles + 1) // 2
                self.consume_c(qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, rings, sQ, sK, sPA, sP1, sMaxA, sMaxB,
                               sAlpha, storage.sQ.data_ptr(), mQn, mQp, mRowKv, mOut, mLse, mPartO, mPartLse,
                               mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits, b, mblk, slot, seq_len,
                               kv_start, kv_end, n_pairs, tidx - 128, wg - 1)
                if fuse_combine != 0 and n_splits > 1:
                    self.combine_in_kernel(mCombineCtr, mPartO, mPartLse, mOut, mLse, mQScale, mKVScale, q_scale,
                                           kv_scale, b, mblk, slot0, n_splits, fuse_combine, tidx - 128,
                                           storage.sQ.data_ptr())
        if cutlass.const_expr(self.use_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def produce_c(self, tma_atom, tma_tensor, sK, rings, mKV, mBT, b, kv_start, kv_end, n_pairs):
        """Warp 0: the pairs' tiles in order into the ring (design B's ``issue_tma``). Tile 0 goes out at once, the
        rest once the consumers' Q loads have landed (``q_ready``): every CTA of a wave starts together, and a
        ring's worth of tiles from each (5 x 36 KB x 132 CTAs, ~5.5 us of HBM) issued beside the Q loads delayed Q,
        and with it the first S, by as much (per-CTA timestamps, docs/perf/cute_sm90_fp8.md)."""
        tKs, tKg = self.tma_partitions(tma_atom, tma_tensor, sK)
        num_blocks = mKV.shape[0]
        for j in cutlass.range(2 * n_pairs, unroll=1):
            if j == Q_FIRST_TILES:
                rings.q_ready.wait_filled(0)
            self.issue_tma(tma_atom, tKg, tKs, rings, mBT, num_blocks, b, kv_start, kv_end, j)

    @cute.jit
    def issue_qk(self, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, rings, j):
        """Issue (not wait for) S = Q K^T of tile ``j`` once it has landed."""
        rings.full_k.wait_filled(j)
        stage = j % STAGES_C
        warpgroup.fence()
        for k in cutlass.range_constexpr(K_STEPS):
            if cutlass.const_expr(k >= ROPE_STEP):
                cute.gemm(qk_rs_mma, acc_s, tSrQreg[(None, None, k - ROPE_STEP)], tSrK[(None, None, k, stage)],
                          acc_s)
            elif cutlass.const_expr(k == 0):
                cute.gemm(qk_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
            else:
                cute.gemm(qk_acc_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def load_vt(self, rV32, thread_addr, side: cutlass.Constexpr, k: cutlass.Constexpr, lane, valid, r=None):
        """This thread's V^T A fragments of k-step ``k`` of a tile (4 m-tiles x a0..a3, into ``rV32``) for group
        ``side``'s latent chunks 4 side .. + 3: ldmatrix.trans.x4 + prmt (fp8seesaw_layout), the bytes of keys >=
        ``valid`` zeroed. ``r``: the k-step's ``ldsm_vt`` registers when the caller issued the loads earlier."""
        # Every ldmatrix of the k-step is issued (into a register array) before the first byte permute, so the
        # four loads are in flight together. (ptxas had already scheduled the loads so: the SASS is the same;
        # the order is now the source's.)
        if cutlass.const_expr(r is None):
            r = self.ldsm_vt(thread_addr, side, k)
        for mt in cutlass.range_constexpr(M_TILES):
            base = 4 * mt
            rV32[base + 0] = _prmt(r[mt][0], r[mt][1], PRMT_LO)
            rV32[base + 1] = _prmt(r[mt][0], r[mt][1], PRMT_HI)
            rV32[base + 2] = _prmt(r[mt][2], r[mt][3], PRMT_LO)
            rV32[base + 3] = _prmt(r[mt][2], r[mt][3], PRMT_HI)
        # Keys >= valid (past the item's end: TMA loads whole page slices, so their bytes may be NaN / inf, and
        # P = 0 there does not help, 0 x NaN = NaN) are zeroed byte by byte; the masks are computed and applied
        # only when this k-step holds such a key. The k-step's keys are 32 k .. 32 k + 31 (fragment_key), so for
        # valid >= 32 (k + 1) every mask is all ones and skipping them changes no bit. ``valid`` (kv_end - the
        # tile's first key) is the same for the whole CTA, so the branch is uniform; it is taken on the tile
        # holding kv_end (wherever in the split that falls) and on a tile past it (valid <= 0, all zeroed), as
        # design B's transpose_v chooses its masked form by valid < BLOCK_N.
        if valid < 32 * (k + 1):
            masks = []
            for h in cutlass.range_constexpr(2):
                m = cutlass.Int32(0)
                for q in cutlass.range_constexpr(4):
                    keep = 0 - cutlass.Int32(fragment_key(lane, k, 2 * h, q) < valid)
                    m = m | (keep & BYTE_MASKS[q])
                masks.append(m)
            for i in cutlass.range_constexpr(4 * M_TILES):
                rV32[i] = rV32[i] & masks[(i >> 1) & 1]

    def ldsm_vt(self, thread_addr, side, k):
        """The 4 ldmatrix.trans.x4 of k-step ``k`` (one per m-tile, 16 registers), back to back: the rows that
        ``load_vt`` permutes into the A fragments."""
        return [_ldsm_t4(thread_addr, ldsm_immediate(4 * side + mt, k)) for mt in range(M_TILES)]

    @cute.jit
    def pv_thread_addr(self, rings, k_base, tile, warp, lane):
        """This thread's ldmatrix row address in tile ``tile``'s stage, once the tile has landed."""
        rings.full_k.wait_filled(tile)
        return k_base + (tile % STAGES_C) * K_STAGE_BYTES + ldsm_thread_base(lane, warp)

    @cute.jit
    def pv_step(self, pv_mma, acc_t, rV, tOrP, rings, thread_addr, tile, side: cutlass.Constexpr,
                k: cutlass.Constexpr, lane, valid, r=None, p_stage=0, loaded: cutlass.Constexpr = False):
        """k-step ``k`` of O^T += V_tile^T P^T for this group's 256 latent columns: load the step's fragments and
        issue its 4 m-tiles as one wgmma group (the caller waits for the previous step before reusing ``rV``); the
        tile is released after the last step's loads (this warp's last read of it: the wgmmas read registers and
        P^T). ``loaded``: the caller loaded them already (``load_first_step``)."""
        if cutlass.const_expr(not loaded):
            self.load_vt(cute.recast_tensor(rV, cutlass.Int32), thread_addr, side, k, lane, valid, r)
        if cutlass.const_expr(k == PV_STEPS - 1):
            if lane == 0:
                rings.empty_k.arrive(tile)
        warpgroup.fence()
        cute.gemm(pv_mma, acc_t, rV[(None, None, 0)], tOrP[(None, None, k, p_stage)], acc_t)
        warpgroup.commit_group()

    @cute.jit
    def issue_pv_t(self, pv_mma, acc_t, rV, tOrP, rings, k_base, tile, side: cutlass.Constexpr, warp, lane,
                   valid, p_stage=0):
        """Both k-steps of O^T += V_tile^T P^T, with a wait between them (32 fragment registers at once made ptxas
        serialise every wgmma)."""
        thread_addr = self.pv_thread_addr(rings, k_base, tile, warp, lane)
        self.pv_step(pv_mma, acc_t, rV, tOrP, rings, thread_addr, tile, side, 0, lane, valid, None, p_stage)
        # k-step 1's ldmatrix before the wait for k-step 0, into 16 registers of their own (rV is still the
        # wgmma's): their latency passes under the wait, so the permutes after it do not stall on them. The
        # stage stays held until k-step 1's permutes are done (pv_step's release). (0 spills, waits unchanged.)
        r1 = self.ldsm_vt(thread_addr, side, 1)
        warpgroup.wait_group(0)  # the previous k-step's fragments are free
        self.pv_step(pv_mma, acc_t, rV, tOrP, rings, thread_addr, tile, side, 1, lane, valid, r1, p_stage)

    @cute.jit
    def load_first_step(self, rV, rings, k_base, tile, side: cutlass.Constexpr, warp, lane, valid):
        """k-step 0's V^T fragments of ``tile`` into ``rV`` ahead of its ``issue_pv_t_then_qk(..., thread_addr)``:
        the loads and permutes need the tile, not P, so a group runs them before it waits for P (the caller has
        retired the wgmma that last read ``rV``); returns the thread's ldmatrix address for the rest."""
        thread_addr = self.pv_thread_addr(rings, k_base, tile, warp, lane)
        self.load_vt(cute.recast_tensor(rV, cutlass.Int32), thread_addr, side, 0, lane, valid)
        return thread_addr

    @cute.jit
    def issue_pv_t_then_qk(self, pv_mma, acc_t, rV, tOrP, rings, k_base, tile, side: cutlass.Constexpr, warp, lane,
                           valid, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, next_tile, has_next,
                           thread_addr):
        """``issue_pv_t`` with S of ``next_tile`` (when ``has_next``) issued between the two k-steps: it runs on the
        tensor pipe while this group waits for its first k-step and through the max exchange, so the next tile's
        S is done by the time the group needs it (wgmma groups retire in order: waiting for all but the newest
        one retires the first k-step). k-step 0's fragments are in ``rV`` already (``load_first_step``, which gave
        ``thread_addr``)."""
        self.pv_step(pv_mma, acc_t, rV, tOrP, rings, thread_addr, tile, side, 0, lane, valid, loaded=True)
        r1 = self.ldsm_vt(thread_addr, side, 1)  # k-step 1's loads under the S issue and the wait (issue_pv_t)
        if has_next:
            self.issue_qk(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, rings, next_tile)
            warpgroup.wait_group(1)
        else:
            warpgroup.wait_group(0)
        self.pv_step(pv_mma, acc_t, rV, tOrP, rings, thread_addr, tile, side, 1, lane, valid, r1)

    @cute.jit
    def store_p_t(self, acc_s, p_addr, warp, lane):
        """P (fp32 in ``acc_s``, already x p_scale: ``exp_and_sum``) as e4m3 into the P^T tile at ``p_addr``,
        key k at slot ``slot_of_key(k)`` (``p_offset`` in the form ``p_thread_base``: value v of the m64n64
        accumulator is row 16 warp + lane // 4 + 8 ((v >> 1) & 1), key 8 (v >> 2) + 2 (lane % 4) + (v & 1)); fenced
        for the wgmma (async proxy)."""
        base = p_addr + p_thread_base(lane, warp)
        # 4-byte stores: values v0, v0 + 1 (keys 2 (lane % 4) + 0, 1 of an 8-key column group) and v0 + 4, v0 + 5
        # (the same keys + 8) of one row sit at slots 4 (lane % 4) + 0..3 (slot_of_key), one aligned word, so
        # this thread stores them together with no shuffle (p_word_values); 8 STS.32 instead of 16 STS.U16
        for w in cutlass.range_constexpr(cute.size(acc_s) // 4):
            vals = p_word_values(w)
            xor, imm = p_value_terms(vals[0])
            _st_e4m3x4(base, xor, imm, *(acc_s[v] for v in vals))
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def post_rows(self, sX, base, tScS, vals, lane):
        """This thread's two rows' ``vals`` into sX[base + row] (one thread of each quad)."""
        if lane % 4 == 0:
            for half in cutlass.range_constexpr(2):
                sX[base + tScS[2 * half][0]] = vals[half]

    @cute.jit
    def post_factors(self, sAlpha, base, tScS, vals, lane, warp):
        """``post_rows`` of a factor set (``base``, a multiple of BLOCK_M) and its warp's flag: 1.0 when a factor
        of the warp's rows is not 1 (a NaN one too), at MOVED + 4 (base / BLOCK_M) + warp."""
        self.post_rows(sAlpha, base, tScS, vals, lane)
        moved = cute.arch.vote_any_sync(vals[0] != 1.0 or vals[1] != 1.0)
        if lane == 0:
            flag = cutlass.Float32(0.0)
            if moved:
                flag = cutlass.Float32(1.0)
            sAlpha[MOVED + base // (BLOCK_M // 4) + warp] = flag

    @cute.jit
    def rescale_o_t(self, acc_t, sAlpha, base, lane):
        """O^T's columns are query rows (all 64 in every warp): this thread's 16 (8 j + 2 (lane % 4) + e) take
        their factors from sAlpha[base + row], unless no flag of the set is up (``post_factors``: every factor
        is 1, most tiles of a long split with the running max's slack): then 4 loads and no compare."""
        flags = cutlass.Float32(0.0)
        for w in cutlass.range_constexpr(4):
            flags = flags + sAlpha[MOVED + base // (BLOCK_M // 4) + w]
        if flags != 0.0:
            a = cute.make_rmem_tensor(cute.make_layout(16), cutlass.Float32)
            for j in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(2):
                    a[2 * j + e] = sAlpha[base + 8 * j + 2 * (lane % 4) + e]
            for v in cutlass.range_constexpr(cute.size(acc_t)):
                acc_t[v] = acc_t[v] * a[ot_column_index(v)]

    @cute.jit
    def consume_c(self, qk_mma, qk_acc_mma, qk_rs_mma, pv_mma, rings, sQ, sK, sPA, sP1, sMaxA, sMaxB, sAlpha,
                  stage_ptr, mQn, mQp, mRowKv, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale,
                  sm_scale_log2, n_splits, b, mblk, slot, seq_len, kv_start, kv_end, n_pairs, ctid, grp):
        """``grp`` (warp-uniform): 0 = left (tiles A, latent columns 0..255), 1 = right (tiles B, 256..511)."""
        gtid = ctid % 128
        lane = ctid % 32
        warp = gtid // 32

        qk_mma.set(warpgroup.Field.ACCUMULATE, False)
        qk_acc_mma.set(warpgroup.Field.ACCUMULATE, True)
        qk_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        self.load_q(sQ, sAlpha, mQn, mQp, b, mblk, ctid)  # (an fp8 q has no per-row scale: sAlpha gets 1s)
        if ctid == 0:  # after load_q's consumer barrier: every consumer's Q has landed
            rings.q_ready.arrive(0)
        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        scale_log2 = self.positive_scale(sm_scale_log2 * qscale * kscale)

        qk_thr = qk_mma.get_slice(gtid)
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
        qk_rs_thr = qk_rs_mma.get_slice(gtid)
        tSsQ_rs = qk_rs_thr.partition_A(sQ)
        tSrQreg = cute.make_rmem_tensor(cute.make_layout(((4, 2, 2), 1, 2), stride=((1, 4, 8), 0, 16)), F8)
        for k in cutlass.range_constexpr(2):
            cute.autovec_copy(tSsQ_rs[(None, 0, ROPE_STEP + k, 0)], tSrQreg[(None, 0, k)])
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((BLOCK_M, BLOCK_N)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N)))

        pv_thr = pv_mma.get_slice(gtid)
        acc_t = pv_thr.make_fragment_C(pv_thr.partition_shape_C((D_NOPE // 2, BLOCK_M)))
        acc_t.fill(0.0)
        tOrPA = pv_thr.make_fragment_B(pv_thr.partition_B(sPA))
        tOrP1 = pv_thr.make_fragment_B(pv_thr.partition_B(sP1))  # (..., k-step, pair parity)
        # V^T A fragments of one tile: (values of one m64k32 fragment, 4 m-tiles, 2 k-steps), 32 registers
        rV = cute.make_rmem_tensor(cute.make_layout(((4, 2, 2), M_TILES, 1), stride=((1, 4, 8), 16, 0)), F8)
        k_base = sK.iterator.toint()
        pa = sPA.iterator.toint()
        p1 = sP1.iterator.toint()

        row_max, row_sum, row_limit = self.row_state(mRowKv, b, mblk, tScS, seq_len, kv_end)
        alpha = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
        m_use = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)

        if grp == 0:
            for i in cutlass.range(n_pairs, unroll=1):
                tile_start = kv_start + 2 * i * BLOCK_N
                if i == 0:  # (issued in the loop: an accumulator's first definition may not meet an open wgmma)
                    self.issue_qk(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, rings, 0)
                # S_A: issued just above at i = 0, else during the previous pair and retired there. The previous
                # P_B V_B may still run: it reads O^T, the fragments and the other P_B buffer, none of which the
                # softmax touches (the wait before the rescale below retires it)
                if i == 0:
                    warpgroup.wait_group(0)
                m_a = self.tile_row_max(acc_s, tScS, row_limit, scale_log2, tile_start)
                self.left_running_max(sMaxA, i, tScS, m_a, row_max, alpha, m_use, lane, self.slack_at(i))
                # m_A -> the right group, which needs nothing else of this group before P_FULL: it computes m_B and
                # its P_B while this group computes P_A
                rings.m_a.arrive(i)
                self.exp_and_sum(acc_s, row_sum, alpha, m_use, scale_log2)
                if i > 0:  # the right group has retired the previous P_A V_A
                    rings.pa_free.wait_filled(i - 1)
                # P_A at m_A: both groups' P_A V_A (the right group rescales its O around it)
                self.store_p_t(acc_s, pa, warp, lane)
                self.post_factors(sAlpha, LEFT_TO_A, tScS, alpha, lane, warp)
                rings.left_p.arrive(i)
                warpgroup.wait_group(0)  # the previous P_B V_B: O^T and the fragments are free
                # P_A V_A's first fragments while the group meets
                thread_addr = self.load_first_step(rV, rings, k_base, 2 * i, 0, warp, lane, kv_end - tile_start)
                rings.left_p.wait_filled(i)
                self.rescale_o_t(acc_t, sAlpha, LEFT_TO_A, lane)
                # P_A V_A with S_A of the next pair issued between its k-steps
                self.issue_pv_t_then_qk(pv_mma, acc_t, rV, tOrPA, rings, k_base, 2 * i, 0, warp, lane,
                                        kv_end - tile_start, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg,
                                        tSrK, 2 * i + 2, i + 1 < n_pairs, thread_addr)
                rings.m_b.wait_filled(i)  # m_B <- the right group
                self.left_factor_to_right_max(sMaxB, i, tScS, m_a, row_max, alpha)
                self.post_factors(sAlpha, LEFT_TO_B, tScS, alpha, lane, warp)
                consumer_sync(Sm90DecodeBarrier.P_FULL)  # P_B written, this group's factors posted
                warpgroup.wait_group(0)  # P_A V_A,left (and the next S_A): the fragments may be overwritten
                for half in cutlass.range_constexpr(2):
                    row_sum[half] = row_sum[half] * alpha[half]
                self.rescale_o_t(acc_t, sAlpha, LEFT_TO_B, lane)
                self.issue_pv_t(pv_mma, acc_t, rV, tOrP1, rings, k_base, 2 * i + 1, 0, warp, lane,
                                kv_end - tile_start - BLOCK_N, i % 2)
        else:
            to_a = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            to_b = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            for i in cutlass.range(n_pairs, unroll=1):
                tile_start = kv_start + (2 * i + 1) * BLOCK_N
                if i == 0:
                    self.issue_qk(qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, rings, 1)
                if i == 0:  # S_B (later pairs: retired in the previous one; its P_B V_B may still run, as left)
                    warpgroup.wait_group(0)
                tile_max = self.tile_row_max(acc_s, tScS, row_limit, scale_log2, tile_start)
                rings.m_a.wait_filled(i)
                self.right_running_max(sMaxA, sMaxB, i, tScS, tile_max, row_max, alpha, m_use, lane, to_a, to_b,
                                       self.slack_at(i))
                parity = (i % 2) * RIGHT_PARITY
                self.post_factors(sAlpha, RIGHT_TO_A + parity, tScS, to_a, lane, warp)
                self.post_factors(sAlpha, RIGHT_TO_B + parity, tScS, to_b, lane, warp)
                rings.m_b.arrive(i)  # m_B -> the left group (this group waits for it only at P_FULL)
                self.exp_and_sum(acc_s, row_sum, alpha, m_use, scale_log2)
                # P_B of pair i into sP1 (even i) or sPB (odd): both groups retired the P_B V_B of pair i - 2, which
                # read that buffer, before P_FULL of pair i - 1
                self.store_p_t(acc_s, p1 + (i % 2) * (BLOCK_M * BLOCK_N), warp, lane)
                warpgroup.wait_group(0)  # the previous P_B V_B: O^T and the fragments are free
                # P_A V_A's first fragments before the wait for P_A (the tile landed long ago)
                thread_addr = self.load_first_step(rV, rings, k_base, 2 * i, 1, warp, lane,
                                                   kv_end - tile_start + BLOCK_N)
                consumer_sync(Sm90DecodeBarrier.P_FULL)  # P_B written, this group's factors posted
                # O = (O f_A + P_A V_A) f_B + P_B V_B: P_A is at m_A; S_B of the next pair between P_A V_A's k-steps
                self.rescale_o_t(acc_t, sAlpha, RIGHT_TO_A + parity, lane)
                self.issue_pv_t_then_qk(pv_mma, acc_t, rV, tOrPA, rings, k_base, 2 * i, 1, warp, lane,
                                        kv_end - tile_start + BLOCK_N, qk_mma, qk_acc_mma, qk_rs_mma, acc_s, tSrQ,
                                        tSrQreg, tSrK, 2 * i + 3, i + 1 < n_pairs, thread_addr)
                warpgroup.wait_group(0)  # P_A V_A,right (and the next S_B)
                if i + 1 < n_pairs:
                    rings.pa_free.arrive(i)
                self.rescale_o_t(acc_t, sAlpha, RIGHT_TO_B + parity, lane)
                self.issue_pv_t(pv_mma, acc_t, rV, tOrP1, rings, k_base, 2 * i + 1, 1, warp, lane,
                                kv_end - tile_start, i % 2)
        warpgroup.wait_group(0)

        self.store_result_t(acc_t, row_max, row_sum, tScS, pv_thr, sAlpha, stage_ptr, grp, ctid, mOut, mLse,
                            mPartO, mPartLse, kscale, n_splits, b, mblk, slot)

    @cute.jit
    def store_result_t(self, acc_t, row_max, row_sum, tScS, pv_thr, sAlpha, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                       mPartLse, kscale, n_splits, b, mblk, slot):
        """The epilogue of ``store_result`` for the transposed accumulator: the row sums through sAlpha, each
        row's output factor through sAlpha[RIGHT_TO_A + row], the tile staged in natural order (query row, latent
        column: ``latent_of_row``), then the common 16-byte stores."""
        lane = ctid % 32
        consumer_barrier()  # every thread is past its last read of the factor exchange
        inv, lse2 = self.final_row_stats(row_max, row_sum, tScS, sAlpha, grp, lane, kscale, 1.0, n_splits,
                                         self.log2_p_scale)
        if grp == 0:
            self.post_rows(sAlpha, RIGHT_TO_A, tScS, inv, lane)
        consumer_barrier()
        # the tile in natural order: this thread's 16 rows' factors once (sAlpha is shared memory, as the stage
        # is: loads between the stores would be reloaded after each), then values v and v + 2 (adjacent latent
        # columns of one row) as one 4-byte store at immediate offsets from one base (stage_thread_base)
        f = cute.make_rmem_tensor(cute.make_layout(16), cutlass.Float32)
        for j in cutlass.range_constexpr(8):
            for e in cutlass.range_constexpr(2):
                f[2 * j + e] = sAlpha[RIGHT_TO_A + 8 * j + 2 * (lane % 4) + e]
        elem = self.out_dtype.width // 8
        gtid = ctid % 128
        base = stage_ptr.toint() + elem * (grp * (D_NOPE // 2) + stage_thread_base(lane, gtid // 32, STAGE_ROW))
        for v in cutlass.range_constexpr(cute.size(acc_t)):
            if cutlass.const_expr(v & 2 == 0):
                x = f[ot_column_index(v)]
                _st_16x2(base, elem * stage_value_offset(v, STAGE_ROW), acc_t[v] * x, acc_t[v + 2] * x,
                         self.out_dtype == cutlass.Float16)
        consumer_barrier()
        s_out = self.staged_tile(stage_ptr, self.out_dtype)
        self.store_staged(s_out, lse2, tScS, ctid, mOut, mLse, mPartO, mPartLse, n_splits, b, mblk, slot)
