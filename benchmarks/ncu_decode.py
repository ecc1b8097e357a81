"""One MLA decode call of one kernel, for Nsight Compute; and the budget metrics out of ncu's raw CSV.

Profile (the call runs between cudaProfilerStart / cudaProfilerStop, after warm-up calls that compile and plan):

    ncu --profile-from-start off --set full --clock-control none -o OUT/ours_fp8 -f \\
        python benchmarks/ncu_decode.py --kernel cute_sm90 --batch 128 --seq-len 8192 --kv-dtype fp8
    ncu --import OUT/ours_fp8.ncu-rep --page raw --csv > OUT/ours_fp8.csv
    python benchmarks/ncu_decode.py --summarize OUT/ours_fp8.csv

``--kernel`` takes any benchmarkable kernel of ours or a peer of ``bench_decode.py`` (flashmla, fa3_mla,
triton_mla, flashinfer_mla); inputs, q dtype (ours: ``--q-dtype``, default what the CUTE_MLA backend asks vLLM
for; peers: their own) and the call itself are bench_decode's, on one KV copy (ncu flushes the caches before
each profiled kernel by default). Every kernel the call launches is profiled (the plan kernel, the split
kernel, a combine).

``--summarize`` prints, per profiled kernel, the metrics the cycle budget of docs/design/sm90_decode_budget.md
is checked against (each a regular expression over ncu's raw metric names, so one list serves every ncu
version that names them so): duration, DRAM throughput and bytes, L2 bytes and throughput, tensor-pipe activity,
shared-memory wavefronts and bank conflicts, eligible warps, and the six largest stall reasons per issued
instruction.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

# (label, pattern over raw metric names); every matching column is printed
BUDGET_METRICS = (
    ("duration", r"^gpu__time_duration\.sum$"),
    ("grid / block", r"^launch__(grid_size|block_size|registers_per_thread|shared_mem_per_block_dynamic)$"),
    ("DRAM", r"^dram__(throughput\.avg\.pct_of_peak_sustained_elapsed|bytes_read\.sum|bytes_write\.sum)$"),
    ("L2", r"^lts__(t_bytes\.sum|throughput\.avg\.pct_of_peak_sustained_elapsed|t_sector_hit_rate\.pct)$"),
    ("tensor pipe", r"^sm__(pipe_tensor_op_[a-z]+_cycles_active|inst_executed_pipe_tensor_op_[a-z]+)"
                    r"\.(avg\.pct_of_peak_sustained_(active|elapsed)|sum)$"),
    ("shared memory", r"^(l1tex__data_pipe_lsu_wavefronts_mem_shared(_op_ld|_op_st)?\.sum"
                      r"|l1tex__data_bank_conflicts_pipe_lsu_mem_shared(_op_ld|_op_st)?\.sum"
                      r"|smsp__inst_executed_op_(ldsm|stsm)\.sum)$"),
    ("issue", r"^(smsp__warps_eligible\.avg\.per_cycle_active|smsp__warps_active\.avg\.per_cycle_active"
              r"|smsp__issue_active\.avg\.pct_of_peak_sustained_active|smsp__inst_executed\.sum"
              r"|sm__throughput\.avg\.pct_of_peak_sustained_elapsed)$"),
)
STALL_PATTERN = r"^smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio$"
TOP_STALLS = 6


def read_raw_csv(path: str) -> tuple[list[str], list[str], list[dict[str, str]]]:
    """ncu ``--page raw --csv``: a header of metric names, a row of units, then one row per profiled kernel."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]  # ncu's own ==PROF== / ==WARNING== lines
    table = list(csv.reader(lines))
    if len(table) < 2:
        raise ValueError(f"{path}: no ncu raw CSV (expected a header, a units row and a row per kernel)")
    header, units, rows = table[0], table[1], table[2:]
    return header, units, [dict(zip(header, row)) for row in rows]


