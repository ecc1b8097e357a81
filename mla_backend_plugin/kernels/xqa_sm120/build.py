"""Build the XQA MLA CUDA C++ kernels (csrc/xqa_mla) into one cubin per architecture, cached on disk.

The cubin is built by nvcc on first use (or by ``python -m mla_backend_plugin.compile --arch sm_120a``) and
cached under ``~/.cache/mla_backend_plugin/xqa/<key>/`` (``$CUTE_MLA_XQA_CACHE`` overrides the directory),
where ``key`` hashes the sources, the nvcc version, the architecture and the flags: editing the source or
switching toolkits builds anew, nothing else does. No GPU is needed to build; no torch C++ extension is involved
(launch.py loads the cubin through the driver API).

nvcc is looked up as ``$CUTE_MLA_NVCC``, ``$CUDA_HOME/bin/nvcc``, ``$CUDA_PATH/bin/nvcc``, ``nvcc`` on PATH,
then ``/usr/local/cuda/bin/nvcc``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mla_backend_plugin import envs
from mla_backend_plugin.kernels.xqa_sm120 import MANIFEST
from mla_backend_plugin.ops.files import fingerprint
from mla_backend_plugin.ops.manifest import VariantResult

# architecture name -> nvcc -gencode argument ('a' targets: SM120/121 and SM90 features are arch-specific),
# for every arch the family's manifest claims
ARCHS = {arch: f"arch=compute_{arch[3:]},code={arch}" for arch in MANIFEST.archs}
SOURCE_NAME = "xqa_mla.cu"
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "--expt-relaxed-constexpr")
# kernel entry points in the cubin (unmangled)
SPLIT_KERNELS = {  # (compute dtype, KV is fp8, q is fp8) -> name
    ("bf16", False, False): "xqa_mla_split_bf16_kv16",
    ("bf16", False, True): "xqa_mla_split_bf16_kv16",  # an fp8 q is widened to the compute dtype on load
    ("fp16", False, False): "xqa_mla_split_fp16_kv16",
    ("fp16", False, True): "xqa_mla_split_fp16_kv16",
    ("bf16", True, False): "xqa_mla_split_bf16_kv8",  # fp8 mma; the 16-bit q is quantised as e4m3 hi + lo
    ("fp16", True, False): "xqa_mla_split_fp16_kv8",
    ("bf16", True, True): "xqa_mla_split_fp8_kv8",  # fp8 mma on the fp8 q as it is (out dtype: a runtime flag)
    ("fp16", True, True): "xqa_mla_split_fp8_kv8",
}
SPLIT_KERNEL_NAMES = tuple(dict.fromkeys(SPLIT_KERNELS.values()))
FP8_KV_KERNELS = tuple(n for n in SPLIT_KERNEL_NAMES if n.endswith("_kv8"))
COMBINE_KERNEL = "xqa_mla_combine"
KERNEL_NAMES = SPLIT_KERNEL_NAMES + (COMBINE_KERNEL,)
# SASS every build must show (cuobjdump -sass): each split kernel loads KV by TMA (UTMALDG); on SM120/121 the
# fp8-cache kernels run the native e4m3 mma (QMMA.16832.F32.E4M3.E4M3). sm_90a has no fp8 mma.sync: there the
# kernel emulates it with f16 HMMA, which the check requires instead.
NATIVE_FP8_MMA_ARCHS = ("sm_120a", "sm_121a")
SASS_TMA = r"\bUTMALDG\b"
SASS_FP8_MMA = r"\bQMMA\.16832\.F32\.E4M3\.E4M3\b"
SASS_F16_MMA = r"\bHMMA\.16816\.F32\b"

NVCC_ENV_VAR = "CUTE_MLA_NVCC"
CACHE_ENV_VAR = "CUTE_MLA_XQA_CACHE"
SOURCE_ENV_VAR = "CUTE_MLA_XQA_SRC"
# last resort when neither the environment nor PATH names nvcc (tests clear it to simulate a missing toolkit)
DEFAULT_NVCC_PATHS: tuple[str, ...] = ("/usr/local/cuda/bin/nvcc",)


class XqaBuildError(RuntimeError):
    pass


def source_dir() -> Path:
    """Directory of the .cu/.h sources: $CUTE_MLA_XQA_SRC, a copy shipped inside the package, or the repo's csrc."""
    env = envs.get(SOURCE_ENV_VAR)
    here = Path(__file__).resolve().parent
    candidates = ([Path(env)] if env else []) + [here / "csrc", here.parents[2] / "csrc" / "xqa_mla"]
    for cand in candidates:
        if (cand / SOURCE_NAME).is_file():
            return cand
    raise XqaBuildError(f"XQA MLA sources not found (looked for {SOURCE_NAME} in "
                        + ", ".join(str(c) for c in candidates) + f"; set {SOURCE_ENV_VAR})")


