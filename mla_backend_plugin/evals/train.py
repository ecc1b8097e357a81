"""Train the eval model on the retrieval tasks (``tasks.py``); writes ``config.json``, ``model.safetensors`` and
``train_log.json`` into ``--out`` (also after every eval, so a run cut short still leaves its last weights).

    python -m mla_backend_plugin.evals.train --out DIR --steps auto --minutes 9     # the steps that fit, one H100
    python -m mla_backend_plugin.evals.train --out DIR --steps 8043 --stop-after 6827  # the shipped model's run

Deterministic from ``--seed`` for a given ``--steps``: what a step trains on (its length, its sequences) is a
function of the step index alone, the initialisation of the seed; GPU kernels may still differ in the last bits
between runs. ``--steps auto`` times forward/backward passes at a few lengths first and picks the step count
that fits ``--minutes``; the log records it, so the run can be repeated with that number. Training sequences
hold many queries each (``tasks.training_sequence``); the loss is on their answer tokens only. Context lengths
follow a curriculum over the step index: 256 tokens for the first ``--short-share`` of the steps, then the
longest length drawn grows geometrically to ``--max-len`` until ``--grow-until``; lengths are drawn
log-uniformly from 128 up to it, one length per step, ``--tokens-per-step`` tokens. Worker processes build the
sequences ahead of the GPU (pure Python: one core does not keep up with an H100).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing as mp
import os
import random
import time

import torch
import torch.nn.functional as F

from mla_backend_plugin.evals import tasks
from mla_backend_plugin.evals.model import EvalModel, EvalModelConfig, hf_config, num_parameters

SHORT_LEN, MIN_LEN = 256, 128


def top_length(frac: float, max_len: int, short_share: float, grow_until: float) -> int:
    """The longest length drawn at this fraction of the steps."""
    if max_len <= SHORT_LEN or frac < short_share:
        return min(SHORT_LEN, max_len)
    grow = min(1.0, (frac - short_share) / max(grow_until - short_share, 1e-9))
    return min(max_len, int(SHORT_LEN * (max_len / SHORT_LEN) ** grow))


def step_plan(step: int, steps: int, args) -> tuple[int, int, int]:
    """(length, sequences, first sequence seed) of a step: a function of the step index and the seed alone."""
    top = top_length(step / steps, args.max_len, args.short_share, args.grow_until)
    rng = random.Random(f"{args.seed}:step:{step}")
    length = int(round(math.exp(rng.uniform(math.log(MIN_LEN), math.log(max(top, MIN_LEN + 1)))) / 64)) * 64
    length = max(MIN_LEN, min(length, top))
    count = max(1, args.tokens_per_step // length)
    return length, count, step * 1_000_003 + args.seed  # disjoint seed ranges; never EVAL_SEED_BASE's


def batch_of(plan: tuple[int, int, int]):
    """Inputs [count, length - 1], targets (shifted by one) and the loss mask over answer tokens."""
    length, count, seed0 = plan
    seqs, masks = zip(*(tasks.training_sequence(length, seed0 + i) for i in range(count)))
    seq = torch.tensor(seqs)
    mask = torch.tensor(masks)
    return seq[:, :-1], seq[:, 1:], mask[:, 1:]


@torch.no_grad()
def exact_match(model: EvalModel, length: int, count: int, device, task: str | None = None) -> float:
    """Greedy exact match on held-out problems, by teacher forcing (argmax of every answer position given the
    right prefix equals greedy decoding's answer when all of them are right)."""
    model.eval()
    hits = 0
    for task_name in (task,) if task else tasks.TASKS:
        probs = tasks.eval_problems(task_name, length, count)
        for start in range(0, count, 8):
            chunk = probs[start:start + 8]
            seq = torch.tensor([p.prompt + p.answer for p in chunk], device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=seq.is_cuda):
                logits = model(seq[:, :-1])
            n = len(chunk[0].answer)
            pred = logits[:, -n:].argmax(-1)
            hits += int((pred == seq[:, -n:]).all(-1).sum())
    model.train()
    return hits / (count * (1 if task else len(tasks.TASKS)))


def loss_of(model: EvalModel, inputs, targets, mask, device) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(inputs)
    return F.cross_entropy(logits.float()[mask], targets[mask])


def seconds_per_step(model: EvalModel, args, device) -> dict[int, float]:
    """Forward + backward time per length at ``--tokens-per-step`` (no optimizer step: the model is unchanged)."""
    times = {}
    lengths = sorted({min(n, args.max_len) for n in (SHORT_LEN, 1024, 4096, args.max_len)})
    for length in lengths:
        batch = [t.to(device) for t in batch_of((length, max(1, args.tokens_per_step // length), 0))]
        for i in range(4):
            if i == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            loss_of(model, *batch, device).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[length] = (time.perf_counter() - t0) / 3
        model.zero_grad(set_to_none=True)
    return times


def steps_for_budget(times: dict[int, float], minutes: float, args) -> int:
    """The step count whose expected time (the curriculum's lengths, interpolated in log length) fills 90% of
    the budget: the evals and the data workers' start take the rest."""
    known = sorted(times)

    def t(length):
        for lo, hi in zip(known, known[1:]):
            if length <= hi:
                w = (math.log(length) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return times[lo] + w * (times[hi] - times[lo])
        return times[known[-1]] if length >= known[-1] else times[known[0]]

    probe = 1000
    mean = sum(t(step_plan(s, probe, args)[0]) for s in range(probe)) / probe
    return max(100, int(0.9 * minutes * 60 / mean))


def prefetched(pool, plans, ahead: int):
    """The batches of ``plans`` in order, built by ``pool`` at most ``ahead`` batches ahead (a bound: workers
    outrunning the GPU would otherwise pile up batches in memory)."""
    if pool is None:
        yield from map(batch_of, plans)
        return
    pending = collections.deque()
    for plan in plans:
        pending.append(pool.apply_async(batch_of, (plan,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", default="auto", help="optimizer steps, or 'auto': what fits --minutes")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="budget for --steps auto; with a step count, a cap (the run stops and saves)")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--short-share", type=float, default=0.2, help="share of the steps at 256 tokens")
    parser.add_argument("--grow-until", type=float, default=0.7, help="the full length range from here on")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this many steps of the --steps plan (repeats a run its time cap cut short)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-problems", type=int, default=64, help="held-out problems per task and length")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes building sequences (0: in this process)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a 2-layer, 128-wide model (CPU smoke runs)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2) if args.small else {}
    hf = hf_config(tasks.VOCAB_SIZE, **size)  # DeepSeek-V3's YaRN and max_position_embeddings
    model = EvalModel(EvalModelConfig.from_hf(hf)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    os.makedirs(args.out, exist_ok=True)
    log = {"args": vars(args), "parameters": num_parameters(model), "steps": [], "evals": []}
    print(f"{num_parameters(model) / 1e6:.2f} M parameters on {device}", flush=True)
    if args.steps == "auto":
        times = seconds_per_step(model, args, device)
        steps = steps_for_budget(times, args.minutes, args)
        log["seconds_per_step"] = {str(k): round(v, 4) for k, v in times.items()}
        print(f"seconds per step by length {log['seconds_per_step']}: {steps} steps fit {args.minutes} min",
              flush=True)
    else:
        steps = int(args.steps)
    log["steps_total"] = steps

    def save():
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        model.save_hf(args.out)
        with open(os.path.join(args.out, "train_log.json"), "w") as f:
            json.dump(log, f, indent=1)

    pool = mp.get_context("spawn").Pool(args.workers) if args.workers > 0 else None
    # a step count chosen from timings may run a little long: the cap then sits 20% above the budget
    cap_s = args.minutes * 60 * (1.2 if args.steps == "auto" else 1.0)
    t0 = time.time()
    step = 0
    try:
        for step, (inputs, targets, mask) in enumerate(prefetched(pool, (step_plan(s, steps, args)
                                                                         for s in range(steps)), 2 * args.workers), 1):
            if args.stop_after is not None and step > args.stop_after:
                step -= 1
                break
            if time.time() - t0 >= cap_s:
                print(f"time cap {cap_s / 60:.1f} min reached after {step - 1} of {steps} steps", flush=True)
                step -= 1
                break
            length = inputs.shape[1] + 1
            inputs, targets, mask = inputs.to(device), targets.to(device), mask.to(device)
            frac = (step - 1) / steps
            warm = min(1.0, step / 200)
            lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            loss = loss_of(model, inputs, targets, mask, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 20 == 0:
                log["steps"].append({"step": step, "s": round(time.time() - t0, 1), "len": length,
                                     "loss": round(loss.item(), 4), "lr": lr})
            if step % args.eval_every == 0:
                top = top_length(frac, args.max_len, args.short_share, args.grow_until)
                ev = {"step": step, "s": round(time.time() - t0, 1), "top": top}
                for n in sorted({min(SHORT_LEN, args.max_len), min(2048, args.max_len), args.max_len}):
                    ev[n] = exact_match(model, n, max(4, args.eval_problems // 4), device)
                log["evals"].append(ev)
                print(f"step {step}/{steps} {ev['s']:.0f}s len {length} loss {loss.item():.3f} em {ev}", flush=True)
                save()
    finally:
        if pool:
            pool.terminate()
    final = {"step": step, "s": round(time.time() - t0, 1)}
    for n in sorted({min(n, args.max_len) for n in (256, 1024, 4096, args.max_len)}):
        for task in tasks.TASKS:
            final[f"{task}@{n}"] = exact_match(model, n, args.eval_problems, device, task)
    log["final"] = final
    print(f"final {final}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
