"""End-to-end decode benchmark through vLLM: time per output token of a DeepSeek-V3-width model per MLA backend.

    python benchmarks/bench_e2e.py --dry-run                       # conditions and the model config; no GPU
    python benchmarks/bench_e2e.py --backends CUTE_MLA,FLASH_ATTN_MLA --out-dir DIR   # time them (appends rows)
    python benchmarks/bench_e2e.py --report --out-dir DIR          # results.md / results.csv / plots from the rows
    python benchmarks/bench_e2e.py --start-times --backends CUTE_MLA,FLASHMLA --out-dir DIR   # cold + warm starts

The model: examples/tiny_deepseek's DeepSeek-V3 attention (128 heads, q_lora 1536, kv_lora 512, rope 64, YaRN) at
DeepSeek-V3's width (hidden 7168) with ``--layers`` dense layers, a small MLP and vocabulary, dummy weights, no
tokenizer. Each backend runs in its own process (one engine, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
CUDA graphs on unless ``--eager``, prefix caching off unless ``--prefix-caching``, ``--max-batched-tokens`` per
step. Per cell (batch B,
context S, n-gram speculative tokens), medians of ``--repeats``: chunked prefill makes the first requests decode
while the last still prefill (mixed steps: prefill work, attention run eagerly), so the decode step is timed as the
difference of two generations that both outlast that phase, n_short and n_short + 64 tokens: 64 steps in which the
whole batch decodes under full CUDA graphs (with speculation: per 64 output tokens). ``mixed_step_ms``: what decoding
adds per step while prompts still prefill ((t(n_short) - t(1)) / (n_short - 1): eager attention, smaller chunks).
For CUTE_MLA also the host time per decode step in our metadata builder and in ``forward_mqa`` (a replayed step
calls the builder once and ``forward_mqa`` never). ``--kernel-profile`` adds a CUPTI trace of the two runs: GPU
busy time, attention-kernel time and the heaviest kernels per decode step.
``CUTE_MLA:<kernel>`` runs CUTE_MLA with ``CUTE_MLA_KERNEL=<kernel>``; ``/VAR=VALUE`` suffixes set environment variables
for that engine alone (``CUTE_MLA/CUTE_MLA_DECODE_MAX_QUERY_LEN=1``: short prefills through vLLM's prefill path).

With few layers the step is bound by vLLM's host work (the GPU idles for milliseconds of each step and that idle
time moves between runs); a real DeepSeek-V3 (61 layers) is bound by the GPU. ``--layers 16 --prefix-caching``
measures that regime within a device call: with prefix caching only the warm-up generation prefills the prompts,
the timed ones find them cached (the decode steps, and so the differenced step time, are the same either way).

Two GPUs: ``--tensor-parallel-size 2`` (and ``--decode-context-parallel-size 2``, ``--cp-kv-cache-interleave-size
N``) run every engine over both; rows carry ``tp`` / ``dcp`` / ``interleave`` and the report names the layout
(``CUTE_MLA tp2 dcp2``). Layouts that vLLM 0.26 or our kernels would refuse at engine start (a backend without a
decode LSE under DCP, speculation with an interleave above 1 on a peer, a CUTE_MLA head count our kernels lack:
``evals.plan.layout_problem``) are refused before any engine starts. With TP the decode runs in vLLM's worker
processes: no host-time hooks, no ``--kernel-profile``. Long contexts (S 32k at
B 32 / 128) prefill for minutes: pass ``--prefix-caching`` so that only the warm-up generation prefills.

One call may run out of a device call's 10 minutes: pass a few backends per call and ``--budget-s`` (each engine
stopped at its share, its finished cells kept; exit 75 when the budget cut the run); rows append to
``DIR/rows.jsonl`` and ``--report`` renders them all. H100 runs: docs/perf/e2e_and_host.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = ROOT / "examples" / "tiny_deepseek" / "model" / "config.json"
DEFAULT_BACKENDS = ("CUTE_MLA", "CUTE_MLA:cute_sm90", "CUTE_MLA:triton", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA")


def model_config(layers: int, hidden: int = 7168, intermediate: int = 2048, vocab: int = 16384) -> dict:
    """DeepSeek-V3's attention at its width, ``layers`` dense layers (the MoE fields stay, unused)."""
    config = json.loads(BASE_CONFIG.read_text())
    config.update(hidden_size=hidden, intermediate_size=intermediate, vocab_size=vocab, num_hidden_layers=layers,
                  first_k_dense_replace=layers)
    return config


def conditions(args) -> list[dict]:
    layout = parallel_fields(args)
    return [{"backend": b, "batch": batch, "context": ctx, "spec": spec, **layout}
            for b in args.backends for spec in args.spec for ctx in args.contexts for batch in args.batches]


def parallel_fields(args) -> dict:
    """The engines' parallel layout as a row records it."""
    return {"tp": args.tensor_parallel_size, "dcp": args.decode_context_parallel_size,
            "interleave": args.cp_kv_cache_interleave_size if args.decode_context_parallel_size > 1 else 1}


def row_label(row: dict) -> str:
    """A row's backend with its parallel layout (one GPU: the backend alone) and ``fp8`` for an fp8 KV cache (rows
    of both caches can share a run's report)."""
    tp, dcp = row.get("tp", 1), row.get("dcp", 1)
    label = row["backend"] + (f" tp{tp}" if tp > 1 else "") + (f" dcp{dcp}" if dcp > 1 else "")
    label += f" i{row['interleave']}" if dcp > 1 and row.get("interleave", 1) > 1 else ""
    return label + (" fp8" if row.get("kv_cache_dtype") == "fp8" else "")


