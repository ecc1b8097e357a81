"""CPU tests of the kernel API (run in CI, no GPU needed).

(a) the float32 torch reference against an independent, naive float64 per-row loop;
(b) every input validation error of ``prepare_args`` / ``mla_decode`` (message names the argument and what
    is allowed), and ``mla_decode(kernel="reference")`` end to end on CPU;
(c) the split planner and ``MLAWorkspace`` sizing.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.kernels.triton_decode.config import rows_per_cta_for
from mla_backend_plugin.ops import (
    KERNELS,
    MLAWorkspace,
    available_kernels,
    mla_decode,
    plan_splits,
    prepare_args,
)
from mla_backend_plugin.ops.constants import (
    FP8_DTYPE,
    KV_LORA_RANK,
    QK_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_NUM_HEADS,
    SUPPORTED_Q_LENS,
    WORK_ITEM_INTS,
)
from mla_backend_plugin.ops.plan import MAX_SPLITS, TARGET_CTAS_PER_SM
from mla_backend_plugin.testing import (
    POISON_16BIT,
    SOFTMAX_SCALE,
    assert_close_decode,
    compare_decode,
    draw_seq_lens,
    make_decode_inputs,
)

BF16, FP16, FP8 = torch.bfloat16, torch.float16, FP8_DTYPE

KERNEL_ENV_VAR = "CUTE_MLA_KERNEL"


# --------------------------------------------------------------------------------------------------------
# (a) reference vs a naive float64 loop
# --------------------------------------------------------------------------------------------------------


def _scalar(scale) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return float(scale.reshape(()).item())
    return float(scale)


def naive_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, q_len, softmax_scale, q_scale=None,
                 kv_scale=None):
    """Independent float64 implementation: one query row at a time, keys gathered one position at a time."""
    qs, ks = _scalar(q_scale), _scalar(kv_scale)
    num_tokens, num_heads, _ = q_nope.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, KV_LORA_RANK, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    for b in range(block_table.shape[0]):
        seq_len = int(seq_lens[b])
        for t in range(q_len):
            row = b * q_len + t
            n_visible = seq_len - q_len + t + 1  # causal inside the q block
            if n_visible <= 0:
                continue
            keys = []
            for pos in range(n_visible):
                page = int(block_table[b, pos // block_size])
                keys.append(kv_cache[page, pos % block_size].to(torch.float64) * ks)
            k = torch.stack(keys)  # [n_visible, 576]
            v = k[:, :KV_LORA_RANK]
            for h in range(num_heads):
                qv = torch.cat([q_nope[row, h].to(torch.float64), q_pe[row, h].to(torch.float64)]) * qs
                logits = (k @ qv) * softmax_scale
                m = logits.max()
                e = torch.exp(logits - m)
                denom = e.sum()
                out[row, h] = (e[:, None] * v).sum(0) / denom
                lse[row, h] = m + torch.log(denom)
    return out, lse


def _compare_to_naive(inp, q_scale, kv_scale):
    ref_out, ref_lse = mla_decode_reference(inp.q_nope, inp.q_pe, inp.kv_cache, inp.block_table, inp.seq_lens,
                                            inp.q_len, inp.softmax_scale, q_scale, kv_scale)
    assert ref_out.dtype == torch.float32 and ref_lse.dtype == torch.float32
    nv_out, nv_lse = naive_decode(inp.q_nope, inp.q_pe, inp.kv_cache, inp.block_table, inp.seq_lens, inp.q_len,
                                  inp.softmax_scale, q_scale, kv_scale)
    dead = torch.isneginf(nv_lse)
    assert torch.equal(torch.isneginf(ref_lse), dead)
    assert (ref_out[dead] == 0).all()
    torch.testing.assert_close(ref_out.double(), nv_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref_lse.double()[~dead], nv_lse[~dead], rtol=1e-5, atol=1e-5)
    return nv_out, nv_lse


# Ragged lengths: padded (0), shorter than q_len, exactly one page, page boundaries +-1, several pages.
_RAGGED = [0, 1, 2, 3, 16, 17, 31, 45]


@pytest.mark.parametrize("q_len", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_dtype,q_form", [(BF16, "pair"), (FP16, "cat"), (FP8, "pair"), (FP8, "fp8")])
def test_reference_matches_naive(q_len, kv_dtype, q_form):
    seed = 100 * q_len + 7
    inp = make_decode_inputs(len(_RAGGED), _RAGGED, q_len, 16, 16, kv_dtype, q_form, "cpu", seed,
                             q_scale=2.0 if q_form == "fp8" else None,
                             kv_scale=3.0 if kv_dtype == FP8 else None)
    _compare_to_naive(inp, inp.q_scale, inp.kv_scale)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
@pytest.mark.parametrize("q_scale,kv_scale", [(1.0, 1.0), (2.0, 3.0), (0.5, 0.25)])
def test_reference_fp8_scales(q_scale, kv_scale, as_tensor):
    inp = make_decode_inputs(3, [5, 40, 2], 3, 16, 32, FP8, "fp8", "cpu", 11, q_scale=q_scale, kv_scale=kv_scale)
    s = inp.scale_kwargs(as_tensor)
    if as_tensor:
        assert isinstance(s["q_scale"], torch.Tensor) and isinstance(s["kv_scale"], torch.Tensor)
    _compare_to_naive(inp, s["q_scale"], s["kv_scale"])


def test_reference_scales_are_applied():
    """Scaling the fp8 cache by 2 scales v (out) by 2 and the logits by 2: check against the naive loop
    with explicit numbers so a reference that ignored a scale could not agree with itself."""
    inp = make_decode_inputs(2, [9, 33], 1, 16, 16, FP8, "fp8", "cpu", 5, q_scale=1.0, kv_scale=1.0)
    o1, l1 = mla_decode_reference(inp.q_nope, inp.q_pe, inp.kv_cache, inp.block_table, inp.seq_lens, 1,
                                  inp.softmax_scale, 1.0, 1.0)
    o2, l2 = mla_decode_reference(inp.q_nope, inp.q_pe, inp.kv_cache, inp.block_table, inp.seq_lens, 1,
                                  inp.softmax_scale / 6.0, 2.0, 3.0)
    # q*2 . k*3 * scale/6 == q . k * scale: same softmax, v scaled by 3
    torch.testing.assert_close(o2, o1 * 3.0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", SUPPORTED_BLOCK_SIZES)
def test_reference_block_sizes_and_4d_cache(block_size):
    lens = [1, block_size, block_size + 1, 2 * block_size + 3]
    inp = make_decode_inputs(4, lens, 2, 16, block_size, BF16, "pair", "cpu", block_size)
    _compare_to_naive(inp, None, None)


def test_reference_causal_rows():
    """Row t of a request sees seq_len - q_len + t + 1 keys: with seq_len == q_len, row 0 sees exactly one
    key, so its output is that key's value; a request with seq_len < q_len has dead leading rows."""
    q_len = 4
    inp = make_decode_inputs(2, [4, 2], q_len, 16, 16, BF16, "cat", "cpu", 3)
    out, lse = inp.reference()
    page0 = int(inp.block_table[0, 0])
    torch.testing.assert_close(out[0], inp.kv_cache[page0, 0, :KV_LORA_RANK].float().expand(16, -1))
    assert torch.isneginf(lse[q_len:q_len + 2]).all() and (out[q_len:q_len + 2] == 0).all()
    assert torch.isfinite(lse[q_len + 2:]).all()


# --------------------------------------------------------------------------------------------------------
# test helpers themselves
# --------------------------------------------------------------------------------------------------------


