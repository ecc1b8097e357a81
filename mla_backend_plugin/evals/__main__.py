"""Model-level eval of the MLA decode backends through vLLM, against a float32 reference of the same model.

    python -m mla_backend_plugin.evals                        # every condition below, shipped model, 1k/4k/8k
    python -m mla_backend_plugin.evals --dry-run              # the conditions and problems, no GPU needed
    python -m mla_backend_plugin.evals --backends CUTE_MLA --kv-dtypes fp8 --lengths 8192 --problems 50

Conditions: each backend (CUTE_MLA with ``auto`` and with each of our kernels, TRITON_MLA, FLASHMLA,
FLASH_ATTN_MLA) x KV dtype (bf16 ``auto``, ``fp8``) x mode (eager, CUDA graphs) x speculation (none, n-gram with
3 draft tokens: q_len 4 where the backend allows it). Each condition runs in its own process (one vLLM engine
per process), greedy, with the full next-token distribution of every generated token (``logprobs`` = vocab).

Per condition, task and context length: exact-match accuracy with its Wilson 95% interval, and the mean and max
per-token KL(reference || backend) of the next-token distributions, the reference being the float32 torch model
(``model.py``) run on the prompt plus the tokens that backend generated. Writes ``results.csv``, ``results.md``
and ``accuracy_vs_length.png``; exits 1 when one of our kernels is significantly less accurate (two-proportion
test, p < 0.01) than the reference or than vLLM's own backends under the same KV dtype, or its KL is far
above theirs.

Real checkpoints: ``--model DIR`` takes any model directory in this package's format (config.json +
model.safetensors of a DeepseekV3ForCausalLM with the eval vocabulary). For a real DeepSeek checkpoint
(e.g. DeepSeek-V2-Lite) use lm-eval through vLLM, which needs a tokenizer and a task of its own (README.md has
the command); that path was not run here (no checkpoint can be downloaded).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

from mla_backend_plugin.evals import MODEL_DIR, tasks

OUR_KERNELS = ("auto", "cute_sm90", "triton", "xqa_sm120")
PEER_BACKENDS = ("TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
# backends vLLM 0.26 runs with q_len > 1 in decode (n-gram speculation); TRITON_MLA decodes one token per step
SPEC_BACKENDS = ("CUTE_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
NO_FP8 = ("FLASH_ATTN_MLA",)  # vLLM 0.26 refuses an fp8 cache there


@dataclasses.dataclass(frozen=True)
class Condition:
    backend: str  # vLLM attention backend name
    kernel: str  # our kernel for CUTE_MLA (CUTE_MLA_KERNEL), "-" for the others
    kv_dtype: str  # "auto" (bf16) | "fp8"
    mode: str  # "eager" | "graphs"
    spec: int  # n-gram draft tokens (0: none)

    @property
    def label(self) -> str:
        name = self.backend if self.backend != "CUTE_MLA" else f"CUTE_MLA[{self.kernel}]"
        return f"{name} kv={'bf16' if self.kv_dtype == 'auto' else self.kv_dtype} {self.mode}" + (
            f" spec{self.spec}" if self.spec else "")

    @property
    def ours(self) -> bool:
        return self.backend == "CUTE_MLA"


def conditions(backends, kernels, kv_dtypes, modes, specs) -> list[Condition]:
    out = []
    for backend in backends:
        for kernel in (kernels if backend == "CUTE_MLA" else ("-",)):
            for kv in kv_dtypes:
                if kv == "fp8" and backend in NO_FP8:
                    continue
                for mode in modes:
                    for spec in specs:
                        if spec and backend not in SPEC_BACKENDS:
                            continue
                        out.append(Condition(backend, kernel, kv, mode, spec))
    return out


# ---------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------

def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def worse_p_value(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """One-sided p-value that proportion a is below proportion b (pooled two-proportion z-test)."""
    if n_a == 0 or n_b == 0:
        return 1.0
    pa, pb = hits_a / n_a, hits_b / n_b
    pool = (hits_a + hits_b) / (n_a + n_b)
    se = math.sqrt(pool * (1 - pool) * (1 / n_a + 1 / n_b))
    if se == 0:
        return 1.0 if pa >= pb else 0.0
    z = (pa - pb) / se
    return 0.5 * math.erfc(-z / math.sqrt(2))


def kl_divergence(ref_logprobs, test_logprobs) -> float:
    """KL(ref || test) of two full next-token log-probability vectors (lists or tensors)."""
    import torch

    ref = torch.as_tensor(ref_logprobs, dtype=torch.float64)
    test = torch.as_tensor(test_logprobs, dtype=torch.float64)
    return float((ref.exp() * (ref - test)).sum())


# ---------------------------------------------------------------------------------------------------------
# one condition in a worker process (one vLLM engine)
# ---------------------------------------------------------------------------------------------------------

def run_condition(cond: Condition, model_dir: str, problems: list[tasks.Problem]) -> list[dict]:
    """Generate every problem's answer with vLLM under ``cond``; per problem the tokens and, per generated
    token, the full log-probability vector."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if cond.ours and cond.kernel != "auto":
        os.environ["CUTE_MLA_KERNEL"] = cond.kernel
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    extra = {}
    if cond.spec:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cond.spec,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    max_len = max(p.context_len for p in problems) + 16
    llm = LLM(model=model_dir, attention_backend=cond.backend, skip_tokenizer_init=True,
              enforce_eager=cond.mode == "eager", kv_cache_dtype=cond.kv_dtype, max_model_len=max_len,
              max_num_seqs=32, max_logprobs=vocab, gpu_memory_utilization=0.6, seed=0, **extra)
    params = [SamplingParams(temperature=0.0, max_tokens=len(p.answer), logprobs=vocab, detokenize=False)
              for p in problems]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.prompt) for p in problems], params, use_tqdm=False)
    results = []
    for o in outs:
        comp = o.outputs[0]
        dists = []
        for step in comp.logprobs or []:
            vec = [-math.inf] * vocab
            for tok, lp in step.items():
                vec[tok] = lp.logprob
            dists.append(vec)
        results.append({"tokens": list(comp.token_ids), "logprobs": dists})
    return results


