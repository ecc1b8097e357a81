"""vLLM end to end on a GPU: our builder's metadata and forward_mqa inside a real engine (tiny DeepSeek).

Every eager decode call is compared with the float32 reference on the inputs vLLM passed (see
vllm_gpu_check.py). The CUDA-graph run must generate what the eager run generates. The decode-context-parallel
tests need two GPUs (TP 2 x DCP 2): every rank's call checked on its shard, and the tokens and logprobs equal to
the same engine at TP 2 without DCP (same dummy weights: they depend on the TP sharding, so a one-GPU run has
other weights), eager and with CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from engine_result import run_result_script

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_gpu_check.py")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]


def run_check(*args: str) -> dict:
    return run_result_script(CHECK, *args)


def assert_decode_checked(stats: dict, kv_fp8: bool, q_len: int | str, q_dtype: str) -> None:
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


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def assert_same_generation(a: dict, b: dict, logprob_tol: float) -> None:
    assert a["tokens"] == b["tokens"], (a["tokens"], b["tokens"])
    for lp_a, lp_b in zip(a["logprobs"], b["logprobs"]):
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < logprob_tol


def test_prefix_cache_tails_take_the_decode_path():
    """The uncached tails of prefix-cache hits (5..100 new tokens per request after the cached blocks) run on our
    decode path as token requests, each call checked request by request against the float32 reference, and
    generate what the same engine generates when vLLM's prefill path computes them
    (CUTE_MLA_DECODE_MAX_QUERY_LEN=1); with CUDA graphs too."""
    ours = run_check("eager", "--prefix-tails")
    assert ours["stats"]["token_request_calls"] > 0, ours["stats"]
    assert_decode_checked(ours["stats"], False, "mixed", "torch.bfloat16")
    via_prefill = run_check("eager", "--prefix-tails", "--decode-max-query-len", "1")
    assert via_prefill["stats"]["token_request_calls"] == 0, via_prefill["stats"]
    assert_same_generation(ours, via_prefill, 5e-2)
    graphs = run_check("graphs", "--prefix-tails")
    assert_same_generation(ours, graphs, 5e-2)


@two_gpus
@pytest.mark.parametrize("interleave,spec,kv_cache_dtype", [(1, 0, "auto"), (64, 0, "auto"), (1, 2, "auto"),
                                                             (64, 1, "fp8")])
def test_dcp_two_gpus_matches_tp_without_dcp(interleave, spec, kv_cache_dtype):
    common = ["--tp", "2", "--speculative-tokens", str(spec), "--kv-cache-dtype", kv_cache_dtype,
              "--block-size", "64"]
    base = run_check("eager", *common)
    dcp = run_check("eager", *common, "--dcp", "2", "--interleave", str(interleave))
    stats = dcp["stats"]
    assert stats["workers"] == 2 and stats["dcp_world_sizes"] == {"2": stats["calls"]}, stats
    assert stats["heads"] == {"128": stats["calls"]}, stats  # 64 per rank, gathered over the DCP group
    assert_decode_checked(stats, kv_cache_dtype == "fp8", 1 + spec, "torch.bfloat16")
    if spec:
        assert stats["row_kv_lens_calls"] > 0, stats
    assert_same_generation(dcp, base, 5e-2 if kv_cache_dtype == "fp8" else 2e-2)


@two_gpus
def test_dcp_two_gpus_cuda_graphs_generate_like_eager():
    eager = run_check("eager", "--tp", "2", "--dcp", "2", "--speculative-tokens", "1")
    graphs = run_check("graphs", "--tp", "2", "--dcp", "2", "--speculative-tokens", "1")
    assert_same_generation(graphs, eager, 5e-2)
