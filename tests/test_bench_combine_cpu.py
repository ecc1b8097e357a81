"""benchmarks/bench_combine.py without a GPU: its cells are the ones that launch a combine, with the split lists the
planner writes, and its sweep covers the tiles the plan may choose."""

from __future__ import annotations

from benchmark_scripts import import_benchmark


def _bench():
    return import_benchmark("bench_combine")


def test_cells_are_the_combine_launches_with_the_planned_lists():
    bench = _bench()
    cells = {name: (q_len, plan, split_list) for name, q_len, plan, split_list in bench.cells()}
    # B=4 uniform at q_len 1: every request split, the 2-row tile of ops/plan.py combine_tiles
    q_len, plan, split_list = cells["none B=4 S=8192 q1"]
    assert [b for b, _, _ in split_list] == [0, 1, 2, 3] and min(n for _, _, n in split_list) > 1
    assert (plan.combine_rows, plan.combine_col_blocks, plan.combine_split_block) == (2, 1, 16)
    # one long request among short ones at B=128: one split request under a grid shaped for 65
    _, plan, split_list = cells["one-long B=128 S=32768 q1"]
    assert len(split_list) == 1 and split_list[0][0] == 0 and plan.max_split_requests == 65
    # the slots of the listed requests never overlap
    for name, (_, _, split_list) in cells.items():
        slots = sorted((s0, s0 + n) for _, s0, n in split_list)
        assert all(a[1] <= b[0] for a, b in zip(slots, slots[1:])), name


def test_sweep_covers_every_planned_tile():
    bench = _bench()
    tiles = set(bench.sweep_tiles())
    for _, _, plan, _ in bench.cells():
        assert (plan.combine_rows, plan.combine_col_blocks, plan.combine_split_block) in tiles
