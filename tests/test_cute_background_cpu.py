"""CPU tests of the background builds of CuTe-DSL variants (kernels/cute_common/background.py) and of the serving
hook that starts them at an engine's model construction (ops/serving.py ``prebuild_kernels``): a build started in
the background fills the on-disk cache in another process and the first use waits for it instead of compiling;
a failed build falls back to the in-process compile with its log in the warning; the hook runs once per process,
only with ``CUTE_MLA_PREBUILD=1``."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import pytest
import torch

from mla_backend_plugin.kernels.cute_common import aot, background, host
from mla_backend_plugin.kernels.cute_sm90 import config, launch
from mla_backend_plugin.kernels.cute_sm90.launch import AOT
from mla_backend_plugin.ops import autotune, serving

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))
dsl_only = pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
VARIANT = config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path / "cute"))
    for f in (launch._compiled, host.dsl_missing, aot._prebuilt_cached):
        f.cache_clear()
    background._BUILDS.clear()
    yield
    for build in background._BUILDS.values():
        build.proc.kill()
    background._BUILDS.clear()
    for f in (launch._compiled, host.dsl_missing, aot._prebuilt_cached):
        f.cache_clear()


@dsl_only
def test_a_background_build_serves_the_first_use(monkeypatch, caplog):
    import tvm_ffi

    assert background.start(AOT, VARIANT, True, "sm_90a")
    assert background.start(AOT, VARIANT, True, "sm_90a")  # running: not started twice
    assert len(background._BUILDS) == 1

    def no_compile(*a, **k):
        raise AssertionError("compiled in-process although a background build of the variant was running")

    monkeypatch.setattr(launch, "compile_variant", no_compile)
    with caplog.at_level(logging.INFO, logger="mla_backend_plugin"):
        fn = launch._compiled(VARIANT, True)  # waits for the child, then loads what it exported
    assert isinstance(fn, tvm_ffi.Function)
    assert "built in the background" in caplog.text
    assert AOT.check_entry(VARIANT, True, "sm_90a")[0] is not None
    assert not background.start(AOT, VARIANT, True, "sm_90a")  # cached now: nothing to build


@dsl_only
def test_the_step_plan_kernel_builds_in_the_background_with_the_split_kernel(monkeypatch):
    """cute_sm90's prebuild starts the step-plan kernel too (every launch plans its step with it; the child rebuilds
    a ``PlanVariant``, not a ``Variant``): an engine's first call then compiles nothing in-process."""
    from mla_backend_plugin.ops import prepare_args
    from mla_backend_plugin.ops.manifest import LaunchConfig
    from mla_backend_plugin.testing import make_decode_inputs

    inputs = make_decode_inputs(2, [70, 5], 1, 128, 64, torch.bfloat16, "pair", "cpu", 0)
    args = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens,
                        softmax_scale=inputs.softmax_scale)
    cfg = LaunchConfig(enable_pdl=True)
    monkeypatch.setattr(launch, "variant_for", lambda a, c, kv_multicast=False: VARIANT)
    monkeypatch.setattr(background, "start", lambda cache, variant, pdl, arch, _start=background.start:
                        variant == launch.STEP_PLAN and _start(cache, variant, pdl, arch))  # the plan kernel only
    assert launch.prebuild(args, cfg, (9, 0))
    assert [b.name for b in background._BUILDS.values()] == [launch.STEP_PLAN.name]
    monkeypatch.setattr(launch, "compile_variant", lambda *a, **k: pytest.fail("compiled in-process"))
    launch._compiled(launch.STEP_PLAN, True)  # waits for the child's build, then loads it
    assert AOT.check_entry(launch.STEP_PLAN, True, "sm_90a")[0] is not None and not background._BUILDS


@dsl_only
def test_a_failed_background_build_falls_back_to_compiling_here():
    broken = dataclasses.replace(AOT, builder_module="mla_backend_plugin.no_such_module")
    assert broken.cache_key(VARIANT, False, "sm_90a") == AOT.cache_key(VARIANT, False, "sm_90a")
    assert background.start(broken, VARIANT, False, "sm_90a")
    warned = []
    got = aot.compiled_from_cache_or_jit(broken, VARIANT, False, "sm_90a", lambda: "compiled here", warned.append)
    assert got == "compiled here"
    assert any("background build" in w and "no_such_module" in w for w in warned), warned


