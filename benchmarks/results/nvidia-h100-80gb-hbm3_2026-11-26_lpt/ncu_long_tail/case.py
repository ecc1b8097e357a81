"""One long-tail B=128 S=32k fp8 (fp8 q) decode, planning every call (for ncu of the split kernel)."""
import math
import random

import torch

from mla_backend_plugin.ops import MLAWorkspace, mla_decode
from mla_backend_plugin.testing import make_decode_inputs

B, S = 128, 32768
rng = random.Random(B * 7919 + S)
lens = [S] + [min(S, max(1, int(rng.lognormvariate(math.log(S / 16), 1.2)))) for _ in range(B - 1)]
inp = make_decode_inputs(B, lens, 1, 128, 64, torch.float8_e4m3fn, "fp8", "cuda", 1, kv_scale=0.5, q_scale=1.0)
ws = MLAWorkspace("cuda", max_batch=B, max_q_len=1, num_heads=128)
for _ in range(4):
    mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, workspace=ws, kernel="cute_sm90",
               out_dtype=torch.bfloat16, **inp.scale_kwargs(True))
torch.cuda.synchronize()
print("done", flush=True)
