"""The Triton decode kernel's logic on the CPU, through Triton's interpreter (run by test_triton_interpreter.py).

TRITON_INTERPRET=1 must be set before Triton is imported, hence a separate process. The interpreter's bf16
dot is not usable, so the cases run fp16 (and fp8 KV widened to the fp16 q dtype); everything else is the
real kernel: paging through a permuted block table, causal rows inside the q block, the per-request split
trimming, the combine kernel, the fp8 scale, rows with no visible key. Prints PASS when all cases match the
float32 reference.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from mla_backend_plugin.kernels.triton_decode.config import config_for  # noqa: E402
from mla_backend_plugin.kernels.triton_decode.kernel import launch  # noqa: E402
from mla_backend_plugin.ops.api import prepare_args  # noqa: E402
from mla_backend_plugin.ops.manifest import LaunchConfig  # noqa: E402
from mla_backend_plugin.ops.workspace import MLAWorkspace  # noqa: E402
from mla_backend_plugin.testing import SOFTMAX_SCALE, assert_close_decode, make_decode_inputs  # noqa: E402

# (kv dtype, seq_lens, q_len, heads, block size, max_splits): max_splits 1 writes the output directly, more
# goes through the combine; 300 tokens make 3 splits of a 128-token minimum chunk, 70 one, 1 < q_len none.
CASES = [
    (torch.float16, [70, 300], 2, 16, 16, 1),
    (torch.float16, [70, 300, 1], 2, 16, 16, 8),
    (torch.float16, [129, 45], 3, 32, 32, 8),
    (torch.float8_e4m3fn, [70, 300], 2, 16, 64, 8),
]


def main() -> None:
    for i, (kv_dtype, seq_lens, q_len, heads, block_size, max_splits) in enumerate(CASES):
        inp = make_decode_inputs(batch=len(seq_lens), seq_lens=seq_lens, q_len=q_len, num_heads=heads,
                                 block_size=block_size, kv_dtype=kv_dtype, q_form="pair", device="cpu", seed=i,
                                 q_dtype=torch.float16, kv_scale=2.0 if kv_dtype == torch.float8_e4m3fn else None)
        args = prepare_args(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                            q_scale=inp.q_scale, kv_scale=inp.kv_scale)
        # 64 pretend SMs so that these tiny batches are split (up to max_splits)
        cfg = config_for(heads)
        ws = MLAWorkspace("cpu", max_batch=len(seq_lens), max_q_len=q_len, num_heads=heads, num_sms=64,
                          max_splits=max_splits, rows_per_cta=cfg.block_m)
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        launch(args, ws, LaunchConfig(split_plan="balanced", enable_pdl=False, tile=cfg.tile))
        assert_close_decode(args.out, args.lse, *inp.reference(), kv_dtype)
        print(f"case {i}: ok ({ws.plan(len(seq_lens), q_len, balanced=True).max_slots} partial slots at most)")
    print("PASS")


if __name__ == "__main__":
    sys.exit(main())
