"""Shapes and dtypes of DeepSeek-style MLA decode that every kernel of this package shares."""

import torch

KV_LORA_RANK = 512  # latent (compressed KV) width: the "nope" part of q/k and the whole of v
QK_ROPE_HEAD_DIM = 64  # decoupled rotary part of q/k
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: one KV-cache entry per token
V_HEAD_DIM = KV_LORA_RANK  # 512

# Heads per tensor-parallel rank for DeepSeek-V2/V3/R1 (128 heads at TP1, 16 at TP8).
SUPPORTED_NUM_HEADS = (16, 32, 64, 128)
# Query tokens per request in one decode step: 1 plus up to 3 speculative (MTP) tokens.
SUPPORTED_Q_LENS = (1, 2, 3, 4)
MAX_Q_LEN = max(SUPPORTED_Q_LENS)
# KV-cache page sizes (tokens per block) that vLLM may hand us.
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
# the page size an engine should give the kernels when its user names none: what they are tuned and prebuilt at
PREFERRED_BLOCK_SIZE = 64

# int32s per work item in a workspace's step table (kernels/cute_common/scheduler.py ``StepPlanKernel``): request + 1
# (0 past the schedule's end), request, its KV length, its splits, its first partial slot, the item's KV range
# [start, end), its tiles and its own partial slot (its index w in the schedule: the table holds the items in
# launch order, longest first, so a CTA's index is not its slot).
WORK_ITEM_INTS = 9
# A request's fixed cost on the share plan's line, in KV tiles (its Q load, epilogue and stores): a share boundary
# that falls in it moves the whole request to the next share (ops/plan.py ``share_schedule``; the CPU model
# of benchmarks/model_schedules.py puts a CTA's fixed cost at 1.5 tiles).
SHARE_REQUEST_COST = 2
# The largest running-max slack a launch may ask for (log2 units; LaunchConfig.max_slack, the seesaw schedules of
# cute_sm90: kernels/cute_sm90/config.py): P = exp2(s - m) reaches up to 2^slack.
MAX_SLACK = 8.0

Q_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = (torch.bfloat16, torch.float16, FP8_DTYPE)
OUT_DTYPES = (torch.bfloat16, torch.float16)


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)
