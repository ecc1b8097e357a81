"""Test configuration: without a CUDA device, tests marked ``gpu`` (declared in setup.cfg) are deselected at
collection (one summary line says how many), so a CPU run neither schedules nor reports them one by one.

Run them with ``pytest -m gpu tests/`` on a machine with an NVIDIA GPU; CPU tests run anywhere.
"""

from __future__ import annotations

import pytest
import torch

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
GPU_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)
    config.stash[GPU_DESELECTED] = len(gpu)
    if hasattr(config, "workeroutput"):  # a pytest-xdist worker: tell the controller, which collects nothing
        config.workeroutput["gpu_deselected"] = len(gpu)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # pytest-xdist's controller, as each worker finishes
    if "gpu_deselected" in getattr(node, "workeroutput", {}):
        node.config.stash[GPU_DESELECTED] = node.workeroutput["gpu_deselected"]


def pytest_sessionfinish(session, exitstatus):
    """A run of GPU tests alone on a machine without one ends as cleanly as when they skipped: status 0, not
    pytest's 5 (no tests collected)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.stash.get(GPU_DESELECTED, 0):
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.stash.get(GPU_DESELECTED, 0):
        terminalreporter.write_line(f"{config.stash[GPU_DESELECTED]} tests marked gpu deselected: {NO_GPU}; "
                                    "run them with pytest -m gpu on a GPU host")


@pytest.fixture(autouse=True)
def _no_packaged_kernels(request):
    """CPU tests see only the caches they set up: kernels a wheel shipped in the package (or a developer exported
    into the checkout) would otherwise answer lookups that a test expects to miss. GPU tests keep them: there
    they are what a user's engine loads. (Its own MonkeyPatch: taking the test's `monkeypatch` here would set it
    up first and so undo it last, after the test's other fixtures have torn down.)"""
    if "gpu" in request.keywords:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUTE_MLA_PACKAGED_KERNELS", "0")
        yield
