"""The engine-neutral serving half on the CPU: the decode runner with the float32 reference kernel, and its
debug check (``CUTE_MLA_CHECK_DIR``), which the vLLM and SGLang end-to-end GPU tests read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mla_backend_plugin.ops import serving
from mla_backend_plugin.testing import make_decode_inputs, poison_runner_outputs
from mla_backend_plugin.testing import reference_check as checks


def _inputs(kv_dtype, q_len=2):
    return make_decode_inputs(3, [1, 37, 130], q_len, 16, 16, kv_dtype, "cat", "cpu", seed=7,
                              kv_scale=0.5 if kv_dtype == torch.float8_e4m3fn else None)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_runner_writes_one_check_record_per_call(monkeypatch, tmp_path, kv_dtype):
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    monkeypatch.setenv("CUTE_MLA_CHECK_DIR", str(tmp_path))
    inp = _inputs(kv_dtype)
    ws = serving.make_workspace("cpu", max_num_seqs=4, num_speculative_tokens=1, num_heads=16,
                                out_dtype=torch.bfloat16)
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8" if kv_dtype == torch.float8_e4m3fn else "auto",
                                  check=checks.engine_check())
    for _ in range(2):
        runner.decode(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, kv_scale=inp.kv_scale)
    [name] = os.listdir(tmp_path)
    assert name == f"{os.getpid()}.jsonl"
    total = checks.read_check_records(str(tmp_path))
    assert total["calls"] == 2 and total["processes"] == 1
    assert total["q_lens"] == {"2": 2} and total["heads"] == {"16": 2} and total["block_sizes"] == {"16": 2}
    assert total["kv_dtypes"] == {str(kv_dtype): 2}
    assert total["max_seq_len"] == 130 and total["lse_inf_mismatch"] == 0
    # the reference against itself, up to the bf16 rounding of the output
    assert total["max_rel_err"] < 1e-2 and total["max_lse_err"] < 1e-4


def test_check_catches_a_wrong_output():
    inp = _inputs(torch.bfloat16)
    from mla_backend_plugin.ops.api import mla_decode

    out, lse = mla_decode(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, softmax_scale=inp.softmax_scale,
                          kernel="reference")
    good = checks.reference_check(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, inp.softmax_scale,
                                   out, lse)
    assert good["max_rel_err"] < 1e-2
    wrong = out.clone()
    wrong[1] = 0  # one query row lost
    bad = checks.reference_check(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, inp.softmax_scale,
                                  wrong, lse + 0.5)
    assert bad["max_rel_err"] > 0.05 and bad["max_lse_err"] == pytest.approx(0.5, abs=1e-3)


def test_merge_check_records():
    total = {}
    checks.merge_check_records(total, {"calls": 1, "q_lens": {"1": 1}, "max_rel_err": 0.1})
    checks.merge_check_records(total, {"calls": 1, "q_lens": {"1": 1, "2": 1}, "max_rel_err": 0.05})
    assert total == {"calls": 2, "q_lens": {"1": 2, "2": 1}, "max_rel_err": 0.1}
    assert json.loads(json.dumps(total)) == total


def test_engine_result_script_reader(tmp_path):
    """The reader the engine GPU tests share: the last RESULT line of a successful script; a failing one fails."""
    from engine_result import run_result_script

    ok = tmp_path / "ok.py"
    ok.write_text("print('noise')\nprint('RESULT {\"a\": 1}')\nprint('RESULT {\"a\": 2}')\n")
    assert run_result_script(str(ok)) == {"a": 2}
    bad = tmp_path / "bad.py"
    bad.write_text("print('RESULT {}')\nraise SystemExit(3)\n")
    with pytest.raises(AssertionError, match="exit 3"):
        run_result_script(str(bad))


# ------------------------------------------------------- short prefills on the decode path: one request per token


def test_uniform_query_len():
    assert serving.uniform_query_len([2, 2, 2], 6) == 2
    assert serving.uniform_query_len([2, 2, 0, 0], 8) == 2  # a full-graph batch's padding requests
    assert serving.uniform_query_len([1, 3], 4) is None  # 4 tokens / 2 requests is 2, but not for each
    assert serving.uniform_query_len([16, 16], 32) == 16
    assert serving.uniform_query_len([1, 2], 3) is None
    assert serving.uniform_query_len([], 0) is None


def test_decode_query_len_threshold(monkeypatch):
    monkeypatch.delenv("CUTE_MLA_DECODE_MAX_QUERY_LEN", raising=False)
    assert serving.decode_query_len_threshold(0) == 128
    assert serving.decode_query_len_threshold(3, dcp_world_size=2) == 4  # DCP: the speculative q_len only
    monkeypatch.setenv("CUTE_MLA_DECODE_MAX_QUERY_LEN", "1")
    assert serving.decode_query_len_threshold(0) == 1
    assert serving.decode_query_len_threshold(2) == 3  # never under the speculative q_len
    monkeypatch.setenv("CUTE_MLA_DECODE_MAX_QUERY_LEN", "0")
    with pytest.raises(ValueError, match="CUTE_MLA_DECODE_MAX_QUERY_LEN='0': allowed values are integers >= 1"):
        serving.decode_query_len_threshold(0)


def test_token_request_q_len_fills_the_tile():
    assert [serving.token_request_q_len(h) for h in (16, 32, 64, 128)] == [4, 2, 1, 1]


def test_token_requests_give_each_query_token_its_causal_keys():
    # requests of 3, 1, 0 (an engine's padding request), 5 new tokens; two padding tokens past the last request
    query_lens, seq_lens = [3, 1, 0, 5], torch.tensor([10, 4, 0, 70], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 4, 4, 9], dtype=torch.int32)
    block_table = torch.arange(4 * 9, dtype=torch.int32).view(4, 9)
    tr = serving.token_requests(qsl, query_lens, seq_lens, block_table, 11)
    assert tr.q_len == 1 and tr.rows is None and tr.row_kv_lens is None and tr.query_lens == query_lens
    assert tr.seq_lens.dtype == torch.int32 and tr.block_table.dtype == torch.int32 and tr.block_table.is_contiguous()
    assert tr.seq_lens.tolist() == [8, 9, 10, 4, 66, 67, 68, 69, 70, 0, 0]
    rows = [0, 0, 0, 1, 3, 3, 3, 3, 3]
    assert torch.equal(tr.block_table[:9], block_table[rows])
    # only the columns a request of the step can use (70 keys in pages of 16: 5 columns)
    tr = serving.token_requests(qsl, query_lens, seq_lens, block_table, 9, max_seq_len=70, block_size=16)
    assert torch.equal(tr.block_table, block_table[rows, :5])
    assert serving.token_requests(qsl, query_lens, seq_lens, block_table, 9, max_seq_len=1000,
                                  block_size=16).block_table.shape == (9, 9)
    # groups of up to 2 tokens of one request: [3] -> 2 requests, [1] -> 1, [5] -> 3, the 2 padding tokens -> 1
    tr = serving.token_requests(qsl, query_lens, seq_lens, block_table, 11, q_len=2)
    assert tr.row_kv_lens.tolist() == [[8, 9], [10, 0], [4, 0], [66, 67], [68, 69], [70, 0], [0, 0]]
    assert tr.seq_lens.tolist() == [9, 10, 4, 67, 69, 70, 0]
    assert tr.rows.tolist() == [0, 1, 2, 0, 3, 0, 4, 5, 6, 7, 8, 0, 9, 10]  # 0: a row past its request's end
    assert tr.row_of_token.tolist() == [0, 1, 2, 4, 6, 7, 8, 9, 10, 12, 13]
    assert torch.equal(tr.block_table[:6], block_table[[0, 0, 1, 3, 3, 3]])
    q = torch.arange(11.0)[:, None, None]
    assert torch.equal(tr.gather_q(q).flatten(), torch.tensor([0.0, 1, 2, 0, 3, 0, 4, 5, 6, 7, 8, 0, 9, 10]))
    out, lse = tr.scatter(tr.gather_q(q), tr.gather_q(q)[:, :, 0])
    assert torch.equal(out, q) and torch.equal(lse, q[:, :, 0])


def _varlen_case(heads: int, kv_dtype=torch.bfloat16, seed: int = 3):
    """Requests of mixed q_lens (decodes, drafts, prefix-cache tails) over random pages with poisoned unread slots;
    q in token order, and each request's float32 reference of its own causal q block."""
    from mla_backend_plugin.kernels.reference import mla_decode_reference

    query_lens = [1, 3, 16, 2, 9, 1, 5]
    seq_lens = [9, 300, 16 * 12, 19, 9 + 200, 1, 5 + 3]
    fp8 = kv_dtype == torch.float8_e4m3fn
    inp = make_decode_inputs(len(seq_lens), seq_lens, 1, heads, 16, kv_dtype, "cat", "cpu", seed=seed,
                             kv_scale=0.5 if fp8 else None)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, 576, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    refs, start = [], 0
    for b, n in enumerate(query_lens):
        refs.append(mla_decode_reference(q[start:start + n, :, :512], q[start:start + n, :, 512:], inp.kv_caches[0],
                                         inp.block_table[b:b + 1], inp.seq_lens[b:b + 1], n, inp.softmax_scale,
                                         kv_scale=inp.kv_scale))
        start += n
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return inp, q, query_lens, qsl, tuple(torch.cat([r[i] for r in refs]) for i in range(2))


