"""The autotuner without a GPU (ops/autotune.py, ops/tuned.py): shape-key buckets, the candidate filter and its
reasons, choosing (with the static choice's margin and over a context profile), the JSON cache (round trip, merge,
stale contexts), tuning with a stand-in measurement under a budget, and the graph-safe lookup that
mla_decode(kernel="auto") does.

Fake kernel families (KernelManifest with the reference's launch) stand in for compiled kernels; the registry is
pointed at them and the device capability is pretended."""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os

import pytest
import torch

from mla_backend_plugin.ops import LaunchConfig, PlanTile, autotune, prepare_args, registry, selfcheck, tuned
from mla_backend_plugin.ops.api import mla_decode
from mla_backend_plugin.ops.tuned import Candidate, ShapeKey, TuneCache, TuneResult
from mla_backend_plugin.ops.workspace import MLAWorkspace
from mla_backend_plugin.testing import make_decode_inputs

REFERENCE = registry.KERNELS["reference"]
HOPPER = (9, 0)


def _fake(name, *, reason=None, configs=None, plan_tile=True, seen=None):
    configs = configs or [LaunchConfig(enable_pdl=True), LaunchConfig(enable_pdl=False)]

    def launch(args, workspace, config):
        if seen is not None:
            seen.append((name, config))
        REFERENCE.launch(args, workspace, config)

    return dataclasses.replace(
        REFERENCE, name=name, verified_archs=frozenset({HOPPER}), unsupported_reason=lambda a, cc: reason,
        launch=launch, default_config=lambda a, cc: configs[0], configs=lambda a, cc: list(configs),
        plan_tile=(lambda h, smem, cfg: PlanTile(64, 64)) if plan_tile else None, combine="shared")


@pytest.fixture
def fakes(monkeypatch):
    """A registry of fake kernels on a pretend Hopper, no tuning cache, a clean live table."""
    seen = []
    kernels = {
        "fast": _fake("fast", seen=seen, configs=[LaunchConfig(), LaunchConfig(max_splits=64)]),
        "slow": _fake("slow", seen=seen),
        "nope": _fake("nope", reason="needs a B200"),
        "flaky": dataclasses.replace(_fake("flaky", seen=seen), verified_archs=frozenset()),
        "reference": REFERENCE,
    }
    monkeypatch.setattr(registry, "KERNELS", kernels)
    monkeypatch.setattr(registry, "AUTO_ORDER", {9: ("slow", "fast")})
    monkeypatch.setattr(selfcheck, "self_check_failure",
                        lambda spec, device, cc: "lse off by 3" if spec.name == "flaky" else None)
    monkeypatch.setenv("CUTE_MLA_TUNE_CACHE", "0")
    monkeypatch.delenv("CUTE_MLA_CANDIDATES", raising=False)
    monkeypatch.delenv("CUTE_MLA_TUNE_SEQ_LENS", raising=False)
    tuned.clear()
    yield seen
    tuned.clear()


def _inputs(batch=3, seq=300, q_len=1, heads=16, q_form="pair", kv_dtype=torch.bfloat16, **kw):
    return make_decode_inputs(batch, [seq] * batch, q_len, heads, 64, kv_dtype, q_form, "cpu", 0, **kw)


def _args(inputs, tensor_scales=False):
    return prepare_args(*inputs.call_args(), softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype,
                        **inputs.scale_kwargs(as_tensor=tensor_scales))


# ---------------------------------------------------------------------------------------------- shape keys

def test_buckets():
    assert [tuned.batch_bucket(b) for b in (1, 2, 3, 24, 32, 33, 512)] == [1, 2, 4, 32, 32, 64, 512]
    assert tuned.seq_bucket(1) == tuned.MIN_SEQ_BUCKET == 512
    assert [tuned.seq_bucket(s) for s in (1024, 1025, 8000, 8192, 32768)] == [1024, 2048, 8192, 8192, 32768]
    assert tuned.seq_bucket(10**7) == tuned.MAX_SEQ_BUCKET


