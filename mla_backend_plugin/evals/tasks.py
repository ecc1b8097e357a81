"""The synthetic long-context tasks the eval model is trained and evaluated on.

A context is BOS, then ``pairs`` key -> value facts (``PAIR k v``, keys unique, values random symbols) spread
among filler tokens, then one query; the answer is a few symbols that only attention to the right earlier
positions can produce:

* ``retrieve``: ``QUERY k1 k2 k3 ANSWER`` -> ``v1 v2 v3`` (three lookups, anywhere in the context);
* ``hop2``: ``HOP k ANSWER`` -> ``v1 v2`` with v1 = value(k) and v2 = value(v1) (a lookup that depends on the
  result of another: the facts form a chain).

Everything is a deterministic function of the seed (``random.Random``), so eval problems are reproducible and
disjoint from training seeds (``EVAL_SEED_BASE``). No tokenizer: token ids are the interface.
"""

from __future__ import annotations

import dataclasses
import random

BOS, EOS, PAD, PAIR, QUERY, HOP, ANSWER = 0, 1, 2, 3, 4, 5, 6
SYMBOL_BASE, NUM_SYMBOLS = 16, 512  # keys and values
FILLER_BASE, NUM_FILLER = SYMBOL_BASE + NUM_SYMBOLS, 64
VOCAB_SIZE = 640  # >= FILLER_BASE + NUM_FILLER, a multiple of 64
TASKS = ("retrieve", "hop2")
RETRIEVE_KEYS = 3
EVAL_SEED_BASE = 1_000_000_007  # eval problems use seeds from here on; training never does


@dataclasses.dataclass(frozen=True)
class Problem:
    task: str
    prompt: list[int]
    answer: list[int]
    seed: int

    @property
    def context_len(self) -> int:
        return len(self.prompt)


def pairs_for(length: int) -> int:
    """Facts in a context of ``length`` tokens: about one per 32 tokens, at least 8, at most half the symbols."""
    return max(8, min(NUM_SYMBOLS // 2, length // 32))


def make_problem(task: str, length: int, seed: int) -> Problem:
    """A problem whose prompt has exactly ``length`` tokens (length >= 64)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}; allowed: {', '.join(TASKS)}")
    if length < 64:
        raise ValueError(f"length {length} is too short; at least 64 tokens")
    rng = random.Random(f"{task}:{length}:{seed}")
    n = pairs_for(length)
    symbols = rng.sample(range(SYMBOL_BASE, SYMBOL_BASE + NUM_SYMBOLS), n + 1)
    keys = symbols[:n]
    if task == "hop2":
        # a chain k0 -> k1 -> ... -> kn: every value is a key except the last, so value(value(k)) is defined
        # for k = k0 .. k_{n-2}; facts are written in random order
        values = symbols[1:n + 1]
        query_pos = rng.randrange(n - 1)
        suffix = [HOP, keys[query_pos], ANSWER]
        answer = [values[query_pos], values[query_pos + 1]]
    else:
        values = [rng.randrange(SYMBOL_BASE, SYMBOL_BASE + NUM_SYMBOLS) for _ in range(n)]
        picks = rng.sample(range(n), RETRIEVE_KEYS)
        suffix = [QUERY] + [keys[i] for i in picks] + [ANSWER]
        answer = [values[i] for i in picks]
    facts = list(range(n))
    rng.shuffle(facts)
    filler = length - 1 - 3 * n - len(suffix)
    # filler spread at random between facts: cut points in [0, filler]
    cuts = sorted(rng.randrange(filler + 1) for _ in range(n))
    prompt = [BOS]
    prev = 0
    for f, cut in zip(facts, cuts):
        prompt += [FILLER_BASE + rng.randrange(NUM_FILLER) for _ in range(cut - prev)]
        prompt += [PAIR, keys[f], values[f]]
        prev = cut
    prompt += [FILLER_BASE + rng.randrange(NUM_FILLER) for _ in range(filler - prev)]
    prompt += suffix
    assert len(prompt) == length, (len(prompt), length)
    return Problem(task, prompt, answer, seed)


def training_sequence(length: int, seed: int, query_share: float = 0.4) -> tuple[list[int], list[bool]]:
    """A training sequence of ``length`` tokens and its loss mask: facts among filler, then query blocks of both
    tasks back to back (``QUERY k1 k2 k3 ANSWER v1 v2 v3`` / ``HOP k ANSWER v1 v2``, and restated facts
    ``PAIR k v``, the plain induction case that helps the lookup circuit form first) filling ``query_share`` of
    the sequence, every answer token supervised. A single query per context gives a few supervised tokens per
    thousands and training never leaves the uniform plateau; many queries per context make the lookup the
    dominant signal. Eval problems (``make_problem``) have one query at the end, right after the facts."""
    rng = random.Random(f"train:{length}:{seed}")
    n = pairs_for(length)
    symbols = rng.sample(range(SYMBOL_BASE, SYMBOL_BASE + NUM_SYMBOLS), n + 1)
    keys = symbols[:n]
    chain = rng.random() < 0.5  # hop2 queries need a chain; retrieve queries work on either
    values = symbols[1:n + 1] if chain else [rng.randrange(SYMBOL_BASE, SYMBOL_BASE + NUM_SYMBOLS) for _ in range(n)]
    facts = list(range(n))
    rng.shuffle(facts)
    context_len = max(1 + 3 * n, int(length * (1 - query_share)))
    filler = context_len - 1 - 3 * n
    cuts = sorted(rng.randrange(filler + 1) for _ in range(n))
    seq, prev = [BOS], 0
    for f, cut in zip(facts, cuts):
        seq += [FILLER_BASE + rng.randrange(NUM_FILLER) for _ in range(cut - prev)]
        seq += [PAIR, keys[f], values[f]]
        prev = cut
    seq += [FILLER_BASE + rng.randrange(NUM_FILLER) for _ in range(filler - prev)]
    mask = [False] * len(seq)
    while True:
        if rng.random() < 0.25:  # a fact restated: plain induction (the token after this key's last occurrence)
            i = rng.randrange(n)
            seq += [PAIR, keys[i], values[i]]
            mask += [False, False, True]
            if len(seq) > length:
                seq, mask = seq[:-3], mask[:-3]
                break
            continue
        if chain and rng.random() < 0.5:
            i = rng.randrange(n - 1)
            block, answer = [HOP, keys[i], ANSWER], [values[i], values[i + 1]]
        else:
            picks = rng.sample(range(n), RETRIEVE_KEYS)
            block, answer = [QUERY] + [keys[i] for i in picks] + [ANSWER], [values[i] for i in picks]
        if len(seq) + len(block) + len(answer) > length:
            break
        seq += block + answer
        mask += [False] * len(block) + [True] * len(answer)
    pad = length - len(seq)
    return seq + [PAD] * pad, mask + [False] * pad


def eval_problems(task: str, length: int, count: int) -> list[Problem]:
    """Held-out problems (seeds training never uses)."""
    return [make_problem(task, length, EVAL_SEED_BASE + i) for i in range(count)]
