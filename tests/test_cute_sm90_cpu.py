"""CPU tests of the CuTe-DSL SM90 kernel's host side: support checks, variant keys, launch configs, the
shared-memory budget, one real sm_90a compile (no GPU needed) whose SASS must hold wgmma and TMA and no
spills, and the on-disk cache of prebuilt (exported) variants (kernels/cute_common/aot.py): relocatable,
loadable where the DSL is absent, invalidated by what changes the binary (an edit to the family's folder or to
cute_common included) or breaks loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from mla_backend_plugin.kernels.cute_common import aot, host
from mla_backend_plugin.kernels.cute_common.host import COOPERATIVE, LAST_CTA
from mla_backend_plugin.kernels.cute_sm90 import config, launch
from mla_backend_plugin.kernels.cute_sm90.launch import AOT, unsupported_reason
from mla_backend_plugin.ops import LaunchConfig, constants, prepare_args
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.manifest import PlanTile

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))


def _args(kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16, heads=128, q_len=2, block_size=32, kv_scale=None, batch=2):
    q = torch.zeros(batch * q_len, heads, 576, dtype=q_dtype)
    kv = torch.zeros(4, block_size, 576, dtype=kv_dtype)
    return prepare_args(q, kv, torch.zeros(batch, 2, dtype=torch.int32), torch.ones(batch, dtype=torch.int32),
                        softmax_scale=0.1, kv_scale=kv_scale,
                        out_dtype=torch.bfloat16 if q_dtype == FP8_DTYPE else None,
                        q_scale=2.0 if q_dtype == FP8_DTYPE else None)


@pytest.mark.parametrize("cc", [None, (8, 0), (10, 0), (12, 0)])
def test_unsupported_outside_sm90(cc):
    reason = unsupported_reason(_args(), cc)
    assert reason is not None
    assert ("sm_90a" in reason) if cc else ("CUDA device" in reason)


def variant_for(args, **config):
    return launch.variant_for(args, launch.default_config(args, (9, 0)) if not config else LaunchConfig(**config))


def test_variant_key_covers_what_changes_the_binary():
    v = variant_for(_args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, heads=16, q_len=3, block_size=16,
                          kv_scale=torch.tensor(3.0), batch=4))
    assert (v.kv_dtype, v.q_dtype, v.out_dtype, v.num_heads, v.q_len, v.block_size) == ("fp8", "fp8", "bf16", 16, 3, 16)
    assert v.kv_scale_is_ptr and not v.q_scale_is_ptr and v.compute_dtype == "bf16" and v.fp8_mma
    assert variant_for(_args()) != v and "h16 q3 bs16" in v.name
    fp8 = _args(kv_dtype=FP8_DTYPE, kv_scale=2.0)
    assert not variant_for(fp8, fp8_design="dequant").fp8_mma and variant_for(fp8, fp8_design="fp8mma").fp8_mma


def test_fp8_design_by_batch_unless_named(monkeypatch):
    """CUTE_MLA_FP8_DESIGN=auto (the default): with a 16-bit q design A (dequant) up to batch
    FP8_DEQUANT_MAX_BATCH, design B above; with an fp8 q design B below FP8_SEESAW_MIN_BATCH, design C from it; a
    named design always wins (design C only for an fp8 q)."""
    monkeypatch.delenv("CUTE_MLA_FP8_DESIGN", raising=False)
    small, large = (_args(kv_dtype=FP8_DTYPE, kv_scale=2.0, batch=b) for b in (launch.FP8_DEQUANT_MAX_BATCH,
                                                                               launch.FP8_DEQUANT_MAX_BATCH + 1))
    assert not variant_for(small).fp8_mma and variant_for(large).fp8_mma
    assert launch.default_config(small, (9, 0)).fp8_design == "dequant"
    # an fp8 q has no hi + lo split to pay for: never design A; design C from batch 6
    for batch, design in ((1, "fp8mma"), (5, "fp8mma"), (6, "fp8seesaw"), (64, "fp8seesaw")):
        fp8_q = _args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=2.0, batch=batch)
        assert variant_for(fp8_q).fp8_mma and variant_for(fp8_q).fp8_seesaw == (design == "fp8seesaw")
        assert launch.default_config(fp8_q, (9, 0)).fp8_design == design
        # design B with an fp8 q splits down to one 64-key tile; the others keep the workspace's chunk
        assert launch.default_config(fp8_q, (9, 0)).min_chunk == (64 if design == "fp8mma" else None)
    small_fp8_q = _args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=2.0, batch=1)
    # the tuner times every design the q allows
    assert {c.fp8_design for c in launch.configs(fp8_q, (9, 0))} == {"fp8seesaw", "fp8mma", "dequant"}
    assert {c.fp8_design for c in launch.configs(large, (9, 0))} == {"fp8mma", "dequant"}
    assert {(c.fp8_design, c.min_chunk) for c in launch.configs(fp8_q, (9, 0))} == {
        ("fp8seesaw", None), ("fp8mma", 64), ("dequant", None)}
    assert launch.default_config(large, (9, 0)).min_chunk is None  # a 16-bit q's design B
    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "fp8mma")
    assert variant_for(small).fp8_mma
    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "dequant")
    assert not variant_for(large).fp8_mma and not variant_for(small_fp8_q).fp8_mma
    assert launch.default_config(_args(), (9, 0)).fp8_design is None  # 16-bit cache


def test_schedule_is_a_config_field_the_environment_defaults(monkeypatch):
    """16-bit caches run the config's schedule (a separate binary each: its own cache key); the default config
    takes CUTE_MLA_SM90_SCHEDULE (seesaw unless set), and so does a config that names none; a named schedule wins
    over the environment; fp8 caches have one schedule per design; a bad value is refused by name."""
    fp8 = _args(kv_dtype=FP8_DTYPE, kv_scale=2.0)
    monkeypatch.delenv("CUTE_MLA_SM90_SCHEDULE", raising=False)
    seesaw = variant_for(_args())
    assert seesaw.schedule == "seesaw" and "lockstep" not in seesaw.name
    assert launch.default_config(_args(), (9, 0)).schedule == "seesaw"
    assert launch.default_config(fp8, (9, 0)).schedule is None
    monkeypatch.setenv("CUTE_MLA_SM90_SCHEDULE", "lockstep")
    lockstep = variant_for(_args())
    assert lockstep.schedule == "lockstep" and lockstep.name.endswith(" lockstep") and lockstep != seesaw
    assert launch.default_config(_args(), (9, 0)).schedule == "lockstep"
    assert variant_for(_args(), split_plan="auto").schedule == "lockstep"  # no schedule named: the environment's
    assert variant_for(_args(), schedule="seesaw") == seesaw  # a named one wins
    assert variant_for(fp8).schedule == "lockstep" and "lockstep" not in variant_for(fp8).name
    monkeypatch.delenv("CUTE_MLA_SM90_SCHEDULE")
    assert variant_for(_args(), schedule="lockstep") == lockstep
    assert variant_for(fp8).schedule == "lockstep" and variant_for(fp8, schedule="seesaw").schedule == "lockstep"
    monkeypatch.setenv("CUTE_MLA_SM90_SCHEDULE", "pingpong")
    with pytest.raises(ValueError, match="CUTE_MLA_SM90_SCHEDULE='pingpong': allowed values are seesaw, lockstep"):
        variant_for(_args())
    with pytest.raises(ValueError, match="schedule 'pingpong'; allowed: seesaw, lockstep"):
        config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False, schedule="pingpong")
    with pytest.raises(ValueError, match="LaunchConfig: schedule 'pingpong'; allowed: seesaw, lockstep$"):
        LaunchConfig(schedule="pingpong")
    with pytest.raises(ValueError, match="LaunchConfig: schedule 'seesaw32'; allowed: seesaw, lockstep$"):
        LaunchConfig(schedule="seesaw32")  # removed 2026-11-29: slower than the seesaw in every cell


def test_l2_prefetch_is_a_seesaw_config_field(monkeypatch):
    """LaunchConfig.l2_prefetch reaches the 16-bit seesaw's variant (its own binary and name), the family's
    default where the config names none; the other schedules and fp8 caches have no prefetch (0); bad values are
    refused by name."""
    monkeypatch.delenv("CUTE_MLA_SM90_SCHEDULE", raising=False)
    fp8 = _args(kv_dtype=FP8_DTYPE, kv_scale=2.0)
    default = variant_for(_args())
    assert default.l2_prefetch == config.SEESAW_L2_PREFETCH
    for n in (0, 1, 2):
        v = variant_for(_args(), l2_prefetch=n)
        assert v.l2_prefetch == n and (f" l2pf{n}" in v.name) == (n > 0)
    assert variant_for(_args(), l2_prefetch=1) != variant_for(_args(), l2_prefetch=2)
    assert variant_for(_args(), schedule="lockstep", l2_prefetch=2).l2_prefetch == 0
    assert variant_for(fp8, l2_prefetch=2).l2_prefetch == 0
    with pytest.raises(ValueError, match="l2_prefetch must be in 0..2, got 3"):
        LaunchConfig(l2_prefetch=3)
    with pytest.raises(ValueError, match="l2_prefetch=1 is the 16-bit seesaw kernel's"):
        config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False, schedule="lockstep", l2_prefetch=1)
    assert "l2-prefetch 1" in LaunchConfig(l2_prefetch=1).label()
    assert LaunchConfig.from_dict(LaunchConfig(l2_prefetch=2).as_dict()).l2_prefetch == 2


def test_kv_multicast_is_a_per_call_choice_of_the_seesaw(monkeypatch):
    """LaunchConfig.kv_multicast reaches a call's variant (its own binary and name) only where the kernel can pair
    m-blocks (the 16-bit seesaw, an even m-block count) and the split grid's CTAs do not merge together (a grid of
    clusters is not promised to be resident at once); the family's default where the config names none; a
    serving twin for every seesaw variant that can; bad values refused by name."""
    from mla_backend_plugin.kernels.cute_sm90.build import serving_variants

    monkeypatch.delenv("CUTE_MLA_SM90_SCHEDULE", raising=False)
    args = _args(q_len=1, batch=32, block_size=64)
    for fused in (False, True):
        for mc in (None, False, True):
            cfg = LaunchConfig(kv_multicast=mc)
            want = not fused and (config.SEESAW_KV_MULTICAST if mc is None else mc)
            assert launch.kv_multicast_for(args, cfg, fused) == want
    # the default's measured range: 64-token pages from batch 32; a config that asks gets it anywhere it fits
    for batch, block_size in ((31, 64), (32, 16), (32, 128)):
        other = _args(q_len=1, batch=batch, block_size=block_size)
        assert not launch.kv_multicast_for(other, LaunchConfig(), False)
        assert launch.kv_multicast_for(other, LaunchConfig(kv_multicast=True), False)
    cfg = LaunchConfig(kv_multicast=True)
    v = launch.variant_for(args, cfg, launch.kv_multicast_for(args, cfg, False))
    assert v.kv_multicast and v.name.endswith(" mc2") and v != launch.variant_for(args, cfg)
    # m-blocks that pair: 128 heads at any q_len, 64 at q_len 2 and 4, 32 at q_len 3-4; not 64 or fewer at q_len 1,
    # the lock step or an fp8 cache
    for heads, q_len, fits in ((128, 1, True), (128, 3, True), (64, 2, True), (32, 4, True), (64, 1, False),
                               (16, 4, False), (32, 3, True), (64, 3, False)):
        assert launch.kv_multicast_for(_args(heads=heads, q_len=q_len), cfg, False) == fits, (heads, q_len)
    assert not launch.kv_multicast_for(args, LaunchConfig(kv_multicast=True, schedule="lockstep"), False)
    # CUTE_MLA_SM90_KV_MULTICAST sets the default config's field (16-bit caches only)
    for raw, field in (("auto", None), ("1", True), ("0", False)):
        monkeypatch.setenv("CUTE_MLA_SM90_KV_MULTICAST", raw)
        assert launch.default_config(args, (9, 0)).kv_multicast is field
        assert launch.default_config(_args(kv_dtype=FP8_DTYPE, kv_scale=2.0), (9, 0)).kv_multicast is None
    monkeypatch.setenv("CUTE_MLA_SM90_KV_MULTICAST", "always")
    with pytest.raises(ValueError, match="CUTE_MLA_SM90_KV_MULTICAST='always': allowed values are auto, 1, 0"):
        launch.default_config(args, (9, 0))
    monkeypatch.delenv("CUTE_MLA_SM90_KV_MULTICAST")
    # no DSL to compile with: the multicast twin only where it is prebuilt, else the plain kernel
    for reason, want in (("not prebuilt", False), (None, True)):
        with monkeypatch.context() as m:
            m.setattr(launch, "dsl_missing", lambda: "Python package 'cutlass' is not installed")
            m.setattr(type(launch.AOT), "prebuilt_reason", lambda self, *a, r=reason: r)
            assert launch.kv_multicast_for(args, cfg, False) == want
    assert not launch.kv_multicast_for(_args(kv_dtype=FP8_DTYPE, kv_scale=2.0, q_len=1), cfg, False)
    with pytest.raises(ValueError, match="kv_multicast is the 16-bit seesaw kernel's with an m-block count divisible"):
        config.Variant("bf16", "bf16", "bf16", 64, 1, 64, False, False, kv_multicast=True)
    with pytest.raises(ValueError, match="kv_multicast is the 16-bit seesaw kernel's"):
        config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False, schedule="lockstep", kv_multicast=True)
    with pytest.raises(ValueError, match="LaunchConfig: kv_multicast must be True, False or None, got 1"):
        LaunchConfig(kv_multicast=1)
    assert "kv-multicast" in LaunchConfig(kv_multicast=True).label()
    assert "no-kv-multicast" in LaunchConfig(kv_multicast=False).label()
    assert LaunchConfig.from_dict(LaunchConfig(kv_multicast=False).as_dict()).kv_multicast is False
    served = serving_variants()
    twins = {v for v in served if v.kv_multicast}
    assert twins == {dataclasses.replace(v, kv_multicast=True) for v in served if config.multicast_fits(v)
                     and not v.kv_multicast and v.block_size in config.SEESAW_KV_MULTICAST_BLOCK_SIZES}
    assert {(128, 1), (128, 2), (64, 2), (32, 4)} <= {(v.num_heads, v.q_len) for v in twins}
    assert all(v.l2_prefetch == config.SEESAW_L2_PREFETCH for v in twins)


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
@pytest.mark.parametrize("block_size", [16, 64])
def test_kv_multicast_compiles_to_multicast_tma_without_spills(tmp_path, block_size):
    """The multicast variant's producer issues UTMALDG.*.MULTICAST (half of a tile's boxes per CTA: 9 chunks per
    page slice split 5 / 4), its consumers' wgmmas stay unserialised, no spills; the SASS check refuses a
    kv_multicast variant without a multicast load."""
    from mla_backend_plugin.kernels.cute_sm90.build import inspect_cubin, sass_problems

    v = config.Variant("bf16", "bf16", "bf16", 128, 1, block_size, False, False, l2_prefetch=1, kv_multicast=True)
    compiled = launch.compile_variant(v, use_pdl=True, arch="sm_90a", keep_dir=str(tmp_path))
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.__cubin__)
    info = inspect_cubin(str(path))
    assert info["utmaldg_multicast"] > 0 and info["utmaldg_multicast"] == info["utmaldg"], info
    assert not sass_problems(v, info), (info, sass_problems(v, info))
    assert "no UTMALDG.*.MULTICAST" in sass_problems(v, dict(info, utmaldg_multicast=0))[0]


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
@pytest.mark.parametrize("block_size", [16, 64])
def test_l2_prefetch_compiles_to_bulk_prefetches_without_spills(tmp_path, block_size):
    """The seesaw producer's L2 prefetch is UBLKPF (one per page slice of each tile of a pair, in the 24-register
    producer; 16-token pages: 4 slices per tile); the SASS check refuses an l2_prefetch variant without it."""
    from mla_backend_plugin.kernels.cute_sm90.build import inspect_cubin, sass_problems

    v = config.Variant("bf16", "bf16", "bf16", 128, 1, block_size, False, False, l2_prefetch=1)
    compiled = launch.compile_variant(v, use_pdl=True, arch="sm_90a", keep_dir=str(tmp_path))
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.__cubin__)
    info = inspect_cubin(str(path))
    assert info["ublkpf"] > 0 and not sass_problems(v, info), (info, sass_problems(v, info))
    assert "no UBLKPF" in sass_problems(v, dict(info, ublkpf=0))[0]


def test_launch_configs(monkeypatch):
    """The default follows the environment; the candidates a tuner sees cover the fp8 designs (fp8 caches), the
    seesaw alone (16-bit caches: the lock step wins no cell) and PDL, all with the default's split plan and
    combine."""
    fp8 = _args(kv_dtype=FP8_DTYPE, kv_scale=2.0, batch=8)
    for name in ("CUTE_MLA_FP8_DESIGN", "CUTE_MLA_PDL", "CUTE_MLA_SM90_PLAN", "CUTE_MLA_SM90_SCHEDULE",
                 "CUTE_MLA_FUSED_COMBINE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.default_config(fp8, (9, 0)) == LaunchConfig("auto", fp8_design="fp8mma", enable_pdl=True)
    assert launch.default_config(_args(), (9, 0)) == LaunchConfig("auto", enable_pdl=True, schedule="seesaw")
    bf16 = launch.configs(_args(), (9, 0))
    assert bf16[0] == launch.default_config(_args(), (9, 0)) and len(set(bf16)) == len(bf16) == 2
    assert {c.schedule for c in bf16} == {"seesaw"} and {c.enable_pdl for c in bf16} == {True}
    assert all(c.fused_combine and c.fp8_design is None and c.split_plan == "auto" for c in bf16)
    assert {launch.MANIFEST.label(c) for c in bf16} == {"cute_sm90:auto seesaw pdl",
                                                        "cute_sm90:auto splits<=64 seesaw pdl"}
    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "dequant")
    monkeypatch.setenv("CUTE_MLA_PDL", "0")
    monkeypatch.setenv("CUTE_MLA_SM90_PLAN", "balanced")
    monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", "0")
    assert launch.default_config(fp8, (9, 0)) == LaunchConfig(fp8_design="dequant", enable_pdl=False,
                                                              fused_combine=False)
    candidates = launch.configs(fp8, (9, 0))
    assert candidates[0] == launch.default_config(fp8, (9, 0)) and len(set(candidates)) == len(candidates) == 4
    assert {c.fp8_design for c in candidates} == {"fp8mma", "dequant"} and {c.enable_pdl for c in candidates} == {
        False} and all(c.balanced and c.schedule is None and not c.fused_combine for c in candidates)
    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "fast")
    with pytest.raises(ValueError,
                       match="CUTE_MLA_FP8_DESIGN='fast': allowed values are auto, fp8mma, dequant, fp8seesaw"):
        launch.default_config(fp8, (9, 0))


def test_register_budgets_fit_the_launch_registers():
    """Producer + 2 consumer setmaxnreg budgets of every design <= the registers a CTA holds at launch / 128."""
    assert config.SETMAXNREG_SUM == 504
    assert config.REGS_PRODUCER_TMA + 2 * config.REGS_CONSUMER <= config.SETMAXNREG_SUM
    assert config.REGS_PRODUCER_FP8 + 2 * config.REGS_CONSUMER_FP8 <= config.SETMAXNREG_SUM
    assert config.REGS_PRODUCER_C + 2 * config.REGS_CONSUMER_C <= config.SETMAXNREG_SUM
    if HAS_DSL:
        from mla_backend_plugin.kernels.cute_sm90 import kernel_fp8mma

        assert kernel_fp8mma.REGS_PRODUCER_B + 2 * kernel_fp8mma.REGS_CONSUMER_B <= config.SETMAXNREG_SUM


# fp8 design C (kernel_fp8seesaw.py): not a serving variant (fp8_design="fp8seesaw" only)
DESIGN_C = config.Variant("fp8", "fp8", "bf16", 128, 1, 64, True, True, fp8_mma=True, fp8_seesaw=True)


def test_shared_memory_fits_one_cta_per_sm():
    from mla_backend_plugin.kernels.cute_sm90.build import serving_variants

    for v in serving_variants() + [None, DESIGN_C]:
        assert config.shared_bytes(v) <= 232_448, v  # sm_90 opt-in maximum per block
    assert config.m_blocks(128, 4) == 8 and config.m_blocks(16, 3) == 1


def test_epilogue_staging_tile_fits_every_design():
    from mla_backend_plugin.kernels.cute_sm90.build import serving_variants

    for v in serving_variants() + [None, DESIGN_C]:
        assert config.epilogue_stage_room(v) >= config.STAGE_BYTES, v
    assert config.STAGE_ROW * 2 % 16 == 0  # 16-byte aligned rows for the bf16/fp16 stage too


def test_refuses_an_output_without_16_byte_aligned_rows():
    args = _args()
    wide = torch.zeros(args.out.shape[0], args.out.shape[1], 516, dtype=args.out.dtype)
    misaligned = dataclasses.replace(args, out=wide[:, :, 2:514])
    assert host.aligned_rows_reason(args, outputs=True) is None
    reason = unsupported_reason(misaligned, (9, 0))
    assert reason is not None and reason.startswith("out needs 16-byte aligned rows")


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_one_per_class_instantiates_every_kernel_class(monkeypatch):
    """build.kernel_class names the kernel launch.compile_variant instantiates: the one-per-class sample (CI's pass
    against the newer CuTe-DSL) instantiates every kernel class that the whole build list does."""
    import cutlass.cute as cute

    from mla_backend_plugin.kernels.cute_sm90 import build
    from mla_backend_plugin.ops.manifest import first_of_each_class

    monkeypatch.setattr(cute, "compile", lambda op, *args, **kwargs: type(op).__name__)
    kernel = {v: launch.compile_variant(v, arch="sm_90a") for v in build.builds()}
    sample = first_of_each_class(build.builds(), build.kernel_class)
    assert {kernel[v] for v in sample} == set(kernel.values()) and len(set(kernel.values())) == 5
    for v in build.builds():  # one kernel class per key
        assert kernel[v] == kernel[next(s for s in sample if build.kernel_class(s) == build.kernel_class(v))]


def test_rejects_other_archs_at_build_time():
    from mla_backend_plugin.kernels.cute_sm90.build import compile_variants

    with pytest.raises(ValueError, match="sm_90a"):
        compile_variants("sm_100a", [])


# ---- one real sm_90a compile, exported into a cache directory as `compile --export-dir` does ----

# what _args(block_size=16) calls (the default config's L2 prefetch included)
CACHED = config.Variant("bf16", "bf16", "bf16", 128, 2, 16, False, False, l2_prefetch=config.SEESAW_L2_PREFETCH)
dsl_only = pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(build result, cache root) of CACHED compiled for sm_90a and exported by `python -m
    mla_backend_plugin.compile --arch sm_90a --kernels cute_sm90 --export-dir DIR`, cut down to that one variant
    (one ~8 s compile per module)."""
    if not HAS_DSL:
        pytest.skip("nvidia-cutlass-dsl / apache-tvm-ffi not installed")
    from mla_backend_plugin import compile as compile_cli
    from mla_backend_plugin.kernels.cute_sm90 import build

    root = tmp_path_factory.mktemp("cute_cache") / "built-here"
    results = []
    real = build.compile_variants
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(aot.CACHE_ENV_VAR, "restored-after-the-build")  # --export-dir sets it for the build
        mp.setattr(build, "serving_variants", lambda: [CACHED])
        mp.setattr(build, "compile_variants",
                   lambda *a, **k: results.extend(real(*a, **k)) or results)
        rc = compile_cli.main(["--arch", "sm_90a", "--kernels", "cute_sm90", "--export-dir", str(root)])
    # the split variant and the step-plan kernel every split variant reads its work items from
    assert rc == 0 and [r.name for r in results] == [CACHED.name, launch.STEP_PLAN.name], results
    assert results[1].ok and results[1].spill_bytes == 0, results[1]
    return results[0], root


