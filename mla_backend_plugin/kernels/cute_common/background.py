"""CuTe-DSL variants compiled in background processes, so that an engine's start-up overlaps their compiles with
its own work (model construction and load, torch.compile, memory profiling) instead of adding them to it.

An engine knows at model construction which variants its decode steps will launch (``ops/serving.py``
``prebuild_kernels`` asks each graph size's decision); compiling them in-process on the first decode call, as
the JIT otherwise does, costs seconds each on the critical path of start-up (the DSL import, the MLIR
pipeline, ptxas), after torch.compile and before graph capture.

Parent side: ``start`` spawns ``python -m mla_backend_plugin.kernels.cute_common.background MODULE VARIANT PDL
ARCH`` unless the on-disk cache (aot.py) already holds the entry, the cache is off, the DSL is missing or a
build of that entry is running. ``wait`` (called by ``aot.compiled_from_cache_or_jit`` before it looks into
the cache) blocks until that build ends; a build that fails or overruns ``WAIT_S`` only means the variant is
compiled in-process, as without this module.

Child side: compiles for ``ARCH`` on the CPU (``CUDA_VISIBLE_DEVICES`` is empty there: the build takes no GPU
context and no GPU memory, which vLLM's memory profiling would count) and exports into the cache under a
per-entry file lock, after checking the entry again: the ranks of a tensor-parallel engine, which all start the
same builds, compile each variant once.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from mla_backend_plugin.ops.files import locked

logger = logging.getLogger("mla_backend_plugin")

WAIT_S = 600.0  # the longest a first use waits for its background build before compiling in-process itself


@dataclasses.dataclass
class Build:
    name: str  # the variant's name, for the log
    proc: subprocess.Popen
    log_path: str
    started: float


_BUILDS: dict[str, Build] = {}  # cache key -> this process's build of it


VARIANT_CLASS = "__class__"  # the variant's class name in the child's JSON (the rest: its fields)


def start(cache, variant, use_pdl: bool, arch: str) -> bool:
    """Start building ``variant`` into the on-disk cache in a child process; True when a build is (now) running
    for it. Does nothing when the cache holds a usable entry, the cache is off, or the DSL cannot compile here."""
    from mla_backend_plugin.kernels.cute_common.aot import cache_root
    from mla_backend_plugin.kernels.cute_common.host import dsl_missing

    key = cache.cache_key(variant, use_pdl, arch)
    if key in _BUILDS:
        return _BUILDS[key].proc.poll() is None
    if cache_root() is None or dsl_missing() is not None or cache.find(variant, use_pdl, arch)[0]:
        return False
    if not cache.builder_module:
        return False
    fd, log_path = tempfile.mkstemp(prefix=f"{cache.family}-build-", suffix=".log")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, cache.builder_module,
             json.dumps({VARIANT_CLASS: type(variant).__name__, **dataclasses.asdict(variant)}),
             "1" if use_pdl else "0", arch], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    _BUILDS[key] = Build(variant.name, proc, log_path, time.monotonic())
    logger.info("mla_decode: %s: building %s (pdl %s, %s) in the background (pid %d)", cache.family, variant.name,
                "on" if use_pdl else "off", arch, proc.pid)
    return True


def wait(cache, variant, use_pdl: bool, arch: str, warn) -> None:
    """Block until this process's background build of the entry (if any) ends. ``warn(msg)`` reports a failed
    or overrunning build (its variant is then compiled in-process by the caller)."""
    build = _BUILDS.pop(cache.cache_key(variant, use_pdl, arch), None)
    if build is None:
        return
    t0 = time.monotonic()
    try:
        rc = build.proc.wait(timeout=max(1.0, WAIT_S - (t0 - build.started)))
    except subprocess.TimeoutExpired:
        build.proc.kill()
        build.proc.wait()
        rc = None
    waited, took = time.monotonic() - t0, time.monotonic() - build.started
    tail = _tail(build.log_path)
    if rc == 0:
        logger.info("mla_decode: %s: %s built in the background in %.1f s (first use waited %.1f s)", cache.family,
                    build.name, took, waited)
    else:
        why = f"ran past {WAIT_S:.0f} s" if rc is None else f"exited with {rc}"
        warn(f"{cache.family}: the background build of {build.name} {why}; compiling it in this process. "
             f"Its log: {tail}")


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
        os.unlink(path)
    except OSError:
        return "(no log)"
    return text[-limit:].strip() or "(empty)"


def build_entry(module: str, variant_fields: dict, use_pdl: bool, arch: str) -> str:
    """Child side: the family's ``compile_variant`` exported into the cache, unless another process did it
    first (checked again under the entry's lock). ``variant_fields`` names the variant's class in the family's
    module (``Variant``, or cute_sm90's ``PlanVariant``, the step-plan kernel). Returns what it did."""
    family = importlib.import_module(module)
    fields = dict(variant_fields)
    variant = getattr(family, fields.pop(VARIANT_CLASS, "Variant"))(**fields)
    cache = family.AOT
    if cache.check_entry(variant, use_pdl, arch)[0]:
        return "already cached"
    entry = cache.entry_dir(variant, use_pdl, arch)
    os.makedirs(os.path.dirname(entry), exist_ok=True)
    with locked(entry + ".lock"):
        if cache.check_entry(variant, use_pdl, arch)[0]:
            return "cached by another process"
        t0 = time.monotonic()
        compiled = family.compile_variant(variant, use_pdl, arch=arch)
        cache.export(compiled, variant, use_pdl, arch)
        return f"compiled and cached in {time.monotonic() - t0:.1f} s"


def main(argv: list[str]) -> int:
    module, variant_json, pdl, arch = argv
    print(build_entry(module, json.loads(variant_json), pdl == "1", arch), flush=True)
    return 0


if __name__ == "__main__":
    # below the engine's own start-up work (torch.compile's workers above all), which is on the critical path;
    # the build has until the first decode call
    os.nice(5)
    sys.exit(main(sys.argv[1:]))
