"""The tests' assertion over the one comparison against the float32 reference (ops/tolerances.py)."""

from __future__ import annotations

import torch

from mla_backend_plugin.ops.tolerances import compare_decode


def assert_close_decode(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                        kv_dtype, msg: str = "") -> None:
    """``compare_decode`` that raises AssertionError listing every problem."""
    result = compare_decode(out, lse, ref_out, ref_lse, kv_dtype)
    if not result.ok:
        raise AssertionError(f"{result.summary()}{f' [{msg}]' if msg else ''}")
