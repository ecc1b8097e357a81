"""The model-level eval through vLLM on a GPU (issue 12): CUTE_MLA (kernel auto, CUDA graphs) on the trained eval
model at one context length, with a bf16 and an fp8 KV cache, against the float32 reference of the same run.

The thresholds come from that run, not from constants that a broken kernel could meet:

* accuracy per task: not significantly below the float32 reference's (one-sided two-proportion test, p < 0.01:
  the eval's own verdict);
* mean per-token KL(reference || CUTE_MLA) per task: at most ``KL_FACTOR`` x the larger of two yardsticks
  measured in the same run, or below the eval's NEGLIGIBLE_KL. One: what bf16 arithmetic alone costs (the
  ``torch bf16`` condition: the same model in plain torch bf16, no cache), for an fp8 cache times
  (e4m3 eps / bf16 eps)^2 = 256, since its values carry that much more rounding and the KL of a small
  perturbation grows with its square. Two: vLLM's own TRITON_MLA with the same KV dtype (it reads the same cache
  that vLLM wrote, fp8 rounding included).

The model: the directory in ``CUTE_MLA_EVAL_MODEL_DIR``, else ``mla_backend_plugin/evals/model`` (a source
install). Skipped without a GPU, without vLLM, or without weights.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from engine_result import engine_lock

from mla_backend_plugin.evals import missing_model, model_dir, plan, stats

EVAL_MODEL = model_dir()
LENGTH = 8192  # past DeepSeek's original 4096 (YaRN) and long enough for split-KV decode
PROBLEMS = 40  # per task
KV_DTYPES = ("auto", "fp8")
YARDSTICK_BACKEND = "TRITON_MLA"  # vLLM's own backend that takes both KV dtypes
FP8_ROUNDING = (torch.finfo(torch.float8_e4m3fn).eps / torch.finfo(torch.bfloat16).eps) ** 2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
              pytest.mark.skipif(missing_model(EVAL_MODEL) is not None, reason=str(missing_model(EVAL_MODEL)))]


@pytest.fixture(scope="module")
def eval_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("evals")
    cmd = [sys.executable, "-m", "mla_backend_plugin.evals", "--model", EVAL_MODEL, "--backends",
           f"CUTE_MLA,{YARDSTICK_BACKEND},{plan.TORCH}", "--kernels", "auto", "--kv-dtypes", ",".join(KV_DTYPES),
           "--modes", "graphs", "--spec", "0", "--lengths", str(LENGTH), "--problems", str(PROBLEMS),
           "--jobs", "5", "--timeout", "300", "--out", str(out)]
    with engine_lock():  # its engines share the GPU with each other (fixed KV caches), not with other tests'
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    path = out / "results.json"
    assert path.exists(), f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    results = json.loads(path.read_text())
    results["stdout"] = proc.stdout
    return results


def _rows(results: dict, condition: str, kv_dtype: str | None = None) -> dict[str, dict]:
    return {r["task"]: r for r in results["rows"]
            if r["condition"] == condition and (kv_dtype is None or r["kv_dtype"] == kv_dtype)}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cute_mla_is_as_accurate_as_the_float32_reference(eval_results, kv_dtype):
    label = plan.Condition("CUTE_MLA", "auto", kv_dtype, "graphs", 0).label
    runs = {r["condition"]: r for r in eval_results["runs"]}
    assert runs[label]["status"] == "ok", (runs[label], eval_results["stdout"][-3000:])
    assert runs[plan.TORCH_CONDITION.label]["status"] == "ok", runs[plan.TORCH_CONDITION.label]
    ours = _rows(eval_results, label)
    reference = _rows(eval_results, plan.REFERENCE, kv_dtype)
    bf16 = _rows(eval_results, plan.TORCH_CONDITION.label)
    peer = _rows(eval_results, plan.Condition(YARDSTICK_BACKEND, "-", kv_dtype, "graphs", 0).label)
    assert set(ours) == set(reference) == set(bf16) and ours
    for task, row in ours.items():
        ref = reference[task]
        assert row["n"] == ref["n"] == PROBLEMS and row["length"] == LENGTH
        p = stats.worse_p_value(row["hits"], row["n"], ref["hits"], ref["n"])
        assert p >= 0.01, (f"{label} {task}: accuracy {row['accuracy']:.3f} below the reference's "
                           f"{ref['accuracy']:.3f} (p = {p:.2g})")
        floor = bf16[task]["kl_mean"]
        assert math.isfinite(floor) and floor > 0, bf16[task]  # bf16 arithmetic always moves the distributions
        yardsticks = {"torch bf16" + (" x fp8 rounding" if kv_dtype == "fp8" else ""):
                      floor * (FP8_ROUNDING if kv_dtype == "fp8" else 1)}
        if task in peer and math.isfinite(peer[task]["kl_mean"]):
            yardsticks[YARDSTICK_BACKEND] = peer[task]["kl_mean"]
        allowed = max(stats.NEGLIGIBLE_KL, stats.KL_FACTOR * max(yardsticks.values()))
        assert row["kl_tokens"] >= row["n"], row  # at least each answer's first token was compared
        assert row["kl_mean"] <= allowed, f"{label} {task}: mean KL {row['kl_mean']:.3g} > {allowed:.3g} ({yardsticks})"