def _worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    cond = Condition(**spec["condition"])
    problems = [tasks.Problem(**p) for p in spec["problems"]]
    results = run_condition(cond, spec["model_dir"], problems)
    with open(spec["out"], "w") as f:
        json.dump(results, f)
    return 0


# ---------------------------------------------------------------------------------------------------------
# reference and scoring
# ---------------------------------------------------------------------------------------------------------

def reference_logprobs(model, problems: list[tasks.Problem], generated: list[list[int]], device) -> list:
    """Per problem, the float32 model's next-token log-probabilities at every generated position, given the
    prompt and the tokens that were generated before it (teacher forcing on the backend's own output)."""
    import torch

    out = []
    with torch.no_grad():
        for p, gen in zip(problems, generated):
            if not gen:
                out.append([])
                continue
            seq = torch.tensor([p.prompt + gen[:-1]], device=device)
            logits = model(seq)[0, len(p.prompt) - 1:].float()
            out.append(torch.log_softmax(logits, -1).cpu().tolist())
    return out


def score(problems, results, ref_lps) -> dict:
    hits = sum(int(r["tokens"] == p.answer) for p, r in zip(problems, results))
    kls = [kl_divergence(ref, test) for r, refs in zip(results, ref_lps) for ref, test in zip(refs, r["logprobs"])
           if all(math.isfinite(x) for x in test)]
    lo, hi = wilson(hits, len(problems))
    return {"hits": hits, "n": len(problems), "accuracy": hits / max(len(problems), 1), "ci_low": lo,
            "ci_high": hi, "kl_mean": sum(kls) / len(kls) if kls else float("nan"),
            "kl_max": max(kls) if kls else float("nan"), "kl_tokens": len(kls)}


def verdicts(rows: list[dict], alpha: float = 0.01, kl_factor: float = 10.0) -> list[str]:
    """Why our kernels fail the eval (empty: they pass): significantly less accurate than the reference or
    than the best of vLLM's backends under the same KV dtype, task and length; or a mean KL more than
    ``kl_factor`` x the largest of vLLM's backends there (and above 1e-3)."""
    problems = []
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        by_key.setdefault((r["task"], r["length"], r["kv_dtype"]), []).append(r)
    for key, group in by_key.items():
        ref = next((g for g in group if g["condition"] == "reference"), None)
        peers = [g for g in group if not g["ours"] and g["condition"] != "reference"]
        best_peer = max(peers, key=lambda g: g["accuracy"], default=None)
        peer_kl = max((g["kl_mean"] for g in peers if math.isfinite(g["kl_mean"])), default=None)
        for g in group:
            if not g["ours"]:
                continue
            for other, what in ((ref, "the float32 reference"), (best_peer, f"{best_peer and best_peer['condition']}")):
                if other is None:
                    continue
                p = worse_p_value(g["hits"], g["n"], other["hits"], other["n"])
                if p < alpha:
                    problems.append(f"{g['condition']} {key}: accuracy {g['accuracy']:.3f} below {what} "
                                    f"{other['accuracy']:.3f} (p = {p:.2g})")
            if peer_kl is not None and math.isfinite(g["kl_mean"]) and g["kl_mean"] > max(1e-3, kl_factor * peer_kl):
                problems.append(f"{g['condition']} {key}: mean KL {g['kl_mean']:.3g} > {kl_factor} x vLLM's "
                                f"{peer_kl:.3g}")
    return problems


