"""Model-level eval of the MLA decode backends through vLLM, against a float32 reference of the same model.

    python -m mla_backend_plugin.evals                        # the full plan: every condition below, 1k/4k/8k
    python -m mla_backend_plugin.evals --plan device --jobs 8 # the reduced plan for one ~7-minute GPU call
    python -m mla_backend_plugin.evals --dry-run              # the conditions and problems, no GPU needed
    python -m mla_backend_plugin.evals --backends CUTE_MLA --kv-dtypes fp8 --lengths 8192 --problems 50

Conditions: each backend (CUTE_MLA with ``auto`` and with each of our kernels, TRITON_MLA, FLASHMLA,
FLASH_ATTN_MLA) x KV dtype (bf16 ``auto``, ``fp8``) x mode (eager, CUDA graphs) x speculation (none, n-gram with
3 draft tokens: q_len 4 where the backend allows it), and ``torch bf16``: the same model in plain torch with
bf16 arithmetic and no cache, the yardstick for what bf16 alone costs. Each condition runs in its own process
(one vLLM engine per process, in-process engine core), greedy, with the full next-token distribution of every
generated token (``logprobs`` = vocab). ``--plan device`` keeps every backend and every kernel of ours that runs
on SM90 with CUDA graphs and both KV dtypes, and eager and n-gram speculation only for CUTE_MLA ``auto`` and
FLASHMLA (``PLANS``). The backend, kernel, KV dtype, mode and speculation flags filter the plan.

``--jobs N`` runs N conditions at once on the one GPU. Every engine gets the same fixed KV cache
(``kv_cache_bytes``) whatever N is, so engines neither size their caches from memory the others hold nor
schedule differently from a run alone: results are those of ``--jobs 1``, reported in the plan's order.
``--timeout`` bounds each condition (its process group is killed), ``--budget-s`` the whole run: no condition
starts when too little of it is left, and those still running at its end are killed; what finished is scored
and written.

Per condition, task and context length: exact-match accuracy with its Wilson 95% interval, and the mean and max
per-token KL(reference || backend) of the next-token distributions, the reference being the float32 torch model
(``model.py``) run on the prompt plus the tokens that backend generated (``TorchReference``: computed once per
answer prefix, batched, shared by every condition). Writes ``results.csv``, ``results.md``, ``results.json``,
``accuracy_vs_length.png`` and one log per condition (``logs/``); exits 1 when one of our kernels is
significantly less accurate (two-proportion test, p < 0.01) than the reference or than vLLM's own backends under
the same KV dtype, or its KL is far above theirs, or one of its conditions did not finish.

Real checkpoints: ``--model DIR`` takes any model directory in this package's format (config.json +
model.safetensors of a DeepseekV3ForCausalLM with the eval vocabulary). A real DeepSeek checkpoint (e.g.
DeepSeek-V2-Lite, with its tokenizer) takes an lm-eval task instead: ``--model DIR --lm-eval-task gsm8k`` runs
lm-eval through vLLM once per backend and compares the scores (``lm_eval_route.py``); that path was not run here
(no checkpoint can be downloaded).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from mla_backend_plugin.evals import MODEL_DIR, tasks

OUR_KERNELS = ("auto", "cute_sm90", "triton", "xqa_sm120")
PEER_BACKENDS = ("TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
BACKENDS = ("CUTE_MLA",) + PEER_BACKENDS
# backends vLLM 0.26 runs with q_len > 1 in decode (n-gram speculation); TRITON_MLA decodes one token per step
SPEC_BACKENDS = ("CUTE_MLA", "FLASHMLA", "FLASH_ATTN_MLA")
NO_FP8 = ("FLASH_ATTN_MLA",)  # vLLM 0.26 refuses an fp8 cache there
TORCH = "torch"  # the eval model in plain torch, bf16 arithmetic, no cache: not a vLLM backend
REFERENCE = "reference"  # the float32 torch model, computed by the runner itself
NGRAM_TOKENS = 3
# our mean KL above KL_FACTOR x vLLM's backends' fails the eval, unless it stays below NEGLIGIBLE_KL (nats)
KL_FACTOR = 10.0
NEGLIGIBLE_KL = 1e-3
MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 32768  # four 8k prompts per step: the prefill of 600 prompts takes ~100 engine steps
# with a fixed KV cache (kv_cache_memory_bytes) vLLM uses gpu_memory_utilization only to demand that much free
# memory at startup: keep it small so that --jobs engines start side by side
STARTUP_FREE_FRACTION = 0.05
MIN_START_S = 60.0  # no engine starts, compiles and generates in less: later conditions are skipped instead
# tokens per forward pass of the torch model on a GPU (a few GB of activations); on the CPU one sequence per pass:
# its attention materialises the [heads, T, T] scores
REFERENCE_BATCH_TOKENS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Condition:
    backend: str  # vLLM attention backend name, or TORCH
    kernel: str  # our kernel for CUTE_MLA (CUTE_MLA_KERNEL), "-" for the others
    kv_dtype: str  # "auto" (bf16) | "fp8"
    mode: str  # "eager" | "graphs"
    spec: int  # n-gram draft tokens (0: none)

    @property
    def label(self) -> str:
        if self.backend == TORCH:
            return "torch bf16"
        name = self.backend if self.backend != "CUTE_MLA" else f"CUTE_MLA[{self.kernel}]"
        return f"{name} kv={'bf16' if self.kv_dtype == 'auto' else self.kv_dtype} {self.mode}" + (
            f" spec{self.spec}" if self.spec else "")

    @property
    def ours(self) -> bool:
        return self.backend == "CUTE_MLA"


TORCH_CONDITION = Condition(TORCH, "-", "-", "-", 0)  # no cache, no engine: only --backends selects it


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


def select(conds, backends=None, kernels=None, kv_dtypes=None, modes=None, specs=None) -> list[Condition]:
    """The conditions of ``conds`` that every given filter admits (None: all); ``kernels`` filters CUTE_MLA's, and
    the torch condition has no KV dtype, mode or speculation to filter."""
    return [c for c in conds
            if (backends is None or c.backend in backends) and (kernels is None or not c.ours or c.kernel in kernels)
            and (c.backend == TORCH or ((kv_dtypes is None or c.kv_dtype in kv_dtypes)
                                        and (modes is None or c.mode in modes) and (specs is None or c.spec in specs)))]


@dataclasses.dataclass(frozen=True)
class Plan:
    conditions: tuple[Condition, ...]  # in the order they start and are reported
    lengths: tuple[int, ...]
    problems: int  # per task and length
    timeout_s: float  # per condition
    budget_s: float | None  # the whole run (None: no limit)


def sm90_kernels() -> tuple[str, ...]:
    """``auto`` and each of our kernels whose family is built for sm_90a (the registry's manifests)."""
    from mla_backend_plugin.ops.registry import KERNELS

    return tuple(k for k in OUR_KERNELS if k == "auto" or "sm_90a" in KERNELS[k].archs)


def device_plan() -> Plan:
    """One GPU call (~9 minutes on one H100; the GPU test in a call of its own): every backend and every kernel
    of ours that runs on SM90, with CUDA graphs, bf16 and fp8 caches (where the backend allows fp8); eager and
    n-gram speculation for CUTE_MLA auto and FLASHMLA (the peer that has both fp8 and q_len > 1). 22 conditions,
    ours first. Measured (nvidia-h100-x1, 2026-11-24, --jobs 8, warm kernel cache, cold Inductor cache): an
    engine condition takes 120-160 s under the contention of 8 engine starts, so three waves need ~8 minutes;
    the float32 reference runs while the first engines start. The 360 s budget of that run cut the last five
    conditions; the budget is now 500 s."""
    kv = ("auto", "fp8")
    ours_graphs = conditions(("CUTE_MLA",), sm90_kernels(), kv, ("graphs",), (0,))
    peers_graphs = conditions(PEER_BACKENDS, (), kv, ("graphs",), (0,))
    extra = [c for backend in ("CUTE_MLA", "FLASHMLA")
             for c in conditions((backend,), ("auto",), kv, ("eager",), (0,))
             + conditions((backend,), ("auto",), kv, ("graphs",), (NGRAM_TOKENS,))]
    return Plan((TORCH_CONDITION, *ours_graphs, *peers_graphs, *extra), (1024, 4096, 8192), 100, timeout_s=240,
                budget_s=500)


def full_plan() -> Plan:
    grid = conditions(BACKENDS, OUR_KERNELS, ("auto", "fp8"), ("eager", "graphs"), (0, NGRAM_TOKENS))
    return Plan((TORCH_CONDITION, *grid), (1024, 4096, 8192), 100, timeout_s=600, budget_s=None)


PLANS = {"full": full_plan, "device": device_plan}


def problem_sets(lengths, count: int) -> dict[tuple[str, int], list[tasks.Problem]]:
    return {(t, n): tasks.eval_problems(t, n, count) for t in tasks.TASKS for n in lengths}


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


def kl_divergence(ref_logprobs, test_logprobs):
    """KL(ref || test) of full next-token log-probability vectors [..., vocab] (lists or tensors): a float for
    one pair of vectors, a float64 tensor of the leading shape for stacks of them."""
    import torch

    # renormalised in float64: vectors that came out of a float32 softmax sum to 1 only within ~1e-7, enough to
    # make KL of near-identical, confident distributions come out negative
    ref = torch.as_tensor(ref_logprobs, dtype=torch.float64)
    ref = ref - ref.logsumexp(-1, keepdim=True)
    test = torch.as_tensor(test_logprobs, dtype=torch.float64)
    test = test - test.logsumexp(-1, keepdim=True)
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0.0)
    return float(kl) if kl.dim() == 0 else kl


