"""The SGLang backend on a GPU, with SGLang's own MLA attention test kit (tiny DeepSeek MLA layer at the real
dims, 512 + 64; KV written by SGLang into shuffled pages; SGLang's reference): DECODE eager over page sizes 16..128
and heads 16..128, bf16 and fp8 pools, chain TARGET_VERIFY, and decode captured in a CUDA graph and replayed
with other requests in other rows (the page table and lengths are refilled inside the graph).

Our kernels run as ``mla_decode`` picks them (``kernel="auto"``; ``CUTE_MLA_KERNEL`` overrides). Needs sglang
0.5.17 on the GPU host (../shared/gpu: wheels-sglang.txt)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import unittest
from types import SimpleNamespace

import pytest
import sglang_kit
import torch
from engine_result import run_result_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]

MAX_CONTEXT = 8 * 128  # room for several pages of every page size


def _fixture(kit, case, *, fp8=False, runner_batch_size=None):
    return kit.build_mla_attention_fixture(unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64,
                                           hidden_size=64, max_context_len=MAX_CONTEXT, dtype=torch.bfloat16,
                                           device="cuda", fp8_kv_cache=fp8, runner_batch_size=runner_batch_size)


def _assert_matches(actual, expected, fp8):
    torch.testing.assert_close(actual.float(), expected.float(), atol=0.15 if fp8 else 3e-2, rtol=3e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_heads", [16, 32, 64, 128])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_decode_eager(page_size, num_heads, fp8):
    kit = sglang_kit.kit()
    # lengths on, before and after page edges, one request past several pages
    prefix_lens = (page_size - 2, page_size - 1, page_size, 3 * page_size + 5)
    case = kit.MLAAttentionCase(name=f"cute_mla_p{page_size}_h{num_heads}_{fp8}", backend="cute_mla",
                                forward_mode=kit.ForwardMode.DECODE, num_heads=num_heads, page_size=page_size,
                                prefix_lens=prefix_lens)
    fixture = _fixture(kit, case, fp8=fp8)
    assert sglang_kit.poison(fixture) > 0
    _assert_matches(kit.run_mla_fixture_eager(fixture), kit.expected_mla_fixture_output(fixture), fp8)


@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("page_size", [16, 64])
def test_chain_verify_eager(page_size, q_len):
    kit = sglang_kit.kit()
    prefix_lens = (page_size - 1, 2 * page_size + 3)
    case = kit.MLAAttentionCase(name=f"cute_mla_verify_p{page_size}_q{q_len}", backend="cute_mla",
                                forward_mode=kit.ForwardMode.TARGET_VERIFY, num_heads=128, page_size=page_size,
                                prefix_lens=prefix_lens, extend_lens=(q_len,) * len(prefix_lens))
    fixture = _fixture(kit, case)
    batch = fixture.forward_batch
    batch.seq_lens = torch.tensor(prefix_lens, dtype=torch.int32, device="cuda")  # SGLang's: without drafts
    batch.seq_lens_cpu = batch.seq_lens.cpu()
    batch.seq_lens_sum = sum(prefix_lens)
    batch.spec_info = SimpleNamespace(topk=1, draft_token_num=q_len, custom_mask=None)
    assert sglang_kit.poison(fixture) > 0
    _assert_matches(kit.run_mla_fixture_eager(fixture), kit.expected_mla_fixture_output(fixture), False)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_cuda_graph_capture_and_replay(fp8):
    """Capture one decode step as SGLang's graph runner does (out_graph(in_capture=True) outside, in_graph and
    the layer inside the graph), replay it, then replay again with the requests in reversed rows and new hidden
    states: the page table and lengths the graph refills must follow."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    kit = sglang_kit.kit()
    page_size = 64
    prefix_lens = (5, 64, 200)
    case = kit.MLAAttentionCase(name=f"cute_mla_graph_{fp8}", backend="cute_mla",
                                forward_mode=kit.ForwardMode.DECODE, num_heads=128, page_size=page_size,
                                prefix_lens=prefix_lens)
    fixture = _fixture(kit, case, fp8=fp8)
    backend, batch, module = fixture.backend, fixture.forward_batch, fixture.actual_module
    hidden = fixture.input_hidden.clone()
    assert sglang_kit.poison(fixture) > 0
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=len(prefix_lens), max_num_tokens=len(prefix_lens))
        backend.init_forward_metadata_out_graph(batch, in_capture=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles, autotune warm-up, as SGLang's runner does
            backend.init_forward_metadata_in_graph(batch)
            module(hidden, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.init_forward_metadata_in_graph(batch)
            out = module(hidden, batch)
        graph.replay()
        _assert_matches(out, kit.expected_mla_fixture_output(fixture), fp8)

        # the same requests in reversed rows, new current tokens
        order = list(reversed(range(len(prefix_lens))))
        new_hidden = torch.randn_like(hidden)
        batch.req_pool_indices.copy_(batch.req_pool_indices[order].clone())
        batch.seq_lens.copy_(batch.seq_lens[order].clone())
        batch.out_cache_loc.copy_(batch.out_cache_loc[order].clone())
        hidden.copy_(new_hidden)
        backend.init_forward_metadata_out_graph(batch)
        backend.workspace.out_buffer.fill_(float("nan"))  # the replay must write every row again
        graph.replay()
        reversed_case = dataclasses.replace(case, prefix_lens=tuple(prefix_lens[i] for i in order))
        expected = kit._mla_attention_reference(fixture.reference_module, reversed_case,
                                                [fixture.prefix_hidden[i] for i in order], new_hidden)
        _assert_matches(out, expected, fp8)


def test_decode_cuda_graph_with_sglang_runner():
    """SGLang's own CUDA-graph decode runner of the kit (capture at a padded batch, replays at smaller ones)."""
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        run_mla_cuda_graph_decode_case,
    )

    kit = sglang_kit.kit()
    case = kit.MLAAttentionCase(name="cute_mla_kit_graph", backend="cute_mla", forward_mode=kit.ForwardMode.DECODE,
                                num_heads=128, page_size=64, prefix_lens=(7, 64, 130))
    run_mla_cuda_graph_decode_case(unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=64,
                                   max_context_len=MAX_CONTEXT, dtype=torch.bfloat16, device="cuda",
                                   cuda_graph_capture_batch_size=4)


CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_gpu_check.py")


def run_engine(*args: str) -> dict:
    return run_result_script(CHECK, *args)


@pytest.mark.parametrize("kv_cache_dtype,page_size,decode_only", [
    ("auto", 64, False), ("fp8_e4m3", 32, False), ("auto", 128, True)])
def test_engine_end_to_end(kv_cache_dtype, page_size, decode_only):
    """sglang.Engine with cute_mla (the whole backend, or decode only in SGLang's hybrid backend): every eager
    decode call in the scheduler process matches the float32 reference on SGLang's inputs, and the CUDA-graph
    run generates what the eager run generates. The hybrid case prefills with SGLang's Triton backend: the
    staged sglang-kernel leaves out FA3 (benchmarks/wheels-sglang.txt)."""
    args = ["--kv-cache-dtype", kv_cache_dtype, "--page-size", str(page_size)]
    if decode_only:
        args += ["--decode-only", "--prefill-backend", "triton"]
    eager = run_engine("eager", *args)
    stats = eager["stats"]
    fp8 = kv_cache_dtype.startswith("fp8")
    assert stats["calls"] > 0, "forward_decode never reached our kernels"
    assert stats["q_lens"] == {"1": stats["calls"]} and stats["heads"] == {"128": stats["calls"]}, stats
    assert stats["block_sizes"] == {str(page_size): stats["calls"]}, stats
    assert stats["max_seq_len"] >= 2047, stats  # the longest prompt decoded
    assert stats["lse_inf_mismatch"] == 0
    assert stats["max_rel_err"] < (5e-2 if fp8 else 1e-2), stats
    graphs = run_engine("graphs", *args)
    assert graphs["tokens"] == eager["tokens"]
