"""CPU tests of the xqa_sm120 kernel family: nvcc builds for every architecture (no GPU needed) whose SASS holds
the TMA load and, on sm_120a/sm_121a, the native fp8 mma; the on-disk cache and its key, clear errors for a
missing nvcc or an unsupported architecture, unsupported_reason texts, the ctypes mirror of the kernel's
parameter struct, the KV tensor map's arguments and cache, and a numpy model of the fp8 fragment algebra the
kernel relies on (emulated k32 mma, the V transpose through 16-bit ldmatrix + prmt, the swizzled addresses)."""

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
    sass = build.sass_by_kernel(cubin, build.find_nvcc())
    assert set(sass) == set(build.KERNEL_NAMES)
    for name in build.SPLIT_KERNEL_NAMES:
        assert re.search(build.SASS_TMA, sass[name]), f"{name}: no UTMALDG on {arch}"
        native = re.search(build.SASS_FP8_MMA, sass[name])
        if name in build.FP8_KV_KERNELS and arch in build.NATIVE_FP8_MMA_ARCHS:
            assert native and not re.search(r"\bHMMA\.", sass[name]), f"{name}: no native fp8 mma on {arch}"
        elif name in build.FP8_KV_KERNELS:  # sm_90a: the f16 emulation
            assert not native and re.search(r"\bHMMA\.16816\.F32 ", sass[name]) and "E4M3" in sass[name]
        else:
            assert not native and re.search(r"\bHMMA\.16816", sass[name])
        assert not re.search(r"\b(?:STL|LDL)\b", sass[name])


def test_sass_problems_are_reported():
    """compile_variants fails a kernel whose SASS lacks TMA / the native fp8 mma, or touches local memory."""
    good16 = "UTMALDG.4D [UR8], [UR4] ; HMMA.16816.F32.BF16 R4, R8, R12, R4 ;"
    assert build.sass_problems("xqa_mla_split_bf16_kv16", "sm_120a", good16) == []
    assert "no UTMALDG" in build.sass_problems("xqa_mla_split_bf16_kv16", "sm_90a", "HMMA.16816.F32.BF16 R4")[0]
    good8 = "UTMALDG.4D [UR8], [UR4] ; QMMA.16832.F32.E4M3.E4M3 R8, R8, R12, RZ ;"
    assert build.sass_problems("xqa_mla_split_fp8_kv8", "sm_121a", good8) == []
    missing = build.sass_problems("xqa_mla_split_bf16_kv8", "sm_120a", good16)
    assert any("native fp8 mma" in m for m in missing) and any("HMMA in an fp8" in m for m in missing)
    emulated = "UTMALDG.4D [UR8], [UR4] ; F2FP.F16.E4M3.UNPACK_B R1, R2 ; HMMA.16816.F32 R4, R8, R12, R4 ;"
    assert build.sass_problems("xqa_mla_split_fp16_kv8", "sm_90a", emulated) == []
    assert "STL/LDL" in build.sass_problems("xqa_mla_combine", "sm_90a", "STL.64 [R1], RZ ;")[0]


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
    # the plan tile the workspace sizes for is the kernel's tile
    assert (consts["XQA_MLA_BLOCK_M"], consts["XQA_MLA_BLOCK_N"]) == (launch.BLOCK_M, launch.BLOCK_N)


def test_launch_configs(monkeypatch):
    """Uniform plan only; PDL from CUTE_MLA_PDL by default, both settings offered to a tuner."""
    monkeypatch.delenv("CUTE_MLA_PDL", raising=False)
    assert launch.default_config(None, (12, 0)).enable_pdl
    monkeypatch.setenv("CUTE_MLA_PDL", "0")
    first, *rest = launch.configs(None, (12, 0))
    assert not first.enable_pdl and first.split_plan == "uniform" and [c.enable_pdl for c in rest] == [True]
    monkeypatch.setenv("CUTE_MLA_PDL", "maybe")
    with pytest.raises(ValueError, match="CUTE_MLA_PDL='maybe': allowed values are 1, true"):
        launch.default_config(None, (12, 0))
    assert launch.arch_for((12, 1)) == "sm_121a" and launch.arch_for((10, 0)) is None


