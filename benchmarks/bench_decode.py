"""Benchmark of MLA decode: every registered kernel of ours against vLLM 0.26's MLA decode kernels.

    python benchmarks/bench_decode.py                   # standard grid, all our kernels, default peers
    python benchmarks/bench_decode.py --quick           # a subset (< 2 minutes on an H100)
    python benchmarks/bench_decode.py --with-flashinfer # + FlashInfer (JIT-compiles with nvcc first)
    python benchmarks/bench_decode.py --dry-run         # grid, kernels and peers with reasons; no GPU needed
    python benchmarks/bench_decode.py --ragged one-long # ragged batches: one request of S, the rest short
    python benchmarks/bench_decode.py --candidates --peers none   # the autotuner: tuned `auto` beside every
                                                        # fixed candidate (kernel:config) of the tuner's set

Per cell (batch B, KV length S, q_len, KV dtype): inputs are built once (mla_backend_plugin.testing) and shared
by every kernel; each kernel's output is checked against the package's float32 reference (a wrong kernel is
reported, not timed); each correct kernel is captured in a CUDA graph that cycles through enough copies of the
KV cache that L2 cannot serve them; graphs of all kernels are replayed interleaved and timed with CUDA events
(the package's timing core, mla_backend_plugin.ops.timing, which the tuner uses too). Results go to
results.csv / results.json / results.md / plots/*.png (see benchmarks/README.md).

With ``--candidates`` each of our kernels becomes one runner per launch config it lists (``configs()``), named
``kernel:config``, and a runner ``auto`` calls ``mla_decode(kernel="auto")`` after the autotuner has tuned the
cell's shape (or found it in the tuning cache, ``CUTE_MLA_TUNE_CACHE``) with the cell's S as the context
profile; results.md then compares auto with the best fixed candidate per cell and notes the tuning time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import peers
import report
import torch
from peers import PEERS, Cell, PeerCall, cell_inputs, check_against_reference

from mla_backend_plugin import envs
from mla_backend_plugin.ops import autotune, registry, serving, tuned
from mla_backend_plugin.ops.api import mla_decode, prepare_args
from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_HEAD_DIM
from mla_backend_plugin.ops.manifest import LaunchConfig
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY
from mla_backend_plugin.ops.registry import KERNELS, available_kernels
from mla_backend_plugin.ops.timing import (
    calls_per_graph_for,
    capture_graph,
    kv_copies_for,
    measure_bf16_flops_per_s,
    measure_fp8_flops_per_s,
    measure_hbm_bytes_per_s,
    time_graphs,
)
from mla_backend_plugin.ops.workspace import MLAWorkspace, StepPlans
from mla_backend_plugin.testing import DecodeInputs

GRIDS = {
    "standard": dict(batches=(1, 8, 32, 64, 128, 256), seq_lens=(1024, 4096, 8192, 32768), q_lens=(1, 2),
                     kv_dtypes=("bf16", "fp8")),
    # Few shapes so that few Triton specialisations compile, one short and one long context per batch.
    "quick": dict(batches=(1, 64), seq_lens=(1024, 8192), q_lens=(1, 2), kv_dtypes=("bf16", "fp8")),
}
DEFAULT_TIME_PER_KERNEL_S = {"standard": 0.25, "quick": 0.05}
DEFAULT_PEERS = tuple(name for name, peer in PEERS.items() if not peer.opt_in)
NOT_BENCHMARKED_KERNELS = ("reference",)  # host loop, not CUDA-graph safe
H100_L2_BYTES = 50 * 2**20  # for --dry-run without a GPU
# Device memory a cell needs beyond its KV copies, per query row (token x head): fp32 split-KV partials of
# the kernels (FA3 alone keeps 32 under CUDA graphs), outputs and the float32 reference; plus a fixed margin.
SCRATCH_FP32_ROWS_PER_QUERY_ROW = 64
CELL_MEMORY_MARGIN_BYTES = 2 * 2**30


RAGGED_KINDS = ("none", "one-long", "long-tail")


def ragged_seq_lens(kind: str, batch: int, max_len: int, short: int, seed: int) -> list[int]:
    """Per-request KV lengths of a ragged cell whose longest request has ``max_len`` (the cell's S).

    one-long: request 0 has max_len, the others min(short, max_len) (e.g. one 32k request among 1k ones);
    long-tail: request 0 has max_len, the others log-normal with median max_len / 16 (sigma 1.2), clipped to
    [1, max_len], the same for a given seed.
    """
    import random

    if kind == "one-long":
        return [max_len] + [min(short, max_len)] * (batch - 1)
    if kind == "long-tail":
        rng = random.Random(seed * 1_000_003 + batch * 7919 + max_len)
        median = max(1.0, max_len / 16)
        return [max_len] + [min(max_len, max(1, int(rng.lognormvariate(math.log(median), 1.2))))
                            for _ in range(batch - 1)]
    raise ValueError(f"unknown ragged kind {kind!r}")


class FatalCudaError(RuntimeError):
    """A kernel broke the CUDA context (e.g. an illegal address): nothing after it can be trusted."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows  # the cell's rows so far, the culprit's marked "error"


# ----------------------------------------------------------------------------------------------------------
# Our kernels, behind the same interface as the peers (peers.Peer)
# ----------------------------------------------------------------------------------------------------------

def meta_args(cell: Cell, q_dtype_name: str):
    """DecodeArgs of the cell's shapes on meta tensors (no device memory), as our runners call mla_decode."""
    meta = torch.device("meta")
    q_dtype = peers.TORCH_DTYPES[q_dtype_name]
    q = torch.empty(cell.tokens, cell.num_heads, QK_HEAD_DIM, dtype=q_dtype, device=meta)
    kv = torch.empty(cell.num_blocks, cell.block_size, QK_HEAD_DIM, dtype=peers.TORCH_DTYPES[cell.kv_dtype],
                     device=meta)
    block_table = torch.empty(cell.batch, cell.pages_per_request, dtype=torch.int32, device=meta)
    seq_lens = torch.empty(cell.batch, dtype=torch.int32, device=meta)
    one = torch.ones(1, device=meta)
    return prepare_args(q, kv, block_table, seq_lens, softmax_scale=1.0,
                        q_scale=one if q_dtype == peers.FP8_DTYPE else None,
                        kv_scale=one if cell.kv_dtype == "fp8" else None, out_dtype=torch.bfloat16)


# Operand dtype of our kernels' tensor-core products with an fp8 cache (report.MMA_DTYPES); with a 16-bit cache
# every kernel of ours runs its MMAs in the cache's dtype. cute_sm90 follows its fp8 design (fp8mma, "design B":
# e4m3 wgmma for Q K^T, on q split into e4m3 hi + lo when q is 16-bit, and for P V on a transposed V; dequant,
# "design A": the tile widened to 16 bits); triton widens the cache to q's 16-bit dtype before tl.dot; xqa_sm120
# runs the native e4m3 mma on SM120/121 and emulates it with f16 HMMA in its sm_90a build; cute_sm100 and the
# FlashInfer SM100 adapters run e4m3 MMAs (kind::f8f6f4 / trtllm-gen).
FP8_CACHE_MMA_DTYPES = {
    "triton": "bf16",
    "cute_sm100": "fp8",
    "flashinfer_cute_dsl": "fp8",
    "flashinfer_trtllm": "fp8",
    "flashinfer_xqa": "fp8",  # FlashInfer's SM120 XQA MLA kernel: e4m3 mma.sync with an e4m3 cache and q
}


def our_mma_dtype(kernel: str, config: LaunchConfig | None, args, cc) -> str:
    """The MMA dtype ``kernel`` runs for the call ``args`` (meta tensors) under ``config`` (None: its default)."""
    if args.kv_dtype != peers.FP8_DTYPE:
        return "fp16" if args.q_dtype == torch.float16 else "bf16"
    if kernel == "cute_sm90":
        chosen = config or KERNELS[kernel].default_config(args, tuple(cc) if cc else None)
        return "fp8" if (chosen.fp8_design or "fp8mma") in ("fp8mma", "fp8seesaw") else "bf16"
    if kernel == "xqa_sm120":
        return "fp8" if cc is not None and cc[0] == 12 else "fp16"
    if kernel not in FP8_CACHE_MMA_DTYPES:
        raise ValueError(f"kernel {kernel!r}: its MMA dtype with an fp8 cache is not declared; add it to "
                         f"FP8_CACHE_MMA_DTYPES (known: cute_sm90, xqa_sm120, {', '.join(FP8_CACHE_MMA_DTYPES)})")
    return FP8_CACHE_MMA_DTYPES[kernel]


class OurKernel:
    """One of our kernels (its default config, or one ``config`` of its ``configs()``: ``kernel:config``; or, with
    ``overrides`` (--launch-config), its default config of each cell with those fields replaced)."""

    kind = report.OURS

    def __init__(self, kernel: str, fp8_query: str, shadowed_in_bf16_cells: bool, config: LaunchConfig | None = None,
                 plan_per_call: bool = False, overrides: dict | None = None):
        self.kernel = kernel
        self.config = config
        self.overrides = overrides or None
        if self.overrides and config is not None:
            raise ValueError("OurKernel: a config of configs() or overrides of the default config, not both")
        self.plan_per_call = plan_per_call  # --plan-per-call
        self.fp8_query = fp8_query  # the q dtype this variant takes in fp8-KV cells
        # an fp8-q variant next to the bf16-q one runs the same thing in bf16-KV cells: run it once
        self.shadowed_in_bf16_cells = shadowed_in_bf16_cells
        base = kernel if config is None else KERNELS[kernel].label(config)
        if self.overrides:
            base += "[" + ",".join(f"{k}={v}" for k, v in sorted(self.overrides.items())) + "]"
        self.name = base if fp8_query == "bf16" else f"{base}/fp8q"
        self.description = KERNELS[kernel].description

    def config_for(self, cell: Cell, cc) -> LaunchConfig | None:
        """The config this runner launches ``cell`` with (None: the kernel's default, chosen per call)."""
        if not self.overrides:
            return self.config
        args = meta_args(cell, self.query_dtype(cell, cc))
        default = KERNELS[self.kernel].default_config(args, tuple(cc) if cc else None)
        return dataclasses.replace(default, **self.overrides)

    def available(self) -> tuple[bool, str]:
        return (True, "registered") if torch.cuda.is_available() else (False, "no CUDA device here")

    def query_dtype(self, cell: Cell, cc) -> str:
        return self.fp8_query if cell.kv_dtype == "fp8" else "bf16"

    def mma_dtype(self, cell: Cell, cc) -> str:
        return our_mma_dtype(self.kernel, self.config_for(cell, cc), meta_args(cell, self.query_dtype(cell, cc)), cc)

    def unsupported_reason(self, cell: Cell, cc) -> str | None:
        """The registry's own verdict, on meta tensors of the cell's shapes (no device memory)."""
        if cc is None:
            return "needs a CUDA device"
        if self.shadowed_in_bf16_cells and cell.kv_dtype == "bf16":
            return f"same run as {self.kernel} in bf16-KV cells"
        try:
            args = meta_args(cell, self.query_dtype(cell, cc))
        except ValueError as e:
            return str(e)
        spec = KERNELS[self.kernel]
        reason = spec.unsupported_reason(args, tuple(cc))
        if reason is None and self.config is not None and self.config not in spec.configs(args, tuple(cc)):
            reason = f"not one of {self.kernel}'s configs for this cell"
        return reason

    def prepare(self, cell: Cell, inputs: DecodeInputs) -> PeerCall:
        q, q_scale = inputs.query(self.query_dtype(cell, None))
        kv_scale = inputs.kv_scale_tensor()
        # as the serving backends make it (room for every split cap a config may ask for)
        workspace = MLAWorkspace(inputs.device, max_batch=cell.batch, max_q_len=cell.q_len,
                                 num_heads=cell.num_heads, split_capacity=SPLIT_CAPACITY)
        out = torch.empty(cell.tokens, cell.num_heads, KV_LORA_RANK, dtype=torch.bfloat16, device=inputs.device)
        lse = torch.empty(cell.tokens, cell.num_heads, dtype=torch.float32, device=inputs.device)

        # the calls of one graph stand for the layers of one decode step, as a serving backend makes them: one
        # StepPlans, so a kernel with a step-plan kernel (cute_sm90) plans once per graph replay, where the
        # peers' scheduler metadata is made once in prepare (--plan-per-call: every call plans for itself)
        step = None if self.plan_per_call else StepPlans()

        config = self.config_for(cell, torch.cuda.get_device_capability(inputs.device))

        def launch(i):
            return mla_decode(q, inputs.kv_caches[i], inputs.block_table, inputs.seq_lens,
                              softmax_scale=inputs.softmax_scale, q_scale=q_scale, kv_scale=kv_scale,
                              out=out, lse=lse, workspace=workspace, kernel=self.kernel, config=config,
                              step=step)

        return PeerCall(launch, lambda raw: raw)


class TunedAuto(OurKernel):
    """``mla_decode(kernel="auto")`` after the autotuner timed this cell's shape over ``kernels`` (or found it in
    the tuning cache), with the cell's S as the deployment's context profile (what a CUDA graph captures)."""

    def __init__(self, kernels: tuple[str, ...], tune_time_s: float, retune: bool):
        self.kernel, self.config, self.fp8_query, self.shadowed_in_bf16_cells = report.AUTO, None, "bf16", False
        self.name = report.AUTO
        self.description = f"mla_decode(kernel='auto') tuned per cell over {', '.join(kernels) or '-'}"
        self.kernels, self.tune_time_s, self.retune = kernels, tune_time_s, retune
        self.tunings: list[dict] = []  # per cell: shape, seconds, from the cache or not, winner

    def unsupported_reason(self, cell: Cell, cc) -> str | None:
        return "needs a CUDA device" if cc is None else None

    def mma_dtype(self, cell: Cell, cc) -> str:
        return report.MMA_UNKNOWN  # the tuned winner's: its own row of the cell (kernel:config) says which

    def prepare(self, cell: Cell, inputs: DecodeInputs) -> PeerCall:
        q, q_scale = inputs.query("bf16")
        kv_scale = inputs.kv_scale_tensor()
        device = inputs.device
        cc = torch.cuda.get_device_capability(device)
        args = prepare_args(q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, softmax_scale=1.0,
                            q_scale=q_scale, kv_scale=kv_scale)
        key = tuned.ShapeKey.of(args, cc, cell.seq_len)
        cache = tuned.cache_for(device)
        t0 = time.monotonic()
        report_ = autotune.tune_keys([key], device, cache=cache, force=self.retune, kernels=self.kernels,
                                     time_per_candidate=self.tune_time_s)
        seconds = time.monotonic() - t0
        result = report_["results"][0] if report_["results"] else None
        cold = report_["tuned"] > 0
        self.tunings.append({"cell": cell.label(), "shape": key.id(), "cold": cold, "seconds": round(seconds, 2),
                             "winner": result.labels.get(result.winner) if result and result.winner else None})
        tuned.set_seq_profile([cell.seq_len])
        call = super().prepare(cell, inputs)  # mla_decode(kernel="auto"): the lookup under capture
        winner = result.labels.get(result.winner, "?") if result and result.winner else "static"
        call.note = f"{winner}; {'tuned' if cold else 'cache'} {seconds:.1f} s"
        return call


# ----------------------------------------------------------------------------------------------------------
# Device peaks and timing
# ----------------------------------------------------------------------------------------------------------

def estimate_cell_bytes(cell: Cell, copies: int) -> int:
    query_rows = cell.tokens * cell.num_heads
    return (cell.kv_bytes_per_copy * copies + query_rows * KV_LORA_RANK * 4 * SCRATCH_FP32_ROWS_PER_QUERY_ROW
            + CELL_MEMORY_MARGIN_BYTES)


# ----------------------------------------------------------------------------------------------------------
# One cell
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunContext:
    device: torch.device
    cc: tuple[int, int]
    l2_bytes: int
    hbm_bytes_per_s: float
    peak_flops_per_s: float  # measured bf16 matmul peak
    fp8_peak_flops_per_s: float | None  # measured fp8 matmul peak (None: no fp8 matmul on the device)
    unavailable: dict[str, str]  # runner name -> why it cannot run at all
    args: argparse.Namespace


# Sticky CUDA errors: after one of these every later CUDA call fails (unlike, say, a failed graph capture).
_STICKY_CUDA_ERRORS = ("illegal memory access", "illegal instruction", "misaligned address",
                       "unspecified launch failure", "device-side assert")


def _is_fatal_cuda_error(e: BaseException) -> bool:
    text = str(e)
    return any(marker in text for marker in _STICKY_CUDA_ERRORS)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_cell(cell: Cell, runners: list, ctx: RunContext) -> list[dict]:
    """Rows of every runner for one cell: n/a ones with their reason, the others checked and timed."""
    args = ctx.args
    cell_fields = cell.as_dict()
    rows: dict[str, dict] = {}
    active = []
    for runner in runners:
        q_dtype = runner.query_dtype(cell, ctx.cc)
        reason = ctx.unavailable.get(runner.name) or runner.unsupported_reason(cell, ctx.cc)
        status = report.NOT_APPLICABLE if reason else report.OK
        rows[runner.name] = report.new_row(runner.name, runner.kind, cell_fields, q_dtype, status, reason or "")
        if not reason:
            rows[runner.name]["mma_dtype"] = runner.mma_dtype(cell, ctx.cc)
            active.append(runner)

    copies = kv_copies_for(cell.kv_bytes_per_copy, ctx.l2_bytes, args.l2_factor, args.max_kv_copies)
    calls = calls_per_graph_for(copies, args.min_calls_per_graph)
    torch.cuda.empty_cache()
    free_bytes = torch.cuda.mem_get_info(ctx.device)[0]
    need_bytes = estimate_cell_bytes(cell, copies)
    if active and need_bytes > free_bytes:
        note = f"does not fit: needs ~{need_bytes / 2**30:.1f} GiB, {free_bytes / 2**30:.1f} GiB free"
        for runner in active:
            rows[runner.name].update(status=report.SKIPPED, note=note)
        active = []

    inputs = refs = graphs = prepared = None
    try:
        if active:
            inputs = cell_inputs(cell, ctx.device, copies, args.softmax_scale, args.seed)
            if args.ragged != "none":
                # The cache and block table cover S for every request; the lengths shrink below it in place,
                # before any runner plans (peers that take a max length get S, an upper bound).
                lens = ragged_seq_lens(args.ragged, cell.batch, cell.seq_len, args.ragged_short, args.seed)
                inputs.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
            # A CUDA graph does not keep the tensors it reads alive: each runner's prepared call (its planning
            # metadata, output and scratch buffers) must outlive its graph, or the next runner's allocations
            # reuse that memory and the replay reads freed memory.
            refs, graphs, prepared = {}, {}, {}
        for runner in active:
            row = rows[runner.name]
            row.update(kv_copies=copies, calls_per_graph=calls)
            phase = "prepare"  # named in the note of a failure, to tell planning, running and capture apart
            try:
                call = prepared[runner.name] = runner.prepare(cell, inputs)
                phase = "first call"
                out, lse = call(0)
                torch.cuda.synchronize()
                phase = "reference check"
                if row["q_dtype"] not in refs:
                    refs[row["q_dtype"]] = inputs.reference(row["q_dtype"])
                check = check_against_reference(out, lse, *refs[row["q_dtype"]], cell.kv_dtype)
                del out, lse
                note = "; ".join(x for x in (getattr(call, "note", ""), check.summary()) if x)
                row.update(max_abs_err=check.max_abs_err, lse_max_abs_err=check.lse_max_abs_err, note=note)
                if not check.out_ok:
                    row["status"] = report.WRONG
                    continue
                phase = "CUDA-graph capture"
                graphs[runner.name] = (capture_graph(call.launch, calls=calls, copies=copies), calls)
            except torch.OutOfMemoryError as e:
                row.update(status=report.SKIPPED, note=f"out of memory in {phase}: {_one_line(e)}")
            except Exception as e:  # noqa: BLE001 - a failing kernel is a result, not the end of the run
                row.update(status=report.ERROR, note=f"{phase}: {_one_line(e)}")
                if _is_fatal_cuda_error(e):
                    for other in rows.values():
                        if other["status"] == report.OK:
                            other.update(status=report.ERROR, note="not timed: the CUDA context broke in this cell")
                    raise FatalCudaError(f"{runner.name} on {cell.label()}: {_one_line(e)}",
                                         [rows[r.name] for r in runners]) from e
        if graphs:
            timings = time_graphs(graphs, args.time_per_kernel, args.min_replays, args.max_replays,
                                  args.warmup_replays)
            for name, timing in timings.items():
                rows[name].update(time_us=timing.median_us, time_us_p10=timing.p10_us, time_us_p90=timing.p90_us,
                                  replays=timing.replays)
    except torch.OutOfMemoryError as e:
        for row in rows.values():
            if row["status"] == report.OK and row["time_us"] is None:
                row.update(status=report.SKIPPED, note=f"out of memory: {_one_line(e)}")
    finally:
        del inputs, refs, graphs, prepared
        gc.collect()
        torch.cuda.empty_cache()

    for row in rows.values():
        report.fill_metrics(row, ctx.hbm_bytes_per_s, ctx.peak_flops_per_s, ctx.fp8_peak_flops_per_s)
    return [rows[runner.name] for runner in runners]


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_args(argv=None) -> argparse.Namespace:
    ours_default = [k for k in available_kernels() if k not in NOT_BENCHMARKED_KERNELS]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sel = parser.add_argument_group("what runs")
    sel.add_argument("--kernels", type=_name_list, default=None,
                     help=f"our kernels, comma-separated, or 'none' (default: every registered kernel but "
                          f"{', '.join(NOT_BENCHMARKED_KERNELS)}: {','.join(ours_default)}; with --candidates: "
                          f"the autotuner's kernels for the GPU, CUTE_MLA_CANDIDATES)")
    sel.add_argument("--candidates", action="store_true",
                     help="one runner per launch config of each of our kernels (kernel:config) plus 'auto' "
                          "(mla_decode(kernel='auto') after tuning the cell's shape; tuning cache: "
                          "CUTE_MLA_TUNE_CACHE): the autotuner's benchmark")
    sel.add_argument("--tune-time", type=float, default=autotune.TIME_PER_CANDIDATE_S,
                     help="--candidates: seconds of timed replays per candidate when 'auto' tunes a cell "
                          "(default: %(default)s)")
    sel.add_argument("--retune", action="store_true",
                     help="--candidates: tune every cell again instead of reading the tuning cache")
    sel.add_argument("--launch-config", type=_launch_config, action="append", default=None, metavar="JSON",
                     help="LaunchConfig fields as JSON, e.g. '{\"min_chunk\": 64}': each of our kernels also runs "
                          "with its default config of each cell with these fields replaced (a row of its own); "
                          "repeat it for more such rows")
    sel.add_argument("--peers", type=_name_list, default=DEFAULT_PEERS,
                     help=f"peers, comma-separated, 'all' or 'none' (default: {','.join(DEFAULT_PEERS)}; "
                          f"known: {','.join(PEERS)})")
    sel.add_argument("--plan-per-call", action="store_true",
                     help="our calls plan their split schedule each (mla_decode without a step), not once per graph "
                          "replay (the calls of a graph are the layers of one step by default)")
    sel.add_argument("--with-flashinfer", action="store_true",
                     help="add flashinfer_mla to the peers (JIT-compiles with nvcc on first use: minutes)")
    sel.add_argument("--flashinfer-timeout", type=float, default=900.0,
                     help="seconds allowed for FlashInfer's JIT warm-up (run in a subprocess); on timeout or "
                          "failure it is reported n/a (default: %(default)s)")
    sel.add_argument("--ours-fp8-q", type=_name_list, default=None,
                     help="q dtype(s) our kernels take in fp8-KV cells: fp8 (CUTE_MLA_FP8_QUERY=1), bf16 (=0), or "
                          "fp8,bf16 for both (default: what the CUTE_MLA vLLM backend takes on this GPU under "
                          "this environment's CUTE_MLA_FP8_QUERY: by default fp8 on SM90, else bf16)")
    grid = parser.add_argument_group("grid (defaults: the standard grid, or the quick one with --quick)")
    grid.add_argument("--quick", action="store_true", help="a subset of the grid that runs in < 2 minutes")
    grid.add_argument("--batches", type=_int_list, help="batch sizes B, e.g. 1,8,32")
    grid.add_argument("--seq-lens", type=_int_list, help="KV lengths S (incl. the new tokens), e.g. 1024,4096")
    grid.add_argument("--q-lens", type=_int_list, help="query tokens per request, e.g. 1,2")
    grid.add_argument("--kv-dtypes", type=_name_list, help="KV-cache dtypes: bf16, fp8")
    grid.add_argument("--num-heads", type=int, default=128, help="query heads per rank (default: %(default)s)")
    grid.add_argument("--block-size", "--block-sizes", type=_int_list, default=[64], dest="block_size",
                      help="KV-cache page size(s), e.g. 16,32,64,128: each kernel is timed at each (a section per "
                           "size; a peer that needs another size shows n/a there) (default: 64)")
    grid.add_argument("--ragged", choices=RAGGED_KINDS, default="none",
                      help="ragged batches: request 0 has S, the others --ragged-short tokens (one-long) or "
                           "log-normal lengths with median S/16 (long-tail). Compare time_us only: bytes, "
                           "FLOPs and %% of floor still assume every request has S (default: %(default)s)")
    grid.add_argument("--ragged-short", type=int, default=1024,
                      help="the short requests' length with --ragged one-long (default: %(default)s)")
    grid.add_argument("--softmax-scale", type=float, default=peers.DEFAULT_SOFTMAX_SCALE,
                      help="default: 1/sqrt(128 + 64), DeepSeek's head dim before absorption")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--time-per-kernel", type=float,
                        help="seconds of timed replays per kernel and cell (default: 0.25, quick: 0.05)")
    timing.add_argument("--min-replays", type=int, default=10)
    timing.add_argument("--max-replays", type=int, default=1000)
    timing.add_argument("--warmup-replays", type=int, default=3)
    timing.add_argument("--min-calls-per-graph", type=int, default=8,
                        help="decode calls per CUDA graph at least (amortises the replay launch)")
    timing.add_argument("--l2-factor", type=float, default=2.0,
                        help="KV copies rotated through add up to at least this many times L2 (default: 2)")
    timing.add_argument("--max-kv-copies", type=int, default=256)
    timing.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", type=Path,
                     help="default: benchmarks/results/<device-name>_<date>[_quick]/")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--dry-run", action="store_true",
                     help="print the grid, kernels and peers (importable or not, with reasons) and exit")
    out.add_argument("--assume-sm", type=int, default=90,
                     help="--dry-run without a GPU: decide per-cell support for this SM (default: %(default)s)")
    args = parser.parse_args(argv)

    grid_name = "quick" if args.quick else "standard"
    base = GRIDS[grid_name]
    args.grid_name = grid_name
    args.batches = args.batches or base["batches"]
    args.seq_lens = args.seq_lens or base["seq_lens"]
    args.q_lens = args.q_lens or base["q_lens"]
    args.kv_dtypes = args.kv_dtypes or base["kv_dtypes"]
    if args.time_per_kernel is None:
        args.time_per_kernel = DEFAULT_TIME_PER_KERNEL_S[grid_name]

    if args.kernels == ("none",):
        args.kernels = ()
    for k in args.kernels or ():
        if k not in available_kernels() or k in NOT_BENCHMARKED_KERNELS:
            parser.error(f"--kernels: {k!r} is not a benchmarkable kernel; choose from {','.join(ours_default)}")
    if args.peers == ("all",):
        args.peers = tuple(PEERS)
    elif args.peers == ("none",):
        args.peers = ()
    if args.with_flashinfer and "flashinfer_mla" not in args.peers:
        args.peers += ("flashinfer_mla",)
    for p in args.peers:
        if p not in PEERS:
            parser.error(f"--peers: unknown peer {p!r}; known: {','.join(PEERS)}")
    for d in args.kv_dtypes:
        if d not in peers.TORCH_DTYPES:
            parser.error(f"--kv-dtypes: {d!r} is not one of {','.join(peers.TORCH_DTYPES)}")
    for d in args.ours_fp8_q or ():
        if d not in ("fp8", "bf16"):
            parser.error(f"--ours-fp8-q: {d!r} is not fp8 or bf16")
    if args.launch_config and args.candidates:
        parser.error("--launch-config runs our kernels' default configs with fields replaced; --candidates runs "
                     "every config the kernels list: use one")
    return args


