"""The autotuner on a GPU (ops/autotune.py): it times every candidate of a shape under CUDA graphs, picks one,
keeps it in the tuning cache (a second run times nothing), and ``mla_decode(kernel="auto")`` captures the tuned
choice into a CUDA graph with one dict lookup, which then replays correctly for new lengths. The serving warm-up
hook tunes before capture. FlashInfer's SM100 adapters run only on SM100/SM103 (skipped elsewhere).

Run: ``pytest -m gpu tests/test_autotune_gpu.py`` (about a minute on an H100; the candidates are Triton and
cute_sm90 on SM90, so the first run also compiles their variants)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops import MLAWorkspace, api, autotune, mla_decode, prepare_args, registry, serving, tuned
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY
from mla_backend_plugin.ops.timing import capture_graph
from mla_backend_plugin.ops.tuned import Candidate, ShapeKey, TuneResult
from mla_backend_plugin.testing import assert_close_decode, make_decode_inputs

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_MLA_TUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("CUTE_MLA_KERNEL", raising=False)
    monkeypatch.delenv("CUTE_MLA_CANDIDATES", raising=False)
    monkeypatch.delenv("CUTE_MLA_TUNE_SEQ_LENS", raising=False)
    tuned.clear()
    tuned._CACHES.clear()
    yield
    tuned.clear()
    tuned._CACHES.clear()


def _cc():
    return torch.cuda.get_device_capability()


def _key(batch=4, seq=2048, q_len=1, heads=128, kv="bf16"):
    return ShapeKey(_cc(), kv, "bf16", "bf16", heads, q_len, 64, "pair", "none" if kv == "bf16" else "tensor",
                    batch, seq)


def test_tuner_times_every_candidate_picks_one_and_caches_it(tmp_path, monkeypatch):
    device = torch.device(DEVICE, torch.cuda.current_device())
    key = _key()
    cache = tuned.cache_for(device)
    report = autotune.tune_keys([key], device, cache=cache, time_per_candidate=0.01)
    assert report["tuned"] == 1, report
    (result,) = report["results"]
    print(result.summary(), json.dumps(result.refused, indent=1))
    assert result.winner in result.timings_us and result.static in result.timings_us
    assert len(result.timings_us) >= 2 and all(0 < t < 1e5 for t in result.timings_us.values())
    assert result.timings_us[result.winner] <= result.timings_us[result.static]
    data = json.loads((tmp_path / "autotune.json").read_text())
    (entries,) = data["entries"].values()
    assert entries[key.id()]["winner"] == result.winner  # written after the shape, atomically
    # a new process (fresh cache object): nothing is timed again
    monkeypatch.setattr(autotune, "tune_shape", lambda *a, **k: pytest.fail("timed a cached shape"))
    tuned.clear()
    fresh = tuned.TuneCache(cache.path, tuned.context_for(device))
    assert fresh.load() == 1
    again = autotune.tune_keys([key], device, cache=fresh)
    assert again["cached"] == 1 and again["results"][0].winner == result.winner


def test_the_tuned_choice_is_captured_in_a_cuda_graph_and_replays_correctly(monkeypatch):
    """mla_decode(kernel="auto") inside capture: the profile's choice (one dict lookup, never the static table,
    whatever max_seq_len says), and the graph replays correctly for other lengths, pages and contents."""
    batch, q_len, heads, bs, width = 3, 2, 128, 64, 64
    seen = []
    triton = registry.KERNELS["triton"]
    spy = dataclasses.replace(triton, launch=lambda a, w, c: (seen.append(c), triton.launch(a, w, c)))
    monkeypatch.setattr(registry, "KERNELS", {**dict(registry.KERNELS), "triton": spy})
    static = make_decode_inputs(batch, [300, 1500, 4000], q_len, heads, bs, BF16, "pair", DEVICE, 1,
                                num_blocks=batch * width + 5, max_blocks=width)
    args = prepare_args(static.q, static.kv_cache, static.block_table, static.seq_lens,
                        softmax_scale=static.softmax_scale)
    config = dataclasses.replace(triton.default_config(args, _cc()), split_plan="uniform", max_splits=64)
    cid = Candidate("triton", config).cid
    for seq in (1024, 4096):  # the winner of the deployment's buckets
        tuned.install(TuneResult(key=ShapeKey.of(args, _cc(), seq), timings_us={cid: 1.0}, refused={},
                                    winner=cid, static=None, labels={cid: "triton tuned"}, seconds=0.0))
    tuned.set_seq_profile([4096])
    ws = MLAWorkspace(DEVICE, max_batch=8, max_q_len=q_len, num_heads=heads, split_capacity=SPLIT_CAPACITY)
    out = torch.empty(batch * q_len, heads, 512, dtype=BF16, device=DEVICE)
    lse = torch.empty(batch * q_len, heads, dtype=torch.float32, device=DEVICE)

    def run(_):
        mla_decode(static.q, static.kv_cache, static.block_table, static.seq_lens, softmax_scale=static.softmax_scale,
                   out=out, lse=lse, workspace=ws, max_seq_len=100)  # ignored under capture

    def no_static(*a, **k):
        raise AssertionError("the static table was consulted during capture")

    with monkeypatch.context() as m:
        m.setattr(api, "select_kernel", no_static)
        graph = capture_graph(run)  # warm-up calls are eager: there max_seq_len=100 -> bucket 512, not tuned
    assert seen and seen[-1] == config, seen
    for i, lens in enumerate(([4000, 1, 64], [1, 2, 3], [2500, 4096, 129])):
        new = make_decode_inputs(batch, lens, q_len, heads, bs, BF16, "pair", DEVICE, 10 + i,
                                 num_blocks=batch * width + 5, max_blocks=width)
        static.load_(new)
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_decode_reference(*static.q, static.kv_cache, static.block_table, static.seq_lens,
                                                q_len, static.softmax_scale, None, None)
        assert_close_decode(out, lse, ref_out, ref_lse, BF16, msg=f"replay with seq_lens {lens}")


def test_serving_warm_up_tunes_before_capture(monkeypatch):
    """DeploymentTuning (a serving builder makes one and runs it on its first build) tunes within its budget; the
    graph captured after it runs a tuned choice."""
    monkeypatch.setenv("CUTE_MLA_CANDIDATES", "triton")  # few candidates: a short test
    device = torch.device(DEVICE, torch.cuda.current_device())
    dep = serving.make_deployment(num_heads=16, max_num_seqs=4, num_speculative_tokens=0, model_dtype=BF16,
                                  kv_cache_dtype="auto", block_size=64, max_model_len=2048, capture_sizes=[1, 4])
    hook = serving.DeploymentTuning(dep, tune=True, budget_s=300)
    ws = serving.make_workspace(device, max_num_seqs=4, num_speculative_tokens=0, num_heads=16, out_dtype=BF16)
    runner = serving.DecodeRunner(192 ** -0.5, "auto")
    inp = make_decode_inputs(4, [100, 2048, 7, 900], 1, 16, 64, BF16, "pair", DEVICE, 3, max_blocks=32)
    hook.run_once(device)  # eager, as a builder's first build: tunes
    assert hook.report["tuned"] == 2, hook.report
    runner.decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, ws)
    args = prepare_args(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=1.0)
    graph = capture_graph(lambda _: runner.decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, ws))
    torch.cuda.synchronize()
    assert tuned.lookup(args, _cc()) is not None
    out, lse = ws.output_views(4)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_decode(out, lse, *inp.reference(), BF16)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10,
                    reason="FlashInfer's MLA adapters run on SM100/SM103 only")
@pytest.mark.parametrize("kernel", ["flashinfer_cute_dsl", "flashinfer_trtllm"])
@pytest.mark.parametrize("case", ["bf16-pair", "bf16-cat", "fp8"])
def test_flashinfer_adapters_match_the_reference(kernel, case, monkeypatch):
    """Self-check first (the gate), then the adapter vs the reference, eager and replayed in a CUDA graph."""
    monkeypatch.setenv("CUTE_MLA_SELF_CHECK", "always")
    reason = registry.KERNELS[kernel].unsupported_reason(
        prepare_args(*make_decode_inputs(1, [64], 1, 128, 64, BF16, "cat", DEVICE, 0).call_args(),
                     softmax_scale=0.1), _cc())
    if reason:
        pytest.skip(reason)
    fp8 = case == "fp8"
    inp = make_decode_inputs(4, [1, 300, 2049, 5000], 2, 128, 64, torch.float8_e4m3fn if fp8 else BF16,
                             "fp8" if fp8 else case.split("-")[1], DEVICE, 7, kv_scale=2.0 if fp8 else None,
                             q_scale=0.5 if fp8 else None, poison="nan")
    ws = MLAWorkspace(DEVICE, max_batch=4, max_q_len=2, num_heads=128)
    out, lse = inp.poisoned_outputs()

    def run(_=0):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws, kernel=kernel,
                   out_dtype=BF16, **inp.scale_kwargs())

    run()
    torch.cuda.synchronize()
    ref = inp.reference()
    assert_close_decode(out, lse, *ref, inp.kv_cache.dtype, msg=f"{kernel} {case} eager")
    graph = capture_graph(run)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_decode(out, lse, *ref, inp.kv_cache.dtype, msg=f"{kernel} {case} graph")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prebuild_compiles_what_the_engine_then_launches(tmp_path, monkeypatch, kv_cache_dtype):
    """An engine's model construction starts background builds of exactly the variants its decode calls then
    launch: the first call waits for them and compiles nothing in-process (on SM90: cute_sm90)."""
    from mla_backend_plugin.kernels.cute_common import aot, background

    if _cc() != (9, 0):
        pytest.skip("cute_sm90 (the kernel the prebuild targets here) runs on SM90 only")
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path / "cute"))
    from mla_backend_plugin.kernels.cute_sm90 import launch

    launch._compiled.cache_clear()
    aot._prebuilt_cached.cache_clear()
    device = torch.device(DEVICE, torch.cuda.current_device())
    deployment = serving.make_deployment(num_heads=128, max_num_seqs=16, num_speculative_tokens=0,
                                         model_dtype=BF16, kv_cache_dtype=kv_cache_dtype, block_size=64,
                                         max_model_len=4096)
    with torch.device(DEVICE):  # as vLLM constructs models (the stand-in inputs must ignore it)
        started = autotune.prebuild_deployment(deployment, device)
    assert started and all(s.startswith("cute_sm90:") for s in started), started
    builds = sorted(b.name for b in background._BUILDS.values())
    assert len(builds) == len(started) + 1 and launch.STEP_PLAN.name in builds, builds  # + the step-plan kernel

    def no_compile(*a, **k):
        raise AssertionError("compiled in-process although the prebuild covered this call")

    monkeypatch.setattr(launch, "compile_variant", no_compile)
    fp8 = kv_cache_dtype == "fp8"
    for batch in (1, 16):
        inputs = make_decode_inputs(batch, [1000] * batch, 1, 128, 64, torch.float8_e4m3fn if fp8 else BF16, "pair",
                                    DEVICE, seed=batch, q_dtype=BF16, kv_scale=0.5 if fp8 else None)
        scales = inputs.scale_kwargs(as_tensor=True) if fp8 else {}
        ws = MLAWorkspace(device, max_batch=16, max_q_len=1, num_heads=128, out_dtype=BF16)
        out, lse = mla_decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                              softmax_scale=inputs.softmax_scale, workspace=ws, **scales)
        ref_out, ref_lse = inputs.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, inputs.kv_cache.dtype)
    assert not background._BUILDS  # every started build was waited for by a call
    launch._compiled.cache_clear()