def test_split_kernel_choice():
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
    assert launch.split_kernel_name(bf16, bf16, bf16) == "xqa_mla_split_bf16_kv16"
    assert launch.split_kernel_name(fp16, fp16, fp8) == "xqa_mla_split_fp16_kv16"  # fp8 q widened
    assert launch.split_kernel_name(bf16, fp8, bf16) == "xqa_mla_split_bf16_kv8"  # q quantised hi + lo
    assert launch.split_kernel_name(fp16, fp8, fp16) == "xqa_mla_split_fp16_kv8"
    assert launch.split_kernel_name(bf16, fp8, fp8) == launch.split_kernel_name(fp16, fp8, fp8) == \
        "xqa_mla_split_fp8_kv8"
    assert set(build.FP8_KV_KERNELS) == {"xqa_mla_split_bf16_kv8", "xqa_mla_split_fp16_kv8", "xqa_mla_split_fp8_kv8"}


@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_kv_tensor_map_spec(page, dtype):
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver as cd

    es = torch.empty(0, dtype=dtype).element_size()
    kv = torch.zeros(7, page, 576, dtype=dtype)
    spec = launch.kv_tensor_map_spec(kv)
    assert spec["dims"] == (64, 9, page, 7)
    assert spec["strides_bytes"] == (64 * es, 576 * es, page * 576 * es)
    assert spec["box"] == (64, 9, min(page, 32), 1)  # one box per tile (or two for 16-token pages)
    # the inner box fills exactly one swizzle span: 128 B for 16-bit rows, 64 B for fp8 rows
    assert spec["swizzle"] == (cd.CU_TENSOR_MAP_SWIZZLE_64B if es == 1 else cd.CU_TENSOR_MAP_SWIZZLE_128B)
    assert spec["box"][0] * es == (64 if es == 1 else 128)
    assert spec["data_type"] == (cd.CU_TENSOR_MAP_DATA_TYPE_UINT8 if es == 1 else cd.CU_TENSOR_MAP_DATA_TYPE_UINT16)
    for stride in spec["strides_bytes"]:
        assert stride % 16 == 0 and stride < 2 ** 40
    # a strided cache (vLLM's [blocks, page, 1, 576] squeezed, pages padded): the map follows the strides
    big = torch.zeros(7, page + 2, 576, dtype=dtype)[:, :page]
    assert launch.kv_tensor_map_spec(big)["strides_bytes"] == (64 * es, 576 * es, (page + 2) * 576 * es)


def test_kv_tensor_map_cache(monkeypatch):
    """One encode per cache tensor (address, shape, strides, dtype); a map is reused across calls (and graph
    replays keep the bytes they captured)."""
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    encoded = []

    class FakeMap:
        def __init__(self, **kw):
            encoded.append(kw)
            self.param = kw

    monkeypatch.setattr(cuda_driver, "TensorMap", FakeMap)
    monkeypatch.setattr(launch, "_TMAPS", {})
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    m1 = launch.kv_tensor_map(kv)
    assert launch.kv_tensor_map(kv) is m1 and len(encoded) == 1
    assert encoded[0]["global_address"] == kv.data_ptr() and encoded[0]["dims"] == (64, 9, 64, 4)
    launch.kv_tensor_map(kv[:2])  # another shape at the same address: a new map
    launch.kv_tensor_map(kv.view(torch.float16))  # another dtype
    launch.kv_tensor_map(torch.zeros(4, 64, 576, dtype=torch.bfloat16))  # another tensor
    assert len(encoded) == 4


def test_unsupported_reason_page_size():
    args = _args()
    args.kv_cache = torch.zeros(2, 48, 576, dtype=torch.bfloat16)
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert "block size 48" in launch.unsupported_reason(args, (12, 0))


# ---- numpy model of the fp8 fragment algebra in xqa_mla.cu (PTX ISA fragment layouts, ldmatrix, prmt) ----

def _swz(addr: int, fp8: bool) -> int:
    """kv_addr's swizzle: TMA 64 B swizzle for fp8 rows, 128 B for 16-bit rows."""
    return addr ^ ((addr >> 3) & (0x30 if fp8 else 0x70))


