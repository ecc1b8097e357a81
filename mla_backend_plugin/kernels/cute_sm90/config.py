"""Static configuration of the CuTe-DSL SM90 decode kernel (no cutlass import: the planner and CPU tests read it)."""

from __future__ import annotations

import dataclasses

from mla_backend_plugin.kernels.cute_common.variant import Variant as CuteVariant
from mla_backend_plugin.ops.constants import MAX_SLACK
from mla_backend_plugin.ops.manifest import SCHEDULES  # kernel_seesaw.py, kernel.py (lock step)

# One CTA owns 64 query rows (one wgmma M) of one request and one KV split, and walks the split's keys in
# tiles of 64 (the wgmma N of Q K^T and the K of P V).
BLOCK_M = 64
BLOCK_N = 64
KV_STAGES = 2  # 2 x 72 KB bf16 KV tiles + 72 KB of Q + 8 KB of P fill the 227 KB of shared memory
# Warp groups: 0 = producer (TMA for 16-bit caches; load + fp8->16-bit conversion for fp8 caches),
# 1 and 2 = consumers, each owning 256 of the 512 output columns.
NUM_THREADS = 384
# 64-column chunks of Q each consumer keeps in registers (16 registers per chunk) and feeds to Q K^T as a
# register operand: each saves 8 KB of shared-memory reads per group and tile
Q_REG_CHUNKS = 2
# setmaxnreg budgets: consumers hold a 64x256 fp32 O slice (128 regs) and their 64x32 half of the S tile (16).
# The producer's and both consumers' budgets must sum to at most 504 (x 128 threads = the 64,512 registers a
# 384-thread CTA holds at launch, 65,536 / 384 rounded down to 8), or setmaxnreg.inc waits forever (a 32-register
# producer hung the kernel: docs/perf/cute_sm90_bf16.md; tests/test_cute_sm90_cpu.py checks it).
SETMAXNREG_SUM = 65536 // NUM_THREADS // 8 * 8 * 3
REGS_CONSUMER = 240
REGS_PRODUCER_TMA = 24
REGS_CONSUMER_FP8 = 224
REGS_PRODUCER_FP8 = 56
# fp8 design C (kernel_fp8seesaw.py): a TMA-only producer warp, consumers holding O^T (128), S (32), V^T fragments
# (32) and Q's rope chunk (8); 5 K stages of 36 KB (no V^T ring): 3 KB of barriers and row statistics + a 4 KB P^T
# tile + 36 KB Q (its rope chunk the second P^T tile) + 180 KB
REGS_CONSUMER_C = 240
REGS_PRODUCER_C = 24
STAGES_C = 5
# 16-bit caches, seesaw schedule: tile pairs the producer prefetches into L2 ahead of its TMA loads when the launch
# config does not say (LaunchConfig.l2_prefetch; measured: docs/perf/cute_sm90_bf16.md)
SEESAW_L2_PREFETCH = 1
# 16-bit caches, seesaw schedule, an even number of m-blocks (128 heads; 64 at q_len 2 and 4; 32 at q_len 3-4): the two
# m-block CTAs of a work item run as a cluster of KV_CLUSTER and each TMA-loads every other 64-column chunk of each
# KV tile into both (multicast), so every tile crosses L2 -> SM once per cluster instead of once per CTA. Only for
# split grids that do not fit on the GPU at once (launch.kv_multicast_for): the cooperative fused combine needs every
# CTA resident, which a cluster grid does not promise at one CTA per SM. The default when the launch config does not
# say (LaunchConfig.kv_multicast): on for 64-token pages from batch 32. Measured (nvidia-h200, 2026-11-29, the
# standard bf16 grid beside kv_multicast false; docs/perf/cute_sm90_bf16.md): 0.896-0.974x the time at B >= 64 and
# S >= 4096 (q_len 1), 0.92-0.96x at S = 32768 (q_len 2), within noise elsewhere, but +4% at q_len 2 B=8 S <= 4096
# (few tiles per CTA) and +3-8% with 16-token pages (+0-2% with 128-token pages) at B 64-256
KV_CLUSTER = 2
# The seesaw schedules (16-bit and fp8 design C): a row's running max moves only when a tile's max exceeds it by
# more than the variant's max_slack (log2 units; kernel.py ``moved_max``), so P = exp2(s - m) reaches up to
# 2^max_slack and the O^T / O rescale (128 multiplies per thread on the consumers' critical path, skipped when no
# row of the warp moved) is skipped on most tiles. Design C stores P as e4m3(P x p_scale_for(slack)) <= 448. The
# cost: a row's largest P is no longer exactly 1 (exact in e4m3), so its rounding error reaches the output.
# Default for design C (nvidia-h200, 2026-11-29; docs/perf/cute_sm90_fp8.md "The running max's slack"): 0.8, the
# most that keeps P's scale at 256; the 16-bit seesaw keeps 0 (not measured to pay). The largest slack a variant
# takes is ops/constants.py's MAX_SLACK (LaunchConfig checks it too).
# design C: the slack applies from this pair of a split on (its first 2 x 8 tiles = 1024 keys keep the exact max:
# the max moves on most of them anyway, and a 1k-token split keeps its accuracy)
MAX_SLACK_FROM_PAIR = 8
FP8_SEESAW_MAX_SLACK = 0.8
SEESAW_MAX_SLACK = 0.0
P_SCALE_FP8 = 256.0  # design B and C store P as e4m3(P x 256): probabilities down to 2^-14 stay normal
E4M3_MAX = 448.0
SEESAW_KV_MULTICAST = True
SEESAW_KV_MULTICAST_MIN_BATCH = 32
SEESAW_KV_MULTICAST_BLOCK_SIZES = (64,)
# The epilogue stages the 64 x 512 output tile in shared memory (Q's buffer and the KV ring after it, free by
# then) and writes whole rows with 16-byte stores. Row pitch 512 + 8 elements keeps rows 16-byte aligned and
# spreads the accumulator layout's 8 rows per warp over all 32 banks.
STAGE_ROW = 512 + 8
STAGE_BYTES = BLOCK_M * STAGE_ROW * 2  # the output dtype (a split item's partial too: launch.compile_variant)