def test_make_decode_inputs_is_adversarial():
    lens = [0, 3, 40, 100]
    bs = 16
    inp = make_decode_inputs(4, lens, 2, 32, bs, BF16, "pair", "cpu", 9)
    q_nope, q_pe = inp.q
    assert q_nope.shape == (8, 32, 512) and q_pe.shape == (8, 32, 64)
    assert not q_pe.is_contiguous() and q_pe.stride(-1) == 1
    bt = inp.block_table
    assert bt.dtype == torch.int32 and inp.seq_lens.dtype == torch.int32
    pages = [-(-n // bs) for n in lens]
    owned = torch.cat([bt[b, :n] for b, n in enumerate(pages)])
    assert owned.unique().numel() == owned.numel(), "pages must not be shared"
    assert not torch.equal(owned.sort().values, owned), "pages should be permuted"
    spare = sorted(set(range(inp.kv_cache.shape[0])) - set(owned.tolist()))
    assert spare, "there must be spare pages"
    for b, n in enumerate(pages):  # garbage past each request's pages points at spare pages
        assert set(bt[b, n:].tolist()) <= set(spare)
    # spare pages and page tails are poisoned (NaN by default); owned slots hold ~N(0, 1) values
    assert torch.isnan(inp.kv_cache[spare].float()).all()
    last = int(bt[1, 0])
    assert torch.isnan(inp.kv_cache[last, 3:].float()).all()
    owned_slots = inp.kv_cache[last, :3].float()
    assert owned_slots.abs().max() < 10 and owned_slots.std() > 0.5
    for poison, check in (("finite", lambda x: (x.abs() == POISON_16BIT).all()),
                          ("inf", lambda x: torch.isinf(x).all() and (x > 0).any() and (x < 0).any())):
        other = make_decode_inputs(4, lens, 2, 32, bs, BF16, "pair", "cpu", 9, poison=poison)
        assert check(other.kv_cache[int(other.block_table[1, 0]), 3:].float()), poison
        assert torch.equal(other.block_table, bt)  # the same layout, only the poison differs
    fp8 = make_decode_inputs(4, lens, 2, 32, bs, FP8, "pair", "cpu", 9, poison="inf")  # e4m3fn: no inf, NaN
    assert torch.isnan(fp8.kv_cache[int(fp8.block_table[1, 0]), 3:].float()).all()


def test_make_decode_inputs_fp8_ranges():
    inp = make_decode_inputs(2, [50, 70], 1, 16, 16, FP8, "fp8", "cpu", 4, q_scale=2.0, kv_scale=3.0)
    assert inp.q.dtype == FP8 and inp.kv_cache.dtype == FP8 and inp.out_dtype == BF16
    k = inp.kv_cache[inp.block_table[0, 0].long(), :16].float() * 3.0
    q = inp.q.float() * 2.0
    for x in (k, q):
        assert 0.7 < x.std().item() < 1.3, "dequantised values should be ~N(0, 1)"
        assert (x != 0).float().mean() > 0.9


def test_draw_seq_lens():
    for batch, around, bs in [(3, 17, 16), (32, 4096, 64), (129, 1000, 32), (129, 33000, 16)]:
        lens = draw_seq_lens(batch, around, block_size=bs, seed=1, max_total_tokens=1_300_000)
        assert len(lens) == batch and min(lens) >= 1
        assert around in lens
        assert any(n % bs and n % 32 for n in lens)
        assert sum(lens) <= 1_300_000
    assert draw_seq_lens(1, 4096, block_size=64, seed=0) == [4096]
    assert max(draw_seq_lens(8, 5000, block_size=64, seed=0, max_len=4096)) <= 4096


def test_assert_close_decode_catches_errors():
    inp = make_decode_inputs(2, [1, 20], 2, 16, 16, BF16, "pair", "cpu", 2)
    ref_out, ref_lse = inp.reference()
    assert torch.isneginf(ref_lse).any()
    assert_close_decode(ref_out.bfloat16(), ref_lse.clone(), ref_out, ref_lse, BF16)
    bad = ref_out.clone()
    bad[-1, 0, 0] = math.nan
    with pytest.raises(AssertionError, match="NaN/inf in out"):
        assert_close_decode(bad, ref_lse, ref_out, ref_lse, BF16)
    bad_lse = ref_lse.clone()
    bad_lse[0, 0] = 0.0
    with pytest.raises(AssertionError, match="-inf"):
        assert_close_decode(ref_out, bad_lse, ref_out, ref_lse, BF16)
    bad_lse = ref_lse.clone()
    bad_lse[-1, 3] += 0.03
    with pytest.raises(AssertionError, match="lse differs from the reference by up to 0.03"):
        assert_close_decode(ref_out, bad_lse, ref_out, ref_lse, BF16)
    assert_close_decode(ref_out, bad_lse, ref_out, ref_lse, FP8)  # fp8: lse atol 5e-2
    bad = ref_out.clone()
    bad[-1, 0, 0] += 0.1
    with pytest.raises(AssertionError, match=r"out: 1 of \d+ elements beyond atol 0.01"):
        assert_close_decode(bad, ref_lse, ref_out, ref_lse, BF16)
    dead_row = ref_out.clone()
    dead_row[torch.isneginf(ref_lse)] = 1e-3  # within atol, but a row that sees no key must be exactly 0
    with pytest.raises(AssertionError, match="rows with no visible key must be 0"):
        assert_close_decode(dead_row, ref_lse, ref_out, ref_lse, BF16)
    # the benchmark's reading: a wrong LSE alone leaves the output usable
    result = compare_decode(ref_out, bad_lse, ref_out, ref_lse, BF16)
    assert result.out_ok and not result.lse_ok and result.max_abs_err == 0 and abs(result.lse_max_abs_err - 0.03) < 1e-6
    nan_lse = ref_lse.clone()
    nan_lse[-1, -1] = math.nan
    with pytest.raises(AssertionError, match="NaN in lse"):
        assert_close_decode(ref_out, nan_lse, ref_out, ref_lse, FP8)


# --------------------------------------------------------------------------------------------------------
# (b) validation
# --------------------------------------------------------------------------------------------------------

B, H, QL, BS = 2, 16, 1, 16


def _base(q_form="cat", kv_dtype=BF16, q_len=QL, heads=H, block_size=BS, seed=0, **kw):
    return make_decode_inputs(B, [5, 20], q_len, heads, block_size, kv_dtype, q_form, "cpu", seed, **kw)


def _kwargs(inp, **over):
    kw = dict(softmax_scale=inp.softmax_scale)
    kw.update(over)
    return kw


def _call(inp, q=None, kv=None, bt=None, sl=None, **over):
    return prepare_args(inp.q if q is None else q, inp.kv_cache if kv is None else kv,
                        inp.block_table if bt is None else bt, inp.seq_lens if sl is None else sl,
                        **_kwargs(inp, **over))


def _rx(s: str) -> str:
    return re.escape(s)


_ALLOWED_HEADS = _rx(str(SUPPORTED_NUM_HEADS))
_ALLOWED_Q_LENS = _rx(str(SUPPORTED_Q_LENS))
_ALLOWED_BLOCKS = _rx(str(SUPPORTED_BLOCK_SIZES))
_ALL_Q_DTYPES = "allowed: bfloat16, float16, float8_e4m3fn"
_PAIR_DTYPES = "allowed: bfloat16, float16$"
_OUT_DTYPES = "allowed: bfloat16, float16"


def _validation_cases():
    """(id, thunk raising ValueError, regex the message must match)."""
    cases = []

    def add(name, fn, pattern):
        cases.append(pytest.param(fn, pattern, id=name))

    # ---- q: heads, dims, dtypes, form ----
    add("heads_8", lambda: _call(_base(heads=16), q=torch.randn(2, 8, QK_HEAD_DIM, dtype=BF16)),
        r"mla_decode: q: 8 heads is not supported; allowed heads per rank: " + _ALLOWED_HEADS)
    add("heads_48_pair", lambda: _call(_base(), q=(torch.randn(2, 48, 512, dtype=BF16),
                                                   torch.randn(2, 48, 64, dtype=BF16))),
        r"q: 48 heads is not supported; allowed heads per rank: " + _ALLOWED_HEADS)
    add("q_2d", lambda: _call(_base(), q=torch.randn(2, QK_HEAD_DIM, dtype=BF16)),
        r"mla_decode: q: must be a \[tokens, heads, 576\] tensor or a \(q_nope, q_pe\) pair, got \(2, 576\)")
    add("q_last_dim_512", lambda: _call(_base(), q=torch.randn(2, H, 512, dtype=BF16)),
        r"q: must be a \[tokens, heads, 576\] tensor .*got \(2, 16, 512\)")
    add("q_not_tensor", lambda: _call(_base(), q=[[1.0]]),
        r"q: a tuple must be \(q_nope \[T, H, 512\], q_pe \[T, H, 64\]\)")
    add("q_tuple_of_3", lambda: _call(_base(), q=(torch.randn(2, H, 512), torch.randn(2, H, 64),
                                                  torch.randn(2, H, 64))),
        r"q: a tuple must be \(q_nope \[T, H, 512\], q_pe \[T, H, 64\]\)")
    add("q_nope_wrong_dim", lambda: _call(_base(), q=(torch.randn(2, H, 511, dtype=BF16),
                                                      torch.randn(2, H, 64, dtype=BF16))),
        r"q_nope: must be a 3-D tensor \[tokens, heads, 512\], got \(2, 16, 511\)")
    add("q_pe_wrong_dim", lambda: _call(_base(), q=(torch.randn(2, H, 512, dtype=BF16),
                                                    torch.randn(2, H, 32, dtype=BF16))),
        r"q_pe: must be a 3-D tensor \[tokens, heads, 64\], got \(2, 16, 32\)")
    add("q_pe_2d", lambda: _call(_base(), q=(torch.randn(2, H, 512, dtype=BF16), torch.randn(2, 64, dtype=BF16))),
        r"q_pe: must be a 3-D tensor \[tokens, heads, 64\]")
    add("q_pair_token_mismatch", lambda: _call(_base(), q=(torch.randn(2, H, 512, dtype=BF16),
                                                           torch.randn(4, H, 64, dtype=BF16))),
        r"q: q_nope \(2, 16, 512\) and q_pe \(4, 16, 64\) disagree on \[tokens, heads\]")
    add("q_pair_dtype_mismatch", lambda: _call(_base(), q=(torch.randn(2, H, 512, dtype=BF16),
                                                           torch.randn(2, H, 64, dtype=FP16))),
        r"q: q_nope is torch.bfloat16 but q_pe is torch.float16")
    add("q_float32", lambda: _call(_base(), q=torch.randn(2, H, QK_HEAD_DIM)),
        r"q: dtype torch.float32 is not supported; " + _ALL_Q_DTYPES)
    add("q_pair_float32", lambda: _call(_base(), q=(torch.randn(2, H, 512), torch.randn(2, H, 64))),
        r"q: dtype torch.float32 is not supported for the \(q_nope, q_pe\) form; " + _PAIR_DTYPES)
    add("q_pair_fp8", lambda: _call(_base(), q=(torch.randn(2, H, 512).to(FP8), torch.randn(2, H, 64).to(FP8))),
        r"q: dtype torch.float8_e4m3fn is not supported for the \(q_nope, q_pe\) form; " + _PAIR_DTYPES)
    add("q_pe_last_dim_strided", lambda: _call(_base(), q=(torch.randn(2, H, 512, dtype=BF16),
                                                           torch.randn(2, H, 128, dtype=BF16)[..., ::2])),
        r"q_pe: last dimension must be contiguous \(stride 1\)")
    add("q_last_dim_strided", lambda: _call(_base(), q=torch.randn(2, H, 2 * QK_HEAD_DIM, dtype=BF16)[..., ::2]),
        r"q_nope: last dimension must be contiguous \(stride 1\)")

    # ---- kv_cache ----
    add("kv_not_tensor", lambda: _call(_base(), kv=[1, 2]), r"kv_cache: must be a tensor, got list")
    add("kv_last_dim_512", lambda: _call(_base(), kv=torch.randn(8, BS, 512, dtype=BF16)),
        r"kv_cache: must be \[num_blocks, block_size, 576\], got \(8, 16, 512\)")
    add("kv_2d", lambda: _call(_base(), kv=torch.randn(8 * BS, QK_HEAD_DIM, dtype=BF16)),
        r"kv_cache: must be \[num_blocks, block_size, 576\], got \(128, 576\)")
    add("kv_4d_two_heads", lambda: _call(_base(), kv=torch.randn(8, BS, 2, QK_HEAD_DIM, dtype=BF16)),
        r"kv_cache: must be \[num_blocks, block_size, 576\], got \(8, 16, 2, 576\)")
    add("kv_float32", lambda: _call(_base(), kv=torch.randn(8, BS, QK_HEAD_DIM)),
        r"kv_cache: dtype torch.float32 is not supported; " + _ALL_Q_DTYPES + "$")
    add("kv_uint8_hint", lambda: _call(_base(), kv=torch.zeros(8, BS, QK_HEAD_DIM, dtype=torch.uint8)),
        r"kv_cache: dtype torch.uint8 is not supported; " + _ALL_Q_DTYPES
        + r" \(view a uint8 fp8 cache as torch.float8_e4m3fn\)")
    add("kv_dtype_differs_from_q", lambda: _call(_base(), kv=torch.randn(8, BS, QK_HEAD_DIM, dtype=FP16)),
        r"kv_cache: a 16-bit cache must have q's dtype \(torch.bfloat16\), got torch.float16")
    add("kv_dtype_differs_from_fp8_q_out", lambda: _call(_base("fp8", kv_dtype=BF16), out_dtype=FP16),
        r"kv_cache: a 16-bit cache must have q's dtype \(torch.float16\), got torch.bfloat16")
    add("kv_last_dim_strided", lambda: _call(_base(), kv=torch.randn(8, BS, 2 * QK_HEAD_DIM, dtype=BF16)[..., ::2]),
        r"kv_cache: last dimension must be contiguous \(stride 1\)")
    for bs in (8, 24, 256):
        add(f"block_size_{bs}", lambda bs=bs: _call(_base(), kv=torch.randn(8, bs, QK_HEAD_DIM, dtype=BF16)),
            rf"kv_cache: block size {bs} is not supported; allowed: " + _ALLOWED_BLOCKS)

    # ---- block_table / seq_lens / batch / q_len ----
    add("block_table_int64", lambda: _call((i := _base()), bt=i.block_table.long()),
        r"block_table: must be an int32 tensor \[batch, max_blocks_per_request\]")
    add("block_table_1d", lambda: _call((i := _base()), bt=i.block_table[0]),
        r"block_table: must be an int32 tensor \[batch, max_blocks_per_request\]")
    add("block_table_not_tensor", lambda: _call((i := _base()), bt=i.block_table.tolist()),
        r"block_table: must be an int32 tensor \[batch, max_blocks_per_request\]")
    add("block_table_last_dim_strided", lambda: _call((i := _base()), bt=i.block_table.repeat(1, 2)[:, ::2]),
        r"block_table: last dimension must be contiguous \(stride 1\)")
    add("seq_lens_int64", lambda: _call((i := _base()), sl=i.seq_lens.long()),
        r"seq_lens: must be an int32 tensor \[batch\]")
    add("seq_lens_2d", lambda: _call((i := _base()), sl=i.seq_lens[None]),
        r"seq_lens: must be an int32 tensor \[batch\]")
    add("seq_lens_not_contiguous", lambda: _call((i := _base()), sl=i.seq_lens.repeat(2)[::2]),
        r"seq_lens: must be contiguous")
    add("seq_lens_wrong_length", lambda: _call(_base(), sl=torch.tensor([5, 20, 7], dtype=torch.int32)),
        r"seq_lens: has 3 entries but block_table has 2 rows")
    add("empty_batch", lambda: _call((i := _base()), bt=i.block_table[:0], sl=i.seq_lens[:0]),
        r"block_table: batch is empty")
    add("tokens_not_multiple_of_batch", lambda: _call(_base(), q=torch.randn(3, H, QK_HEAD_DIM, dtype=BF16)),
        r"q: 3 tokens is not a multiple of the batch \(2\): q_len must be uniform")
    add("q_len_5", lambda: _call(_base(), q=torch.randn(B * 5, H, QK_HEAD_DIM, dtype=BF16)),
        r"q_len: 5 query tokens per request is not supported; allowed: " + _ALLOWED_Q_LENS)
    add("q_len_5_explicit", lambda: _call(_base(), q=torch.randn(B * 5, H, QK_HEAD_DIM, dtype=BF16), q_len=5),
        r"q_len: 5 query tokens per request is not supported; allowed: " + _ALLOWED_Q_LENS)
    add("q_len_disagrees", lambda: _call(_base(q_len=2), q_len=1),
        r"q_len: is 1 but q has 4 tokens for 2 requests \(2 each\)")

    # ---- devices (meta stands in for a second device on a CPU-only machine) ----
    add("kv_on_other_device", lambda: _call(_base(), q=torch.empty(2, H, QK_HEAD_DIM, dtype=BF16, device="meta")),
        r"kv_cache: is on cpu but q is on meta")
    add("scale_on_other_device", lambda: _call(_base("fp8", kv_dtype=FP8), out_dtype=BF16,
                                               kv_scale=torch.ones(1, device="meta")),
        r"kv_scale: must be on cpu, got meta")

    # ---- scales ----
    add("q_scale_for_16bit_q", lambda: _call(_base(), q_scale=2.0),
        r"q_scale: is a dequantisation scale of an fp8 tensor; pass None when that tensor is 16-bit")
    add("kv_scale_for_16bit_cache", lambda: _call(_base(), kv_scale=2.0),
        r"kv_scale: is a dequantisation scale of an fp8 tensor; pass None when that tensor is 16-bit")
    add("kv_scale_tensor_for_16bit_cache", lambda: _call(_base(), kv_scale=torch.ones(1)),
        r"kv_scale: is a dequantisation scale of an fp8 tensor; pass None")
    add("q_scale_tensor_float64", lambda: _call(_base("fp8", kv_dtype=FP8), out_dtype=BF16,
                                                q_scale=torch.ones(1, dtype=torch.float64)),
        r"q_scale: must be a float or a 1-element float32 tensor, got \(1,\) torch.float64")
    add("kv_scale_tensor_2_elems", lambda: _call(_base("pair", kv_dtype=FP8), kv_scale=torch.ones(2)),
        r"kv_scale: must be a float or a 1-element float32 tensor, got \(2,\) torch.float32")
    add("kv_scale_zero", lambda: _call(_base("pair", kv_dtype=FP8), kv_scale=0.0),
        r"kv_scale: must be a positive finite number \(a dequantisation scale\), got 0.0")
    add("q_scale_negative", lambda: _call(_base("fp8", kv_dtype=FP8), out_dtype=BF16, q_scale=-0.5),
        r"q_scale: must be a positive finite number \(a dequantisation scale\), got -0.5")
    add("kv_scale_nan", lambda: _call(_base("pair", kv_dtype=FP8), kv_scale=float("nan")),
        r"kv_scale: must be a positive finite number \(a dequantisation scale\), got nan")

    # ---- output dtype / out / lse ----
    add("fp8_q_without_out_dtype", lambda: _call(_base("fp8", kv_dtype=FP8)),
        r"out_dtype: q is fp8, so the output dtype must be given \(out= or out_dtype=\); " + _OUT_DTYPES)
    add("out_dtype_float32", lambda: _call(_base(), out_dtype=torch.float32),
        r"out_dtype: torch.float32 is not supported; " + _OUT_DTYPES)
    add("out_float32", lambda: _call(_base(), out=torch.empty(B, H, KV_LORA_RANK)),
        r"out_dtype: torch.float32 is not supported; " + _OUT_DTYPES)
    add("out_dtype_disagrees_with_out", lambda: _call(_base(), out=torch.empty(B, H, KV_LORA_RANK, dtype=BF16),
                                                      out_dtype=FP16),
        r"out_dtype: is torch.float16 but out is torch.bfloat16")
    add("out_bad_shape", lambda: _call(_base(), out=torch.empty(B, H, QK_HEAD_DIM, dtype=BF16)),
        r"out: must be a \(2, 16, 512\) tensor on cpu with a contiguous last dim, got \(2, 16, 576\) on cpu")
    add("out_bad_tokens", lambda: _call(_base(), out=torch.empty(B + 1, H, KV_LORA_RANK, dtype=BF16)),
        r"out: must be a \(2, 16, 512\) tensor")
    add("out_last_dim_strided", lambda: _call(_base(), out=torch.empty(B, H, 2 * KV_LORA_RANK, dtype=BF16)[..., ::2]),
        r"out: must be a \(2, 16, 512\) tensor on cpu with a contiguous last dim")
    add("lse_bad_shape", lambda: _call(_base(), lse=torch.empty(B, H, 1)),
        r"lse: must be a float32 tensor \(2, 16\) on cpu, got torch.float32 \(2, 16, 1\) on cpu")
    add("lse_bad_dtype", lambda: _call(_base(), lse=torch.empty(B, H, dtype=BF16)),
        r"lse: must be a float32 tensor \(2, 16\) on cpu, got torch.bfloat16")

    # ---- softmax_scale ----
    for name, bad in (("zero", 0.0), ("negative", -0.1), ("tensor", torch.tensor(0.1)), ("none", None),
                      ("nan", math.nan)):
        add(f"softmax_scale_{name}", lambda bad=bad: _call(_base(), softmax_scale=bad),
            r"softmax_scale: must be a positive Python float")
    return cases


@pytest.mark.parametrize("fn,pattern", _validation_cases())
def test_prepare_args_rejects(fn, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn()


def test_validation_messages_name_argument():
    """Every message has the ``mla_decode: <argument>: ...`` shape."""
    for param in _validation_cases():
        fn, _ = param.values
        with pytest.raises(ValueError) as info:
            fn()
        assert re.match(r"mla_decode: (q|q_nope|q_pe|kv_cache|block_table|seq_lens|q_len|q_scale|kv_scale|"
                        r"out_dtype|out|lse|softmax_scale): ", str(info.value)), str(info.value)


def test_unknown_kernel_name():
    inp = _base()
    allowed = "allowed: 'auto', " + ", ".join(repr(k) for k in KERNELS)
    with pytest.raises(ValueError, match=r"mla_decode: kernel: unknown kernel 'nope'; " + re.escape(allowed)):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="nope")
    assert set(available_kernels()) >= {"triton", "reference"}


def test_step_must_be_a_step_plans():
    from mla_backend_plugin.ops.workspace import StepPlans

    inp = _base()
    with pytest.raises(ValueError, match=r"mla_decode: step: must be a StepPlans \(one per decode step\) or None, "
                                         r"got dict"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference", step={})
    out, _ = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference", step=StepPlans())
    assert torch.isfinite(out).all()  # kernels without a step-plan kernel ignore it


def test_unknown_kernel_name_from_env(monkeypatch):
    inp = _base()
    monkeypatch.setenv(KERNEL_ENV_VAR, "nope")
    with pytest.raises(ValueError, match=r"mla_decode: kernel: unknown kernel 'nope'; allowed: 'auto', "):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale)


def test_triton_kernel_needs_cuda():
    inp = _base()
    with pytest.raises(ValueError, match=r"mla_decode: kernel: 'triton' cannot run this call: needs a CUDA device"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="triton")


def test_auto_on_cpu_points_to_reference(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV_VAR, raising=False)
    inp = _base()
    with pytest.raises(ValueError, match=r"mla_decode: q: kernels need a CUDA device, got cpu "
                                         r"\(kernel='reference' runs anywhere\)"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale)


# ---- valid inputs that prepare_args must accept and normalise ----


def test_prepare_args_accepts_and_normalises():
    inp = _base("pair", kv_dtype=BF16, q_len=2)
    args = prepare_args(*inp.call_args(), softmax_scale=inp.softmax_scale)
    assert (args.batch, args.q_len, args.num_heads, args.block_size) == (2, 2, H, BS)
    assert args.q_pe.data_ptr() == inp.q[1].data_ptr() and args.q_pe.stride() == inp.q[1].stride()
    assert args.out.shape == (4, H, KV_LORA_RANK) and args.out.dtype == BF16
    assert args.lse.shape == (4, H) and args.lse.dtype == torch.float32
    assert args.compute_dtype == BF16 and args.q_scale is None and args.kv_scale is None
    # explicit matching q_len, int softmax_scale, a [nb, bs, 1, 576] cache (one latent head) are accepted
    kv4 = inp.kv_cache.unsqueeze(2)
    args = prepare_args(inp.q, kv4, inp.block_table, inp.seq_lens, softmax_scale=1, q_len=2)
    assert args.kv_cache.shape == inp.kv_cache.shape and args.softmax_scale == 1.0
    # fp8 q + fp8 cache: out dtype decides the compute dtype; float scales become Python floats
    f8 = _base("fp8", kv_dtype=FP8, q_scale=2.0, kv_scale=3.0)
    args = prepare_args(*f8.call_args(), softmax_scale=0.1, out_dtype=FP16, q_scale=2, kv_scale=3.0)
    assert args.out.dtype == FP16 and args.compute_dtype == FP16
    assert isinstance(args.q_scale, float) and args.q_scale == 2.0 and args.kv_scale == 3.0
    t = torch.tensor([3.0])
    args = prepare_args(*f8.call_args(), softmax_scale=0.1, out=torch.empty(2, H, 512, dtype=BF16), kv_scale=t)
    assert args.kv_scale.data_ptr() == t.data_ptr() and args.compute_dtype == BF16
    # a 0-d scale (what vLLM passes) becomes a shape-(1,) view of the same storage: one shape for every kernel
    t0 = torch.tensor(3.0)
    args = prepare_args(*f8.call_args(), softmax_scale=0.1, out=torch.empty(2, H, 512, dtype=BF16), kv_scale=t0)
    assert args.kv_scale.shape == (1,) and args.kv_scale.data_ptr() == t0.data_ptr()
    # fp8 cache with a 16-bit q, scales omitted (= 1)
    p8 = _base("pair", kv_dtype=FP8)
    args = prepare_args(*p8.call_args(), softmax_scale=0.1)
    assert args.kv_scale is None and args.compute_dtype == BF16


# ---- mla_decode(kernel="reference") end to end on CPU ----


@pytest.mark.parametrize("q_form,kv_dtype,q_scale,kv_scale", [
    ("pair", BF16, None, None),
    ("cat", FP16, None, None),
    ("pair", FP8, None, 3.0),
    ("fp8", FP8, 2.0, 3.0),
    ("fp8", BF16, 2.0, None),
])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "tensor"])
def test_mla_decode_reference_kernel_end_to_end(q_form, kv_dtype, q_scale, kv_scale, as_tensor):
    lens = [0, 2, 17, 64, 33]
    inp = make_decode_inputs(5, lens, 3, 16, 16, kv_dtype, q_form, "cpu", 21, q_scale=q_scale, kv_scale=kv_scale)
    scales = inp.scale_kwargs(as_tensor)
    out_dtype = inp.out_dtype if q_form == "fp8" else None
    out, lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference",
                          out_dtype=out_dtype, **scales)
    assert out.dtype == inp.out_dtype and out.shape == (15, 16, KV_LORA_RANK)
    assert lse.dtype == torch.float32 and lse.shape == (15, 16)
    nv_out, nv_lse = naive_decode(inp.q_nope, inp.q_pe, inp.kv_cache, inp.block_table, inp.seq_lens, 3,
                                  inp.softmax_scale, inp.q_scale, inp.kv_scale)
    assert_close_decode(out, lse, nv_out, nv_lse, kv_dtype)

    # preallocated, NaN-poisoned out/lse (out as a view into a larger buffer): written in place, returned as is
    big = torch.full((15, 16, 2 * KV_LORA_RANK), math.nan, dtype=inp.out_dtype)
    out2 = big[..., KV_LORA_RANK:]
    lse2 = torch.full((15, 16), math.nan)
    r_out, r_lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference",
                              out=out2, lse=lse2, **scales)
    assert r_out is out2 and r_lse is lse2
    assert torch.isnan(big[..., :KV_LORA_RANK].float()).all(), "wrote outside out"
    assert_close_decode(out2, lse2, nv_out, nv_lse, kv_dtype)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)


