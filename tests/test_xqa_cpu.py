"""CPU tests of the xqa_sm120 kernel family: nvcc builds for every architecture (no GPU needed), the on-disk
cache and its key, clear errors for a missing nvcc or an unsupported architecture, unsupported_reason texts,
and the ctypes mirror of the kernel's parameter struct."""

from __future__ import annotations

import ctypes
import re
import subprocess
import types

import pytest
import torch

from mla_backend_plugin.kernels.xqa_sm120 import build, launch

needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xqa_cache")


@pytest.fixture
def cache_env(cache_dir, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV_VAR, str(cache_dir))
    return cache_dir


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a", "sm_121a"])
def test_compile_every_variant(cache_env, arch):
    results = build.compile_variants(arch)
    assert [r.name.split()[1] for r in results] == list(build.KERNEL_NAMES)
    for r in results:
        assert r.ok, f"{r.name}: {r.error}"
        assert r.registers and r.registers <= 255
        assert r.spill_bytes == 0, f"{r.name} spills {r.spill_bytes} bytes on {arch}"
        if "split" in r.name:
            assert r.shared_bytes <= 99 * 1024, "SM120 allows at most 99 KB of shared memory per block"
    cubin = build.build(arch).cubin
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    for name in build.KERNEL_NAMES:
        assert name.encode() in data
    assert arch.encode() in cubin.name.encode()


@needs_nvcc
def test_compile_command_exit_code(cache_env, capsys):
    from mla_backend_plugin import compile as compile_mod

    assert compile_mod.main(["--arch", "sm_120a", "--kernels", "xqa_sm120"]) == 0
    out = capsys.readouterr().out
    assert "xqa_mla_split_bf16_kv8" in out and "OK: 0 variant(s) failed" in out


@needs_nvcc
def test_cache_hit_and_key(cache_env, monkeypatch):
    first = build.build("sm_90a")
    real_run = subprocess.run
    calls = []

    def no_compile(cmd, *a, **kw):
        calls.append(cmd)
        if "--version" in cmd:
            return real_run(cmd, *a, **kw)
        raise AssertionError(f"unexpected compile on a cache hit: {cmd}")

    monkeypatch.setattr(build.subprocess, "run", no_compile)
    again = build.build("sm_90a")
    assert again.cached and again.cubin == first.cubin and again.log == first.log
    monkeypatch.setattr(build.subprocess, "run", real_run)
    nvcc = build.require_nvcc()
    key = build.cache_key("sm_90a", nvcc)
    assert first.cubin.parent.name == key
    assert build.cache_key("sm_120a", nvcc) != key
    assert build.cache_key("sm_90a", nvcc, build.NVCC_FLAGS + ("-DX=1",)) != key
    monkeypatch.setattr(build, "nvcc_version", lambda n: "Cuda compilation tools, release 99.9")
    assert build.cache_key("sm_90a", nvcc) != key


@needs_nvcc
def test_cache_key_follows_source(cache_env, monkeypatch, tmp_path):
    src = build.source_dir()
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    nvcc = build.require_nvcc()
    key = build.cache_key("sm_90a", nvcc)
    monkeypatch.setenv(build.SOURCE_ENV_VAR, str(tmp_path))
    assert build.cache_key("sm_90a", nvcc) == key
    (tmp_path / "xqa_mla.cu").write_text((tmp_path / "xqa_mla.cu").read_text() + "\n// edited\n")
    assert build.cache_key("sm_90a", nvcc) != key


@needs_nvcc
def test_nvcc_error_is_reported(cache_env, monkeypatch, tmp_path):
    (tmp_path / "xqa_mla.cu").write_text("this is not C++\n")
    (tmp_path / "xqa_mla_params.h").write_text(build.source_dir().joinpath("xqa_mla_params.h").read_text())
    monkeypatch.setenv(build.SOURCE_ENV_VAR, str(tmp_path))
    with pytest.raises(build.XqaBuildError, match=r"nvcc failed for sm_90a"):
        build.build("sm_90a")
    results = build.compile_variants("sm_90a")
    assert results and not any(r.ok for r in results) and "nvcc failed" in results[0].error