def summarize(path: str, out=sys.stdout) -> int:
    header, units, rows = read_raw_csv(path)
    unit = dict(zip(header, units))
    if not rows:
        print(f"{path}: no profiled kernel", file=out)
        return 1
    for row in rows:
        name = row.get("Kernel Name", "?")
        print(f"== {name[:140]}", file=out)
        for label, pattern in BUDGET_METRICS:
            found = [m for m in header if re.match(pattern, m)]
            for metric in found:
                print(f"  {label:14} {metric:75} {row[metric]:>16} {unit.get(metric, '')}", file=out)
            if not found:
                print(f"  {label:14} (no metric matching {pattern} in this report)", file=out)
        stalls = []
        for metric in header:
            m = re.match(STALL_PATTERN, metric)
            if m and not metric.endswith("_not_issued_per_issue_active.ratio"):
                try:
                    stalls.append((float(row[metric].replace(",", "")), m.group(1)))
                except ValueError:
                    continue
        stalls.sort(reverse=True)
        total = sum(v for v, _ in stalls)
        print(f"  stalls per issued instruction (top {TOP_STALLS} of {total:.2f} cycles):", file=out)
        for value, reason in stalls[:TOP_STALLS]:
            print(f"    {reason:40} {value:8.2f}", file=out)
    return 0


def profile(args) -> int:
    import bench_decode
    import torch
    from bench_decode import OurKernel
    from peers import PEERS, Cell, cell_inputs

    if not torch.cuda.is_available():
        print("ncu_decode.py needs a CUDA device (--summarize does not)", file=sys.stderr)
        return 2
    cc = torch.cuda.get_device_capability()
    cell = Cell(batch=args.batch, seq_len=args.seq_len, q_len=args.q_len, kv_dtype=args.kv_dtype,
                num_heads=args.num_heads, block_size=args.block_size)
    if args.kernel in PEERS:
        runner = PEERS[args.kernel]
        ok, why = runner.available()
        if not ok:
            print(f"--kernel {args.kernel}: {why}", file=sys.stderr)
            return 2
    else:
        ours = [k for k in bench_decode.available_kernels() if k not in bench_decode.NOT_BENCHMARKED_KERNELS]
        if args.kernel not in ours:
            print(f"--kernel: {args.kernel!r} is neither a peer ({', '.join(PEERS)}) nor a benchmarkable kernel of "
                  f"ours ({', '.join(ours)})", file=sys.stderr)
            return 2
        q_dtype = args.q_dtype or ("fp8" if bench_decode.serving.fp8_query(bench_decode.envs.CUTE_MLA_FP8_QUERY, cc)
                                   else "bf16")
        runner = OurKernel(args.kernel, q_dtype, shadowed_in_bf16_cells=False,
                           overrides=bench_decode._launch_config(args.launch_config) if args.launch_config else None)
    reason = runner.unsupported_reason(cell, cc)
    if reason:
        print(f"{runner.name} cannot run {cell.label()}: {reason}", file=sys.stderr)
        return 2
    inputs = cell_inputs(cell, torch.device("cuda"), copies=1, seed=args.seed)
    call = runner.prepare(cell, inputs)
    for _ in range(args.warmup):
        call(0)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call.launch(0)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one call: {runner.name} on {cell.label()}, q {runner.query_dtype(cell, cc)}, "
          f"MMA {runner.mma_dtype(cell, cc)}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summarize", metavar="RAW_CSV",
                        help="print the budget metrics of an `ncu --import R --page raw --csv` export and exit")
    parser.add_argument("--kernel", default="cute_sm90", help="a kernel of ours or a bench_decode peer")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--q-dtype", choices=("bf16", "fp8"), default=None,
                        help="ours with an fp8 cache: the q dtype (default: what the CUTE_MLA backend asks for)")
    parser.add_argument("--num-heads", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (compile, plan)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch-config", metavar="JSON", default=None,
                        help="our kernel's default config with these LaunchConfig fields replaced (bench_decode.py's "
                             "--launch-config), e.g. '{\"l2_prefetch\": 1}'")
    args = parser.parse_args(argv)
    if args.summarize:
        try:
            return summarize(args.summarize)
        except (OSError, ValueError) as e:
            print(f"--summarize: {e}", file=sys.stderr)
            return 2
    if args.batch < 1 or args.seq_len < args.q_len or args.q_len < 1:
        parser.error(f"--batch >= 1 and --seq-len >= --q-len >= 1 (got {args.batch}, {args.seq_len}, {args.q_len})")
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
