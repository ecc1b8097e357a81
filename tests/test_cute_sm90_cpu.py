"""CPU tests of the CuTe-DSL SM90 kernel's host side: support checks, variant keys, the shared-memory budget,
and one real sm_90a compile (no GPU needed) whose SASS must hold wgmma and TMA and no spills."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mla_backend_plugin.kernels.cute_sm90 import config
from mla_backend_plugin.kernels.cute_sm90.launch import unsupported_reason, variant_for
from mla_backend_plugin.ops import prepare_args
from mla_backend_plugin.ops.constants import FP8_DTYPE

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))


def _args(kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, heads=128, q_len=2, block_size=32, kv_scale=None):
    q = torch.zeros(2 * q_len, heads, 576, dtype=q_dtype)
    kv = torch.zeros(4, block_size, 576, dtype=kv_dtype)
    return prepare_args(q, kv, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                        softmax_scale=0.1, kv_scale=kv_scale,
                        out_dtype=torch.bfloat16 if q_dtype == FP8_DTYPE else None,
                        q_scale=2.0 if q_dtype == FP8_DTYPE else None)


@pytest.mark.parametrize("cc", [None, (8, 0), (10, 0), (12, 0)])
def test_unsupported_outside_sm90(cc):
    reason = unsupported_reason(_args(), cc)
    assert reason is not None
    assert ("sm_90a" in reason) if cc else ("CUDA device" in reason)


def test_variant_key_covers_what_changes_the_binary():
    v = variant_for(_args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, heads=16, q_len=3, block_size=16,
                          kv_scale=torch.tensor(3.0)))
    assert (v.kv_dtype, v.q_dtype, v.out_dtype, v.num_heads, v.q_len, v.block_size) == ("fp8", "fp8", "bf16", 16, 3, 16)
    assert v.kv_scale_is_ptr and not v.q_scale_is_ptr and v.compute_dtype == "bf16"
    assert variant_for(_args()) != v and "h16 q3 bs16" in v.name


def test_shared_memory_fits_one_cta_per_sm():
    assert config.shared_bytes() <= 232_448  # sm_90 opt-in maximum per block
    assert config.m_blocks(128, 4) == 8 and config.m_blocks(16, 3) == 1


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_compiles_for_sm90a_without_gpu():
    from mla_backend_plugin.kernels.cute_sm90.build import compile_variants

    variant = config.Variant("bf16", "bf16", "bf16", 128, 2, 16, False, False)
    (result,) = compile_variants("sm_90a", [variant], jobs=1)
    assert result.ok, result.error
    assert result.spill_bytes == 0 and result.registers and result.shared_bytes == config.shared_bytes()


def test_rejects_other_archs_at_build_time():
    from mla_backend_plugin.kernels.cute_sm90.build import compile_variants

    with pytest.raises(ValueError, match="sm_90a"):
        compile_variants("sm_100a", [])


# ---- on-disk cache of exported variants (aot.py) ----


def test_cache_is_opt_in_and_keyed_by_what_changes_the_binary(monkeypatch, tmp_path):
    from mla_backend_plugin.kernels.cute_sm90 import aot

    monkeypatch.delenv(aot.CACHE_ENV_VAR, raising=False)
    assert aot.cache_root() is None and aot.library_path(config.Variant("bf16", "bf16", "bf16", 128, 1, 64,
                                                                        False, False), True, "sm_90a") is None
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "1")
    assert aot.cache_root().endswith("cute_sm90")
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path))
    v = config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False)
    keys = {aot.cache_key(v, True, "sm_90a"), aot.cache_key(v, False, "sm_90a"),
            aot.cache_key(config.Variant("bf16", "bf16", "bf16", 128, 2, 64, False, False), True, "sm_90a")}
    assert len(keys) == 3 and aot.cache_key(v, True, "sm_90a") == aot.cache_key(v, True, "sm_90a")
    assert aot.library_path(v, True, "sm_90a").startswith(str(tmp_path))


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_exported_variant_loads_without_compiling(monkeypatch, tmp_path):
    """compile -> export to the cache -> a later lookup loads the library and never calls the compiler."""
    from mla_backend_plugin.kernels.cute_sm90 import aot, launch

    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path))
    v = config.Variant("fp8", "bf16", "bf16", 16, 3, 16, False, True)
    compiled = launch.compile_variant(v, True, arch="sm_90a")
    path = aot.export(compiled, v, True, "sm_90a")
    assert path.startswith(str(tmp_path)) and path.endswith(".so")

    def no_compile(*a, **k):
        raise AssertionError("compiled although the cache holds the variant")

    monkeypatch.setattr(launch, "compile_variant", no_compile)
    launch._compiled.cache_clear()
    try:
        fn = launch._compiled(v, True)
    finally:
        launch._compiled.cache_clear()
    import tvm_ffi

    assert isinstance(fn, tvm_ffi.Function)
