"""On-disk cache of ahead-of-time exported cute_sm90 variants (TVM-FFI shared libraries).

A variant compiled once, by the JIT on first use or by ``python -m mla_backend_plugin.compile --arch sm_90a`` on a
machine without a GPU, is exported with ``export_to_c`` and linked into ``<cache>/<key>/mla_decode_sm90.so``.
Later processes load that library with ``tvm_ffi.load_module``: no DSL compile (seconds per variant), and no
DSL compiler needed at all, only apache-tvm-ffi and the DSL's ``libcute_dsl_runtime.so``.

The key hashes everything that changes the binary: the kernel's source files, the variant, PDL on/off, the
target arch and the versions of nvidia-cutlass-dsl and apache-tvm-ffi.

Opt-in for now: ``CUTE_MLA_CUTE_CACHE=1`` (``~/.cache/mla_backend_plugin/cute_sm90``) or ``=<dir>``. Export and
load are tested on CPU; a kernel call through a loaded library has not run on a GPU yet, so the default stays
the in-process JIT until it has.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import tempfile

from mla_backend_plugin.kernels.cute_sm90.config import Variant

CACHE_ENV_VAR = "CUTE_MLA_CUTE_CACHE"
FUNCTION_NAME = "mla_decode_sm90"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ("kernel.py", "config.py", "launch.py")


def cache_root() -> str | None:
    value = os.environ.get(CACHE_ENV_VAR, "").strip()
    if value.lower() in ("", "off", "0", "none", "false"):
        return None
    if value.lower() in ("1", "on", "true"):
        return os.path.join(os.path.expanduser("~"), ".cache", "mla_backend_plugin", "cute_sm90")
    return value


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def cache_key(variant: Variant, use_pdl: bool, arch: str) -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    h.update(repr((dataclasses.astuple(variant), use_pdl, arch, _version("nvidia-cutlass-dsl"),
                   _version("apache-tvm-ffi"))).encode())
    return h.hexdigest()[:24]


def library_path(variant: Variant, use_pdl: bool, arch: str) -> str | None:
    root = cache_root()
    return None if root is None else os.path.join(root, cache_key(variant, use_pdl, arch), FUNCTION_NAME + ".so")


def export(compiled, variant: Variant, use_pdl: bool, arch: str) -> str:
    """Export a compiled (``--enable-tvm-ffi``) variant into the cache; returns the library's path."""
    import cutlass.cute as cute

    path = library_path(variant, use_pdl, arch)
    if path is None:
        raise RuntimeError(f"the cute_sm90 cache is off (set {CACHE_ENV_VAR}=1 or ={CACHE_ENV_VAR.lower()}-dir)")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) to link the exported kernel")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        obj = os.path.join(tmp, FUNCTION_NAME + ".o")
        compiled.export_to_c(obj, function_name=FUNCTION_NAME)
        tmp_lib = os.path.join(tmp, FUNCTION_NAME + ".so")
        rpaths = [f"-Wl,-rpath,{d}" for d in sorted({os.path.dirname(lib) for lib in libs})]
        subprocess.run([cc, "-shared", "-o", tmp_lib, obj, *libs, *rpaths], check=True, capture_output=True)
        os.replace(tmp_lib, path)  # atomic: concurrent builders of the same key never see half a file
    return path


def load(variant: Variant, use_pdl: bool, arch: str):
    """The cached variant's function, or None when it is not in the cache."""
    path = library_path(variant, use_pdl, arch)
    if path is None or not os.path.exists(path):
        return None
    import tvm_ffi

    return tvm_ffi.load_module(path)[FUNCTION_NAME]
