"""Host side of the CuTe-DSL SM90 decode kernel: support checks, launch configs, the compile cache, the launch.

Importable without cutlass (the registry asks ``unsupported_reason`` on any machine); the DSL is imported on
first compile. Each variant (config.Variant: dtypes, heads, q_len, block size, scale forms, fp8 design) is
compiled once per process with fake tensors whose batch, lengths and strides are symbolic, so one binary
serves every batch size and cache size; ``--enable-tvm-ffi`` lets the compiled function take torch tensors
directly, and the on-disk cache (cute_common/aot.py) keeps it across processes and hosts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.kernels.cute_common import background
from mla_backend_plugin.kernels.cute_common.aot import AotCache, compiled_from_cache_or_jit
from mla_backend_plugin.kernels.cute_common.host import (
    COOPERATIVE,
    DTYPE_NAMES,
    LAST_CTA,
    aligned_rows_reason,
    current_cu_stream,
    dsl_missing,
    scale_launch_args,
)
from mla_backend_plugin.kernels.cute_sm90 import MANIFEST
from mla_backend_plugin.kernels.cute_sm90.config import (
    BLOCK_M,
    BLOCK_N,
    FP8_SEESAW_MAX_SLACK,
    SEESAW_KV_MULTICAST,
    SEESAW_KV_MULTICAST_BLOCK_SIZES,
    SEESAW_KV_MULTICAST_MIN_BATCH,
    SEESAW_L2_PREFETCH,
    SEESAW_MAX_SLACK,
    PlanVariant,
    Variant,
    has_max_slack,
    m_blocks,
    multicast_fits,
    softmax_scale_log2,
)
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.manifest import FP8_DESIGNS, LaunchConfig, PlanTile
from mla_backend_plugin.ops.workspace import capturing, step_needs_plan

ARCH = MANIFEST.archs[0]  # sm_90a
STEP_PLAN = PlanVariant(BLOCK_N)
# the step-plan kernel's ``shares`` argument per device plan, times W (cute_common/scheduler.py StepPlanKernel)
STEP_PLAN_MODES = {"balanced": 0, "shares": 1, "auto": -1}
AOT = AotCache.for_family("cute_sm90", "mla_decode_sm90", os.path.dirname(os.path.abspath(__file__)), __name__)


def unsupported_reason(args, cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc != (9, 0):
        return f"is built for sm_90a (H100/H200) only, device has compute capability {cc[0]}.{cc[1]}"
    why = aligned_rows_reason(args, outputs=True)
    if why:
        return why
    missing = dsl_missing()
    if missing:  # no JIT here: only a prebuilt library of the default variant can run (cute_common/aot.py)
        config = default_config(args, cc)
        why = (AOT.prebuilt_reason(variant_for(args, config), config.enable_pdl, ARCH)
               or AOT.prebuilt_reason(STEP_PLAN, config.enable_pdl, ARCH))
        if why:
            return f"{missing} and no prebuilt library can be used: {why}; {AOT.prebuild_hint(ARCH)}"
    return None


# fp8 caches, CUTE_MLA_FP8_DESIGN=auto, 16-bit q: design A ("dequant") up to this batch, design B ("fp8mma")
# above. At batch 1-2 each CTA has a few tiles and design B's fixed cost (q split into e4m3 hi + lo, a larger
# kernel) outweighs its faster tiles: H100, B 1-2 x S 1k/8k x q_len 1/2, A took 19.4-46.9 us where B took
# 27.7-50.7; from B=8 on B is faster (docs/perf/cute_sm90_fp8.md). An fp8 q has no
# split to pay for: never design A (B at B 1-2: 10-44% faster than A; same file).
FP8_DEQUANT_MAX_BATCH = 2


# fp8 caches, CUTE_MLA_FP8_DESIGN=auto, fp8 q: design C ("fp8seesaw", kernel_fp8seesaw.py, an fp8 q only) from this
# batch, design B below; design C stays a tuner candidate at every batch (configs). Measured on design C's lean
# softmax (H200, 2026-11-29, benchmarks/results/fp8_softmax_h200/small_batch.txt, C against B at B 1-6 x S 1k-32k x
# q_len 1-2 beside FlashMLA): C / B 0.89 at B=6 (0.73-1.07, the 1.07 at S = 1-2k q_len 1), 0.93 at B=4 but 1.19 at
# S = 1k, 1.01 at B=2; C wins from S = 4-8k at every batch and loses up to 1.23x at S <= 2k below 6, so design B
# stays there (the launch knows the batch, not the step's lengths). Earlier thresholds (32, 16, 8) and their
# grids: docs/perf/cute_sm90_fp8.md.
FP8_SEESAW_MIN_BATCH = 6


def fp8_design_for(args) -> str:
    """CUTE_MLA_FP8_DESIGN for these arguments: ``auto`` resolved by q dtype and batch (an fp8 q: design C from
    FP8_SEESAW_MIN_BATCH, B below; a 16-bit q: A up to FP8_DEQUANT_MAX_BATCH, B above); ``fp8seesaw`` (design C takes
    an fp8 q only) is a preference, so a 16-bit q runs design B under it (``mla_decode(fp8_design="fp8seesaw")``
    with a 16-bit q is refused by name instead)."""
    design = envs.CUTE_MLA_FP8_DESIGN
    if design == "auto":
        if args.q_dtype == FP8_DTYPE:
            design = "fp8seesaw" if args.batch >= FP8_SEESAW_MIN_BATCH else "fp8mma"
        else:
            design = "dequant" if args.batch <= FP8_DEQUANT_MAX_BATCH else "fp8mma"
    elif design == "fp8seesaw" and args.q_dtype != FP8_DTYPE:
        design = "fp8mma"
    return design


# fp8 caches, design B ("fp8mma") with an fp8 q: the smallest split, in tokens (one 64-key tile; the workspace's
# default is 128). Measured (nvidia-h200, 2026-11-29, both in one run beside FlashMLA fp8, B 1-8 x S 1k-8k x q_len
# 1-2; benchmarks/results/fp8_small_batch_h200/min_chunk/): 0.88-0.99x the time where the chunk binds (B x S below
# ~4k tokens; B=1 S=1k 14.09 -> 12.75 us against FlashMLA's 12.56), the same work items elsewhere, and a lower max
# error (above FlashMLA's in 7 of 32 cells against 12): each split's largest P is exact in e4m3, so more splits of a
# short context round less of P. With a 16-bit cache 64-token chunks were 4-23% slower; designs A and C keep the
# workspace's.
FP8_Q_DESIGN_B_MIN_CHUNK = 64


def design_min_chunk(args, design: str | None) -> int | None:
    """The smallest split (tokens) a default config of this fp8 design runs with; None = the workspace's."""
    return FP8_Q_DESIGN_B_MIN_CHUNK if design == "fp8mma" and args.q_dtype == FP8_DTYPE else None