def _hide_nvcc(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for var in ("CUDA_HOME", "CUDA_PATH", build.NVCC_ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build, "DEFAULT_NVCC_PATHS", ())


def test_missing_nvcc(cache_env, monkeypatch):
    _hide_nvcc(monkeypatch)
    assert build.find_nvcc() is None
    with pytest.raises(build.XqaBuildError, match=r"nvcc not found"):
        build.build("sm_120a")
    results = build.compile_variants("sm_120a")
    assert not any(r.ok for r in results) and "nvcc not found" in results[0].error
    assert launch.unsupported_reason(_args(), (12, 0)).startswith("nvcc not found")


def test_nvcc_env_override(monkeypatch, tmp_path):
    _hide_nvcc(monkeypatch)
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(build.NVCC_ENV_VAR, str(fake))
    assert build.find_nvcc() == str(fake)
    monkeypatch.setenv(build.NVCC_ENV_VAR, str(tmp_path / "missing"))
    assert build.find_nvcc() is None


def test_unsupported_arch():
    with pytest.raises(ValueError, match=r"'sm_100a' is not supported; allowed: sm_90a, sm_120a, sm_121a"):
        build.build("sm_100a")


def _args(kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16):
    """A DecodeArgs-like object (CPU tensors) for unsupported_reason."""
    kv = torch.zeros(4, 64, 576, dtype=kv_dtype)
    return types.SimpleNamespace(
        q_nope=torch.zeros(2, 16, 512, dtype=q_dtype), kv_cache=kv, compute_dtype=torch.bfloat16,
        out=torch.zeros(2, 16, 512, dtype=torch.bfloat16), kv_dtype=kv_dtype, q_dtype=q_dtype)


@pytest.mark.parametrize("cc,expect", [
    (None, r"needs a CUDA device"),
    ((8, 0), r"needs compute capability 9.0 or 12.x \(sm_90a/sm_120a/sm_121a builds\), device has 8.0"),
    ((10, 0), r"device has 10.0"),
    ((8, 9), r"device has 8.9"),
])
def test_unsupported_reason_arch(cc, expect):
    assert re.search(expect, launch.unsupported_reason(_args(), cc))


@needs_nvcc
@pytest.mark.parametrize("cc", [(9, 0), (12, 0), (12, 1)])
def test_unsupported_reason_supported_archs(cc):
    assert launch.unsupported_reason(_args(), cc) is None
    assert launch.unsupported_reason(_args(torch.float8_e4m3fn, torch.float8_e4m3fn), cc) is None
    assert launch.arch_for(cc) in build.ARCHS


@needs_nvcc
def test_unsupported_reason_misaligned_cache():
    args = _args()
    args.kv_cache = torch.zeros(4 * 64 * 576 + 1, dtype=torch.bfloat16)[1:].view(4, 64, 576)
    assert "16-byte aligned" in launch.unsupported_reason(args, (9, 0))


def test_params_struct_matches_header():
    """launch.XqaMlaParams mirrors struct XqaMlaParams field by field (names, order, widths)."""
    text = build.source_dir().joinpath("xqa_mla_params.h").read_text()
    body = text[text.index("struct XqaMlaParams {"):text.index("};")]
    ctype = {"const void*": 8, "void*": 8, "const int*": 8, "float*": 8, "const float*": 8, "int64_t": 8,
             "float": 4, "int": 4}
    fields = []
    for line in body.splitlines()[1:]:
        line = line.split("//")[0].strip().rstrip(";")
        if not line:
            continue
        m = re.match(r"(const void\*|void\*|const int\*|const float\*|float\*|int64_t|float|int)\s+(.*)", line)
        assert m, line
        fields += [(name.strip(), ctype[m.group(1)]) for name in m.group(2).split(",")]
    mirror = [(name, ctypes.sizeof(t)) for name, t in launch.XqaMlaParams._fields_]
    assert mirror == fields
    consts = build.header_constants()
    assert consts["XQA_MLA_SMEM_BYTES"] <= 99 * 1024 and consts["XQA_MLA_BLOCK_N"] == 32


def test_pdl_env(monkeypatch):
    monkeypatch.delenv(launch.PDL_ENV_VAR, raising=False)
    assert launch.pdl_enabled()
    monkeypatch.setenv(launch.PDL_ENV_VAR, "0")
    assert not launch.pdl_enabled()
    monkeypatch.setenv(launch.PDL_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="CUTE_MLA_PDL"):
        launch.pdl_enabled()


def test_launch_structs_layout():
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    assert ctypes.sizeof(cuda_driver.CUlaunchAttribute) == 72
    assert cuda_driver.CUlaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cuda_driver.CUlaunchConfig) == 56
