"""Sweep the Triton decode kernel's tile configurations on the GPU at hand, beside vLLM's Triton MLA decode.

    python benchmarks/tune_triton.py                    # default sweep, prints a table per shape
    python benchmarks/tune_triton.py --quick            # fewer configs

Each configuration is checked against the float32 reference before it is timed (CUDA graphs, KV rotated past
L2, median), with the package's timing core (mla_backend_plugin.ops.timing), as bench_decode.py does. The
winner goes into mla_backend_plugin/kernels/triton_decode/config.py by hand, with the numbers in
benchmarks/NOTES.md. (The autotuner of issue 16 replaces this script.)
"""

from __future__ import annotations

import argparse
import itertools

import torch
from peers import PEERS, Cell, cell_inputs, check_against_reference

from mla_backend_plugin.kernels.triton_decode.config import TritonDecodeConfig, config_for
from mla_backend_plugin.kernels.triton_decode.kernel import launch
from mla_backend_plugin.ops import LaunchConfig
from mla_backend_plugin.ops import workspace as workspace_module
from mla_backend_plugin.ops.api import prepare_args
from mla_backend_plugin.ops.timing import calls_per_graph_for, capture_graph, kv_copies_for, time_graphs
from mla_backend_plugin.ops.workspace import MLAWorkspace

SHAPES = [Cell(1, 8192, 1, "bf16", 128, 64), Cell(8, 4096, 1, "bf16", 128, 64), Cell(64, 8192, 1, "bf16", 128, 64),
          Cell(128, 4096, 1, "bf16", 128, 64), Cell(64, 8192, 2, "bf16", 128, 64),
          Cell(64, 8192, 1, "fp8", 128, 64)]


def configs(quick: bool) -> list[TritonDecodeConfig]:
    if quick:
        grid = itertools.product((16, 32, 64), (32, 64), (4, 8), (2,))
    else:
        grid = itertools.product((16, 32, 64), (16, 32, 64), (4, 8), (1, 2, 3))
    out = []
    for m, n, w, s in grid:
        if m == 64 and w == 4 and n == 64:
            continue  # 64x512 fp32 accumulator + 64-wide tiles on one warpgroup: certain to spill
        out.append(TritonDecodeConfig(block_m=m, block_n=n, num_warps=w, num_stages=s))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-per-config", type=float, default=0.05)
    parser.add_argument("--ctas-per-sm", default=None,
                        help="comma-separated split-planner targets (TARGET_CTAS_PER_SM) to compare with the "
                             "shipped tile config instead of sweeping tiles, e.g. 1,2,4")
    args = parser.parse_args()
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    print(f"{torch.cuda.get_device_name(device)}")
    for cell in SHAPES:
        copies = kv_copies_for(cell.kv_bytes_per_copy, l2, 2.0, 64)
        calls = calls_per_graph_for(copies, 8)
        inputs = cell_inputs(cell, device, copies)
        ref = inputs.reference("bf16")
        kv_scale = inputs.kv_scale_tensor()
        graphs, keep, rows = {}, {}, []
        if args.ctas_per_sm:
            variants = [(config_for(cell.num_heads), int(t)) for t in args.ctas_per_sm.split(",")]
        else:
            variants = [(cfg, workspace_module.TARGET_CTAS_PER_SM) for cfg in configs(args.quick)]
        for cfg, target in variants:
            workspace_module.TARGET_CTAS_PER_SM = target  # read by plan_splits when the workspace plans
            ws = MLAWorkspace(device, max_batch=cell.batch, max_q_len=cell.q_len, num_heads=cell.num_heads,
                              rows_per_cta=cfg.block_m)
            out = torch.empty(cell.tokens, cell.num_heads, 512, dtype=torch.bfloat16, device=device)
            lse = torch.empty(cell.tokens, cell.num_heads, dtype=torch.float32, device=device)
            q, _ = inputs.query("bf16")

            def run(i, cfg=cfg, ws=ws, out=out, lse=lse, q=q, inputs=inputs, kv_scale=kv_scale):
                a = prepare_args(q, inputs.kv_caches[i], inputs.block_table, inputs.seq_lens,
                                 softmax_scale=inputs.softmax_scale, kv_scale=kv_scale, out=out, lse=lse)
                launch(a, ws, LaunchConfig(split_plan="balanced", enable_pdl=False, tile=cfg.tile))
            name = f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}"
            if args.ctas_per_sm:
                name += f" target{target} items{ws.plan(cell.batch, cell.q_len, balanced=True).grid_items}"
            try:
                run(0)
                torch.cuda.synchronize()
                check = check_against_reference(out, lse, *ref, cell.kv_dtype)
                if not check.out_ok:
                    rows.append((name, "wrong", check.summary()))
                    continue
                graphs[name] = (capture_graph(run, calls=calls, copies=copies), calls)
                keep[name] = (ws, out, lse)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile (smem, regs) is a result
                rows.append((name, "error", str(e).splitlines()[0][:100]))
        peer = PEERS.get("triton_mla")
        if peer is not None and peer.available()[0] and cell.q_len == 1:
            call = peer.prepare(cell, inputs)
            call(0)
            graphs["vllm_triton_mla"] = (capture_graph(call.launch, calls=calls, copies=copies), calls)
            keep["vllm_triton_mla"] = call
        timings = time_graphs(graphs, args.time_per_config, 10, 400, 2)
        kv_bytes = cell.batch * cell.seq_len * 576 * (1 if cell.kv_dtype == "fp8" else 2)
        print(f"\n== B={cell.batch} S={cell.seq_len} q_len={cell.q_len} kv={cell.kv_dtype} "
              f"(KV {kv_bytes / 1e6:.0f} MB)")
        for name, t in sorted(timings.items(), key=lambda kv: kv[1].median_us)[:12]:
            print(f"  {name:18s} {t.median_us:9.1f} us  {kv_bytes / t.median_us / 1e3:7.0f} GB/s")
        for name, status, note in rows:
            print(f"  {name:18s} {status}: {note}")
        del graphs, keep, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
