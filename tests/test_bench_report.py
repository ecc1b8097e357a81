"""The benchmark harness without a GPU: report writers (CSV, JSON, markdown, PNG plots) on fabricated rows, and
the CLI's dry run (grid, kernels, which peers import and why not)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_report_selftest_renders_every_output():
    proc = _run("benchmarks/report.py", "--selftest")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "plots skipped" not in proc.stdout + proc.stderr


def test_bench_dry_run_lists_grid_and_peers():
    proc = _run("benchmarks/bench_decode.py", "--dry-run", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for peer in ("flashmla", "fa3_mla", "triton_mla"):
        assert peer in out, out[-3000:]
    assert "1024" in out and "8192" in out


def test_bench_host_cpu_dry_times_and_profiles_the_serving_path(tmp_path):
    """bench_host.py --cpu-dry: the serving path's Python per call on any machine, a table per cache dtype and a
    cProfile listing per cell whose calls reach mla_decode and cute_sm90's launch (stubbed below the launch)."""
    proc = _run("benchmarks/bench_host.py", "--cpu-dry", "--batches", "1,4", "--seq-lens", "1024", "--iters", "3",
                "--layers", "2", "--profile-top", "40", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "host_results.md").read_text()
    assert table.count("| serving:auto |") == 2 and "## kv fp8, S = 1024" in table
    profiles = (tmp_path / "host_profiles.txt").read_text()
    assert profiles.count("=====") == 4
    assert "(mla_decode)" in profiles and "cute_sm90/launch.py" in profiles
    # every step a batch size no step had (mixed steps): each step's first call decides and plans again
    proc = _run("benchmarks/bench_host.py", "--cpu-dry", "--new-batch-each-step", "--batches", "4", "--seq-lens",
                "1024", "--kv-dtypes", "bf16", "--iters", "3", "--layers", "2", "--profile-top", "40", "--out-dir",
                str(tmp_path / "new"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--new-batch-each-step" in (tmp_path / "new" / "host_results.md").read_text()
    assert "(plan_for)" in (tmp_path / "new" / "host_profiles.txt").read_text()  # the profiled steps planned anew
    # n-gram 1's eager steps: q_lens 1 and 2 recast as token requests once per step, then decoded through them
    proc = _run("benchmarks/bench_host.py", "--cpu-dry", "--mixed-q", "--batches", "4", "--seq-lens", "1024",
                "--iters", "3", "--layers", "2", "--profile-top", "40", "--out-dir", str(tmp_path / "mixed"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "mixed" / "host_results.md").read_text()
    assert table.count("| recast (us per step) |") == 2 and "--mixed-q" in table
    profiles = (tmp_path / "mixed" / "host_profiles.txt").read_text()
    assert "(token_requests)" in profiles and "(mla_decode)" in profiles  # the recast, and the calls taking it
    proc = _run("benchmarks/bench_host.py", "--mixed-q", "--out-dir", str(tmp_path / "bad"))
    assert proc.returncode == 2 and "--cpu-dry options" in proc.stderr


def test_compare_runs_ratios(tmp_path):
    """benchmarks/compare_runs.py: per-cell ratio of one kernel across runs, geomean and extremes."""
    import json

    def run(name, times):
        rows = [dict(kernel="cute_sm90", batch=b, seq_len=1024, q_len=1, kv_dtype="bf16", status="ok", time_us=t)
                for b, t in times.items()]
        rows.append(dict(kernel="triton", batch=1, seq_len=1024, q_len=1, kv_dtype="bf16", status="ok", time_us=1.0))
        d = tmp_path / name
        d.mkdir()
        (d / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
        return str(d)

    a = run("a", {1: 10.0, 8: 20.0, 64: 40.0})
    b = run("b", {1: 11.0, 8: 20.0, 64: 20.0, 128: 5.0})
    proc = _run("benchmarks/compare_runs.py", a, b, "--show", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    geo = (1.1 * 1.0 * 0.5) ** (1 / 3)
    assert f"b / a: 3 cells, time ratio geomean {geo:.4f}, min 0.500, max 1.100" in proc.stdout, proc.stdout
    assert "slower  (1, 1024, 1, 'bf16'): 10.0 -> 11.0 us (1.100)" in proc.stdout
    # a run of --ours-fp8-q fp8 labels the kernel cute_sm90/fp8q: --kernel cute_sm90 finds it
    for d in (a, b):
        path = tmp_path / d / "results.json"
        path.write_text(path.read_text().replace('"cute_sm90"', '"cute_sm90/fp8q"'))
    proc = _run("benchmarks/compare_runs.py", a, b, "--show", "1")
    assert f"b / a: 3 cells, time ratio geomean {geo:.4f}" in proc.stdout, proc.stdout + proc.stderr


def test_bench_candidates_dry_run_expands_configs():
    """--candidates: 'auto' beside one runner per launch config (kernel:config), n/a where a config is not one of
    the kernel's for the cell (the fp8 designs in bf16 cells)."""
    proc = _run("benchmarks/bench_decode.py", "--dry-run", "--candidates", "--peers", "none", "--batches", "1",
                "--seq-lens", "1024", "--q-lens", "1", "--kv-dtypes", "bf16,fp8", "--assume-sm", "90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for name in ("auto", "cute_sm90:auto seesaw pdl", "cute_sm90:auto splits<=64 seesaw pdl",
                 "cute_sm90:auto dequant pdl",
                 "triton:uniform splits<=64 tile 64x64x8x2 no-pdl"):
        assert f"  {name} " in out, out[-4000:]
    assert "not one of cute_sm90's configs for this cell" in out


def test_autotune_summary_compares_auto_with_the_best_fixed_candidate():
    import importlib
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        report = importlib.import_module("report")
    finally:
        sys.path.pop(0)
    cell = dict(seq_len=1024, q_len=1, kv_dtype="bf16", num_heads=128, block_size=64)
    rows = []
    for batch, times in ((1, {"auto": 10.2, "cute_sm90:balanced pdl": 10.0, "triton:balanced no-pdl": 12.0}),
                         (64, {"auto": 110.0, "cute_sm90:balanced pdl": 100.0, "triton:balanced no-pdl": 150.0})):
        for kernel, t in times.items():
            row = report.new_row(kernel, report.OURS, dict(cell, batch=batch), "bf16", report.OK, "")
            row["time_us"] = t
            rows.append(row)
    rows.append(report.new_row("flashmla", report.PEER, dict(cell, batch=1), "bf16", report.OK, ""))
    rows[-1]["time_us"] = 1.0
    summary = report.autotune_summary(rows)
    assert [(e["batch"], e["best"], round(e["ratio"], 3), e["within"]) for e in summary] == [
        (1, "cute_sm90:balanced pdl", 1.02, True), (64, "cute_sm90:balanced pdl", 1.1, False)]
    text = "\n".join(report.render_autotune(summary))
    assert "1 of 2 cells within 3%" in text and "| 1.100 **!** |" in text


def test_tune_cli_dry_run_lists_shapes_candidates_and_reasons():
    proc = _run("-m", "mla_backend_plugin.tune", "--dry-run", "--assume-cc", "10.0", "--model",
                "examples/tiny_deepseek/model", "--tp", "8", "--batches", "3", "--seq-lens", "3000",
                "--kv-dtypes", "bf16,fp8", "--block-size", "16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert ("2 shapes on compute capability 10.0; kernels timed: flashinfer_cute_dsl, cute_sm100, triton, "
            "flashinfer_trtllm") in out
    assert "sm100 kv=bf16 q=bf16 out=bf16 h16 q_len=1 bs16 pair scales=none B<=4 S<=4096" in out  # 128 heads / 8
    if "import flashinfer.mla failed" in out or "flashinfer-python is not installed" in out:
        return  # FlashInfer's refusals past the import need an importable flashinfer (vLLM installs it)
    assert "n/a flashinfer_trtllm: trtllm-gen needs block size 32 or 64, the cache has 16" in out
    assert "needs q in the cache's dtype" in out  # fp8 cache with vLLM's default bf16 q


def test_model_schedules_table():
    """benchmarks/model_schedules.py: every cell of its table is bounded below by the ideal, longest first is never
    slower than the order of w, and a persistent contiguous-share grid is within 4% of the ideal plus two pieces'
    fixed cost on uniform batches of 8 or more (a slot holds at most two pieces there)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import model_schedules
    finally:
        sys.path.pop(0)
    table = list(model_schedules.rows(heads=128, q_len=1, sms=132))
    assert len(table) == 30
    for kind, batch, _, by_w, lpt, contiguous, ideal in table:
        assert ideal <= contiguous and ideal <= lpt <= by_w
        if kind == "none" and batch >= 8:
            assert contiguous <= 1.04 * ideal + 2 * model_schedules.PIECE_COST + model_schedules.LAUNCH_COST


def test_mma_dtype_of_every_runner_in_fp8_and_bf16_cells():
    """The floor a row gets follows the MMA dtype its kernel runs: cute_sm90 by its fp8 design (the default picks
    design A for a 16-bit q at batch <= 2, design B otherwise), Triton widens the cache, FlashMLA runs fp8 wgmma,
    FlashInfer's SM90 kernel dequantises to bf16; every benchmarkable kernel of ours declares its dtype."""
    from benchmark_scripts import import_benchmark

    bench = import_benchmark("bench_decode")
    from mla_backend_plugin.ops.manifest import LaunchConfig

    sm90 = (9, 0)
    fp8_big, fp8_small = bench.Cell(64, 8192, 1, "fp8"), bench.Cell(1, 8192, 1, "fp8")
    bf16 = bench.Cell(64, 8192, 1, "bf16")
    cute = bench.OurKernel("cute_sm90", "bf16", False)
    cute_fp8q = bench.OurKernel("cute_sm90", "fp8", True)
    assert cute.mma_dtype(fp8_big, sm90) == "fp8" and cute.mma_dtype(fp8_small, sm90) == "bf16"
    assert cute_fp8q.mma_dtype(fp8_small, sm90) == "fp8" and cute.mma_dtype(bf16, sm90) == "bf16"
    dequant = bench.OurKernel("cute_sm90", "bf16", False, config=LaunchConfig(fp8_design="dequant"))
    assert dequant.mma_dtype(fp8_big, sm90) == "bf16"
    assert bench.OurKernel("triton", "fp8", True).mma_dtype(fp8_big, sm90) == "bf16"
    assert bench.OurKernel("xqa_sm120", "bf16", False).mma_dtype(fp8_big, sm90) == "fp16"
    assert bench.OurKernel("xqa_sm120", "bf16", False).mma_dtype(fp8_big, (12, 0)) == "fp8"
    assert bench.TunedAuto((), 0.1, False).mma_dtype(fp8_big, sm90) == bench.report.MMA_UNKNOWN
    # --launch-config: each cell's default config with fields replaced, a runner of its own beside the default
    args = bench.parse_args(["--kernels", "cute_sm90", "--peers", "none", "--launch-config", '{"min_chunk": 64}'])
    runners = bench.build_runners(args, sm90, [fp8_big])
    assert [r.name for r in runners] == ["cute_sm90/fp8q", "cute_sm90[min_chunk=64]/fp8q"]
    chunk64 = runners[1]
    assert chunk64.config_for(fp8_big, sm90) == dataclasses.replace(
        bench.KERNELS["cute_sm90"].default_config(bench.meta_args(fp8_big, "fp8"), sm90), min_chunk=64)
    assert chunk64.config_for(fp8_big, sm90).fp8_design == "fp8seesaw" and chunk64.mma_dtype(fp8_big, sm90) == "fp8"
    assert runners[0].config_for(fp8_big, sm90) is None  # the default: chosen per call
    args = bench.parse_args(["--kernels", "cute_sm90", "--peers", "none", "--launch-config", '{"l2_prefetch": 1}',
                             "--launch-config", '{"l2_prefetch": 2}'])  # repeated: a row per JSON
    assert [r.name for r in bench.build_runners(args, sm90, [fp8_big])] == [
        "cute_sm90/fp8q", "cute_sm90[l2_prefetch=1]/fp8q", "cute_sm90[l2_prefetch=2]/fp8q"]
    design_a = bench.OurKernel("cute_sm90", "bf16", False, overrides={"fp8_design": "dequant"})
    assert design_a.mma_dtype(fp8_big, sm90) == "bf16"
    for bad in ('{"min_chunks": 64}', "[1]", "{}", '{"split_plan": "nope"}', "nope"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--launch-config", bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--launch-config", '{"min_chunk": 64}', "--candidates"])
    peers = bench.PEERS
    assert peers["flashmla"].mma_dtype(fp8_big, sm90) == "fp8" and peers["flashmla"].mma_dtype(bf16, sm90) == "bf16"
    assert peers["flashinfer_mla"].mma_dtype(fp8_big, sm90) == "bf16"
    assert peers["flashinfer_mla"].mma_dtype(fp8_big, (10, 0)) == "fp8"
    assert peers["triton_mla"].mma_dtype(fp8_big, sm90) == "bf16"
    for kernel in bench.available_kernels():
        if kernel in bench.NOT_BENCHMARKED_KERNELS:
            continue
        args = bench.meta_args(fp8_big, "fp8")
        cc = (12, 0) if kernel == "xqa_sm120" else (10, 0) if "sm100" in kernel or "flashinfer" in kernel else sm90
        config = bench.LaunchConfig() if kernel != "cute_sm90" else None
        assert bench.our_mma_dtype(kernel, config, args, cc) in bench.report.MMA_DTYPES, kernel
    try:
        bench.our_mma_dtype("no_such_kernel", bench.LaunchConfig(), bench.meta_args(fp8_big, "fp8"), sm90)
    except ValueError as e:
        assert "FP8_CACHE_MMA_DTYPES" in str(e)
    else:
        raise AssertionError("an undeclared kernel got an MMA dtype")


def test_bench_dry_run_names_each_kernels_mma_dtype():
    proc = _run("benchmarks/bench_decode.py", "--dry-run", "--quick", "--kernels", "cute_sm90", "--ours-fp8-q",
                "fp8,bf16", "--peers", "flashmla", "--assume-sm", "90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "MMA dtype: fp8 in 8 fp8 cell(s)" in out, out[-3000:]  # cute_sm90/fp8q: design B in every fp8 cell
    assert "MMA dtype: bf16 in 8 bf16 cell(s); bf16 in 4 fp8 cell(s); fp8 in 4 fp8 cell(s)" in out  # A at B=1
    assert "MMA dtype: bf16 in 8 bf16 cell(s); fp8 in 8 fp8 cell(s)" in out  # flashmla (block 64, every B)


def test_ncu_summary_picks_the_budget_metrics(tmp_path):
    """benchmarks/ncu_decode.py --summarize: the budget's metrics and the largest stall reasons out of an ncu raw
    CSV export (ncu's own ==PROF== lines skipped), and a clear message for a file that is not one."""
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
              "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
              "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "smsp__warps_eligible.avg.per_cycle_active",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"]
    units = ["", "", "us", "%", "%", "", "warp", "ratio", "ratio", "ratio"]
    row = ["0", "kernel_Sm90MlaDecodeFp8Mma", "448.2", "41.6", "55.0", "1,234,567", "0.51", "4.7", "1.2", "9.9"]
    raw = tmp_path / "raw.csv"
    raw.write_text("==PROF== Disconnected\n" + "\n".join(",".join(f'"{v}"' for v in r) for r in (header, units, row)))
    proc = _run("benchmarks/ncu_decode.py", "--summarize", str(raw))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for text in ("kernel_Sm90MlaDecodeFp8Mma", "gpu__time_duration.sum", "448.2", "41.6", "55.0", "1,234,567",
                 "0.51"):
        assert text in out, out
    stalls = out[out.index("stalls per issued instruction"):]
    assert stalls.index("long_scoreboard") < stalls.index("barrier") and "not_issued" not in stalls
    assert "(no metric matching" in out  # e.g. no launch__ metrics in this export: said, not hidden
    bad = tmp_path / "bad.csv"
    bad.write_text("nothing\n")
    proc = _run("benchmarks/ncu_decode.py", "--summarize", str(bad))
    assert proc.returncode != 0 and "no ncu raw CSV" in proc.stderr


def test_several_block_sizes_time_each_kernel_at_each_page_size():
    """--block-sizes 16,64: every cell at each page size (a peer that needs 64 says so at 16), one markdown section
    per (KV, q_len, page size)."""
    import importlib

    proc = _run("benchmarks/bench_decode.py", "--dry-run", "--kernels", "cute_sm90", "--peers", "flashmla",
                "--batches", "8", "--seq-lens", "1024", "--q-lens", "1", "--kv-dtypes", "bf16",
                "--block-sizes", "16,64", "--assume-sm", "90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 cells" in proc.stdout and "block size 16/64" in proc.stdout, proc.stdout[-3000:]
    assert "FlashMLA needs block size 64, cell has 16" in proc.stdout, proc.stdout[-3000:]

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        report = importlib.import_module("report")
    finally:
        sys.path.pop(0)
    rows = []
    for page, t in ((16, 30.0), (64, 20.0)):
        cell = dict(batch=8, seq_len=1024, q_len=1, kv_dtype="bf16", num_heads=128, block_size=page)
        rows.append(report.new_row("cute_sm90", report.OURS, cell, "bf16", report.OK, ""))
        rows[-1]["time_us"] = t
    md = report.render_markdown(rows, {})
    assert "## KV bf16, q_len 1, block 16" in md and "## KV bf16, q_len 1, block 64" in md
    one = report.render_markdown(rows[1:], {})
    assert "## KV bf16, q_len 1\n" in one and "block 64" not in one