def test_shape_key_of_a_call():
    pair = _args(_inputs(batch=24, q_form="pair"))
    cat = _args(_inputs(batch=24, q_form="cat"))
    fp8 = _args(_inputs(q_form="fp8", kv_dtype=torch.float8_e4m3fn, kv_scale=2.0, q_scale=0.5), tensor_scales=True)
    k = ShapeKey.of(pair, HOPPER, 5000)
    assert (k.batch, k.seq, k.q_form, k.scale_form, k.kv_dtype, k.q_dtype) == (32, 8192, "pair", "none", "bf16",
                                                                                "bf16")
    assert ShapeKey.of(cat, HOPPER, 5000).q_form == "cat"
    kf = ShapeKey.of(fp8, HOPPER, 100)
    assert (kf.kv_dtype, kf.q_dtype, kf.out_dtype, kf.q_form, kf.scale_form, kf.seq) == (
        "fp8", "fp8", "bf16", "cat", "tensor", 512)
    float_scales = _args(_inputs(kv_dtype=torch.float8_e4m3fn, kv_scale=2.0))
    assert ShapeKey.of(float_scales, HOPPER, 1).scale_form == "float"
    assert ShapeKey.from_dict(json.loads(json.dumps(k.as_dict()))) == k
    assert k.id() == "sm90 kv=bf16 q=bf16 out=bf16 h16 q_len=1 bs64 pair scales=none B<=32 S<=8192"


# ---------------------------------------------------------------------------------------------- candidates

def test_candidate_kernels_per_arch_and_from_the_environment(monkeypatch):
    monkeypatch.delenv("CUTE_MLA_CANDIDATES", raising=False)
    assert registry.candidate_kernels((9, 0)) == ["cute_sm90", "triton"]
    assert registry.candidate_kernels((10, 0)) == ["flashinfer_cute_dsl", "cute_sm100", "triton", "flashinfer_trtllm"]
    assert registry.candidate_kernels(None) == []
    monkeypatch.setenv("CUTE_MLA_CANDIDATES", "+xqa_sm120")
    assert registry.candidate_kernels((9, 0)) == ["cute_sm90", "triton", "xqa_sm120"]
    monkeypatch.setenv("CUTE_MLA_CANDIDATES", "triton")
    assert registry.candidate_kernels((9, 0)) == ["triton"]
    assert registry.candidate_kernels((9, 0), ["cute_sm90", "+triton"]) == ["cute_sm90", "triton"]
    monkeypatch.setenv("CUTE_MLA_CANDIDATES", "triton,flashmla")
    with pytest.raises(ValueError, match="CUTE_MLA_CANDIDATES: unknown kernel 'flashmla'; allowed: .*triton"):
        registry.candidate_kernels((9, 0))
    with pytest.raises(ValueError, match="unknown kernel 'reference'"):
        registry.candidate_kernels((9, 0), ["reference"])


def test_candidates_are_filtered_with_reasons(fakes):
    args = _args(_inputs())
    workspace = MLAWorkspace("cpu", max_batch=4, num_heads=16, num_sms=132)  # split capacity 32
    found, refused = autotune.candidates_for(args, HOPPER, workspace, kernels=["fast", "slow", "nope", "flaky"])
    assert [c.label for c in found] == ["fast:balanced pdl", "slow:balanced pdl", "slow:balanced no-pdl"]
    assert refused == {
        "fast:balanced splits<=64 pdl": "config: max_splits=64 exceeds the workspace's split capacity 32",
        "nope": "needs a B200",
        "flaky": "failed its self-check: lse off by 3",
    }
    roomy = MLAWorkspace("cpu", max_batch=4, num_heads=16, num_sms=132, split_capacity=64)
    found, refused = autotune.candidates_for(args, HOPPER, roomy, kernels=["fast"])
    assert len(found) == 2 and not refused
    found, refused = autotune.candidates_for(args, HOPPER, None, kernels=["flaky"], check=False)
    assert len(found) == 2 and not refused  # a dry run without a GPU does not self-check


def test_candidate_ids_round_trip():
    c = Candidate("triton", LaunchConfig(split_plan="uniform", max_splits=64, enable_pdl=False, tile=(64, 64, 8, 2)))
    assert Candidate.from_cid(c.cid) == c
    assert c.label == "triton:uniform splits<=64 tile 64x64x8x2 no-pdl"
    assert Candidate("flashinfer_trtllm", LaunchConfig(enable_pdl=False)).label == "flashinfer_trtllm:no-pdl"


# ---------------------------------------------------------------------------------------------- choosing

def test_choose_keeps_the_static_choice_within_the_margin():
    assert tuned.choose({"a": 100.0, "b": 99.5}, static="a") == "a"  # 0.5% faster: noise
    assert tuned.choose({"a": 100.0, "b": 98.0}, static="a") == "b"
    assert tuned.choose({"a": 100.0, "b": 98.0}, static=None) == "b"
    assert tuned.choose({}, static="a") is None


def _result(seq, timings, static="a", batch=8, shape=None):
    key = shape or ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 1, 64, "pair", "none", batch, seq)
    key = dataclasses.replace(key, seq=seq, batch=batch)
    cids = {name: Candidate(name, LaunchConfig()).cid for name in timings}
    return TuneResult(key=key, timings_us={cids[n]: t for n, t in timings.items()}, refused={},
                      winner=tuned.choose({cids[n]: t for n, t in timings.items()}, cids.get(static)),
                      static=cids.get(static), labels={c: n for n, c in cids.items()}, seconds=1.0)