def check_parallel(args) -> None:
    """Refuse, before any engine starts, a layout that vLLM or the backends would refuse after a start
    (``evals.plan.layout_problem``: the DCP size dividing the TP size, DCP support, speculation with an interleave
    above 1, CUTE_MLA's heads per decode call); and the kernel profile, which sees the engine's process only."""
    from mla_backend_plugin.evals.plan import layout_problem

    tp, dcp, interleave = args.tensor_parallel_size, args.decode_context_parallel_size, args.cp_kv_cache_interleave_size
    if tp > 1 and args.kernel_profile:
        raise ValueError(f"--kernel-profile with --tensor-parallel-size {tp}: the trace sees the engine's own "
                         f"process, the decode runs in vLLM's workers; allowed: --tensor-parallel-size 1")
    heads = model_config(args.layers)["num_attention_heads"]
    for spec in args.backends:
        problem = layout_problem(parse_backend(spec)[0], heads, tp, dcp, interleave, max(args.spec))
        if problem:
            raise ValueError(problem)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _prompts(batch: int, context: int, spec: int, seed: int) -> list[list[int]]:
    """Token ids (2 .. 4001). With speculation, periodic prompts: n-gram lookup proposes from the prompt, and
    with dummy weights the model tends to repeat, so drafts get accepted sometimes (what matters is that the
    verify path runs; acceptance is reported)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if spec:
            period = [rng.randrange(2, 4002) for _ in range(16)]
            out.append((period * (context // 16 + 1))[:context])
        else:
            out.append([rng.randrange(2, 4002) for _ in range(context)])
    return out


# which kernels run in a decode step: CUPTI through torch.profiler (kernels inside graph replays included)
ATTENTION_KERNEL = re.compile(r"(?i)mla|flash|attn|attention|splitkv|combine|fmha|mha_|decode")


def _kernel_trace(fn) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    return [(e["name"], float(e["ts"]), float(e.get("dur", 0))) for e in events
            if e.get("cat") == "kernel" and e.get("ph") == "X"]


def _busy_us(kernels) -> float:
    """GPU time with at least one kernel running (the union of the kernels' intervals)."""
    busy, end = 0.0, float("-inf")
    for _, start, dur in sorted(kernels, key=lambda k: k[1]):
        if start + dur > end:
            busy += start + dur - max(start, end)
            end = start + dur
    return busy


def _idle_before(kernels) -> dict[str, float]:
    """The GPU's idle gaps (no kernel running) summed by the name of the kernel that ends each gap: where in a
    step the GPU waits (a host launch, a graph's start, a kernel's dependency)."""
    gaps: dict[str, float] = {}
    end = None
    for name, start, dur in sorted(kernels, key=lambda k: k[1]):
        if end is not None and start > end:
            gaps[name] = gaps.get(name, 0.0) + start - end
        end = start + dur if end is None else max(end, start + dur)
    return gaps


def _span_us(kernels) -> float:
    """From the first kernel's start to the last one's end."""
    return max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels) if kernels else 0.0


def kernel_profile_per_step(run_short, run_long, steps: int) -> dict:
    """Per decode step, the long run minus the short one (the same prefill): GPU busy time, the span from the first
    kernel to the last (busy plus the GPU's idle gaps, from the same two traced runs: the idle time measured
    without the timed runs' run-to-run noise), kernel time, the attention kernels' time (names matching
    ATTENTION_KERNEL) and the heaviest kernels by name."""
    short, long = _kernel_trace(run_short), _kernel_trace(run_long)

    def by_name(kernels):
        totals: dict[str, float] = {}
        for name, _, dur in kernels:
            totals[name] = totals.get(name, 0.0) + dur
        return totals

    a, b = by_name(short), by_name(long)
    per_step = {n: (b.get(n, 0.0) - a.get(n, 0.0)) / steps for n in set(a) | set(b)}
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:10]
    ga, gb = _idle_before(short), _idle_before(long)
    idle = {n: (gb.get(n, 0.0) - ga.get(n, 0.0)) / steps for n in set(ga) | set(gb)}
    idle_top = sorted(idle.items(), key=lambda kv: -abs(kv[1]))[:8]
    return {"gpu_busy_ms": round((_busy_us(long) - _busy_us(short)) / steps / 1e3, 4),
            "gpu_span_ms": round((_span_us(long) - _span_us(short)) / steps / 1e3, 4),
            "kernel_ms": round(sum(per_step.values()) / 1e3, 4),
            "attention_kernel_ms": round(sum(v for n, v in per_step.items() if ATTENTION_KERNEL.search(n)) / 1e3, 4),
            "kernel_launches": round((len(long) - len(short)) / steps, 1),
            "top_kernels": [[n[:90], round(v, 1)] for n, v in top],
            "idle_before_us": [[n[:90], round(v, 1)] for n, v in idle_top]}


# ---------------------------------------------------------------- worker (one backend, one engine)

class HostTimers:
    """Host seconds a backend spends in its metadata builder (``build``, and the decode part ``_build_decode``) and
    in ``forward_mqa`` (wrapped methods): the same hooks for every backend, so that the host time is compared like
    the step time. For CUTE_MLA also the part of it inside the launches (bench_host.py ``time_launches``: the
    compiled CuTe calls and the combine's), the rest being Python."""

    KEYS = ("builder", "build_decode", "forward_mqa", "cute_launch", "combine_launch")

    def __init__(self):
        self.seconds = dict.fromkeys(self.KEYS, 0.0)
        self.calls = dict.fromkeys(self.KEYS, 0)

    @staticmethod
    def classes(backend: str) -> tuple[type, type]:
        """(metadata builder class, impl class) of a backend named as vLLM names it."""
        if backend == "CUTE_MLA":
            from mla_backend_plugin.vllm.backend import CuteMLABackend as cls
        else:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            cls = AttentionBackendEnum[backend].get_class()
        return cls.get_builder_cls(), cls.get_impl_cls()

    def install(self, backend: str):
        builder, impl = self.classes(backend)
        for cls, method, key in ((builder, "build", "builder"), (builder, "_build_decode", "build_decode"),
                                 (impl, "forward_mqa", "forward_mqa")):
            original = getattr(cls, method)

            def timed(self_, *a, _original=original, _key=key, **kw):
                t = time.perf_counter()
                try:
                    return _original(self_, *a, **kw)
                finally:
                    self.seconds[_key] += time.perf_counter() - t
                    self.calls[_key] += 1

            setattr(cls, method, timed)
        if backend == "CUTE_MLA":  # inside forward_mqa: cute_sm90's compiled calls and the combine's launches
            from bench_host import time_launches

            def record(piece: str, ns: int) -> None:
                self.seconds[f"{piece}_launch"] += ns / 1e9
                self.calls[f"{piece}_launch"] += 1

            time_launches(record)

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