def write_outputs(rows: list[dict], out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    cols = ["condition", "ours", "kv_dtype", "mode", "spec", "task", "length", "hits", "n", "accuracy", "ci_low",
            "ci_high", "kl_mean", "kl_max", "kl_tokens"]
    paths = [os.path.join(out_dir, "results.csv"), os.path.join(out_dir, "results.md")]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(paths[1], "w") as f:
        f.write("| condition | task | length | accuracy (95% CI) | KL mean | KL max |\n|---|---|---:|---|---:|---:|\n")
        for r in rows:
            f.write(f"| {r['condition']} | {r['task']} | {r['length']} | {r['accuracy']:.3f} "
                    f"({r['ci_low']:.3f} .. {r['ci_high']:.3f}) | {r['kl_mean']:.3g} | {r['kl_max']:.3g} |\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(tasks.TASKS), figsize=(6 * len(tasks.TASKS), 4.5), squeeze=False)
        for ax, task in zip(axes[0], tasks.TASKS):
            for cond in dict.fromkeys(r["condition"] for r in rows):
                pts = sorted((r["length"], r["accuracy"]) for r in rows if r["condition"] == cond and r["task"] == task)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=cond)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("exact match")
            ax.set_title(task)
            ax.set_ylim(-0.02, 1.02)
        axes[0][-1].legend(fontsize=6, loc="lower left")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "accuracy_vs_length.png"))
        fig.savefig(paths[-1], dpi=120)
    except ImportError:
        pass
    return paths


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return _worker_main(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_DIR, help="model directory (default: the shipped model)")
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--problems", type=int, default=100, help="problems per task and length")
    parser.add_argument("--backends", default="CUTE_MLA," + ",".join(PEER_BACKENDS))
    parser.add_argument("--kernels", default=",".join(OUR_KERNELS), help="our kernels under CUTE_MLA")
    parser.add_argument("--kv-dtypes", default="auto,fp8")
    parser.add_argument("--modes", default="eager,graphs")
    parser.add_argument("--spec", default="0,3", help="n-gram draft tokens (0 = no speculation)")
    parser.add_argument("--out", default="eval_results")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)

    lengths = [int(x) for x in args.lengths.split(",")]
    conds = conditions(args.backends.split(","), args.kernels.split(","), args.kv_dtypes.split(","),
                       args.modes.split(","), [int(x) for x in args.spec.split(",")])
    problems = {(t, n): tasks.eval_problems(t, n, args.problems) for t in tasks.TASKS for n in lengths}
    print(f"{len(conds)} conditions x {len(problems)} (task, length) sets of {args.problems} problems; model "
          f"{args.model}")
    if args.dry_run:
        for c in conds:
            print(f"  {c.label}")
        return 0
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        print(f"{args.model} holds no model.safetensors (train one: python -m mla_backend_plugin.evals.train)",
              file=sys.stderr)
        return 2
    import torch

    from mla_backend_plugin.evals.model import EvalModel, greedy_answer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref_model = EvalModel.load_hf(args.model, device=device, dtype=torch.float32)
    flat = [p for key in problems for p in problems[key]]
    rows = []
    # the reference itself: greedy answers of the float32 model (KL 0 by definition)
    ref_tokens = []
    with torch.no_grad():
        for p in flat:
            ref_tokens.append(greedy_answer(ref_model, p.prompt, len(p.answer), device))
    for kv in args.kv_dtypes.split(","):
        for (task, n), probs in problems.items():
            idx = [flat.index(p) for p in probs]
            hits = sum(int(ref_tokens[i] == flat[i].answer) for i in idx)
            lo, hi = wilson(hits, len(idx))
            rows.append({"condition": "reference", "ours": False, "kv_dtype": kv, "mode": "-", "spec": 0,
                         "task": task, "length": n, "hits": hits, "n": len(idx), "accuracy": hits / len(idx),
                         "ci_low": lo, "ci_high": hi, "kl_mean": 0.0, "kl_max": 0.0, "kl_tokens": 0})
    with tempfile.TemporaryDirectory() as tmp:
        for c in conds:
            spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
            with open(spec_path, "w") as f:
                json.dump({"condition": dataclasses.asdict(c), "model_dir": os.path.abspath(args.model),
                           "problems": [dataclasses.asdict(p) for p in flat], "out": out_path}, f)
            print(f"running {c.label} ...", flush=True)
            proc = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--worker", spec_path],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"  failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
                continue
            with open(out_path) as f:
                results = json.load(f)
            ref_lps = reference_logprobs(ref_model, flat, [r["tokens"] for r in results], device)
            for (task, n), probs in problems.items():
                idx = [flat.index(p) for p in probs]
                s = score([flat[i] for i in idx], [results[i] for i in idx], [ref_lps[i] for i in idx])
                rows.append({"condition": c.label, "ours": c.ours, "kv_dtype": c.kv_dtype, "mode": c.mode,
                             "spec": c.spec, "task": task, "length": n, **s})
                print(f"  {task}@{n}: {s['accuracy']:.3f} ({s['ci_low']:.3f} .. {s['ci_high']:.3f}), KL mean "
                      f"{s['kl_mean']:.3g} max {s['kl_max']:.3g}", flush=True)
    for path in write_outputs(rows, args.out):
        print(path)
    failures = verdicts(rows)
    for line in failures:
        print("FAIL:", line)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
