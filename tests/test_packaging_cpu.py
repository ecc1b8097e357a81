"""A built wheel (not an editable install) carries the CUDA C++ sources the XQA kernel compiles at first use, and
no eval data (the eval model stays in the source tree); the installed package finds the sources there. CI's wheel
check (.ci/check_wheel.py) fails a wheel that holds eval data."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_wheel():
    """CI's wheel check, .ci/check_wheel.py (a script, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("check_wheel", os.path.join(ROOT, ".ci", "check_wheel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheel_ships_csrc_and_build_finds_it(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "-q", "-w", str(wheel_dir)],
                          capture_output=True, text=True)
    if proc.returncode != 0 and "Could not find a version" in proc.stderr + proc.stdout:
        pytest.skip("no package index reachable for the build backend")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = wheel_dir.glob("mla_backend_plugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for src in os.listdir(os.path.join(ROOT, "csrc", "xqa_mla")):
        assert f"mla_backend_plugin/kernels/xqa_sm120/csrc/{src}" in names
    # the checkout holds the eval model; the wheel does not
    assert os.path.exists(os.path.join(ROOT, "mla_backend_plugin", "evals", "model", "config.json"))
    assert check_wheel().eval_data(names) == []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    found = subprocess.run([sys.executable, "-c", "from mla_backend_plugin.kernels.xqa_sm120.build import source_dir;"
                            "print(source_dir())"], capture_output=True, text=True, check=True, cwd=str(tmp_path),
                           env=dict(os.environ, PYTHONPATH=str(target))).stdout.strip()
    assert found == str(target / "mla_backend_plugin" / "kernels" / "xqa_sm120" / "csrc")


def test_wheel_check_fails_a_wheel_with_eval_data(tmp_path, capsys):
    """The check CI runs on the release wheel: eval weights or any file of the eval model fail it, named."""
    check = check_wheel()
    for entry in ("mla_backend_plugin/evals/model/model.safetensors", "mla_backend_plugin/evals/model/README.md",
                  "mla_backend_plugin/weights/other.safetensors"):
        wheel = tmp_path / "mla_backend_plugin-0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("mla_backend_plugin/__init__.py", "")
            z.writestr(entry, b"weights")
        assert check.main(str(wheel), []) == 1
        out = capsys.readouterr().out
        assert "1 eval data file(s); 1 problem(s)" in out and entry in out
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mla_backend_plugin/evals/__init__.py", "")
    assert check.main(str(wheel), []) == 0
    assert "0 eval data file(s); 0 problem(s)" in capsys.readouterr().out
