"""The float32 torch reference of the eval model (and the torch bf16 condition): greedy answers and next-token
log-probabilities along any answer, each answer prefix computed once."""

from __future__ import annotations

import time

from mla_backend_plugin.evals import tasks
from mla_backend_plugin.evals.plan import REFERENCE, TORCH, Condition
from mla_backend_plugin.evals.stats import condition_rows

# tokens per forward pass of the torch model on a GPU (a few GB of activations); on the CPU one sequence per pass:
# its attention materialises the [heads, T, T] scores
REFERENCE_BATCH_TOKENS = 1 << 16


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