def test_env_override_selects_reference(monkeypatch):
    inp = make_decode_inputs(3, [1, 40, 7], 2, 32, 32, BF16, "pair", "cpu", 8)
    monkeypatch.setenv(KERNEL_ENV_VAR, "reference")
    out, lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale)  # kernel="auto" -> env
    ref_out, ref_lse = inp.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, BF16)
    # an explicit kernel name wins over the environment
    monkeypatch.setenv(KERNEL_ENV_VAR, "nope")
    out2, lse2 = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference")
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    # an empty variable means "auto" (which has no CPU kernel)
    monkeypatch.setenv(KERNEL_ENV_VAR, "")
    with pytest.raises(ValueError, match="kernels need a CUDA device"):
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale)


def test_decisions_are_kept_per_signature(monkeypatch):
    """With a workspace, a call's decision (kernel + config) is made once per signature and kept there; a change of
    shape, dtype, stride, scale form, environment or the tuner's table decides again; the result is the same."""
    from mla_backend_plugin.ops import api, tuned

    decided = []
    real = api._decide

    def counting(*a, **kw):
        decided.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(api, "_decide", counting)
    ws = MLAWorkspace(device="cpu", max_batch=4, max_q_len=2, num_heads=16, num_sms=NUM_SMS)
    inp = make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "pair", "cpu", 8)

    def call(i=inp, **kw):
        return mla_decode(*i.call_args(), softmax_scale=i.softmax_scale, kernel="reference", workspace=ws, **kw)

    first = call()
    for _ in range(3):
        again = call()
    assert len(decided) == 1 and len(ws.decisions) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    call(i=make_decode_inputs(2, [5, 9], 2, 16, 16, BF16, "pair", "cpu", 9))  # another batch
    call(i=make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "cat", "cpu", 8))  # q as one tensor: other strides
    call(i=make_decode_inputs(3, [1, 40, 7], 2, 16, 16, FP8, "pair", "cpu", 8, kv_scale=2.0), kv_scale=2.0)
    assert len(decided) == 4
    monkeypatch.setenv("CUTE_MLA_PDL", "0")  # the environment changed: decide again, then keep that
    call()
    call()
    assert len(decided) == 5
    tuned.set_seq_profile(None)  # the tuner's table/profile changed
    call()
    assert len(decided) == 6
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference")  # no workspace: no memo
    assert len(decided) == 7 and len(ws.decisions) == 6


