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


def _problem(inp, seq_len: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(base-2 scores [T, H, S], V [S, 512], the float32 reference's (output [T, H, 512], LSE [T, H])) of request 0
    of ``inp`` in float64, with the q the kernels take (vLLM's per-tensor e4m3 rounding of a 16-bit q) and the
    cache's dequantised values."""
    q8, q_scale = inp.query("fp8")
    ref = tuple(r[:q_len].to("cpu", torch.float64) for r in inp.reference("fp8"))
    block_size = inp.kv_cache.shape[1]
    pages = inp.block_table[0, :(seq_len + block_size - 1) // block_size].tolist()
    kv = torch.cat([inp.kv_cache[p] for p in pages])[:seq_len].to("cpu", torch.float64)
    kv = kv * (1.0 if inp.kv_scale is None else float(inp.kv_scale))
    q = q8[:q_len].to("cpu", torch.float64) * float(q_scale)
    s = torch.einsum("thd,kd->thk", q, kv) * (inp.softmax_scale * math.log2(math.e))
    for t in range(q_len):
        s[t, :, seq_len - q_len + 1 + t:] = -math.inf
    return s, kv[:, :KV_LORA_RANK], ref


def model_output(s: torch.Tensor, v: torch.Tensor, sc: Scheme) -> torch.Tensor:
    """The scheme's merged output in float64 (before the output's own rounding)."""
    parts = []
    for start in range(0, s.shape[-1], sc.split):
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
    return sum(weights[i] * parts[i][0] for i in range(len(parts)))


def model_inputs(seq_len: int, q_len: int, seed: int, heads: int = 128, block_size: int = 64, device="cpu"):
    """The inputs of the GPU tests (``make_decode_inputs``: an fp8 q, unit scales, 576^-0.5) for one request."""
    return make_decode_inputs(1, [seq_len], q_len, heads, block_size, FP8_DTYPE, "fp8", device, seed)


def bench_inputs(seq_len: int, q_len: int, seed: int, heads: int = 128, device="cpu"):
    """bench_decode.py's inputs for one request (``peers.cell_inputs``: a bf16 q rounded per tensor, the cache
    stored as value x 64, DeepSeek's softmax scale 192^-0.5), where the grid's max_abs_err column comes from."""
    from peers import Cell, cell_inputs  # benchmarks/ sibling: only this input set needs it

    return cell_inputs(Cell(1, seq_len, q_len, "fp8", num_heads=heads), device, seed=seed)


def max_errors(seq_len: int, q_len: int, seed: int, schemes: dict[str, Scheme], heads: int = 128,
               block_size: int = 64, out_dtype: torch.dtype = torch.bfloat16, inputs=None) -> dict[str, float]:
    """Max |out - reference| per scheme for one request of ``seq_len`` keys (``q_len`` query rows, causal), the
    output rounded to ``out_dtype``; on ``inputs`` (a DecodeInputs of that request) or ``model_inputs``'."""
    inp = inputs if inputs is not None else model_inputs(seq_len, q_len, seed, heads, block_size)
    s, v, (ref, _) = _problem(inp, seq_len, q_len)
    return {name: (model_output(s, v, sc).to(out_dtype).to(torch.float64) - ref).abs().max().item()
            for name, sc in schemes.items()}


READ_BACK_KERNELS = ("ours", "ours_chunk128", "ours_dequant", "ours_fp8seesaw", "flashmla")


# --kernels: a kernel's name (READ_BACK_KERNELS) -> (the bench runner's factory, the scheme whose arithmetic it
# follows)
def _kernel_runners():
    import bench_decode  # benchmarks/ siblings, imported only for a GPU read-back
    import peers

    return {
        "ours": (lambda: bench_decode.OurKernel("cute_sm90", "fp8", False), "ours"),
        "ours_chunk128": (lambda: bench_decode.OurKernel("cute_sm90", "fp8", False, overrides={"min_chunk": 128}),
                          "splits128"),
        "ours_dequant": (lambda: bench_decode.OurKernel("cute_sm90", "fp8", False,
                                                        overrides={"fp8_design": "dequant"}), None),
        "ours_fp8seesaw": (lambda: bench_decode.OurKernel("cute_sm90", "fp8", False,
                                                          overrides={"fp8_design": "fp8seesaw"}), "splits128"),
        "flashmla": (lambda: peers.PEERS["flashmla"], "flashmla_like"),
    }


def read_back(seq_len: int, q_len: int, seed: int, names: list[str], heads: int = 128) -> dict[str, dict]:
    """Each kernel on bench_decode's inputs on the GPU, beside the model of its arithmetic on the same values:
    its max error, the max error of its scheme, their largest difference, the LSE's max error (natural log), and
    where its max error sits (row, head, column: kernel, scheme, reference)."""
    from peers import Cell

    runners = _kernel_runners()
    inp = bench_inputs(seq_len, q_len, seed, heads, device="cuda")
    s, v, (ref, ref_lse) = _problem(inp, seq_len, q_len)
    cell = Cell(1, seq_len, q_len, "fp8", num_heads=heads)
    out = {}
    for name in names:
        factory, scheme = runners[name]
        o, lse = factory().prepare(cell, inp)()
        torch.cuda.synchronize()
        o = o[:q_len].to("cpu", torch.float64)
        err = (o - ref).abs()
        at = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
        row = {"err": err.max().item(), "rms": err.pow(2).mean().sqrt().item(), "at": at, "kernel": o[at].item(),
               "ref": ref[at].item()}
        if lse is not None:
            row["lse_err"] = (lse[:q_len].to("cpu", torch.float64) - ref_lse).abs().max().item()
        if scheme is not None:
            m = model_output(s, v, SCHEMES[scheme]).to(torch.bfloat16).to(torch.float64)
            row.update(scheme=scheme, scheme_err=(m - ref).abs().max().item(),
                       scheme_rms=(m - ref).pow(2).mean().sqrt().item(),
                       kernel_vs_scheme=(o - m).abs().max().item(), scheme_at=m[at].item())
        out[name] = row
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
    ap.add_argument("--inputs", choices=("model", "bench"), default="model",
                    help="model: the GPU tests' inputs (fp8 q, unit scales); bench: bench_decode.py's (default: model)")
    ap.add_argument("--kernels", default=None,
                    help="on a GPU, bench inputs: run these kernels and compare each with its scheme, of: "
                         + ", ".join(READ_BACK_KERNELS))
    args = ap.parse_args(argv)
    names = args.schemes.split(",")
    unknown = [n for n in names if n not in SCHEMES]
    if unknown:
        ap.error(f"--schemes: {', '.join(unknown)} unknown; allowed: {', '.join(SCHEMES)}")
    schemes = {n: SCHEMES[n] for n in names}
    cells = [(seq_len, q_len, seed) for seq_len in map(int, args.seq_lens.split(","))
             for seed in map(int, args.seeds.split(",")) for q_len in map(int, args.q_lens.split(","))]
    if args.kernels:
        return _main_read_back(cells, args.kernels.split(","), args.heads, ap)
    print("| S | q_len | seed | " + " | ".join(names) + " |")
    print("|---:|---:|---:|" + "---:|" * len(names))
    for seq_len, q_len, seed in cells:
        inp = bench_inputs(seq_len, q_len, seed, args.heads) if args.inputs == "bench" else None
        errs = max_errors(seq_len, q_len, seed, schemes, args.heads, inputs=inp)
        print(f"| {seq_len} | {q_len} | {seed} | " + " | ".join(f"{errs[n]:.4f}" for n in names) + " |")
    return 0


def _main_read_back(cells, kernels: list[str], heads: int, ap) -> int:
    if unknown := [k for k in kernels if k not in READ_BACK_KERNELS]:
        ap.error(f"--kernels: {', '.join(unknown)} unknown; allowed: {', '.join(READ_BACK_KERNELS)}")
    if not torch.cuda.is_available():
        ap.error("--kernels needs a CUDA device")
    print("| S | q_len | seed | kernel | max err | rms err | scheme | scheme's max err | scheme's rms | "
          "max kernel - scheme | lse err | at (row, head, col): kernel / scheme / ref |")
    print("|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|")
    for seq_len, q_len, seed in cells:
        for name, r in read_back(seq_len, q_len, seed, kernels, heads).items():
            sch = r.get("scheme")
            head = f"| {seq_len} | {q_len} | {seed} | {name} | {r['err']:.4f} | {r['rms']:.5f} | "
            print(head + (f"{sch} | {r['scheme_err']:.4f} | {r['scheme_rms']:.5f} | {r['kernel_vs_scheme']:.4f} | "
                          if sch else "- | - | - | - | "), end="")
            at = ",".join(map(str, r["at"]))
            sch_at = f"{r['scheme_at']:.4f}" if sch else "-"
            print(f"{r.get('lse_err', float('nan')):.5f} | {at}: {r['kernel']:.4f} / {sch_at} / {r['ref']:.4f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
