"""Compare one kernel's times across bench_decode.py runs (an A/B of two versions of the code, run one after the
other in the same session): per-cell ratio against the first run, geometric mean, extremes.

    python benchmarks/compare_runs.py RUN_DIR_A RUN_DIR_B [...] [--kernel cute_sm90]

Each RUN_DIR holds the results.json that bench_decode.py wrote (--out-dir).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(run_dir: Path, kernel: str) -> dict[tuple, dict]:
    """The kernel's rows by cell. ``kernel`` names a label exactly or a kernel whose run has one labelled form
    (``cute_sm90`` finds ``cute_sm90/fp8q``, what ``--ours-fp8-q fp8`` writes)."""
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    labels = {r["kernel"] for r in rows}
    if kernel not in labels:
        forms = sorted(k for k in labels if k.split("/")[0] == kernel)
        if len(forms) > 1:
            raise SystemExit(f"{run_dir}: --kernel {kernel} names {len(forms)} labels ({', '.join(forms)}); "
                             f"give one")
        kernel = forms[0] if forms else kernel
    return {(r["batch"], r["seq_len"], r["q_len"], r["kv_dtype"]): r for r in rows if r["kernel"] == kernel}


def compare(base: dict[tuple, dict], other: dict[tuple, dict]) -> tuple[list[tuple], list[tuple]]:
    """(ratios as (other / base, cell, base us, other us), cells timed in only one of the two)."""
    ratios, missing = [], []
    for cell, a in sorted(base.items()):
        b = other.get(cell)
        if b is None or a["time_us"] is None or b["time_us"] is None:
            missing.append(cell)
            continue
        ratios.append((b["time_us"] / a["time_us"], cell, a["time_us"], b["time_us"]))
    return ratios, missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--kernel", default="cute_sm90")
    parser.add_argument("--show", type=int, default=5, help="slowest / fastest cells to list")
    args = parser.parse_args(argv)
    base = load(args.runs[0], args.kernel)
    for run in args.runs[1:]:
        ratios, missing = compare(base, load(run, args.kernel))
        if not ratios:
            print(f"{run.name} / {args.runs[0].name}: no common timed cell")
            continue
        geo = math.exp(sum(math.log(r[0]) for r in ratios) / len(ratios))
        print(f"{run.name} / {args.runs[0].name}: {len(ratios)} cells, time ratio geomean {geo:.4f}, "
              f"min {min(ratios)[0]:.3f}, max {max(ratios)[0]:.3f}"
              + (f"; {len(missing)} cells timed in only one run" if missing else ""))
        # the highest and the lowest ratios, each cell listed once, named by what it is (> 1: the later run slower)
        shown = sorted(ratios)[::-1][:args.show]
        shown += [r for r in sorted(ratios)[:args.show] if r not in shown]
        for ratio, cell, a, b in shown:
            print(f"  {'slower' if ratio > 1 else 'faster' if ratio < 1 else 'same'}  {cell}: {a:.1f} -> {b:.1f} us "
                  f"({ratio:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