def test_one_choice_for_a_context_profile():
    short = _result(1024, {"a": 10.0, "b": 20.0})
    long = _result(32768, {"a": 300.0, "b": 200.0})
    assert short.winner.startswith("a|") and long.winner.startswith("b|")
    # geometric mean of time / each bucket's best: a (1, 1.5) ~1.22, b (2, 1) ~1.41
    assert tuned.choose_for_profile([short, long]).startswith("a|")
    assert tuned.choose_for_profile([short]) == short.winner
    assert tuned.choose_for_profile([]) is None


# ---------------------------------------------------------------------------------------------- cache

def _ctx(gpu="NVIDIA H100 80GB HBM3", sources="abc"):
    return {"gpu": gpu, "cc": "9.0", "sms": 132, "package": "0.1.0", "sources": sources, "versions": {"torch": "2"}}


def test_cache_round_trip_merge_and_stale_contexts(tmp_path, caplog):
    path = str(tmp_path / "sub" / "autotune.json")
    r1, r2 = _result(1024, {"a": 10.0, "b": 12.0}), _result(4096, {"a": 50.0, "b": 40.0})
    first = TuneCache(path, _ctx())
    first.put(r1)
    first.save()
    second = TuneCache(path, _ctx())  # another process of the same context
    assert second.load() == 1
    second.put(r2)
    second.save()
    first.save()  # merges: r2 written by the other process is kept
    fresh = TuneCache(path, _ctx())
    assert fresh.load() == 2
    assert fresh.get(r1.key).as_entry() == r1.as_entry() and fresh.get(r2.key).winner == r2.winner
    assert os.listdir(tmp_path / "sub") == ["autotune.json", "autotune.json.lock"]  # no temporary left behind
    other_gpu = TuneCache(path, _ctx(gpu="NVIDIA B200"))
    other_gpu.put(r1)
    other_gpu.save()
    with caplog.at_level(logging.INFO, logger="mla_backend_plugin"):
        edited = TuneCache(path, _ctx(sources="def"))  # a kernel source changed
        assert edited.load() == 0 and edited.get(r1.key) is None
    assert "2 cached results for NVIDIA H100 80GB HBM3" in caplog.text and "stale (changed: sources)" in caplog.text
    edited.put(r2)
    edited.save()  # drops the stale context of this GPU, keeps the B200's
    with open(path) as f:
        data = json.load(f)
    assert sorted(c["gpu"] for c in data["contexts"].values()) == ["NVIDIA B200", "NVIDIA H100 80GB HBM3"]
    assert sum(len(e) for e in data["entries"].values()) == 2


def test_cache_tolerates_a_broken_file(tmp_path, caplog):
    path = tmp_path / "autotune.json"
    path.write_text("{not json")
    cache = TuneCache(str(path), _ctx())
    with caplog.at_level(logging.WARNING, logger="mla_backend_plugin"):
        assert cache.load() == 0
    assert "cannot be read" in caplog.text
    cache.put(_result(1024, {"a": 1.0}))
    cache.save()
    assert TuneCache(str(path), _ctx()).load() == 1


def test_cache_path_from_the_environment(monkeypatch):
    monkeypatch.setenv("CUTE_MLA_TUNE_CACHE", "0")
    assert tuned.default_cache_path() is None
    monkeypatch.delenv("CUTE_MLA_TUNE_CACHE")
    assert tuned.default_cache_path().endswith(os.path.join(".cache", "mla_backend_plugin", "autotune.json"))
    monkeypatch.setenv("CUTE_MLA_TUNE_CACHE", "/tmp/x.json")
    assert tuned.default_cache_path() == "/tmp/x.json"
    assert len(tuned.sources_hash()) == 16


# ---------------------------------------------------------------------------------------------- tuning

