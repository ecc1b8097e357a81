"""benchmarks/bench_e2e.py without a GPU: the conditions, the model config it writes, and the report it renders
from rows (the GPU run itself is not exercised here)."""

from __future__ import annotations

import json
import os

import pytest
from benchmark_scripts import import_benchmark


def _bench():
    return import_benchmark("bench_e2e")


def test_dry_run_writes_a_deepseek_v3_width_config(tmp_path, capsys):
    bench = _bench()
    args = ["--dry-run", "--out-dir", str(tmp_path), "--backends", "CUTE_MLA,FLASHMLA", "--spec", "0,1"]
    assert bench.main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 2 * 2 * 2 * 3  # backends x spec x contexts x batches
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["hidden_size"] == 7168 and config["num_attention_heads"] == 128
    assert config["kv_lora_rank"] == 512 and config["qk_rope_head_dim"] == 64 and config["q_lora_rank"] == 1536
    assert config["num_hidden_layers"] == config["first_k_dense_replace"] == 4


def test_prompts_have_the_context_length():
    bench = _bench()
    for spec in (0, 1):
        prompts = bench._prompts(3, 1000, spec, 0)
        assert len(prompts) == 3 and all(len(p) == 1000 and min(p) >= 2 for p in prompts)


def test_report_from_rows(tmp_path):
    bench = _bench()
    rows = [{"backend": b, "batch": batch, "context": 1024, "spec": 0, "graphs": True, "step_ms": ms,
             "tokens_per_s": round(batch / ms * 1e3, 1), "start_s": 50.0, "builder_us_per_step": 12.5,
             "forward_mqa_us_per_step": 0.0}
            for b, base in (("CUTE_MLA", 1.0), ("FLASH_ATTN_MLA", 0.9)) for batch, ms in ((1, base), (32, 2 * base))]
    rows.append({"backend": "CUTE_MLA", "start": "cold", "start_s": 86.7})
    rows.append({"backend": "TRITON_MLA", "spec": 0, "error": "boom"})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = bench.render(tmp_path).read_text()
    assert "| CUTE_MLA | 1.000 (1000.0) | 2.000 (16000.0) | 12.5 | 0.0 |" in md
    assert "| CUTE_MLA | cold | 86.7 |" in md and "TRITON_MLA: `boom`" in md
    assert (tmp_path / "results.csv").read_text().count("\n") == len(rows) + 1
    assert "after a prefix-cache hit" not in md  # no row had a tail longer than one token
    rows[0].update(prefix_caching=True, prefix_tail=16, t1_s=0.6213)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = bench.render(tmp_path).read_text()
    assert "| CUTE_MLA | 1024 | 1 | 16 | 0 | 0.6213 |" in md