def _fingerprint_cases():
    """(label, q, kv_cache, block_table, seq_lens, keywords) of calls in every input form a fingerprint tells apart."""
    pair = make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "pair", "cpu", 8)
    cat = make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "cat", "cpu", 8)
    fp8 = make_decode_inputs(2, [5, 70], 1, 16, 16, FP8, "cat", "cpu", 9, kv_scale=2.0)
    fp8q = make_decode_inputs(2, [5, 70], 1, 16, 16, FP8, "fp8", "cpu", 9, kv_scale=2.0, q_scale=0.5)
    rows = torch.tensor([[1, 1], [39, 40], [6, 7]], dtype=torch.int32)
    out = torch.empty(6, 16, KV_LORA_RANK, dtype=BF16)
    return [
        ("pair", *pair.call_args(), {}),
        ("cat", *cat.call_args(), {}),
        ("4-d cache", cat.q, cat.kv_caches[0].unsqueeze(2), cat.block_table, cat.seq_lens, {}),
        ("out given", *cat.call_args(), {"out": out, "lse": torch.empty(6, 16)}),
        ("row_kv_lens", *cat.call_args(), {"row_kv_lens": rows}),
        ("no lse", *cat.call_args(), {"return_lse": False}),
        ("fp8 float scale", *fp8.call_args(), fp8.scale_kwargs()),
        ("fp8 tensor scale", *fp8.call_args(), fp8.scale_kwargs(True)),
        ("fp8 0-d scale", *fp8.call_args(), {"kv_scale": torch.tensor(2.0)}),
        ("fp8 q", *fp8q.call_args(), {**fp8q.scale_kwargs(True), "out_dtype": BF16}),
    ]


