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
