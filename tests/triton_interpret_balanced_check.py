"""The balanced split plan of the Triton kernel on the CPU, through Triton's interpreter (run by
tests/test_planner_balanced.py with TRITON_INTERPRET=1).

Ragged batches (a request of length 1, lengths not multiples of the 64-key tile, one long request among short
ones at a batch that already fills the pretend GPU) through the real balanced split + combine kernels, outputs
poisoned with NaN first, vs the float32 reference; the device's schedule (the combine's list in
workspace.split_index) must equal the Python reference ``balanced_schedule``; a second call with other seq_lens
on the same workspace (as a CUDA-graph replay would) must not read the first call's stale list; the uniform
plan (xqa_sm120's) runs through the same kernels with a uniform launch config. Prints PASS.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch

from mla_backend_plugin.kernels.triton_decode.config import config_for
from mla_backend_plugin.kernels.triton_decode.kernel import launch
from mla_backend_plugin.ops.api import prepare_args
from mla_backend_plugin.ops.manifest import LaunchConfig
from mla_backend_plugin.ops.plan import balanced_schedule
from mla_backend_plugin.ops.workspace import MLAWorkspace
from mla_backend_plugin.testing import SOFTMAX_SCALE, assert_close_decode, make_decode_inputs

# (kv dtype, seq_lens, q_len, heads, page size, pretend SMs, max_splits, balanced, want: request -> min splits)
CASES = [
    # one long request among short ones at a batch that fills the 4 pretend SMs: still split
    (torch.float16, [1000] + [40] * 9 + [1, 65], 1, 16, 16, 4, 64, True, {0: 2}),
    # q_len 2 (causal rows), 32 heads, lengths not multiples of 64, a request of length 1 (< q_len)
    (torch.float16, [1, 1500, 3, 200, 127], 2, 32, 32, 16, 8, True, {1: 3}),
    # fp8 cache with scale 2, q_len 3, 64-key pages
    (torch.float8_e4m3fn, [700, 1, 90], 3, 16, 64, 8, 16, True, {0: 2}),
    # B=1: the combine merges its 24 splits (of at most 32) in two load rounds of 16
    (torch.float16, [3000], 1, 16, 16, 64, 32, True, {0: 16}),
    # a uniform-ish batch whose cdiv(T, W) = 5 tiles per item makes 9 items for the 8 pretend SMs: the one-wave
    # search takes 6 tiles per item (2 splits each, 6 items)
    (torch.float16, [700, 700, 690], 1, 16, 64, 8, 16, True, {0: 2}),
    # the uniform plan through the same kernels
    (torch.float16, [1000, 1, 65, 300], 2, 16, 16, 8, 8, False, {}),
    # 64 heads x q_len 2 on a pretend 64-SM GPU (combine tiles of 16 rows, one split a round): one long request
    # among short ones (its 11 splits in 11 rounds), then three (fp8, scale 2)
    (torch.float16, [2000] + [30] * 18 + [1], 2, 64, 32, 64, 32, True, {0: 8}),
    (torch.float8_e4m3fn, [2000, 1500, 900] + [30] * 16 + [1], 2, 64, 32, 64, 32, True, {0: 2, 1: 2, 2: 2}),
]


def run(kv_dtype, seq_lens, q_len, heads, page, num_sms, max_splits, balanced, ws=None, seed=0):
    inp = make_decode_inputs(batch=len(seq_lens), seq_lens=seq_lens, q_len=q_len, num_heads=heads, block_size=page,
                             kv_dtype=kv_dtype, q_form="pair", device="cpu", seed=seed, q_dtype=torch.float16,
                             kv_scale=2.0 if kv_dtype == torch.float8_e4m3fn else None)
    args = prepare_args(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, softmax_scale=SOFTMAX_SCALE,
                        q_scale=inp.q_scale, kv_scale=inp.kv_scale)
    cfg = config_for(heads)
    if ws is None:
        ws = MLAWorkspace("cpu", max_batch=len(seq_lens), max_q_len=q_len, num_heads=heads, num_sms=num_sms,
                          max_splits=max_splits, rows_per_cta=cfg.block_m)
    args.out.fill_(float("nan"))
    args.lse.fill_(float("nan"))
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    launch(args, ws, LaunchConfig(split_plan="balanced" if balanced else "uniform", enable_pdl=False, tile=cfg.tile))
    assert_close_decode(args.out, args.lse, *inp.reference(), kv_dtype, msg=f"seq_lens {seq_lens}")
    return ws


def check_schedule(ws, seq_lens, q_len, want):
    plan = ws.plan(len(seq_lens), q_len, balanced=True)
    block_n = config_for(ws.num_heads).block_n
    sched = balanced_schedule(seq_lens, block_n, plan.min_chunk, plan.work_target, plan.num_splits)
    index = ws.split_index.tolist()
    got = [tuple(index[1 + 3 * j:4 + 3 * j]) for j in range(index[0])]
    expect = [(b, sched.slot_base[b], sched.splits[b]) for b in sched.split_requests]
    assert got == expect, f"device schedule {got} != reference {expect}"
    assert len(sched.items) <= plan.grid_items and sched.num_slots <= plan.max_slots
    for b, n in want.items():
        assert sched.splits[b] >= n, f"request {b} ({seq_lens[b]} tokens) split {sched.splits[b]} < {n} times"
    return sched


def main() -> None:
    for i, (kv_dtype, seq_lens, q_len, heads, page, num_sms, max_splits, balanced, want) in enumerate(CASES):
        ws = run(kv_dtype, seq_lens, q_len, heads, page, num_sms, max_splits, balanced, seed=i)
        note = ""
        if balanced:
            sched = check_schedule(ws, seq_lens, q_len, want)
            plan = ws.plan(len(seq_lens), q_len, balanced=True)
            note = f"splits {sched.splits}, combine rows {plan.combine_rows}, splits/round {plan.combine_split_block}"
            if len(seq_lens) == 1:  # the B=1 case merges its splits in more than one load round
                assert plan.combine_split_block < max(sched.splits), note
        print(f"case {i}: ok ({'balanced' if balanced else 'uniform'}; {note})")
    # replay: the same workspace, first a batch with split requests, then one with fewer (stale list entries)
    first = [900, 1000, 5, 64]
    second = [3, 1, 64, 700]
    ws = run(torch.float16, first, 1, 16, 16, 4, 64, True, seed=10)
    assert len(check_schedule(ws, first, 1, {0: 2, 1: 2}).split_requests) == 2
    run(torch.float16, second, 1, 16, 16, 4, 64, True, ws=ws, seed=11)
    assert len(check_schedule(ws, second, 1, {3: 2}).split_requests) == 1
    print("replay: ok")
    print("PASS")


if __name__ == "__main__":
    sys.exit(main())