# ---------------------------------------------------------------------------------------------------------
# the torch model: the float32 reference (and the torch bf16 condition)
# ---------------------------------------------------------------------------------------------------------

class TorchReference:
    """A torch model's next-token log-probabilities after each problem's prompt followed by answer prefixes.

    A prefix's log-probabilities do not depend on what follows it, so each is computed once and kept (float32,
    CPU) for every condition that generated it: backends mostly generate the reference's own answer, and scoring
    them then needs no forward pass. Sequences of one length run as one batch (all prompts of a task and length
    have the same length), up to ``batch_tokens`` tokens per pass (REFERENCE_BATCH_TOKENS), halved when the GPU
    runs out of memory.
    """

    def __init__(self, model, problems: list[tasks.Problem], device, batch_tokens: int | None = None):
        self.model = model
        self.problems = problems
        self.device = device
        if batch_tokens is None:
            batch_tokens = REFERENCE_BATCH_TOKENS if device.type == "cuda" else 1
        self.batch_tokens = batch_tokens
        self.rows: list[dict[tuple[int, ...], object]] = [{} for _ in problems]  # answer prefix -> [vocab]

    def _missing(self, i: int, seq: list[int]) -> bool:
        return any(tuple(seq[:k]) not in self.rows[i] for k in range(len(seq) + 1))

    def _ensure(self, items: list[tuple[int, list[int]]]) -> None:
        """Rows for the prefixes seq[:0] .. seq[:len(seq)] of every (problem index, seq): one forward pass of the
        prompt followed by seq gives them all."""
        by_len: dict[int, list[tuple[int, list[int]]]] = {}
        for i, seq in items:
            if self._missing(i, seq):
                by_len.setdefault(len(self.problems[i].prompt) + len(seq), []).append((i, seq))
        for length, group in sorted(by_len.items()):
            per_pass = max(1, self.batch_tokens // length)
            for start in range(0, len(group), per_pass):
                self._forward(group[start:start + per_pass])

    def _forward(self, group: list[tuple[int, list[int]]]) -> None:
        import torch

        tokens = torch.tensor([self.problems[i].prompt + seq for i, seq in group], device=self.device)
        try:
            with torch.no_grad():
                logits = self.model(tokens)
        except torch.cuda.OutOfMemoryError:
            if len(group) == 1:
                raise
            logits = None  # retried outside this block: the exception holds the failed pass's tensors
        if logits is None:
            half = len(group) // 2
            self._forward(group[:half])
            self._forward(group[half:])
            return
        for b, (i, seq) in enumerate(group):
            start = len(self.problems[i].prompt) - 1
            logprobs = torch.log_softmax(logits[b, start:].float(), -1).cpu()
            for k in range(len(seq) + 1):
                self.rows[i].setdefault(tuple(seq[:k]), logprobs[k])

    def logprobs(self, generated: list[list[int]]) -> list:
        """Per problem, [len(generated), vocab]: the log-probabilities at each generated position given the prompt
        and the tokens generated before it (teacher forcing on the backend's own output)."""
        import torch

        self._ensure([(i, gen[:-1]) for i, gen in enumerate(generated) if gen])
        vocab = self.model.c.vocab_size
        return [torch.stack([self.rows[i][tuple(gen[:k])] for k in range(len(gen))]) if gen
                else torch.empty(0, vocab) for i, gen in enumerate(generated)]

    def greedy(self) -> list[list[int]]:
        """Each problem's greedy answer (len(answer) tokens, as vLLM is asked for). It starts from the right answer
        and replaces the first token that is not the argmax given the tokens before it, until none is: one pass
        checks every position, so a problem the model solves costs one pass, not one per token."""
        paths = [list(p.answer) for p in self.problems]
        pending = list(range(len(self.problems)))
        while pending:
            self._ensure([(i, paths[i][:-1]) for i in pending])
            wrong = []
            for i in pending:
                path = paths[i]
                for k in range(len(path)):
                    best = int(self.rows[i][tuple(path[:k])].argmax())
                    if best != path[k]:
                        path[k] = best  # what follows stays a guess, checked after the corrected prefix next pass
                        wrong.append(i)
                        break
            pending = wrong
        return paths


def torch_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------------------
# one condition in a worker process (one vLLM engine, or the torch model)
# ---------------------------------------------------------------------------------------------------------

def kv_cache_bytes(hf: dict, max_model_len: int, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """A KV cache that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens at 2 bytes per value (an fp8
    cache gets twice the blocks), plus a quarter for block rounding and n-gram lookahead slots: no request waits
    or is preempted for cache space, in any run."""
    per_token = hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * 2
    return int(per_token * max_model_len * max_num_seqs * 1.25)


def engine_kwargs(cond: Condition, hf: dict, max_prompt_len: int) -> dict:
    """vLLM ``LLM(...)`` arguments of a condition; the same whatever ``--jobs`` is."""
    max_len = max_prompt_len + 16
    kwargs = dict(attention_backend=cond.backend, skip_tokenizer_init=True, enforce_eager=cond.mode == "eager",
                  kv_cache_dtype=cond.kv_dtype, max_model_len=max_len, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_len),
                  max_logprobs=hf["vocab_size"], kv_cache_memory_bytes=kv_cache_bytes(hf, max_len),
                  gpu_memory_utilization=STARTUP_FREE_FRACTION, seed=0)
    if cond.spec:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cond.spec,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    return kwargs


def worker_env(cond: Condition, jobs: int, cache_root: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               # the engine core in the worker itself: every request is queued before the first step, so the
               # batches (and the numerics) do not depend on timing, and one process group holds everything
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               # vLLM writes its compile cache index in place: two engines of one config must not share it
               VLLM_CACHE_ROOT=cache_root)
    env.pop("CUTE_MLA_KERNEL", None)
    if cond.ours and cond.kernel != "auto":
        env["CUTE_MLA_KERNEL"] = cond.kernel
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if jobs > 1:  # N engines on the host's cores: a share each for torch's CPU threads (vLLM compiles on one)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def run_condition(cond: Condition, model_dir: str, problems: list[tasks.Problem]) -> list[dict]:
    """Generate every problem's answer under ``cond``; per problem the tokens and the full log-probability vector
    [tokens, vocab] of each generated token."""
    import torch

    if cond.backend == TORCH:
        from mla_backend_plugin.evals.model import EvalModel

        device = torch_device()
        run = TorchReference(EvalModel.load_hf(model_dir, device=device, dtype=torch.bfloat16), problems, device)
        paths = run.greedy()
        return [{"tokens": p, "logprobs": lp} for p, lp in zip(paths, run.logprobs(paths))]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    vocab = hf["vocab_size"]
    llm = LLM(model=model_dir, **engine_kwargs(cond, hf, max(p.context_len for p in problems)))
    params = [SamplingParams(temperature=0.0, max_tokens=len(p.answer), logprobs=vocab, detokenize=False)
              for p in problems]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.prompt) for p in problems], params, use_tqdm=False)
    results = []
    for o in outs:
        comp = o.outputs[0]
        dists = torch.full((len(comp.logprobs or []), vocab), -math.inf)
        for row, step in zip(dists, comp.logprobs or []):
            row[list(step)] = torch.tensor([lp.logprob for lp in step.values()])
        results.append({"tokens": list(comp.token_ids), "logprobs": dists})
    return results


