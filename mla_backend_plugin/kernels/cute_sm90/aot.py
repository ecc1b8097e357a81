"""On-disk cache of ahead-of-time exported cute_sm90 variants (TVM-FFI shared libraries).

A variant compiled once, by the JIT on first use or by ``python -m mla_backend_plugin.compile --arch sm_90a``
on a machine without a GPU, is exported with ``export_to_c`` and linked into a self-contained, relocatable
directory::

    <cache>/lib/cute-dsl-<version>-<cu12|cu13>/libcute_dsl_runtime.so   copied once from nvidia-cutlass-dsl
    <cache>/<key>/mla_decode_sm90.so                                    RUNPATH $ORIGIN/../lib/cute-dsl-...
    <cache>/<key>/meta.json                                             versions, source hash, variant, arch

Later processes load the library with ``tvm_ffi.load_module``: no DSL compile (seconds per variant), and no
DSL at all on the loading host, only apache-tvm-ffi (its ``libtvm_ffi.so`` is the one ``import tvm_ffi``
loads; the library names it by soname). The directory can be built on a CPU machine and copied anywhere.

The key hashes what changes the binary and does not depend on what the loading host has installed: the
kernel's source files, the variant, PDL on/off and the target arch. The toolchain versions live in
``meta.json``: with nvidia-cutlass-dsl importable, an entry built by another DSL or tvm-ffi version is stale
(rebuilt and overwritten); without the DSL, an entry is used when the installed apache-tvm-ffi is of the same
release series (major.minor) as the one it was built against.

``CUTE_MLA_CUTE_CACHE``: unset, ``1`` or ``on`` -> ``~/.cache/mla_backend_plugin/cute_sm90``; ``0`` / ``off``
-> no cache; anything else -> that directory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time

from mla_backend_plugin.kernels.cute_sm90.config import Variant

CACHE_ENV_VAR = "CUTE_MLA_CUTE_CACHE"
DEFAULT_ON = True  # an unset CACHE_ENV_VAR means the default directory (verified on an H100, see STATUS)
FUNCTION_NAME = "mla_decode_sm90"
LIBRARY_NAME = FUNCTION_NAME + ".so"
META_NAME = "meta.json"
RUNTIME_NAME = "libcute_dsl_runtime.so"
FORMAT = 1  # layout of an entry; part of the key
DSL_DIST, TVM_FFI_DIST = "nvidia-cutlass-dsl", "apache-tvm-ffi"
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ("kernel.py", "kernel_fp8mma.py", "config.py", "launch.py")  # launch.py: the compiled signature (compile_variant)
PREBUILD_HINT = ("pre-build it where nvidia-cutlass-dsl is installed with `python -m mla_backend_plugin.compile "
                 "--arch sm_90a --kernels cute_sm90 --export-dir DIR` and copy DIR here "
                 f"({CACHE_ENV_VAR}=DIR), or pip install nvidia-cutlass-dsl to compile it on first use")


def default_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "mla_backend_plugin", "cute_sm90")


def cache_root() -> str | None:
    value = os.environ.get(CACHE_ENV_VAR, "").strip()
    if value.lower() in ("0", "off", "none", "false", "no") or (not value and not DEFAULT_ON):
        return None
    if value.lower() in ("", "1", "on", "true", "yes"):
        return default_root()
    return os.path.abspath(os.path.expanduser(value))


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_importable() -> bool:
    """Whether the DSL's compiler can be imported here (its distribution metadata alone does not count)."""
    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


