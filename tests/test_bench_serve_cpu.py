"""benchmarks/bench_serve.py without a GPU: the tokenizer it writes next to the model config, the server and client
commands as vLLM's own parsers read them (and the engine config `vllm serve` would build from them), which
configurations vLLM's backend classes allow, rows.csv's append / resume / skip, the report from a synthetic CSV,
and one whole run of the real `vllm bench serve` client against tests/serve_stub.py standing in for `vllm serve`.

Run as a script (``python tests/test_bench_serve_cpu.py OUT_DIR``) it is the vLLM-side check, in its own interpreter
with the CUDA driver stub and a fake Hopper platform (vLLM's platform state is process-global).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark

HERE = Path(__file__).resolve().parent

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _bench():
    return import_benchmark("bench_serve")


# ---------------------------------------------------------------- the model directory


def test_model_dir_and_tokenizer_round_trip(tmp_path):
    bench = _bench()
    bench.write_model_dir(tmp_path, 2)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["hidden_size"] == 7168 and config["num_attention_heads"] == 128
    assert config["kv_lora_rank"] == 512 and config["num_hidden_layers"] == config["first_k_dense_replace"] == 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.vocab_size == len(tok) == config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert sorted(tok.all_special_ids) == [0, 1, 2] and tok.num_special_tokens_to_add() == 0
    import random

    rng = random.Random(0)
    ids = [rng.randrange(3, config["vocab_size"]) for _ in range(5000)] + [3, config["vocab_size"] - 1]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=True) == ids  # vLLM's random prompts keep their exact length
    assert tok.decode([0, 5, 1], skip_special_tokens=True) == "t5"
    with pytest.raises(ValueError, match="vocab_size 3"):
        bench.write_tokenizer(tmp_path / "bad", 3, 100)


# ---------------------------------------------------------------- arguments


def test_arguments_and_their_errors(capsys):
    bench = _bench()
    args = bench.parse_args(["--dry-run"])
    assert args.shapes == {(2048, 256): ["4", "8", "16", "inf"], (8192, 512): ["1", "2", "4", "inf"]}
    assert args.backends == ["CUTE_MLA", "FLASH_ATTN_MLA", "FLASHMLA"] and args.spec == [0, 1]
    assert args.kv_cache_dtypes == ["auto", "fp8"] and args.layers == 16
    assert bench.parse_rates("inf,0.5,4,4") == ["0.5", "4", "inf"]
    assert bench.max_model_len(args.shapes) == 8960  # 8192 + 512, rounded up to 256, + 256
    smoke = bench.parse_args(["--smoke"])
    assert (smoke.backends, smoke.shapes, smoke.num_prompts, smoke.spec, smoke.kv_cache_dtypes) == (
        ["CUTE_MLA"], {(2048, 256): ["4", "inf"]}, 32, [0], ["auto"])
    assert bench.parse_args(["--smoke", "--backends", "FLASHMLA"]).backends == ["FLASHMLA"]  # explicit wins
    for argv, message in ((["--shapes", "2048"], "--shapes '2048': '2048' is not INPUTxOUTPUT"),
                          (["--shapes", "64x8@1/x"], "--shapes '64x8@1/x'"),
                          (["--rates", "0,4"], "'0' must be > 0"),
                          (["--rates", "fast"], "'fast' is neither a number"),
                          (["--kv-cache-dtypes", "fp16"], "'fp16' is not one of auto, fp8"),
                          (["--spec", "one"], "'one' is not a number of n-gram"),
                          (["--num-prompts", "0"], "--num-prompts 0: must be >= 1"),
                          (["--num-warmups", "-1"], "--num-warmups -1: must be >= 0")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_commands(tmp_path):
    bench = _bench()
    args = bench.parse_args(["--out-dir", str(tmp_path), "--backends", "CUTE_MLA:cute_sm90/CUTE_MLA_X=1"])
    cmd, env = bench.server_command(args, args.backends[0], "fp8", 1, 9001)
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(args.model_dir)]
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "9001" and flags["--attention-backend"] == "CUTE_MLA"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 1
    assert env["CUTE_MLA_KERNEL"] == "cute_sm90" and env["CUTE_MLA_X"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert "--speculative-config" not in bench.server_command(args, "FLASHMLA", "auto", 0, 9001)[0]
    client = bench.client_command(args, 9001, (8192, 512), "inf", tmp_path, "r.json")
    assert client[client.index("--base-url") + 1] == "http://127.0.0.1:9001"
    assert client[client.index("--random-input-len") + 1] == "8192" and "--ignore-eos" in client
    assert client[client.index("--num-warmups") + 1] == "8"
    # the warm-up burst before a server's first row: its prompts at once, short outputs, another seed
    burst = bench.warmup_burst_command(args, 9001, (8192, 512), tmp_path, "b.json")
    flag = {k: burst[burst.index(k) + 1] for k in ("--num-prompts", "--request-rate", "--num-warmups", "--seed",
                                                   "--random-input-len", "--random-output-len")}
    assert flag == {"--num-prompts": "32", "--request-rate": "inf", "--num-warmups": "0",
                    "--seed": str(args.seed + 1), "--random-input-len": "8192",
                    "--random-output-len": str(bench.WARMUP_BURST_OUTPUT)}
    assert bench.parse_args(["--out-dir", str(tmp_path), "--warmup-burst", "0"]).warmup_burst == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--out-dir", str(tmp_path), "--warmup-burst", "-1"])


def test_jit_compiles_inside_a_rows_window():
    """The server log's JIT-monitor warnings whose stamps fall inside a row's window (one second of slack each
    side: the stamps have whole seconds, local time, no year); other lines and other times are not named."""
    bench = _bench()
    log = ("(EngineCore pid=1) INFO 11-29 03:27:59 [jit_monitor.py:79] Kernel JIT monitor activated\n"
           "(EngineCore pid=1) WARNING 11-29 03:28:25 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: rejection_greedy_sample_kernel. This causes a latency spike\n"
           "(EngineCore pid=1) WARNING 11-29 03:28:30 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: mask_empty_context_kernel. This causes a latency spike\n")
    def t(hh, mm, ss):
        return time.mktime((2026, 11, 29, hh, mm, int(ss), 0, 0, -1)) + ss % 1
    assert bench.jit_compiles(log, t(3, 28, 26.5), t(3, 28, 35)) == ["mask_empty_context_kernel"]
    assert bench.jit_compiles(log, t(3, 28, 20), t(3, 28, 35)) == ["rejection_greedy_sample_kernel",
                                                                  "mask_empty_context_kernel"]
    assert bench.jit_compiles(log, t(3, 28, 31.5), t(3, 29, 0)) == []
    assert bench.jit_compiles("", t(3, 28, 0), t(3, 29, 0)) == []


@needs_vllm
def test_commands_parse_with_vllms_parsers_and_backend_classes(tmp_path):
    """The vLLM-side check (the __main__ block below) in its own interpreter."""
    from cuda_driver_stub import env_with_driver

    env = env_with_driver()
    env.update(VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]))
    env.pop("VLLM_ATTENTION_BACKEND", None)
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "PASS" in proc.stdout, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")


def _vllm_check(out_dir: str) -> None:
    from vllm_cpu_harness import install_fake_gpu

    install_fake_gpu()
    from mla_backend_plugin.vllm.register import register

    register()
    bench = _bench()
    args = bench.parse_args(["--out-dir", out_dir])
    bench.write_model_dir(args.model_dir, args.layers)

    # which servers: fp8 KV only where the backend class lists it; n-gram for all three (VARLEN / UNIFORM)
    configs, skipped = bench.configurations(args)
    assert len(configs) == 10 and ("FLASH_ATTN_MLA", "fp8", 0) not in configs, configs
    assert {c[:2] for c in configs} == {("CUTE_MLA", "auto"), ("CUTE_MLA", "fp8"), ("FLASH_ATTN_MLA", "auto"),
                                        ("FLASHMLA", "auto"), ("FLASHMLA", "fp8")}
    assert len(skipped) == 2 and all("FLASH_ATTN_MLA kv=fp8" in s for s in skipped), skipped
    assert bench.backend_support("FLASHMLA")[1:] == (["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"], "UNIFORM")
    assert bench._support_from_source(
        "vllm.v1.attention.backends.mla.flashattn_mla.FlashAttnMLABackend")[1:] == (
        ["auto", "float16", "bfloat16"], "VARLEN")

    # the parsers of vLLM's CLI itself: `vllm serve` and `vllm bench serve` (the same classes in 0.26 and 0.32)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = ServeSubcommand()
    for backend, kv, spec in (("CUTE_MLA", "fp8", 1), ("FLASHMLA", "auto", 0)):
        cmd, _ = bench.server_command(args, backend, kv, spec, 9001)
        parser = FlexibleArgumentParser()
        serve.subparser_init(parser.add_subparsers(dest="subparser"))
        assert cmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
        ns = parser.parse_args(cmd[3:])  # from `serve` on
        serve.validate(ns)
        assert (ns.host, ns.port, ns.load_format, ns.enable_prefix_caching) == ("127.0.0.1", 9001, "dummy", False)
        ns.model = ns.model_tag
        config = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
        assert config.attention_config.backend.name == backend and config.cache_config.cache_dtype == kv
        assert config.model_config.max_model_len == 8960 and config.scheduler_config.max_num_seqs == 128
        assert config.model_config.hf_config.hidden_size == 7168
        if spec:
            assert config.speculative_config.method == "ngram"
            assert config.speculative_config.num_speculative_tokens == spec
        else:
            assert config.speculative_config is None

    parser = FlexibleArgumentParser()
    BenchmarkServingSubcommand.add_cli_args(parser)
    cmd = bench.client_command(args, 9001, (8192, 512), "inf", Path(out_dir), "r.json")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    ns = parser.parse_args(cmd[5:])  # after `bench serve`
    assert (ns.backend, ns.base_url, ns.endpoint, ns.dataset_name) == (
        "vllm", "http://127.0.0.1:9001", "/v1/completions", "random")
    assert (ns.random_input_len, ns.random_output_len, ns.ignore_eos, ns.seed, ns.num_prompts) == (
        8192, 512, True, 0, 64)
    assert ns.request_rate == float("inf") and ns.save_result and ns.result_filename == "r.json"
    assert ns.percentile_metrics == "ttft,tpot,itl,e2el" and ns.metric_percentiles == "50,99"
    assert ns.num_warmups == 8  # first-use costs stay out of the timed requests

    # vLLM's tokenizer loader and random dataset on our tokenizer: exact prompt lengths
    from vllm.benchmarks.datasets.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(args.model_dir))
    requests = RandomDataset(random_seed=0).sample(tokenizer, 3, input_len=2048, output_len=256, range_ratio=0.0)
    assert [r.prompt_len for r in requests] == [2048] * 3
    assert [len(tokenizer.encode(r.prompt)) for r in requests] == [2048] * 3
    # vLLM's server refuses, before tokenising, a prompt longer in characters than its input-token limit times
    # the longest vocabulary entry (renderers/params.py _text_len_check): every shape's longest prompt (5-digit
    # words) passes at the model length the servers get
    for input_len, output_len in bench.parse_shapes("2048x256,8192x512", ["inf"]):
        max_input_tokens = bench.max_model_len([(input_len, output_len)]) - output_len
        prompt = " ".join(f"t{tokenizer.vocab_size - 2 - i}" for i in range(input_len))
        assert len(prompt) <= max_input_tokens * tokenizer.max_chars_per_token, (input_len, output_len)
    print("PASS")


# ---------------------------------------------------------------- rows.csv


def _key(bench, **over) -> dict:
    key = {"backend": "CUTE_MLA", "kv_cache_dtype": "auto", "spec_tokens": 0, "layers": 16, "input_len": 2048,
           "output_len": 256, "request_rate": "4", "num_prompts": 128, "max_num_seqs": 128}
    return {**key, **over}


def test_rows_append_resume_and_skip(tmp_path):
    bench = _bench()
    path = tmp_path / "rows.csv"
    args = bench.parse_args(["--out-dir", str(tmp_path), "--shapes", "2048x256", "--rates", "4,inf"])
    config = ("CUTE_MLA", "auto", 0)
    todo = bench.pending_rows(args, config, bench.done_keys(bench.read_rows(path)))
    assert [(shape, rate) for shape, rate, _ in todo] == [((2048, 256), "4"), ((2048, 256), "inf")]
    bench.append_row(path, {**todo[0][2], "completed": 128, "output_throughput": 1234.5})
    bench.append_row(path, {**todo[1][2], "error": "vllm bench serve exit 1"})
    rows = bench.read_rows(path)
    assert len(rows) == 2 and path.read_text().count("backend,kv_cache_dtype") == 1  # one header
    assert rows[0]["output_throughput"] == "1234.5" and rows[0]["request_rate"] == "4"
    # the finished row is skipped, the errored one runs again
    todo = bench.pending_rows(args, config, bench.done_keys(rows))
    assert [rate for _, rate, _ in todo] == ["inf"]
    bench.append_row(path, {**todo[0][2], "completed": 128})
    assert bench.pending_rows(args, config, bench.done_keys(bench.read_rows(path))) == []
    # other settings are other rows
    more = bench.parse_args(["--out-dir", str(tmp_path), "--shapes", "2048x256", "--rates", "4,inf",
                             "--num-prompts", "32"])
    assert len(bench.pending_rows(more, config, bench.done_keys(bench.read_rows(path)))) == 2
    assert len(bench.pending_rows(args, ("FLASHMLA", "auto", 0), bench.done_keys(bench.read_rows(path)))) == 2
    with pytest.raises(ValueError, match="bogus"):
        bench.append_row(path, {"bogus": 1})
    # a rows.csv written before a column was added is rewritten once with today's columns, its rows kept
    old_fields = [f for f in bench.FIELDS if f != "jit_in_window"]
    older = tmp_path / "older.csv"
    with open(older, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_fields)
        writer.writeheader()
        writer.writerow({**{k: "" for k in old_fields}, **{k: str(v) for k, v in todo[0][2].items()},
                         "tpot_p50_ms": "3.5"})
    bench.append_row(older, {**todo[0][2], "request_rate": "8", "tpot_p50_ms": 4.5, "jit_in_window": "k"})
    again = bench.read_rows(older)
    assert older.read_text().splitlines()[0] == ",".join(bench.FIELDS)
    assert [(r["request_rate"], r["tpot_p50_ms"], r["jit_in_window"]) for r in again] == [("inf", "3.5", ""),
                                                                                          ("8", "4.5", "k")]


def test_row_from_vllm_bench_result():
    bench = _bench()
    result = {"completed": 128, "failed": 0, "duration": 40.123456, "request_throughput": 3.19,
              "output_throughput": 816.7, "total_token_throughput": 7350.1, "median_ttft_ms": 120.0,
              "p99_ttft_ms": 900.0, "median_tpot_ms": 25.5, "p99_tpot_ms": 31.0, "median_itl_ms": 25.0,
              "p99_itl_ms": 60.0, "median_e2el_ms": 6600.0, "p99_e2el_ms": 8000.0, "max_concurrent_requests": 100,
              "spec_decode_acceptance_rate": 41.5, "spec_decode_acceptance_length": 1.41, "errors": []}
    row = bench.row_from_result(result, _key(bench))
    assert row["duration_s"] == 40.1235 and row["tpot_p50_ms"] == 25.5 and row["itl_p99_ms"] == 60.0
    assert row["spec_acceptance_rate"] == 41.5 and not row.get("error")
    failed = bench.row_from_result({"completed": 0, "errors": ["", "Connection refused"]}, _key(bench))
    assert failed["error"] == "no request completed: Connection refused"


# ---------------------------------------------------------------- the report


def _synthetic_rows(bench) -> list[dict]:
    rows = []
    for backend, tpot in (("CUTE_MLA", 20.0), ("FLASH_ATTN_MLA", 21.0), ("FLASHMLA", 22.0)):
        for kv in ("auto", "fp8"):
            if backend == "FLASH_ATTN_MLA" and kv == "fp8":
                continue
            for (i, o), rates in (((2048, 256), ("4", "16", "inf")), ((8192, 512), ("1", "inf"))):
                for n, rate in enumerate(rates):
                    rows.append({**_key(bench, backend=backend, kv_cache_dtype=kv, input_len=i, output_len=o,
                                        request_rate=rate),
                                 "completed": 128, "failed": 0, "duration_s": 30.0, "request_throughput": 4.0 + n,
                                 "output_throughput": 1000.0 * (n + 1) * 20.0 / tpot, "ttft_p50_ms": 100.0,
                                 "ttft_p99_ms": 300.0, "tpot_p50_ms": tpot * (1 + n), "tpot_p99_ms": 2 * tpot,
                                 "itl_p50_ms": tpot, "itl_p99_ms": 3 * tpot, "gpu": "NVIDIA H100 80GB HBM3"})
    return rows


def test_report_from_a_synthetic_csv(tmp_path):
    bench = _bench()
    path = tmp_path / "rows.csv"
    rows = _synthetic_rows(bench)
    stale = {**rows[0], "output_throughput": 1.0}  # measured again later: the later row counts
    rows[1]["jit_in_window"] = "mask_empty_context_kernel"  # named under its group's table
    for row in [stale] + rows:
        bench.append_row(path, row)
    bench.append_row(path, {**_key(bench, backend="FLASHMLA", request_rate="64"), "error": "vllm serve exited with 1"})
    written = bench.render(tmp_path)
    assert [p.name for p in written] == ["results.md", "results.csv", "tpot_vs_throughput.png"]
    md = (tmp_path / "results.md").read_text()
    assert "## 2048 in / 256 out, KV cache model dtype, n-gram 0, 16 layers" in md
    assert "## 8192 in / 512 out, KV cache fp8, n-gram 0, 16 layers" in md
    assert "| CUTE_MLA | 4 | 128/128 | 4.00 | 1000.0 | 100.0 | 300.0 | 20.00 | 40.00 | 20.00 | 60.00 |" in md
    # CUTE_MLA against the best in-tree backend at the same rate: FA3-MLA in bf16, FlashMLA in fp8
    assert "| CUTE_MLA | 4 | 1000.0 | FLASH_ATTN_MLA 952.4 | 1.050 | 20.00 | FLASH_ATTN_MLA 21.00 | 1.050 |" in md
    assert "| CUTE_MLA | 4 | 1000.0 | FLASHMLA 909.1 | 1.100 | 20.00 | FLASHMLA 22.00 | 1.100 |" in md
    assert "FLASHMLA kv=auto n-gram=0 2048x256 rate 64: `vllm serve exited with 1`" in md
    assert md.count("JIT-compiled its own kernels") == 1 and "CUTE_MLA rate 16: mask_empty_context_kernel." in md
    with open(tmp_path / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and all(r["output_throughput"] != "1.0" for r in table)
    png = (tmp_path / "plots" / "tpot_vs_throughput.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert bench.main(["--report-only", "--out-dir", str(tmp_path)]) == 0
    with pytest.raises(FileNotFoundError, match="no rows"):
        bench.render(tmp_path / "empty")
    assert bench.main(["--report-only", "--out-dir", str(tmp_path / "empty")]) == 2


# ---------------------------------------------------------------- a whole run against a stand-in server


@needs_vllm
def test_run_with_vllm_bench_serve_against_a_stub_server(tmp_path, monkeypatch, capsys):
    """The run loop end to end with the real client: the server waited for on /health, one row per rate appended,
    the server's whole process group stopped (its child ignores SIGTERM), the report written; a second run skips
    every row and starts no server; a budget too small for a server start starts none."""
    bench = _bench()
    child_pid_file = tmp_path / "child.pid"

    def stub_command(args, backend, kv, spec, port):
        return [sys.executable, str(HERE / "serve_stub.py"), "--host", bench.HOST, "--port", str(port),
                "--child-pid-file", str(child_pid_file)], {}

    monkeypatch.setattr(bench, "server_command", stub_command)
    monkeypatch.setattr(bench, "unsupported", lambda *a: None)  # vLLM's classes: the subprocess check above
    monkeypatch.setattr(bench.Server, "GRACE_S", 2.0)
    out = tmp_path / "out"
    argv = ["--backends", "CUTE_MLA", "--kv-cache-dtypes", "auto", "--spec", "0", "--shapes", "32x4",
            "--rates", "20,inf", "--num-prompts", "3", "--layers", "2", "--warmup-burst", "2", "--out-dir", str(out)]
    assert bench.main(argv) == 0
    assert "warm-up burst: 2 prompts" in capsys.readouterr().out  # before the first row, not recorded
    rows = bench.read_rows(out / "rows.csv")
    assert [(r["request_rate"], r["completed"], r["error"]) for r in rows] == [("20", "3", ""), ("inf", "3", "")]
    assert all(float(r["output_throughput"]) > 0 and float(r["tpot_p50_ms"]) > 0 for r in rows)
    child = int(child_pid_file.read_text())
    assert not Path(f"/proc/{child}").exists() or "State:\tZ" in Path(f"/proc/{child}/status").read_text()
    assert (out / "results.md").exists() and (out / "plots" / "tpot_vs_throughput.png").exists()

    def no_server(*a, **kw):
        raise AssertionError("a server was started although every row is done")

    monkeypatch.setattr(bench.Server, "__enter__", no_server)
    capsys.readouterr()
    assert bench.main(argv) == 0
    assert "done already: CUTE_MLA kv=auto n-gram=0" in capsys.readouterr().out
    assert len(bench.read_rows(out / "rows.csv")) == 2
    assert bench.main(argv[:-1] + [str(tmp_path / "fresh"), "--budget-s", "30"]) == bench.INCOMPLETE
    assert "not starting CUTE_MLA kv=auto n-gram=0" in capsys.readouterr().out
    # a warm-up burst the budget stops: the call ends as cut by the budget (rows not started, server stopped)
    monkeypatch.undo()
    monkeypatch.setattr(bench, "server_command", stub_command)
    monkeypatch.setattr(bench, "unsupported", lambda *a: None)
    monkeypatch.setattr(bench.Server, "GRACE_S", 2.0)
    real_client = bench.run_client
    monkeypatch.setattr(bench, "run_client", lambda cmd, env, log, timeout: None if "warmup_burst" in log.name
                        else real_client(cmd, env, log, timeout))
    assert bench.main(argv[:-1] + [str(tmp_path / "cut")]) == bench.INCOMPLETE
    assert "stopped the warm-up burst at the budget" in capsys.readouterr().out
    assert not bench.read_rows(tmp_path / "cut" / "rows.csv")


if __name__ == "__main__":
    _vllm_check(sys.argv[1])
