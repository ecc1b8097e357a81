"""The engine-neutral serving half on the CPU: the decode runner with the float32 reference kernel, and its
debug check (``CUTE_MLA_CHECK_DIR``), which the vLLM and SGLang end-to-end GPU tests read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from mla_backend_plugin.ops import serving
from mla_backend_plugin.testing.inputs import make_decode_inputs


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
    runner = serving.DecodeRunner(inp.softmax_scale, "fp8" if kv_dtype == torch.float8_e4m3fn else "auto")
    for _ in range(2):
        runner.decode(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, ws, kv_scale=inp.kv_scale)
    [name] = os.listdir(tmp_path)
    assert name == f"{os.getpid()}.jsonl"
    total = serving.read_check_records(str(tmp_path))
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
    good = serving.reference_check(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, inp.softmax_scale,
                                   out, lse)
    assert good["max_rel_err"] < 1e-2
    wrong = out.clone()
    wrong[1] = 0  # one query row lost
    bad = serving.reference_check(inp.q, inp.kv_caches[0], inp.block_table, inp.seq_lens, inp.softmax_scale,
                                  wrong, lse + 0.5)
    assert bad["max_rel_err"] > 0.05 and bad["max_lse_err"] == pytest.approx(0.5, abs=1e-3)


def test_merge_check_records():
    total = {}
    serving.merge_check_records(total, {"calls": 1, "q_lens": {"1": 1}, "max_rel_err": 0.1})
    serving.merge_check_records(total, {"calls": 1, "q_lens": {"1": 1, "2": 1}, "max_rel_err": 0.05})
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