@pytest.fixture(autouse=True)
def _fresh_memo():
    for f in (launch._compiled, host.dsl_missing, aot._prebuilt_cached):
        f.cache_clear()
    yield
    for f in (launch._compiled, host.dsl_missing, aot._prebuilt_cached):
        f.cache_clear()


@dsl_only
def test_compiles_for_sm90a_without_gpu(exported):
    result, _ = exported
    assert result.ok, result.error
    assert result.spill_bytes == 0 and result.registers and result.shared_bytes == config.shared_bytes()


@dsl_only
def test_export_writes_a_self_contained_entry(exported):
    _, root = exported
    entry = AOT.entry_dir(CACHED, True, "sm_90a", str(root))
    assert os.path.basename(entry).startswith("cute_sm90-")
    with open(os.path.join(entry, aot.META_NAME)) as f:
        meta = json.load(f)
    assert meta["variant"] == dataclasses.asdict(CACHED) and meta["use_pdl"] and meta["arch"] == "sm_90a"
    assert meta["source_sha256"] == AOT.source_hash() and meta["function"] == "mla_decode_sm90"
    assert meta[aot.DSL_DIST] == aot.installed_version(aot.DSL_DIST)
    assert meta[aot.TVM_FFI_DIST] == aot.installed_version(aot.TVM_FFI_DIST)
    runtime = os.path.normpath(os.path.join(entry, meta["runtime"]))
    assert runtime.startswith(str(root)) and os.path.isfile(runtime)
    dyn = subprocess.run(["readelf", "-d", os.path.join(entry, AOT.library_name)], check=False,
                         capture_output=True, text=True).stdout if shutil.which("readelf") else ""
    if dyn:  # sonames only, found through $ORIGIN: nothing points back into this machine's venv
        assert "$ORIGIN/../lib/cute-dsl-" in dyn and "[libtvm_ffi.so]" in dyn and "[libcute_dsl_runtime.so]" in dyn
        assert "site-packages" not in dyn and str(root) not in dyn


