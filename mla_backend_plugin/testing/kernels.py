"""Which registry kernels can run on this machine's GPU, for per-kernel tests and benchmarks."""

from __future__ import annotations

import torch

from mla_backend_plugin import envs


def kernel_unsupported_reason(name: str, device: str = "cuda") -> str | None:
    """Why registry kernel ``name`` cannot run on this machine's GPU (arch, toolchain), from a representative
    bf16 call; None when it can."""
    from mla_backend_plugin.ops import prepare_args, registry

    if not torch.cuda.is_available():
        return "no GPU"
    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    args = prepare_args(q, kv, bt, torch.ones(1, dtype=torch.int32, device=device), softmax_scale=0.1)
    return registry.KERNELS[name].unsupported_reason(args, registry.device_capability(q.device))


def select_kernel_for_test(name: str, namespace: dict, monkeypatch, device: str = "cuda") -> str:
    """Body of a per-kernel parametrized pytest fixture: skip when ``name`` cannot run here (or is filtered out
    by ``MLA_TEST_KERNELS=a,b``), else make it the test module's ``KERNEL`` for this test."""
    import pytest

    wanted = envs.MLA_TEST_KERNELS
    reason = f"MLA_TEST_KERNELS={wanted}" if wanted and name not in wanted.split(",") else \
        kernel_unsupported_reason(name, device)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    monkeypatch.setitem(namespace, "KERNEL", name)
    return name


def poison_runner_outputs(monkeypatch) -> None:
    """NaN in every output buffer the serving decode runner hands its launches (the workspace's views and the fresh
    tensors past them), for the rest of a test: an element no launch writes then fails the comparison."""
    from mla_backend_plugin.ops.serving import DecodeRunner

    real = DecodeRunner._outputs

    def poisoned(workspace, num_tokens, q):
        out, lse = real(workspace, num_tokens, q)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        return out, lse

    monkeypatch.setattr(DecodeRunner, "_outputs", staticmethod(poisoned))