@pytest.mark.parametrize("heads,kv_dtype", [(128, torch.bfloat16), (16, torch.bfloat16), (32, torch.float8_e4m3fn)])
def test_token_requests_decode_like_each_requests_q_block(monkeypatch, tmp_path, heads, kv_dtype):
    """Through the runner (reference kernel): token requests of the tile-filling q_len (1 at 128 heads, 4 at 16, 2
    at 32) in slices of a small workspace give each request's causal attention, token by token, and the debug check
    recomputes them request by request."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    monkeypatch.setenv("CUTE_MLA_CHECK_DIR", str(tmp_path))
    inp, q, query_lens, qsl, (ref_out, ref_lse) = _varlen_case(heads, kv_dtype)
    tr = serving.token_requests(qsl, query_lens, inp.seq_lens, inp.block_table, q.shape[0],
                                q_len=serving.token_request_q_len(heads), max_seq_len=300, block_size=16)
    ws = serving.make_workspace("cpu", max_num_seqs=3, num_speculative_tokens=0, num_heads=heads,
                                out_dtype=torch.bfloat16)
    ws.max_batch = 3  # slices of 3 token requests here (make_workspace would leave room for 128 with token_requests)
    fp8 = kv_dtype == torch.float8_e4m3fn
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8" if fp8 else "auto", check=checks.engine_check())
    poison_runner_outputs(monkeypatch)
    calls = []
    real = serving.mla_decode
    monkeypatch.setattr(serving, "mla_decode", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    out, lse = runner.decode(q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, token_requests=tr,
                             kv_scale=inp.kv_scale)
    assert len(calls) == -(-tr.block_table.shape[0] // 3) > 1 and max(calls) == 3
    from mla_backend_plugin.testing import assert_close_decode

    assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype)
    total = checks.read_check_records(str(tmp_path))
    assert total["calls"] == 1 and total["token_request_calls"] == 1 and total["q_lens"] == {"mixed": 1}
    assert total["max_rel_err"] < 1e-2 and total["lse_inf_mismatch"] == 0


def test_make_workspace_leaves_room_for_token_requests():
    ws = serving.make_workspace("cpu", max_num_seqs=4, num_speculative_tokens=0, num_heads=16,
                                out_dtype=torch.bfloat16, token_requests=True)
    assert (ws.max_batch, ws.max_q_len) == (serving.TOKEN_REQUEST_SLICE, 4)
    # with speculation, a step of mixed q_lens in one call: 256 requests of up to 2 tokens, one token request
    # each at 128 heads, and the engine's padding
    ws = serving.make_workspace("cpu", max_num_seqs=256, num_speculative_tokens=1, num_heads=128,
                                out_dtype=torch.bfloat16, token_requests=True)
    assert (ws.max_batch, ws.max_q_len) == (2 * 256 + serving.TOKEN_REQUEST_PADDING, 2)
    ws = serving.make_workspace("cpu", max_num_seqs=256, num_speculative_tokens=1, num_heads=128,
                                out_dtype=torch.bfloat16, token_requests=False)
    assert (ws.max_batch, ws.max_q_len) == (256, 2)
    ws = serving.make_workspace("cpu", max_num_seqs=64, num_speculative_tokens=3, num_heads=16,
                                out_dtype=torch.bfloat16, token_requests=True)  # 4 tokens a token request
    assert (ws.max_batch, ws.max_q_len) == (serving.TOKEN_REQUEST_SLICE, 4)
    # more draft tokens: slices (a workspace for the whole step would hold max_q_len times the rows it needs)
    ws = serving.make_workspace("cpu", max_num_seqs=256, num_speculative_tokens=3, num_heads=128,
                                out_dtype=torch.bfloat16, token_requests=True)
    assert (ws.max_batch, ws.max_q_len) == (256, 4)


def test_runner_runs_more_requests_than_the_workspace_in_slices(monkeypatch):
    """A q_len 2 step of more requests than the workspace's max_batch runs in slices of max_batch requests (rows of
    q, out and lse in step), with fresh outputs past the workspace's buffers."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    lens = [2, 37, 130, 5, 64, 16, 200, 3]
    inp = make_decode_inputs(len(lens), lens, 2, 16, 16, torch.bfloat16, "pair", "cpu", seed=3)
    ws = serving.make_workspace("cpu", max_num_seqs=3, num_speculative_tokens=1, num_heads=16,
                                out_dtype=torch.bfloat16)
    poison_runner_outputs(monkeypatch)
    calls = []
    real = serving.mla_decode
    monkeypatch.setattr(serving, "mla_decode", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    out, lse = serving.DecodeRunner(inp.softmax_scale, "auto").decode(inp.q, inp.kv_caches[0], inp.block_table,
                                                                      inp.seq_lens, ws)
    assert calls == [3, 3, 2] and out.shape[0] == 16 and out.data_ptr() != ws.out_buffer.data_ptr()
    from mla_backend_plugin.testing import assert_close_decode

    assert_close_decode(out, lse, *inp.reference(), torch.bfloat16)


def test_fp8_query_by_setting_and_gpu():
    """CUTE_MLA_FP8_QUERY: `auto` hands the kernels an fp8 q on SM90 only (where it was measured), `1` / `0`
    everywhere."""
    assert serving.fp8_query("auto", (9, 0)) and not serving.fp8_query("auto", (10, 0))
    assert not serving.fp8_query("auto", None) and not serving.fp8_query("auto", (12, 0))
    assert serving.fp8_query("1", (10, 0)) and not serving.fp8_query("0", (9, 0))


def test_fp8_query_setting_is_checked_by_name(monkeypatch):
    from mla_backend_plugin import envs

    monkeypatch.setenv("CUTE_MLA_FP8_QUERY", "yes")
    with pytest.raises(ValueError, match="CUTE_MLA_FP8_QUERY='yes': allowed values are auto, 1, 0"):
        envs.get("CUTE_MLA_FP8_QUERY")


def test_offline_tuner_takes_the_q_an_engine_takes(monkeypatch):
    """`python -m mla_backend_plugin.tune --q-dtype auto` (the default) tunes fp8-cache shapes with the q a vLLM
    engine on that GPU gets under CUTE_MLA_FP8_QUERY: fp8 on SM90 by default, the model dtype elsewhere;
    `model` / `fp8` name one."""
    from mla_backend_plugin import tune

    monkeypatch.delenv("CUTE_MLA_TUNE_SEQ_LENS", raising=False)
    monkeypatch.delenv("CUTE_MLA_FP8_QUERY", raising=False)
    base = ["--kv-dtypes", "fp8", "--batches", "1", "--seq-lens", "1024", "--heads", "128"]

    def q_dtypes(extra, cc):
        return {k.q_dtype for k in tune.shape_keys(tune.parse_args(base + extra), cc)}

    assert q_dtypes([], (9, 0)) == {"fp8"} and q_dtypes([], (10, 0)) == {"bf16"}
    assert q_dtypes(["--q-dtype", "model"], (9, 0)) == {"bf16"} and q_dtypes(["--q-dtype", "fp8"], (10, 0)) == {"fp8"}
    monkeypatch.setenv("CUTE_MLA_FP8_QUERY", "0")  # an engine told to keep the model dtype is tuned with it
    assert q_dtypes([], (9, 0)) == {"bf16"}


def test_runner_scales_as_mla_decode_takes_them(monkeypatch):
    """The runner hands mla_decode an engine's scales in their kernel form, made once per scale tensor (vLLM's
    0-d scales as [1] views), a float as it is, 1.0 for an fp8 q without a scale, None for 16-bit tensors; the
    outputs are mla_decode's with the engine's own scales."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    from mla_backend_plugin.ops import mla_decode

    inp = make_decode_inputs(2, [9, 40], 1, 16, 16, torch.float8_e4m3fn, "fp8", "cpu", seed=3, kv_scale=0.5,
                             q_scale=0.25)
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8")
    kv_scale, q_scale = torch.tensor(0.5), torch.tensor(0.25)  # 0-d, as vLLM's layer._k_scale / _q_scale
    forms = runner._scales(q_scale, kv_scale, True)
    assert [f.shape for f in forms] == [(1,), (1,)] and forms[1].data_ptr() == kv_scale.data_ptr()
    assert runner._scales(q_scale, kv_scale, True) is forms
    assert runner._scales(q_scale, torch.tensor(0.5), True) is not forms  # another tensor: made again
    assert runner._scales(None, 0.5, True) == (1.0, 0.5)
    assert runner._scales(q_scale, kv_scale, False) == (None, forms[1])
    assert serving.DecodeRunner(inp.softmax_scale, "auto")._scales(q_scale, kv_scale, False) == (None, None)
    ws = serving.make_workspace("cpu", max_num_seqs=4, num_speculative_tokens=0, num_heads=16,
                                out_dtype=torch.bfloat16)
    for _ in range(2):
        out, lse = runner.decode(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, q_scale=q_scale,
                                 kv_scale=kv_scale)
    want_out, want_lse = mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, q_scale=0.25, kv_scale=0.5,
                                    out_dtype=torch.bfloat16)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
