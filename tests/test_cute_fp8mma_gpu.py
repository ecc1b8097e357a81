"""GPU tests of the designs of cute_sm90's fp8-cache path against the float32 reference, with the project's
fp8 tolerance, through ``mla_decode(kernel="cute_sm90", fp8_design=...)``: design B (kernels/cute_sm90/
kernel_fp8mma.py, the default: fp8 wgmma for Q K^T and P V), design A (``"dequant"``: the cache widened to
bf16 in shared memory) and design C (``"fp8seesaw"``, kernel_fp8seesaw.py: fp8 q only, so every case runs
with an fp8 q for it). tests/test_ops_gpu.py runs the default design over the whole grid."""

from __future__ import annotations

import pytest
import torch

from mla_backend_plugin.testing import (
    assert_close_decode,
    draw_seq_lens,
    kernel_unsupported_reason,
    make_decode_inputs,
)

FP8 = torch.float8_e4m3fn
pytestmark = pytest.mark.gpu


@pytest.fixture(params=["fp8mma", "dequant", "fp8seesaw"])
def design(request):
    reason = kernel_unsupported_reason("cute_sm90")
    if reason is not None:
        pytest.skip(f"cute_sm90: {reason}")
    return request.param


# (batch, around, q_len, heads, block_size, q form, q_scale, kv_scale, kv_scale as a device tensor)
CASES = [
    (3, 700, 2, 128, 64, "pair", None, 3.0, False),
    (3, 300, 1, 128, 16, "pair", None, None, False),
    (3, 1000, 4, 16, 32, "fp8", 2.0, 3.0, False),
    (1, 8192, 1, 128, 64, "pair", None, None, False),
    (4, 1000, 1, 128, 64, "pair", None, 2.0, True),
    (5, 2000, 2, 64, 128, "fp8", None, 1.5, True),
    (2, 3000, 1, 32, 64, "fp8", 0.5, None, False),
]


def q_form_for(design: str, q_form: str) -> str:
    """Design C takes an fp8 q only: it runs each case with the q quantised to e4m3 (``"fp8"``)."""
    return "fp8" if design == "fp8seesaw" else q_form


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-S{c[1]}-q{c[2]}-h{c[3]}-bs{c[4]}-{c[5]}")
def test_fp8_designs_match_reference(design, case):
    from mla_backend_plugin.ops import MLAWorkspace, mla_decode

    B, S, ql, H, bs, q_form, q_scale, kv_scale, kv_t = case
    lens = draw_seq_lens(B, S, block_size=bs, seed=B * 7 + ql)  # one length exactly S, one odd
    q_form = q_form_for(design, q_form)
    inp = make_decode_inputs(B, lens, ql, H, bs, FP8, q_form, "cuda", 11 + B, q_scale=q_scale, kv_scale=kv_scale)
    ws = MLAWorkspace("cuda", max_batch=B, max_q_len=ql, num_heads=H)
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel="cute_sm90",
               workspace=ws, fp8_design=design, **inp.scale_kwargs((False, kv_t)))
    torch.cuda.synchronize()
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, FP8, msg=f"{design} {case} lens={lens}")


def test_fp8_designs_short_and_ragged_lengths(design):
    """Lengths below, at and just past one 64-key tile, and below q_len (rows that see no key)."""
    from mla_backend_plugin.ops import MLAWorkspace, mla_decode

    lens = [1, 63, 64, 65, 130]
    inp = make_decode_inputs(len(lens), lens, 2, 128, 64, FP8, q_form_for(design, "pair"), "cuda", 5, kv_scale=0.5)
    ws = MLAWorkspace("cuda", max_batch=len(lens), max_q_len=2, num_heads=128)
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel="cute_sm90",
               workspace=ws, fp8_design=design, **inp.scale_kwargs(False))
    torch.cuda.synchronize()
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, FP8, msg=f"{design} lens={lens}")