@dsl_only
def test_exported_variant_loads_without_compiling(exported, monkeypatch):
    """A later lookup loads the library and never calls the compiler."""
    import tvm_ffi

    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(exported[1]))

    def no_compile(*a, **k):
        raise AssertionError("compiled although the cache holds the variant")

    monkeypatch.setattr(launch, "compile_variant", no_compile)
    assert isinstance(launch._compiled(CACHED, True), tvm_ffi.Function)


_NO_DSL = textwrap.dedent("""
    import importlib.util, json, sys

    # this host "has no DSL": nvidia-cutlass-dsl's .pth put its packages on sys.path; take them off (a finder
    # that raises from find_spec would also break torch, which probes for cutlass at import)
    sys.path[:] = [p for p in sys.path if "dsl_packages" not in p]
    assert importlib.util.find_spec("cutlass") is None
    import torch
    from mla_backend_plugin.kernels.cute_common import host
    from mla_backend_plugin.kernels.cute_sm90 import config, launch
    from mla_backend_plugin.ops import LaunchConfig, prepare_args

    def args(q_len, block_size):
        q = torch.zeros(2 * q_len, 128, 576, dtype=torch.bfloat16)
        kv = torch.zeros(4, block_size, 576, dtype=torch.bfloat16)
        return prepare_args(q, kv, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                            softmax_scale=0.1)

    v = config.Variant(*json.loads(sys.argv[1]))
    out = dict(missing=host.dsl_missing(), key=launch.AOT.cache_key(v, True, "sm_90a"),
               reason=launch.unsupported_reason(args(2, 16), (9, 0)),
               other=launch.unsupported_reason(args(1, 64), (9, 0)))
    fn = launch._compiled(v, True)
    out["fn"] = type(fn).__module__ + "." + type(fn).__name__
    out["cutlass"] = sorted(m for m in sys.modules if m.split(".")[0] == "cutlass")
    try:
        import cutlass  # noqa: F401
        out["cutlass"].append("import cutlass worked")
    except ImportError:
        pass
    try:
        launch.launch(args(2, 16), None, LaunchConfig())  # on CPU it cannot get far; what matters: it imports
    except Exception as e:
        out["launch_error"] = repr(e)
    out["runtime"] = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcute_dsl_runtime" in line})
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def no_dsl_run(exported, tmp_path_factory):
    """(RESULT dict of _NO_DSL, where the cache was moved to): the exported cache moved elsewhere, then read by
    a process where cutlass is not importable."""
    _, root = exported
    moved = tmp_path_factory.mktemp("elsewhere") / "cache"
    shutil.move(str(root), str(moved))
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUTE_MLA_PDL")}
        env[aot.CACHE_ENV_VAR] = str(moved)
        proc = subprocess.run([sys.executable, "-c", _NO_DSL, json.dumps(dataclasses.astuple(CACHED))],
                              check=False, capture_output=True, text=True, env=env, timeout=300)
    finally:
        shutil.move(str(moved), str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1]), str(moved)


@dsl_only
def test_moved_cache_loads_where_the_dsl_is_absent(no_dsl_run):
    """Build here, move the directory, and load through the package's own loader in a process where cutlass is
    not importable: the key is the same, the variant is supported, and the runtime comes from the moved copy."""
    out, moved = no_dsl_run
    assert out["missing"] and "cutlass" in out["missing"] and out["cutlass"] == []
    assert out["key"] == AOT.cache_key(CACHED, True, "sm_90a")  # the DSL's absence does not change the key
    assert out["reason"] is None, out["reason"]
    assert out["other"] and "not prebuilt" in out["other"] and "--export-dir" in out["other"]
    assert out["fn"] == "tvm_ffi.core.Function"
    assert out["runtime"] and all(p.startswith(moved) for p in out["runtime"]), out["runtime"]


@dsl_only
def test_launch_needs_no_cutlass_import(no_dsl_run):
    """launch() gets past its imports (it then stops at the missing workspace, on CPU) without the DSL."""
    error = no_dsl_run[0]["launch_error"]
    assert "cutlass" not in error and "ModuleNotFoundError" not in error, error


# ---- cache keys and invalidation (no compile: entries are copies of the exported one, metadata edited) ----


def test_cache_location_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(aot.CACHE_ENV_VAR, raising=False)
    assert aot.cache_root() == aot.default_root()
    assert aot.default_root().endswith(os.path.join("mla_backend_plugin", "cute"))
    for off in ("0", "off"):
        monkeypatch.setenv(aot.CACHE_ENV_VAR, off)
        assert aot.cache_root() is None and AOT.library_path(CACHED, True, "sm_90a") is None
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "1")
    assert aot.cache_root() == aot.default_root()
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path))
    assert AOT.library_path(CACHED, True, "sm_90a").startswith(str(tmp_path))


def test_key_covers_the_binary_and_not_the_host(monkeypatch):
    key = AOT.cache_key(CACHED, True, "sm_90a")
    others = {AOT.cache_key(CACHED, False, "sm_90a"), AOT.cache_key(CACHED, True, "sm_90"),
              AOT.cache_key(dataclasses.replace(CACHED, q_len=3), True, "sm_90a"),
              AOT.cache_key(dataclasses.replace(CACHED, kv_scale_is_ptr=True), True, "sm_90a"),
              dataclasses.replace(AOT, function_name="other").cache_key(CACHED, True, "sm_90a")}
    assert key not in others and len(others) == 5 and key == AOT.cache_key(CACHED, True, "sm_90a")
    monkeypatch.setattr(aot, "installed_version", lambda dist: None)
    monkeypatch.setattr(aot, "dsl_importable", lambda: False)
    assert AOT.cache_key(CACHED, True, "sm_90a") == key  # the loading host's packages are not in the key
    monkeypatch.setattr(aot.AotCache, "source_hash", lambda self: "0" * 64)  # a kernel edit is
    assert AOT.cache_key(CACHED, True, "sm_90a") != key


def test_fingerprint_covers_the_family_cute_common_and_the_constants():
    """Every .py under the family's folder and under cute_common is fingerprinted, and ops/constants.py (values
    the kernels compile in: the work-item layout); nothing else is."""
    here = os.path.dirname(launch.__file__)
    assert AOT.source_dirs == (os.path.realpath(here), os.path.realpath(os.path.dirname(aot.__file__)),
                               os.path.realpath(constants.__file__))
    files = {p for d in AOT.source_dirs[:2] for p in os.listdir(d) if p.endswith(".py")}
    assert {"kernel.py", "kernel_fp8mma.py", "launch.py", "scheduler.py", "epilogue.py", "aot.py"} <= files


def test_an_edit_to_a_shared_module_invalidates_the_entry(tmp_path, monkeypatch):
    """A cache entry built from one copy of the sources stops matching once a cute_common module changes."""
    family = tmp_path / "src" / "cute_sm90"
    common = tmp_path / "src" / "cute_common"
    shutil.copytree(AOT.source_dirs[0], family, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(AOT.source_dirs[1], common, ignore=shutil.ignore_patterns("__pycache__"))
    consts = tmp_path / "src" / "constants.py"
    shutil.copy(AOT.source_dirs[2], consts)
    cache = aot.AotCache("cute_sm90", "mla_decode_sm90", (str(family), str(common), str(consts)))
    assert cache.source_hash() == AOT.source_hash()  # same bytes, same fingerprint, wherever they live
    root = tmp_path / "cache"
    entry = cache.entry_dir(CACHED, True, "sm_90a", str(root))
    os.makedirs(entry)
    open(os.path.join(entry, cache.library_name), "wb").close()
    os.makedirs(root / "lib" / "rt")
    open(root / "lib" / "rt" / aot.RUNTIME_NAME, "wb").close()
    meta = {**cache.expected_meta(CACHED, True, "sm_90a"), "runtime": os.path.join("..", "lib", "rt", aot.RUNTIME_NAME),
            aot.DSL_DIST: "4.6.0", aot.TVM_FFI_DIST: "0.1.10"}
    with open(os.path.join(entry, aot.META_NAME), "w") as f:
        json.dump(meta, f)
    monkeypatch.setattr(aot, "dsl_importable", lambda: False)
    monkeypatch.setattr(aot, "installed_version", lambda dist: "0.1.11" if dist == aot.TVM_FFI_DIST else None)
    assert cache.check_entry(CACHED, True, "sm_90a", str(root)) == (os.path.join(entry, cache.library_name), "")
    with open(common / "scheduler.py", "a") as f:
        f.write("\n# an edit\n")
    assert cache.source_hash() != AOT.source_hash()
    path, why = cache.check_entry(CACHED, True, "sm_90a", str(root))
    assert path is None and "not prebuilt" in why
    edited = cache.source_hash()
    with open(consts, "a") as f:  # a constant the kernels compile in
        f.write("\n# an edit\n")
    assert cache.source_hash() != edited
    # an entry whose meta.json names another fingerprint is refused, not loaded, even at a matching path
    monkeypatch.setattr(aot.AotCache, "cache_key", lambda self, v, p, a: os.path.basename(entry))
    path, why = cache.check_entry(CACHED, True, "sm_90a", str(root))
    assert path is None and "source_sha256" in why


def _entry_copy(exported, tmp_path, **meta_changes):
    """A cache root holding a copy of the exported entry (runtime library linked in), meta.json edited."""
    src = exported[1]
    root = tmp_path / "cache"
    entry = AOT.entry_dir(CACHED, True, "sm_90a", str(root))
    shutil.copytree(AOT.entry_dir(CACHED, True, "sm_90a", str(src)), entry)
    os.symlink(src / "lib", root / "lib")
    meta_path = os.path.join(entry, aot.META_NAME)
    with open(meta_path) as f:
        meta = json.load(f)
    meta.update(meta_changes)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return str(root), entry


@dsl_only
def test_with_the_dsl_another_toolchain_version_is_stale(exported, tmp_path, monkeypatch):
    root, _ = _entry_copy(exported, tmp_path, **{aot.DSL_DIST: "4.0.0"})
    path, why = AOT.check_entry(CACHED, True, "sm_90a", root)
    assert path is None and "stale" in why and "4.0.0" in why
    root2, _ = _entry_copy(exported, tmp_path / "b", **{aot.TVM_FFI_DIST: "0.1.0"})
    assert AOT.check_entry(CACHED, True, "sm_90a", root2)[0] is None
    # _compiled rebuilds a stale entry and exports over it
    calls = []
    monkeypatch.setenv(aot.CACHE_ENV_VAR, root)
    monkeypatch.setattr(launch, "compile_variant", lambda v, pdl, arch=None: calls.append("compile") or "jit")
    monkeypatch.setattr(aot.AotCache, "export", lambda self, c, v, pdl, arch: calls.append(("export", c)))
    assert launch._compiled(CACHED, True) == "jit" and calls == ["compile", ("export", "jit")]


@dsl_only
def test_without_the_dsl_a_compatible_tvm_ffi_is_enough(exported, tmp_path, monkeypatch):
    monkeypatch.setattr(aot, "dsl_importable", lambda: False)
    tvm = aot.installed_version(aot.TVM_FFI_DIST)
    series = ".".join(tvm.split(".")[:2])
    root, entry = _entry_copy(exported, tmp_path, **{aot.DSL_DIST: "4.0.0", aot.TVM_FFI_DIST: series + ".0"})
    assert AOT.check_entry(CACHED, True, "sm_90a", root) == (os.path.join(entry, AOT.library_name), "")
    root, _ = _entry_copy(exported, tmp_path / "b", **{aot.TVM_FFI_DIST: "9.9.0"})
    path, why = AOT.check_entry(CACHED, True, "sm_90a", root)
    assert path is None and "apache-tvm-ffi==9.9.0" in why
    real = aot.installed_version
    monkeypatch.setattr(aot, "installed_version", lambda d: None if d == aot.TVM_FFI_DIST else real(d))
    path, why = AOT.check_entry(CACHED, True, "sm_90a", root)
    assert path is None and "apache-tvm-ffi is not installed" in why


@dsl_only
def test_entries_that_do_not_match_or_lack_the_runtime_are_refused(exported, tmp_path):
    root, _ = _entry_copy(exported, tmp_path, variant=dataclasses.asdict(dataclasses.replace(CACHED, q_len=1)))
    path, why = AOT.check_entry(CACHED, True, "sm_90a", root)
    assert path is None and "variant" in why
    root, _ = _entry_copy(exported, tmp_path / "b", runtime="../lib/nowhere/libcute_dsl_runtime.so")
    path, why = AOT.check_entry(CACHED, True, "sm_90a", root)
    assert path is None and "runtime library" in why


def test_without_the_dsl_a_missing_prebuilt_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path))
    missing = lambda: "Python package 'cutlass' is not installed"  # noqa: E731
    monkeypatch.setattr(launch, "dsl_missing", missing)
    monkeypatch.setattr(host, "dsl_missing", missing)
    reason = unsupported_reason(_args(block_size=16), (9, 0))
    assert "not prebuilt" in reason and "--export-dir" in reason and "pip install nvidia-cutlass-dsl" in reason
    with pytest.raises(RuntimeError, match="no prebuilt library"):
        launch._compiled(CACHED, True)
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "0")
    assert "cache is off" in unsupported_reason(_args(block_size=16), (9, 0))
    assert "--kernels cute_sm90" in AOT.prebuild_hint("sm_90a")


def test_fused_combine_only_when_the_grid_fits_at_once(monkeypatch):
    """The split kernel merges its own partials only when all of its CTAs fit on the device at once (a request's
    CTAs wait for each other): small batches; never past the device's SM count, however many SMs the workspace
    was planned for; off for a config with fused_combine=False (the default config's under CUTE_MLA_FUSED_COMBINE=0)
    or when nothing is split."""
    from types import SimpleNamespace

    from mla_backend_plugin.ops.plan import plan_splits

    monkeypatch.setattr(launch, "_device_sms", lambda index: 132)
    monkeypatch.delenv("CUTE_MLA_FUSED_COMBINE", raising=False)

    def fuses(batch, q_len, heads, num_sms=132, wanted=True):
        args = SimpleNamespace(q_len=q_len, num_heads=heads, q_nope=SimpleNamespace(device=torch.device("cuda", 0)))
        return launch.fuses_combine(args, plan_splits(batch, q_len, heads, config.BLOCK_M, num_sms,
                                                            balanced=True), wanted)

    assert fuses(1, 1, 128) and fuses(2, 1, 128) and fuses(1, 2, 128) and fuses(1, 4, 64) and fuses(2, 2, 16)
    assert not fuses(3, 1, 128) and not fuses(2, 2, 128) and not fuses(1, 4, 128) and not fuses(64, 1, 128)
    assert not fuses(8, 1, 128, num_sms=1000)  # planned for more SMs than the device has
    assert not fuses(1, 1, 128, num_sms=1)  # one work item per m-block: nothing to combine
    assert not fuses(1, 1, 128, wanted=False)
    assert launch.default_config(_args(), (9, 0)).fused_combine
    monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", "0")
    assert not launch.default_config(_args(), (9, 0)).fused_combine
    key, nbytes = launch.scratch((9, 0), 1, 1, 128, 132)
    assert key == launch.COMBINE_SCRATCH and nbytes >= 4 * 132 and launch.scratch((10, 0), 1, 1, 128, 148) is None


def test_launch_skips_the_combine_kernel_exactly_when_the_kernel_fuses_it(monkeypatch):
    """The host half of the fused combine: the split kernel is told to merge (mode COOPERATIVE where the grid
    fits at once, LAST_CTA where it does not, with the workspace's counters) exactly when no combine kernel
    follows, and told not to (mode 0) whenever one does: a launch that did both or neither would merge twice or
    leave the output unwritten. LAST_CTA is taken outside CUDA-graph capture under the default policy (``eager``)
    at any split count, also inside under ``always`` where the plan has at most LAST_CTA_MAX_MEAN_SPLITS work items
    per request, never under ``never`` or with ``fused_combine`` off. The compiled kernel and the combine are
    stand-ins."""
    from mla_backend_plugin.kernels.combine import kernel as combine
    from mla_backend_plugin.ops import MLAWorkspace

    seen = []
    monkeypatch.setattr(launch, "_compiled", lambda variant, pdl: (
        (lambda *a: None) if variant == launch.STEP_PLAN else lambda *a: seen.append(("split", a[-3], a[-2]))))
    monkeypatch.setattr(launch, "current_cu_stream", lambda device: None)
    monkeypatch.setattr(launch, "_device_sms", lambda index: 132)
    monkeypatch.setattr(combine, "launch_combine", lambda *a, **k: seen.append(("combine",)))
    monkeypatch.delenv("CUTE_MLA_FUSED_COMBINE", raising=False)
    monkeypatch.delenv("CUTE_MLA_LAST_CTA_COMBINE", raising=False)
    capturing = [False]
    monkeypatch.setattr(launch, "capturing", lambda device: capturing[0])
    ws = MLAWorkspace("cpu", max_batch=32, max_q_len=1, num_heads=128, num_sms=132, rows_per_cta=config.BLOCK_M)
    ws.scratch[launch.COMBINE_SCRATCH] = torch.zeros(4 * launch.COMBINE_COUNTERS, dtype=torch.uint8)
    counters = ws.scratch[launch.COMBINE_SCRATCH]

    def run(batch, config=None, **changes):
        seen.clear()
        config = config or launch.default_config(_args(), (9, 0))
        launch.launch(_args(q_len=1, batch=batch), ws, dataclasses.replace(config, **changes))
        return list(seen)

    def merges_in_kernel(calls, mode):
        (split,) = calls  # one launch, no combine
        assert split[2] == mode and split[1].dtype == torch.int32 and split[1].data_ptr() == counters.data_ptr()

    merges_in_kernel(run(1), COOPERATIVE)
    merges_in_kernel(run(32), LAST_CTA)  # 194 CTAs > 132 SMs: each request's last CTA merges its ~3 splits
    merges_in_kernel(run(8), LAST_CTA)  # 146 CTAs, 73 work items: 9 splits a request, eager: merged in the kernel
    assert launch.launch_setup(_args(q_len=1, batch=8), ws, launch.default_config(_args(), (9, 0)))[2].grid_items \
        > launch.LAST_CTA_MAX_MEAN_SPLITS * 8
    merges_in_kernel(run(8, last_cta_combine="always"), LAST_CTA)
    capturing[0] = True
    split, after = run(32)  # in a graph under "eager": the combine kernel follows
    assert split[2] == 0 and after == ("combine",)
    merges_in_kernel(run(32, last_cta_combine="always"), LAST_CTA)
    split, after = run(8, last_cta_combine="always")  # in a graph, 9 splits a request: the combine kernel
    assert split[2] == 0 and after == ("combine",)
    merges_in_kernel(run(1), COOPERATIVE)
    capturing[0] = False
    split, after = run(32, last_cta_combine="never")
    assert split[2] == 0 and after == ("combine",)
    split, after = run(1, fused_combine=False)
    assert split[2] == 0 and after == ("combine",)
    split, after = run(32, fused_combine=False, last_cta_combine="always")
    assert split[2] == 0 and after == ("combine",)
    monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", "0")
    split, after = run(1)
    assert split[2] == 0 and after == ("combine",)
    monkeypatch.delenv("CUTE_MLA_FUSED_COMBINE")
    monkeypatch.setenv("CUTE_MLA_LAST_CTA_COMBINE", "never")
    split, after = run(32)
    assert split[2] == 0 and after == ("combine",)
    # a counter per (request, m-block) or the combine kernel: 32 requests x 2 m-blocks
    monkeypatch.delenv("CUTE_MLA_LAST_CTA_COMBINE")
    default = launch.default_config(_args(), (9, 0))
    plan = launch.launch_setup(_args(q_len=1, batch=32), ws, default)[2]
    assert launch.last_cta_merges(_args(q_len=1, batch=32), plan, default, 64) == "eager"
    assert launch.last_cta_merges(_args(q_len=1, batch=32), plan, default, 63) is None
    many = launch.launch_setup(_args(q_len=1, batch=8), ws, default)[2]
    always = dataclasses.replace(default, last_cta_combine="always")
    assert launch.last_cta_merges(_args(q_len=1, batch=8), many, always, 64) == "eager"


def test_the_counters_cover_the_workspace_s_largest_step():
    """One counter per (request, m-block) of the largest step the workspace serves, at least COMBINE_COUNTERS:
    a LAST_CTA grid of any batch the workspace holds has its own counter per request."""
    key, nbytes = launch.scratch((9, 0), 512, 4, 128, 132)
    assert key == launch.COMBINE_SCRATCH and nbytes == 4 * 512 * config.m_blocks(128, 4)
    assert launch.scratch((9, 0), 8, 1, 128, 132)[1] == 4 * launch.COMBINE_COUNTERS


def test_a_step_is_planned_once_per_step_seq_lens_and_capture(monkeypatch):
    """The host half of the step plan (ops/workspace.py StepPlans): the step-plan kernel runs before the split
    kernel of a call without a step (every call), of the first call of a step, of a call with another seq_lens
    tensor or plan, after another plan overwrote the workspace's table, and of the first call inside each CUDA-graph
    capture (the engine's eager warm-up of the same metadata does not count); every split launch reads the
    workspace's table. The compiled kernels are stand-ins."""
    monkeypatch.delenv("CUTE_MLA_SM90_PLAN", raising=False)
    from mla_backend_plugin.kernels.combine import kernel as combine
    from mla_backend_plugin.ops import MLAWorkspace
    from mla_backend_plugin.ops import workspace as workspace_mod
    from mla_backend_plugin.ops.workspace import StepPlans

    seen = []

    def compiled(variant, pdl):
        if variant == launch.STEP_PLAN:
            return lambda *a: seen.append(("plan", a[0].data_ptr(), a[2].data_ptr(), a[-3], a[-2]))
        return lambda *a: seen.append(("split", a[-5].data_ptr()))

    monkeypatch.setattr(launch, "_compiled", compiled)
    monkeypatch.setattr(launch, "current_cu_stream", lambda device: None)
    monkeypatch.setattr(launch, "_device_sms", lambda index: 132)
    monkeypatch.setattr(combine, "launch_combine", lambda *a, **k: None)
    capture = [None]
    monkeypatch.setattr(workspace_mod, "_capture_id", lambda device: capture[0])
    ws = MLAWorkspace("cpu", max_batch=8, max_q_len=1, num_heads=128, num_sms=132, rows_per_cta=config.BLOCK_M)
    ws.scratch[launch.COMBINE_SCRATCH] = torch.zeros(4 * launch.COMBINE_COUNTERS, dtype=torch.uint8)
    a8, a2 = _args(q_len=1, batch=8), _args(q_len=1, batch=2)
    cfg = launch.default_config(a8, (9, 0))

    def layer(args, step):
        seen.clear()
        launch.launch(dataclasses.replace(args, step=step), ws, cfg)
        assert seen[-1] == ("split", ws.work_items.data_ptr())  # every split kernel reads the table
        return [s[0] for s in seen]

    assert layer(a8, None) == ["plan", "split"] and layer(a8, None) == ["plan", "split"]
    step = StepPlans()
    assert layer(a8, step) == ["plan", "split"]
    assert seen[0][1:] == (a8.seq_lens.data_ptr(), ws.work_items.data_ptr(),
                           ws.plan(8, 1, balanced=True).grid_items, -ws.plan(8, 1, balanced=True).work_target)
    # (-W: the auto plan, CUTE_MLA_SM90_PLAN's default; launch.STEP_PLAN_MODES)
    assert layer(a8, step) == ["split"] and layer(a8, step) == ["split"]  # the step's later layers
    assert layer(a2, step) == ["plan", "split"]  # another seq_lens tensor (e.g. a slice of token requests)
    assert layer(a8, step) == ["plan", "split"]  # the table held a2's plan
    assert layer(a8, step) == ["split"]
    assert layer(a8, None) == ["plan", "split"]  # a call outside the step
    assert layer(a8, step) == ["plan", "split"]
    capture[0] = 7  # warm-up done eagerly above; the capture must hold its own plan launch
    assert layer(a8, step) == ["plan", "split"] and layer(a8, step) == ["split"]
    capture[0] = 8  # a second capture of the same metadata
    assert layer(a8, step) == ["plan", "split"]
    capture[0] = None
    assert layer(a8, StepPlans()) == ["plan", "split"]  # the next step


@pytest.mark.parametrize("heads,q_len,batch,capacity,want,want_long", [
    (128, 1, 1, 64, 64, None),  # W = 66: the default 32 would leave half of the wave idle
    (128, 1, 2, 64, 33, None),  # W // 2; 2 x 33 < B + W - 1: a long cap would grow the grid
    (128, 1, 3, 64, None, 64),  # 3 x 32 >= W: the default, and the long cap (the grid is B + W - 1 either way)
    (128, 1, 8, 64, None, 64),
    (128, 2, 1, 64, 33, 64),  # 4 m-blocks: W = 33 (B x 33 = B + W - 1: the long cap, never binding for B=1)
    (16, 1, 2, 64, 64, None),  # 1 m-block: W = 132, capped by the capacity
    (128, 1, 1, 32, None, None),  # a workspace made for 32 splits keeps 32
    (128, 1, 8, 32, None, None),
])
def test_a_config_without_a_split_cap_fills_one_wave(heads, q_len, batch, capacity, want, want_long):
    """cute_sm90 raises the default split cap to W // batch within the workspace's split capacity, so a B=1 step
    fills the wave (docs/perf/split_plan.md); the grid stays within W items per m-block, so the fused
    combine still serves it; a config with its own cap keeps it. Where batch x cap >= B + W - 1 it also gets the
    capacity as its long cap (ops/plan.py balanced_schedule), which leaves the grid as it was."""
    from mla_backend_plugin.ops import MLAWorkspace

    ws = MLAWorkspace("cpu", max_batch=8, max_q_len=2, num_heads=heads, num_sms=132, rows_per_cta=config.BLOCK_M,
                      split_capacity=capacity)
    args = _args(heads=heads, q_len=q_len, batch=batch)
    cfg = launch.default_config(args, (9, 0))
    got = launch.wave_filling_config(args, ws, cfg)
    assert got.max_splits == want and got.long_splits == want_long
    assert (got is cfg) == (want is None and want_long is None)
    plan = ws.plan_for(args, PlanTile(config.BLOCK_M, config.BLOCK_N), got)
    assert plan.num_splits == (want or ws.max_splits) and plan.long_splits == (want_long or 0)
    if want is not None:  # a raised cap never takes the grid past one wave (the fused combine's condition)
        assert plan.grid_items <= plan.work_target
    tile = PlanTile(config.BLOCK_M, config.BLOCK_N)
    without_long = ws.plan_for(args, tile, dataclasses.replace(got, long_splits=None))
    assert plan.grid_items == without_long.grid_items
    assert launch.wave_filling_config(args, ws, dataclasses.replace(cfg, max_splits=16)).max_splits == 16


def test_launch_setup_is_kept_per_shape_config_and_workspace(monkeypatch):
    """What ``launch`` works out of a call's shape (the compiled variant, the wave-filling config, the plan, the
    fused flag) is kept in the workspace per key and reused by the same shape; every part of the key that changes
    the variant or the plan (batch, q_len, dtypes, scale forms, block size, config) gets its own entry, and a
    second workspace its own."""
    from mla_backend_plugin.ops import MLAWorkspace

    variants = []
    monkeypatch.setattr(launch, "_compiled", lambda variant, pdl: variants.append(variant) or variant)
    monkeypatch.setattr(launch, "_device_sms", lambda index: 132)
    ws = MLAWorkspace("cpu", max_batch=8, max_q_len=2, num_heads=128, num_sms=132, rows_per_cta=config.BLOCK_M)
    cfg = launch.default_config(_args(), (9, 0))
    first = launch.launch_setup(_args(batch=2), ws, cfg)
    assert launch.launch_setup(_args(batch=2), ws, cfg) is first and len(variants) == 1
    assert first[0] == launch.variant_for(_args(batch=2), cfg)  # 2 requests: below the multicast's smallest batch
    assert first[2] is ws.plan_for(_args(batch=2), launch.PlanTile(config.BLOCK_M, config.BLOCK_N), first[1])
    others = [
        (_args(batch=8), cfg),
        (_args(q_len=1), cfg),
        (_args(block_size=64), cfg),
        (_args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=2.0), launch.default_config(
            _args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=2.0), (9, 0))),
        (_args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=torch.tensor([2.0])), launch.default_config(
            _args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=2.0), (9, 0))),
        (_args(batch=2), dataclasses.replace(cfg, schedule="lockstep")),
        (_args(batch=2), dataclasses.replace(cfg, max_splits=16)),
    ]
    seen = {id(first)}
    for args, c in others:
        prepared = launch.launch_setup(args, ws, c)
        variant = launch.variant_for(args, c, launch.kv_multicast_for(args, c, prepared[3]))
        assert id(prepared) not in seen and prepared[0] == variant, (args.batch, c)
        seen.add(id(prepared))
    other_ws = MLAWorkspace("cpu", max_batch=8, max_q_len=2, num_heads=128, num_sms=132,
                            rows_per_cta=config.BLOCK_M)
    assert launch.launch_setup(_args(batch=2), other_ws, cfg) is not first


