"""Tile configuration of the Triton decode kernel (no Triton import here: the planner reads it on CPU)."""

from __future__ import annotations

import dataclasses


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


def config_for(num_heads: int) -> TritonDecodeConfig:
    if num_heads >= 64:
        return _WIDE
    return dataclasses.replace(_NARROW, block_m=min(_NARROW.block_m, num_heads))


def rows_per_cta_for(num_heads: int) -> int:
    return config_for(num_heads).block_m