def test_call_fingerprint_covers_checks_and_signature():
    """Calls of one fingerprint check alike and decide alike: each input form has its own fingerprint, equal
    fingerprints give equal signatures, and bind() of the checked form builds what prepare_args builds."""
    from mla_backend_plugin.ops.args import bind, call_fingerprint, check_call

    def fingerprint(q, kv, bt, sl, kw):
        return call_fingerprint(q, kv, bt, sl, SOFTMAX_SCALE, None, kw.get("q_scale"), kw.get("kv_scale"),
                                kw.get("out"), kw.get("lse"), kw.get("out_dtype"), kw.get("row_kv_lens"),
                                kw.get("return_lse", True), None)

    seen = {}
    for label, q, kv, bt, sl, kw in _fingerprint_cases():
        need_lse = kw.pop("return_lse", True)
        key = fingerprint(q, kv, bt, sl, {**kw, "return_lse": need_lse})
        assert key is not None and key not in seen, (label, seen.get(key))
        seen[key] = label
        args = prepare_args(q, kv, bt, sl, softmax_scale=SOFTMAX_SCALE, need_lse=need_lse, **kw)
        form = check_call(q, kv, bt, sl, softmax_scale=SOFTMAX_SCALE, need_lse=need_lse, **kw)
        bound = bind(form, q, kv, bt, sl, SOFTMAX_SCALE, kw.get("q_scale"), kw.get("kv_scale"), kw.get("out"),
                     kw.get("lse"), kw.get("row_kv_lens"), need_lse, None)
        assert bound.signature()[:-8] == args.signature()[:-8], label  # data_ptr % 16 of fresh out/lse aside
        for name in ("batch", "q_len", "num_heads", "softmax_scale", "compute_dtype", "need_lse"):
            assert getattr(bound, name) == getattr(args, name), (label, name)
        for name in ("q_nope", "q_pe", "kv_cache", "q_scale", "kv_scale"):
            a, b = getattr(bound, name), getattr(args, name)
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr(), (label, name)
            else:
                assert a == b, (label, name)
        assert bound.kv_cache.dim() == 3 and (bound.kv_scale is None or not isinstance(bound.kv_scale, torch.Tensor)
                                              or bound.kv_scale.shape == (1,))
    # inputs of other kinds get none (mla_decode then checks them every call)
    pair = make_decode_inputs(1, [3], 1, 16, 16, BF16, "pair", "cpu", 1)
    for bad in ({"softmax_scale": True}, {"need_lse": 1}, {"q": (pair.q[0],)}, {"kv": "cache"}):
        call = {"q": pair.q, "kv": pair.kv_caches[0], "softmax_scale": SOFTMAX_SCALE, "need_lse": True, **bad}
        assert call_fingerprint(call["q"], call["kv"], pair.block_table, pair.seq_lens, call["softmax_scale"], None,
                                None, None, None, None, None, None, call["need_lse"], None) is None, bad