def find_nvcc() -> str | None:
    env = envs.get(NVCC_ENV_VAR)
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    for path in DEFAULT_NVCC_PATHS:
        if os.access(path, os.X_OK):
            return path
    return None


def require_nvcc() -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        raise XqaBuildError(
            "nvcc not found: the xqa_sm120 kernel is compiled from CUDA C++ on first use and needs the CUDA "
            f"toolkit's nvcc (>= 12.8 for sm_120a/sm_121a); put it on PATH or set CUDA_HOME or {NVCC_ENV_VAR}")
    return nvcc


_NVCC_VERSIONS: dict[str, str] = {}


def nvcc_version(nvcc: str) -> str:
    if nvcc not in _NVCC_VERSIONS:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise XqaBuildError(f"{nvcc} --version failed: {proc.stderr.strip()[:300]}")
        _NVCC_VERSIONS[nvcc] = proc.stdout.strip()
    return _NVCC_VERSIONS[nvcc]


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"xqa_sm120: architecture {arch!r} is not supported; allowed: {', '.join(ARCHS)}")
    return arch


def cache_root() -> Path:
    env = envs.get(CACHE_ENV_VAR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mla_backend_plugin" / "xqa"


def _sources(src: Path) -> list[Path]:
    return sorted(p for p in src.iterdir() if p.suffix in (".cu", ".cuh", ".h"))


def cache_key(arch: str, nvcc: str, flags: tuple[str, ...] = NVCC_FLAGS) -> str:
    """Fingerprint of every source file, the nvcc version, the architecture and the flags."""
    toolchain = (nvcc_version(nvcc).encode() + b"\0" + ARCHS[check_arch(arch)].encode() + b"\0"
                 + " ".join(flags).encode())
    return fingerprint(_sources(source_dir()), extra=toolchain)[:20]


@dataclasses.dataclass
class BuildResult:
    arch: str
    cubin: Path
    log: str  # ptxas -v output (saved beside the cubin, so a cached build still reports its resources)
    seconds: float  # nvcc wall time; 0 for a cache hit
    cached: bool


def build(arch: str, *, force: bool = False, flags: tuple[str, ...] = NVCC_FLAGS) -> BuildResult:
    """The cubin for ``arch`` (``sm_90a``, ``sm_120a``, ``sm_121a``), compiled unless the cache has it."""
    check_arch(arch)
    nvcc = require_nvcc()
    key = cache_key(arch, nvcc, flags)
    out_dir = cache_root() / key
    cubin = out_dir / f"xqa_mla_{arch}.cubin"
    log_path = out_dir / f"xqa_mla_{arch}.ptxas.log"
    if not force and cubin.is_file() and log_path.is_file():
        return BuildResult(arch, cubin, log_path.read_text(), 0.0, True)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    t0 = time.time()
    # Build into a private temp name and rename: concurrent builders (pytest -n, several ranks) never see a
    # half-written cubin.
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".cubin.tmp")
    os.close(fd)
    cmd = [nvcc, *flags, "-gencode", ARCHS[arch], "-I", str(src), "-o", tmp, str(src / SOURCE_NAME)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise XqaBuildError(f"nvcc failed for {arch} (exit {proc.returncode}): {' '.join(cmd)}\n"
                                f"{(proc.stderr or proc.stdout).strip()[-3000:]}")
        log = proc.stdout + proc.stderr
        fd, tmp_log = tempfile.mkstemp(dir=out_dir, suffix=".log.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(log)
        os.replace(tmp_log, log_path)
        os.replace(tmp, cubin)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return BuildResult(arch, cubin, log, time.time() - t0, False)


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, static shared bytes, spill bytes (stores + loads) and stack, from ptxas -v."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or re.search(r"Compiling entry function '([^']+)'",
                                                                             line)
        if m:
            current = out.setdefault(m.group(1), {"registers": 0, "shared": 0, "spills": 0, "stack": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"] = int(m.group(1))
            current["spills"] = int(m.group(2)) + int(m.group(3))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            current["shared"] = int(m.group(1))
    return out


def header_constants() -> dict[str, int]:
    """The ``#define XQA_MLA_*`` numbers of xqa_mla_params.h (tile shape, threads, dynamic smem)."""
    text = (source_dir() / "xqa_mla_params.h").read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"#define (XQA_MLA_\w+) (\d+)", text)}


def dynamic_smem_bytes(kernel: str) -> int:
    return 0 if kernel == COMBINE_KERNEL else header_constants()["XQA_MLA_SMEM_BYTES"]


