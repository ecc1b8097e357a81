"""vLLM integration on CPU: entry point, every backend-selection route, spawn, and validation reasons.

Each scenario of vllm_cpu_harness.py runs in its own interpreter (vLLM's platform and plugin state are
process-global), against the vLLM installed in this environment, with vLLM's real argument parsing,
config creation and backend selector.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from cuda_driver_stub import env_with_driver
from vllm_cpu_harness import SCENARIOS

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu_harness.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm,test]')")


@pytest.fixture(scope="session")
def driver_env():
    env = env_with_driver()
    env.pop("VLLM_ATTENTION_BACKEND", None)
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    return env


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_vllm_scenario(scenario, driver_env):
    proc = subprocess.run([sys.executable, HARNESS, scenario], env=driver_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and f"PASS {scenario}" in proc.stdout, (
        f"scenario {scenario} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n"
        f"--- stderr\n{proc.stderr[-8000:]}")
