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


def decode_and_check(inp, ws, dtype, msg, kernel="cute_sm90", scales=(False, False), **call):
    """One mla_decode of ``inp`` into NaN-poisoned outputs, checked against the float32 reference."""
    from mla_backend_plugin.ops import mla_decode

    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel=kernel, workspace=ws,
               **call, **inp.scale_kwargs(scales))
    if out.is_cuda:
        torch.cuda.synchronize()
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, dtype, msg=msg)


def q_form_for(design: str, q_form: str) -> str:
    """Design C takes an fp8 q only: it runs each case with the q quantised to e4m3 (``"fp8"``)."""
    return "fp8" if design == "fp8seesaw" else q_form


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-S{c[1]}-q{c[2]}-h{c[3]}-bs{c[4]}-{c[5]}")
def test_fp8_designs_match_reference(design, case):
    from mla_backend_plugin.ops import MLAWorkspace

    B, S, ql, H, bs, q_form, q_scale, kv_scale, kv_t = case
    lens = draw_seq_lens(B, S, block_size=bs, seed=B * 7 + ql)  # one length exactly S, one odd
    q_form = q_form_for(design, q_form)
    inp = make_decode_inputs(B, lens, ql, H, bs, FP8, q_form, "cuda", 11 + B, q_scale=q_scale, kv_scale=kv_scale)
    ws = MLAWorkspace("cuda", max_batch=B, max_q_len=ql, num_heads=H)
    decode_and_check(inp, ws, FP8, f"{design} {case} lens={lens}", scales=(False, kv_t), fp8_design=design)


def test_fp8_designs_short_and_ragged_lengths(design):
    """Lengths below, at and just past one 64-key tile, and below q_len (rows that see no key)."""
    from mla_backend_plugin.ops import MLAWorkspace

    lens = [1, 63, 64, 65, 130]
    inp = make_decode_inputs(len(lens), lens, 2, 128, 64, FP8, q_form_for(design, "pair"), "cuda", 5, kv_scale=0.5)
    ws = MLAWorkspace("cuda", max_batch=len(lens), max_q_len=2, num_heads=128)
    decode_and_check(inp, ws, FP8, f"{design} lens={lens}", fp8_design=design)


@pytest.mark.parametrize("which", ["q_scale", "kv_scale"])
def test_design_c_gives_nan_rows_for_a_scale_tensor_not_positive(which):
    """Design C takes each row's max from the raw S (kernel_fp8seesaw.tile_row_max), which holds for a positive
    scale only; a scale tensor <= 0 (read on the device, so the API cannot refuse it as it refuses such a float)
    gives NaN rows, never a finite wrong answer; the same inputs with the scale positive match the reference."""
    from mla_backend_plugin.ops import MLAWorkspace, mla_decode

    if kernel_unsupported_reason("cute_sm90") is not None:
        pytest.skip(kernel_unsupported_reason("cute_sm90"))
    lens = [700, 1500]
    inp = make_decode_inputs(len(lens), lens, 1, 128, 64, FP8, "fp8", "cuda", 21, q_scale=0.5, kv_scale=2.0)
    ws = MLAWorkspace("cuda", max_batch=len(lens), max_q_len=1, num_heads=128)
    decode_and_check(inp, ws, FP8, "design C, positive scales", scales=(True, True), fp8_design="fp8seesaw")
    for bad in (0.0, -2.0):
        scales = inp.scale_kwargs(True)
        scales[which] = torch.tensor([bad], dtype=torch.float32, device="cuda")
        out, lse = inp.poisoned_outputs()
        out.zero_()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel="cute_sm90",
                   workspace=ws, fp8_design="fp8seesaw", **scales)
        torch.cuda.synchronize()
        assert out.float().isnan().all(), f"{which}={bad}: {out.float().isnan().float().mean().item():.3f} NaN"