def test_max_slack_is_a_variant_of_the_seesaw_kernels(monkeypatch):
    """LaunchConfig.max_slack reaches design C's and the 16-bit seesaw's variants (their own binaries and names),
    with the family's defaults where the config names none (design C FP8_SEESAW_MAX_SLACK, the 16-bit seesaw
    SEESAW_MAX_SLACK) and 0 for every other kernel; design C's P scale keeps 2^slack x scale within e4m3; the
    serving variants carry the defaults; bad values refused by name."""
    from mla_backend_plugin.kernels.cute_sm90.build import serving_variants

    monkeypatch.delenv("CUTE_MLA_SM90_SCHEDULE", raising=False)
    fp8 = _args(kv_dtype=FP8_DTYPE, q_dtype=FP8_DTYPE, kv_scale=1.0, batch=32)
    c = launch.variant_for(fp8, LaunchConfig(fp8_design="fp8seesaw"))
    assert c.max_slack == config.FP8_SEESAW_MAX_SLACK > 0 and c.name.endswith(f" slack{c.max_slack:g}")
    c0 = launch.variant_for(fp8, LaunchConfig(fp8_design="fp8seesaw", max_slack=0))
    assert c0.max_slack == 0 and "slack" not in c0.name and c0 != c
    assert launch.variant_for(fp8, LaunchConfig(fp8_design="fp8mma", max_slack=4)).max_slack == 0
    assert launch.variant_for(fp8, LaunchConfig(fp8_design="dequant", max_slack=4)).max_slack == 0
    bf16 = _args(batch=32)
    assert launch.variant_for(bf16, LaunchConfig()).max_slack == config.SEESAW_MAX_SLACK
    assert launch.variant_for(bf16, LaunchConfig(max_slack=8)).max_slack == 8
    assert launch.variant_for(bf16, LaunchConfig(max_slack=8, schedule="lockstep")).max_slack == 0
    for slack in (0.0, 0.5, 0.8, 1.0, 2.8, 4.75, 8.0):
        scale = config.p_scale_for(slack)
        assert scale * 2 ** slack <= config.E4M3_MAX and (scale == config.P_SCALE_FP8 or 2 * scale * 2 ** slack > 448)
    assert config.p_scale_for(config.FP8_SEESAW_MAX_SLACK) == config.P_SCALE_FP8  # the default keeps P's scale
    seesaw_c = [v for v in serving_variants() if v.fp8_seesaw]
    assert seesaw_c and all(v.max_slack == config.FP8_SEESAW_MAX_SLACK for v in seesaw_c)
    assert all(v.max_slack == 0 for v in serving_variants() if not v.fp8_seesaw and v.kv_dtype == "fp8")
    for bad in (-1, 9, "1"):
        with pytest.raises(ValueError, match="max_slack"):
            LaunchConfig(max_slack=bad)
    with pytest.raises(ValueError, match="max_slack"):
        dataclasses.replace(c0, fp8_seesaw=False, max_slack=1.0)
    with pytest.raises(ValueError, match="max_slack"):
        dataclasses.replace(c, max_slack=9.0)
