"""Host side of the CuTe-DSL SM100 decode kernel: support checks, launch configs, the compile cache, the launch.

Importable without cutlass (the registry asks ``unsupported_reason`` on any machine); the DSL is imported on
first compile. Each variant (config.Variant) is compiled once per process for the sm_100 family (sm_100f: one
cubin for sm_100 and sm_103) with fake tensors whose batch, lengths and strides are symbolic, so one binary serves
every batch and cache size; the on-disk cache (cute_common/aot.py) keeps it across processes and hosts.
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
    DTYPE_NAMES,
    aligned_rows_reason,
    current_cu_stream,
    dsl_missing,
    scale_launch_args,
)
from mla_backend_plugin.kernels.cute_sm100.config import BLOCK_N, CTA_ROWS, Variant, softmax_scale_log2
from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile

# compute capability -> the arch the variant is compiled for: the sm_100 family target, one cubin for B200 and
# B300 (its SASS is byte-identical to sm_100a's; an sm_103a build would schedule some exp2 / MMA sequences
# differently, never measured on hardware: docs/design/sm100_cute_mla.md)
ARCH = "sm_100f"
ARCH_BY_CC = {(10, 0): ARCH, (10, 3): ARCH}
AOT = AotCache.for_family("cute_sm100", "mla_decode_sm100", os.path.dirname(os.path.abspath(__file__)), __name__)


def unsupported_reason(args, cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    arch = ARCH_BY_CC.get(tuple(cc))
    if arch is None:
        return (f"is built for the sm_100 family (sm_100f: B200, GB200, B300, GB300) only, device has compute "
                f"capability {cc[0]}.{cc[1]}")
    why = aligned_rows_reason(args, outputs=True)
    if why:
        return why
    missing = dsl_missing()
    if missing:  # no JIT here: only a prebuilt library of the default variant can run (cute_common/aot.py)
        config = default_config(args, cc)
        why = AOT.prebuilt_reason(variant_for(args, config), config.enable_pdl, arch)
        if why:
            return f"{missing} and no prebuilt library can be used: {why}; {AOT.prebuild_hint(arch)}"
    return None


def default_config(args, cc) -> LaunchConfig:
    return LaunchConfig(split_plan="balanced", enable_pdl=envs.CUTE_MLA_PDL)


def configs(args, cc) -> list[LaunchConfig]:
    """The default, then a larger split cap (PDL as the default has it: PDL-off variants are not prebuilt)."""
    first = default_config(args, cc)
    return [first, dataclasses.replace(first, max_splits=64)]


def plan_tile(num_heads: int, smem_per_block, config) -> PlanTile:
    """64 rows per CTA (a pair owns 128), 128-key tiles: the balanced plan's unit (docs/design/sm100_cute_mla.md
    section 2)."""
    return PlanTile(rows_per_cta=CTA_ROWS, block_n=BLOCK_N)


def variant_for(args, config: LaunchConfig) -> Variant:
    return Variant(kv_dtype=DTYPE_NAMES[args.kv_dtype], q_dtype=DTYPE_NAMES[args.q_dtype],
                   out_dtype=DTYPE_NAMES[args.out.dtype], num_heads=args.num_heads, q_len=args.q_len,
                   block_size=args.block_size, q_scale_is_ptr=isinstance(args.q_scale, torch.Tensor),
                   kv_scale_is_ptr=isinstance(args.kv_scale, torch.Tensor))


def compile_variant(variant: Variant, use_pdl: bool = True, arch: str = ARCH, keep_dir: str | None = None):
    """Compile one variant with symbolic sizes (cute_common/fake_tensors.py) for ``arch`` (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from mla_backend_plugin.kernels.cute_common.compat import compile_options
    from mla_backend_plugin.kernels.cute_common.fake_tensors import decode_tensors, int32_vector
    from mla_backend_plugin.kernels.cute_sm100.kernel import Sm100MlaDecode

    t = decode_tensors(variant, partial_dtype=cutlass.Float32)  # fp32 partials
    split_index = int32_vector()
    op = Sm100MlaDecode(variant, use_pdl=use_pdl)
    return cute.compile(op, t.q_nope, t.q_pe, t.kv, t.block_table, t.seq_lens, t.out, t.lse, t.part_o, t.part_lse,
                        t.q_scale, t.kv_scale, cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Float32(1.0),
                        split_index, cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(1), cutlass.Int32(1),
                        make_fake_stream(), options=compile_options(arch, keep_dir))


def prebuild(args, config: LaunchConfig, cc) -> bool:
    """Start compiling the variant ``launch(args, ..., config)`` runs in a background process
    (cute_common/background.py); True when a build is running."""
    arch = ARCH_BY_CC.get(tuple(cc)) if cc is not None else None
    return arch is not None and background.start(AOT, variant_for(args, config), config.enable_pdl, arch)


@functools.cache
def _compiled(variant: Variant, use_pdl: bool, arch: str):
    """The variant's function, from the on-disk cache or compiled now (and cached). Runs outside CUDA-graph
    capture: vLLM's warm-up and the first eager call reach it first."""
    return compiled_from_cache_or_jit(
        AOT, variant, use_pdl, arch, lambda: compile_variant(variant, use_pdl, arch=arch),
        lambda msg: warnings.warn(msg, RuntimeWarning, stacklevel=3))


def launch(args, workspace, config: LaunchConfig) -> None:
    from mla_backend_plugin.kernels.combine.kernel import launch_combine

    if config.split_plan != "balanced":
        raise ValueError(f"cute_sm100: config: split_plan {config.split_plan!r}; allowed: balanced (the kernel's "
                         "device schedule)")
    arch = ARCH_BY_CC[torch.cuda.get_device_capability(args.q_nope.device)]
    fn = _compiled(variant_for(args, config), config.enable_pdl, arch)
    plan = workspace.plan_for(args, PlanTile(CTA_ROWS, BLOCK_N), config)
    q_scale_t, kv_scale_t, q_scale, kv_scale = scale_launch_args(args, workspace.partial_lse[:1])
    stream = current_cu_stream(args.q_nope.device)
    fn(args.q_nope, args.q_pe, args.kv_cache, args.block_table, args.seq_lens, args.out, args.lse,
       workspace.partial_out, workspace.partial_lse, q_scale_t, kv_scale_t, q_scale, kv_scale,
       softmax_scale_log2(args.softmax_scale), workspace.split_index, plan.num_splits, plan.min_chunk,
       plan.work_target, plan.grid_items, stream)
    if plan.has_combine:
        launch_combine(args, workspace, plan, BLOCK_N, use_pdl=False)