def test_tune_shape_and_keys_with_a_stand_in_measurement(fakes, tmp_path):
    key = ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 1, 64, "pair", "none", 2, 512)
    calls = []

    def measure(key, candidates, static, inputs, copies, workspace, deadline, time_per_candidate):
        calls.append(key)
        assert inputs.batch == key.batch and inputs.seq_lens_list == [key.seq] * key.batch
        assert static == candidates[0]  # the arch table's first kernel ("slow") when no GPU decides
        return {c.cid: (50.0 if c.kernel == "fast" else 100.0) for c in candidates}, {"x": "failed to capture"}

    result = autotune.tune_shape(key, "cpu", kernels=["slow", "fast", "nope"], measure=measure)
    assert result.labels[result.winner] == "fast:balanced pdl"
    assert result.refused == {"nope": "needs a B200", "x": "failed to capture"}
    assert result.labels[result.static] == "slow:balanced pdl"

    cache = TuneCache(str(tmp_path / "c.json"), _ctx())
    keys = [key, dataclasses.replace(key, batch=4)]
    report = autotune.tune_keys(keys, "cpu", cache=cache, kernels=["slow", "fast"], measure=measure)
    assert (report["tuned"], report["cached"], len(calls)) == (2, 0, 3)
    tuned.clear()
    again = TuneCache(str(tmp_path / "c.json"), _ctx())
    again.load()
    report = autotune.tune_keys(keys, "cpu", cache=again, kernels=["slow", "fast"], measure=measure)
    assert (report["tuned"], report["cached"], len(calls)) == (0, 2, 3)  # warm cache: nothing timed
    report = autotune.tune_keys([dataclasses.replace(key, batch=8)], "cpu", budget_s=0.0, measure=measure)
    assert report["tuned"] == 0 and len(report["not_reached"]) == 1  # the budget is spent


def test_a_choice_is_the_best_worst_case_over_length_profiles():
    # the H100's fp8 B=8 S=32k cells (2026-11-24): the default wins on uniform lengths by 0.2%, the split cap wins
    # by 10% when one request is long and the rest short
    uniform = {"default": 306.0, "splits64": 306.7, "dequant": 417.6}
    one_long = {"default": 72.0, "splits64": 64.9, "dequant": 90.0}
    assert tuned.choose(uniform, "default") == "default"
    assert tuned.choose_minimax({"uniform": uniform, "one-long": one_long}, "default") == "splits64"
    # a profile where nothing could be timed does not decide; with one profile it is ``choose``
    assert tuned.choose_minimax({"uniform": uniform, "one-long": {}}, "default") == "default"
    assert tuned.choose_minimax({"uniform": {}}, None) is None
    # a candidate missing from a profile cannot be the answer
    assert tuned.choose_minimax({"uniform": uniform, "one-long": {"default": 72.0, "dequant": 90.0}},
                                   "default") == "default"


def test_length_profiles():
    key = ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 1, 64, "pair", "none", 4, 4096)
    assert autotune.profiles_for(key) == ("uniform", "one-long")
    assert autotune.profiles_for(dataclasses.replace(key, batch=1)) == ("uniform",)
    assert autotune.profiles_for(dataclasses.replace(key, seq=autotune.ONE_LONG_SHORT)) == ("uniform",)
    assert autotune.profile_lengths("one-long", 4, 4096) == [4096, 1024, 1024, 1024]
    assert autotune.profile_lengths("uniform", 2, 4096) == [4096, 4096]
    with pytest.raises(ValueError, match="one-long"):
        autotune.profile_lengths("ragged", 2, 4096)


def test_tune_shape_times_every_length_profile_and_keeps_the_best_worst_case(fakes, tmp_path):
    key = ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 1, 64, "pair", "none", 4, 4096)
    seen_lengths = []

    def measure(key, candidates, static, inputs, copies, workspace, deadline, time_per_candidate):
        lengths = inputs.seq_lens_list
        seen_lengths.append(lengths)
        one_long = lengths != [key.seq] * key.batch
        # "slow" (the static choice) wins on uniform lengths; fast's split cap wins by far on one long request
        times = {"slow": 100.0, "fast": 100.5} if not one_long else {"slow": 80.0, "fast": 50.0}
        return {c.cid: times[c.kernel] + (0.3 if c.config.max_splits else 0.0) for c in candidates}, {}

    result = autotune.tune_shape(key, "cpu", kernels=["slow", "fast"], measure=measure)
    assert seen_lengths == [[4096] * 4, [4096, 1024, 1024, 1024]]
    assert result.labels[result.winner].startswith("fast:") and result.labels[result.static].startswith("slow:")
    assert set(result.profile_timings_us) == {"one-long"} and result.timings_us[result.static] == 100.0
    # the cache keeps both profiles' timings
    cache = TuneCache(str(tmp_path / "c.json"), _ctx())
    cache.put(result)
    cache.save()
    again = TuneCache(str(tmp_path / "c.json"), _ctx())
    again.load()
    assert again.get(key).profile_timings_us == result.profile_timings_us and again.get(key).winner == result.winner


def test_a_cache_of_the_uniform_only_format_is_ignored(tmp_path, caplog):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": 1, "contexts": {}, "entries": {}}))
    with caplog.at_level(logging.INFO, logger="mla_backend_plugin"):
        assert TuneCache(str(path), _ctx()).load() == 0
    assert "cache format 1" in caplog.text