KV_MULTICAST_ENV = {"auto": None, "1": True, "0": False}  # CUTE_MLA_SM90_KV_MULTICAST -> LaunchConfig.kv_multicast


def default_config(args, cc) -> LaunchConfig:
    """What runs when nobody chose: the environment's split plan, PDL, fp8 design (fp8 caches) and the design's
    smallest split, schedule and KV multicast (16-bit caches) and fused combine (envs.py)."""
    fp8 = args.kv_dtype == FP8_DTYPE
    design = fp8_design_for(args) if fp8 else None
    return LaunchConfig(split_plan=envs.CUTE_MLA_SM90_PLAN, enable_pdl=envs.CUTE_MLA_PDL, fp8_design=design,
                        min_chunk=design_min_chunk(args, design),
                        schedule=None if fp8 else envs.CUTE_MLA_SM90_SCHEDULE,
                        kv_multicast=None if fp8 else KV_MULTICAST_ENV[envs.CUTE_MLA_SM90_KV_MULTICAST],
                        fused_combine=envs.CUTE_MLA_FUSED_COMBINE,
                        last_cta_combine=envs.CUTE_MLA_LAST_CTA_COMBINE)


def configs(args, cc) -> list[LaunchConfig]:
    """The default, then: the other fp8 designs (fp8 caches; design C with an fp8 q only), each also with a larger
    split cap. 16-bit caches offer the seesaw only: the lock step (and seesaw32, removed) ran slower in all 48
    cells of the standard grid beside the seesaw with its L2 prefetch (nvidia-h200, 2026-11-29,
    docs/perf/cute_sm90_bf16.md). PDL stays as the default has it: a lone kernel times the same with it on and off
    (docs/perf/method.md), and PDL-off variants are not prebuilt. All under the default's split plan (the share plan
    is not a tuner candidate, docs/perf/split_plan.md) and combine: the combine kernel after a grid that fits at once
    was slower or equal in every cell measured (docs/perf/combine.md: the fused combine 0.92x time geomean, no cell
    above 1.010x)."""
    first = default_config(args, cc)
    out = [first]
    if first.fp8_design is not None:
        fp8_q = args.q_dtype == FP8_DTYPE
        out += [dataclasses.replace(first, fp8_design=d, min_chunk=design_min_chunk(args, d)) for d in FP8_DESIGNS
                if d != first.fp8_design and (fp8_q or d != "fp8seesaw")]
    out += [dataclasses.replace(c, max_splits=64) for c in list(out)]
    return list(dict.fromkeys(out))