def _ldmatrix_x4(mem, addrs, trans=False):
    """ldmatrix.m8n8.x4.b16: lane L gives row L % 8 of matrix L // 8 (16 bytes); returns [lane][matrix][4 bytes].
    Also asserts the 8 rows of each matrix hit 8 different 16-byte bank groups (conflict-free)."""
    import numpy as np

    regs = np.zeros((32, 4, 4), dtype=np.int64)
    for m in range(4):
        assert len({(addrs[8 * m + r] >> 4) & 7 for r in range(8)}) == 8, "bank conflict"
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for m in range(4):
            rows = [mem[addrs[8 * m + r]:addrs[8 * m + r] + 16] for r in range(8)]
            regs[lane, m] = rows[g][4 * t:4 * t + 4] if not trans else \
                [rows[2 * t][2 * g], rows[2 * t][2 * g + 1], rows[2 * t + 1][2 * g], rows[2 * t + 1][2 * g + 1]]
    return regs


def _mma_k32(a, b0, b1):
    """m16n8k32 (row.col) from fragments: a [lane][4 regs][4 bytes], b0/b1 [lane][4 bytes] -> C [16, 8]."""
    import numpy as np

    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(4):
            A[g, 4 * t + j], A[g + 8, 4 * t + j] = a[lane][0][j], a[lane][1][j]
            A[g, 16 + 4 * t + j], A[g + 8, 16 + 4 * t + j] = a[lane][2][j], a[lane][3][j]
            B[4 * t + j, g], B[16 + 4 * t + j, g] = b0[lane][j], b1[lane][j]
    return A @ B