def _launch_config(text: str) -> dict:
    """--launch-config: a JSON object of LaunchConfig fields, each checked by LaunchConfig itself."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    if not isinstance(fields, dict) or not fields or set(fields) - known:
        raise argparse.ArgumentTypeError(f"a JSON object of LaunchConfig fields; allowed: {', '.join(sorted(known))}")
    if "tile" in fields and fields["tile"] is not None:
        fields["tile"] = tuple(fields["tile"])
    try:
        LaunchConfig(**fields)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return fields


def build_cells(args) -> list[Cell]:
    return [Cell(batch=b, seq_len=s, q_len=q, kv_dtype=d, num_heads=args.num_heads, block_size=bs)
            for bs in args.block_size for d in args.kv_dtypes for q in args.q_lens for b in args.batches
            for s in args.seq_lens]


def resolve_kernels(args, cc) -> tuple[str, ...]:
    """--kernels, or its default: every benchmarkable kernel; with --candidates the tuner's kernels for ``cc``."""
    if args.kernels is not None:
        return tuple(args.kernels)
    if args.candidates and cc is not None:
        return tuple(registry.candidate_kernels(tuple(cc)))
    return tuple(k for k in available_kernels() if k not in NOT_BENCHMARKED_KERNELS)


def grid_configs(kernel: str, cells: list[Cell], cc) -> list[LaunchConfig]:
    """Every config ``kernel`` lists for any cell of the grid (meta tensors; default configs first)."""
    out: list[LaunchConfig] = []
    for cell in cells:
        try:
            args = meta_args(cell, "bf16")
        except ValueError:
            continue
        if cc is None or KERNELS[kernel].unsupported_reason(args, tuple(cc)) is None:
            out += KERNELS[kernel].configs(args, tuple(cc) if cc else None)
    return list(dict.fromkeys(out))


