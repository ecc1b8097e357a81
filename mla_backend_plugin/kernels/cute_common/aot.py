"""On-disk cache of ahead-of-time exported CuTe-DSL kernels (TVM-FFI shared libraries), for every CuTe family.

A variant compiled once, by the JIT on first use or by ``python -m mla_backend_plugin.compile --arch ARCH`` on a
machine without a GPU, is exported with ``export_to_c`` and linked into a self-contained, relocatable
directory::

    <cache>/lib/cute-dsl-<version>-<cu12|cu13>/libcute_dsl_runtime.so   copied once from nvidia-cutlass-dsl
    <cache>/<family>-<key>/<function>.so                                RUNPATH $ORIGIN/../lib/cute-dsl-...
    <cache>/<family>-<key>/meta.json                                    versions, fingerprint, variant, arch

Later processes load the library with ``tvm_ffi.load_module``: no DSL compile (seconds per variant), and no
DSL at all on the loading host, only apache-tvm-ffi (its ``libtvm_ffi.so`` is the one ``import tvm_ffi``
loads; the library names it by soname). The directory can be built on a CPU machine and copied anywhere.

The key hashes what changes the binary and does not depend on what the loading host has installed: the
fingerprint of the sources (every ``.py`` under the family's folder and under ``cute_common/``, and
``ops/constants.py``, so an edit to a shared module invalidates every family that uses it), the variant,
PDL on/off, the target arch and the exported function's name. The toolchain versions live in ``meta.json``
and are checked on load: with nvidia-cutlass-dsl importable, an entry built by another DSL or tvm-ffi
version is stale (rebuilt and overwritten); without it, an entry is used when the installed apache-tvm-ffi is
of the same release series (major.minor) as the one it was built against.

``CUTE_MLA_CUTE_CACHE`` (envs.py): unset, ``1`` or ``on`` -> ``~/.cache/mla_backend_plugin/cute``; ``0`` /
``off`` -> no cache; anything else -> that directory.

A second, read-only root ships inside the package: ``mla_backend_plugin/kernels/prebuilt/``, filled before a wheel
is built by ``python -m mla_backend_plugin.compile --arch ARCH --into-package`` (``CUTE_MLA_PACKAGED_KERNELS=0``
ignores it). A lookup tries the user's cache first, then the package, so a cold engine start compiles nothing
for the variants a release shipped. Its entries carry no copy of the DSL runtime (43 MB): they load with the
installed nvidia-cutlass-dsl's own ``libcute_dsl_runtime.so`` (preloaded by soname), which the version check
requires to be the release they were built with anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from mla_backend_plugin import envs
from mla_backend_plugin.ops.files import fingerprint
from mla_backend_plugin.ops.manifest import first_of_each_class

CACHE_ENV_VAR = "CUTE_MLA_CUTE_CACHE"
META_NAME = "meta.json"
RUNTIME_NAME = "libcute_dsl_runtime.so"
FORMAT = 2  # layout of an entry; part of the key (2: family fingerprints, one root for every family)
DSL_DIST, TVM_FFI_DIST = "nvidia-cutlass-dsl", "apache-tvm-ffi"
COMMON_DIR = Path(__file__).resolve().parent
# constants the kernels compile in (the work-item layout WORK_ITEM_INTS, SHARE_REQUEST_COST, head dims): an
# edit there changes the binaries as an edit to a kernel does
CONSTANTS_FILE = COMMON_DIR.parent.parent / "ops" / "constants.py"
PACKAGED_ROOT = str(COMMON_DIR.parent / "prebuilt")  # mla_backend_plugin/kernels/prebuilt (package data)
SHARED_RUNTIME = "installed"  # meta "runtime" of a packaged entry: the installed DSL's own runtime library
logger = logging.getLogger("mla_backend_plugin")


def default_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "mla_backend_plugin", "cute")


def cache_root() -> str | None:
    value = envs.get(CACHE_ENV_VAR)
    if value is None:
        return None
    return value or default_root()


def search_roots() -> tuple[str, ...]:
    """Where a lookup looks, in order: the user's cache, then the package's prebuilt kernels (when it has any and
    they are not ignored). Nothing with the cache off."""
    root = cache_root()
    if root is None:
        return ()
    roots = [root]
    if (envs.get("CUTE_MLA_PACKAGED_KERNELS") and os.path.isdir(PACKAGED_ROOT)
            and os.path.realpath(root) != os.path.realpath(PACKAGED_ROOT)):
        roots.append(PACKAGED_ROOT)
    return tuple(roots)


def is_packaged(root: str) -> bool:
    return os.path.realpath(root) == os.path.realpath(PACKAGED_ROOT)


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


def _series(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


@dataclasses.dataclass(frozen=True)
class AotCache:
    """The cache as one CuTe family sees it: its entries are named ``<family>-<key>`` and hold
    ``<function>.so``; ``source_dirs`` are fingerprinted into every key (the family's folder, cute_common and
    ops/constants.py)."""

    family: str
    function_name: str
    source_dirs: tuple[str, ...]
    # the module with the family's ``Variant``, ``compile_variant`` and ``AOT`` (its launch module): what a
    # background build (background.py) imports to compile a variant in another process
    builder_module: str = ""

    @classmethod
    def for_family(cls, family: str, function_name: str, family_dir, builder_module: str = "") -> AotCache:
        return cls(family, function_name, (str(Path(family_dir).resolve()), str(COMMON_DIR), str(CONSTANTS_FILE)),
                   builder_module)

    @property
    def library_name(self) -> str:
        return self.function_name + ".so"

    def prebuild_hint(self, arch: str) -> str:
        return (f"pre-build it where nvidia-cutlass-dsl is installed with `python -m mla_backend_plugin.compile "
                f"--arch {arch} --kernels {self.family} --export-dir DIR` and copy DIR here ({CACHE_ENV_VAR}=DIR), "
                "or pip install nvidia-cutlass-dsl to compile it on first use")

    def source_hash(self) -> str:
        return fingerprint(self.source_dirs)

    def cache_key(self, variant, use_pdl: bool, arch: str) -> str:
        h = hashlib.sha256()
        h.update(repr((FORMAT, self.family, self.function_name, self.source_hash(), dataclasses.astuple(variant),
                       bool(use_pdl), arch)).encode())
        return f"{self.family}-{h.hexdigest()[:24]}"

    def entry_dir(self, variant, use_pdl: bool, arch: str, root: str | None = None) -> str | None:
        root = cache_root() if root is None else root
        return None if root is None else os.path.join(root, self.cache_key(variant, use_pdl, arch))

    def library_path(self, variant, use_pdl: bool, arch: str) -> str | None:
        d = self.entry_dir(variant, use_pdl, arch)
        return None if d is None else os.path.join(d, self.library_name)

    def expected_meta(self, variant, use_pdl: bool, arch: str) -> dict:
        return {"format": FORMAT, "family": self.family, "function": self.function_name,
                "source_sha256": self.source_hash(), "variant": dataclasses.asdict(variant),
                "use_pdl": bool(use_pdl), "arch": arch}

    def check_entry(self, variant, use_pdl: bool, arch: str, root: str | None = None) -> tuple[str | None, str]:
        """(library path, "") when the cached entry can be loaded here, else (None, why not).

        With the DSL importable, the entry must come from the same nvidia-cutlass-dsl and apache-tvm-ffi
        versions (else it is stale and the caller rebuilds it); without it, apache-tvm-ffi must be installed and
        of the entry's release series."""
        d = self.entry_dir(variant, use_pdl, arch, root)
        if d is None:
            return None, f"the CuTe kernel cache is off ({CACHE_ENV_VAR}=0)"
        lib, meta_path = os.path.join(d, self.library_name), os.path.join(d, META_NAME)
        if not (os.path.exists(lib) and os.path.exists(meta_path)):
            return None, f"{variant.name} (pdl={'on' if use_pdl else 'off'}, {arch}) is not prebuilt in {d}"
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            return None, f"unreadable {meta_path}: {e}"
        wrong = [k for k, v in self.expected_meta(variant, use_pdl, arch).items() if meta.get(k) != v]
        if wrong:
            return None, f"{meta_path} does not describe this build ({', '.join(wrong)} differ)"
        built_dsl, built_tvm = meta.get(DSL_DIST), meta.get(TVM_FFI_DIST)
        tvm = installed_version(TVM_FFI_DIST)
        if tvm is None:
            return None, (f"{TVM_FFI_DIST} is not installed (pip install '{TVM_FFI_DIST}=={built_tvm}'; the "
                          "prebuilt kernels load through it)")
        if dsl_importable():
            dsl = installed_version(DSL_DIST)
            if (dsl, tvm) != (built_dsl, built_tvm):
                return None, (f"stale: built with {DSL_DIST} {built_dsl} / {TVM_FFI_DIST} {built_tvm}, "
                              f"installed {dsl} / {tvm}")
        elif _series(tvm) != _series(str(built_tvm)):
            return None, (f"built against {TVM_FFI_DIST} {built_tvm}, installed {tvm} (pip install "
                          f"'{TVM_FFI_DIST}=={built_tvm}', or rebuild with nvidia-cutlass-dsl installed)")
        if meta.get("runtime") == SHARED_RUNTIME:  # a packaged entry: the installed DSL lends its runtime
            if not dsl_importable() or _installed_runtime(meta.get("runtime_flavour", "")) is None:
                return None, (f"{d} loads with {DSL_DIST}'s runtime library: pip install '{DSL_DIST}=={built_dsl}'")
            return lib, ""
        runtime = os.path.join(d, meta.get("runtime", ""))
        if not os.path.isfile(runtime):
            return None, f"the DSL runtime library {runtime} is missing (copy the whole cache directory)"
        return lib, ""

    def find(self, variant, use_pdl: bool, arch: str, roots: tuple[str, ...] | None = None) -> tuple[str | None, str]:
        """(library path, "") from the first root (``search_roots()`` unless given) that holds a loadable entry,
        else (None, why not, per root)."""
        roots = search_roots() if roots is None else roots
        if not roots:
            return None, f"the CuTe kernel cache is off ({CACHE_ENV_VAR}=0)"
        reasons = []
        for root in roots:
            path, why = self.check_entry(variant, use_pdl, arch, root)
            if path is not None:
                return path, ""
            reasons.append(why if not is_packaged(root) else f"package: {why}")
        return None, "; ".join(reasons)

    def prebuilt_reason(self, variant, use_pdl: bool, arch: str) -> str | None:
        """None when a loadable prebuilt library of the variant is in the cache, else why not. Memoised per
        process and cache directory (the registry asks on every call)."""
        roots = search_roots()
        if not roots:
            return f"the CuTe kernel cache is off ({CACHE_ENV_VAR}=0)"
        return _prebuilt_cached(self, variant, bool(use_pdl), arch, roots)

    def export(self, compiled, variant, use_pdl: bool, arch: str, root: str | None = None) -> str:
        """Export a compiled (``--enable-tvm-ffi``) variant into the cache; returns the library's path."""
        import tvm_ffi

        root = cache_root() if root is None else root
        if root is None:
            raise RuntimeError(f"the CuTe kernel cache is off (unset {CACHE_ENV_VAR}, or set it to 1 or a directory)")
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc/gcc) to link the exported kernel")
        d = self.entry_dir(variant, use_pdl, arch, root)
        os.makedirs(d, exist_ok=True)
        runtime_src, runtime_dir = _runtime_library()
        tvm_lib_dir = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
        meta = {**self.expected_meta(variant, use_pdl, arch), "variant_name": variant.name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                DSL_DIST: installed_version(DSL_DIST), TVM_FFI_DIST: installed_version(TVM_FFI_DIST)}
        if is_packaged(root):  # linked by soname only; the installed DSL's runtime is preloaded at load
            lib_dir, rpath = os.path.dirname(runtime_src), []
            meta.update(runtime=SHARED_RUNTIME, runtime_flavour=runtime_dir.rsplit("-", 1)[-1])
        else:
            lib_dir = os.path.join(root, "lib", runtime_dir)
            os.makedirs(lib_dir, exist_ok=True)
            runtime = os.path.join(lib_dir, RUNTIME_NAME)
            if not os.path.exists(runtime) or os.path.getsize(runtime) != os.path.getsize(runtime_src):
                _copy_atomic(runtime_src, runtime)
            rpath = [f"-Wl,-rpath,$ORIGIN/../lib/{runtime_dir}"]
            meta["runtime"] = os.path.join("..", "lib", runtime_dir, RUNTIME_NAME)
        with tempfile.TemporaryDirectory(dir=d, prefix=".tmp-") as tmp:
            obj = os.path.join(tmp, self.function_name + ".o")
            compiled.export_to_c(obj, function_name=self.function_name)
            tmp_lib = os.path.join(tmp, self.library_name)
            # -l by name: the NEEDED entries are sonames, found through RUNPATH ($ORIGIN: the directory moves
            # with the entry) and, for libtvm_ffi.so, as the copy `import tvm_ffi` already loaded
            proc = subprocess.run([cc, "-shared", "-o", tmp_lib, obj, f"-L{lib_dir}", "-lcute_dsl_runtime",
                                   f"-L{tvm_lib_dir}", "-ltvm_ffi", "-Wl,--enable-new-dtags", *rpath], check=False,
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"linking {variant.name} failed: {proc.stderr.strip()}")
            tmp_meta = os.path.join(tmp, META_NAME)
            with open(tmp_meta, "w") as f:
                json.dump(meta, f, indent=1, sort_keys=True)
            # atomic: concurrent builders of the same key never leave half a file; the library goes first, so a
            # reader never pairs a new meta.json with an old library
            os.replace(tmp_lib, os.path.join(d, self.library_name))
            os.replace(tmp_meta, os.path.join(d, META_NAME))
        _prebuilt_cached.cache_clear()
        return os.path.join(d, self.library_name)

    def export_for_build(self, compiled, variant, use_pdl: bool, arch: str) -> None:
        """What ``python -m mla_backend_plugin.compile`` does after each variant: pre-build it for serving (a GPU
        host then loads it instead of compiling; no DSL needed there). Does nothing with the cache off; a
        failure raises when the export was asked for (``--export-dir`` / CUTE_MLA_CUTE_CACHE set), else warns."""
        if cache_root() is None:
            return
        try:
            self.export(compiled, variant, use_pdl, arch)
        except Exception as e:
            if os.environ.get(envs.VARIABLES[CACHE_ENV_VAR].name, "").strip():
                raise RuntimeError(f"export to {cache_root()} failed: {e}") from e
            warnings.warn(f"{self.family}: could not export {variant.name} to {cache_root()}: {e}", RuntimeWarning,
                          stacklevel=2)

    def load_path(self, path: str):
        import tvm_ffi

        try:
            with open(os.path.join(os.path.dirname(path), META_NAME)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            meta = {}
        if meta.get("runtime") == SHARED_RUNTIME:
            _preload_runtime(meta.get("runtime_flavour", ""))
        return tvm_ffi.load_module(path)[self.function_name]

    def load(self, variant, use_pdl: bool, arch: str):
        """The variant's function from the cache or the package, or None when neither holds a usable entry."""
        path, _ = self.find(variant, use_pdl, arch)
        return None if path is None else self.load_path(path)


@functools.cache
def _prebuilt_cached(cache: AotCache, variant, use_pdl: bool, arch: str, roots: tuple[str, ...]) -> str | None:
    return cache.find(variant, use_pdl, arch, roots)[1] or None


def _installed_runtime(flavour: str) -> str | None:
    """The installed DSL's ``libcute_dsl_runtime.so`` of a flavour (cu12 / cu13), found through its distribution's
    file list: importing cutlass to ask it would cost seconds of an engine's start."""
    try:
        path = importlib.metadata.distribution(f"{DSL_DIST}-libs-{flavour}").locate_file(
            f"nvidia_cutlass_dsl/{flavour}/lib/{RUNTIME_NAME}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    return str(path) if os.path.isfile(path) else None


@functools.cache
def _preload_runtime(flavour: str) -> None:
    """Load the installed DSL's runtime globally, so a packaged library's NEEDED ``libcute_dsl_runtime.so`` (a
    soname, no RUNPATH) resolves to it."""
    import ctypes

    path = _installed_runtime(flavour)
    if path is None:
        raise RuntimeError(f"{DSL_DIST}'s {RUNTIME_NAME} ({flavour}) is not installed")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _runtime_library() -> tuple[str, str]:
    """(path of the DSL's libcute_dsl_runtime.so, its directory name inside <cache>/lib)."""
    from mla_backend_plugin.kernels.cute_common.compat import find_runtime_library

    found = find_runtime_library(RUNTIME_NAME)
    flavour = os.path.basename(os.path.dirname(os.path.dirname(found)))  # .../nvidia_cutlass_dsl/cu13/lib
    return found, f"cute-dsl-{installed_version(DSL_DIST)}-{flavour}"


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


def build_in_pool(build_one, variants, arch: str, jobs: int | None, kernel_class, one_per_class: bool = False) -> list:
    """``build_one(variant, arch, use_pdl)`` in worker processes (each compile is single-threaded and seconds
    long): a CuTe family's ``compile_variants``, whose results the compile CLI prints. Every variant with PDL on,
    what the package ships (``CUTE_MLA_PDL=0`` compiles its variant on first use: PDL on and off time alike and give
    bit-identical outputs, docs/perf/method.md); ``one_per_class``: the first variant of each ``kernel_class`` with
    PDL on and the first variant with PDL off, a check that another toolchain version compiles every class and the
    PDL-off path."""
    from concurrent.futures import ProcessPoolExecutor

    if one_per_class:
        variants = first_of_each_class(variants, kernel_class)
    builds = [(v, True) for v in variants] + ([(variants[0], False)] if one_per_class and variants else [])
    if not builds:
        return []
    with ProcessPoolExecutor(max_workers=jobs or min(len(builds), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(build_one, [v for v, _ in builds], [arch] * len(builds), [p for _, p in builds]))


def compiled_from_cache_or_jit(cache: AotCache, variant, use_pdl: bool, arch: str, compile_fn, warn):
    """The variant's function: from the cache when it holds a usable entry, else ``compile_fn()`` now and
    exported to the cache (when the cache is on). Without the DSL only the cache can serve it. A background build
    of the variant (background.py, started at the engine's model construction) is waited for first. ``warn(msg)``
    reports a cache problem that did not stop the build."""
    from mla_backend_plugin.kernels.cute_common import background
    from mla_backend_plugin.kernels.cute_common.host import dsl_missing

    background.wait(cache, variant, use_pdl, arch, warn)
    path, why = cache.find(variant, use_pdl, arch)
    if path is not None:
        try:
            t0 = time.monotonic()
            fn = cache.load_path(path)
            logger.info("mla_decode: %s: loaded %s (pdl %s, %s) from %s in %.2f s", cache.family, variant.name,
                        "on" if use_pdl else "off", arch,
                        "the package" if is_packaged(os.path.dirname(os.path.dirname(path))) else "the cache",
                        time.monotonic() - t0)
            return fn
        except Exception as e:  # noqa: BLE001 - a broken library is rebuilt when the DSL is here
            why = f"loading {path} failed: {e}"
            if dsl_missing() is None:
                warn(f"{cache.family}: ignoring the cached {variant.name}: {why}")
    missing = dsl_missing()
    if missing:
        raise RuntimeError(f"{cache.family}: cannot run {variant.name}: {missing} and no prebuilt library can be "
                           f"used: {why}; {cache.prebuild_hint(arch)}")
    t0 = time.monotonic()
    compiled = compile_fn()
    # on an engine's start-up path unless it was prebuilt: say what it cost
    logger.info("mla_decode: %s: compiled %s (pdl %s, %s) in this process in %.1f s", cache.family, variant.name,
                "on" if use_pdl else "off", arch, time.monotonic() - t0)
    if cache_root() is not None:
        try:
            path = cache.export(compiled, variant, use_pdl, arch)
        except Exception as e:  # noqa: BLE001 - the JIT result still runs
            warn(f"{cache.family}: could not cache {variant.name}: {e}")
        else:
            # the exported library, as a later process would load it: a call through the JIT's own result passes
            # a Python wrapper TVM-FFI generates (~8-10 us a call on an H200 host), the library's function none
            try:
                return cache.load_path(path)
            except Exception as e:  # noqa: BLE001 - the JIT result still runs
                warn(f"{cache.family}: could not load the just-cached {variant.name}: {e}")
    return compiled