def plan_tile(num_heads: int, smem_per_block, config) -> PlanTile:
    return PlanTile(rows_per_cta=BLOCK_M, block_n=BLOCK_N)


def variant_for(args, config: LaunchConfig, kv_multicast: bool = False) -> Variant:
    design = config.fp8_design or "fp8mma"
    fp8_mma = args.kv_dtype == FP8_DTYPE and design in ("fp8mma", "fp8seesaw")
    fp8_seesaw = args.kv_dtype == FP8_DTYPE and design == "fp8seesaw"
    schedule = schedule_for(args, config)
    return Variant(kv_dtype=DTYPE_NAMES[args.kv_dtype], q_dtype=DTYPE_NAMES[args.q_dtype],
                   out_dtype=DTYPE_NAMES[args.out.dtype], num_heads=args.num_heads, q_len=args.q_len,
                   block_size=args.block_size, q_scale_is_ptr=isinstance(args.q_scale, torch.Tensor),
                   kv_scale_is_ptr=isinstance(args.kv_scale, torch.Tensor), fp8_mma=fp8_mma,
                   fp8_seesaw=fp8_seesaw, row_kv_lens=args.row_kv_lens is not None, schedule=schedule,
                   l2_prefetch=l2_prefetch_for(args, config), kv_multicast=kv_multicast,
                   max_slack=max_slack_for(fp8_seesaw, DTYPE_NAMES[args.kv_dtype], schedule, config))


def max_slack_for(fp8_seesaw: bool, kv_dtype: str, schedule: str, config: LaunchConfig) -> float:
    """The running max's slack of a seesaw kernel (design C, the 16-bit seesaw): the config's, else the family's
    default for that kernel; 0 for the other kernels (they have none: config.has_max_slack)."""
    if not has_max_slack(fp8_seesaw, kv_dtype, schedule):
        return 0.0
    if config.max_slack is not None:
        return float(config.max_slack)
    return FP8_SEESAW_MAX_SLACK if fp8_seesaw else SEESAW_MAX_SLACK


