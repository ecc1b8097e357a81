"""Debugging and end-to-end tests of an engine: every decode call it makes outside CUDA-graph capture,
recomputed with the float32 reference on the very inputs the engine passed, one JSON record per call appended to
``CUTE_MLA_CHECK_DIR/<pid>.jsonl`` (``engine_check``: the hook a serving backend hands its
``ops.serving.DecodeRunner``), and the records of a run summed (``read_check_records``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.ops.constants import KV_LORA_RANK


def engine_check(check_dir: str | None = None) -> Callable[..., None] | None:
    """``DecodeRunner``'s ``check`` for an engine: with ``check_dir`` (default ``CUTE_MLA_CHECK_DIR``, read now)
    set, a function that appends the ``reference_check`` record of each call it is given to
    ``check_dir/<pid>.jsonl``; None when it is unset."""
    check_dir = envs.CUTE_MLA_CHECK_DIR if check_dir is None else check_dir
    if not check_dir:
        return None

    def check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse, **kwargs) -> None:
        append_check_record(check_dir, reference_check(q, kv_cache, block_table, seq_lens, softmax_scale, out, lse,
                                                       **kwargs))

    return check


def reference_check(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, *, q_scale=None, kv_scale=None,
                    row_kv_lens: torch.Tensor | None = None, query_lens: list[int] | None = None) -> dict:
    """One decode call recomputed with the float32 reference on the very inputs the engine passed: the
    relative error of the output (Frobenius), the largest LSE error where the reference LSE is finite, and
    whether the infinite LSEs (rows with no key) agree. Plus what the call was (q_len, dtypes, heads, longest
    length), so a test can check which paths an engine exercised. Summed across calls by
    ``merge_check_records``. ``query_lens``: a step of mixed q_lens (request b's tokens follow request b - 1's;
    tokens past them are padding and not compared): each request's q block is recomputed on its own, so what is
    checked does not depend on how the step was launched (``TokenRequests``)."""
    q_nope, q_pe = q if isinstance(q, (tuple, list)) else (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])
    kwargs = dict(q_scale=q_scale, kv_scale=kv_scale)
    if query_lens is None:
        q_len = q_nope.shape[0] // block_table.shape[0]
        q_lens = {str(q_len): 1}
        ref_out, ref_lse = mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, q_len, softmax_scale,
                                                row_kv_lens=row_kv_lens, **kwargs)
    else:
        parts, start = [], 0
        for b, n in enumerate(query_lens):
            if n:
                parts.append(mla_decode_reference(q_nope[start:start + n], q_pe[start:start + n], kv_cache,
                                                  block_table[b:b + 1], seq_lens[b:b + 1], n, softmax_scale, **kwargs))
            start += n
        ref_out, ref_lse = (torch.cat([p[i] for p in parts]) for i in range(2))
        out, lse = out[:start], lse[:start]
        q_lens = {"mixed": 1}
    rel = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return {"calls": 1, "q_lens": q_lens, "max_rel_err": rel, "max_lse_err": lse_err,
            "lse_inf_mismatch": int(not torch.equal(torch.isinf(lse), ~finite)),
            "q_dtypes": {str(q_nope.dtype): 1}, "kv_dtypes": {str(kv_cache.dtype): 1},
            "block_sizes": {str(kv_cache.shape[1]): 1}, "max_seq_len": int(seq_lens.max().item()),
            "heads": {str(q_nope.shape[1]): 1}, "row_kv_lens_calls": int(row_kv_lens is not None),
            "token_request_calls": int(query_lens is not None)}


def append_check_record(check_dir: str, record: dict) -> None:
    os.makedirs(check_dir, exist_ok=True)
    with open(os.path.join(check_dir, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def merge_check_records(total: dict, record: dict) -> dict:
    """Sum ``reference_check`` records: counts add, per-value tallies add, ``max_*`` take the maximum."""
    for key, value in record.items():
        if isinstance(value, dict):
            tally = total.setdefault(key, {})
            for k, n in value.items():
                tally[k] = tally.get(k, 0) + n
        elif key.startswith("max_"):
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def read_check_records(check_dir: str) -> dict:
    """Every record the processes of a run appended under ``check_dir``, summed (plus ``processes``)."""
    total: dict = {"calls": 0, "processes": 0}
    for name in sorted(os.listdir(check_dir)) if os.path.isdir(check_dir) else ():
        with open(os.path.join(check_dir, name)) as f:
            for line in f:
                merge_check_records(total, json.loads(line))
        total["processes"] += 1
    return total