def test_tuning_inputs_stay_within_memory(fakes):
    key = ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 1, 64, "pair", "none", 4, 4096)
    full, copies = autotune.tuning_inputs(key, "cpu", l2_bytes=16 * 2**20)
    assert copies == 2 and full.kv_cache.shape[0] > 4 * 64  # 4 x 4096 tokens of 1152 B = 18 MiB; 2 x L2 = 32
    small, copies = autotune.tuning_inputs(key, "cpu", l2_bytes=16 * 2**20, max_input_bytes=1 * 2**20)
    assert copies == 1 and small.kv_cache.shape[0] == 2**20 // (64 * 576 * 2)  # requests share a pool of pages
    assert small.seq_lens_list == [4096] * 4
    capped, _ = autotune.tuning_inputs(key, "cpu", max_blocks=40)  # the engine's block table: 40 pages
    assert capped.block_table.shape[1] == 48 and capped.seq_lens_list == [2560] * 4


# ---------------------------------------------------------------------------------------------- lookup

def test_lookup_is_graph_safe(fakes, monkeypatch):
    args = _args(_inputs(batch=24))  # batch bucket 32
    shape = ShapeKey.of(args, HOPPER, 1)
    tuned.install(_result(1024, {"slow": 10.0, "fast": 20.0}, static="slow", batch=32, shape=shape))
    tuned.install(_result(32768, {"slow": 300.0, "fast": 100.0}, static="slow", batch=32, shape=shape))
    assert tuned.lookup(args, HOPPER) is None  # no context profile yet: the static table decides
    assert tuned.lookup(args, HOPPER, max_seq_len=900).label == "slow:balanced pdl"
    assert tuned.lookup(args, HOPPER, max_seq_len=30000).label == "fast:balanced pdl"
    tuned.set_seq_profile([32000])
    profile_choice = tuned.lookup(args, HOPPER)
    assert profile_choice.label == "fast:balanced pdl"
    monkeypatch.setattr(tuned, "stream_capturing", lambda device: True)
    # under capture the host's length is ignored: one graph serves every length
    assert tuned.lookup(args, HOPPER, max_seq_len=900) is profile_choice
    monkeypatch.setattr(tuned, "stream_capturing", lambda device: False)
    tuned.set_seq_profile(None)
    monkeypatch.setenv("CUTE_MLA_TUNE_SEQ_LENS", "1000,30000")
    assert tuned.seq_profile() == (1024, 32768)
    tuned.set_seq_profile(None)
    assert tuned.lookup(args, HOPPER).label == "fast:balanced pdl"  # (0.5x .. 1) vs (2x .. 1) geomean
    assert tuned.lookup(_args(_inputs(batch=64)), HOPPER) is None  # another batch bucket: not tuned
    assert tuned.lookup(args, None) is None


def test_lookup_refuses_what_cannot_run_now(fakes, monkeypatch):
    args = _args(_inputs(batch=2))
    shape = ShapeKey.of(args, HOPPER, 1)
    tuned.install(_result(1024, {"flaky": 1.0, "slow": 10.0}, static="slow", batch=2, shape=shape))
    tuned.set_seq_profile([1024])
    with pytest.warns(RuntimeWarning, match="flaky:balanced pdl failed its self-check and is not used"):
        assert tuned.lookup(args, HOPPER) is None
    registry.KERNELS["slow"] = dataclasses.replace(registry.KERNELS["slow"], unsupported_reason=lambda a, cc: "no")
    tuned.install(_result(1024, {"slow": 1.0}, static="slow", batch=2, shape=shape))
    assert tuned.lookup(args, HOPPER) is None


def test_mla_decode_auto_runs_the_tuned_choice(fakes, monkeypatch):
    """kernel="auto" takes the installed choice (its config too); explicit kernels and configs bypass it."""
    monkeypatch.setattr(registry, "device_capability", lambda device: HOPPER)
    for name in ("slow", "fast"):  # no workspace in this test: the fakes plan nothing
        registry.KERNELS[name] = dataclasses.replace(registry.KERNELS[name], plan_tile=None)
    inputs = _inputs(batch=2)
    args = _args(inputs)
    tuned_config = LaunchConfig(max_splits=64)
    key = ShapeKey.of(args, HOPPER, 1)
    cid = Candidate("fast", tuned_config).cid
    tuned.install(TuneResult(key=dataclasses.replace(key, seq=1024), timings_us={cid: 1.0}, refused={},
                                winner=cid, static=None, labels={cid: "fast"}, seconds=0.0))
    tuned.set_seq_profile([1000])
    kw = dict(softmax_scale=inputs.softmax_scale)
    mla_decode(*inputs.call_args(), **kw)
    mla_decode(*inputs.call_args(), kernel="slow", **kw)
    mla_decode(*inputs.call_args(), config=LaunchConfig(enable_pdl=False), **kw)
    mla_decode(*inputs.call_args(), enable_pdl=False, **kw)
    assert fakes == [("fast", tuned_config), ("slow", LaunchConfig(enable_pdl=True)),
                     ("slow", LaunchConfig(enable_pdl=False)), ("fast", LaunchConfig(max_splits=64, enable_pdl=False))]
    out, lse = mla_decode(*inputs.call_args(), **kw)
    ref_out, ref_lse = inputs.reference()
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


