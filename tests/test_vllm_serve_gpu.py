"""The README's headline command, run for real: ``VLLM_ATTENTION_BACKEND=CUTE_MLA vllm serve`` (and the
``--attention-backend CUTE_MLA`` form) on the tiny DeepSeek-V3 config with dummy weights and CUDA graphs,
concurrent completion requests of different lengths on loopback, the server's log naming CUTE_MLA, and the
returned tokens equal to an offline ``LLM(...)`` run of the same prompts (tests/vllm_gpu_check.py, graphs).

Needs the OpenAI server's extra wheels on the GPU host (../shared/gpu/wheels-serve.txt). Not yet run.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from engine_result import run_result_script

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(os.path.dirname(HERE), "examples", "tiny_deepseek", "model")
CHECK = os.path.join(HERE, "vllm_gpu_check.py")
# the prompts and settings of vllm_gpu_check.py, so that its offline run is the comparison
PROMPT_LENS = (1, 5, 17, 64, 100, 333, 1000, 2047)
MAX_TOKENS = 24


def _prompt(i: int, n: int) -> list[int]:
    return [(11 * i + 5 * j) % 4000 + 2 for j in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _tail(path: str, n: int = 6000) -> str:
    with open(path) as f:
        return f.read()[-n:]


def _wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    pytest.fail(f"vllm serve not healthy after {timeout} s:\n{_tail(log_path)}")


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    return run_result_script(CHECK, "graphs", "--max-tokens", str(MAX_TOKENS))["tokens"]


@pytest.mark.parametrize("form", ["env", "flag"])
def test_vllm_serve_headline_command(form, tmp_path, offline_tokens):
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL_DIR, "--load-format", "dummy",
           "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
           "--max-num-seqs", "32", "--gpu-memory-utilization", "0.4", "--seed", "0"]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1")
    if form == "env":
        env["VLLM_ATTENTION_BACKEND"] = "CUTE_MLA"
    else:
        env.pop("VLLM_ATTENTION_BACKEND", None)
        cmd += ["--attention-backend", "CUTE_MLA"]
    log_path = str(tmp_path / "serve.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc, log_path)

        def complete(i: int) -> list[int]:
            body = {"model": MODEL_DIR, "prompt": _prompt(i, PROMPT_LENS[i]), "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            return _post(base + "/v1/completions", body)["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPT_LENS)) as pool:  # concurrent, different lengths
            served = list(pool.map(complete, range(len(PROMPT_LENS))))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_text = _tail(log_path, 10**9)
    assert "CUTE_MLA" in log_text and "backend" in log_text, log_text[-4000:]
    assert served == offline_tokens