def _mma_k32_emulated(a, b0, b1):
    """The sm_90a emulation: two m16n8k16 on A {a0.lo, a1.lo, a0.hi, a1.hi}, B {b0.lo, b0.hi} (then a2/a3/b1)."""
    import numpy as np

    C = np.zeros((16, 8))
    for half in range(2):
        A, B = np.zeros((16, 16)), np.zeros((16, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            r0, r1, rb = a[lane][2 * half], a[lane][2 * half + 1], (b0, b1)[half][lane]
            A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = r0[0:2], r1[0:2]
            A[g, 8 + 2 * t:10 + 2 * t], A[g + 8, 8 + 2 * t:10 + 2 * t] = r0[2:4], r1[2:4]
            B[2 * t:2 * t + 2, g], B[8 + 2 * t:10 + 2 * t, g] = rb[0:2], rb[2:4]
        C += A @ B
    return C


def _a_frag(A):
    return [[[A[r + 8 * (reg & 1), 16 * (reg >> 1) + 4 * (lane % 4) + j] for j in range(4)] for reg in range(4)]
            for lane in range(32) for r in [lane // 4]]


def test_fp8_fragment_model():
    """The kernel's fp8 index algebra on a model of the PTX semantics: (1) the f16 emulation equals the k32 e4m3
    mma; (2) Q K^T of one warp (4 k32 steps + the rope half step) through the swizzled tile; (3) P V with P
    packed straight from the S accumulators and V transposed by ldmatrix.trans.b16 + prmt, columns mapped back
    by the epilogue's col_pair; every ldmatrix conflict-free."""
    import numpy as np

    rng = np.random.default_rng(0)
    A, B = rng.integers(-8, 8, (16, 32)), rng.integers(-8, 8, (32, 8))
    b0 = [[B[4 * (ln % 4) + j, ln // 4] for j in range(4)] for ln in range(32)]
    b1 = [[B[16 + 4 * (ln % 4) + j, ln // 4] for j in range(4)] for ln in range(32)]
    assert np.array_equal(_mma_k32(_a_frag(A), b0, b1), A @ B)
    assert np.array_equal(_mma_k32_emulated(_a_frag(A), b0, b1), A @ B)

    base, row = 3 * 1024, 576
    kv = rng.integers(-8, 8, (32, row))  # e4m3 values stand-ins, one "byte" each
    mem = np.zeros(base + 32 * row, dtype=np.int64)
    for k in range(32):
        for c in range(row):
            mem[_swz(base + k * row + c, True)] = kv[k, c]  # what TMA with the 64 B swizzle writes

    def addr(key, byte):  # kv_addr<true>
        return _swz(base + key * row + byte, True)

    q = rng.integers(-4, 4, (16, 576))
    p = rng.integers(0, 5, (16, 32))
    for cq in range(4):
        s = np.zeros((16, 32))
        for ks in range(4):
            d0 = cq * 128 + ks * 32
            for np_ in range(2):
                r = _ldmatrix_x4(mem, [addr(np_ * 16 + (ln >> 4) * 8 + (ln & 7), d0 + ((ln >> 3) & 1) * 16)
                                       for ln in range(32)])
                for h in range(2):
                    s[:, 16 * np_ + 8 * h:16 * np_ + 8 * h + 8] += _mma_k32(_a_frag(q[:, d0:d0 + 32]), r[:, 2 * h],
                                                                          r[:, 2 * h + 1])
        dr = 512 + 16 * cq
        r = _ldmatrix_x4(mem, [addr(ln, dr) for ln in range(32)])
        qr = np.zeros((16, 32))
        qr[:, :16] = q[:, dr:dr + 16]
        for n in range(4):
            s[:, 8 * n:8 * n + 8] += _mma_k32_emulated(_a_frag(qr), r[:, n], np.zeros((32, 4)))
        dims = list(range(cq * 128, cq * 128 + 128)) + list(range(dr, dr + 16))
        assert np.array_equal(s, q[:, dims] @ kv[:, dims].T)

        # P V: a0 = (row g: S tiles 0, 1 at 2t, 2t+1), a1 = row g + 8, a2/a3 = tiles 2, 3
        pa = [[[p[g + 8 * (reg & 1), 16 * (reg >> 1) + 8 * h + 2 * t + e] for h in range(2) for e in range(2)]
               for reg in range(4)] for ln in range(32) for g, t in [(ln // 4, ln % 4)]]
        out = np.zeros((16, 128))
        for sp in range(8):
            cb = cq * 128 + sp * 16
            r = _ldmatrix_x4(mem, [addr(ln, cb) for ln in range(32)], trans=True)
            for h, sel in ((0, 0x6420), (1, 0x7531)):

                def pick(x, y, sel=sel):  # prmt.b32 d, x, y, sel
                    both = list(x) + list(y)
                    return [both[(sel >> (4 * i)) & 0xF] for i in range(4)]

                c = _mma_k32(pa, [pick(r[ln, 0], r[ln, 1]) for ln in range(32)],
                             [pick(r[ln, 2], r[ln, 3]) for ln in range(32)])
                for ln in range(32):
                    g, t = ln // 4, ln % 4
                    for i in range(2):
                        for e in range(2):  # o[2 sp + h][2 i + e] -> column 16 sp + 4 t + 2 e + h (col_pair)
                            out[g + 8 * i, sp * 16 + 4 * t + 2 * e + h] = c[g + 8 * i, 2 * t + e]
        assert np.array_equal(out, p @ kv[:, cq * 128:cq * 128 + 128])


def test_bf16_swizzled_ldmatrix_conflict_free():
    """The 16-bit tile's ldmatrix addresses (Q K^T and the transposed V reads) through the 128 B swizzle."""
    base = 2 * 1024
    for np_ in range(2):
        for d0 in range(0, 576, 16):
            addrs = [_swz(base + (np_ * 16 + (ln >> 4) * 8 + (ln & 7)) * 1152 + (d0 + ((ln >> 3) & 1) * 8) * 2, False)
                     for ln in range(32)]
            assert all(len({(addrs[8 * m + r] >> 4) & 7 for r in range(8)}) == 8 for m in range(4))
    for kk in range(2):
        for col in range(0, 512, 16):
            addrs = [_swz(base + (kk * 16 + ((ln >> 3) & 1) * 8 + (ln & 7)) * 1152 + (col + (ln >> 4) * 8) * 2, False)
                     for ln in range(32)]
            assert all(len({(addrs[8 * m + r] >> 4) & 7 for r in range(8)}) == 8 for m in range(4))


def test_launch_structs_layout():
    from mla_backend_plugin.kernels.xqa_sm120 import cuda_driver

    assert ctypes.sizeof(cuda_driver.CUlaunchAttribute) == 72
    assert cuda_driver.CUlaunchAttribute.value.offset == 8
    assert ctypes.sizeof(cuda_driver.CUlaunchConfig) == 56
