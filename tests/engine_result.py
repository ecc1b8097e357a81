"""Run an engine check script (tests/vllm_gpu_check.py, tests/sglang_gpu_check.py) in its own process and read
the one JSON line ``RESULT {...}`` it prints.

One engine at a time, also under pytest-xdist: concurrent engines each size their KV cache from the free memory
they see and can starve each other ("No available memory for the cache blocks")."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile


@contextlib.contextmanager
def engine_lock():
    """Held while a test's engines run: no other test's engine starts meanwhile (any pytest-xdist worker)."""
    with open(os.path.join(tempfile.gettempdir(), "cute_mla_engine_gpu_test.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_result_script(script: str, *args: str, timeout: float = 900) -> dict:
    with engine_lock():
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])