def test_kernel_profile_rows_render_where_the_step_goes(tmp_path):
    bench = _bench()
    # the union of kernel intervals: overlapping kernels count once, gaps not at all
    assert bench._busy_us([("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("d", 31.0, 1.0)]) == 20.0
    assert bench.ATTENTION_KERNEL.search("flash_fwd_splitkv_mla_kernel") and not bench.ATTENTION_KERNEL.search(
        "sm90_xmma_gemm_bf16bf16")
    row = {"backend": "CUTE_MLA", "batch": 32, "context": 8192, "spec": 0, "graphs": True, "step_ms": 5.0,
           "tokens_per_s": 6400.0, "start_s": 60.0, "gpu_busy_ms": 4.5, "kernel_ms": 4.6, "attention_kernel_ms": 1.25,
           "kernel_launches": 80.0, "top_kernels": [["mla_decode_sm90", 300.0], ["gemm", 200.0]]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    md = bench.render(tmp_path).read_text()
    # an older row (no traced span): idle from the timed step
    assert "| CUTE_MLA | 8192 | 32 | 0 | 5.000 | - | 4.500 | 0.500 | 1.250 | 3.250 | 3.750 | 80.0 | - | - |" in md
    # idle gaps go to the kernel that ends them; overlapping kernels leave none
    assert bench._idle_before([("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 5.0), ("a", 36.0, 1.0)]) == {
        "c": 15.0, "a": 1.0}
    row["idle_before_us"] = [["plan_kernel", 12.5]]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert "- CUTE_MLA S=8192 B=32 n-gram 0: `plan_kernel` 12.5" in bench.render(tmp_path).read_text()
    # a speculative row: the builder runs once per engine step, so 0.5 calls per token = 2 tokens a step
    (tmp_path / "rows.jsonl").write_text(json.dumps(row | {"spec": 1, "builder_calls_per_step": 0.5}) + "\n")
    assert ("- CUTE_MLA S=8192 B=32 n-gram 1: 2.00 tokens per engine step, 10.000 ms per engine step"
            in bench.render(tmp_path).read_text())
    # a traced span: idle from the traced runs themselves
    assert bench._span_us([("a", 2.0, 10.0), ("b", 30.0, 5.0)]) == 33.0
    (tmp_path / "rows.jsonl").write_text(json.dumps({**row, "gpu_span_ms": 4.6}) + "\n")
    md = bench.render(tmp_path).read_text()
    assert "| CUTE_MLA | 8192 | 32 | 0 | 5.000 | 4.6 | 4.500 | 0.100 | 1.250 | 3.250 | 3.750 | 80.0 | - | - |" in md
    assert "`mla_decode_sm90` 300.0" in md
    assert '[[""mla_decode_sm90"", 300.0]' in (tmp_path / "results.csv").read_text()
    assert "against the best in-tree backend" not in md  # no peer in the cell


def test_kernel_profile_attributes_the_difference_to_the_best_peer(tmp_path):
    """Per CUTE_MLA cell, the lowest-step peer of the same cell and KV cache, and the traced step's difference split
    exactly into attention kernels + other kernels + GPU idle, with the builder's host time beside it; fp8 rows are
    labelled and compared only with fp8 rows."""
    bench = _bench()
    host = {"builder_us_per_step": 70.0, "forward_mqa_us_mixed_phase": 2400.0, "forward_mqa_calls_mixed_phase": 8}

    def row(backend, step, span, busy, attention, kv="auto", **extra):
        return {"backend": backend, "batch": 32, "context": 8192, "spec": 0, "graphs": True, "step_ms": step,
                "tokens_per_s": 1.0, "gpu_span_ms": span, "gpu_busy_ms": busy, "kernel_ms": busy,
                "attention_kernel_ms": attention, "kernel_launches": 300.0, "top_kernels": [], "layers": 16,
                "kv_cache_dtype": kv, **extra}

    rows = [row("CUTE_MLA", 6.8, 6.7, 5.0, 2.9, **host),
            row("FLASH_ATTN_MLA", 5.3, 5.25, 4.9, 2.8, builder_us_per_step=40.0),
            row("FLASHMLA", 5.9, 5.8, 5.0, 2.9),  # a slower peer: not the best
            row("CUTE_MLA", 5.0, 4.9, 4.0, 2.0, kv="fp8"), row("FLASHMLA", 4.5, 4.45, 4.1, 2.1, kv="fp8")]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = bench.render(tmp_path).read_text()
    assert ("| CUTE_MLA | 8192 | 32 | 0 | 6.800 | 6.7 | 5.000 | 1.700 | 2.900 | 2.100 | 3.900 | 300.0 | 70.0 | 300.0 |"
            in md)
    # 6.7 - 5.25 = 1.45 traced = 0.1 attention + 0.0 other + 1.35 idle; builder 70 - 40
    assert ("| CUTE_MLA | 8192 | 32 | 0 | FLASH_ATTN_MLA | 1.283 | +1.500 | +1.450 | +0.100 | +0.000 | +1.350 | "
            "+30.0 |") in md
    assert ("| CUTE_MLA fp8 | 8192 | 32 | 0 | FLASHMLA fp8 | 1.111 | +0.500 | +0.450 | -0.100 | +0.000 | +0.550 | - |"
            in md)
    assert md.count("| FLASHMLA | 8192 | 32 | 0 |") == 1  # the fp8 FLASHMLA row has its own label


class _ChunkedPrefillEngine:
    """A stand-in for vLLM's scheduler and clock: each step hands ``budget`` tokens out, one to each decoding
    request first, the rest to prompts in order; a request's first token comes with the end of its prefill. A step
    where the whole batch decodes costs ``decode_s``; a step with prefill costs more (its prefill tokens)."""

    def __init__(self, batch, context, budget, decode_s=0.004, prefill_s_per_token=2e-7, mixed_overhead_s=0.003):
        self.batch, self.context, self.budget = batch, context, budget
        self.decode_s, self.per_token, self.mixed = decode_s, prefill_s_per_token, mixed_overhead_s
        self.now = 0.0

    def clock(self):
        return self.now

    def generate(self, prompts, params, use_tqdm=False):
        left = [self.context] * self.batch  # prompt tokens still to prefill
        made = [0] * self.batch  # tokens generated
        while any(m < params.max_tokens for m in made):
            decoding = [i for i in range(self.batch) if left[i] == 0 and 0 < made[i] < params.max_tokens]
            room = self.budget - len(decoding)
            prefilled = 0
            for i in range(self.batch):
                if left[i] and room:
                    take = min(left[i], room)
                    left[i] -= take
                    room -= take
                    prefilled += take
                    if left[i] == 0:
                        made[i] = 1
            for i in decoding:
                made[i] += 1
            self.now += self.decode_s + (self.mixed + prefilled * self.per_token if prefilled else 0.0)


def test_measure_cell_times_the_steps_where_the_whole_batch_decodes(monkeypatch):
    import argparse

    bench = _bench()
    for batch, context in ((32, 8192), (128, 8192), (4, 1024)):
        engine = _ChunkedPrefillEngine(batch, context, budget=16384)
        monkeypatch.setattr(bench.time, "perf_counter", engine.clock)
        args = argparse.Namespace(max_batched_tokens=16384, repeats=1, worker_backend="X", worker_spec=0,
                                  eager=False, kernel_profile=False)
        row = bench.measure_cell(engine, argparse.Namespace, [None] * batch, None, args, batch, context)
        # the decode step exactly, although the first requests decode during a long mixed phase
        assert abs(row["step_ms"] - 4.0) < 1e-6, (batch, context, row)
        assert row["n_long"] - row["n_short"] == bench.DECODE_STEPS
        # where prompts need several steps to prefill, those steps cost more than a decode step
        assert (row["mixed_step_ms"] > 4.05) == (batch * context > 16384), row


@pytest.mark.parametrize("packaged", [False, True])
def test_start_times_keep_each_start_as_it_finishes(tmp_path, monkeypatch, packaged):
    """A cut-off --start-times run keeps what it measured: every start is on disk before the next one begins.
    CUTE_MLA starts cold, warm, then cold again (emptied caches): without the packaged kernels where the package
    ships them (as a source install starts), else with the background prebuild; every start runs the sweep's
    engine (max_num_seqs = the largest batch)."""
    import argparse

    bench = _bench()
    monkeypatch.setattr(bench, "packaged_kernels", lambda: packaged)
    monkeypatch.delenv("CUTE_MLA_PACKAGED_KERNELS", raising=False)  # conftest's; a start passes the environment on
    second = ("CUTE_MLA_PACKAGED_KERNELS", "0") if packaged else ("CUTE_MLA_PREBUILD", "1")
    seen_on_disk = []
    seen = []

    def fake_run_backend(args, backend, spec, env=None, log_path=None):
        rows_file = tmp_path / "rows.jsonl"
        seen_on_disk.append(len(rows_file.read_text().splitlines()) if rows_file.exists() else 0)
        if backend == "FLASHMLA":
            raise TimeoutError("deadline")
        root = env["VLLM_CACHE_ROOT"].rsplit("/", 1)[0]
        assert env["CUTE_MLA_CUTE_CACHE"].startswith(root) and env["TORCHINDUCTOR_CACHE_DIR"].startswith(root)
        seen.append((env.get(second[0]), os.path.exists(env["VLLM_CACHE_ROOT"]), args.max_num_seqs))
        os.makedirs(env["VLLM_CACHE_ROOT"], exist_ok=True)  # what a start leaves for the next
        log_path.write_text("log")
        return [{"backend": backend, "start_s": 10.0 if len(seen_on_disk) % 2 else 5.0, "graph_capture_s": 3.0}]

    monkeypatch.setattr(bench, "run_backend", fake_run_backend)
    args = argparse.Namespace(backends=["CUTE_MLA", "FLASHMLA"], batches=[1, 32], contexts=[8192], repeats=2,
                              max_num_seqs=None)
    with pytest.raises(TimeoutError):
        bench.start_times(args, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert seen_on_disk == [0, 1, 2, 3]
    assert [(r["backend"], r["start"], r["start_s"]) for r in rows] == [
        ("CUTE_MLA", "cold", 10.0), ("CUTE_MLA", "warm", 5.0), ("CUTE_MLA", f"cold, {second[0]}={second[1]}", 10.0)]
    assert seen == [(None, False, 32), (None, True, 32), (second[1], False, 32)]
    assert all(r["graph_capture_s"] == 3.0 for r in rows)
    assert len(list((tmp_path / "logs").glob("start_CUTE_MLA_*.log"))) == 3


def test_start_phases_from_the_engine_log():
    bench = _bench()
    log = "\n".join([
        "INFO 11-24 [gpu_model_runner.py:5348] Model loading took 6.2 GiB memory and 3.512345 seconds",
        "INFO 11-24 [monitor.py:20] torch.compile took 14.93 s in total",
        "INFO 11-24 [aot.py:308] mla_decode: cute_sm90: compiled cute_sm90 h128 q1 bs16 kv=bf16 q=bf16 out=bf16 qFkF "
        "(pdl on, sm_90a) in this process in 4.2 s",
        "INFO 11-24 [mla_backend_plugin] mla_decode: cute_sm90: bf16_q1 built in the background in 9.5 s (first use "
        "waited 0.0 s)",
        "INFO 11-24 [mla_backend_plugin] mla_decode: cute_sm90: bf16_q2 built in the background in 8.0 s (first use "
        "waited 1.5 s)",
        "INFO 11-25 [aot.py:300] mla_decode: cute_sm90: loaded cute_sm90 h128 q1 bs64 kv=bf16 q=bf16 out=bf16 qFkF "
        "(pdl on, sm_90a) from the package in 0.05 s",
        "INFO 11-25 [aot.py:300] mla_decode: cute_sm90: loaded cute_sm90 h128 q2 bs64 kv=bf16 q=bf16 out=bf16 qFkF "
        "(pdl on, sm_90a) from the cache in 0.04 s",
        "INFO 11-24 [gpu_model_runner.py:6845] Graph capturing finished in 7 secs, took 0.40 GiB",
        "INFO 11-24 [core.py:341] init engine (profile, create kv cache, warmup model) took 31.40 s (compilation: "
        "14.93 s)"])
    assert bench.start_phases(log) == {
        "load_s": 3.5, "torch_compile_s": 14.9, "graph_capture_s": 7.0, "init_engine_s": 31.4,
        "cute_compile_in_process_s": 4.2, "cute_load_packaged_s": 0.1, "cute_background_build_s": 17.5,
        "cute_first_use_wait_s": 1.5}
    assert bench.start_phases("nothing logged") == {}


def test_a_timed_out_engine_keeps_the_cells_it_finished(tmp_path, monkeypatch):
    """A worker cut off by --timeout loses no finished cell: its rows come back with an error row naming the
    timeout, and the worker is told about prefix caching when asked for it."""
    import argparse
    import subprocess

    bench = _bench()
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=b'ROW {"backend": "X", "batch": 1, '
                                        b'"context": 1024, "spec": 0, "step_ms": 2.0}\nmore\n', stderr=None)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(model_dir=str(tmp_path), batches=[1, 32], contexts=[1024], repeats=1,
                              gpu_memory_utilization=0.8, max_batched_tokens=16384, max_num_seqs=None, eager=False,
                              prefix_caching=True, prefix_tail=16, kernel_profile=False, timeout=5,
                              kv_cache_dtype="fp8", tensor_parallel_size=1, decode_context_parallel_size=1,
                              cp_kv_cache_interleave_size=1, block_size=None)
    rows = bench.run_backend(args, "X", 0, log_path=tmp_path / "log")
    assert rows[0]["step_ms"] == 2.0
    assert "timed out" in rows[1]["error"]
    assert "--prefix-caching" in seen["cmd"]
    assert seen["cmd"][seen["cmd"].index("--kv-cache-dtype") + 1] == "fp8"  # the worker runs the asked cache
    assert seen["cmd"][seen["cmd"].index("--prefix-tail") + 1] == "16"
    assert "more" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_cached_prompts_leave_one_token_to_compute(block_size):
    """vLLM reuses the cached blocks of a prompt's first len - 1 tokens (whole blocks only): the prompts of a
    prefix-cached run leave one token per request, a decode step for every backend."""
    bench = _bench()
    for context in (1024, 8192):
        length = bench.prompt_length(context, prefix_caching=True)
        assert length - ((length - 1) // block_size) * block_size == 1
        assert bench.prompt_length(context, prefix_caching=False) == context
        length = bench.prompt_length(context, prefix_caching=True, tail=16)
        assert length - ((length - 1) // block_size) * block_size == 16  # a 16-token short prefill


def test_backend_specs_name_a_kernel_and_environment():
    bench = _bench()
    assert bench.parse_backend("FLASH_ATTN_MLA") == ("FLASH_ATTN_MLA", {})
    assert bench.parse_backend("CUTE_MLA:triton/CUTE_MLA_DECODE_MAX_QUERY_LEN=1") == (
        "CUTE_MLA", {"CUTE_MLA_KERNEL": "triton", "CUTE_MLA_DECODE_MAX_QUERY_LEN": "1"})
    with pytest.raises(ValueError, match="'FOO' is not VAR=VALUE"):
        bench.parse_backend("CUTE_MLA/FOO")


def test_two_gpu_layouts_reach_the_engines_rows_and_report(tmp_path, capsys, monkeypatch):
    """--tensor-parallel-size / --decode-context-parallel-size / --cp-kv-cache-interleave-size: the dry run lists the
    layout, the worker is told it and hands it to vLLM (nothing on one GPU), rows and the report name it (a one-GPU
    row keeps its plain name), and layouts vLLM or our kernels would refuse after an engine start are refused
    before, naming the option and the allowed values."""
    import argparse
    import subprocess

    bench = _bench()
    dcp = ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"]
    assert bench.main(["--dry-run", "--out-dir", str(tmp_path), "--backends", "CUTE_MLA,FLASHMLA,FLASH_ATTN_MLA",
                       "--batches", "32,128", "--contexts", "32768", "--spec", "0", *dcp]) == 0
    cells = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(cells) == 6 and all((c["tp"], c["dcp"], c["interleave"]) == (2, 2, 1) for c in cells)
    ns = argparse.Namespace(tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=64,
                            block_size=64)
    assert bench.parallel_engine_args(ns) == {"tensor_parallel_size": 2, "decode_context_parallel_size": 2,
                                              "cp_kv_cache_interleave_size": 64, "block_size": 64}
    assert bench.parallel_engine_args(argparse.Namespace(tensor_parallel_size=1, decode_context_parallel_size=1,
                                                         cp_kv_cache_interleave_size=1, block_size=None)) == {}
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, stdout='ROW {"backend": "CUTE_MLA", "batch": 32, "context": '
                                           '32768, "spec": 0, "graphs": true, "step_ms": 3.0, "tokens_per_s": 10666.7, '
                                           '"tp": 2, "dcp": 2, "interleave": 64}\n', stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(model_dir=str(tmp_path), batches=[32], contexts=[32768], repeats=1,
                              gpu_memory_utilization=0.8, max_batched_tokens=16384, max_num_seqs=None, eager=False,
                              prefix_caching=True, prefix_tail=1, kernel_profile=False, timeout=5,
                              kv_cache_dtype="auto", **vars(ns))
    rows = bench.run_backend(args, "CUTE_MLA", 0)
    cmd = seen["cmd"]
    for flag, value in (("--tensor-parallel-size", "2"), ("--decode-context-parallel-size", "2"),
                        ("--cp-kv-cache-interleave-size", "64"), ("--block-size", "64")):
        assert cmd[cmd.index(flag) + 1] == value, flag
    rows += [{"backend": "CUTE_MLA", "batch": 32, "context": 32768, "spec": 0, "graphs": True, "step_ms": 5.0,
              "tokens_per_s": 6400.0, "tp": 2, "dcp": 1, "interleave": 1},
             {"backend": "FLASHMLA", "batch": 32, "context": 32768, "spec": 0, "graphs": True, "step_ms": 4.0,
              "tokens_per_s": 8000.0}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = bench.render(tmp_path).read_text()
    assert "| CUTE_MLA tp2 dcp2 i64 | 3.000 (10666.7) | - | - |" in md
    assert "| CUTE_MLA tp2 | 5.000 (6400.0) | - | - |" in md and "| FLASHMLA | 4.000 (8000.0) | - | - |" in md
    for argv, message in (
            (["--tensor-parallel-size", "3", "--decode-context-parallel-size", "2"],
             "the DCP size dividing the TP size"),
            ([*dcp, "--backends", "CUTE_MLA,CUTLASS_MLA"], "CUTLASS_MLA's decode returns no LSE; allowed backends "
                                                           "under DCP: CUTE_MLA, TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA"),
            ([*dcp, "--backends", "FLASHMLA", "--cp-kv-cache-interleave-size", "64", "--spec", "0,1"],
             "vLLM 0.26 refuses it for FLASHMLA; allowed: interleave 1, no speculation, or CUTE_MLA"),
            (["--tensor-parallel-size", "16", "--backends", "CUTE_MLA"],
             "128 heads / 16 x 1 = 8 query heads per call; allowed: 16, 32, 64, 128"),
            (["--tensor-parallel-size", "2", "--kernel-profile"], "allowed: --tensor-parallel-size 1")):
        with pytest.raises(SystemExit):
            bench.main(["--dry-run", "--out-dir", str(tmp_path), *argv])
        assert message in capsys.readouterr().err, argv
    # speculation with interleave > 1 is ours alone; CUTE_MLA takes it
    assert bench.main(["--dry-run", "--out-dir", str(tmp_path), *dcp, "--backends", "CUTE_MLA",
                       "--cp-kv-cache-interleave-size", "64", "--spec", "0,1"]) == 0


def test_budget_gives_each_engine_its_share_and_stops_cleanly(tmp_path, monkeypatch, capsys):
    """--budget-s: an engine may run all but --min-engine-s per engine still to start (at least --min-engine-s, at
    most --timeout); one that would get less is not started, the call's exit status says so (75) and the report
    renders the rows that finished, the cut engine's cells included."""
    bench = _bench()
    assert bench.engine_allowance(500, 1, 560, 200) == 300  # the first of two leaves 200 s to the second
    assert bench.engine_allowance(500, 0, 560, 200) == 500
    assert bench.engine_allowance(500, 0, 300, 200) == 300  # never more than --timeout
    assert bench.engine_allowance(300, 2, 560, 200) == 200  # all cannot fit: the first ones run, the last dropped
    assert bench.engine_allowance(150, 0, 560, 200) is None
    clock = {"now": 0.0}
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock["now"])
    asked = []

    def fake_run_backend(args, backend, spec, env=None, log_path=None, timeout_s=None):
        asked.append((backend, timeout_s))
        clock["now"] += timeout_s  # each engine uses all it is allowed, the last cell cut
        return [{"backend": backend, "batch": 32, "context": 8192, "spec": spec, "graphs": True, "step_ms": 5.0,
                 "tokens_per_s": 6400.0},
                {"backend": backend, "spec": spec, "error": f"timed out after {timeout_s:.0f} s (--budget-s)"}]

    monkeypatch.setattr(bench, "run_backend", fake_run_backend)
    argv = ["--out-dir", str(tmp_path), "--backends", "CUTE_MLA,FLASH_ATTN_MLA,FLASHMLA", "--batches", "32",
            "--contexts", "8192", "--spec", "0", "--budget-s", "500", "--min-engine-s", "180"]
    assert bench.main(argv) == bench.INCOMPLETE
    assert asked == [("CUTE_MLA", 180.0), ("FLASH_ATTN_MLA", 180.0)]  # 500 - 2 x 180 < 180; then 320 - 180
    out = capsys.readouterr().out
    assert "budget: 140 s left (--min-engine-s 180): not starting FLASHMLA n-gram 0" in out
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert sum("step_ms" in r for r in rows) == 2 and (tmp_path / "results.md").exists()
    fresh = tmp_path / "fresh"  # a budget that starts no engine: nothing to render, said so
    assert bench.main([*argv[:1], str(fresh), *argv[2:-4], "--budget-s", "100", "--min-engine-s", "180"]) == (
        bench.INCOMPLETE)
    assert not (fresh / "rows.jsonl").exists() and len(asked) == 2
    assert bench.main(["--report", "--out-dir", str(fresh)]) == 2
    assert "rows.jsonl does not exist" in capsys.readouterr().err
    for argv, message in ((["--budget-s", "0"], "--budget-s 0.0: must be > 0"),
                          (["--budget-s", "100", "--start-times"], "--budget-s with --start-times")):
        with pytest.raises(SystemExit):
            bench.main(["--dry-run", "--out-dir", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
