"""End-to-end decode benchmark through vLLM: time per output token of a DeepSeek-V3-width model per MLA backend.

    python benchmarks/bench_e2e.py --dry-run                       # conditions and the model config; no GPU
    python benchmarks/bench_e2e.py --backends CUTE_MLA,FLASH_ATTN_MLA --out-dir DIR   # time them (appends rows)
    python benchmarks/bench_e2e.py --report --out-dir DIR          # results.md / results.csv / plots from the rows
    python benchmarks/bench_e2e.py --start-times --backends CUTE_MLA,FLASHMLA --out-dir DIR   # cold + warm starts

The model: examples/tiny_deepseek's DeepSeek-V3 attention (128 heads, q_lora 1536, kv_lora 512, rope 64, YaRN) at
DeepSeek-V3's width (hidden 7168) with ``--layers`` dense layers, a small MLP and vocabulary, dummy weights, no
tokenizer. Each backend runs in its own process (one engine, in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
CUDA graphs on unless ``--eager``, prefix caching off. Per cell (batch B, context S, n-gram speculative tokens):
the time of a 65-token generation minus that of a 1-token one (same prompts, so the same prefill), over 64 decode
steps, medians of ``--repeats``: time per decode step and decode tokens/s. For CUTE_MLA also the host time per
step in our metadata builder and in ``forward_mqa`` (zero in graph replays: the graph runs without Python).
``CUTE_MLA:<kernel>`` runs CUTE_MLA with ``CUTE_MLA_KERNEL=<kernel>``.

One call may run out of a device call's 10 minutes: pass a few backends per call; rows append to
``DIR/rows.jsonl`` and ``--report`` renders them all. Not yet run on a GPU (2026-11-23).
"""

from __future__ import annotations

import argparse
import json
import os
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
    return [{"backend": b, "batch": batch, "context": ctx, "spec": spec}
            for b in args.backends for spec in args.spec for ctx in args.contexts for batch in args.batches]


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


# ---------------------------------------------------------------- worker (one backend, one engine)

class HostTimers:
    """Host seconds spent in CUTE_MLA's metadata builder and forward_mqa (wrapped methods)."""

    def __init__(self):
        self.seconds = {"builder": 0.0, "forward_mqa": 0.0}
        self.calls = {"builder": 0, "forward_mqa": 0}

    def install(self):
        from mla_backend_plugin.vllm.backend import CuteMLAImpl, CuteMLAMetadataBuilder

        for cls, method, key in ((CuteMLAMetadataBuilder, "build", "builder"),
                                 (CuteMLAImpl, "forward_mqa", "forward_mqa")):
            original = getattr(cls, method)

            def timed(self_, *a, _original=original, _key=key, **kw):
                t = time.perf_counter()
                try:
                    return _original(self_, *a, **kw)
                finally:
                    self.seconds[_key] += time.perf_counter() - t
                    self.calls[_key] += 1

            setattr(cls, method, timed)

    def snapshot(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


def worker(args) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend, _, kernel = args.worker_backend.partition(":")
    if kernel:
        os.environ["CUTE_MLA_KERNEL"] = kernel
    timers = HostTimers() if backend == "CUTE_MLA" else None
    if timers is not None:
        timers.install()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if args.worker_spec:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.worker_spec,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 8}
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, attention_backend=backend, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=args.eager, max_model_len=max(args.contexts) + 128, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, gpu_memory_utilization=args.gpu_memory_utilization, seed=0, **extra)
    start_s = time.perf_counter() - t0
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, context, args.worker_spec, 0)]

            def run(n: int, prompts=prompts) -> tuple[float, list]:
                params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
                t = time.perf_counter()
                out = llm.generate(prompts, params, use_tqdm=False)
                return time.perf_counter() - t, out

            run(2)  # warm-up of this shape
            one = statistics.median(run(1)[0] for _ in range(args.repeats))
            before = timers.snapshot() if timers else None
            many = []
            for _ in range(args.repeats):
                seconds, _out = run(65)
                many.append(seconds)
            after = timers.snapshot() if timers else None
            step = (statistics.median(many) - one) / 64
            row = {"backend": args.worker_backend, "batch": batch, "context": context, "spec": args.worker_spec,
                   "graphs": not args.eager, "step_ms": round(step * 1e3, 4),
                   "tokens_per_s": round(batch / step, 1) if step > 0 else None, "start_s": round(start_s, 1),
                   "t1_s": round(one, 4), "t65_s": round(statistics.median(many), 4)}
            if timers:
                steps = 64 * args.repeats
                for key in ("builder", "forward_mqa"):
                    spent = after["seconds"][key] - before["seconds"][key]
                    row[f"{key}_us_per_step"] = round(spent / steps * 1e6, 1)
                    row[f"{key}_calls"] = after["calls"][key] - before["calls"][key]
            rows.append(row)
            print("ROW " + json.dumps(row), flush=True)
    print("DONE", flush=True)