@dataclasses.dataclass(frozen=True)
class Variant(CuteVariant):
    """cute_sm90's variant: the common fields (cute_common/variant.py) and the SM90 kernel forms."""

    FAMILY = "cute_sm90"

    # fp8 caches only: True = "design B" (kernel_fp8mma.py: fp8 wgmma on the fp8 tile, q quantised to e4m3
    # hi + lo, V transposed in shared memory), False = "design A" (kernel.py: widen the tile to 16 bits)
    fp8_mma: bool = False
    # fp8 caches with fp8_mma and an fp8 q only: "design C" (kernel_fp8seesaw.py: fp8 wgmma on the seesaw schedule,
    # P V as O^T = V^T P^T with V^T in registers), fp8_design="fp8seesaw"
    fp8_seesaw: bool = False
    # True: each query row's key count is read from a [B, q_len] tensor (decode context parallelism with MTP,
    # where the q block's own tokens are not all in this rank's cache) instead of seq_len - q_len + t + 1
    row_kv_lens: bool = False
    # 16-bit caches: "seesaw" (kernel_seesaw.py: the consumer groups alternate tiles) or "lockstep" (kernel.py:
    # both groups on every tile: design A's code, not a tuner candidate); fp8 caches: always "lockstep" (the fp8
    # kernels have one schedule each)
    schedule: str = "seesaw"
    # 16-bit caches, seesaw schedule: KV tile pairs prefetched into L2 ahead of the TMA ring (0 = off)
    l2_prefetch: int = 0
    # 16-bit caches, seesaw schedule, an even m-block count: clusters of KV_CLUSTER m-block CTAs share each KV tile
    # by TMA multicast
    kv_multicast: bool = False
    # the seesaw schedules (16-bit, design C): the running max's slack in log2 units (MAX_SLACK above)
    max_slack: float = 0.0

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if self.fp8_seesaw and not (self.kv_dtype == "fp8" and self.q_dtype == "fp8" and self.fp8_mma):
            raise ValueError(f"fp8_design='fp8seesaw' needs an fp8 q and an fp8 KV cache; got q_dtype="
                             f"{self.q_dtype!r}, kv_dtype={self.kv_dtype!r} (allowed: fp8 for both)")
        if self.kv_dtype == "fp8" and self.schedule != "lockstep":
            object.__setattr__(self, "schedule", "lockstep")
        if self.l2_prefetch and self.schedule != "seesaw":
            raise ValueError(f"l2_prefetch={self.l2_prefetch} is the 16-bit seesaw kernel's; schedule "
                             f"{self.schedule!r}, kv_dtype {self.kv_dtype!r} (allowed: 0 there)")
        if self.max_slack and not has_max_slack(self.fp8_seesaw, self.kv_dtype, self.schedule):
            raise ValueError(f"max_slack={self.max_slack} is the seesaw schedules' (16-bit seesaw, fp8 design C); "
                             f"schedule {self.schedule!r}, kv_dtype {self.kv_dtype!r}, fp8_seesaw {self.fp8_seesaw} "
                             f"(allowed: 0 there)")
        if not 0.0 <= self.max_slack <= MAX_SLACK:
            raise ValueError(f"max_slack must be in 0..{MAX_SLACK}, got {self.max_slack}")
        if self.kv_multicast and not multicast_fits(self):
            raise ValueError(f"kv_multicast is the 16-bit seesaw kernel's with an m-block count divisible by "
                             f"{KV_CLUSTER}; schedule {self.schedule!r}, kv_dtype {self.kv_dtype!r}, "
                             f"{m_blocks(self.num_heads, self.q_len)} m-block(s) (allowed: False there)")

    @property
    def compute_dtype(self) -> str:
        return self.out_dtype if self.q_dtype == "fp8" else self.q_dtype

    @property
    def options(self) -> str:
        design = ((" fp8seesaw" if self.fp8_seesaw else " fp8mma" if self.fp8_mma else " dequant")
                  if self.kv_dtype == "fp8" else "")
        rows = " row_kv_lens" if self.row_kv_lens else ""
        schedule = f" {self.schedule}" if self.kv_dtype != "fp8" and self.schedule != "seesaw" else ""
        l2 = f" l2pf{self.l2_prefetch}" if self.l2_prefetch else ""
        mc = f" mc{KV_CLUSTER}" if self.kv_multicast else ""
        slack = f" slack{self.max_slack:g}" if self.max_slack else ""
        return f"{design}{rows}{schedule}{l2}{mc}{slack}"


