"""CuTe-DSL kernels shipped prebuilt inside the package (issue 17: an engine's first start compiles nothing).

``python -m mla_backend_plugin.compile --arch ARCH --into-package`` exports the variants into
``mla_backend_plugin/kernels/prebuilt``; a wheel built afterwards carries them; a lookup tries the user's cache,
then the package. Here the package folder is pointed at a temporary one (a test never writes into the source
tree), one variant is compiled for sm_90a on the CPU, and a fresh process with an empty user cache loads it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from mla_backend_plugin import compile as compile_cli
from mla_backend_plugin.kernels.cute_common import aot
from mla_backend_plugin.kernels.cute_sm90 import config
from mla_backend_plugin.kernels.cute_sm90.launch import AOT

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))
dsl_only = pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
VARIANT = config.Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    """The package's prebuilt folder (a temporary stand-in) after `compile --arch sm_90a --kernels cute_sm90
    --into-package`, cut down to one variant (PDL on: what ships)."""
    if not HAS_DSL:
        pytest.skip("nvidia-cutlass-dsl / apache-tvm-ffi not installed")
    from mla_backend_plugin.kernels.cute_sm90 import build

    root = tmp_path_factory.mktemp("package") / "prebuilt"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "PACKAGED_ROOT", str(root))
        mp.setenv(aot.CACHE_ENV_VAR, "restored-after-the-build")  # --into-package sets it for the build
        mp.setattr(build, "serving_variants", lambda: [VARIANT])
        rc = compile_cli.main(["--arch", "sm_90a", "--kernels", "cute_sm90", "--into-package"])
    assert rc == 0
    return root


def test_a_lookup_tries_the_user_cache_then_the_package(monkeypatch, tmp_path):
    package = tmp_path / "prebuilt"
    monkeypatch.setattr(aot, "PACKAGED_ROOT", str(package))
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path / "user"))
    monkeypatch.setenv("CUTE_MLA_PACKAGED_KERNELS", "1")
    assert aot.search_roots() == (str(tmp_path / "user"),)  # a source checkout: no prebuilt folder
    package.mkdir()
    assert aot.search_roots() == (str(tmp_path / "user"), str(package))
    monkeypatch.setenv("CUTE_MLA_PACKAGED_KERNELS", "0")
    assert aot.search_roots() == (str(tmp_path / "user"),)
    monkeypatch.setenv(aot.CACHE_ENV_VAR, "0")  # the cache off: nothing is loaded, everything compiles
    monkeypatch.setenv("CUTE_MLA_PACKAGED_KERNELS", "1")
    assert aot.search_roots() == ()
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(package))  # exporting into the package: one root
    assert aot.search_roots() == (str(package),)


def test_into_package_and_export_dir_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        compile_cli.main(["--arch", "sm_90a", "--into-package", "--export-dir", "x"])
    assert e.value.code == 2 and "--into-package and --export-dir" in capsys.readouterr().err


@dsl_only
def test_into_package_writes_entries_that_borrow_the_installed_runtime(packaged):
    # PDL on only: CUTE_MLA_PDL=0 compiles its variant on first use (or, without the DSL, runs another kernel)
    assert not os.path.exists(AOT.entry_dir(VARIANT, False, "sm_90a", str(packaged)))
    entry = AOT.entry_dir(VARIANT, True, "sm_90a", str(packaged))
    with open(os.path.join(entry, aot.META_NAME)) as f:
        meta = json.load(f)
    assert meta["runtime"] == aot.SHARED_RUNTIME and meta["runtime_flavour"] in ("cu12", "cu13")
    assert meta[aot.DSL_DIST] == aot.installed_version(aot.DSL_DIST)
    assert not (packaged / "lib").exists()  # no 43 MB copy of the DSL runtime in a wheel
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", os.path.join(entry, AOT.library_name)], check=True,
                             capture_output=True, text=True).stdout
        assert "[libcute_dsl_runtime.so]" in dyn and "RUNPATH" not in dyn and "site-packages" not in dyn


_LOAD = textwrap.dedent("""
    import json, os, sys
    from mla_backend_plugin.kernels.cute_common import aot
    from mla_backend_plugin.kernels.cute_sm90 import config, launch

    aot.PACKAGED_ROOT = sys.argv[2]
    v = config.Variant(*json.loads(sys.argv[1]))

    def no_compile(*a, **k):
        raise AssertionError("compiled although the package ships the variant")

    launch.compile_variant = no_compile
    out = dict(reason=launch.AOT.prebuilt_reason(v, True, "sm_90a"))
    fn = launch._compiled(v, True)
    out["fn"] = type(fn).__module__ + "." + type(fn).__name__
    out["cutlass_imported"] = "cutlass" in sys.modules
    out["runtime"] = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcute_dsl_runtime" in l})
    out["user_cache"] = sorted(os.listdir(os.environ["CUTE_MLA_CUTE_CACHE"]))
    os.environ["CUTE_MLA_PACKAGED_KERNELS"] = "0"
    aot._prebuilt_cached.cache_clear()
    out["ignored"] = launch.AOT.prebuilt_reason(v, True, "sm_90a")
    print("RESULT " + json.dumps(out))
""")


@dsl_only
def test_an_empty_user_cache_loads_the_packaged_kernel_without_compiling(packaged, tmp_path):
    """A fresh process (an engine's first start): nothing in the user's cache, the variant in the package. It
    loads without compiling and without importing the DSL (seconds of a start), with the installed DSL's
    runtime library; ignoring the package sends it back to the compiler."""
    user = tmp_path / "user-cache"
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUTE_MLA_PDL")}
    env.update({aot.CACHE_ENV_VAR: str(user), "CUTE_MLA_PACKAGED_KERNELS": "1"})
    proc = subprocess.run([sys.executable, "-c", _LOAD, json.dumps(dataclasses.astuple(VARIANT)), str(packaged)],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["reason"] is None and out["fn"] == "tvm_ffi.core.Function"
    assert not out["cutlass_imported"]
    assert out["runtime"] and all("nvidia_cutlass_dsl" in p for p in out["runtime"]), out["runtime"]
    assert out["user_cache"] == []  # loaded from the package, nothing copied or rebuilt
    assert out["ignored"] and "not prebuilt" in out["ignored"]


@dsl_only
def test_packaged_entry_of_another_dsl_release_is_passed_over(packaged, tmp_path, monkeypatch):
    """The version check holds for packaged entries too: built by another DSL, the variant is compiled."""
    package = tmp_path / "prebuilt"
    shutil.copytree(packaged, package)
    meta_path = os.path.join(AOT.entry_dir(VARIANT, True, "sm_90a", str(package)), aot.META_NAME)
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, aot.DSL_DIST: "4.0.0"}, f)
    monkeypatch.setattr(aot, "PACKAGED_ROOT", str(package))
    monkeypatch.setenv(aot.CACHE_ENV_VAR, str(tmp_path / "user"))
    monkeypatch.setenv("CUTE_MLA_PACKAGED_KERNELS", "1")
    path, why = AOT.find(VARIANT, True, "sm_90a")
    assert path is None and "package: stale" in why and "4.0.0" in why


def test_a_wheel_carries_the_packaged_kernels(tmp_path):
    """setup.cfg's package data and setup.py's tag: a wheel built from a tree whose prebuilt folder holds an entry
    ships it and is tagged for the platform; the eval model in that tree stays out of it."""
    tree = tmp_path / "src"
    shutil.copytree(REPO / "mla_backend_plugin", tree / "mla_backend_plugin",
                    ignore=shutil.ignore_patterns("__pycache__", "prebuilt"))
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(REPO / name, tree / name)
    entry = tree / "mla_backend_plugin" / "kernels" / "prebuilt" / "cute_sm90-0123456789abcdef01234567"
    entry.mkdir(parents=True)
    (entry / AOT.library_name).write_bytes(b"\x7fELF stand-in")
    (entry / aot.META_NAME).write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(tree)], check=False, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith("mla_backend_plugin-") and "-py3-none-" in wheel.name
    assert not wheel.name.endswith("-any.whl"), wheel.name  # it holds x86-64 libraries: a platform wheel
    names = zipfile.ZipFile(wheel).namelist()
    prefix = "mla_backend_plugin/kernels/prebuilt/cute_sm90-0123456789abcdef01234567/"
    assert prefix + AOT.library_name in names and prefix + aot.META_NAME in names
    assert (tree / "mla_backend_plugin" / "evals" / "model" / "model.safetensors").exists()
    assert not [n for n in names if n.startswith("mla_backend_plugin/evals/model/")]
