"""A float64 model of an fp8 split-KV decode's rounding, on the CPU: how the max error against the float32 reference
depends on the split size, P's scale in e4m3, the dtype of the split partials and whether the row sum adds P before
or after its rounding. It models the arithmetic a kernel chooses (P = exp2(s - split max) rounded to e4m3 after a
scale, P V over the rounded P, O / l per split stored in a dtype, splits merged by their LSEs, the output rounded to
bf16), not the tensor core's own accumulation, and P against each split's final max (a kernel's online max is the
same within a split of one tile). Inputs are the GPU tests' (``ops.inputs.make_decode_inputs``: an fp8
cache and vLLM's fp8 q, one request).

    python benchmarks/fp8_rounding_model.py --seq-lens 1024,4096 --seeds 1,2,3,17 --q-lens 1,2
    python benchmarks/fp8_rounding_model.py --schemes ours,rounded_sum,flashmla_like

Schemes (each a split size, P's scale, the partials' dtype, the row sum's P):
``ours`` cute_sm90 design B with 64-token splits (P x 256, bf16 partials, the sum before rounding);
``rounded_sum`` the same with the row sum of the rounded P; ``flashmla_like`` FlashMLA's SM90 fp8 decode as read
(P unscaled, fp32 partials, the sum before rounding); ``splits128`` ours with 128-token splits.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK
from mla_backend_plugin.ops.inputs import make_decode_inputs


@dataclasses.dataclass(frozen=True)
class Scheme:
    split: int  # keys per split
    p_scale: float  # P is rounded as e4m3(P * p_scale) / p_scale
    partial_dtype: torch.dtype  # each split's O / l is stored in this dtype before the merge
    sum_rounded: bool  # the row sum adds the rounded P (else the fp32 P before rounding)
    round_p: bool = True  # False: P unrounded (the model's own check: only the partials' and output's rounding)


SCHEMES = {
    "ours": Scheme(64, 256.0, torch.bfloat16, False),
    "rounded_sum": Scheme(64, 256.0, torch.bfloat16, True),
    "flashmla_like": Scheme(64, 1.0, torch.float32, False),
    "splits128": Scheme(128, 256.0, torch.bfloat16, False),
}


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(FP8_DTYPE).to(torch.float64)


def max_errors(seq_len: int, q_len: int, seed: int, schemes: dict[str, Scheme], heads: int = 128,
               block_size: int = 64, out_dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Max |out - reference| per scheme for one request of ``seq_len`` keys (``q_len`` query rows, causal), the
    output rounded to ``out_dtype``."""
    inp = make_decode_inputs(1, [seq_len], q_len, heads, block_size, FP8_DTYPE, "fp8", "cpu", seed)
    ref = inp.reference()[0].to(torch.float64)
    pages = inp.block_table[0, :(seq_len + block_size - 1) // block_size].tolist()
    kv = torch.cat([inp.kv_cache[p] for p in pages])[:seq_len].to(torch.float64)
    kv = kv * (1.0 if inp.kv_scale is None else float(inp.kv_scale))
    q = torch.cat([inp.q_nope, inp.q_pe], -1).to(torch.float64)
    q = q * (1.0 if inp.q_scale is None else float(inp.q_scale))
    s = torch.einsum("thd,kd->thk", q, kv) * (inp.softmax_scale * math.log2(math.e))
    for t in range(q_len):
        s[t, :, seq_len - q_len + 1 + t:] = -math.inf
    v = kv[:, :KV_LORA_RANK]
    out = {}
    for name, sc in schemes.items():
        parts = []
        for start in range(0, seq_len, sc.split):
            chunk = s[..., start:start + sc.split]
            m = chunk.amax(-1, keepdim=True)
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row with no key in this split
            p = torch.exp2(chunk - m)
            p_hat = _e4m3(p * sc.p_scale) / sc.p_scale if sc.round_p else p
            row_sum = (p_hat if sc.sum_rounded else p).sum(-1, keepdim=True)
            o = torch.einsum("thk,kd->thd", p_hat, v[start:start + sc.split]) / row_sum.clamp_min(1e-300)
            lse = torch.where(row_sum > 0, m + torch.log2(row_sum), torch.full_like(m, -math.inf))
            parts.append((o.to(sc.partial_dtype).to(torch.float64), lse))
        lses = torch.stack([lse for _, lse in parts])
        weights = torch.exp2(lses - lses.amax(0))
        weights = weights / weights.sum(0)
        merged = sum(weights[i] * parts[i][0] for i in range(len(parts)))
        out[name] = (merged.to(out_dtype).to(torch.float64) - ref).abs().max().item()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="1024")
    ap.add_argument("--q-lens", default="1,2")
    ap.add_argument("--seeds", default="1,2,3,17,23,31")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--schemes", default="ours,rounded_sum,flashmla_like",
                    help=f"comma-separated, of: {', '.join(SCHEMES)}")
    args = ap.parse_args(argv)
    names = args.schemes.split(",")
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: {', '.join(unknown)} unknown; allowed: {', '.join(SCHEMES)}")
    schemes = {n: SCHEMES[n] for n in names}
    print("| S | q_len | seed | " + " | ".join(names) + " |")
    print("|---:|---:|---:|" + "---:|" * len(names))
    for seq_len in map(int, args.seq_lens.split(",")):
        for seed in map(int, args.seeds.split(",")):
            for q_len in map(int, args.q_lens.split(",")):
                errs = max_errors(seq_len, q_len, seed, schemes, args.heads)
                print(f"| {seq_len} | {q_len} | {seed} | " + " | ".join(f"{errs[n]:.4f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
