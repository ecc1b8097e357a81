"""The eval's outputs: results.csv / results.md / results.json, the accuracy plot, and the summary table."""

from __future__ import annotations

import csv
import json
import math
import os

from mla_backend_plugin.evals import tasks


def summary_lines(rows: list[dict], runs: list[dict]) -> list[str]:
    """A compact table: per condition its status, seconds, accuracy per task and length, worst mean and max KL."""
    cells = list(dict.fromkeys((r["task"], r["length"]) for r in rows))
    names = list(dict.fromkeys([r["condition"] for r in rows] + [r["condition"] for r in runs]))
    status = {r["condition"]: r for r in runs}
    width = max([len(n) for n in names] + [9])
    cell_names = [f"{t}@{n}" for t, n in cells]
    head = f"{'condition':<{width}} {'status':<8} {'s':>4} " + " ".join(cell_names)
    lines = [head + "   KL mean    KL max"]
    for name in names:
        mine = {(r["task"], r["length"]): r for r in rows if r["condition"] == name}
        run = status.get(name, {"status": "ok", "seconds": None})
        secs = f"{run['seconds']:4.0f}" if run.get("seconds") is not None else "   -"
        accs = " ".join(f"{mine[c]['accuracy']:>{len(head_cell)}.3f}" if c in mine else f"{'-':>{len(head_cell)}}"
                        for c, head_cell in zip(cells, cell_names))
        kl_mean = max((r["kl_mean"] for r in mine.values() if math.isfinite(r["kl_mean"])), default=float("nan"))
        kl_max = max((r["kl_max"] for r in mine.values() if math.isfinite(r["kl_max"])), default=float("nan"))
        lines.append(f"{name:<{width}} {run['status']:<8} {secs} {accs}  {kl_mean:9.2g} {kl_max:9.2g}")
    return lines


def write_outputs(rows: list[dict], out_dir: str, runs: list[dict] | None = None,
                  failures: list[str] | None = None) -> list[str]:
    runs = runs or []
    os.makedirs(out_dir, exist_ok=True)
    cols = ["condition", "backend", "ours", "kv_dtype", "mode", "spec", "task", "length", "hits", "n", "accuracy",
            "ci_low", "ci_high", "kl_mean", "kl_max", "kl_tokens", "tp", "dcp", "interleave"]
    paths = [os.path.join(out_dir, name) for name in ("results.csv", "results.md", "results.json")]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(paths[1], "w") as f:
        f.write("| condition | task | length | accuracy (95% CI) | KL mean | KL max |\n|---|---|---:|---|---:|---:|\n")
        seen = set()
        for r in rows:
            if (r["condition"], r["task"], r["length"]) in seen:  # the reference, once per KV dtype in the csv
                continue
            seen.add((r["condition"], r["task"], r["length"]))
            f.write(f"| {r['condition']} | {r['task']} | {r['length']} | {r['accuracy']:.3f} "
                    f"({r['ci_low']:.3f} .. {r['ci_high']:.3f}) | {r['kl_mean']:.3g} | {r['kl_max']:.3g} |\n")
        if runs:
            f.write("\n| condition | status | seconds | log | detail |\n|---|---|---:|---|---|\n")
            for r in runs:
                detail = r["detail"].replace("|", "/")
                f.write(f"| {r['condition']} | {r['status']} | {r['seconds']:.0f} | {r['log']} | {detail} |\n")
        if failures:
            f.write("\nFailures:\n\n" + "".join(f"- {line}\n" for line in failures))
    with open(paths[2], "w") as f:
        json.dump({"rows": rows, "runs": runs, "failures": failures or []}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(tasks.TASKS), figsize=(6 * len(tasks.TASKS), 4.5), squeeze=False)
        for ax, task in zip(axes[0], tasks.TASKS):
            for cond in dict.fromkeys(r["condition"] for r in rows):
                pts = sorted((r["length"], r["accuracy"]) for r in rows if r["condition"] == cond and r["task"] == task)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=cond)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("exact match")
            ax.set_title(task)
            ax.set_ylim(-0.02, 1.02)
        axes[0][-1].legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "accuracy_vs_length.png"))
        fig.savefig(paths[-1], dpi=120)
    except ImportError:
        pass
    return paths