def source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        with open(os.path.join(_HERE, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def cache_key(variant: Variant, use_pdl: bool, arch: str) -> str:
    h = hashlib.sha256()
    h.update(repr((FORMAT, source_hash(), dataclasses.astuple(variant), bool(use_pdl), arch)).encode())
    return h.hexdigest()[:24]


def entry_dir(variant: Variant, use_pdl: bool, arch: str, root: str | None = None) -> str | None:
    root = cache_root() if root is None else root
    return None if root is None else os.path.join(root, cache_key(variant, use_pdl, arch))


def library_path(variant: Variant, use_pdl: bool, arch: str) -> str | None:
    d = entry_dir(variant, use_pdl, arch)
    return None if d is None else os.path.join(d, LIBRARY_NAME)


def _series(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def check_entry(variant: Variant, use_pdl: bool, arch: str, root: str | None = None) -> tuple[str | None, str]:
    """(library path, "") when the cached entry can be loaded here, else (None, why not).

    With the DSL importable, the entry must come from the same nvidia-cutlass-dsl and apache-tvm-ffi versions
    (else it is stale and the caller rebuilds it); without it, apache-tvm-ffi must be installed and of the
    entry's release series."""
    d = entry_dir(variant, use_pdl, arch, root)
    if d is None:
        return None, f"the cute_sm90 cache is off ({CACHE_ENV_VAR}=0)"
    lib, meta_path = os.path.join(d, LIBRARY_NAME), os.path.join(d, META_NAME)
    if not (os.path.exists(lib) and os.path.exists(meta_path)):
        return None, f"{variant.name} (pdl={'on' if use_pdl else 'off'}, {arch}) is not prebuilt in {d}"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"unreadable {meta_path}: {e}"
    expected = {"format": FORMAT, "source_sha256": source_hash(), "variant": dataclasses.asdict(variant),
                "use_pdl": bool(use_pdl), "arch": arch}
    wrong = [k for k, v in expected.items() if meta.get(k) != v]
    if wrong:
        return None, f"{meta_path} does not describe this build ({', '.join(wrong)} differ)"
    built_dsl, built_tvm = meta.get(DSL_DIST), meta.get(TVM_FFI_DIST)
    tvm = installed_version(TVM_FFI_DIST)
    if tvm is None:
        return None, (f"{TVM_FFI_DIST} is not installed (pip install '{TVM_FFI_DIST}=={built_tvm}'; the prebuilt "
                      "kernels load through it)")
    if dsl_importable():
        dsl = installed_version(DSL_DIST)
        if (dsl, tvm) != (built_dsl, built_tvm):
            return None, (f"stale: built with {DSL_DIST} {built_dsl} / {TVM_FFI_DIST} {built_tvm}, "
                          f"installed {dsl} / {tvm}")
    elif _series(tvm) != _series(str(built_tvm)):
        return None, (f"built against {TVM_FFI_DIST} {built_tvm}, installed {tvm} (pip install "
                      f"'{TVM_FFI_DIST}=={built_tvm}', or rebuild with nvidia-cutlass-dsl installed)")
    runtime = os.path.join(d, meta.get("runtime", ""))
    if not os.path.isfile(runtime):
        return None, f"the DSL runtime library {runtime} is missing (copy the whole cache directory)"
    return lib, ""


@functools.cache
def _prebuilt_cached(variant: Variant, use_pdl: bool, arch: str, root: str | None) -> str | None:
    return check_entry(variant, use_pdl, arch, root)[1] or None


def prebuilt_reason(variant: Variant, use_pdl: bool, arch: str) -> str | None:
    """None when a loadable prebuilt library of the variant is in the cache, else why not. Memoised per
    process and cache directory (the registry asks on every call)."""
    root = cache_root()
    if root is None:
        return f"the cute_sm90 cache is off ({CACHE_ENV_VAR}=0)"
    return _prebuilt_cached(variant, bool(use_pdl), arch, root)


def _runtime_library() -> tuple[str, str]:
    """(path of the DSL's libcute_dsl_runtime.so, its directory name inside <cache>/lib)."""
    from cutlass import cute

    found = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False)
             if os.path.basename(p) == RUNTIME_NAME]
    if not found:
        raise RuntimeError(f"nvidia-cutlass-dsl's {RUNTIME_NAME} not found (find_runtime_libraries)")
    flavour = os.path.basename(os.path.dirname(os.path.dirname(found[0])))  # .../nvidia_cutlass_dsl/cu13/lib
    return found[0], f"cute-dsl-{installed_version(DSL_DIST)}-{flavour}"


def _copy_atomic(src: str, dst: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst), prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def export(compiled, variant: Variant, use_pdl: bool, arch: str, root: str | None = None) -> str:
    """Export a compiled (``--enable-tvm-ffi``) variant into the cache; returns the library's path."""
    import tvm_ffi

    root = cache_root() if root is None else root
    if root is None:
        raise RuntimeError(f"the cute_sm90 cache is off (unset {CACHE_ENV_VAR}, or set it to 1 or a directory)")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) to link the exported kernel")
    d = entry_dir(variant, use_pdl, arch, root)
    os.makedirs(d, exist_ok=True)
    runtime_src, runtime_dir = _runtime_library()
    lib_dir = os.path.join(root, "lib", runtime_dir)
    os.makedirs(lib_dir, exist_ok=True)
    runtime = os.path.join(lib_dir, RUNTIME_NAME)
    if not os.path.exists(runtime) or os.path.getsize(runtime) != os.path.getsize(runtime_src):
        _copy_atomic(runtime_src, runtime)
    tvm_lib_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    meta = {"format": FORMAT, "function": FUNCTION_NAME, "variant": dataclasses.asdict(variant),
            "variant_name": variant.name, "use_pdl": bool(use_pdl), "arch": arch, "source_sha256": source_hash(),
            "runtime": os.path.join("..", "lib", runtime_dir, RUNTIME_NAME),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            DSL_DIST: installed_version(DSL_DIST), TVM_FFI_DIST: installed_version(TVM_FFI_DIST)}
    with tempfile.TemporaryDirectory(dir=d, prefix=".tmp-") as tmp:
        obj = os.path.join(tmp, FUNCTION_NAME + ".o")
        compiled.export_to_c(obj, function_name=FUNCTION_NAME)
        tmp_lib = os.path.join(tmp, LIBRARY_NAME)
        # -l by name: the NEEDED entries are sonames, found through RUNPATH ($ORIGIN: the directory moves
        # with the entry) and, for libtvm_ffi.so, as the copy `import tvm_ffi` already loaded
        proc = subprocess.run([cc, "-shared", "-o", tmp_lib, obj, f"-L{lib_dir}", "-lcute_dsl_runtime",
                               f"-L{tvm_lib_dir}", "-ltvm_ffi", "-Wl,--enable-new-dtags",
                               f"-Wl,-rpath,$ORIGIN/../lib/{runtime_dir}"], check=False, capture_output=True,
                              text=True)
        if proc.returncode:
            raise RuntimeError(f"linking {variant.name} failed: {proc.stderr.strip()}")
        tmp_meta = os.path.join(tmp, META_NAME)
        with open(tmp_meta, "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
        # atomic: concurrent builders of the same key never leave half a file; the library goes first, so a
        # reader never pairs a new meta.json with an old library
        os.replace(tmp_lib, os.path.join(d, LIBRARY_NAME))
        os.replace(tmp_meta, os.path.join(d, META_NAME))
    _prebuilt_cached.cache_clear()
    return os.path.join(d, LIBRARY_NAME)


def load_path(path: str):
    import tvm_ffi

    return tvm_ffi.load_module(path)[FUNCTION_NAME]


def load(variant: Variant, use_pdl: bool, arch: str):
    """The cached variant's function, or None when the cache holds no usable entry for it."""
    path, _ = check_entry(variant, use_pdl, arch)
    return None if path is None else load_path(path)