def test_kept_checks_still_refuse_bad_input(monkeypatch):
    """After a valid call's checks are kept, a call that differs in anything the checks read is checked again and
    refused with its own message; the kept form serves only its own fingerprint."""
    from mla_backend_plugin.ops import api

    ws = MLAWorkspace(device="cpu", max_batch=4, max_q_len=2, num_heads=16, num_sms=NUM_SMS)
    inp = make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "cat", "cpu", 8)
    checked = []
    real = api.check_call

    def counting(*a, **kw):
        checked.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(api, "check_call", counting)

    def call(*args, softmax_scale=inp.softmax_scale, **kw):
        return mla_decode(*args, softmax_scale=softmax_scale, kernel="reference", workspace=ws, **kw)

    call(*inp.call_args())
    call(*inp.call_args())
    assert len(checked) == 1
    refusals = [
        ("softmax_scale: must be a positive", inp.call_args(), {"softmax_scale": -1.0}),
        ("seq_lens: must be an int32", (inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens.long()), {}),
        ("block_table: last dimension must be contiguous",
         (inp.q, inp.kv_caches[0], inp.block_table.t().contiguous().t(), inp.seq_lens), {}),
        ("kv_scale: is a dequantisation scale of an fp8 tensor", inp.call_args(), {"kv_scale": 2.0}),
        ("out: must be a", inp.call_args(), {"out": torch.empty(6, 16, 256, dtype=BF16)}),
    ]
    for message, args, kw in refusals:
        for _ in range(2):
            with pytest.raises(ValueError, match=message):
                call(*args, **kw)
    assert len(checked) == 1 + 2 * len(refusals)
    with pytest.raises(ValueError, match="step: must be a StepPlans"):  # not an input the fingerprint holds
        call(*inp.call_args(), step=object())
    # a float dequantisation scale's sign is part of the fingerprint: a kept fp8 form does not let a bad one through
    fp8 = make_decode_inputs(2, [5, 70], 1, 16, 16, FP8, "cat", "cpu", 9, kv_scale=2.0)
    call(*fp8.call_args(), kv_scale=2.0)
    call(*fp8.call_args(), kv_scale=3.0)
    for bad in (-2.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="kv_scale: must be a positive finite number"):
            call(*fp8.call_args(), kv_scale=bad)