def _die_with(parent_pid: int) -> None:
    """SIGKILL this process when the runner dies, however it dies (an OOM kill runs no cleanup): an orphaned
    engine would hold GPU memory and cores for the rest of the call."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the call above
        os._exit(1)


def _worker_main(spec_path: str) -> int:
    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    _die_with(spec["runner_pid"])
    with open(spec["problems"]) as f:
        problems = [tasks.Problem(**p) for p in json.load(f)]
    results = run_condition(Condition(**spec["condition"]), spec["model_dir"], problems)
    torch.save(results, spec["out"])
    return 0


# ---------------------------------------------------------------------------------------------------------
# running the conditions' processes, up to --jobs at once
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """One process and how it ended: status pending | running | ok | failed | timeout | cut | skipped."""
    label: str
    argv: list[str]
    env: dict[str, str] | None
    log_path: str
    status: str = "pending"
    detail: str = ""
    seconds: float = 0.0
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @property
    def ended(self) -> bool:
        return self.status not in ("pending", "running")


def _last_error_line(log_path: str) -> str:
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
    return (errors or lines or [""])[-1][-300:]


class Runner:
    """Starts ``runs`` in order, at most ``jobs`` at once, each in its own process group (vLLM's and the
    compilers' children die with it); kills one that outlives ``timeout_s`` or the ``deadline``
    (time.monotonic()), and starts none with less than MIN_START_S of the deadline left."""

    def __init__(self, runs: list[Run], jobs: int, timeout_s: float, deadline: float | None = None,
                 min_start_s: float = MIN_START_S):
        self.runs, self.jobs, self.timeout_s, self.deadline = runs, max(1, jobs), timeout_s, deadline
        self.min_start_s = min_start_s

    def done(self) -> bool:
        return all(r.ended for r in self.runs)

    def poll(self) -> None:
        now = time.monotonic()
        overdue = []
        for run in self.runs:
            if run.status != "running":
                continue
            code = run.proc.poll()
            limit = run.started + self.timeout_s
            if self.deadline is not None:
                limit = min(limit, self.deadline)
            if code is None and now >= limit:
                overdue.append(run)
            elif code is not None:
                run.status = "ok" if code == 0 else "failed"
                run.detail = "" if code == 0 else f"exit {code}: {_last_error_line(run.log_path)}"
                run.seconds = now - run.started
        self._kill(overdue)
        for run in overdue:
            # "cut": the whole run's budget ended it before its own timeout (not a verdict on the condition)
            cut = run.started + self.timeout_s > now
            run.status = "cut" if cut else "timeout"
            why = "the run's time budget ended it" if cut else "killed"
            run.detail = f"{why} after {now - run.started:.0f} s; log: {_last_error_line(run.log_path)}"
            run.seconds = now - run.started
        running = sum(r.status == "running" for r in self.runs)
        for run in self.runs:
            if run.status != "pending" or running >= self.jobs:
                continue
            if self.deadline is not None and self.deadline - time.monotonic() < self.min_start_s:
                run.status, run.detail = "skipped", "the run's time budget was spent"
                continue
            os.makedirs(os.path.dirname(run.log_path) or ".", exist_ok=True)
            with open(run.log_path, "w") as log:
                run.proc = subprocess.Popen(run.argv, env=run.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
            run.status, run.started = "running", time.monotonic()
            running += 1

    @staticmethod
    def _kill(runs: list[Run], grace_s: float = 10.0) -> None:
        """SIGTERM to every run's process group at once, SIGKILL after ``grace_s`` (also to whatever a group
        leader that exited left behind)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for run in runs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, sig)
            end = time.monotonic() + grace_s
            for run in runs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=max(0.0, end - time.monotonic()))

    def kill_all(self) -> None:
        running = [run for run in self.runs if run.status == "running"]
        self._kill(running)
        for run in running:
            run.status, run.detail = "timeout", "the eval was stopped"
            run.seconds = time.monotonic() - run.started


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")


