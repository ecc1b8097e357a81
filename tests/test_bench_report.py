"""The benchmark harness without a GPU: report writers (CSV, JSON, markdown, PNG plots) on fabricated rows, and
the CLI's dry run (grid, kernels, which peers import and why not)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_report_selftest_renders_every_output():
    proc = _run("benchmarks/report.py", "--selftest")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plots skipped" not in proc.stdout + proc.stderr


def test_bench_dry_run_lists_grid_and_peers():
    proc = _run("benchmarks/bench_decode.py", "--dry-run", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for peer in ("flashmla", "fa3_mla", "triton_mla"):
        assert peer in out, out[-3000:]
    assert "1024" in out and "8192" in out


def test_compare_runs_ratios(tmp_path):
    """benchmarks/compare_runs.py: per-cell ratio of one kernel across runs, geomean and extremes."""
    import json

    def run(name, times):
        rows = [dict(kernel="cute_sm90", batch=b, seq_len=1024, q_len=1, kv_dtype="bf16", status="ok", time_us=t)
                for b, t in times.items()]
        rows.append(dict(kernel="triton", batch=1, seq_len=1024, q_len=1, kv_dtype="bf16", status="ok", time_us=1.0))
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
        return str(d)

    a = run("a", {1: 10.0, 8: 20.0, 64: 40.0})
    b = run("b", {1: 11.0, 8: 20.0, 64: 20.0, 128: 5.0})
    proc = _run("benchmarks/compare_runs.py", a, b, "--show", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    geo = (1.1 * 1.0 * 0.5) ** (1 / 3)
    assert f"b / a: 3 cells, time ratio geomean {geo:.4f}, min 0.500, max 1.100" in proc.stdout, proc.stdout
    assert "slower  (1, 1024, 1, 'bf16'): 10.0 -> 11.0 us (1.100)" in proc.stdout
