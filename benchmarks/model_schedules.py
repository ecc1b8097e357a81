"""Modelled split-kernel step time of the balanced plan's schedules against a persistent contiguous-share grid
(no GPU; testing/schedule_model.py's model of ops/plan.py's plans: a CTA costs its KV tiles plus a fixed 1.5 tiles,
one CTA per SM).

    python benchmarks/model_schedules.py [--heads 128] [--q-len 1] [--sms 132]

Per cell (the kernel benchmark's uniform and ragged batches, benchmarks/bench_decode.py ``ragged_seq_lens``):

* ``w order``: the balanced plan's items launched in order of w (Triton, cute_sm100; cute_sm90 before 2026-11-26);
* ``longest first``: the same items launched longest first (cute_sm90's step plan since 2026-11-26);
* ``contiguous``: what a persistent grid could do (FlashMLA's scheduler does this): W = SMs / m-blocks CTA slots
  each take one contiguous share of the batch's concatenated KV tiles, crossing request boundaries, and pay the
  fixed cost once per request piece they hold. No split cap; the partials and the combine are not modelled
  (a request split n ways writes n partials in either design).

All in units of one KV tile (64 keys for one m-block). ``ideal``: every tile spread evenly, no fixed cost.
Written to size the persistent split kernel of issue 11 (docs/perf/split_plan.md) before building it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import ragged_seq_lens  # noqa: E402

from mla_backend_plugin.ops.plan import plan_splits  # noqa: E402
from mla_backend_plugin.testing.schedule_model import ideal_makespan, makespan, plan_cta_costs  # noqa: E402

BLOCK_N = ROWS = 64  # cute_sm90's tile
PIECE_COST = 1.5  # tiles: a CTA's (or a request piece's) Q load, epilogue and prologue, as plan_cta_costs
LAUNCH_COST = 0.15  # tiles: a persistent CTA's launch, as plan_cta_costs' exiting CTA


def contiguous_share_makespan(seq_lens, slots: int, piece_cost: float = PIECE_COST,
                              launch_cost: float = LAUNCH_COST) -> float:
    """The smallest per-slot load with which a greedy walk over the concatenated requests (each slot taking
    pieces until its load is spent, a piece costing ``piece_cost`` plus its tiles) fits in ``slots`` slots."""
    tiles = [max(-(-int(x) // BLOCK_N), 1) for x in seq_lens]

    def slots_needed(share: float) -> int:
        used, left = 1, share
        for t in tiles:
            rest = float(t)
            while rest > 1e-9:
                if left <= piece_cost + 1e-9:
                    used, left = used + 1, share
                take = min(rest, left - piece_cost)
                left -= piece_cost + take
                rest -= take
        return used

    lo, hi = (sum(tiles) + piece_cost * len(tiles)) / slots, float(sum(tiles)) + piece_cost * len(tiles) + 1
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if slots_needed(mid) <= slots else (mid, hi)
    return hi + launch_cost


def rows(heads: int, q_len: int, sms: int):
    m_blocks = -(-(q_len * heads) // ROWS)
    for kind in ("none", "long-tail", "one-long"):
        for batch in (1, 8, 32, 64, 128):
            for seq_len in (8192, 32768):
                lens = [seq_len] * batch if kind == "none" else ragged_seq_lens(kind, batch, seq_len, 1024, 0)
                plan = plan_splits(batch, q_len, heads, ROWS, sms, balanced=True)
                by_w, lpt = (makespan(plan_cta_costs(plan, lens, q_len, heads, BLOCK_N, longest_first=o), sms)
                             for o in (False, True))
                yield (kind, batch, seq_len, by_w, lpt, contiguous_share_makespan(lens, -(-sms // m_blocks)),
                       ideal_makespan(lens, q_len, heads, ROWS, BLOCK_N, sms))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args(argv)
    print("| kind | B | S | w order | longest first | contiguous | ideal | longest first / contiguous |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, batch, seq_len, by_w, lpt, contiguous, ideal in rows(args.heads, args.q_len, args.sms):
        print(f"| {kind} | {batch} | {seq_len} | {by_w:.1f} | {lpt:.1f} | {contiguous:.1f} | {ideal:.1f} | "
              f"{lpt / contiguous:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