# ---------------------------------------------------------------- driver

def run_backend(args, backend: str, spec: int, env: dict | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker-backend", backend, "--worker-spec", str(spec), "--model-dir",
           args.model_dir, "--batches", ",".join(map(str, args.batches)), "--contexts",
           ",".join(map(str, args.contexts)), "--repeats", str(args.repeats), "--gpu-memory-utilization",
           str(args.gpu_memory_utilization)] + (["--eager"] if args.eager else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0:
        rows.append({"backend": backend, "spec": spec, "error": proc.stderr[-2000:]})
    return rows


def start_times(args, out_dir: Path) -> list[dict]:
    """Engine start (LLM construction to ready) per backend: cold (empty package, vLLM and Triton caches) then
    warm (the same caches again)."""
    rows = []
    for backend in args.backends:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUTE_MLA_CUTE_CACHE=os.path.join(cache, "cute"),
                       CUTE_MLA_TUNE_CACHE=os.path.join(cache, "tune.json"),
                       VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            small = argparse.Namespace(**{**vars(args), "batches": [1], "contexts": [1024], "repeats": 1})
            for label in ("cold", "warm"):
                got = run_backend(small, backend, 0, env)
                start = next((r["start_s"] for r in got if "start_s" in r), None)
                rows.append({"backend": backend, "start": label, "start_s": start,
                             "error": next((r["error"] for r in got if "error" in r), None)})
    return rows


def render(out_dir: Path) -> Path:
    rows = [json.loads(line) for line in (out_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows if "step_ms" in r]
    lines = ["# End-to-end decode through vLLM", "",
             "Time per decode step ((t65 - t1) / 64, medians) and decode tokens/s per backend; host time per step in "
             "CUTE_MLA's builder and forward_mqa.", ""]
    keys = sorted({(r["context"], r["spec"], r["graphs"]) for r in timed})
    for context, spec, graphs in keys:
        cell = [r for r in timed if (r["context"], r["spec"], r["graphs"]) == (context, spec, graphs)]
        batches = sorted({r["batch"] for r in cell})
        backends = sorted({r["backend"] for r in cell})
        lines += [f"## S = {context}, n-gram tokens {spec}, {'CUDA graphs' if graphs else 'eager'}", "",
                  "| backend | " + " | ".join(f"B={b} ms/step (tok/s)" for b in batches) + " | builder us/step | "
                  "forward_mqa us/step |", "|---|" + "---:|" * (len(batches) + 2)]
        for b in backends:
            by_batch = {r["batch"]: r for r in cell if r["backend"] == b}
            texts = [f"{by_batch[x]['step_ms']:.3f} ({by_batch[x]['tokens_per_s']})" if x in by_batch else "-"
                     for x in batches]
            last = by_batch.get(batches[-1], {})
            lines.append(f"| {b} | " + " | ".join(texts) + f" | {last.get('builder_us_per_step', '-')} | "
                         f"{last.get('forward_mqa_us_per_step', '-')} |")
        lines.append("")
    starts = [r for r in rows if "start" in r]
    if starts:
        lines += ["## Engine start", "", "| backend | start | seconds |", "|---|---|---:|"]
        lines += [f"| {r['backend']} | {r['start']} | {r['start_s']} |" for r in starts]
        lines.append("")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["## Errors", ""] + [f"- {r['backend']}: `{r['error'][-300:]}`" for r in errors]
    md = out_dir / "results.md"
    md.write_text("\n".join(lines) + "\n")
    import csv

    fields = sorted({k for r in rows for k in r if k != "error"})
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
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
        for b in sorted({r["backend"] for r in cell}):
            pts = sorted((r["batch"], r["step_ms"]) for r in cell if r["backend"] == b)
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
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--timeout", type=float, default=560)
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
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"e2e_{time.strftime('%Y-%m-%d')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
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
    rows = start_times(args, out_dir) if args.start_times else [
        row for b in args.backends for spec in args.spec for row in run_backend(args, b, spec)]
    with open(out_dir / "rows.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(render(out_dir))
    return 0 if not any(r.get("error") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