def build_runners(args, cc=None, cells: list[Cell] | None = None) -> list:
    kernels = resolve_kernels(args, cc)
    if args.candidates:
        ours = [TunedAuto(kernels, args.tune_time, args.retune)]
        ours += [OurKernel(k, "bf16", False, config=c, plan_per_call=args.plan_per_call)
                 for k in kernels for c in grid_configs(k, cells or [], cc)]
    else:
        q_dtypes = args.ours_fp8_q or (("fp8",) if serving.fp8_query(envs.CUTE_MLA_FP8_QUERY,
                                                                     tuple(cc) if cc else None) else ("bf16",))
        ours = [OurKernel(k, q, shadowed_in_bf16_cells=(q == "fp8" and "bf16" in q_dtypes),
                          plan_per_call=args.plan_per_call)
                for k in kernels for q in dict.fromkeys(q_dtypes)]
        if args.launch_config:  # beside each default runner: the same with the fields replaced
            ours += [OurKernel(o.kernel, o.fp8_query, o.shadowed_in_bf16_cells, plan_per_call=args.plan_per_call,
                               overrides=fields) for fields in args.launch_config for o in list(ours)]
    return ours + [PEERS[name] for name in args.peers]


def _versions() -> str:
    parts = []
    for dist in ("torch", "triton", "vllm", "flashinfer-python", "mla_backend_plugin"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} -")
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    return ", ".join(parts)