def test_workspace_keeps_output_views_and_checked_plans():
    from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile

    ws = MLAWorkspace(device="cpu", max_batch=4, max_q_len=2, num_heads=16, num_sms=NUM_SMS,
                      out_dtype=torch.bfloat16)
    out, lse = ws.output_views(6)
    assert ws.output_views(6)[0] is out and out.shape[0] == 6 and out.data_ptr() == ws.out_buffer.data_ptr()
    with torch.inference_mode():
        assert ws.output_views(6)[0] is not out  # views made in inference mode are kept apart
    with pytest.raises(ValueError, match="exceed the workspace"):
        ws.output_views(9)
    args = prepare_args(*make_decode_inputs(3, [1, 40, 7], 2, 16, 16, BF16, "cat", "cpu", 8).call_args(),
                        softmax_scale=SOFTMAX_SCALE)
    tile = PlanTile(64, 64)
    plan = ws.plan_for(args, tile, LaunchConfig())
    assert ws.plan_for(args, tile, LaunchConfig()) is plan
    too_many = LaunchConfig(max_splits=64)
    for _ in range(2):  # a refusal is not kept: every call raises it
        with pytest.raises(ValueError, match="split capacity"):
            ws.plan_for(args, tile, too_many)


def test_reference_kernel_accepts_4d_cache_and_q_len():
    inp = make_decode_inputs(2, [3, 50], 4, 16, 16, BF16, "cat", "cpu", 13)
    out_a, lse_a = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, kernel="reference")
    out_b, lse_b = mla_decode(inp.q, inp.kv_cache.unsqueeze(2), inp.block_table, inp.seq_lens,
                              softmax_scale=inp.softmax_scale, q_len=4, kernel="reference")
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


# --------------------------------------------------------------------------------------------------------
# (c) split planner and workspace
# --------------------------------------------------------------------------------------------------------

NUM_SMS = 132  # H100 SXM


