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

Parallel layouts (``--tensor-parallel-size``, ``--decode-context-parallel-size``, ``--cp-kv-cache-interleave-size``,
each a comma-separated list): every vLLM condition runs under each combination where the DCP size divides the TP
size (an interleave above 1 is also the engine's block size), labelled ``tp2``, ``tp2 dcp2 i64``. A condition under
DCP also fails the eval when it is significantly less accurate than, or has a mean KL more than DCP_KL_FACTOR x,
the same condition without DCP (at its TP size, else on one GPU). CUTE_MLA takes 16, 32, 64 or 128 query heads
per decode call: heads / TP x DCP. The shipped model has 16 heads: one GPU and TP 2 x DCP 2 run it, TP 2 alone
does not (8 heads per rank); ``--widen-heads 2`` runs every condition on the same model with each head repeated
(32 heads, the same function: ``model.widen_heads``), which TP 2 runs at 16 heads per rank.

The model: ``--model DIR``, else ``CUTE_MLA_EVAL_MODEL_DIR``, else the package's ``model/`` (a source or editable
install; the serving wheel ships no eval weights).

Real checkpoints: ``--model DIR`` takes any model directory in this package's format (config.json +
model.safetensors of a DeepseekV3ForCausalLM with the eval vocabulary). A real DeepSeek checkpoint (e.g.
DeepSeek-V2-Lite, with its tokenizer) takes an lm-eval task instead: ``--model DIR --lm-eval-task gsm8k`` runs
lm-eval through vLLM once per backend and compares the scores (``lm_eval_route.py``); that path was not run here
(no checkpoint can be downloaded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time

from mla_backend_plugin.evals import missing_model, model_dir
from mla_backend_plugin.evals.plan import (
    BACKENDS,
    NGRAM_TOKENS,
    OUR_KERNELS,
    PLANS,
    SINGLE_GPU,
    check_layouts,
    parallel_layouts,
    problem_sets,
    select,
    with_layouts,
)
from mla_backend_plugin.evals.report import summary_lines, write_outputs
from mla_backend_plugin.evals.runner import Run, Runner, evaluate, slug
from mla_backend_plugin.evals.stats import verdicts
from mla_backend_plugin.evals.worker import worker_env, worker_main


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _split(text: str | None, kind=str):
    return None if text is None else [kind(x) for x in text.split(",")]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: CUTE_MLA_EVAL_MODEL_DIR, else the package's "
                                         "model/ of a source install)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="full",
                        help="full: every condition; device: the reduced set for one GPU call (see device_plan)")
    parser.add_argument("--lengths", help="context lengths (default: the plan's, 1024,4096,8192)")
    parser.add_argument("--problems", type=int, help="problems per task and length (default: the plan's, 100)")
    parser.add_argument("--backends", help="only these (CUTE_MLA, TRITON_MLA, FLASHMLA, FLASH_ATTN_MLA, torch)")
    parser.add_argument("--kernels", help=f"only these of our kernels under CUTE_MLA ({','.join(OUR_KERNELS)})")
    parser.add_argument("--kv-dtypes", help="only these KV dtypes (auto, fp8)")
    parser.add_argument("--modes", help="only these modes (eager, graphs)")
    parser.add_argument("--spec", help=f"only these n-gram draft token counts (0, {NGRAM_TOKENS})")
    parser.add_argument("--jobs", type=int, default=1, help="conditions run at once on the GPU(s)")
    par = parser.add_argument_group("parallel layouts (each a comma-separated list; every vLLM condition under each)")
    par.add_argument("--tensor-parallel-size", default="1", help="vLLM tensor_parallel_size (GPUs per engine)")
    par.add_argument("--decode-context-parallel-size", default="1",
                     help="vLLM decode_context_parallel_size (divides the TP size)")
    par.add_argument("--cp-kv-cache-interleave-size", default="1",
                     help="vLLM cp_kv_cache_interleave_size under DCP: 1 (token-level) or a block size (16, 32, 64, "
                          "128: block-level; the engine then runs with that block size)")
    par.add_argument("--widen-heads", type=int, default=1,
                     help="run the model with each attention head repeated this many times (the same function, more "
                          "heads: e.g. 2 makes the 16-head eval model run TP 2 with 16 heads per rank)")
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

        if args.model is None:
            parser.error("--lm-eval-task needs --model: a real checkpoint with its tokenizer")
        kv = _split(args.kv_dtypes) or ["auto"]
        if len(kv) != 1:
            parser.error(f"--lm-eval-task runs one KV dtype per call, got {args.kv_dtypes}")
        return lm_eval_route.run(args.model, args.lm_eval_task, _split(args.backends) or list(BACKENDS), args.out,
                                 kv_cache_dtype=kv[0], limit=args.limit, model_args=args.lm_eval_model_args,
                                 timeout_s=args.timeout)

    source_model = args.model or model_dir()
    if args.widen_heads < 1:
        parser.error(f"--widen-heads {args.widen_heads}: allowed values are integers >= 1")
    plan = PLANS[args.plan]()
    lengths = _split(args.lengths, int) or list(plan.lengths)
    count = args.problems or plan.problems
    timeout_s = args.timeout or plan.timeout_s
    budget_s = args.budget_s if args.budget_s is not None else plan.budget_s
    conds = select(plan.conditions, _split(args.backends), _split(args.kernels), _split(args.kv_dtypes),
                   _split(args.modes), _split(args.spec, int))
    try:
        layouts = parallel_layouts(_split(args.tensor_parallel_size, int), _split(args.decode_context_parallel_size,
                                   int), _split(args.cp_kv_cache_interleave_size, int))
        if layouts != SINGLE_GPU:
            conds = with_layouts(conds, layouts)
            if not os.path.isfile(os.path.join(source_model, "config.json")):
                parser.error(missing_model(source_model))
            with open(os.path.join(source_model, "config.json")) as f:
                heads = json.load(f)["num_attention_heads"] * args.widen_heads
            check_layouts(conds, heads)
    except ValueError as e:
        parser.error(str(e))
    sets = problem_sets(lengths, count)
    flat = [p for probs in sets.values() for p in probs]
    print(f"plan {args.plan}: {len(conds)} conditions x {len(sets)} (task, length) sets of {count} problems, "
          f"{args.jobs} at once, {timeout_s:.0f} s each" + (f", {budget_s:.0f} s in all" if budget_s else "")
          + f"; model {source_model}" + (f" with each head x{args.widen_heads}" if args.widen_heads > 1 else ""),
          flush=True)
    if args.dry_run:
        for c in conds:
            print(f"  {c.label}")
        return 0
    why = missing_model(source_model)
    if why:
        print(why, file=sys.stderr)
        return 2
    deadline = time.monotonic() + budget_s if budget_s else None
    # an outer `timeout` sends SIGTERM: end as after Ctrl-C, killing the workers' process groups on the way out
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with tempfile.TemporaryDirectory() as tmp:
        model = source_model
        if args.widen_heads > 1:
            from mla_backend_plugin.evals.model import widen_heads

            model = widen_heads(source_model, os.path.join(tmp, "model"), args.widen_heads)
        problems_path = os.path.join(tmp, "problems.json")
        with open(problems_path, "w") as f:
            json.dump([dataclasses.asdict(p) for p in flat], f)
        runs, result_paths = [], []
        for i, c in enumerate(conds):
            spec_path, out_path = os.path.join(tmp, f"{i:02d}.json"), os.path.join(tmp, f"{i:02d}.pt")
            with open(spec_path, "w") as f:
                json.dump({"condition": dataclasses.asdict(c), "model_dir": os.path.abspath(model),
                           "problems": problems_path, "out": out_path, "runner_pid": os.getpid()}, f)
            runs.append(Run(c.label, [sys.executable, "-m", "mla_backend_plugin.evals", "--worker", spec_path],
                            worker_env(c, args.jobs, os.path.join(tmp, f"vllm-cache-{i:02d}")),
                            os.path.join(args.out, "logs", f"{i:02d}_{slug(c.label)}.log")))
            result_paths.append(out_path)
        runner = Runner(runs, args.jobs, timeout_s, deadline)
        try:
            runner.poll()  # the first engines start while the reference runs
            rows = evaluate(model, conds, sets, flat, runner, result_paths)
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


if __name__ == "__main__":
    raise SystemExit(main())

