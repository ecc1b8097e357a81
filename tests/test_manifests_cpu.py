"""The kernel-family contract (ops/manifest.py): every family under kernels/ declares a well-formed MANIFEST, the
registry and compile.py are built from the manifests, nothing heavy is imported to read them, and the launch
knobs reach mla_decode as keywords."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from mla_backend_plugin.ops import KERNELS, LaunchConfig, PlanTile, mla_decode, prepare_args, registry
from mla_backend_plugin.ops.arch import ARCHS
from mla_backend_plugin.ops.manifest import COMBINES, KernelManifest, VariantResult, first_of_each_class, lazy
from mla_backend_plugin.testing import make_decode_inputs


def _args(kv_dtype=torch.bfloat16, heads=128, q_len=2):
    inp = make_decode_inputs(2, [70, 300], q_len, heads, 64, kv_dtype, "cat", "cpu", 0,
                             kv_scale=2.0 if kv_dtype == torch.float8_e4m3fn else None)
    return prepare_args(*inp.call_args(), softmax_scale=0.1, **inp.scale_kwargs())


def test_every_family_is_found_and_well_formed():
    assert set(KERNELS) == {"cute_sm90", "cute_sm100", "triton", "xqa_sm120", "reference", "flashinfer_cute_dsl",
                            "flashinfer_trtllm", "flashinfer_xqa"}
    for name, m in KERNELS.items():
        assert isinstance(m, KernelManifest) and m.name == name and m.combine in COMBINES
        assert set(m.archs) <= set(ARCHS), (name, m.archs)
        assert (m.compile_variants is None) == (not m.archs), name
        for kv in (torch.bfloat16, torch.float8_e4m3fn):
            args = _args(kv)
            default = m.default_config(args, (9, 0))
            candidates = m.configs(args, (9, 0))
            assert isinstance(default, LaunchConfig) and candidates[0] == default, name
            assert len(set(candidates)) == len(candidates), name
            for c in candidates:
                assert LaunchConfig.from_dict(c.as_dict()) == c  # JSON-friendly for a tuner's cache
        if m.plan_tile is not None:
            for heads in (16, 128):
                tile = m.plan_tile(heads, 232_448, None)
                assert isinstance(tile, PlanTile) and tile.rows_per_cta in (16, 32, 64, 128) and tile.block_n >= 16


def test_the_registry_reads_manifests_without_importing_toolchains():
    code = ("import sys\nfrom mla_backend_plugin.ops import KERNELS\nfrom mla_backend_plugin import compile\n"
            "names = sorted(KERNELS)\nfams = sorted(compile.families())\n"
            "heavy = ('triton', 'cutlass', 'vllm', 'tvm_ffi', 'flashinfer')\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
            "print(names, fams, bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ("['cute_sm100', 'cute_sm90', 'flashinfer_cute_dsl', 'flashinfer_trtllm', "
                           "'flashinfer_xqa', 'reference', 'triton', 'xqa_sm120'] "
                           "['cute_sm100', 'cute_sm90', 'triton', 'xqa_sm120'] []"), out


def test_auto_order_names_only_declared_kernels(monkeypatch):
    monkeypatch.setattr(registry, "AUTO_ORDER", {9: ("nope",)})
    with pytest.raises(RuntimeError, match=r"AUTO_ORDER names kernels no family declares: \['nope'\]"):
        registry._discover()


def test_lazy_imports_on_first_call():
    f = lazy("json", "dumps")
    assert f.__name__ == "json.dumps" and f([1]) == "[1]"


def test_launch_config_validation():
    with pytest.raises(ValueError, match="split_plan 'even'; allowed: balanced, uniform"):
        LaunchConfig(split_plan="even")
    with pytest.raises(ValueError, match="fp8_design 'int4'; allowed: fp8mma, dequant, fp8seesaw"):
        LaunchConfig(fp8_design="int4")
    with pytest.raises(ValueError, match="max_splits must be in 1..64"):
        LaunchConfig(max_splits=65)


def test_mla_decode_launch_keywords():
    """enable_pdl / fp8_design / config reach the kernel; bad values are refused by name."""
    inp = make_decode_inputs(2, [70, 300], 1, 16, 16, torch.float8_e4m3fn, "cat", "cpu", 0, kv_scale=2.0)
    kw = dict(softmax_scale=0.1, kernel="reference", out_dtype=torch.bfloat16, **inp.scale_kwargs())
    seen = []
    real = KERNELS["reference"]
    spec = type(real)(**{**real.__dict__, "launch": lambda a, w, c: (seen.append(c), real.launch(a, w, c))})
    registry_kernels = dict(KERNELS)
    registry_kernels["reference"] = spec
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "KERNELS", registry_kernels)
        mla_decode(*inp.call_args(), fp8_design="dequant", enable_pdl=False, **kw)
        mla_decode(*inp.call_args(), config=LaunchConfig(split_plan="uniform", max_splits=8), **kw)
        with pytest.raises(ValueError, match=r"enable_pdl: PDL needs compute capability >= 9.0"):
            mla_decode(*inp.call_args(), enable_pdl=True, **kw)
        with pytest.raises(ValueError,
                           match=r"fp8_design: 'fast' is not a design; allowed: fp8mma, dequant, fp8seesaw"):
            mla_decode(*inp.call_args(), fp8_design="fast", **kw)
        with pytest.raises(ValueError, match=r"config: must be a LaunchConfig, got dict"):
            mla_decode(*inp.call_args(), config={"split_plan": "uniform"}, **kw)
    assert seen[0].fp8_design == "dequant" and not seen[0].enable_pdl
    assert seen[1] == LaunchConfig(split_plan="uniform", max_splits=8)


def test_first_of_each_class_keeps_the_first_of_each_in_order():
    assert first_of_each_class([3, 4, 5, 8, 10, 7, 6], lambda n: n % 3) == [3, 4, 5]
    assert first_of_each_class([], lambda n: n) == []


@pytest.mark.parametrize("family,arch", [("cute_sm90", "sm_90a"), ("cute_sm100", "sm_100f")])
def test_compile_builds_every_variant_pdl_on_and_one_per_class_adds_pdl_off_once(family, arch, monkeypatch, capsys):
    """`compile` builds (and ships) every variant with PDL on; `compile --one-per-class` (CI's pass against the
    newer CuTe-DSL) the family's first variant of each kernel class with PDL on and the first with PDL off."""
    import concurrent.futures
    import importlib

    from mla_backend_plugin import compile as compile_cli

    build = importlib.import_module(f"mla_backend_plugin.kernels.{family}.build")
    pools = []

    def fake_map(self, fn, variants, archs, pdls):
        pools.append(list(zip(variants, pdls)))
        return [VariantResult(v.name, True, 168, 0, 0, 0.0) for v in variants]

    monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor, "map", fake_map)  # what build_in_pool runs
    assert compile_cli.main(["--arch", arch, "--kernels", family, "--one-per-class"]) == 0
    assert compile_cli.main(["--arch", arch, "--kernels", family]) == 0
    sample, every = pools
    assert every == [(v, True) for v in build.builds()]
    on = [v for v, pdl in sample if pdl]
    assert [(v, pdl) for v, pdl in sample if not pdl] == [(on[0], False)]
    classes = {build.kernel_class(v) for v in build.builds()}
    assert len(on) == len(classes) == len({build.kernel_class(v) for v in on}) < len(every) / 2
    assert all(v in build.builds() for v in on)
    assert "OK: 0 variant(s) failed" in capsys.readouterr().out


def test_compile_one_per_class_builds_one_triton_kernel_per_signature(monkeypatch):
    """Triton's sample: the first variant of each jit kernel and pointer signature (cache and partials dtypes)."""
    from mla_backend_plugin.kernels.triton_decode import build

    built = []

    def fake_build(fn, pointers, constexprs, options, cc):
        built.append((fn, tuple(sorted(pointers.items()))))
        return types.SimpleNamespace(asm={"ptx": ""}, metadata=types.SimpleNamespace(shared=0))

    monkeypatch.setattr(build, "build_triton", fake_build)
    monkeypatch.setattr(build, "ptxas_report", lambda ptx, gpu: (32, 0))
    every = build.compile_variants("sm_90a")
    every_built, built[:] = list(built), []
    sample = build.compile_variants("sm_90a", one_per_class=True)
    assert all(r.ok for r in every + sample)
    assert len(set(built)) == len(built) == len(set(every_built)) < len(every_built)
    assert {fn for fn, _ in built} == {fn for fn, _ in every_built}
    assert [r.name for r in sample] == [r.name for r in every if r.name in {s.name for s in sample}]
