"""CuTe-DSL MLA decode for Hopper, 16-bit caches: the staggered schedule on 32-key halves ("seesaw32", sm_90a).

The seesaw (kernel_seesaw.py) computes two 64-key tiles at once, A in stage 0 by the left group and B in stage 1 by
the right one. Each tile is K for one group's Q K^T and V for both groups' P V, so neither stage can be refilled
before the pair's last P V: the next pair's loads start as this pair ends, and on the H100 37% of the warp samples
wait for them (docs/perf/cute_sm90_bf16.md; docs/design/cute_sm90_v4.md 3.10). This schedule keeps the
seesaw's order inside one 64-key tile instead, with the lock-step kernel's layouts (kernel.py): the left group
computes S over keys 0..31 of the tile, the right group over keys 32..63, and the tile's one stage is released
after both groups' P V, while the producer fills the other stage with the next tile. So one tile is always in
flight, as in the lock-step kernel, and one group's softmax still runs under the other group's wgmmas.

Per tile, the left group (L: keys 0..31, output columns 0..255) and the right group (R: keys 32..63, columns
256..511):

* L: S_A done -> row max over its keys -> running max m_A (posted, ``SCALE_A``) -> P_A = exp2(S - m_A) -> O_L *=
  alpha -> O_L += P_A V_A,L (P from registers) -> ``SCALE_B`` (R's m_B) -> P_A x exp2(m_A - m_B) into P's columns
  0..31 in shared memory -> ``P_FULL`` -> O_L *= that factor, O_L += P_B V_B,L (P_B from shared memory) -> release
  the stage -> S_A of the next tile.
* R: S_B done -> row max over its keys -> ``SCALE_A`` -> m_B = max(m_A, its max) (posted) -> ``SCALE_B`` -> P_B =
  exp2(S - m_B) into registers and P's columns 32..63 -> O_R rescaled -> O_R += P_B V_B,R -> ``P_FULL`` -> O_R +=
  P_A V_A,R -> release the stage -> S_B of the next tile.

Both groups' S, P and their register copies are half the seesaw's (16 + 8 registers per thread instead of 32 + 16).
The three meeting points are full two-sided barriers (as in the seesaw, for racecheck); the running maxima go through
one buffer per tile parity. P's shared memory is the lock-step kernel's 64 x 64 tile: each group writes its 32 key
columns after ``SCALE_B`` of its tile, which the other group reaches only after its P V of the previous tile retired.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import pipeline
from cutlass.cute.nvgpu import warpgroup

from mla_backend_plugin.kernels.cute_common.barriers import Sm90DecodeBarrier, consumer_sync
from mla_backend_plugin.kernels.cute_common.epilogue import load_scales
from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_M, BLOCK_N, KV_STAGES, Variant
from mla_backend_plugin.kernels.cute_sm90.kernel import D_NOPE, Sm90MlaDecode
from mla_backend_plugin.kernels.cute_sm90.kernel_seesaw import Sm90MlaDecodeSeesaw

HALF_KEYS = BLOCK_N // 2
K_STEPS_HALF = HALF_KEYS // 16  # k-steps of P V over one group's keys


class Sm90MlaDecodeSeesaw32(Sm90MlaDecode):
    """The staggered schedule on the two 32-key halves of each tile (16-bit caches)."""

    def __init__(self, variant: Variant, use_pdl: bool = True):
        super().__init__(variant, use_pdl)
        if variant.kv_dtype == "fp8":
            raise ValueError("the seesaw32 schedule is for 16-bit caches (fp8 caches: kernel_fp8mma.py)")

    @cute.jit
    def consume(self, qk_mma, qk_rs_mma, pv_mma, kv_pipe, sQ, sKV, sV, sP, sMaxX, sSumX, stage_ptr, mQn, mQp, mBT,
                mRowKv, mOut, mLse, mPartO, mPartLse, mQScale, mKVScale, q_scale, kv_scale, sm_scale_log2, n_splits,
                b, mblk, slot, seq_len, kv_start, kv_end, n_tiles, ctid):
        cd = self.cdtype
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        grp = warp_idx // 4 - 1  # warp-uniform (ptxas serialises wgmmas behind a divergent branch: C7518)
        gtid = ctid % 128
        lane = ctid % 32

        self.load_q(sQ, mQn, mQp, b, mblk, ctid)
        qscale, kscale = load_scales(self.v.q_scale_is_ptr, self.v.kv_scale_is_ptr, q_scale, kv_scale, mQScale,
                                     mKVScale)
        scale_log2 = sm_scale_log2 * qscale * kscale

        # P V with P from registers, for this group's own half (the lock-step kernel's P V reads all of P from
        # shared memory); the same two atoms along N as ``pv_mma``
        pv_rs_mma = sm90_utils.make_trivial_tiled_mma(cd, cd, cute.nvgpu.OperandMajorMode.K,
                                                      cute.nvgpu.OperandMajorMode.MN, cutlass.Float32, (1, 2, 1),
                                                      (BLOCK_M, D_NOPE // 2), warpgroup.OperandSource.RMEM)
        pv_rs_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        (pv_thr, tSrQ, tSrQreg, tSrK, tOrP, tOrV, acc_o, acc_s, tScS,
         tSsP) = self.split_key_operands(qk_mma, qk_rs_mma, pv_mma, sQ, sKV, sV, sP, ctid)
        pv_rs_thr = pv_rs_mma.get_slice(ctid)
        tOrVrs = pv_rs_thr.make_fragment_B(pv_rs_thr.partition_B(sV))
        # this group's P as the A operand of its own P V: the S accumulator's 16 values in the same order (the C
        # layout of m64n32 and the A layout of two m64k16 steps hold the same (row, key) per value index)
        r_p = cute.make_rmem_tensor(cute.make_layout(((2, 2, 2), 1, K_STEPS_HALF), stride=((1, 2, 4), 0, 8)), cd)
        # the own half's k-steps of P V over the tile's 64 keys, and the other half's
        own_k0 = grp * K_STEPS_HALF
        other_k0 = (1 - grp) * K_STEPS_HALF

        # the running maximum (both groups), the sum over this group's keys, the key limit, per row
        row_max, row_sum, row_limit = self.row_state(mRowKv, b, mblk, tScS, seq_len, kv_end)
        # the running maxima after L's half (A) and after R's half (B), one buffer per tile parity
        sMaxA = cute.make_tensor(sMaxX.iterator, cute.make_layout(2 * BLOCK_M))
        sMaxB = cute.make_tensor(sMaxX.iterator + 2 * BLOCK_M, cute.make_layout(2 * BLOCK_M))

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, KV_STAGES)
        for j in cutlass.range(n_tiles, unroll=1):
            stage = read_state.index
            tile_start = kv_start + j * BLOCK_N
            # S over this group's 32 keys; the groups drift apart by the schedule below (L reaches the next
            # tile's S while R still runs its P V), which is where one's softmax meets the other's wgmmas
            kv_pipe.consumer_wait(read_state)
            self.issue_qk(qk_mma, qk_rs_mma, acc_s, tSrQ, tSrQreg, tSrK, stage)
            warpgroup.wait_group(0)
            valid = kv_end - tile_start
            if valid < BLOCK_N:
                # V rows past the split's end hold whatever the page held (NaN included): zero this group's
                # rows before either group's P V reads them (the other group's after P_FULL, past this fence)
                self.zero_v_rows(sKV, stage, valid, grp, gtid)
                cute.arch.fence_proxy("async.shared", space="cta")
            tile_max = self.half_row_max(acc_s, tScS, row_limit, scale_log2, tile_start)
            alpha = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            m_use = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            if grp == 0:
                self.left_running_max(sMaxA, j, tScS, tile_max, row_max, alpha, m_use, lane)
                self.exp_and_sum(acc_s, r_p, row_sum, alpha, m_use)
                self.rescale_o(acc_o, alpha)
                self.issue_pv_rs(pv_rs_mma, acc_o, r_p, tOrVrs, own_k0, stage)
                consumer_sync(Sm90DecodeBarrier.SCALE_A)
                consumer_sync(Sm90DecodeBarrier.SCALE_B)  # m_B from the right group: P_A goes to it rescaled
                self.left_p_at_right_max(sMaxB, j, tScS, tile_max, row_max, alpha, acc_s, tSsP)
                consumer_sync(Sm90DecodeBarrier.P_FULL)
                warpgroup.wait_group(0)  # P_A V_A,L
                for half in cutlass.range_constexpr(2):
                    row_sum[half] = row_sum[half] * alpha[half]
                self.rescale_o(acc_o, alpha)
            else:
                consumer_sync(Sm90DecodeBarrier.SCALE_A)
                self.right_softmax(sMaxA, sMaxB, j, tScS, tile_max, row_max, row_sum, acc_s, r_p, tSsP, acc_o, lane)
                self.issue_pv_rs(pv_rs_mma, acc_o, r_p, tOrVrs, own_k0, stage)
                consumer_sync(Sm90DecodeBarrier.P_FULL)
            # the other group's P from shared memory with the other half's keys of V
            self.pv_from_smem_and_release(pv_mma, acc_o, tOrP, tOrV, other_k0, K_STEPS_HALF, kv_pipe, read_state)
            read_state.advance()

        self.store_result(acc_o, row_max, row_sum, tScS, pv_thr, sSumX, stage_ptr, grp, ctid, mOut, mLse, mPartO,
                          mPartLse, kscale, 1.0, n_splits, b, mblk, slot)

    @cute.jit
    def issue_pv_rs(self, pv_rs_mma, acc_o, r_p, tOrV, k0, stage):
        """O += P V over this group's own 32 keys with P from registers (``r_p``)."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(K_STEPS_HALF):
            cute.gemm(pv_rs_mma, acc_o, r_p[(None, None, k)], tOrV[(None, None, k0 + k, stage)], acc_o)
        warpgroup.commit_group()

    # the seesaw's per-group softmax pieces and max exchange, unchanged (16 S values per thread here instead of 32)
    half_row_max = Sm90MlaDecodeSeesaw.scaled_row_max
    exp_and_sum = Sm90MlaDecodeSeesaw.exp_and_sum
    rescale_o = Sm90MlaDecodeSeesaw.rescale_o
    left_running_max = Sm90MlaDecodeSeesaw.left_running_max
    right_running_max = Sm90MlaDecodeSeesaw.right_running_max
    right_softmax = Sm90MlaDecodeSeesaw.right_softmax
    left_factor_to_right_max = Sm90MlaDecodeSeesaw.left_factor_to_right_max
    left_p_at_right_max = Sm90MlaDecodeSeesaw.left_p_at_right_max