def default_out_dir(args, device_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-")
    suffix = "_quick" if args.grid_name == "quick" else ""
    return peers.REPO_ROOT / "benchmarks" / "results" / f"{slug}_{datetime.date.today().isoformat()}{suffix}"


def dry_run(args, cells: list[Cell], runners: list) -> None:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cc = torch.cuda.get_device_capability(0)
        l2_bytes = props.L2_cache_size
        print(f"device: {props.name} (SM{cc[0]}{cc[1]}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB, L2 {l2_bytes / 2**20:.0f} MiB)")
    else:
        cc = divmod(args.assume_sm, 10)
        l2_bytes = H100_L2_BYTES
        print(f"device: none (no CUDA here); per-cell support below assumes SM{args.assume_sm} and an "
              f"H100-sized L2 ({l2_bytes >> 20} MiB)")
    print(f"grid '{args.grid_name}': {len(cells)} cells = B {list(args.batches)} x S {list(args.seq_lens)} x "
          f"q_len {list(args.q_lens)} x KV {list(args.kv_dtypes)}; {args.num_heads} heads, block size "
          f"{'/'.join(map(str, args.block_size))}; ~{args.time_per_kernel} s of replays per kernel and cell")
    if args.ragged != "none":
        for b in sorted(set(args.batches)):
            for seq in sorted(set(args.seq_lens)):
                lens = ragged_seq_lens(args.ragged, b, seq, args.ragged_short, args.seed)
                print(f"  ragged {args.ragged} B={b} S={seq}: total {sum(lens)} tokens, min {min(lens)}, "
                      f"median {sorted(lens)[len(lens) // 2]}, max {max(lens)}")
    print("\nkernels:")
    for runner in runners:
        ok, reason = runner.available()
        print(f"  {runner.kind:4}  {runner.name:15} {'yes' if ok else 'no '}  {reason}")
        print(f"        {'':15}      {runner.description}")
        mma: dict[tuple[str, str], int] = {}  # (MMA dtype, KV dtype) -> cells
        for cell in cells:
            if runner.unsupported_reason(cell, cc) is None:
                key = (runner.mma_dtype(cell, cc), cell.kv_dtype)
                mma[key] = mma.get(key, 0) + 1
        if mma:
            print(f"        {'':15}      MMA dtype: " + "; ".join(
                f"{dtype} in {n} {kv} cell(s)" for (dtype, kv), n in mma.items()))
    skipped = [name for name in PEERS if name not in args.peers]
    if skipped:
        print(f"  not selected: {', '.join(skipped)} (--peers / --with-flashinfer)")

    print("\nper cell: KV MiB per copy, copies rotated, calls per graph, estimated GiB; "
          "then run / n/a per kernel")
    names = [r.name for r in runners]
    print(f"  {'B':>4} {'S':>6} {'q':>2} {'kv':>4} {'MiB':>8} {'copies':>6} {'calls':>5} {'GiB':>6}  "
          + " ".join(f"{n:>15}" for n in names))
    reasons: dict[tuple[str, str], int] = {}
    for cell in cells:
        copies = kv_copies_for(cell.kv_bytes_per_copy, l2_bytes, args.l2_factor, args.max_kv_copies)
        marks = []
        for runner in runners:
            reason = runner.unsupported_reason(cell, cc)
            marks.append("n/a" if reason else "run")
            if reason:
                reasons[(runner.name, reason)] = reasons.get((runner.name, reason), 0) + 1
        print(f"  {cell.batch:>4} {cell.seq_len:>6} {cell.q_len:>2} {cell.kv_dtype:>4} "
              f"{cell.kv_bytes_per_copy / 2**20:>8.1f} {copies:>6} "
              f"{calls_per_graph_for(copies, args.min_calls_per_graph):>5} "
              f"{estimate_cell_bytes(cell, copies) / 2**30:>6.1f}  " + " ".join(f"{m:>15}" for m in marks))
    if reasons:
        print("\nn/a reasons:")
        for (name, reason), count in sorted(reasons.items()):
            print(f"  {name} ({count} cells): {reason}")


def warm_up_flashinfer(args) -> str | None:
    """JIT-compile FlashInfer's MLA kernels in a subprocess with a time limit (``peers.py --smoke``).

    The compiled modules land in FlashInfer's JIT cache, from which this process then loads them quickly.
    Returns None when FlashInfer can be used, else the reason it cannot.
    """
    cmd = [sys.executable, str(Path(peers.__file__).resolve()), "--smoke", "flashinfer_mla",
           "--kv-dtypes", ",".join(args.kv_dtypes), "--q-lens", ",".join(map(str, args.q_lens)),
           "--block-size", str(args.block_size[0]), "--num-heads", str(args.num_heads)]
    print(f"FlashInfer warm-up (JIT, up to {args.flashinfer_timeout:.0f} s): {' '.join(cmd)}", flush=True)
    t0 = time.time()
    # Own session, so that on timeout the compiler processes it started are ended with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.flashinfer_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"FlashInfer JIT warm-up did not finish in {args.flashinfer_timeout:.0f} s (--flashinfer-timeout)"
    print(output.rstrip())
    print(f"FlashInfer warm-up: exit {proc.returncode} after {time.time() - t0:.0f} s", flush=True)
    if proc.returncode not in (peers.SMOKE_OK, peers.SMOKE_WRONG):
        tail = " | ".join(line for line in output.strip().splitlines()[-3:])
        return f"FlashInfer warm-up failed (exit {proc.returncode}): {tail}"[:400]
    return None


class _LineProgress:
    """Stand-in for tqdm: one line per cell."""

    def __init__(self, items, desc):
        self.items, self.desc = list(items), desc

    def __iter__(self):
        for i, item in enumerate(self.items):
            print(f"[{i + 1}/{len(self.items)}] {self.desc}: {item.label()}", flush=True)
            yield item

    def set_postfix_str(self, text):
        pass

    @staticmethod
    def write(text):
        print(text, flush=True)


def progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(items, desc)
    return tqdm(items, desc=desc, unit="cell", dynamic_ncols=True, file=sys.stdout)


def _cell_summary(cell: Cell, rows: list[dict]) -> str:
    parts = [f"{r['kernel']} {r['time_us']:.1f}us" if r["status"] == report.OK else f"{r['kernel']} {r['status']}"
             for r in rows]
    return f"{cell.label()}: " + ", ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    cells = build_cells(args)
    if args.dry_run:
        cc = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else divmod(args.assume_sm, 10)
        dry_run(args, cells, build_runners(args, cc, cells))
        return 0
    if not torch.cuda.is_available():
        print("bench_decode.py needs a CUDA device (use --dry-run to see the plan here)", file=sys.stderr)
        return 2

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    cc = torch.cuda.get_device_capability(device)
    runners = build_runners(args, cc, cells)
    unavailable = {}
    for runner in runners:
        ok, reason = runner.available()
        if ok and runner.name == "flashinfer_mla":
            reason = warm_up_flashinfer(args)
            ok = reason is None
        if not ok:
            unavailable[runner.name] = f"unavailable: {reason}"
        print(f"{runner.kind:4} {runner.name:15} {'available' if ok else unavailable[runner.name]}")

    hbm = measure_hbm_bytes_per_s(device)
    peak = measure_bf16_flops_per_s(device)
    fp8_peak = measure_fp8_flops_per_s(device)
    gc.collect()
    torch.cuda.empty_cache()
    fp8_text = "none" if fp8_peak is None else f"{fp8_peak / 1e12:.0f} TFLOP/s"
    print(f"{props.name}: SM{cc[0]}{cc[1]}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB; "
          f"measured HBM {hbm / 1e9:.0f} GB/s (copy, read + write), bf16 matmul {peak / 1e12:.0f} TFLOP/s, "
          f"fp8 matmul {fp8_text}")

    out_dir = args.out_dir or default_out_dir(args, props.name)
    meta = dict(device_name=props.name, compute_capability=f"{cc[0]}.{cc[1]}", sm_count=props.multi_processor_count,
                l2_mib=props.L2_cache_size / 2**20, hbm_gbps=hbm / 1e9, peak_tflops=peak / 1e12,
                fp8_peak_tflops=None if fp8_peak is None else fp8_peak / 1e12,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                command=" ".join(["python"] + (sys.argv if argv is None else [sys.argv[0], *argv])),
                grid=f"{args.grid_name}: B {list(args.batches)} x S {list(args.seq_lens)} x q_len "
                     f"{list(args.q_lens)} x KV {list(args.kv_dtypes)}, {args.num_heads} heads, block "
                     f"{'/'.join(map(str, args.block_size))}" + ("" if args.ragged == "none" else
                                             f", ragged {args.ragged} (short {args.ragged_short}; metrics "
                                             f"other than time assume S for every request)"),
                versions=_versions(), unavailable=unavailable,
                timing=dict(time_per_kernel_s=args.time_per_kernel, min_replays=args.min_replays,
                            max_replays=args.max_replays, min_calls_per_graph=args.min_calls_per_graph,
                            l2_factor=args.l2_factor, max_kv_copies=args.max_kv_copies),
                softmax_scale=args.softmax_scale, seed=args.seed)
    ctx = RunContext(device=device, cc=cc, l2_bytes=props.L2_cache_size, hbm_bytes_per_s=hbm,
                     peak_flops_per_s=peak, fp8_peak_flops_per_s=fp8_peak, unavailable=unavailable, args=args)

    rows: list[dict] = []
    bar = progress(cells, "MLA decode")
    t0 = time.time()
    exit_code = 0
    try:
        for cell in bar:
            bar.set_postfix_str(cell.label())
            cell_rows = run_cell(cell, runners, ctx)
            rows += cell_rows
            bar.write(_cell_summary(cell, cell_rows))
            for row in cell_rows:
                if row["kind"] == report.OURS and row["status"] in (report.WRONG, report.ERROR):
                    bar.write(f"  !! {row['kernel']} {row['status']}: {row['note']}")
            # Keep the machine-readable results current, so that a run cut short still leaves them.
            out_dir.mkdir(parents=True, exist_ok=True)
            report.write_csv(report.annotate_speedups(rows), out_dir / "results.csv")
            report.write_json(rows, meta, out_dir / "results.json")
    except (Exception, KeyboardInterrupt) as e:  # keep what was measured: the report is written below
        if isinstance(e, FatalCudaError):
            rows += e.rows
        traceback.print_exc()
        print(f"stopping early: {_one_line(e)}", file=sys.stderr)
        meta["stopped_early"] = _one_line(e)
        exit_code = 1
    meta["wall_s"] = round(time.time() - t0, 1)
    tuned_auto = next((r for r in runners if isinstance(r, TunedAuto)), None)
    if tuned_auto is not None:
        meta["autotune"] = {"cache": tuned.default_cache_path(), "kernels": list(tuned_auto.kernels),
                            "tune_time_s": tuned_auto.tune_time_s, "cells": tuned_auto.tunings,
                            "cold_s": round(sum(t["seconds"] for t in tuned_auto.tunings if t["cold"]), 1),
                            "warm_s": round(sum(t["seconds"] for t in tuned_auto.tunings if not t["cold"]), 1)}
        summary = report.autotune_summary(report.annotate_speedups(rows))
        print(f"auto within {100 * report.AUTO_TOLERANCE:.0f}% of the best fixed candidate in "
              f"{sum(e['within'] for e in summary)} of {len(summary)} cells; tuning {meta['autotune']['cold_s']} s "
              f"cold ({sum(t['cold'] for t in tuned_auto.tunings)} cells), {meta['autotune']['warm_s']} s from the "
              "cache")
    for path in report.write_report(report.annotate_speedups(rows), meta, out_dir, plots=not args.no_plots):
        print(path)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