def test_explicit_kernels_that_plan_splits_run_with_their_default_config(fakes, monkeypatch):
    """A named kernel with a split plan (a workspace) and no config gets its default config; the check that a tuned
    choice fits the workspace is skipped for it (a regression: every named cute_sm90 / triton call failed on the
    GPU with "'NoneType' object has no attribute 'max_splits'")."""
    monkeypatch.setattr(registry, "device_capability", lambda device: HOPPER)
    inputs = _inputs(batch=2)
    kw = dict(softmax_scale=inputs.softmax_scale)
    out, lse = mla_decode(*inputs.call_args(), kernel="slow", **kw)
    mla_decode(*inputs.call_args(), kernel="fast", **kw)
    assert fakes == [("slow", LaunchConfig(enable_pdl=True)), ("fast", LaunchConfig())]
    ref_out, ref_lse = inputs.reference()
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------- warm-up hook

def test_deployment_from_engine_limits(monkeypatch):
    from mla_backend_plugin.ops import serving

    monkeypatch.delenv("CUTE_MLA_TUNE_SEQ_LENS", raising=False)
    dep = serving.make_deployment(num_heads=16, max_num_seqs=16, num_speculative_tokens=1,
                                  model_dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64,
                                  max_model_len=5000, capture_sizes=[1, 2, 4, 8, 16, 24, 32, 40])
    assert dep.q_len == 2 and dep.batches == (1, 2, 4, 8, 12, 16)  # tokens / q_len, up to max_num_seqs
    assert (dep.kv_dtype, dep.q_dtype, dep.q_form, dep.scale_form) == ("fp8", "bf16", "pair", "tensor")
    assert dep.seq_lens == (5000,) and dep.max_blocks == 79
    assert [k.batch for k in dep.keys(HOPPER)] == [1, 2, 4, 8, 16] and {k.seq for k in dep.keys(HOPPER)} == {8192}
    monkeypatch.setenv("CUTE_MLA_TUNE_SEQ_LENS", "2048,8192")
    eager = serving.make_deployment(num_heads=128, max_num_seqs=100, num_speculative_tokens=0,
                                    model_dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64,
                                    max_model_len=5000, fp8_query=True)
    assert eager.batches == (1, 2, 4, 8, 16, 32, 64) and eager.seq_lens == (2048, 8192)
    assert (eager.q_dtype, eager.q_form) == ("fp8", "cat")


def test_warm_up_hook_runs_once_and_never_during_capture(monkeypatch):
    from mla_backend_plugin.ops import serving

    calls = []
    monkeypatch.setattr(autotune, "prepare_deployment",
                        lambda dep, device, tune, budget_s: calls.append((device, tune, budget_s)) or {"tuned": 0})
    monkeypatch.setenv("CUTE_MLA_AUTOTUNE", "1")
    monkeypatch.setenv("CUTE_MLA_AUTOTUNE_BUDGET_S", "7.5")
    dep = serving.make_deployment(num_heads=16, max_num_seqs=4, num_speculative_tokens=0, model_dtype=torch.bfloat16,
                                  kv_cache_dtype="auto", block_size=64, max_model_len=4096)
    hook = serving.DeploymentTuning(dep)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    hook.run_once("cuda:0")  # inside capture: nothing (it would synchronise)
    assert calls == [] and hook.report is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    hook.run_once("cuda:0")
    hook.run_once("cuda:0")
    assert calls == [(torch.device("cuda:0"), True, 7.5)]
    # a failing tuner leaves the static table in charge, with a warning, and is not retried every step
    monkeypatch.setattr(autotune, "prepare_deployment", lambda *a, **k: 1 / 0)
    broken = serving.DeploymentTuning(dep, tune=False)
    broken.run_once("cpu")
    broken.run_once("cpu")
    assert broken.report == {}


