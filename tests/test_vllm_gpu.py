"""vLLM end to end on a GPU: our builder's metadata and forward_mqa inside a real engine (tiny DeepSeek).

Every eager decode call is compared with the float32 reference on the inputs vLLM passed (see
vllm_gpu_check.py). The CUDA-graph run must generate what the eager run generates.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_gpu_check.py")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]


def run_check(*args: str) -> dict:
    # One engine at a time, also under pytest-xdist: concurrent engines each size their KV cache from the
    # free memory they see and can starve each other ("No available memory for the cache blocks").
    with open(os.path.join(tempfile.gettempdir(), "cute_mla_vllm_gpu_test.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, CHECK, *args], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def assert_decode_checked(stats: dict, kv_fp8: bool, q_len: int, q_dtype: str) -> None:
    assert list(stats["q_dtypes"]) == [q_dtype], stats["q_dtypes"]
    assert stats["calls"] > 0, "forward_mqa never ran"
    assert str(q_len) in stats["q_lens"], stats["q_lens"]
    assert stats["lse_inf_mismatch"] == 0
    assert stats["max_rel_err"] < (5e-2 if kv_fp8 else 1e-2), stats
    assert stats["max_lse_err"] < (5e-2 if kv_fp8 else 1e-2), stats


@pytest.mark.parametrize("kv_cache_dtype,spec,block_size,fp8_query", [
    ("auto", 0, None, False), ("auto", 3, 32, False), ("fp8", 0, 64, False), ("fp8", 1, 16, False),
    ("fp8", 0, 64, True)])
def test_forward_mqa_matches_reference_in_vllm(kv_cache_dtype, spec, block_size, fp8_query):
    args = ["eager", "--kv-cache-dtype", kv_cache_dtype, "--speculative-tokens", str(spec)]
    if block_size:
        args += ["--block-size", str(block_size)]
    if fp8_query:
        args += ["--fp8-query"]
    result = run_check(*args)
    q_dtype = "torch.float8_e4m3fn" if fp8_query else "torch.bfloat16"
    assert_decode_checked(result["stats"], kv_cache_dtype == "fp8", 1 + spec, q_dtype)


def test_cuda_graphs_generate_like_eager():
    eager = run_check("eager")
    graphs = run_check("graphs")
    assert graphs["tokens"] == eager["tokens"]
    for lp_e, lp_g in zip(eager["logprobs"], graphs["logprobs"]):
        assert max(abs(a - b) for a, b in zip(lp_e, lp_g)) < 5e-2
