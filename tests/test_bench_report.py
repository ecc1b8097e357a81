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
