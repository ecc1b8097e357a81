"""Per-kernel device times (torch profiler) of cute_sm90 on a few ragged cells, for the tree on PYTHONPATH.

    PYTHONPATH=TREE python prof_kernels.py        # the first set of cells
    PYTHONPATH=TREE python prof_kernels.py b      # the second set (kernel_times.txt, part 3)

Eager calls without a step, so the step-plan kernel runs in every call; mean over 50 calls."""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_backend_plugin
from mla_backend_plugin.ops import MLAWorkspace, mla_decode
from mla_backend_plugin.ops.workspace import SPLIT_CAPACITY
from mla_backend_plugin.testing import make_decode_inputs

FP8 = torch.float8_e4m3fn
FIRST = [("onelong B8 8k bf16", [8192] + [1024] * 7, torch.bfloat16),
         ("onelong B16 32k fp8", [32768] + [1024] * 15, FP8),
         ("onelong B8 32k fp8", [32768] + [1024] * 7, FP8),
         ("uni B3 1k bf16", [1024] * 3, torch.bfloat16)]
SECOND = [("onelong B32 32k fp8", [32768] + [1024] * 31, FP8),
          ("onelong B32 32k bf16", [32768] + [1024] * 31, torch.bfloat16),
          ("onelong B8 32k fp8", [32768] + [1024] * 7, FP8),
          ("uni B3 1k bf16", [1024] * 3, torch.bfloat16)]


def kernel_times(lens, kv) -> dict[str, float]:
    fp8 = kv != torch.bfloat16
    inp = make_decode_inputs(len(lens), lens, 1, 128, 64, kv, "fp8" if fp8 else "pair", "cuda", 1,
                             q_scale=1.0 if fp8 else None, kv_scale=1.0 if fp8 else None)
    ws = MLAWorkspace("cuda", max_batch=len(lens), max_q_len=1, num_heads=128, split_capacity=SPLIT_CAPACITY)
    out, lse = inp.poisoned_outputs()
    scales = inp.scale_kwargs(True)

    def call():
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                   kernel="cute_sm90", **scales)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            call()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name[:60]].append(e.device_time)
    return {name: sum(v) / len(v) for name, v in sorted(times.items())}


if __name__ == "__main__":
    print(mla_backend_plugin.__file__)
    for name, lens, kv in SECOND if len(sys.argv) > 1 else FIRST:
        print(name, " | ".join(f"{k}: {t:.1f} us" for k, t in kernel_times(lens, kv).items()))