# ---------------------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------------------

def score(problems, results, ref_lps) -> dict:
    import torch

    hits = sum(int(r["tokens"] == p.answer) for p, r in zip(problems, results))
    kls = []
    for r, ref in zip(results, ref_lps):
        test = torch.as_tensor(r["logprobs"], dtype=torch.float32).reshape(-1, ref.shape[-1])[:len(ref)]
        finite = torch.isfinite(test).all(-1)  # a vector vLLM did not return whole cannot be compared
        kls += kl_divergence(ref[:len(test)][finite], test[finite]).tolist()
    lo, hi = wilson(hits, len(problems))
    return {"hits": hits, "n": len(problems), "accuracy": hits / max(len(problems), 1), "ci_low": lo,
            "ci_high": hi, "kl_mean": sum(kls) / len(kls) if kls else float("nan"),
            "kl_max": max(kls) if kls else float("nan"), "kl_tokens": len(kls)}


def condition_rows(cond_fields: dict, sets, results, ref_lps) -> list[dict]:
    """One row per (task, length) of a condition; ``results`` and ``ref_lps`` in the order of ``sets``."""
    rows, at = [], 0
    for (task, n), probs in sets.items():
        part = slice(at, at + len(probs))
        at += len(probs)
        rows.append({**cond_fields, "task": task, "length": n, **score(probs, results[part], ref_lps[part])})
    return rows