def test_nothing_is_started_without_a_cache_or_a_builder(monkeypatch):
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "0")
    assert not background.start(AOT, VARIANT, True, "sm_90a")
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "1")
    assert not background.start(dataclasses.replace(AOT, builder_module=""), VARIANT, True, "sm_90a")
    assert not background._BUILDS


def _deployment(**kw):
    return serving.make_deployment(num_heads=128, max_num_seqs=8, num_speculative_tokens=0,
                                   model_dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64,
                                   max_model_len=4096, **kw)


def test_the_engine_hook_prebuilds_once_per_process_and_can_be_turned_off(monkeypatch):
    calls = []
    monkeypatch.setattr(autotune, "prebuild_deployment", lambda d, dev, k: calls.append((d, dev, k)) or ["x:y"])
    monkeypatch.setattr(serving, "_PREBUILT", set())
    monkeypatch.delenv("CUTE_MLA_PREBUILD", raising=False)  # off by default (it did not shorten a cold start)
    assert serving.prebuild_kernels(_deployment(), "cuda:0") == [] and not calls
    monkeypatch.setenv("CUTE_MLA_PREBUILD", "0")
    assert serving.prebuild_kernels(_deployment(), "cuda:0") == [] and not calls
    monkeypatch.setenv("CUTE_MLA_PREBUILD", "1")
    assert serving.prebuild_kernels(_deployment(), "cuda:0") == ["x:y"]
    assert serving.prebuild_kernels(_deployment(), "cuda:0") == []  # every layer's impl asks; once is enough
    assert len(calls) == 1
    assert serving.prebuild_kernels(_deployment(fp8_query=False, tensor_scales=False), "cuda:1") == ["x:y"]


def test_the_engine_hook_never_raises(monkeypatch, caplog):
    def broken(*a):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(autotune, "prebuild_deployment", broken)
    monkeypatch.setattr(serving, "_PREBUILT", set())
    monkeypatch.setenv("CUTE_MLA_PREBUILD", "1")
    with caplog.at_level(logging.WARNING, logger="mla_backend_plugin"):
        assert serving.prebuild_kernels(_deployment(), "cuda:0") == []
    assert "compile on first use" in caplog.text


def test_prebuilding_needs_a_gpu():
    assert autotune.prebuild_deployment(_deployment(), torch.device("cpu")) == []


def test_stand_in_inputs_ignore_a_default_device_context():
    """vLLM constructs models under ``with torch.device("cuda")``; the prebuild's stand-in inputs are made there
    (a CPU generator drawing into a tensor of the default device failed: "Expected a 'cuda' device type for
    generator but found 'cpu'"). Here the default device is meta, which fails the same way."""
    from mla_backend_plugin.testing import make_decode_inputs

    with torch.device("meta"):
        inputs = make_decode_inputs(2, [70, 5], 1, 16, 64, torch.bfloat16, "pair", "cpu", 0)
    assert inputs.kv_cache.device.type == "cpu" and inputs.block_table.device.type == "cpu"


def test_a_variant_compiled_here_runs_from_the_library_it_exported(monkeypatch, tmp_path):
    """After an in-process compile the function handed out is the exported library's (as any later process loads
    it), not the JIT's own result, whose calls pass through a Python wrapper; when the export or the load fails,
    the JIT's result (with a warning)."""
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setattr(host, "dsl_missing", functools.cache(lambda: None))  # the fixture clears it
    calls = []
    monkeypatch.setattr(aot.AotCache, "find", lambda self, *a, **k: (None, "empty"))
    monkeypatch.setattr(aot.AotCache, "export", lambda self, compiled, *a, **k: calls.append(("export", compiled))
                        or str(tmp_path / "lib.so"))
    monkeypatch.setattr(aot.AotCache, "load_path", lambda self, path: calls.append(("load", path)) or "loaded")
    warned = []
    got = aot.compiled_from_cache_or_jit(AOT, VARIANT, True, "sm_90a", lambda: "jit", warned.append)
    assert got == "loaded" and calls == [("export", "jit"), ("load", str(tmp_path / "lib.so"))] and not warned

    def broken_load(self, path):
        raise OSError("no such library")

    monkeypatch.setattr(aot.AotCache, "load_path", broken_load)
    got = aot.compiled_from_cache_or_jit(AOT, VARIANT, True, "sm_90a", lambda: "jit", warned.append)
    assert got == "jit" and any("could not load" in w for w in warned), warned
