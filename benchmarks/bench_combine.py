"""The balanced split-KV combine alone (kernels/combine ``combine_balanced_kernel``) on the split lists of the
benchmark's cells, to choose its tiles (ops/plan.py ``combine_tiles``) without timing whole decode steps.

    python benchmarks/bench_combine.py                    # the plan's tile on every cell
    python benchmarks/bench_combine.py --sweep            # also every tile of 4096-16384 partials a round
    python benchmarks/bench_combine.py --partials fp32    # the Triton / cute_sm100 partials (cute_sm90: bf16)

Cells: the standard grid's uniform batches and the one-long / long-tail ragged batches of bench_decode.py
(B 4-128, S 8k / 32k), q_len 1 and 2, 128 heads, plus the Triton kernel's B=1-2 steps (cute_sm90 fuses its
combine there). Each cell's split list is the one cute_sm90's plan kernel writes on a 132-SM H100
(ops/plan.py ``step_schedule`` under the caps of ``cute_sm90.launch.wave_filling_config``); its partials are
random. Times: one CUDA graph of 20 launches per tile, replayed interleaved (ops/timing.py), per-launch medians;
every tile's output is checked against a float32 merge of the same partials first.

The partials of a split are read right after the split kernel wrote them, so they are L2 hits in serving: the
graph replays the same partials (no rotation past L2). A process's times of one cell can differ between
processes by up to 2x for some cells (docs/perf/combine.md): compare tiles within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from types import SimpleNamespace

import torch
from bench_decode import ragged_seq_lens  # sibling module: benchmarks/ is the script directory

from mla_backend_plugin.ops import timing
from mla_backend_plugin.ops.constants import KV_LORA_RANK
from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY, step_schedule
from mla_backend_plugin.ops.workspace import MLAWorkspace

HEADS, NUM_SMS, CALLS = 128, 132, 20


def cells():
    """(name, q_len, plan, split list [(b, first slot, splits)]) of every cell with a combine launch."""
    from mla_backend_plugin.kernels.cute_sm90 import launch as cute
    from mla_backend_plugin.kernels.cute_sm90.config import BLOCK_M, BLOCK_N

    for q_len in (1, 2):
        for n in (8, 32, 64):  # the Triton kernel's single-request steps: one request split n ways
            ws = MLAWorkspace("cpu", max_batch=1, max_q_len=q_len, num_heads=HEADS, num_sms=NUM_SMS,
                              split_capacity=SPLIT_CAPACITY)
            plan = ws.plan(1, q_len, True, BLOCK_M, max_splits=max(n, 32))
            yield f"one request, {n} splits, q{q_len}", q_len, plan, [(0, 0, n)]
        for kind in ("none", "one-long", "long-tail"):
            for batch in (4, 8, 16, 32, 64, 128):
                for seq_len in (8192, 32768):
                    lens = [seq_len] * batch if kind == "none" else ragged_seq_lens(kind, batch, seq_len, 1024, 0)
                    ws = MLAWorkspace("cpu", max_batch=batch, max_q_len=q_len, num_heads=HEADS, num_sms=NUM_SMS,
                                      split_capacity=SPLIT_CAPACITY)
                    shape = SimpleNamespace(batch=batch, q_len=q_len)
                    config = cute.wave_filling_config(shape, ws, LaunchConfig(split_plan="balanced"))
                    plan = ws.plan_for(shape, PlanTile(BLOCK_M, BLOCK_N), config)
                    if not plan.has_combine or cute.m_blocks(HEADS, q_len) * plan.grid_items <= NUM_SMS:
                        continue  # no combine launch (fused into the split kernel)
                    sched = step_schedule(lens, BLOCK_N, plan, "balanced")
                    split_list = [(b, sched.slot_base[b], sched.splits[b]) for b in sched.split_requests]
                    yield f"{kind} B={batch} S={seq_len} q{q_len}", q_len, plan, split_list


def sweep_tiles():
    """(rows, column blocks, splits a round) of every tile of 4096, 8192 or 16384 partials."""
    for rows in (1, 2, 4, 8, 16):
        for col_blocks in (1, 2, 4):
            for split_block in (1, 2, 4, 8, 16, 32, 64):
                if rows * KV_LORA_RANK // col_blocks * split_block in (4096, 8192, 16384):
                    yield rows, col_blocks, split_block


def run_cell(q_len, plan, split_list, tiles, partial_dtype):
    """{tile: Timing} of the combine over ``split_list``'s random partials, each tile's output checked first."""
    from mla_backend_plugin.kernels.combine.kernel import launch_combine

    rows = q_len * HEADS
    batch = max([b for b, _, _ in split_list], default=0) + 1
    slots = max([s0 + n for _, s0, n in split_list], default=1)
    parts = torch.randn(slots * rows, KV_LORA_RANK, device="cuda").to(partial_dtype)
    part_lse = torch.randn(slots * rows, device="cuda") * 3
    index = torch.full((1 + 3 * plan.max_split_requests,), -5, dtype=torch.int32, device="cuda")
    flat = [len(split_list)] + [v for entry in split_list for v in entry]
    index[:len(flat)] = torch.tensor(flat, dtype=torch.int32)
    out = torch.empty(batch * q_len, HEADS, KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch * q_len, HEADS, device="cuda")
    args = SimpleNamespace(out=out, lse=lse, q_len=q_len, num_heads=HEADS, batch=batch, kv_scale=None)
    workspace = SimpleNamespace(partials_as=lambda dtype: parts, partial_lse=part_lse, split_index=index)
    expected = {}
    for b, s0, n in split_list:  # the partial LSEs are base 2
        o = parts[s0 * rows:(s0 + n) * rows].float().view(n, rows, KV_LORA_RANK)
        w = torch.exp2(part_lse[s0 * rows:(s0 + n) * rows].view(n, rows))
        expected[b] = ((w[:, :, None] * o).sum(0) / w.sum(0)[:, None]).view(q_len, HEADS, KV_LORA_RANK)
    graphs = {}
    for tile in tiles:
        tile_plan = dataclasses.replace(plan, combine_rows=tile[0], combine_col_blocks=tile[1],
                                        combine_split_block=tile[2])

        def launch(_copy, tile_plan=tile_plan):
            launch_combine(args, workspace, tile_plan, 64, partial_dtype=partial_dtype)

        out.fill_(float("nan"))
        launch(0)
        for b, want in expected.items():
            got = out[b * q_len:(b + 1) * q_len].float()
            if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                raise AssertionError(f"tile {tile}: request {b} differs from the float32 merge by "
                                     f"{(got - want).abs().max().item():.3g}")
        graphs[tile] = (timing.capture_graph(launch, CALLS), CALLS)
    return timing.time_graphs(graphs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time every tile of 4096-16384 partials")
    parser.add_argument("--partials", choices=("bf16", "fp32"), default="bf16", help="partial dtype")
    parser.add_argument("--only", default="", help="cells whose name contains this")
    opts = parser.parse_args(argv)
    dtype = torch.bfloat16 if opts.partials == "bf16" else torch.float32
    torch.manual_seed(0)
    log_ratios = []
    for name, q_len, plan, split_list in cells():
        if opts.only not in name:
            continue
        planned = (plan.combine_rows, plan.combine_col_blocks, plan.combine_split_block)
        tiles = [planned] + ([t for t in sweep_tiles() if t != planned and q_len * HEADS % t[0] == 0]
                             if opts.sweep else [])
        times = run_cell(q_len, plan, split_list, tiles, dtype)
        splits = max([n for _, _, n in split_list], default=0)
        line = (f"{name:32s} J={len(split_list):2d}/{plan.max_split_requests:2d} most splits {splits:2d} "
                f"plan {planned}: {times[planned].median_us:6.2f} us")
        if opts.sweep:
            best = min(times, key=lambda t: times[t].median_us)
            log_ratios.append(math.log(times[best].median_us / times[planned].median_us))
            line += f" | best {best}: {times[best].median_us:6.2f} us | " + " ".join(
                f"{'-'.join(map(str, t))}:{v.median_us:.2f}" for t, v in times.items())
        print(line, flush=True)
    if log_ratios:
        print(f"best / planned, geomean over cells: {math.exp(sum(log_ratios) / len(log_ratios)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