DECODE_STEPS = 64  # full-batch decode steps timed per cell


def mixed_steps(batch: int, context: int, max_batched_tokens: int) -> int:
    """Steps until the last prompt of a batch has prefilled: each step's token budget goes to the decoding requests
    (one token each) first and the rest to prefill chunks."""
    prefill_per_step = max(1, max_batched_tokens - batch)
    return -(-batch * context // prefill_per_step)


def prompt_length(context: int, prefix_caching: bool, tail: int = 1) -> int:
    """With prefix caching, ``tail`` tokens past the context: vLLM reuses whole cached blocks and recomputes the
    rest, so a prompt of a multiple of the block size plus ``tail`` tokens leaves exactly ``tail`` tokens to compute
    per request (every supported block size divides the contexts). With the default tail of 1 the first step of a
    timed run is a q_len 1 decode for every backend. A longer tail (``--prefix-tail``) makes that step a short
    prefill with the whole context cached (what a multi-turn chat's next turn is): vLLM's FA3 and FlashMLA backends
    run it through their decode kernels (up to 512 / 128 query tokens), CUTE_MLA as one q_len 1 request per token
    up to CUTE_MLA_DECODE_MAX_QUERY_LEN; its time is the row's ``t1_s``."""
    return context + tail if prefix_caching else context


def run_lengths(batch: int, context: int, max_batched_tokens: int) -> tuple[int, int]:
    """Tokens of a cell's two timed generations: both outlast the mixed phase, and they differ by DECODE_STEPS."""
    n_short = mixed_steps(batch, context, max_batched_tokens) + 2
    return n_short, n_short + DECODE_STEPS


def longest_run(args) -> int:
    """Room the engine's max_model_len must leave past the prompt: the longest generation of any cell, plus 8."""
    return max(run_lengths(b, c, args.max_batched_tokens)[1] for b in args.batches for c in args.contexts) + 8


def parse_backend(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME[:kernel][/VAR=VALUE...]`` -> (vLLM backend name, environment of its engine)."""
    name, *settings = spec.split("/")
    backend, _, kernel = name.partition(":")
    env = {"CUTE_MLA_KERNEL": kernel} if kernel else {}
    for setting in settings:
        var, eq, value = setting.partition("=")
        if not eq or not var:
            raise ValueError(f"--backends {spec!r}: {setting!r} is not VAR=VALUE")
        env[var] = value
    return backend, env


def parallel_engine_args(args) -> dict:
    """vLLM ``LLM(...)`` arguments of the layout (none on one GPU, so one-GPU engines are those of before)."""
    extra = {}
    if args.tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = args.tensor_parallel_size
    if args.decode_context_parallel_size > 1:
        extra["decode_context_parallel_size"] = args.decode_context_parallel_size
        extra["cp_kv_cache_interleave_size"] = args.cp_kv_cache_interleave_size
    if args.block_size:
        extra["block_size"] = args.block_size
    return extra


def worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend, env = parse_backend(args.worker_backend)
    os.environ.update(env)
    # with TP the builder and forward_mqa run in vLLM's worker processes: hooks here would count nothing
    timers = HostTimers() if args.tensor_parallel_size == 1 else None
    if timers:
        timers.install(backend)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if args.worker_spec:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.worker_spec,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 8}
    extra.update(parallel_engine_args(args))
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, attention_backend=backend, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=args.eager, max_model_len=max(args.contexts) + longest_run(args),
              max_num_seqs=args.max_num_seqs or max(args.batches), max_num_batched_tokens=args.max_batched_tokens,
              enable_prefix_caching=args.prefix_caching, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              kv_cache_dtype=args.kv_cache_dtype, **extra)
    layers = json.loads((Path(args.model_dir) / "config.json").read_text())["num_hidden_layers"]
    start_s = time.perf_counter() - t0
    for context in args.contexts:
        for batch in args.batches:
            prompts = [TokensPrompt(prompt_token_ids=p)
                       for p in _prompts(batch, prompt_length(context, args.prefix_caching, args.prefix_tail),
                                         args.worker_spec, 0)]
            row = measure_cell(llm, SamplingParams, prompts, timers, args, batch, context)
            row.update(start_s=round(start_s, 1), layers=layers, prefix_caching=args.prefix_caching,
                       **parallel_fields(args),
                       kv_cache_dtype=args.kv_cache_dtype)
            if args.prefix_caching:
                row["prefix_tail"] = args.prefix_tail
            print("ROW " + json.dumps(row), flush=True)
    print("DONE", flush=True)


def measure_cell(llm, sampling_params, prompts, timers: HostTimers | None, args, batch: int, context: int) -> dict:
    """One cell's row. Chunked prefill hands out max_num_batched_tokens per step, so the first requests decode while
    the last ones still prefill: those mixed steps run attention eagerly (piecewise graphs) and carry prefill work.
    A request of an n-token run decodes for n - 1 steps after its prefill, so two runs that both outlast the mixed
    phase differ by exactly (n_long - n_short) steps in which the whole batch decodes (full CUDA graphs): that
    difference is the decode step. The mixed phase is reported apart."""

    def run(n: int) -> float:
        params = sampling_params(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        before = timers.snapshot() if timers else None
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        if timers:
            after = timers.snapshot()
            hosts.setdefault(n, []).append(
                {k: after["seconds"][k] - before["seconds"][k] for k in after["seconds"]}
                | {f"{k}_calls": after["calls"][k] - before["calls"][k] for k in after["calls"]})
        return seconds

    hosts: dict[int, list] = {}
    run(2)  # warm-up of this shape
    n_short, n_long = run_lengths(batch, context, args.max_batched_tokens)
    t = {n: statistics.median(run(n) for _ in range(args.repeats)) for n in (1, n_short, n_long)}
    step = (t[n_long] - t[n_short]) / DECODE_STEPS
    row = {"backend": args.worker_backend, "batch": batch, "context": context, "spec": args.worker_spec,
           "graphs": not args.eager, "step_ms": round(step * 1e3, 4),
           "tokens_per_s": round(batch / step, 1) if step > 0 else None,
           # what decoding adds per step while prompts still prefill (the prefill itself cancels), for comparison
           "mixed_step_ms": round((t[n_short] - t[1]) / (n_short - 1) * 1e3, 4),
           "t1_s": round(t[1], 4), "n_short": n_short, "t_short_s": round(t[n_short], 4),
           "n_long": n_long, "t_long_s": round(t[n_long], 4)}
    if timers:
        # host time in our hooks per decode step, differenced like the step time (under full graphs a replayed
        # step calls the builder once and forward_mqa never)
        def median(field: str, n: int) -> float:
            return statistics.median(h[field] for h in hosts[n])

        for key in HostTimers.KEYS:
            row[f"{key}_us_per_step"] = round((median(key, n_long) - median(key, n_short)) / DECODE_STEPS * 1e6, 1)
            row[f"{key}_calls_per_step"] = round(
                (median(f"{key}_calls", n_long) - median(f"{key}_calls", n_short)) / DECODE_STEPS, 2)
            row[f"{key}_us_mixed_phase"] = round((median(key, n_short) - median(key, 1)) * 1e6, 1)
            row[f"{key}_calls_mixed_phase"] = round(median(f"{key}_calls", n_short) - median(f"{key}_calls", 1), 1)
    if args.kernel_profile:
        row.update(kernel_profile_per_step(lambda: run(n_short), lambda: run(n_long), DECODE_STEPS))
    return row


# ---------------------------------------------------------------- driver

def run_backend(args, backend: str, spec: int, env: dict | None = None, log_path: Path | None = None,
                timeout_s: float | None = None) -> list[dict]:
    """One engine (its own process) over every cell: its rows, the cells it finished when it fails or is stopped
    at ``timeout_s`` (default ``--timeout``), then an error row."""
    cmd = [sys.executable, __file__, "--worker-backend", backend, "--worker-spec", str(spec), "--model-dir",
           args.model_dir, "--batches", ",".join(map(str, args.batches)), "--contexts",
           ",".join(map(str, args.contexts)), "--repeats", str(args.repeats), "--gpu-memory-utilization",
           str(args.gpu_memory_utilization), "--max-batched-tokens", str(args.max_batched_tokens),
           "--kv-cache-dtype", args.kv_cache_dtype, "--tensor-parallel-size", str(args.tensor_parallel_size),
           "--decode-context-parallel-size", str(args.decode_context_parallel_size), "--cp-kv-cache-interleave-size",
           str(args.cp_kv_cache_interleave_size)] \
        + (["--block-size", str(args.block_size)] if args.block_size else []) \
        + (["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []) \
        + (["--eager"] if args.eager else []) \
        + (["--prefix-caching", "--prefix-tail", str(args.prefix_tail)] if args.prefix_caching else []) \
        + (["--kernel-profile"] if args.kernel_profile else [])
    timeout = args.timeout if timeout_s is None else timeout_s
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        stdout, stderr, failure = proc.stdout, proc.stderr, (proc.stderr[-2000:] if proc.returncode else None)
    except subprocess.TimeoutExpired as e:  # keep the cells it finished
        stdout, stderr = (_text(e.stdout), _text(e.stderr))
        failure = f"timed out after {timeout:.0f} s ({'--timeout' if timeout_s is None else '--budget-s'})"
    if log_path is not None:
        log_path.write_text(stdout + "\n----- stderr\n" + stderr)
    rows = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
    if failure:
        rows.append({"backend": backend, "spec": spec, **parallel_fields(args), "kv_cache_dtype": args.kv_cache_dtype,
                     "error": failure})
    phases = start_phases(stdout + "\n" + stderr)
    for row in rows:
        row.update(phases)
    return rows


class Budget:
    """Seconds left of a ``--budget-s`` (unbounded without one)."""

    def __init__(self, seconds: float | None):
        self.end = time.monotonic() + seconds if seconds else None

    def left(self) -> float:
        return math.inf if self.end is None else self.end - time.monotonic()


INCOMPLETE = 75  # exit status when --budget-s ended the call before everything ran


def engine_allowance(left: float, later: int, timeout: float, min_engine_s: float) -> float | None:
    """Seconds an engine may run with ``left`` seconds of the budget and ``later`` engines still to start after it:
    all but ``min_engine_s`` for each later one (so every engine gets a start and its first cells), never less than
    ``min_engine_s`` while that much is left (engines run in the order asked: when the budget cannot hold them all,
    the last ones are dropped), at most ``timeout``; None when less than ``min_engine_s`` is left."""
    if left < min_engine_s:
        return None
    return min(timeout, max(left - later * min_engine_s, min_engine_s))


def run_engines(args, out_dir: Path) -> tuple[list[dict], bool]:
    """Every (backend, n-gram) engine in turn, its rows appended to ``rows.jsonl`` as it finishes; with
    ``--budget-s``, each engine stopped at its allowance (``engine_allowance``: its finished cells kept) and no
    engine started with less than ``--min-engine-s`` left. Returns the rows and whether the budget cut the run."""
    rows, cut = [], False
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    jobs = [(backend, spec) for backend in args.backends for spec in args.spec]
    budget = Budget(args.budget_s)
    for i, (backend, spec) in enumerate(jobs):
        allowed = engine_allowance(budget.left(), len(jobs) - 1 - i, args.timeout, args.min_engine_s)
        if allowed is None:
            print(f"budget: {budget.left():.0f} s left (--min-engine-s {args.min_engine_s:.0f}): not starting "
                  + ", ".join(f"{b} n-gram {n}" for b, n in jobs[i:]), flush=True)
            return rows, True
        t0 = time.monotonic()
        got = run_backend(args, backend, spec, log_path=logs / (re.sub(r"[^A-Za-z0-9]+", "_", backend)
                                                                + f"_spec{spec}.log"),
                          timeout_s=None if args.budget_s is None else allowed)
        cut |= any("(--budget-s)" in (r.get("error") or "") for r in got)
        with open(out_dir / "rows.jsonl", "a") as f:  # as each engine finishes: a later one may not
            for row in got:
                f.write(json.dumps(row) + "\n")
        print(f"engine {backend} n-gram {spec}: {sum('step_ms' in r for r in got)} cells in "
              f"{time.monotonic() - t0:.0f} s (allowed {allowed:.0f} s)", flush=True)
        rows += got
    return rows, cut


def _text(output) -> str:
    """A timed-out child's captured output (bytes even with ``text=True``, or None)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


# what an engine start spends its time on, from vLLM's log lines and ours (the package logs through vLLM's
# handlers): seconds per phase; ours sum over variants
START_PHASES = {
    "load_s": r"Model loading took [^\n]*? and ([0-9.]+) seconds",
    "torch_compile_s": r"torch\.compile took ([0-9.]+) s in total",
    "memory_profile_s": r"Memory profiling takes ([0-9.]+) seconds",
    "graph_capture_s": r"Graph capturing finished in ([0-9.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s",
    "cute_compile_in_process_s": r"compiled [^\n]+? \(pdl \w+, \w+\) in this process in ([0-9.]+) s",
    "cute_load_packaged_s": r"loaded [^\n]+? \(pdl \w+, \w+\) from the package in ([0-9.]+) s",
    "cute_background_build_s": r"built in the background in ([0-9.]+) s",
    "cute_first_use_wait_s": r"built in the background in [0-9.]+ s \(first use waited ([0-9.]+) s\)",
}


def start_phases(log: str) -> dict[str, float]:
    """START_PHASES found in an engine's log (a phase that is not logged is left out; repeated ones add up)."""
    found = {}
    for key, pattern in START_PHASES.items():
        values = [float(v) for v in re.findall(pattern, log)]
        if values:
            found[key] = round(sum(values), 1)
    return found


def packaged_kernels() -> bool:
    """Whether the installed package ships prebuilt CuTe-DSL kernels (kernels/prebuilt holds entries)."""
    from mla_backend_plugin.kernels.cute_common.aot import PACKAGED_ROOT

    return os.path.isdir(PACKAGED_ROOT) and any(os.scandir(PACKAGED_ROOT))


def start_times(args, out_dir: Path) -> list[dict]:
    """Engine start (LLM construction to ready) per backend: cold (empty package, vLLM and Triton caches) then
    warm (the same caches again). Each row is appended to ``rows.jsonl`` as soon as it is measured: a run cut off
    by a deadline keeps the starts it finished (a cold plus a warm start take ~3 minutes per backend)."""
    rows = []
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    # the engine of the sweep (max_num_seqs = its largest batch, so every CUDA-graph size is captured), timed on
    # one small cell
    small = argparse.Namespace(**{**vars(args), "batches": [1], "contexts": [1024], "repeats": 1,
                                  "max_num_seqs": args.max_num_seqs or max(args.batches)})
    # CUTE_MLA's cold start twice: as configured, and then, where the package ships prebuilt kernels (a wheel
    # built after `compile --into-package`), as a source install starts (it compiles them), else with the
    # background prebuild on
    second_cold = (("cold, CUTE_MLA_PACKAGED_KERNELS=0", {"CUTE_MLA_PACKAGED_KERNELS": "0"}) if packaged_kernels()
                   else ("cold, CUTE_MLA_PREBUILD=1", {"CUTE_MLA_PREBUILD": "1"}))
    for backend in args.backends:
        starts = [("cold", {}), ("warm", {})] + ([second_cold] if backend.startswith("CUTE_MLA") else [])
        with tempfile.TemporaryDirectory() as cache:
            for label, extra in starts:
                if label.startswith("cold") and label != "cold":  # empty caches again
                    shutil.rmtree(cache, ignore_errors=True)
                    os.makedirs(cache)
                env = dict(os.environ, CUTE_MLA_CUTE_CACHE=os.path.join(cache, "cute"),
                           CUTE_MLA_TUNE_CACHE=os.path.join(cache, "tune.json"),
                           VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                           TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), **extra)
                tag = re.sub(r"[^A-Za-z0-9]+", "_", f"{backend}_{label}").strip("_")
                got = run_backend(small, backend, 0, env, log_path=logs / f"start_{tag}.log")
                first = next((r for r in got if "start_s" in r), {})
                rows.append({"backend": backend, "start": label, "start_s": first.get("start_s"),
                             **{k: first[k] for k in START_PHASES if k in first},
                             "error": next((r["error"] for r in got if "error" in r), None)})
                with open(out_dir / "rows.jsonl", "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                print(f"START {json.dumps(rows[-1])}", flush=True)
    return rows


def step_split(row: dict) -> tuple[float, float, float, float]:
    """A profiled row's traced step (ms) and its parts: attention kernels + other kernels + GPU idle. Rows of older
    runs have no traced span: the timed step stands in for it."""
    span = row.get("gpu_span_ms")
    traced = span if span is not None else row["step_ms"]
    busy, attention = row["gpu_busy_ms"], row["attention_kernel_ms"]
    return traced, attention, busy - attention, traced - busy


def _mixed_forward_us(row: dict) -> str:
    calls = row.get("forward_mqa_calls_mixed_phase") or 0
    return f"{row['forward_mqa_us_mixed_phase'] / calls:.1f}" if calls else "-"


def _mixed_launch_us(row: dict) -> str:
    """Per eager forward_mqa call in the mixed phase: us inside the CuTe launches / the combine's launches."""
    calls = row.get("forward_mqa_calls_mixed_phase") or 0
    if not calls or "cute_launch_us_mixed_phase" not in row:
        return "-"
    return f"{row['cute_launch_us_mixed_phase'] / calls:.1f} / {row['combine_launch_us_mixed_phase'] / calls:.1f}"


def _cell(row: dict) -> tuple:
    """What two rows must share to be compared: the cell, the engine's settings and its layout."""
    return (row["context"], row["spec"], row["batch"], row.get("graphs"), row.get("kv_cache_dtype") or "auto",
            row.get("layers"), row.get("prefix_tail") or 1, row.get("tp", 1), row.get("dcp", 1),
            row.get("interleave", 1))


def attribution_lines(profiled: list[dict]) -> list[str]:
    """Markdown: per profiled CUTE_MLA row, the best in-tree backend of the same cell (the lowest step) and where
    the difference goes: traced step = attention kernels + other kernels + GPU idle (each ours - best), and the
    builder's host time per step beside it. Empty when no cell has both."""
    pairs = []
    for ours in profiled:
        if not ours["backend"].startswith("CUTE_MLA"):
            continue
        peers = [r for r in profiled if not r["backend"].startswith("CUTE_MLA") and _cell(r) == _cell(ours)]
        if peers:
            pairs.append((ours, min(peers, key=lambda r: r["step_ms"])))
    if not pairs:
        return []
    lines = ["", "CUTE_MLA against the best in-tree backend of the same cell (lowest step), ms per decode step, ours - "
             "best (> 0: ours slower): the traced step's difference is exactly attention + other kernels + idle; "
             "builder host us/step ours - best beside it.", "",
             "| backend | S | B | n-gram | best in-tree | step ours / best | step | traced step | attention kernels | "
             "other kernels | GPU idle | host: builder us/step |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for ours, best in sorted(pairs, key=lambda p: (p[0]["context"], p[0]["spec"], p[0]["batch"], row_label(p[0]))):
        diff = [round(a - b, 3) + 0.0 for a, b in zip(step_split(ours), step_split(best))]  # + 0.0: no "-0.000"
        builder = (f"{ours['builder_us_per_step'] - best['builder_us_per_step']:+.1f}"
                   if "builder_us_per_step" in ours and "builder_us_per_step" in best else "-")
        lines.append(f"| {row_label(ours)} | {ours['context']} | {ours['batch']} | {ours['spec']} | "
                     f"{row_label(best)} | {ours['step_ms'] / best['step_ms']:.3f} | "
                     f"{ours['step_ms'] - best['step_ms']:+.3f} | "
                     + " | ".join(f"{d:+.3f}" for d in diff) + f" | {builder} |")
    return lines


def render(out_dir: Path) -> Path:
    rows = [json.loads(line) for line in (out_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "step_ms" in r]
    lines = ["# End-to-end decode through vLLM", "",
             "Time per decode step (the whole batch decoding under CUDA graphs: two generations past the prefill "
             "phase, differenced over 64 steps, medians) and decode tokens/s per backend; host time per step in "
             "CUTE_MLA's builder and forward_mqa. `mixed`: what decoding adds per step (ms) while prompts still "
             "prefill in chunks (eager attention, smaller chunks; the prefill itself cancels).", ""]
    setups = sorted({(r.get("layers") or 0, bool(r.get("prefix_caching")), r.get("kv_cache_dtype") or "auto")
                     for r in timed})
    if setups:
        lines += ["Model: " + "; ".join(f"{n or '?'} layers, prefix caching {'on' if pc else 'off'}, KV cache "
                                        f"{'fp8' if kv == 'fp8' else 'model dtype'}" for n, pc, kv in setups) + ".",
                  ""]
    keys = sorted({(r["context"], r["spec"], r["graphs"]) for r in timed})
    for context, spec, graphs in keys:
        cell = [r for r in timed if (r["context"], r["spec"], r["graphs"]) == (context, spec, graphs)]
        batches = sorted({r["batch"] for r in cell})
        backends = sorted({row_label(r) for r in cell})
        lines += [f"## S = {context}, n-gram tokens {spec}, {'CUDA graphs' if graphs else 'eager'}", "",
                  "| backend | " + " | ".join(f"B={b} ms/step (tok/s)" for b in batches) + " | builder us/step | "
                  "forward_mqa us/step |", "|---|" + "---:|" * (len(batches) + 2)]
        for b in backends:
            by_batch = {r["batch"]: r for r in cell if row_label(r) == b}
            texts = [f"{by_batch[x]['step_ms']:.3f} ({by_batch[x]['tokens_per_s']})"
                     + (f"; mixed {by_batch[x]['mixed_step_ms']:.2f}" if "mixed_step_ms" in by_batch[x] else "")
                     if x in by_batch else "-" for x in batches]
            last = by_batch.get(batches[-1], {})
            lines.append(f"| {b} | " + " | ".join(texts) + f" | {last.get('builder_us_per_step', '-')} | "
                         f"{last.get('forward_mqa_us_per_step', '-')} |")
        lines.append("")
    hosted = [r for r in timed if "builder_us_per_step" in r]
    if hosted:
        lines += ["## Host time in the backend's hooks (the same wrapped methods for every backend)", "",
                  "Decode steps: host us per step in the metadata builder (`build`; `_build_decode` is its decode "
                  "part), differenced like the step. Mixed phase (chunked prefill next to decoding, attention "
                  "eager): builder us per step and us per eager `forward_mqa` call.", "",
                  "| backend | S | B | builder us/step | _build_decode us/step | mixed: builder us/step | "
                  "mixed: forward_mqa us/call | of which CuTe launches / combine launches us/call |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(hosted, key=lambda r: (r["context"], r["spec"], r["batch"], row_label(r))):
            mixed_steps_ = max(1, r.get("n_short", 2) - 1)
            per_call = _mixed_forward_us(r)
            builder_mixed = (f"{r['builder_us_mixed_phase'] / mixed_steps_:.1f}" if "builder_us_mixed_phase" in r
                             else "-")
            lines.append(f"| {row_label(r)} | {r['context']} | {r['batch']} | {r['builder_us_per_step']} | "
                         f"{r.get('build_decode_us_per_step', '-')} | {builder_mixed} | {per_call} | "
                         f"{_mixed_launch_us(r)} |")
        lines.append("")
    tails = [r for r in timed if (r.get("prefix_tail") or 1) > 1]
    if tails:
        lines += ["## The step after a prefix-cache hit", "",
                  "`t1_s`: one generated token for a batch whose prompts are cached but for their last `tail` tokens "
                  "(a short prefill over the whole cached context, then the first token; medians).", "",
                  "| backend | S | B | tail | n-gram | t1 s |", "|---|---:|---:|---:|---:|---:|"]
        for r in sorted(tails, key=lambda r: (r["context"], r["batch"], r["prefix_tail"], r["spec"], row_label(r))):
            lines.append(f"| {row_label(r)} | {r['context']} | {r['batch']} | {r['prefix_tail']} | {r['spec']} | "
                         f"{r['t1_s']:.4f} |")
        lines.append("")
    profiled = [r for r in timed if "gpu_busy_ms" in r]
    if profiled:
        lines += ["## Where a decode step goes (CUPTI kernel trace, per decode step: the long run minus the short one)",
                  "", "Attention: kernels whose names match the decode attention kernels (ours, FlashMLA's, FA3's, "
                  "their combines); the rest of the step is the model's other kernels plus GPU idle time. `traced "
                  "step` is the first-to-last kernel span of the traced runs and `idle` its gaps (the same two "
                  "runs, so free of the timed runs' run-to-run noise); `other kernels` = busy - attention.", "",
                  "Host: us per decode step in the backend's metadata builder (under full graphs the step's only "
                  "backend host work), and us per eager `forward_mqa` call in the mixed phase.", "",
                  "| backend | S | B | n-gram | step ms | traced step ms | GPU busy ms | idle ms | "
                  "attention kernels ms | other kernels ms | step - attention ms | kernels/step | host: builder "
                  "us/step | host: mixed forward_mqa us/call |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(profiled, key=lambda r: (r["context"], r["spec"], r["batch"], row_label(r))):
            span = r.get("gpu_span_ms")
            _, attention, other, idle = step_split(r)
            lines.append(f"| {row_label(r)} | {r['context']} | {r['batch']} | {r['spec']} | {r['step_ms']:.3f} | "
                         f"{span if span is not None else '-'} | {r['gpu_busy_ms']:.3f} | {idle:.3f} | "
                         f"{attention:.3f} | {other:.3f} | {r['step_ms'] - attention:.3f} | {r['kernel_launches']} | "
                         f"{r.get('builder_us_per_step', '-')} | {_mixed_forward_us(r)} |")
        lines += attribution_lines(profiled)
        lines += ["", "Heaviest kernels per step (us):", ""]
        for r in sorted(profiled, key=lambda r: (r["context"], r["spec"], r["batch"], row_label(r))):
            kernels = "; ".join(f"`{n[:60]}` {us}" for n, us in r["top_kernels"][:6])
            lines.append(f"- {row_label(r)} S={r['context']} B={r['batch']}: {kernels}")
        spec_rows = [r for r in profiled if r["spec"] and r.get("builder_calls_per_step")]
        if spec_rows:
            lines += ["", "With speculation a timed step is one token per request; the engine steps behind it (one "
                      "builder call each) depend on how many drafts were accepted, so compare these first:", ""]
            for r in sorted(spec_rows, key=lambda r: (r["context"], r["spec"], r["batch"], row_label(r))):
                calls = r["builder_calls_per_step"]
                lines.append(f"- {row_label(r)} S={r['context']} B={r['batch']} n-gram {r['spec']}: "
                             f"{1 / calls:.2f} tokens per engine step, {r['step_ms'] / calls:.3f} ms per engine step")
        idle_rows = [r for r in profiled if r.get("idle_before_us")]
        if idle_rows:
            lines += ["", "GPU idle per step (us) by the kernel that ends the gap (what the GPU waited to start):", ""]
            for r in sorted(idle_rows, key=lambda r: (r["context"], r["spec"], r["batch"], row_label(r))):
                gaps = "; ".join(f"`{n[:60]}` {us}" for n, us in r["idle_before_us"][:6])
                lines.append(f"- {row_label(r)} S={r['context']} B={r['batch']} n-gram {r['spec']}: {gaps}")
        lines.append("")
    starts = [r for r in rows if "start" in r]
    if starts:
        phases = [k for k in START_PHASES if any(k in r for r in starts)]
        lines += ["## Engine start", "", "Seconds from `LLM(...)` to ready; the phases as vLLM's log and ours "
                  "report them (CuTe compiles: in the engine's process, or in background processes and the first "
                  "use's wait for them).", "",
                  "| backend | start | seconds | " + " | ".join(k.removesuffix("_s") for k in phases) + " |",
                  "|---|---|---:|" + "---:|" * len(phases)]
        lines += [f"| {r['backend']} | {r['start']} | {r['start_s']} | "
                  + " | ".join(str(r.get(k, "-")) for k in phases) + " |" for r in starts]
        lines.append("")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["## Errors", ""] + [f"- {row_label(r)}: `{r['error'][-300:]}`" for r in errors]
    md = out_dir / "results.md"
    md.write_text("\n".join(lines) + "\n")
    import csv

    fields = sorted({k for r in rows for k in r if k != "error"})
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    _plot(timed, out_dir)
    return md


def _plot(timed: list[dict], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = sorted({(r["context"], r["spec"], r["graphs"]) for r in timed})
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (context, spec, graphs) in zip(axes[0], keys):
        cell = [r for r in timed if (r["context"], r["spec"], r["graphs"]) == (context, spec, graphs)]
        for b in sorted({row_label(r) for r in cell}):
            pts = sorted((r["batch"], r["step_ms"]) for r in cell if row_label(r) == b)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b,
                    linestyle="-" if b.startswith("CUTE_MLA") else "--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"S={context} spec={spec} {'graphs' if graphs else 'eager'}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    (out_dir / "plots").mkdir(exist_ok=True)
    fig.savefig(out_dir / "plots" / "step_ms_vs_batch.png", dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=",".join(DEFAULT_BACKENDS))
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--spec", default="0,1", help="n-gram speculative tokens per step (q_len = 1 + n)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="prefix caching on: the timed generations find the prompts cached (the GPU-bound "
                             "regime of many layers fits in a device call)")
    parser.add_argument("--prefix-tail", type=int, default=1,
                        help="with --prefix-caching: tokens each prompt brings past its cached context (1: the first "
                             "timed step is a decode; more: a short prefill over a cached context, its time t1_s)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the engine's max_num_seqs (default: the "
                        "largest batch; --start-times: the largest of --batches)")
    parser.add_argument("--max-batched-tokens", type=int, default=16384,
                        help="the engine's max_num_batched_tokens (chunked prefill budget per step)")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="per cell, also trace one short and one long run's kernels (CUPTI): GPU busy and "
                             "attention-kernel time per step, the heaviest kernels")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the engines' KV cache: the model dtype (auto) or fp8 e4m3")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (vLLM TP)")
    parser.add_argument("--decode-context-parallel-size", type=int, default=1,
                        help="vLLM DCP size: ranks that shard the KV cache (divides the TP size)")
    parser.add_argument("--cp-kv-cache-interleave-size", type=int, default=1,
                        help="under DCP: tokens dealt to a rank at a time (1, or up to the block size, dividing it)")
    parser.add_argument("--block-size", type=int, default=None, help="the engines' KV block size (default: vLLM's)")
    parser.add_argument("--timeout", type=float, default=560, help="seconds one engine (its start and cells) may run")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall seconds for all engines of this call: each engine is stopped at its share (its "
                             "finished cells kept), none starts with less than --min-engine-s left; exit status 75 "
                             "when the budget cut the run (keep it ~30 s under the device call's limit)")
    parser.add_argument("--min-engine-s", type=float, default=200,
                        help="with --budget-s: the seconds reserved for each engine still to start (its start, "
                             "~90-180 s on an H100, and its first cells)")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--model-dir", default=None, help="default: a config written into the output directory")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--report", action="store_true", help="render DIR/rows.jsonl only")
    parser.add_argument("--start-times", action="store_true")
    parser.add_argument("--worker-backend", help=argparse.SUPPRESS)
    parser.add_argument("--worker-spec", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.batches, args.contexts, args.spec = _ints(args.batches), _ints(args.contexts), _ints(args.spec)
    if args.worker_backend:
        worker(args)
        return 0
    try:
        check_parallel(args)
        for name in ("budget_s", "min_engine_s", "timeout"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be > 0 (seconds)")
        if args.budget_s is not None and args.start_times:
            raise ValueError("--budget-s with --start-times: the budget covers the timed cells only; allowed: one "
                             "of them")
    except ValueError as e:
        parser.error(str(e))
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"e2e_{time.strftime('%Y-%m-%d')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        if not (out_dir / "rows.jsonl").exists():
            print(f"--report: {out_dir / 'rows.jsonl'} does not exist (no engine has finished there)", file=sys.stderr)
            return 2
        print(render(out_dir))
        return 0
    if args.model_dir is None:
        model_dir = out_dir / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(model_config(args.layers), indent=2))
        args.model_dir = str(model_dir)
    if args.dry_run:
        for c in conditions(args):
            print(json.dumps(c))
        print(f"model config: {args.model_dir}/config.json ({args.layers} layers, hidden 7168)")
        return 0
    if args.start_times:
        rows = start_times(args, out_dir)  # written as they come
        cut = False
    else:
        rows, cut = run_engines(args, out_dir)
    if (out_dir / "rows.jsonl").exists():  # none when the budget let no engine start
        print(render(out_dir))
    return INCOMPLETE if cut else 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
