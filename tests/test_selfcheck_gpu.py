"""The first-use self-check runs the real compiled kernels on the GPU at hand and passes (CUTE_MLA_SELF_CHECK=always
forces it on the verified architecture too), and a kernel corrupted on purpose is caught on the GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backend_plugin.ops import registry, selfcheck
from mla_backend_plugin.testing import kernel_unsupported_reason

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_results():
    selfcheck.clear_results()
    yield
    selfcheck.clear_results()


@pytest.mark.parametrize("name", [n for n in registry.KERNELS if n != "reference"])
def test_every_kernel_passes_its_self_check_here(name):
    reason = kernel_unsupported_reason(name)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    assert selfcheck.run_self_check(registry.KERNELS[name], torch.device("cuda")) is None


def test_corrupted_kernel_is_caught_on_gpu():
    triton = registry.KERNELS["triton"]

    def off_by_a_bit(args, workspace, config):
        triton.launch(args, workspace, config)
        args.out[0, 0, 0] += 1.0

    reason = selfcheck.run_self_check(dataclasses.replace(triton, launch=off_by_a_bit), torch.device("cuda"))
    assert reason is not None and "beyond atol" in reason