def _disassemblers(nvcc: str | None) -> list[list[str]]:
    """Commands that print a cubin's SASS, best first: nvdisasm beside nvcc or on PATH or from the nvidia-*-cu13
    wheels (new enough to decode sm_121), then Triton's bundled nvdisasm / cuobjdump (CUDA 12.8: up to sm_120)."""
    found: list[list[str]] = []

    def add(path: str | None, *args: str) -> None:
        if path and os.path.isfile(path) and os.access(path, os.X_OK) and [path, *args] not in found:
            found.append([path, *args])

    if nvcc:
        add(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "nvdisasm"), "-c")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            add(os.path.join(os.environ[var], "bin", "nvdisasm"), "-c")
    add(shutil.which("nvdisasm"), "-c")
    try:
        import nvidia  # namespace package of the CUDA wheels (nvidia/cu13/bin/nvdisasm)

        for root in getattr(nvidia, "__path__", []):
            for cand in sorted(Path(root).glob("*/bin/nvdisasm"), reverse=True):
                add(str(cand), "-c")
    except ImportError:
        pass
    try:
        import triton.backends.nvidia as triton_nvidia

        tbin = os.path.join(os.path.dirname(triton_nvidia.__file__), "bin")
        add(os.path.join(tbin, "nvdisasm"), "-c")
        add(os.path.join(tbin, "cuobjdump"), "-sass")
    except ImportError:
        pass
    add(shutil.which("cuobjdump"), "-sass")
    return found


def sass_by_kernel(cubin: Path, nvcc: str | None = None) -> dict[str, str]:
    """SASS text of every kernel in ``cubin``, from the first disassembler that decodes its architecture."""
    errors = []
    for cmd in _disassemblers(nvcc):
        proc = subprocess.run([*cmd, str(cubin)], capture_output=True, text=True, check=False)
        text = proc.stdout
        if proc.returncode != 0 or "Cannot decode" in proc.stderr + text:
            errors.append(f"{os.path.basename(cmd[0])}: {(proc.stderr or text).strip()[:200]}")
            continue
        # nvdisasm: '.text.<name>' sections; cuobjdump: 'Function : <name>'
        marker = r"^\s*\.section\s+\.text\.(\w+)" if cmd[-1] == "-c" else r"^\s*Function\s*:\s*(\w+)"
        parts = re.split(marker, text, flags=re.MULTILINE)
        out: dict[str, str] = {}
        for name, body in zip(parts[1::2], parts[2::2]):
            out[name] = out.get(name, "") + body
        if out:
            return out
        errors.append(f"{os.path.basename(cmd[0])}: no kernel found in the listing")
    raise XqaBuildError("no disassembler could read the cubin (nvdisasm / cuobjdump of CUDA >= 12.8; sm_121a "
                        "needs a CUDA 13 nvdisasm): " + "; ".join(errors or ["none found"]))


def sass_problems(name: str, arch: str, sass: str) -> list[str]:
    """What the SASS of kernel ``name`` built for ``arch`` lacks (empty when it is as designed)."""
    problems = []
    if name in SPLIT_KERNEL_NAMES:
        if not re.search(SASS_TMA, sass):
            problems.append("no UTMALDG (TMA load) in the SASS")
        if name in FP8_KV_KERNELS:
            if arch in NATIVE_FP8_MMA_ARCHS:
                if not re.search(SASS_FP8_MMA, sass):
                    problems.append("no native fp8 mma (QMMA.16832.F32.E4M3.E4M3) in the SASS")
                if re.search(r"\bHMMA\.", sass):
                    problems.append("HMMA in an fp8-cache kernel (the fp8 mma fell back to f16)")
            elif not re.search(SASS_F16_MMA, sass):
                problems.append("no f16 HMMA (the emulated fp8 mma) in the SASS")
    spill_ops = len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass))
    if spill_ops:
        problems.append(f"{spill_ops} local-memory loads/stores (STL/LDL) in the SASS")
    return problems


def compile_variants(arch: str, one_per_class: bool = False):
    """Build for ``arch`` and report every kernel (mla_backend_plugin.compile's contract): registers, shared
    memory, spills; a kernel fails if it spills or if its SASS lacks the TMA load or (fp8 caches on
    sm_120a/sm_121a) the native fp8 mma. One nvcc build compiles every kernel, so ``one_per_class`` builds the
    same."""
    t0 = time.time()
    try:
        res = build(arch)
        sass = sass_by_kernel(res.cubin, find_nvcc())
    except (XqaBuildError, ValueError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [VariantResult(f"xqa {name}", False, seconds=time.time() - t0, error=first) for name in KERNEL_NAMES]
    info = parse_ptxas(res.log)
    results = []
    for name in KERNEL_NAMES:
        k = info.get(name)
        label = f"xqa {name}" + (" (cached)" if res.cached else "")
        if k is None:
            results.append(VariantResult(label, False, seconds=res.seconds, error="kernel missing from ptxas output"))
            continue
        problems = sass_problems(name, arch, sass.get(name, "")) if name in sass else ["kernel missing from SASS"]
        if k["spills"] or k["stack"]:
            problems.append(f"spills: {k['spills']} B, stack frame {k['stack']} B")
        results.append(VariantResult(label, not problems, registers=k["registers"],
                                     shared_bytes=k["shared"] + dynamic_smem_bytes(name),
                                     spill_bytes=k["spills"], seconds=res.seconds, error="; ".join(problems)))
    return results