def may_multicast(args, config: LaunchConfig) -> bool:
    """Whether this config runs the KV multicast where a call's split grid does not fit at once: the config's
    ``kv_multicast``, else the default (SEESAW_KV_MULTICAST with the page sizes and the smallest batch it was
    measured to pay at); only kernels with a cluster-divisible m-block count have one."""
    wanted = config.kv_multicast
    if wanted is None:
        wanted = (SEESAW_KV_MULTICAST and args.block_size in SEESAW_KV_MULTICAST_BLOCK_SIZES
                  and args.batch >= SEESAW_KV_MULTICAST_MIN_BATCH)
    return wanted and multicast_fits(variant_for(args, config))


def kv_multicast_for(args, config: LaunchConfig, fused: bool) -> bool:
    """The KV multicast for one call: where the config may run it (may_multicast) and the CTAs do not merge
    together (``fused``, COOPERATIVE): that merge waits for every CTA of the grid, which is safe only when all are
    resident at once, and a grid of clusters does not promise that at the SM count (a GPC with an odd number of free
    SMs leaves one idle). A grid that fits at once has at most one CTA per SM and no second wave to overlap. Where
    the DSL is missing only a prebuilt multicast variant can run; without one the call runs the plain kernel (the
    one unsupported_reason asks for)."""
    if fused or not may_multicast(args, config):
        return False
    return not dsl_missing() or AOT.prebuilt_reason(variant_for(args, config, True), config.enable_pdl, ARCH) is None


def l2_prefetch_for(args, config: LaunchConfig) -> int:
    """The config's L2 prefetch distance where the kernel has one (the 16-bit seesaw), else 0."""
    if schedule_for(args, config) != "seesaw":
        return 0
    return SEESAW_L2_PREFETCH if config.l2_prefetch is None else config.l2_prefetch


def schedule_for(args, config: LaunchConfig) -> str:
    """The config's schedule (16-bit caches; a config without one: CUTE_MLA_SM90_SCHEDULE); fp8 caches have one
    schedule per design ("lockstep")."""
    if args.kv_dtype == FP8_DTYPE:
        return "lockstep"
    return config.schedule or envs.CUTE_MLA_SM90_SCHEDULE