def has_max_slack(fp8_seesaw: bool, kv_dtype: str, schedule: str) -> bool:
    """Whether a kernel takes a running-max slack: the seesaw schedules (fp8 design C, the 16-bit seesaw)."""
    return fp8_seesaw or (kv_dtype != "fp8" and schedule == "seesaw")


def p_scale_for(max_slack: float) -> float:
    """Design C's scale of P in e4m3: 256 while 256 x 2^max_slack fits e4m3, else the largest power of two that
    keeps P's largest value, 2^max_slack, at or below 448."""
    scale = P_SCALE_FP8
    while scale * 2.0 ** max_slack > E4M3_MAX:
        scale /= 2.0
    return scale


def multicast_fits(variant: Variant) -> bool:
    """Whether a variant's kernel can share its KV tiles over a cluster (Variant.kv_multicast): the 16-bit seesaw
    with an m-block count the cluster divides (the m-blocks of one work item are adjacent in the grid's x)."""
    return (variant.kv_dtype != "fp8" and variant.schedule == "seesaw"
            and m_blocks(variant.num_heads, variant.q_len) % KV_CLUSTER == 0)


@dataclasses.dataclass(frozen=True)
class PlanVariant:
    """The step-plan kernel (cute_common/scheduler.py ``StepPlanKernel``): writes a step's work items of the
    balanced plan for split kernels of KV tile ``block_n``; one binary serves every variant of the family."""

    block_n: int

    @property
    def name(self) -> str:
        return f"cute_sm90 step plan bn{self.block_n}"


def m_blocks(num_heads: int, q_len: int) -> int:
    return -(-(num_heads * q_len) // BLOCK_M)


def shared_bytes(variant: Variant | None = None) -> int:
    """Dynamic shared memory of one CTA: mbarriers and the two groups' exchanged row statistics (padded to the
    1 KB swizzle alignment), P, Q, the KV ring. Design A stages 16-bit tiles (fp8 caches widened on the way
    in); design B keeps P, Q (hi and lo, unless q is fp8) and the KV tiles in e4m3 plus a V^T ring; design C a P_A^T
    tile (after a 3 KB first part: six rows of row factors), Q, a second P_B^T tile (the first is Q's rope chunk)
    and STAGES_C K tiles in e4m3: 232,448 bytes, sm_90's opt-in maximum per block."""
    if variant is not None and variant.fp8_seesaw:
        return 3072 + 2 * BLOCK_M * BLOCK_N + BLOCK_M * 576 + STAGES_C * BLOCK_N * 576
    if variant is not None and variant.kv_dtype == "fp8" and variant.fp8_mma:
        q_parts = 1 if variant.q_dtype == "fp8" else 2
        return 2048 + BLOCK_M * BLOCK_N + q_parts * BLOCK_M * 576 + KV_STAGES * BLOCK_N * (576 + 512)
    return 2048 + BLOCK_M * BLOCK_N * 2 + BLOCK_M * 576 * 2 + KV_STAGES * BLOCK_N * 576 * 2


def epilogue_stage_room(variant: Variant | None = None) -> int:
    """Bytes from the start of Q's buffer to the end of the CTA's shared memory (Q, then the KV ring(s), in
    every design's layout): where the epilogue stages its tile."""
    if variant is not None and variant.fp8_seesaw:
        return BLOCK_M * 576 + BLOCK_M * BLOCK_N + STAGES_C * BLOCK_N * 576
    p_bytes = BLOCK_M * BLOCK_N * (1 if variant is not None and variant.kv_dtype == "fp8" and variant.fp8_mma else 2)
    return shared_bytes(variant) - 2048 - p_bytes


LOG2E = 1.4426950408889634


def softmax_scale_log2(softmax_scale: float) -> float:
    """The kernel's softmax runs in the log2 domain (here, not in kernel.py, so a host without the DSL can
    launch a prebuilt kernel without importing cutlass)."""
    return float(softmax_scale) * LOG2E
