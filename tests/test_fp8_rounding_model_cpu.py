"""benchmarks/fp8_rounding_model.py: the float64 model of an fp8 split-KV decode's rounding that docs/perf/
cute_sm90_fp8.md cites. Its split merge must reproduce the float32 reference when nothing is rounded,
and rounding P to e4m3 must cost accuracy, so the model's comparisons measure rounding, not a merge error."""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import BENCHMARKS, import_benchmark

model = import_benchmark("fp8_rounding_model")


@pytest.mark.parametrize("seq_len,q_len", [(200, 1), (129, 2), (64, 3)])
def test_unrounded_splits_merge_to_the_reference(seq_len, q_len):
    exact = model.Scheme(64, 1.0, torch.float64, False, round_p=False)
    schemes = {"exact": exact, "ours": model.SCHEMES["ours"]}
    unrounded = model.max_errors(seq_len, q_len, 5, schemes, heads=16, out_dtype=torch.float64)
    assert unrounded["exact"] <= 1e-5  # the float32 reference's own rounding
    assert unrounded["ours"] > 1e-3  # e4m3 P and bf16 partials are what the model measures
    errs = model.max_errors(seq_len, q_len, 5, schemes, heads=16)
    assert errs["exact"] < errs["ours"] < 0.15  # bf16 output: still below rounded P; within the GPU tests' fp8 atol


def test_cli_prints_one_row_per_cell_and_refuses_unknown_schemes(capsys):
    assert model.main(["--seq-lens", "96", "--seeds", "1,2", "--q-lens", "1", "--heads", "8",
                       "--schemes", "ours,flashmla_like"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 96 ")]
    assert len(rows) == 2 and all(len(r.split("|")) == 7 for r in rows)
    with pytest.raises(SystemExit):
        model.main(["--schemes", "ours,nope"])


def test_bench_inputs_and_the_kernel_read_back_refuse_clearly(capsys, monkeypatch):
    """--inputs bench models bench_decode.py's inputs (a bf16 q rounded per tensor, DeepSeek's softmax scale); the
    GPU read-back names an unknown kernel and refuses to run without a CUDA device."""
    monkeypatch.syspath_prepend(BENCHMARKS)  # the script imports its siblings (peers) where it needs them
    assert model.main(["--seq-lens", "96", "--seeds", "1", "--q-lens", "1", "--heads", "8", "--inputs", "bench",
                       "--schemes", "ours"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 96 ")]
    assert len(rows) == 1 and 0 < float(rows[0].split("|")[4]) < 0.15
    with pytest.raises(SystemExit):
        model.main(["--kernels", "ours,nope"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            model.main(["--kernels", "ours"])