def test_decode_warm_up_runs_every_batch_and_q_len_the_eager_steps_can_bring(monkeypatch):
    """warm_up_decode: one serving call per (q_len 1 .. the workspace's, batch 1 .. the workspace's), with the
    deployment's q form and scale form and the profile's choice (max_seq_len None); a q_len no kernel serves is
    skipped, not fatal. run_once runs it once per workspace and deployment (a second builder on the same
    workspace reuses its report), given the engine's workspace, on a GPU device only, unless
    CUTE_MLA_DECODE_WARMUP=0 (an n-gram engine JIT-compiled the combine's q_len-1 plans during inference)."""
    from mla_backend_plugin.ops import serving

    seen = []

    class Recorder(serving.DecodeRunner):
        def decode(self, q, kv_cache, block_table, seq_lens, workspace, **kw):
            rows, batch = q.shape[0], block_table.shape[0]
            if rows // batch == 2 and batch == 3:
                raise ValueError("no kernel for this shape")
            seen.append((rows // batch, batch, q.dtype, kv_cache.dtype, type(kw["kv_scale"]), kw["max_seq_len"]))

    monkeypatch.setattr(serving, "DecodeRunner", Recorder)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    dep = serving.make_deployment(num_heads=128, max_num_seqs=4, num_speculative_tokens=1,
                                  model_dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=64,
                                  max_model_len=4096, fp8_query=True)
    ws = MLAWorkspace("cpu", max_batch=4, max_q_len=2, num_heads=128, num_sms=4, out_dtype=torch.bfloat16)
    report = serving.warm_up_decode(dep, ws)
    assert [(q, b) for q, b, *_ in seen] == [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2)]
    fp8 = torch.float8_e4m3fn
    assert all(x[2:] == (fp8, fp8, torch.Tensor, None) for x in seen)  # fp8 q, fp8 cache, tensor scales
    assert report["calls"] == 6 and len(report["skipped"]) == 1 and "q_len 2" in report["skipped"][0]

    ran = []
    monkeypatch.setattr(serving, "warm_up_decode", lambda d, w: ran.append(w) or {"calls": 1})
    monkeypatch.setattr(autotune, "prepare_deployment", lambda *a, **k: {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    serving.DeploymentTuning(dep).run_once("cpu", ws)  # no GPU: nothing to warm up
    serving.DeploymentTuning(dep).run_once("cuda:0")  # no workspace (an engine's hook without one)
    hook = serving.DeploymentTuning(dep)
    hook.run_once("cuda:0", ws)
    hook.run_once("cuda:0", ws)
    assert ran == [ws] and hook.report["warm_up"] == {"calls": 1}
    again = serving.DeploymentTuning(dep)  # a second builder on the same workspace (vLLM 0.26's memory profile)
    again.run_once("cuda:0", ws)
    assert ran == [ws] and again.report["warm_up"] == {"calls": 1}
    monkeypatch.setenv("CUTE_MLA_DECODE_WARMUP", "0")
    serving.DeploymentTuning(dep).run_once("cuda:0", ws)
    assert ran == [ws]


def test_decode_does_no_warm_up_and_picks_by_the_length_the_engine_may_use(monkeypatch):
    """The warm-up is the builder's (DeploymentTuning.run_once on its first build): a decode call passes on the
    length its metadata holds, which is the step's longest for an eager engine and None under full decode graphs
    (their warm-up and capture run the context profile's choice)."""
    from mla_backend_plugin.ops import serving

    calls = []
    monkeypatch.setattr(serving, "mla_decode", lambda *a, **kw: calls.append(kw["max_seq_len"]))
    monkeypatch.setattr(autotune, "prepare_deployment", lambda *a, **k: calls.append("warm-up") or {})
    dep = serving.make_deployment(num_heads=16, max_num_seqs=2, num_speculative_tokens=0, model_dtype=torch.bfloat16,
                                  kv_cache_dtype="auto", block_size=64, max_model_len=4096)
    inputs = _inputs(batch=2)
    ws = MLAWorkspace("cpu", max_batch=2, num_heads=16, num_sms=4, out_dtype=torch.bfloat16)
    runner = serving.DecodeRunner(inputs.softmax_scale, "auto")
    for host_lengths in (True, False):
        hook = serving.DeploymentTuning(dep, host_lengths=host_lengths)
        runner.decode(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, ws,
                      max_seq_len=hook.choice_seq_len(300))
    assert calls == [300, None]
    assert "tuning" not in inspect.signature(serving.DecodeRunner.decode).parameters


def test_prepare_deployment_on_cpu_sets_the_profile(monkeypatch):
    tuned.clear()
    dep = autotune.Deployment(num_heads=16, q_len=1, kv_dtype="bf16", q_dtype="bf16", out_dtype="bf16",
                              block_size=64, batches=(1, 8), seq_lens=(3000, 20000))
    report = autotune.prepare_deployment(dep, "cpu", tune=True, budget_s=1.0)
    assert report["tuned"] == 0 and tuned.seq_profile() == (4096, 32768)
    tuned.clear()


def test_the_gpu_measurement_path_with_the_timing_core_stubbed(fakes, monkeypatch):
    """measure_on_gpu as it runs on a GPU (mla_decode per candidate, checked against the static choice's output,
    captured, timed), with CUDA graphs and events replaced by stand-ins so it runs here."""
    from mla_backend_plugin.ops import timing

    def wrong(args, workspace, config):
        REFERENCE.launch(args, workspace, config)
        args.out.mul_(1.5)

    def raises(args, workspace, config):
        raise RuntimeError("too many resources requested for launch")

    registry.KERNELS["wrong"] = dataclasses.replace(registry.KERNELS["slow"], name="wrong", launch=wrong)
    registry.KERNELS["raises"] = dataclasses.replace(registry.KERNELS["slow"], name="raises", launch=raises)
    monkeypatch.setattr(registry, "device_capability", lambda device: HOPPER)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    captured = []
    monkeypatch.setattr(timing, "capture_graph", lambda launch, calls, copies: captured.append(calls) or launch)
    monkeypatch.setattr(timing, "time_graphs", lambda graphs, *a, **k: {
        cid: timing.Timing(10.0 + i, 9.0, 11.0, 10) for i, cid in enumerate(graphs)})
    key = ShapeKey(HOPPER, "bf16", "bf16", "bf16", 16, 2, 64, "pair", "none", 2, 512)
    result = autotune.tune_shape(key, "cpu", kernels=["slow", "fast", "wrong", "raises"])
    labels = {result.labels[c]: t for c, t in result.timings_us.items()}
    assert list(labels) == ["slow:balanced pdl", "slow:balanced no-pdl", "fast:balanced pdl",
                            "fast:balanced splits<=64 pdl"]
    assert "differs from the static choice's output" in result.refused["wrong:balanced pdl"]
    assert result.refused["raises:balanced no-pdl"] == "first call: RuntimeError: too many resources requested " \
                                                       "for launch"
    assert result.labels[result.static] == "slow:balanced pdl" and result.winner == result.static
    assert captured == [8] * 4  # calls per graph: a multiple of the KV copies, at least 8
    assert all(name == "slow" for name, _ in fakes[:1])  # the static choice ran first: the others' reference


def test_the_tune_table_shows_both_length_profiles(capsys):
    from mla_backend_plugin import tune

    key = ShapeKey(HOPPER, "fp8", "bf16", "bf16", 128, 1, 64, "pair", "tensor", 8, 32768)
    result = TuneResult(key=key, timings_us={"a": 306.0, "b": 306.7}, refused={}, winner="b", static="a",
                        labels={"a": "default", "b": "splits64"}, seconds=1.0,
                        profile_timings_us={"one-long": {"a": 72.0, "b": 64.9}})
    tune.print_table([result, dataclasses.replace(result, profile_timings_us={})])
    rows = [line for line in capsys.readouterr().out.splitlines() if "splits64" in line]
    assert rows[0].endswith("306.7     306.0  1.00x  64.9 (72.0)") and rows[1].endswith("1.00x")


def test_the_choice_over_several_length_buckets_keeps_each_buckets_worst_case():
    key = ShapeKey(HOPPER, "fp8", "bf16", "bf16", 128, 1, 64, "pair", "tensor", 8, 8192)
    # uniform lengths favour "a" slightly in both buckets; with one long request "b" is far ahead in the long one
    short = TuneResult(key=key, timings_us={"a": 100.0, "b": 100.5}, refused={}, winner="a", static="a",
                       labels={}, seconds=0.0, profile_timings_us={"one-long": {"a": 50.0, "b": 49.8}})
    long = TuneResult(key=dataclasses.replace(key, seq=32768), timings_us={"a": 306.0, "b": 306.7}, refused={},
                      winner="b", static="a", labels={}, seconds=0.0,
                      profile_timings_us={"one-long": {"a": 72.0, "b": 64.9}})
    assert long.ratios_to_best() == pytest.approx({"a": 72.0 / 64.9, "b": 306.7 / 306.0})
    assert tuned.choose_for_profile([short, long]) == "b"
    # on uniform timings alone the profile would keep "a"
    uniform_only = [dataclasses.replace(r, profile_timings_us={}) for r in (short, long)]
    assert tuned.choose_for_profile(uniform_only) == "a"
