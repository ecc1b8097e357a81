"""GPU: short prefills on the decode path (``ops.serving.TokenRequests``) through each decode kernel.

A step of mixed q_lens (decodes, drafts of mixed counts, prefix-cache tails of 16..100 tokens) is recast as token
requests of the tile-filling q_len (1 at 128 heads, 4 at 16 heads: per-row key counts) and launched by the decode
runner in slices of its workspace's max_batch (fresh outputs past its buffers). Each request's rows must equal the
float32 reference of its own causal q block over its own pages, with NaN in every KV slot no request may read and
the workspace's output buffers NaN-poisoned first. Kernels that take no per-row key counts (``row_kv_lens``) skip
the grouped cases.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops import registry, serving
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.testing import (
    assert_close_decode,
    make_decode_inputs,
    poison_runner_outputs,
    select_kernel_for_test,
)

pytestmark = pytest.mark.gpu

KERNEL = "triton"  # set per test by the fixture


@pytest.fixture(autouse=True, params=[name for name in registry.KERNELS if name != "reference"])
def kernel(request, monkeypatch):
    name = select_kernel_for_test(request.param, globals(), monkeypatch)
    monkeypatch.setenv("CUTE_MLA_KERNEL", name)
    monkeypatch.setenv("CUTE_MLA_SELF_CHECK", "never")
    return name


def assert_each_request(q, inp, query_lens, seq_lens, out, lse, kv_dtype):
    """Each request's rows (token order) against the float32 reference of its own causal q block."""
    start = 0
    for b, n in enumerate(query_lens):
        rows = slice(start, start + n)
        ref_out, ref_lse = mla_decode_reference(q[rows, :, :512], q[rows, :, 512:], inp.kv_caches[0],
                                                inp.block_table[b:b + 1], inp.seq_lens[b:b + 1], n,
                                                inp.softmax_scale, kv_scale=inp.kv_scale)
        assert_close_decode(out[rows], lse[rows], ref_out, ref_lse, kv_dtype,
                            msg=f"{KERNEL}: request {b} (q_len {n}, seq_len {seq_lens[b]})")
        start += n


@pytest.mark.parametrize("kv_dtype,heads,max_batch", [(torch.bfloat16, 128, 4), (FP8_DTYPE, 128, 8),
                                                      (torch.bfloat16, 16, 5), (FP8_DTYPE, 32, 128)],
                         ids=["bf16-h128-slices", "fp8-h128-slices", "bf16-h16-slices", "fp8-h32"])
def test_token_requests_match_each_requests_causal_attention(kv_dtype, heads, max_batch, monkeypatch):
    q_len = serving.token_request_q_len(heads)
    if q_len > 1 and not registry.KERNELS[KERNEL].supports_row_kv_lens:
        pytest.skip(f"{KERNEL} takes no per-row key counts")
    query_lens = [1, 3, 16, 2, 100, 1, 41]
    seq_lens = [9, 300, 16 * 40, 19, 100 + 1000, 1, 41 + 7]
    fp8 = kv_dtype == FP8_DTYPE
    inp = make_decode_inputs(len(seq_lens), seq_lens, 1, heads, 64, kv_dtype, "cat", "cuda", seed=11,
                             kv_scale=0.5 if fp8 else None)
    tokens = sum(query_lens)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(tokens, heads, 576, generator=gen, device="cuda").to(torch.bfloat16)
    qsl = torch.tensor([0] + query_lens, device="cuda").cumsum(0).to(torch.int32)
    tr = serving.token_requests(qsl, query_lens, inp.seq_lens, inp.block_table, tokens, q_len=q_len,
                                max_seq_len=max(seq_lens), block_size=64)
    ws = serving.make_workspace("cuda", max_num_seqs=max_batch, num_speculative_tokens=0, num_heads=heads,
                                out_dtype=torch.bfloat16, token_requests=True)
    ws.max_batch = max_batch  # slices of this many token requests (the plans and buffers hold more)
    poison_runner_outputs(monkeypatch)
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8" if fp8 else "auto")
    out, lse = runner.decode(q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, token_requests=tr,
                             kv_scale=torch.tensor(inp.kv_scale, device="cuda") if fp8 else None)
    torch.cuda.synchronize()
    assert_each_request(q, inp, query_lens, seq_lens, out, lse, kv_dtype)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_speculative_step_of_mixed_drafts_runs_in_one_call(kv_dtype, monkeypatch):
    """What vLLM hands decode with n-gram 1 when some of 128 requests have a draft and some not: the workspace an
    engine makes for it (one draft token, token requests) holds the whole step, so the runner launches once, and
    every request's rows are its own causal attention."""
    heads, num_reqs = 128, 128
    gen = torch.Generator().manual_seed(3)
    query_lens = (torch.randint(1, 3, (num_reqs,), generator=gen)).tolist()
    seq_lens = (torch.randint(2, 3000, (num_reqs,), generator=gen)).tolist()
    fp8 = kv_dtype == FP8_DTYPE
    inp = make_decode_inputs(num_reqs, seq_lens, 1, heads, 64, kv_dtype, "cat", "cuda", seed=13,
                             kv_scale=0.5 if fp8 else None)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, 576, generator=torch.Generator(device="cuda").manual_seed(7),
                    device="cuda").to(torch.bfloat16)
    qsl = torch.tensor([0] + query_lens, device="cuda").cumsum(0).to(torch.int32)
    tr = serving.token_requests(qsl, query_lens, inp.seq_lens, inp.block_table, tokens,
                                q_len=serving.token_request_q_len(heads), max_seq_len=max(seq_lens), block_size=64)
    ws = serving.make_workspace("cuda", max_num_seqs=num_reqs, num_speculative_tokens=1, num_heads=heads,
                                out_dtype=torch.bfloat16, token_requests=True)
    launches = []
    real = serving.mla_decode
    monkeypatch.setattr(serving, "mla_decode", lambda *a, **k: launches.append(1) or real(*a, **k))
    poison_runner_outputs(monkeypatch)
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8" if fp8 else "auto")
    out, lse = runner.decode(q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, token_requests=tr,
                             kv_scale=torch.tensor(inp.kv_scale, device="cuda") if fp8 else None)
    torch.cuda.synchronize()
    assert len(launches) == 1, f"{KERNEL}: {len(launches)} launches for one speculative step"
    assert_each_request(q, inp, query_lens, seq_lens, out, lse, kv_dtype)
