"""GPU tests of the host fast paths of an eager decode call: a repeated call of one shape reuses what the first
worked out (cute_sm90's prepared launch, kernels/cute_sm90/launch.py) and launches the Triton combine straight
through its compiled launcher (kernels/combine/kernel.py ``prepared_launch``). Each call's outputs, poisoned
before it, against the float32 reference; then the same calls captured in a CUDA graph after those eager calls
(the prepared launch must land on the capturing stream) and replayed with new lengths."""

from __future__ import annotations

import pytest
import torch

from mla_backend_plugin.kernels.combine import kernel as combine
from mla_backend_plugin.ops import MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.testing import (
    assert_close_decode,
    capture_graph,
    kernel_unsupported_reason,
    make_decode_inputs,
    replay_with,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", ["cute_sm90", "triton"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
def test_repeat_eager_calls_take_the_prepared_combine_launch(kernel, kv_dtype, monkeypatch):
    reason = kernel_unsupported_reason(kernel)
    if reason is not None:
        pytest.skip(f"{kernel}: {reason}")
    monkeypatch.setenv("CUTE_MLA_FUSED_COMBINE", "0")  # cute_sm90: the separate combine after every split grid
    monkeypatch.setenv("CUTE_MLA_PREPARED_COMBINE", "1")
    paths = []
    real = combine.prepared_launch
    monkeypatch.setattr(combine, "prepared_launch", lambda *a, **k: paths.append(real(*a, **k)) or paths[-1])
    fp8 = kv_dtype == FP8_DTYPE
    lens = [2000, 1537, 777]
    sizes = dict(num_blocks=160, max_blocks=40)  # one cache and table shape for both input sets
    inp = make_decode_inputs(3, lens, 1, 128, 64, kv_dtype, "pair", "cuda", 21, kv_scale=2.5 if fp8 else None,
                             **sizes)
    ws = MLAWorkspace("cuda", max_batch=3, max_q_len=1, num_heads=128)
    ref_out, ref_lse = inp.reference()
    for i in range(3):
        out, lse = inp.poisoned_outputs()
        mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse, kernel=kernel,
                   workspace=ws, **inp.scale_kwargs(i == 2))  # the last call: the scale as a device tensor
        torch.cuda.synchronize()
        assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype, msg=f"{kernel} call {i}")
    # the first call of each specialisation goes through Triton, every repeat straight to the launcher; a scale
    # given as a tensor is another specialisation
    assert paths[:3] == [paths[0], "prepared", paths[2]] and paths[0] in ("triton", "prepared"), paths

    # a CUDA graph of the same call after eager ones, replayed with other lengths
    out, lse = inp.poisoned_outputs()
    graph = capture_graph(lambda _: mla_decode(*inp.call_args(), softmax_scale=inp.softmax_scale, out=out, lse=lse,
                                               kernel=kernel, workspace=ws, **inp.scale_kwargs()))
    assert paths[-1] == "prepared", paths
    new = make_decode_inputs(3, [1999, 64, 1200], 1, 128, 64, kv_dtype, "pair", "cuda", 22,
                             kv_scale=2.5 if fp8 else None, **sizes)
    replay_with(graph, inp, new, out, lse)
    ref_out, ref_lse = new.reference()
    assert_close_decode(out, lse, ref_out, ref_lse, kv_dtype, msg=f"{kernel} graph replay")


def _combine_specialisations() -> int:
    """Compiled specialisations of the Triton combine kernels on every device (Triton's per-device kernel cache)."""
    return sum(len(cache[0]) for fn in (combine.combine_balanced_kernel, combine.combine_uniform_kernel)
               for cache in fn.device_caches.values())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_decode_warm_up_leaves_nothing_to_compile_for_the_eager_steps(kv_cache_dtype):
    """An n-gram engine (q_len 2 graphs) after ``warm_up_decode``: eager serving calls at q_len 1 and 2 (steps with
    requests that have no draft, chunked prefill beside decodes) at batch sizes no graph has compile nothing more,
    and are right (outputs poisoned before each, against the float32 reference)."""
    from mla_backend_plugin.ops import serving

    fp8 = kv_cache_dtype == "fp8"
    dep = serving.make_deployment(num_heads=128, max_num_seqs=24, num_speculative_tokens=1,
                                  model_dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, block_size=64,
                                  max_model_len=4096, fp8_query=fp8)
    ws = serving.make_workspace("cuda", max_num_seqs=24, num_speculative_tokens=1, num_heads=128,
                                out_dtype=torch.bfloat16)
    report = serving.warm_up_decode(dep, ws)
    assert report["calls"] == ws.max_batch * ws.max_q_len and not report["skipped"], report
    before = _combine_specialisations()
    assert before > 0, "the warm-up launched no combine: the calls below would check nothing"
    runner = serving.DecodeRunner(0.07, "fp8" if fp8 else "auto")
    for i, (batch, q_len) in enumerate([(3, 1), (17, 1), (5, 2), (23, 2), (11, 1)]):
        lens = [int(x) for x in torch.randint(q_len, 3000, (batch,), generator=torch.Generator().manual_seed(i))]
        inp = make_decode_inputs(batch, lens, q_len, 128, 64, FP8_DTYPE if fp8 else torch.bfloat16,
                                 "fp8" if fp8 else "pair", "cuda", 40 + i, q_scale=0.5 if fp8 else None,
                                 kv_scale=2.0 if fp8 else None, softmax_scale=0.07)
        for t in ws.output_views(batch * q_len):  # out and lse poisoned before each call
            t.fill_(float("nan"))
        out, lse = runner.decode(inp.q, inp.kv_cache, inp.block_table, inp.seq_lens, ws, max_seq_len=None,
                                 **inp.scale_kwargs(as_tensor=True))
        torch.cuda.synchronize()
        assert_close_decode(out, lse, *inp.reference(), inp.kv_cache.dtype, msg=f"B={batch} q_len={q_len}")
    assert _combine_specialisations() == before, "an eager call compiled a combine specialisation"
