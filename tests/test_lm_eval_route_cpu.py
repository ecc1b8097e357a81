"""The real-checkpoint route of the eval (evals/lm_eval_route.py) without lm-eval or a GPU: the lm-eval command of
each backend, reading lm-eval's results JSON, the verdict, and the whole run against a stand-in ``lm_eval``
executable that writes results as lm-eval does."""

from __future__ import annotations

import json
import os
import stat
import sys

from mla_backend_plugin.evals import __main__ as evals_main
from mla_backend_plugin.evals import lm_eval_route

# A stand-in for the lm_eval CLI: writes <output_path>/<model>/results_<n>.json with a gsm8k score per backend
# (from SCORES in its environment), as lm-eval 0.4 lays its results out.
FAKE_LM_EVAL = """#!{python}
import json, os, sys
argv = sys.argv[1:]
opt = {{argv[i]: argv[i + 1] for i in range(0, len(argv) - 1, 2)}}
margs = dict(a.split("=", 1) for a in opt["--model_args"].split(","))
scores = json.loads(os.environ["SCORES"])
backend = margs["attention_backend"]
if backend not in scores:
    sys.exit(3)
out = os.path.join(opt["--output_path"], "models__fake")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "results_2026-11-24T00-00-00.json"), "w") as f:
    json.dump({{"results": {{opt["--tasks"]: {{"alias": "gsm8k", "exact_match,strict-match": scores[backend],
               "exact_match_stderr,strict-match": 0.011, "exact_match,flexible-extract": scores[backend] + 0.01,
               "exact_match_stderr,flexible-extract": 0.011}}}}, "config": {{"model_args": opt["--model_args"]}}}}, f)
"""


def _fake_lm_eval(tmp_path, monkeypatch, scores: dict) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    exe = bindir / "lm_eval"
    exe.write_text(FAKE_LM_EVAL.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SCORES", json.dumps(scores))


def test_the_command_of_one_backend():
    cmd = lm_eval_route.lm_eval_command("/m/V2-Lite", "CUTE_MLA", "gsm8k", "/o", kv_cache_dtype="fp8", limit=200,
                                        model_args="tensor_parallel_size=2,max_model_len=8192")
    assert cmd[:3] == ["lm_eval", "--model", "vllm"]
    margs = cmd[cmd.index("--model_args") + 1]
    assert margs == ("pretrained=/m/V2-Lite,attention_backend=CUTE_MLA,kv_cache_dtype=fp8,"
                     "tensor_parallel_size=2,max_model_len=8192")
    assert cmd[cmd.index("--tasks") + 1] == "gsm8k" and cmd[cmd.index("--limit") + 1] == "200"


def test_the_verdict_uses_the_standard_errors():
    best = (0.80, 0.01)
    assert not lm_eval_route.significantly_below((0.78, 0.01), best)  # 2 points: 1.4 standard errors
    assert lm_eval_route.significantly_below((0.75, 0.01), best)  # 5 points: 3.5 standard errors
    assert lm_eval_route.significantly_below((0.79, None), best)  # no error bars: any shortfall
    assert not lm_eval_route.significantly_below((0.90, 0.01), best)


def test_a_run_through_a_stand_in_lm_eval(tmp_path, monkeypatch, capsys):
    _fake_lm_eval(tmp_path, monkeypatch, {"CUTE_MLA": 0.79, "FLASHMLA": 0.80, "TRITON_MLA": 0.78})
    out = tmp_path / "ok"
    rc = evals_main.main(["--model", str(tmp_path), "--lm-eval-task", "gsm8k", "--backends", "FLASHMLA,TRITON_MLA",
                          "--limit", "50", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out
    md = (out / "results.md").read_text()
    assert "| task | metric | CUTE_MLA | FLASHMLA | TRITON_MLA |" in md
    assert "| gsm8k | exact_match,strict-match | 0.7900 +- 0.0110 | 0.8000 +- 0.0110 | 0.7800 +- 0.0110 |" in md
    assert (out / "results.csv").read_text().count("\n") == 1 + 3 * 2  # header + 3 backends x 2 metrics

    # CUTE_MLA well below vLLM's best: exit 1, the metric named
    _fake_lm_eval(tmp_path / "worse", monkeypatch, {"CUTE_MLA": 0.70, "FLASHMLA": 0.80})
    rc = evals_main.main(["--model", str(tmp_path), "--lm-eval-task", "gsm8k", "--backends", "FLASHMLA",
                          "--out", str(tmp_path / "bad")])
    text = capsys.readouterr().out
    assert rc == 1 and "FAIL: gsm8k exact_match,strict-match: CUTE_MLA 0.7000 vs FLASHMLA 0.8000" in text

    # a backend whose run fails is named in the table; CUTE_MLA's own failure fails the eval
    _fake_lm_eval(tmp_path / "fails", monkeypatch, {"FLASHMLA": 0.80})
    rc = evals_main.main(["--model", str(tmp_path), "--lm-eval-task", "gsm8k", "--backends", "FLASHMLA",
                          "--out", str(tmp_path / "fail")])
    text = capsys.readouterr().out
    assert rc == 1 and "CUTE_MLA failed: lm_eval exit 3" in text