def compile_variant(variant: Variant | PlanVariant, use_pdl: bool = True, arch: str | None = None,
                    keep_dir: str | None = None):
    """Compile one variant with symbolic sizes (cute_common/fake_tensors.py); ``arch`` (e.g. "sm_90a") compiles
    with no GPU present."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from mla_backend_plugin.kernels.cute_common.compat import compile_options
    from mla_backend_plugin.kernels.cute_common.fake_tensors import DTYPES, decode_tensors, int32_vector

    if isinstance(variant, PlanVariant):  # the step-plan kernel (cute_common/scheduler.py StepPlanKernel)
        from mla_backend_plugin.kernels.cute_common.scheduler import StepPlanKernel

        ints = [int32_vector() for _ in range(3)]
        return cute.compile(StepPlanKernel(variant.block_n, use_pdl=use_pdl), *ints, cutlass.Int32(1),
                            cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(0),
                            make_fake_stream(), options=compile_options(arch, keep_dir))
    if variant.fp8_seesaw:
        from mla_backend_plugin.kernels.cute_sm90.kernel_fp8seesaw import Sm90MlaDecodeFp8Seesaw as kernel_class
    elif variant.fp8_mma:
        from mla_backend_plugin.kernels.cute_sm90.kernel_fp8mma import Sm90MlaDecodeFp8Mma as kernel_class
    elif variant.schedule == "seesaw":
        from mla_backend_plugin.kernels.cute_sm90.kernel_seesaw import Sm90MlaDecodeSeesaw as kernel_class
    else:
        from mla_backend_plugin.kernels.cute_sm90.kernel import Sm90MlaDecode as kernel_class

    # A split item stores its partial O / l in the output dtype, not fp32, as FlashInfer's MLA kernels do: a
    # 64-row CTA writes 64 KB instead of 128 KB (a bf16 KV tile is 72 KB) and the combine reads half, for one
    # more rounding of the output dtype on each partial (docs/perf/cute_sm90_bf16.md). The LSEs stay fp32.
    t = decode_tensors(variant, partial_dtype=DTYPES[variant.out_dtype])
    # row_kv_lens flattened ([B * q_len]); read only by row_kv_lens variants (others get seq_lens, unread)
    row_kv_lens = int32_vector()
    work_items = int32_vector()
    combine_counters = int32_vector()
    op = kernel_class(variant, use_pdl=use_pdl)
    return cute.compile(op, t.q_nope, t.q_pe, t.kv, t.block_table, t.seq_lens, row_kv_lens, t.out, t.lse, t.part_o,
                        t.part_lse, t.q_scale, t.kv_scale, cutlass.Float32(1.0), cutlass.Float32(1.0),
                        cutlass.Float32(1.0), work_items, cutlass.Int32(1), combine_counters, cutlass.Int32(0),
                        make_fake_stream(), options=compile_options(arch, keep_dir))


def prebuild(args, config: LaunchConfig, cc) -> bool:
    """Start compiling what ``launch(args, ..., config)`` runs in background processes (cute_common/background.py):
    the variant and the step-plan kernel (every launch plans its step with it); True when a build is running."""
    split = background.start(AOT, variant_for(args, config), config.enable_pdl, ARCH)
    multicast = may_multicast(args, config) and background.start(AOT, variant_for(args, config, True),
                                                                 config.enable_pdl, ARCH)
    step_plan = background.start(AOT, STEP_PLAN, config.enable_pdl, ARCH)
    return split or multicast or step_plan


@functools.cache
def _compiled(variant: Variant | PlanVariant, use_pdl: bool):
    """The variant's function, from the on-disk cache or compiled now (and cached). Runs outside CUDA-graph
    capture: vLLM's warm-up and the first eager call reach it first."""
    return compiled_from_cache_or_jit(
        AOT, variant, use_pdl, ARCH, lambda: compile_variant(variant, use_pdl, arch=ARCH),
        lambda msg: warnings.warn(msg, RuntimeWarning, stacklevel=3))


# The fused combine's counters (one int32 per (request, m-block) of the workspace's largest step): a
# zero-initialised scratch buffer of the workspace, reset by the kernel after each use.
COMBINE_SCRATCH = "cute_sm90_combine_counters"
COMBINE_COUNTERS = 1024  # at least this many: more than any GPU's SM count


def scratch(cc, max_batch: int, max_q_len: int, num_heads: int, num_sms: int) -> tuple[str, int] | None:
    return (COMBINE_SCRATCH, 4 * max(COMBINE_COUNTERS, max_batch * m_blocks(num_heads, max_q_len))) \
        if cc == (9, 0) else None


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fuses_combine(args, plan, wanted: bool = True) -> bool:
    """Whether the split kernel's CTAs merge a request's partials together (cute_common/epilogue.py
    ``fused_combine``, COOPERATIVE) instead of a second launch: when ``wanted`` (the config's ``fused_combine``)
    and the grid (m-blocks x work items) fits on the device's SMs at one CTA each, since a request's CTAs wait for
    each other there."""
    if not (plan.has_combine and wanted):
        return False
    ctas = m_blocks(args.num_heads, args.q_len) * plan.grid_items
    return ctas <= min(_device_sms(args.q_nope.device.index), COMBINE_COUNTERS)


# LAST_CTA in CUDA graphs only where the plan's work items per request (its mean split count) are at most this:
# one CTA merges a request's 64 rows over all of its splits at the end of the grid, which the combine kernel spreads
# over many CTAs. H200, 2026-11-28 (bench_decode, graphs, the first merge loop): at 9 splits a request (B=8, 128
# heads) it cost +15 us a call, at ~3 (B=32 S=1k) +15 us, at <= 2 (B >= 64) -6 .. +3%. Eager calls take it at any
# split count: there the combine kernel's launch costs 30-50 us of host time, more than the merge costs the GPU.
LAST_CTA_MAX_MEAN_SPLITS = 4


