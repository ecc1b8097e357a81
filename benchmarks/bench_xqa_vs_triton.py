"""Quick timing of the xqa_sm120 kernel against the Triton kernel (CUDA graphs, median of replays).

    python benchmarks/bench_xqa_vs_triton.py

Not the full benchmark (bench_decode.py): a handful of decode shapes, KV not rotated past L2, both kernels
checked against the float32 reference first.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from mla_testutils import assert_close_decode, make_decode_inputs

from mla_backend_plugin.ops import MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import FP8_DTYPE

SHAPES = [  # (kv, batch, seq_len, q_len, heads)
    ("bf16", 1, 8192, 1, 128), ("bf16", 64, 8192, 1, 128), ("bf16", 64, 8192, 2, 128),
    ("fp8", 64, 8192, 1, 128), ("bf16", 32, 4096, 1, 16), ("fp8", 128, 4096, 1, 128),
]


def time_graph(fn, reps: int = 30) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name()}  PDL={os.environ.get('CUTE_MLA_PDL', '1')}")
    print(f"{'kv':5s} {'B':>4s} {'S':>6s} {'q':>2s} {'H':>4s} {'triton us':>10s} {'xqa us':>8s} {'xqa/triton':>10s}")
    for kv, batch, seq, q_len, heads in SHAPES:
        kv_dtype = FP8_DTYPE if kv == "fp8" else torch.bfloat16
        inp = make_decode_inputs(batch, [seq] * batch, q_len, heads, 64, kv_dtype, "pair", "cuda", 1,
                                 kv_scale=1.0 if kv == "fp8" else None, poison=False)
        ws = MLAWorkspace("cuda", max_batch=batch, max_q_len=q_len, num_heads=heads)
        res = {}
        ref = inp.reference() if batch * seq <= 300_000 else None
        for kernel in ("triton", "xqa_sm120"):
            out, lse = inp.poisoned_outputs()

            def run(kernel=kernel, out=out, lse=lse):
                mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                           kernel=kernel, **inp.scale_kwargs())
            run()
            torch.cuda.synchronize()
            if ref is not None:
                assert_close_decode(out, lse, *ref, kv_dtype, msg=kernel)
            res[kernel] = time_graph(run)
        print(f"{kv:5s} {batch:4d} {seq:6d} {q_len:2d} {heads:4d} {res['triton']:10.1f} {res['xqa_sm120']:8.1f} "
              f"{res['xqa_sm120'] / res['triton']:10.2f}")


if __name__ == "__main__":
    main()
