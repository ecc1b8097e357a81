"""Tile configuration of the Triton decode kernel (no Triton import here: the planner reads it on CPU)."""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class TritonDecodeConfig:
    block_m: int  # query rows per CTA (q_len * heads folded together)
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


# Chosen by benchmarks/tune_triton.py on an H100 (numbers in benchmarks/NOTES.md): 64 query rows x 64 keys on
# 8 warps was fastest at every batch >= 8 (1.3-1.6x the 32-row tiles: half the CTAs re-read each KV tile
# from L2); 16/32 heads keep tiles no taller than their rows.
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


def config_for(num_heads: int, smem_per_block: int | None = None) -> TritonDecodeConfig:
    """The fastest tile that fits ``smem_per_block`` (the device's opt-in maximum; None = no limit)."""
    candidates = _candidates(num_heads)
    for cfg in candidates:
        if smem_per_block is None or smem_bytes(cfg) <= smem_per_block:
            return cfg
    return candidates[-1]  # smaller than every GPU this package supports (>= 99 KB); Triton reports it


def rows_per_cta_for(num_heads: int, smem_per_block: int | None = None) -> int:
    return config_for(num_heads, smem_per_block).block_m


def compiler_options(cc: int) -> dict:
    """Extra Triton compile options per compute capability (cc = 10 * major + minor). On SM80/86, ptxas' default
    budget for the 16-head split kernel with several splits is 32 registers and 17 KB of spills per thread
    (compile.py --arch sm_80); an explicit limit of 255 makes it 255 registers and 1 KB."""
    return {"maxnreg": 255} if cc < 89 else {}


def device_smem_per_block(device) -> int | None:
    """Opt-in shared memory per block of a CUDA device (None for other devices)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_smem_per_block(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_smem_per_block(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin
