"""Static configuration of the CuTe-DSL SM100 decode kernel: tile, warp roles, budgets, variant key.

No cutlass import: the registry, the planner and the CPU tests read it on machines without the DSL. The numbers
are explained in docs/design/sm100_cute_mla.md; ``tmem_columns`` and ``shared_bytes`` are the budgets the CPU
tests hold the kernel to (TMEM <= 512 columns, shared memory <= 227 KB per CTA).
"""

from __future__ import annotations

import dataclasses

from mla_backend_plugin.kernels.cute_common.variant import Variant as CuteVariant
from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_HEAD_DIM

# ---- tile: a CTA pair (cluster 2x1x1) runs tcgen05.mma.cta_group::2 ----
CLUSTER = 2
BLOCK_M = 128  # query rows of one m-block (the pair); each CTA owns CTA_ROWS of them
CTA_ROWS = BLOCK_M // CLUSTER  # 64
BLOCK_N = 128  # keys per KV tile; S = Q K^T is one M=128 x N=128 MMA per 16 (32 for fp8) columns of K
CTA_KEYS = BLOCK_N // CLUSTER  # 64: the K tile keys one CTA loads (its half of B's N)
K_CHUNK = 64  # columns of K per ring stage (9 stages per K tile: 8 latent + 1 rope)
K_CHUNKS = QK_HEAD_DIM // K_CHUNK  # 9
D_TILE = 256  # output columns of one P V instruction (the pair's N); each CTA supplies D_TILE // 2 of V
D_TILES = KV_LORA_RANK // D_TILE  # 2
V_KEYS = 32  # keys per V ring stage (same bytes as a K stage: 128 columns x 32 keys = 64 keys x 64 columns)
V_STAGES_PER_TILE = (BLOCK_N // V_KEYS) * D_TILES  # 8
K_STAGES_PER_TILE = K_CHUNKS  # 9

S_STAGES = 2  # S accumulators in TMEM (softmax of tile j overlaps S of tile j + 1)
P_STAGES = 2  # P tiles in shared memory
COR_STAGES = 2  # per-tile rescale factors handed from the softmax to the correction warps
O_STAGES = 1

# ---- tensor memory (per CTA: 128 lanes x 512 columns of 32 bit). 2-CTA M=128 accumulators fold their N
# columns across the two 64-lane halves (PTX data-path layout B), so an N-column accumulator takes N / 2 ----
TMEM_S_COLS = BLOCK_N // CLUSTER  # 64 per S stage
TMEM_O_OFFSET = S_STAGES * TMEM_S_COLS  # 128
TMEM_O_COLS = KV_LORA_RANK // CLUSTER  # 256 (two D tiles of 128)
TMEM_ALLOC_COLS = 512  # tcgen05.alloc takes a power of two >= 32
TMEM_MAX_COLS = 512

# ---- warp roles (12 warps; setmaxnreg works per warp group) ----
NUM_WARPS = 12
NUM_THREADS = 32 * NUM_WARPS
SOFTMAX_WARPS = (0, 1, 2, 3)  # thread t reads TMEM lane t: row t % 64, keys 64 (t // 64) .. + 63 of S
CORRECTION_WARPS = (4, 5, 6, 7)  # Q load, O rescale, epilogue; thread c reads lane c of O
MMA_WARP = 8
TMA_WARP = 9
IDLE_WARPS = (10, 11)
REGS_SOFTMAX = 192
REGS_CORRECTION = 208
REGS_OTHER = 96  # MMA, TMA and idle warps
REGISTER_FILE = 65536

# ---- softmax ----
# A row's running maximum is only raised (and O rescaled) when the tile's maximum exceeds it by more than this
# (log2 units): P then stays <= 2^8, exact in fp32 sums and bf16/fp16 P, and O, l and the LSE all use the same
# stale maximum, so the result is exact. e4m3 P is stored as P x 256 and must stay <= 448: no slack.
RESCALE_THRESHOLD_16BIT = 8.0
RESCALE_THRESHOLD_FP8 = 0.0
P_SCALE_FP8 = 256.0  # P is stored as e4m3(P x 256); probabilities down to 2^-14 stay normal
Q_FP8_TARGET = 448.0  # per-row q scale of the hi + lo split: max |q_row| -> 448 (e4m3 max)

# ---- shared memory ----
SMEM_LIMIT = 232_448  # opt-in shared memory per block on SM100/SM103 (227 KB)
SMEM_RESERVED = 1024  # the DSL's reserved region (cuobjdump: SHARED:1024 static), outside the kernel's struct
SMEM_MARGIN = 4096  # kept free
MAX_KV_STAGES = 48
# the struct's small fields (bytes): TMEM address, row max/sum exchange (2 x 128 fp32), rescale factors
# (COR_STAGES x 64), final row max and sum and per-row q scale (3 x 64); mbarriers are counted per stage
SMEM_SMALL_FIELDS = 4 + 4 * (2 * 128 + COR_STAGES * 64 + 3 * 64)
SMEM_FIXED_MBARRIERS = 2 + 2 * S_STAGES + 2 * P_STAGES + 2 * COR_STAGES + 2 * O_STAGES + 1  # + 2 per KV stage

LOG2E = 1.4426950408889634

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class Variant(CuteVariant):
    """cute_sm100's variant: the common fields (cute_common/variant.py); one kernel form per dtype combination.
    ``fp8``: the MMAs run kind::f8f6f4 (e4m3), else kind::f16 in the cache's dtype."""

    FAMILY = "cute_sm100"

    @property
    def q_parts(self) -> int:
        """Q products per k-step: 2 for a 16-bit q on an fp8 cache (e4m3 hi + lo), else 1."""
        return 2 if self.fp8 and self.q_dtype != "fp8" else 1


def m_blocks(num_heads: int, q_len: int) -> int:
    """m-blocks (CTA pairs) per work item."""
    return -(-(num_heads * q_len) // BLOCK_M)


def stage_bytes(variant: Variant) -> int:
    """One KV ring stage: a 64-key x 64-column K chunk, or a 32-key x 128-column V block, of one CTA."""
    return CTA_KEYS * K_CHUNK * ELEM_BYTES[variant.kv_dtype]


def q_bytes(variant: Variant) -> int:
    return variant.q_parts * CTA_ROWS * QK_HEAD_DIM * ELEM_BYTES[variant.kv_dtype]


def p_bytes(variant: Variant) -> int:
    return P_STAGES * CTA_ROWS * BLOCK_N * ELEM_BYTES[variant.kv_dtype]


def header_bytes(stages: int) -> int:
    """mbarriers and the small fields, padded to the 1 KB alignment of Q (the swizzle atom)."""
    raw = 8 * (SMEM_FIXED_MBARRIERS + 2 * stages) + SMEM_SMALL_FIELDS
    return -(-raw // 1024) * 1024


def _dynamic_bytes(variant: Variant, stages: int) -> int:
    return header_bytes(stages) + q_bytes(variant) + p_bytes(variant) + stages * stage_bytes(variant)


def kv_stages(variant: Variant) -> int:
    """KV ring depth: the most stages that leave SMEM_MARGIN of the per-block limit free."""
    stages = MAX_KV_STAGES
    while SMEM_RESERVED + _dynamic_bytes(variant, stages) + SMEM_MARGIN > SMEM_LIMIT:
        stages -= 1
    return stages


def dynamic_shared_bytes(variant: Variant) -> int:
    """The kernel's shared-storage struct (header, Q, P, KV ring; each big buffer 1 KB aligned). The kernel checks
    at trace time that the DSL lays it out in exactly this many bytes."""
    return _dynamic_bytes(variant, kv_stages(variant))


def shared_bytes(variant: Variant) -> int:
    """Shared memory of one CTA: the struct plus the DSL's reserved region."""
    return SMEM_RESERVED + dynamic_shared_bytes(variant)


def tmem_columns() -> int:
    """TMEM columns one CTA uses: S_STAGES S accumulators and the two O tiles."""
    return TMEM_O_OFFSET + TMEM_O_COLS


def rescale_threshold(variant: Variant) -> float:
    return RESCALE_THRESHOLD_FP8 if variant.fp8 else RESCALE_THRESHOLD_16BIT


def softmax_scale_log2(softmax_scale: float) -> float:
    """The kernel's softmax runs in the log2 domain (here, so a host without the DSL can launch a prebuilt
    kernel without importing cutlass)."""
    return float(softmax_scale) * LOG2E
