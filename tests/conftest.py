"""Test configuration: tests marked ``gpu`` (declared in setup.cfg) skip cleanly without a CUDA device.

Run them with ``pytest -m gpu tests/`` on a machine with an NVIDIA GPU; CPU tests run anywhere.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