def verdicts(rows: list[dict], alpha: float = 0.01, kl_factor: float = KL_FACTOR) -> list[str]:
    """Why our kernels fail the eval (empty: they pass): significantly less accurate than the reference or
    than the best of vLLM's backends under the same KV dtype, task and length; or a mean KL more than
    ``kl_factor`` x the largest of vLLM's backends there (and above NEGLIGIBLE_KL)."""
    problems = []
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        by_key.setdefault((r["task"], r["length"], r["kv_dtype"]), []).append(r)
    for key, group in by_key.items():
        ref = next((g for g in group if g["backend"] == REFERENCE), None)
        peers = [g for g in group if g["backend"] in PEER_BACKENDS]
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
            if (peer_kl is not None and math.isfinite(g["kl_mean"])
                    and g["kl_mean"] > max(NEGLIGIBLE_KL, kl_factor * peer_kl)):
                problems.append(f"{g['condition']} {key}: mean KL {g['kl_mean']:.3g} > {kl_factor} x vLLM's "
                                f"{peer_kl:.3g}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------------------

def summary_lines(rows: list[dict], runs: list[dict]) -> list[str]:
    """A compact table: per condition its status, seconds, accuracy per task and length, worst mean and max KL."""
    cells = list(dict.fromkeys((r["task"], r["length"]) for r in rows))
    names = list(dict.fromkeys([r["condition"] for r in rows] + [r["condition"] for r in runs]))
    status = {r["condition"]: r for r in runs}
    width = max([len(n) for n in names] + [9])
    cell_names = [f"{t}@{n}" for t, n in cells]
    head = f"{'condition':<{width}} {'status':<8} {'s':>4} " + " ".join(cell_names)
    lines = [head + "   KL mean    KL max"]
    for name in names:
        mine = {(r["task"], r["length"]): r for r in rows if r["condition"] == name}
        run = status.get(name, {"status": "ok", "seconds": None})
        secs = f"{run['seconds']:4.0f}" if run.get("seconds") is not None else "   -"
        accs = " ".join(f"{mine[c]['accuracy']:>{len(head_cell)}.3f}" if c in mine else f"{'-':>{len(head_cell)}}"
                        for c, head_cell in zip(cells, cell_names))
        kl_mean = max((r["kl_mean"] for r in mine.values() if math.isfinite(r["kl_mean"])), default=float("nan"))
        kl_max = max((r["kl_max"] for r in mine.values() if math.isfinite(r["kl_max"])), default=float("nan"))
        lines.append(f"{name:<{width}} {run['status']:<8} {secs} {accs}  {kl_mean:9.2g} {kl_max:9.2g}")
    return lines


def write_outputs(rows: list[dict], out_dir: str, runs: list[dict] | None = None,
                  failures: list[str] | None = None) -> list[str]:
    runs = runs or []
    os.makedirs(out_dir, exist_ok=True)
    cols = ["condition", "backend", "ours", "kv_dtype", "mode", "spec", "task", "length", "hits", "n", "accuracy",
            "ci_low", "ci_high", "kl_mean", "kl_max", "kl_tokens"]
    paths = [os.path.join(out_dir, name) for name in ("results.csv", "results.md", "results.json")]
    with open(paths[0], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(paths[1], "w") as f:
        f.write("| condition | task | length | accuracy (95% CI) | KL mean | KL max |\n|---|---|---:|---|---:|---:|\n")
        seen = set()
        for r in rows:
            if (r["condition"], r["task"], r["length"]) in seen:  # the reference, once per KV dtype in the csv
                continue
            seen.add((r["condition"], r["task"], r["length"]))
            f.write(f"| {r['condition']} | {r['task']} | {r['length']} | {r['accuracy']:.3f} "
                    f"({r['ci_low']:.3f} .. {r['ci_high']:.3f}) | {r['kl_mean']:.3g} | {r['kl_max']:.3g} |\n")
        if runs:
            f.write("\n| condition | status | seconds | log | detail |\n|---|---|---:|---|---|\n")
            for r in runs:
                detail = r["detail"].replace("|", "/")
                f.write(f"| {r['condition']} | {r['status']} | {r['seconds']:.0f} | {r['log']} | {detail} |\n")
        if failures:
            f.write("\nFailures:\n\n" + "".join(f"- {line}\n" for line in failures))
    with open(paths[2], "w") as f:
        json.dump({"rows": rows, "runs": runs, "failures": failures or []}, f, indent=1)
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


# ---------------------------------------------------------------------------------------------------------
# the eval
# ---------------------------------------------------------------------------------------------------------

def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _split(text: str | None, kind=str):
    return None if text is None else [kind(x) for x in text.split(",")]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return _worker_main(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_DIR, help="model directory (default: the shipped model)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full",
                        help="full: every condition; device: the reduced set for one GPU call (see device_plan)")
    parser.add_argument("--lengths", help="context lengths (default: the plan's, 1024,4096,8192)")
    parser.add_argument("--problems", type=int, help="problems per task and length (default: the plan's, 100)")
    parser.add_argument("--backends", help="only these (CUTE_MLA, TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA, torch)")
    parser.add_argument("--kernels", help=f"only these of our kernels under CUTE_MLA ({','.join(OUR_KERNELS)})")
    parser.add_argument("--kv-dtypes", help="only these KV dtypes (auto, fp8)")
    parser.add_argument("--modes", help="only these modes (eager, graphs)")
    parser.add_argument("--spec", help=f"only these n-gram draft token counts (0, {NGRAM_TOKENS})")
    parser.add_argument("--jobs", type=int, default=1, help="conditions run at once on the GPU")
    parser.add_argument("--timeout", type=float, help="seconds per condition (default: the plan's)")
    parser.add_argument("--budget-s", type=float, help="seconds for the whole run (default: the plan's)")
    parser.add_argument("--out", default="eval_results")
    parser.add_argument("--dry-run", action="store_true")
    real = parser.add_argument_group("a real checkpoint through lm-eval (lm_eval_route.py)")
    real.add_argument("--lm-eval-task", help="an lm-eval task (e.g. gsm8k): run --model (an HF directory with its "
                                             "tokenizer) through lm-eval once per backend instead of the "
                                             "synthetic tasks")
    real.add_argument("--limit", type=int, help="lm-eval: at most this many examples of the task")
    real.add_argument("--lm-eval-model-args", default="",
                      help="lm-eval: more vLLM arguments, comma-separated (e.g. tensor_parallel_size=8)")
    args = parser.parse_args(argv)
    if args.lm_eval_task:
        from mla_backend_plugin.evals import lm_eval_route

        if args.model == MODEL_DIR:
            parser.error("--lm-eval-task needs --model: a real checkpoint with its tokenizer")
        kv = _split(args.kv_dtypes) or ["auto"]
        if len(kv) != 1:
            parser.error(f"--lm-eval-task runs one KV dtype per call, got {args.kv_dtypes}")
        return lm_eval_route.run(args.model, args.lm_eval_task, _split(args.backends) or list(BACKENDS), args.out,
                                 kv_cache_dtype=kv[0], limit=args.limit, model_args=args.lm_eval_model_args,
                                 timeout_s=args.timeout)

    plan = PLANS[args.plan]()
    lengths = _split(args.lengths, int) or list(plan.lengths)
    count = args.problems or plan.problems
    timeout_s = args.timeout or plan.timeout_s
    budget_s = args.budget_s if args.budget_s is not None else plan.budget_s
    conds = select(plan.conditions, _split(args.backends), _split(args.kernels), _split(args.kv_dtypes),
                   _split(args.modes), _split(args.spec, int))
    sets = problem_sets(lengths, count)
    flat = [p for probs in sets.values() for p in probs]
    print(f"plan {args.plan}: {len(conds)} conditions x {len(sets)} (task, length) sets of {count} problems, "
          f"{args.jobs} at once, {timeout_s:.0f} s each" + (f", {budget_s:.0f} s in all" if budget_s else "")
          + f"; model {args.model}", flush=True)
    if args.dry_run:
        for c in conds:
            print(f"  {c.label}")
        return 0
    if not os.path.exists(os.path.join(args.model, "model.safetensors")):
        print(f"{args.model} holds no model.safetensors (train one: python -m mla_backend_plugin.evals.train)",
              file=sys.stderr)
        return 2
    deadline = time.monotonic() + budget_s if budget_s else None
    # an outer `timeout` sends SIGTERM: end as after Ctrl-C, killing the workers' process groups on the way out
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with tempfile.TemporaryDirectory() as tmp:
        problems_path = os.path.join(tmp, "problems.json")
        with open(problems_path, "w") as f:
            json.dump([dataclasses.asdict(p) for p in flat], f)
        runs, result_paths = [], []
        for i, c in enumerate(conds):
            spec_path, out_path = os.path.join(tmp, f"{i:02d}.json"), os.path.join(tmp, f"{i:02d}.pt")
            with open(spec_path, "w") as f:
                json.dump({"condition": dataclasses.asdict(c), "model_dir": os.path.abspath(args.model),
                           "problems": problems_path, "out": out_path, "runner_pid": os.getpid()}, f)
            runs.append(Run(c.label, [sys.executable, "-m", "mla_backend_plugin.evals", "--worker", spec_path],
                            worker_env(c, args.jobs, os.path.join(tmp, f"vllm-cache-{i:02d}")),
                            os.path.join(args.out, "logs", f"{i:02d}_{_slug(c.label)}.log")))
            result_paths.append(out_path)
        runner = Runner(runs, args.jobs, timeout_s, deadline)
        try:
            runner.poll()  # the first engines start while the reference runs
            rows = evaluate(args.model, conds, sets, flat, runner, result_paths)
        finally:
            runner.kill_all()
            signal.signal(signal.SIGTERM, previous_handler)
    run_records = [{"condition": r.label, "status": r.status, "seconds": round(r.seconds, 1),
                    "log": os.path.relpath(r.log_path, args.out), "detail": r.detail} for r in runs]
    failures = verdicts(rows) + [f"{r.label}: {r.status} ({r.detail})" for c, r in zip(conds, runs)
                                 if c.ours and r.status != "ok"]
    for path in write_outputs(rows, args.out, run_records, failures):
        print(path)
    for line in failures:
        print("FAIL:", line)
    print("\nSUMMARY")
    print("\n".join(summary_lines(rows, run_records)), flush=True)
    return 1 if failures else 0


def reference_rows(model_dir: str, conds: list[Condition], sets, flat) -> tuple[TorchReference, list[dict]]:
    """The float32 reference (its greedy answers, KL 0 by definition) and its rows: one copy per KV dtype of the
    vLLM conditions, since the verdicts compare within a KV dtype."""
    import torch

    from mla_backend_plugin.evals.model import EvalModel

    device = torch_device()
    t0 = time.monotonic()
    ref = TorchReference(EvalModel.load_hf(model_dir, device=device, dtype=torch.float32), flat, device)
    paths = ref.greedy()
    lps = ref.logprobs(paths)
    results = [{"tokens": p, "logprobs": lp} for p, lp in zip(paths, lps)]
    rows = []
    for kv in dict.fromkeys(c.kv_dtype for c in conds if c.backend != TORCH) or ("-",):
        rows += condition_rows({"condition": REFERENCE, "backend": REFERENCE, "ours": False, "kv_dtype": kv,
                                "mode": "-", "spec": 0}, sets, results, lps)
    print(f"reference (float32 torch, {device}): {time.monotonic() - t0:.0f} s", flush=True)
    return ref, rows


def evaluate(model_dir: str, conds: list[Condition], sets, flat, runner: Runner, result_paths) -> list[dict]:
    """The reference's rows, then each condition's as its process ends, in the plan's order. The reference runs
    in a thread (its GPU kernels release the GIL) so that the runner keeps starting, timing and killing
    processes meanwhile."""
    import concurrent.futures

    import torch

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending_reference = pool.submit(reference_rows, model_dir, conds, sets, flat)
        while not pending_reference.done():
            runner.poll()
            time.sleep(0.5)
        ref, rows = pending_reference.result()
    reported = 0
    while reported < len(conds):
        runner.poll()
        while reported < len(conds) and runner.runs[reported].ended:
            c, run = conds[reported], runner.runs[reported]
            reported += 1
            print(f"{c.label}: {run.status} after {run.seconds:.0f} s {run.detail}".rstrip(), flush=True)
            if run.status != "ok":
                continue
            results = torch.load(result_paths[reported - 1], weights_only=True)
            fields = {"condition": c.label, "backend": c.backend, "ours": c.ours, "kv_dtype": c.kv_dtype,
                      "mode": c.mode, "spec": c.spec}
            new = condition_rows(fields, sets, results, ref.logprobs([r["tokens"] for r in results]))
            for s in new:
                print(f"  {s['task']}@{s['length']}: {s['accuracy']:.3f} ({s['ci_low']:.3f} .. {s['ci_high']:.3f}), "
                      f"KL mean {s['kl_mean']:.3g} max {s['kl_max']:.3g}", flush=True)
            rows += new
        if reported < len(conds):
            time.sleep(0.5)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