def test_plan_splits_basic():
    # 128 heads, 32 rows per CTA: 4 CTAs per request and q token
    target = TARGET_CTAS_PER_SM * NUM_SMS
    fills = -(-target // 4)  # smallest batch whose 4 CTAs per request reach the target
    assert plan_splits(128, 1, 128, 32, NUM_SMS).num_splits == 1  # 512 CTAs fill 132 SMs
    assert plan_splits(fills, 1, 128, 32, NUM_SMS).num_splits == 1
    assert plan_splits(fills - 1, 1, 128, 32, NUM_SMS).num_splits == 2
    assert plan_splits(1, 1, 128, 32, NUM_SMS).num_splits == MAX_SPLITS
    assert plan_splits(1, 1, 128, 32, NUM_SMS, max_splits=8).num_splits == 8
    assert plan_splits(32, 4, 128, 32, NUM_SMS).num_splits == 1
    p = plan_splits(3, 2, 16, 16, NUM_SMS, min_chunk=256)
    assert p.rows_per_cta == 16 and p.min_chunk == 256
    assert p.num_splits == min(MAX_SPLITS, -(-TARGET_CTAS_PER_SM * NUM_SMS // 6))  # 3 requests x 2 CTAs
    # the planner only looks at shapes: same answer every time
    assert plan_splits(7, 3, 64, 32, NUM_SMS) == plan_splits(7, 3, 64, 32, NUM_SMS)


@pytest.mark.parametrize("heads", SUPPORTED_NUM_HEADS)
@pytest.mark.parametrize("q_len", SUPPORTED_Q_LENS)
@pytest.mark.parametrize("max_splits", [1, 4, MAX_SPLITS, 64])
def test_plan_splits_properties(heads, q_len, max_splits):
    rows = rows_per_cta_for(heads)
    prev = None
    for batch in range(1, 600):
        plan = plan_splits(batch, q_len, heads, rows, NUM_SMS, max_splits=max_splits)
        assert 1 <= plan.num_splits <= max_splits
        ctas = batch * -(-(q_len * heads) // rows)
        if ctas >= TARGET_CTAS_PER_SM * NUM_SMS:
            assert plan.num_splits == 1, f"batch {batch} already fills the GPU but splits {plan.num_splits}"
        else:  # enough splits to reach the target, unless capped
            assert ctas * plan.num_splits >= TARGET_CTAS_PER_SM * NUM_SMS or plan.num_splits == max_splits
        if prev is not None:
            assert plan.num_splits <= prev, "more requests must never mean more splits"
        prev = plan.num_splits


@pytest.mark.parametrize("max_batch,max_q_len,heads,max_splits", [
    (1, 1, 128, MAX_SPLITS),
    (8, 2, 128, MAX_SPLITS),
    (200, 4, 128, MAX_SPLITS),
    (64, 4, 16, MAX_SPLITS),
    (300, 3, 32, 16),
    (129, 1, 64, 64),
    (512, 4, 128, 1),
])
def test_workspace_sizing(max_batch, max_q_len, heads, max_splits):
    ws = MLAWorkspace(device="cpu", max_batch=max_batch, max_q_len=max_q_len, num_heads=heads, num_sms=NUM_SMS,
                      max_splits=max_splits, rows_per_cta=rows_per_cta_for(heads))
    assert ws.device == torch.device("cpu") and ws.num_sms == NUM_SMS
    assert ws.plan_rows == (rows_per_cta_for(heads),)  # the one tile height the plan is made for
    assert ws.partial_out.dtype == torch.float32 and ws.partial_out.shape[1] == KV_LORA_RANK
    assert ws.partial_lse.dtype == torch.float32
    assert ws.partial_out.shape[0] == ws.partial_lse.shape[0]
    needed = 0
    for q_len in range(1, max_q_len + 1):
        for batch in range(1, max_batch + 1):
            plan = ws.plan(batch, q_len)
            assert plan == plan_splits(batch, q_len, heads, ws.rows_per_cta, NUM_SMS, max_splits)
            assert 1 <= plan.num_splits <= max_splits
            if plan.num_splits > 1:
                rows = batch * q_len * heads * plan.num_splits
                assert ws.partial_out.shape[0] >= rows, f"batch {batch} q_len {q_len}: {rows} partial rows needed"
                needed = max(needed, rows)
            ws.check_fits(batch, q_len, heads, torch.device("cpu"))
    assert ws.partial_rows == needed
    for q_len in range(1, max_q_len + 1):  # the step table holds every balanced plan's work items
        for batch in range(1, max_batch + 1):
            plan = ws.plan(batch, q_len, balanced=True)
            assert plan.grid_items * WORK_ITEM_INTS <= ws.work_items.numel(), (batch, q_len)
    assert ws.work_items.dtype == torch.int32
    assert ws.nbytes == (ws.partial_out.numel() + ws.partial_lse.numel() + ws.split_index.numel()
                         + ws.work_items.numel()) * 4
    assert "MLAWorkspace(" in repr(ws)
    if max_splits == 1:
        assert ws.partial_rows == 0 and ws.partial_out.shape[0] == 1


def test_partials_as_views_the_same_bytes():
    """16-bit partial rows (cute_sm90 stores them in the output dtype) live in the fp32 buffer's bytes, rows of
    KV_LORA_RANK elements, at least as many as the fp32 rows; other dtypes are refused by name."""
    ws = MLAWorkspace(device="cpu", max_batch=8, max_q_len=2, num_heads=128, num_sms=NUM_SMS)
    assert ws.partials_as(torch.float32) is ws.partial_out
    for dtype in (torch.bfloat16, torch.float16):
        view = ws.partials_as(dtype)
        assert view.dtype == dtype and view.shape == (2 * ws.partial_out.shape[0], KV_LORA_RANK)
        assert view.is_contiguous() and view.data_ptr() == ws.partial_out.data_ptr()
        view[-1, -1] = 1.0  # inside the buffer's storage: no allocation of its own
        assert view.untyped_storage().data_ptr() == ws.partial_out.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="partial dtype.*allowed: float32, bfloat16, float16"):
        ws.partials_as(torch.float8_e4m3fn)


def test_workspace_no_split_when_batch_fills_gpu():
    ws = MLAWorkspace(device="cpu", max_batch=256, max_q_len=4, num_heads=128, num_sms=NUM_SMS, rows_per_cta=64)
    ctas_per_request = -(-128 // ws.rows_per_cta)
    fills = -(-TARGET_CTAS_PER_SM * NUM_SMS // ctas_per_request)  # smallest batch that fills the GPU
    assert ws.plan(fills, 1).num_splits == 1
    assert ws.plan(fills - 1, 1).num_splits == 2
    assert ws.plan(256, 1).num_splits == 1
    assert ws.plan(1, 1).num_splits == MAX_SPLITS
    # 128 heads x q_len 1 x 32 splits x 1 request would be 4096 rows; the worst case is larger
    assert ws.partial_rows >= 1 * 1 * 128 * MAX_SPLITS


@pytest.mark.parametrize("heads", SUPPORTED_NUM_HEADS)
def test_workspace_holds_the_plan_of_every_family_tile(heads):
    """A workspace made without a tile serves every family that may run on its device (on CPU: all of them),
    each planning for its own CTA height; a workspace made for a short tile refuses a taller one (fewer m-blocks
    per request: more work items, more partial slots) with the fix in the message."""
    from mla_backend_plugin.ops.manifest import LaunchConfig, PlanTile
    from mla_backend_plugin.ops.registry import plan_rows_for

    ws = MLAWorkspace(device="cpu", max_batch=40, max_q_len=4, num_heads=heads, num_sms=NUM_SMS)
    tiles = {m.name: m.plan_tile(heads, None, None) for m in KERNELS.values() if m.plan_tile is not None}
    assert ws.plan_rows == plan_rows_for(heads, "cpu") == tuple(sorted({t.rows_per_cta for t in tiles.values()}))
    assert tiles["cute_sm90"].rows_per_cta == 64 and tiles["xqa_sm120"].rows_per_cta == 32
    for batch in (1, 3, 17, 40):
        for q_len in (1, 2, 4):
            inp = make_decode_inputs(batch, [5] * batch, q_len, heads, 16, BF16, "cat", "cpu", 0, poison=None)
            args = prepare_args(*inp.call_args(), softmax_scale=SOFTMAX_SCALE)
            for name, tile in tiles.items():
                for plan_name in ("balanced", "uniform"):
                    plan = ws.plan_for(args, tile, LaunchConfig(split_plan=plan_name))
                    assert plan.rows_per_cta == tile.rows_per_cta, name
    small = MLAWorkspace(device="cpu", max_batch=4, max_q_len=1, num_heads=128, num_sms=NUM_SMS, rows_per_cta=16)
    inp = make_decode_inputs(1, [5], 1, 128, 16, BF16, "cat", "cpu", 0, poison=None)
    args = prepare_args(*inp.call_args(), softmax_scale=SOFTMAX_SCALE)
    small.plan_for(args, PlanTile(16, 64), LaunchConfig())
    with pytest.raises(ValueError, match=r"workspace: a 128-row tile needs \d+ partial rows.*plan_rows="):
        small.plan_for(args, PlanTile(128, 64), LaunchConfig(split_plan="uniform"))
    with pytest.raises(ValueError, match=r"max_splits=64 exceeds the workspace's split capacity 32"):
        small.plan_for(args, PlanTile(16, 64), LaunchConfig(max_splits=64))
    with pytest.raises(ValueError, match=r"several tiles"):
        ws.plan(1, 1)


def test_workspace_check_fits_errors():
    ws = MLAWorkspace(device="cpu", max_batch=16, max_q_len=2, num_heads=64, num_sms=NUM_SMS)
    ws.check_fits(16, 2, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"batch 17 exceeds the workspace's max_batch=16"):
        ws.check_fits(17, 1, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"q_len 3 exceeds the workspace's max_q_len=2"):
        ws.check_fits(1, 3, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"workspace was made for num_heads=64, inputs have 128"):
        ws.check_fits(1, 1, 128, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"workspace is on cpu but the inputs are on cuda:0"):
        ws.check_fits(1, 1, 64, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"workspace is on cpu but the inputs are on meta"):
        ws.check_fits(1, 1, 64, torch.device("meta"))


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(max_batch=0), r"max_batch must be >= 1, got 0"),
    (dict(max_batch=4, max_q_len=5), r"max_q_len must be one of \(1, 2, 3, 4\), got 5"),
    (dict(max_batch=4, max_q_len=0), r"max_q_len must be one of \(1, 2, 3, 4\), got 0"),
    (dict(max_batch=4, num_heads=8), r"num_heads must be one of \(16, 32, 64, 128\), got 8"),
    (dict(max_batch=4, max_splits=0), r"max_splits must be in 1..64, got 0"),
    (dict(max_batch=4, max_splits=65), r"max_splits must be in 1..64, got 65"),
])
def test_workspace_constructor_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MLAWorkspace(device="cpu", num_sms=NUM_SMS, **kwargs)


def test_workspace_ignored_by_reference_kernel():
    """Only kernels that need a workspace check it: the reference runs with a workspace too small for the call."""
    inp = make_decode_inputs(2, [3, 9], 1, 16, 16, BF16, "pair", "cpu", 1)
    ws = MLAWorkspace(device="cpu", max_batch=1, num_heads=16, num_sms=NUM_SMS)
    assert not KERNELS["reference"].needs_workspace and KERNELS["triton"].needs_workspace
    out, lse = mla_decode(*inp.call_args(), softmax_scale=SOFTMAX_SCALE, kernel="reference", workspace=ws)
    assert torch.isfinite(lse).all()


def test_decode_inputs_load_in_place_for_graph_replays():
    """``DecodeInputs.load_`` copies another draw into the captured tensors (same storage, new values: the
    reference then answers for the new draw); scales differing from the captured ones are refused."""
    a = make_decode_inputs(3, [100, 37, 64], 2, 16, 16, torch.bfloat16, "pair", "cpu", 1, num_blocks=40,
                           max_blocks=10)
    b = make_decode_inputs(3, [150, 1, 9], 2, 16, 16, torch.bfloat16, "pair", "cpu", 2, num_blocks=40,
                           max_blocks=10)
    tensors = lambda x: (*x.q, x.kv_cache, x.block_table, x.seq_lens)  # noqa: E731
    ptrs = [t.data_ptr() for t in tensors(a)]
    a.load_(b)
    assert ptrs == [t.data_ptr() for t in tensors(a)]
    for x, y in zip(tensors(a), tensors(b)):
        assert torch.equal(x.float().nan_to_num(), y.float().nan_to_num())
    torch.testing.assert_close(a.reference()[0], b.reference()[0], equal_nan=True)
    fp8 = [make_decode_inputs(2, [70, 9], 1, 16, 16, torch.float8_e4m3fn, "fp8", "cpu", s, kv_scale=k)
           for s, k in ((3, 2.0), (4, 1.0))]
    with pytest.raises(ValueError, match="load_: scales"):
        fp8[0].load_(fp8[1])
