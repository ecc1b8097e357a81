"""Ragged KV lengths for tests and benchmarks, and a CUDA graph's replay on a new draw of inputs (the decode-input
generator itself is ops/inputs.py, which the self-check and the tuner use too; ``mla_backend_plugin.testing``
re-exports it)."""

from __future__ import annotations

import math
import random


def draw_seq_lens(batch: int, around: int, *, block_size: int, seed: int, max_total_tokens: int | None = None,
                  max_len: int | None = None) -> list[int]:
    """Ragged per-request KV lengths drawn around ``around`` (at least 1 each).

    With two or more requests, one length is exactly ``around`` and one is odd (so neither a multiple of the
    block size nor of a kernel's KV tile); the order is shuffled. With one request, the length is ``around``
    itself. ``max_total_tokens`` bounds the KV of the whole batch: when ``batch * around`` would exceed it,
    only some requests are long and the rest are drawn around what the budget leaves. ``max_len`` caps every
    length (e.g. the block-table width times the block size).
    """
    rng = random.Random(seed)
    cap = max_len if max_len is not None else 1 << 62
    around = min(around, cap)
    if batch == 1:
        return [around]

    def near(center: int) -> int:
        d = max(2, center // 8)
        return max(1, min(cap, center + rng.randint(-d, d)))

    n_long = batch
    short_center = around
    if max_total_tokens is not None and batch * (around + around // 8 + 2) > max_total_tokens:
        n_long = max(2, min(batch, (max_total_tokens // 2) // (around + around // 8 + 2)))
        short_center = max(1, (max_total_tokens - n_long * (around + around // 8 + 2)) // max(1, batch - n_long)
                           * 7 // 8)
        short_center = min(short_center, around)
    lens = [near(around) if i < n_long else near(short_center) for i in range(batch)]
    lens[0] = around
    odd = lens[1] if lens[1] % 2 == 1 else lens[1] + (1 if lens[1] + 1 <= cap else -1)
    lens[1] = max(1, odd)
    rng.shuffle(lens)
    return lens


def replay_with(graph, captured, new, out, lse) -> None:
    """Replay ``graph`` (captured on ``captured``'s tensors, writing ``out`` / ``lse``) on ``new``'s inputs: they
    are copied into the captured tensors (``DecodeInputs.load_``), the outputs poisoned with NaN, and the replay
    waited for."""
    import torch

    captured.load_(new)
    out.fill_(math.nan)
    lse.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
