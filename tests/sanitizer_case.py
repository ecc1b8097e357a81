"""A small decode run of one kernel (argv[1]) for compute-sanitizer (memcheck / racecheck); run by
tests/test_kernel_features_gpu.py.

Covers the split (cute_sm90: with the combine fused into the split kernel, by all of a request's CTAs or by its last
one, and separate) and the unsplit path,
bf16 and fp8 KV, a request shorter than q_len and an empty one (and for cute_sm90 fp8 design C at 128 heads); checks
the results against the reference too, and prints SANITIZER_OK at the end.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mla_backend_plugin.ops import LaunchConfig, MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.testing import assert_close_decode, make_decode_inputs


def main(kernel: str) -> None:
    # cute_sm90 merges the splits of this small grid in the split kernel; the last case launches the combine
    for kv_dtype, num_sms, fused in ((torch.bfloat16, 1, "1"), (torch.bfloat16, 132, "1"), (FP8_DTYPE, 132, "1"),
                                     (torch.bfloat16, 132, "0")):
        os.environ["CUTE_MLA_FUSED_COMBINE"] = fused
        lens = [300, 1, 0]
        inp = make_decode_inputs(3, lens, 2, 16, 16, kv_dtype, "pair", "cuda", 7,
                                 kv_scale=2.0 if kv_dtype == FP8_DTYPE else None)
        # num_sms=1 plans no split; 132 splits the 300-token request
        ws = MLAWorkspace("cuda", max_batch=3, max_q_len=2, num_heads=16, num_sms=num_sms)
        out, lse = inp.poisoned_outputs()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                   kernel=kernel, **inp.scale_kwargs())
        torch.cuda.synchronize()
        ref_out, ref_lse = inp.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype,
                            msg=f"sanitizer case {kv_dtype} sms={num_sms} fused combine={fused}")
    if kernel == "cute_sm90":
        # a grid too large to be resident at once (24 requests x 128 heads: 178 CTAs on 132 SMs): each request's
        # last CTA merges its partials (LAST_CTA), and the seesaw runs its KV multicast (2-CTA clusters; asked for:
        # the default's smallest batch is 32)
        os.environ["CUTE_MLA_FUSED_COMBINE"] = "1"
        lens = [1500, 700, 64 * 5 + 3, 1, 0, 900, 1200, 2000] * 3
        inp = make_decode_inputs(24, lens, 1, 128, 64, torch.bfloat16, "pair", "cuda", 9)
        ws = MLAWorkspace("cuda", max_batch=24, max_q_len=1, num_heads=128)
        out, lse = inp.poisoned_outputs()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                   kernel=kernel, config=LaunchConfig(kv_multicast=True), **inp.scale_kwargs())
        torch.cuda.synchronize()
        ref_out, ref_lse = inp.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, torch.bfloat16, msg="sanitizer case last-CTA combine")
        # fp8 design C at the serving shape (128 heads, an fp8 q, q_len 2): its consumer groups meet through
        # mbarriers of 128 arrivals and 256-thread named barriers; a 128-thread named barrier here once drew
        # racecheck hazard reports (kernel_fp8seesaw.py); rows past 1024 keys so its running max's slack (from a
        # split's ninth tile pair) runs too
        os.environ["CUTE_MLA_FUSED_COMBINE"] = "1"
        lens = [1500, 1335, 1217]
        inp = make_decode_inputs(3, lens, 2, 128, 64, FP8_DTYPE, "fp8", "cuda", 14, kv_scale=3.0)
        ws = MLAWorkspace("cuda", max_batch=3, max_q_len=2, num_heads=128)
        out, lse = inp.poisoned_outputs()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, workspace=ws,
                   kernel=kernel, fp8_design="fp8seesaw", **inp.scale_kwargs())
        torch.cuda.synchronize()
        ref_out, ref_lse = inp.reference()
        assert_close_decode(out, lse, ref_out, ref_lse, FP8_DTYPE, msg="sanitizer case fp8 design C")
    print("SANITIZER_OK")


if __name__ == "__main__":
    main(sys.argv[1])
