"""Tile configuration and registry entry points of the Triton decode kernel (no Triton import here: the
registry, the planner and CPU tests read it on any machine)."""

from __future__ import annotations

import dataclasses

from mla_backend_plugin import envs
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile


@dataclasses.dataclass(frozen=True)
class TritonDecodeConfig:
    block_m: int  # query rows per CTA (q_len * heads folded together)
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int

    @property
    def tile(self) -> tuple[int, int, int, int]:
        """This config as ``LaunchConfig.tile``."""
        return dataclasses.astuple(self)


# Chosen by the tile sweep on an H100 (docs/perf/triton.md): 64 query rows x 64 keys on 8 warps for
# >= 64 heads (half the CTAs re-read each KV tile from L2 compared with 32 rows); 16/32 heads keep tiles no
# taller than their rows.
_WIDE = TritonDecodeConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
_NARROW = TritonDecodeConfig(block_m=32, block_n=64, num_warps=4, num_stages=2)
# Smaller fallbacks for GPUs with less shared memory per block than the H100's 227 KB: the A100 (SM80) has
# 163 KB, SM86/SM89 and SM120/121 have 99 KB, where the 64 x 64 tile (168 KB) does not launch.
_WIDE_SHORT = TritonDecodeConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
_SMALL = TritonDecodeConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)

# Shared memory (bytes) of the split kernel per (block_m, block_n, num_warps) with a bf16 cache (fp8 needs
# less), from Triton 3.6's compile metadata; tests/test_triton_config_cpu.py recompiles and checks them.
SMEM_BYTES = {
    (64, 64, 8): 172_032,
    (64, 32, 8): 122_880,
    (32, 64, 4): 110_592,
    (16, 64, 4): 92_160,
    (32, 32, 4): 77_824,
    (16, 32, 4): 77_824,
}


def _candidates(num_heads: int) -> list[TritonDecodeConfig]:
    if num_heads >= 64:
        return [_WIDE, _WIDE_SHORT, _SMALL]
    rows = min(_NARROW.block_m, num_heads)
    return [dataclasses.replace(_NARROW, block_m=rows), dataclasses.replace(_SMALL, block_m=rows)]


def smem_bytes(cfg: TritonDecodeConfig) -> int:
    return SMEM_BYTES[(cfg.block_m, cfg.block_n, cfg.num_warps)]


def fitting_configs(num_heads: int, smem_per_block: int | None = None) -> list[TritonDecodeConfig]:
    """The tiles that fit ``smem_per_block`` (the device's opt-in maximum; None = no limit), fastest first."""
    candidates = _candidates(num_heads)
    fit = [c for c in candidates if smem_per_block is None or smem_bytes(c) <= smem_per_block]
    return fit or candidates[-1:]  # smaller than every GPU this package supports (>= 99 KB); Triton reports it


def config_for(num_heads: int, smem_per_block: int | None = None) -> TritonDecodeConfig:
    """The fastest tile that fits ``smem_per_block``."""
    return fitting_configs(num_heads, smem_per_block)[0]


def rows_per_cta_for(num_heads: int, smem_per_block: int | None = None) -> int:
    return config_for(num_heads, smem_per_block).block_m


def compiler_options(cc: int) -> dict:
    """Extra Triton compile options per compute capability (cc = 10 * major + minor). On SM80/86, ptxas' default
    budget for the 16-head split kernel with several splits is 32 registers and 17 KB of spills per thread
    (compile.py --arch sm_80); an explicit limit of 255 makes it 255 registers and 1 KB."""
    return {"maxnreg": 255} if cc < 89 else {}


# ---------------------------------------------------------------------------------------------------------
# registry entry points (MANIFEST in __init__.py)
# ---------------------------------------------------------------------------------------------------------

def unsupported_reason(args, cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc < (8, 0):
        return f"needs compute capability >= 8.0, device has {cc[0]}.{cc[1]}"
    if FP8_DTYPE in (args.kv_dtype, args.q_dtype) and cc < (8, 9):
        return f"fp8 needs compute capability >= 8.9, device has {cc[0]}.{cc[1]}"
    return None


def _smem(args) -> int | None:
    from mla_backend_plugin.ops.arch import device_smem_per_block

    return device_smem_per_block(args.q_nope.device)


def default_config(args, cc) -> LaunchConfig:
    # PDL: the Triton split kernel launches as an ordinary kernel; the combine follows it stream-ordered
    return LaunchConfig(split_plan=envs.CUTE_MLA_TRITON_SPLITS, enable_pdl=False,
                        tile=config_for(args.num_heads, _smem(args)).tile)


def configs(args, cc) -> list[LaunchConfig]:
    """Every fitting tile under both split plans and a few split caps, the default first."""
    first = default_config(args, cc)
    out = [first]
    for cfg in fitting_configs(args.num_heads, _smem(args)):
        for plan in ("balanced", "uniform"):
            for max_splits in (None, 64):
                c = LaunchConfig(split_plan=plan, max_splits=max_splits, enable_pdl=False, tile=cfg.tile)
                if c not in out:
                    out.append(c)
    return out


def sweep_configs(full: bool = False) -> list[LaunchConfig]:
    """A wider tile sweep than ``configs()`` for ``python -m mla_backend_plugin.tune --triton-tiles quick|full``
    (what benchmarks/tune_triton.py swept before the autotuner): block_m x block_n x warps x stages on the
    balanced plan. Tiles that do not fit the GPU fail to launch and are reported as such."""
    import itertools

    if full:
        grid = itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3))
    else:
        grid = itertools.product((16, 32, 64), (32, 64), (4, 8), (2,))
    # 64 rows x 64 keys on one warpgroup: a 64 x 512 fp32 accumulator per 128 threads, certain to spill
    return [LaunchConfig(split_plan="balanced", enable_pdl=False, tile=(m, n, w, st))
            for m, n, w, st in grid if not (m == 64 and n == 64 and w == 4)]


def plan_tile(num_heads: int, smem_per_block: int | None, config: LaunchConfig | None) -> PlanTile:
    cfg = TritonDecodeConfig(*config.tile) if config is not None and config.tile else \
        config_for(num_heads, smem_per_block)
    return PlanTile(rows_per_cta=cfg.block_m, block_n=cfg.block_n)
