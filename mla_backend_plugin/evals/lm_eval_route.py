"""Real checkpoints through lm-eval: ``python -m mla_backend_plugin.evals --model DIR --lm-eval-task TASK``.

A real DeepSeek checkpoint (e.g. DeepSeek-V2-Lite, with its tokenizer) is evaluated on an lm-eval task (gsm8k,
mmlu, ...) through vLLM once per MLA backend: ``lm_eval --model vllm --model_args pretrained=DIR,
attention_backend=B,...``, one process per backend (one engine at a time on the GPU). The table puts the task's
metrics of every backend side by side with their standard errors; the exit code is 1 when CUTE_MLA scores
significantly below the best of vLLM's own backends (z > 2.58, p < 0.01 one-sided, on lm-eval's standard errors)
or one of its runs failed. lm-eval is not a dependency of this package (``pip install lm-eval``). Not run here:
no real checkpoint can be downloaded on the machines this package was built on.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import shutil
import subprocess
import sys

Z_99 = 2.58  # one-sided p < 0.01


def lm_eval_command(model_dir: str, backend: str, task: str, output_dir: str, *, kv_cache_dtype: str = "auto",
                    limit: int | None = None, model_args: str = "", batch_size: str = "auto",
                    lm_eval: str = "lm_eval") -> list[str]:
    """The lm-eval CLI call of one backend."""
    margs = [f"pretrained={model_dir}", f"attention_backend={backend}", f"kv_cache_dtype={kv_cache_dtype}"]
    margs += [a for a in model_args.split(",") if a]
    cmd = [lm_eval, "--model", "vllm", "--model_args", ",".join(margs), "--tasks", task,
           "--batch_size", batch_size, "--output_path", output_dir]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    return cmd


def read_results(output_dir: str) -> dict[str, dict[str, tuple[float, float | None]]]:
    """task -> metric -> (value, stderr) from the newest results JSON lm-eval wrote under ``output_dir``."""
    files = sorted(glob.glob(os.path.join(output_dir, "**", "results*.json"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"lm-eval wrote no results*.json under {output_dir}")
    with open(files[-1]) as f:
        data = json.load(f)
    out: dict[str, dict[str, tuple[float, float | None]]] = {}
    for task, metrics in data.get("results", {}).items():
        for name, value in metrics.items():
            if "_stderr" in name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = name.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{filt}" if filt else f"{metric}_stderr")
            out.setdefault(task, {})[name] = (float(value),
                                               float(stderr) if isinstance(stderr, (int, float)) else None)
    return out


def significantly_below(ours: tuple[float, float | None], best: tuple[float, float | None]) -> bool:
    """Ours below the best by more than Z_99 standard errors of the difference (no stderr: any shortfall)."""
    (a, sa), (b, sb) = ours, best
    if sa is None or sb is None:
        return a < b
    se = math.sqrt(sa * sa + sb * sb)
    return (b - a) > Z_99 * se if se > 0 else a < b


def verdicts(results: dict[str, dict]) -> list[str]:
    """Why CUTE_MLA fails against vLLM's backends (empty: it does not). ``results``: backend -> read_results()."""
    ours = results.get("CUTE_MLA")
    if not ours:
        return ["CUTE_MLA produced no results"]
    problems = []
    for task, metrics in ours.items():
        for metric, value in metrics.items():
            peers = [(b, r[task][metric]) for b, r in results.items()
                     if b != "CUTE_MLA" and r and metric in r.get(task, {})]
            if not peers:
                continue
            best_backend, best = max(peers, key=lambda p: p[1][0])
            if significantly_below(value, best):
                problems.append(f"{task} {metric}: CUTE_MLA {value[0]:.4f} vs {best_backend} {best[0]:.4f}")
    return problems


def write_table(results: dict[str, dict], errors: dict[str, str], out_dir: str) -> str:
    """results.md / results.csv: one row per (task, metric), one column per backend (value +- stderr)."""
    backends = list(results) + [b for b in errors if b not in results]
    rows = sorted({(t, m) for r in results.values() if r for t, ms in r.items() for m in ms})
    lines = ["| task | metric | " + " | ".join(backends) + " |", "|---|---|" + "---:|" * len(backends)]
    csv_rows = []
    for task, metric in rows:
        cells = []
        for b in backends:
            v = (results.get(b) or {}).get(task, {}).get(metric)
            cells.append("-" if v is None else f"{v[0]:.4f}" + (f" +- {v[1]:.4f}" if v[1] is not None else ""))
            if v is not None:
                csv_rows.append({"backend": b, "task": task, "metric": metric, "value": v[0], "stderr": v[1]})
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {b}: failed: {why}" for b, why in errors.items()]
    os.makedirs(out_dir, exist_ok=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["backend", "task", "metric", "value", "stderr"])
        writer.writeheader()
        writer.writerows(csv_rows)
    return text


def run(model_dir: str, task: str, backends: list[str], out_dir: str, *, kv_cache_dtype: str = "auto",
        limit: int | None = None, model_args: str = "", timeout_s: float | None = None) -> int:
    """Every backend through lm-eval, the table, the verdict (exit code)."""
    lm_eval = shutil.which("lm_eval")
    if lm_eval is None:
        print("lm-eval is not installed (pip install lm-eval); it runs the task through vLLM", file=sys.stderr)
        return 2
    if "CUTE_MLA" not in backends:
        backends = ["CUTE_MLA", *backends]
    results, errors = {}, {}
    for backend in backends:
        run_dir = os.path.join(out_dir, "lm_eval", backend)
        cmd = lm_eval_command(model_dir, backend, task, run_dir, kv_cache_dtype=kv_cache_dtype, limit=limit,
                              model_args=model_args, lm_eval=lm_eval)
        print(f"{backend}: {' '.join(cmd)}", flush=True)
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "lm_eval.log"), "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            if rc != 0:
                raise RuntimeError(f"lm_eval exit {rc} (log: {run_dir}/lm_eval.log)")
            results[backend] = read_results(run_dir)
        except (RuntimeError, FileNotFoundError, ValueError) as e:
            errors[backend] = str(e)
    print(write_table(results, errors, out_dir))
    problems = [f"CUTE_MLA failed: {errors['CUTE_MLA']}"] if "CUTE_MLA" in errors else verdicts(results)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0