@pytest.mark.parametrize("heads,lens_around,bs", [(128, 3000, 64), (16, 1500, 32)])
def test_auto_runs_design_c_from_its_min_batch_eager_and_in_graphs(heads, lens_around, bs, monkeypatch):
    """The serving default: ``auto`` with an fp8 q runs design C from launch.FP8_SEESAW_MIN_BATCH. Ragged lengths
    (one not a multiple of the page), NaN/inf in every unread slot, the kv scale as a device tensor, outputs
    poisoned; then the same call in a CUDA graph replayed with new lengths and tables."""
    reason = kernel_unsupported_reason("cute_sm90")
    if reason is not None:
        pytest.skip(f"cute_sm90: {reason}")
    from mla_backend_plugin.kernels.cute_sm90 import launch
    from mla_backend_plugin.ops import MLAWorkspace, mla_decode
    from mla_backend_plugin.testing import capture_graph, replay_with

    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "auto")
    chosen = []
    real = launch.fp8_design_for
    monkeypatch.setattr(launch, "fp8_design_for", lambda args: chosen.append(real(args)) or chosen[-1])
    B = launch.FP8_SEESAW_MIN_BATCH
    lens = draw_seq_lens(B, lens_around, block_size=bs, seed=heads)
    max_blocks = -(-max(lens) * 2 // bs)
    sizes = dict(num_blocks=B * max_blocks, max_blocks=max_blocks)
    inp = make_decode_inputs(B, lens, 1, heads, bs, FP8, "fp8", "cuda", 31, kv_scale=1.75, **sizes)
    ws = MLAWorkspace("cuda", max_batch=B, max_q_len=1, num_heads=heads)
    scales = inp.scale_kwargs((False, True))  # the kv scale a device tensor, as vLLM hands it
    out, lse = inp.poisoned_outputs()
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel="cute_sm90",
               workspace=ws, **scales)
    torch.cuda.synchronize()
    assert chosen and set(chosen) == {"fp8seesaw"}, chosen
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, FP8, msg=f"auto B={B} h{heads} lens={lens}")

    out, lse = inp.poisoned_outputs()
    graph = capture_graph(lambda _: mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse,
                                               kernel="cute_sm90", workspace=ws, **scales))
    new_lens = draw_seq_lens(B, lens_around * 2, block_size=bs, seed=heads + 1, max_len=max_blocks * bs)
    new = make_decode_inputs(B, new_lens, 1, heads, bs, FP8, "fp8", "cuda", 32, kv_scale=1.75, **sizes)
    replay_with(graph, inp, new, out, lse)
    ref_out, ref_lse = new.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, FP8, msg=f"auto graph replay B={B} h{heads} lens={new_lens}")


@pytest.mark.parametrize("kv,slack", [("fp8", 0.0), ("fp8", 2.8), ("fp8", 8.0), ("bf16", 8.0)])
def test_seesaw_max_slack_matches_reference(kv, slack, monkeypatch):
    """The running max's slack (config.MAX_SLACK; design C's default is FP8_SEESAW_MAX_SLACK, run by every design C
    case above): a row's max moves only when a tile's exceeds it by more than ``slack``, so P reaches 2^slack
    (design C: e4m3(P x p_scale_for(slack))). Long ragged rows (many tiles past the first max, so most keep the
    old max), 128 heads at q_len 2, NaN in every unread slot, outputs poisoned; design C and the 16-bit seesaw.
    Fails too if the launched binary is not the asked slack's."""
    reason = kernel_unsupported_reason("cute_sm90")
    if reason is not None:
        pytest.skip(f"cute_sm90: {reason}")
    from mla_backend_plugin.kernels.cute_sm90 import launch
    from mla_backend_plugin.ops import MLAWorkspace
    from mla_backend_plugin.ops.manifest import LaunchConfig

    launched = []
    compiled = launch._compiled
    monkeypatch.setattr(launch, "_compiled", lambda variant, pdl: launched.append(getattr(variant, "max_slack", None))
                        or compiled(variant, pdl))
    dtype = FP8 if kv == "fp8" else torch.bfloat16
    lens = draw_seq_lens(3, 5000, block_size=64, seed=int(slack * 10))
    inp = make_decode_inputs(3, lens, 2, 128, 64, dtype, "fp8" if kv == "fp8" else "pair", "cuda", 17,
                             kv_scale=1.5 if kv == "fp8" else None)
    ws = MLAWorkspace("cuda", max_batch=3, max_q_len=2, num_heads=128)
    config = LaunchConfig(fp8_design="fp8seesaw" if kv == "fp8" else None, max_slack=slack)
    decode_and_check(inp, ws, dtype, f"{kv} slack {slack} lens={lens}", config=config)
    assert slack in launched, (slack, launched)
