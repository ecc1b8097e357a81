"""The one table of tolerances against the float32 reference, and the one comparison every checker uses
(tests, the first-use self-check, the tuner's check of each candidate against the static choice, the benchmark;
testing/ re-exports it and adds ``assert_close_decode``).

bf16/fp16 caches: out within 1e-2 + 1e-2 |ref|, LSE within 1e-2. fp8 caches: out within 0.15 + 1e-2 |ref|
(vLLM's fp8 tolerance), LSE within 5e-2. Beyond the numbers: no NaN anywhere, no +inf LSE, the LSE is -inf
exactly where the reference's is (rows that see no key) and the output is exactly 0 there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    lse_atol: float


TOLERANCES = {
    "16bit": Tolerance(rtol=1e-2, atol=1e-2, lse_atol=1e-2),
    "fp8": Tolerance(rtol=1e-2, atol=0.15, lse_atol=5e-2),
}


def tolerance_for(kv_dtype) -> Tolerance:
    """By the KV cache's dtype (a torch dtype, or a name such as "bf16" / "fp8")."""
    is_fp8 = kv_dtype == FP8_DTYPE or (isinstance(kv_dtype, str) and kv_dtype.startswith("fp8"))
    return TOLERANCES["fp8" if is_fp8 else "16bit"]


@dataclasses.dataclass
class Comparison:
    out_ok: bool
    lse_ok: bool
    max_abs_err: float  # inf when out holds NaN/inf
    lse_max_abs_err: float | None  # over rows the reference gives a finite LSE; None without an LSE
    problems: list[str]

    @property
    def ok(self) -> bool:
        return self.out_ok and self.lse_ok

    def summary(self) -> str:
        return "; ".join(self.problems)


def _where(mask: torch.Tensor) -> str:
    idx = mask.nonzero()
    return f"first at (token, head{', dim' if mask.dim() > 2 else ''}) {tuple(idx[0].tolist())}" if len(idx) else ""


def compare_decode(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                   kv_dtype) -> Comparison:
    """Compare a kernel's (out, lse) with the reference's (float32) under ``tolerance_for(kv_dtype)``."""
    tol = tolerance_for(kv_dtype)
    problems: list[str] = []
    out_ok = lse_ok = True
    if tuple(out.shape) != tuple(ref_out.shape):
        return Comparison(False, False, math.inf, None, [f"out shape {tuple(out.shape)} != {tuple(ref_out.shape)}"])
    out_f = out.float()
    ref_out = ref_out.float().to(out_f.device)
    ref_lse = ref_lse.float().to(out_f.device)
    if torch.isnan(ref_out).any() or torch.isnan(ref_lse).any():
        problems.append("NaN in the reference")
    bad = ~torch.isfinite(out_f)
    if bad.any():
        out_ok = False
        problems.append(f"{int(bad.sum())} NaN/inf in out (unwritten or bad math), {_where(bad)}")
        max_err = math.inf
    else:
        diff = (out_f - ref_out).abs()
        max_err = float(diff.max()) if diff.numel() else 0.0
        over = diff > tol.atol + tol.rtol * ref_out.abs()
        if over.any():
            out_ok = False
            worst = tuple(int(i) for i in torch.unravel_index(torch.argmax(diff - tol.rtol * ref_out.abs()),
                                                             diff.shape))
            problems.append(f"out: {int(over.sum())} of {over.numel()} elements beyond atol {tol.atol} + rtol "
                            f"{tol.rtol} * |ref|; max |err| {max_err:.4g}; worst at {worst}: "
                            f"{out_f[worst].item():.5g} vs ref {ref_out[worst].item():.5g}")
    ref_dead = torch.isneginf(ref_lse)
    if ref_dead.any() and not bad.any():
        dead_out = out_f[ref_dead]
        if not (dead_out == 0).all():
            out_ok = False
            problems.append(f"rows with no visible key must be 0, max |out| there = {dead_out.abs().max().item()}")
    lse_err = None
    if lse is not None:
        if tuple(lse.shape) != tuple(ref_lse.shape) or lse.dtype != torch.float32:
            return Comparison(out_ok, False, max_err, None, problems + [
                f"lse must be float32 {tuple(ref_lse.shape)}, got {lse.dtype} {tuple(lse.shape)}"])
        lse_f = lse.float()
        if torch.isnan(lse_f).any():
            lse_ok = False
            problems.append(f"{int(torch.isnan(lse_f).sum())} NaN in lse, {_where(torch.isnan(lse_f))}")
        elif torch.isposinf(lse_f).any():
            lse_ok = False
            problems.append("+inf in lse")
        else:
            dead = torch.isneginf(lse_f)
            if not torch.equal(dead, ref_dead):
                lse_ok = False
                problems.append(f"lse is -inf at {int(dead.sum())} rows but the reference at {int(ref_dead.sum())}, "
                                f"{_where(dead != ref_dead)}")
            live = ~ref_dead & ~dead
            if live.any():
                lse_err = float((lse_f[live] - ref_lse[live]).abs().max())
                if lse_err > tol.lse_atol:
                    lse_ok = False
                    problems.append(f"lse differs from the reference by up to {lse_err:.4g} (atol {tol.lse_atol})")
    return Comparison(out_ok, lse_ok, max_err, lse_err, problems)
