"""The eval's statistics and scoring: Wilson intervals, the two-proportion test, KL of next-token distributions,
a condition's rows per (task, length), and the verdicts on our kernels."""

from __future__ import annotations

import math

from mla_backend_plugin.evals.plan import PEER_BACKENDS, REFERENCE

# our mean KL above KL_FACTOR x vLLM's backends' fails the eval, unless it stays below NEGLIGIBLE_KL (nats)
KL_FACTOR = 10.0
NEGLIGIBLE_KL = 1e-3
# under decode context parallelism our mean KL above DCP_KL_FACTOR x the same condition's without DCP fails the
# eval (unless below NEGLIGIBLE_KL): the same kernels on a split cache merged by the LSE, only rounding may move
DCP_KL_FACTOR = 2.0


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


def _layout(row: dict) -> tuple[int, int, int]:
    return row.get("tp", 1), row.get("dcp", 1), row.get("interleave", 1)


def dcp_twin(row: dict, group: list[dict]) -> dict | None:
    """The row of the same condition without decode context parallelism: at the same TP size, else on one GPU."""
    same = [g for g in group if all(g.get(k) == row.get(k) for k in ("backend", "kernel", "mode", "spec"))]
    for layout in ((_layout(row)[0], 1, 1), (1, 1, 1)):
        twin = next((g for g in same if _layout(g) == layout), None)
        if twin is not None:
            return twin
    return None


def verdicts(rows: list[dict], alpha: float = 0.01, kl_factor: float = KL_FACTOR) -> list[str]:
    """Why our kernels fail the eval (empty: they pass): significantly less accurate than the reference or
    than the best of vLLM's backends under the same KV dtype, task and length; or a mean KL more than
    ``kl_factor`` x the largest of vLLM's backends there (and above NEGLIGIBLE_KL). Under decode context
    parallelism also: significantly less accurate than the same condition without DCP (``dcp_twin``), or a mean
    KL above DCP_KL_FACTOR x its (and above NEGLIGIBLE_KL)."""
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
            twin = dcp_twin(g, group) if _layout(g)[1] > 1 else None
            if twin is None:
                continue
            p = worse_p_value(g["hits"], g["n"], twin["hits"], twin["n"])
            if p < alpha:
                problems.append(f"{g['condition']} {key}: accuracy {g['accuracy']:.3f} below {twin['condition']} "
                                f"{twin['accuracy']:.3f} without DCP (p = {p:.2g})")
            if (math.isfinite(g["kl_mean"]) and math.isfinite(twin["kl_mean"])
                    and g["kl_mean"] > max(NEGLIGIBLE_KL, DCP_KL_FACTOR * twin["kl_mean"])):
                problems.append(f"{g['condition']} {key}: mean KL {g['kl_mean']:.3g} > {DCP_KL_FACTOR} x "
                                f"{twin['condition']}'s {twin['kl_mean']:.3g} without DCP")
    return problems