def last_cta_merges(args, plan, config: LaunchConfig, counters: int) -> str | None:
    """When a split grid too large for COOPERATIVE merges in the kernel by each request's last CTA (LAST_CTA:
    nobody waits, so any grid): the config's ``last_cta_combine`` ("eager" or "always"); "eager" where the plan
    has more than LAST_CTA_MAX_MEAN_SPLITS work items per request (graphs keep the combine kernel there); or None
    (the combine kernel): with ``fused_combine`` off, policy "never", no split, or fewer ``counters`` in the
    workspace than (requests x m-blocks)."""
    if not (plan.has_combine and config.fused_combine and config.last_cta_combine != "never"):
        return None
    if args.batch * m_blocks(args.num_heads, args.q_len) > counters:
        return None
    return "eager" if plan.grid_items > LAST_CTA_MAX_MEAN_SPLITS * args.batch else config.last_cta_combine


def combine_mode(fused: bool, last_cta: str | None, device: torch.device) -> int:
    """The split kernel's ``fuse_combine`` argument for this call: COOPERATIVE where the grid fits at once;
    LAST_CTA where ``last_cta_merges`` says "always", or "eager" and this call is not being captured into a CUDA
    graph (an eager call's combine kernel costs a second launch's host time); else 0, the combine kernel."""
    if fused:
        return COOPERATIVE
    if last_cta == "always" or (last_cta == "eager" and not capturing(device)):
        return LAST_CTA
    return 0


@functools.lru_cache(maxsize=256)
def _with_split_caps(config: LaunchConfig, cap: int | None, long_cap: int | None) -> LaunchConfig:
    return dataclasses.replace(config, max_splits=cap, long_splits=long_cap)


