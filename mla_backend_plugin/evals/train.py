"""Train the eval model on the retrieval tasks (``tasks.py``); writes ``config.json``, ``model.safetensors`` and
``train_log.json`` into ``--out``.

    python -m mla_backend_plugin.evals.train --out mla_backend_plugin/evals/model --minutes 7   # one H100

Deterministic from ``--seed`` in what it draws (initialisation, the problems, their order); GPU kernels may
still differ in the last bits between runs. Training sequences hold many queries each (``tasks.training_sequence``),
the loss is on their answer tokens only. Context lengths follow a curriculum: the longest length drawn grows
from 256 to ``--max-len`` between 10% and 60% of the time budget; lengths are drawn log-uniformly from 128 up
to it, one length per step, ``--tokens-per-step`` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F

from mla_backend_plugin.evals import tasks
from mla_backend_plugin.evals.model import EvalModel, EvalModelConfig, hf_config, num_parameters


def batch_of(length: int, count: int, seed0: int):
    """Inputs [count, length - 1], targets (shifted by one) and the loss mask over answer tokens."""
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=7.0, help="wall-clock training budget")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-problems", type=int, default=64, help="held-out problems per task and length")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a 2-layer, 128-wide model (CPU smoke runs)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = torch.device(args.device)
    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2) if args.small else {}
    hf = hf_config(tasks.VOCAB_SIZE, **size)  # DeepSeek-V3's YaRN and max_position_embeddings
    model = EvalModel(EvalModelConfig.from_hf(hf)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    os.makedirs(args.out, exist_ok=True)
    log = {"args": vars(args), "parameters": num_parameters(model), "steps": [], "evals": []}
    print(f"{num_parameters(model) / 1e6:.2f} M parameters on {device}", flush=True)
    budget = args.minutes * 60
    t0 = time.time()
    step = 0
    seed = 0
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0:
            break
        grow = min(1.0, max(0.0, (frac - 0.1) / 0.5))
        top = min(args.max_len, int(256 * (args.max_len / 256) ** grow))
        length = int(round(math.exp(rng.uniform(math.log(128), math.log(max(top, 129)))) / 64)) * 64
        length = max(128, min(length, args.max_len))
        count = max(1, args.tokens_per_step // length)
        inputs, targets, mask = batch_of(length, count, seed)
        seed += count
        inputs, targets, mask = inputs.to(device), targets.to(device), mask.to(device)
        warm = min(1.0, (step + 1) / 200)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float()[mask], targets[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            log["steps"].append({"step": step, "s": round(time.time() - t0, 1), "len": length,
                                 "loss": round(loss.item(), 4), "lr": lr})
        if step % args.eval_every == 0:
            ev = {"step": step, "s": round(time.time() - t0, 1)}
            for n in sorted({min(512, args.max_len), min(2048, args.max_len), args.max_len}):
                ev[n] = exact_match(model, n, max(4, args.eval_problems // 4), device)
            log["evals"].append(ev)
            print(f"step {step} {ev['s']:.0f}s len {length} loss {loss.item():.3f} em {ev}", flush=True)
    final = {"step": step, "s": round(time.time() - t0, 1)}
    for n in sorted({min(n, args.max_len) for n in (256, 1024, 4096, args.max_len)}):
        for task in tasks.TASKS:
            final[f"{task}@{n}"] = exact_match(model, n, args.eval_problems, device, task)
    log["final"] = final
    print(f"final {final}", flush=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    model.save_hf(args.out)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