def wave_filling_config(args, workspace, config: LaunchConfig) -> LaunchConfig:
    """A config without its own split cap gets the workspace's default (32), which leaves part of a wave of work
    items idle when batch x 32 < W (the balanced plan's items per m-block: 66 at 128 heads and q_len 1 on 132
    SMs): at B=1 only 32 of the 66 slots. Such a config gets min(W // batch, the workspace's split capacity) instead
    (B=1: 64), so a one-request step fills the GPU: B=1 S=32k fp8 42.6 -> 30.8 us, bf16 51.2 -> 44.7
    (docs/perf/split_plan.md). The grid stays within one wave (at most W items), so the fused combine still
    serves it; the cap of 64 at B=2 (a grid bound of B + W - 1 = 67 items: 134 CTAs on 132 SMs, so the separate
    combine) cost 6-33% there. W comes from the memoised plan (launch checks the plan it runs with plan_for).

    Such a config also gets the split capacity as its long cap (SplitPlan.long_splits: a request whose items at
    the cap would hold over 1.5x the plan's tiles per item may take up to that many; ops/plan.py
    balanced_schedule) where the grid stays as it is: batch x cap >= batch + W - 1, so from B=3 at the default
    cap, never at B <= 2, whose fused combine needs the grid within one wave."""
    if config.max_splits is not None or not config.balanced:
        return config
    work = workspace.plan(args.batch, args.q_len, True, BLOCK_M, device_plan=config.device_plan).work_target
    wave_cap = min(workspace.split_capacity, work // args.batch)
    cap = wave_cap if wave_cap > workspace.max_splits else None
    runs_cap = cap or workspace.max_splits
    long_cap = config.long_splits
    if long_cap is None and workspace.split_capacity > runs_cap and args.batch * runs_cap >= args.batch + work - 1:
        long_cap = workspace.split_capacity
    return config if cap is None and long_cap is None else _with_split_caps(config, cap, long_cap)


def launch_setup(args, workspace, config: LaunchConfig) -> tuple:
    """(compiled function, the config it runs, its plan, whether the CTAs merge together (COOPERATIVE), whether
    the last CTA may merge (LAST_CTA), the counters as int32 (any int32 tensor where the kernel never merges), the
    scale tensors' stand-in) of ``launch(args, workspace, config)``:
    functions of what the key below holds, so they are worked out once per key and kept in the workspace (an
    engine's eager calls repeat one shape per layer and step)."""
    key = ("cute_sm90.launch", config, args.batch, args.q_len, args.num_heads, args.kv_cache.shape[1],
           args.kv_cache.dtype, args.q_nope.dtype, args.out.dtype, type(args.q_scale), type(args.kv_scale),
           args.row_kv_lens is None, schedule_for(args, config), args.q_nope.device.index)
    prepared = workspace.decisions.get(key)
    if prepared is None:
        run_config = wave_filling_config(args, workspace, config)
        # the device schedule packs a 128-request step's slot count into 16 bits: 128 * max_splits (<= 64, the
        # workspace's limit) < 2^16
        plan = workspace.plan_for(args, PlanTile(BLOCK_M, BLOCK_N), run_config)
        fused = fuses_combine(args, plan, run_config.fused_combine)
        fn = _compiled(variant_for(args, config, kv_multicast_for(args, config, fused)), config.enable_pdl)
        counters = workspace.scratch.get(COMBINE_SCRATCH)
        last_cta = None if fused else last_cta_merges(args, plan, run_config,
                                                      0 if counters is None else counters.numel() // 4)
        # a launch that never merges never reads the counters: any int32 tensor stands in; None: merging with no
        # counters in this workspace (launch raises naming them)
        if fused or last_cta:
            counters = None if counters is None else counters.view(torch.int32)
        else:
            counters = workspace.split_index
        prepared = workspace.decisions[key] = (fn, run_config, plan, fused, last_cta, counters,
                                               workspace.partial_lse[:1])
    return prepared


def launch(args, workspace, config: LaunchConfig) -> None:
    from mla_backend_plugin.kernels.combine.kernel import launch_combine

    if not config.balanced:
        raise ValueError(f"cute_sm90: config: split_plan {config.split_plan!r}; allowed: balanced, shares, auto "
                         "(the kernel's device schedules)")
    fn, config, plan, fused, last_cta, counters, dummy = launch_setup(args, workspace, config)
    q_scale_t, kv_scale_t, q_scale, kv_scale = scale_launch_args(args, dummy)
    stream = current_cu_stream(args.q_nope.device)
    row_kv_lens = args.row_kv_lens.view(-1) if args.row_kv_lens is not None else args.seq_lens
    if step_needs_plan(args.step, workspace, args.seq_lens, (BLOCK_N, plan)):
        # the step's work items and the combine's split list, once per step (every call without a step)
        _compiled(STEP_PLAN, config.enable_pdl)(args.seq_lens, workspace.split_index, workspace.work_items,
                                                plan.num_splits, plan.request_split_limit, plan.min_chunk,
                                                plan.work_target, plan.grid_items,
                                                STEP_PLAN_MODES[plan.device_plan] * plan.work_target, stream)
    mode = combine_mode(fused, last_cta, args.q_nope.device)
    if counters is None:
        counters = workspace.scratch_for(COMBINE_SCRATCH)  # raises: this workspace has no counters
    fn(args.q_nope, args.q_pe, args.kv_cache, args.block_table, args.seq_lens, row_kv_lens, args.out, args.lse,
       workspace.partials_as(args.out.dtype), workspace.partial_lse, q_scale_t, kv_scale_t, q_scale, kv_scale,
       softmax_scale_log2(args.softmax_scale), workspace.work_items, plan.grid_items, counters, mode, stream)
    if plan.has_combine and not mode:
        # an ordinary stream-ordered launch, not a programmatic dependent of the split kernel: launched early it
        # cost B=1 q_len 2 more than it saved anywhere (docs/perf/method.md, PDL)
        launch_combine(args, workspace, plan, BLOCK_N, use_pdl=False, partial_dtype=args.out.dtype)
