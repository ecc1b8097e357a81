"""What the SGLang tests share around SGLang's MLA attention kit: our backend registered, the kit's KV write
without Triton (CPU), and poison where the kernels must not read or must overwrite."""

from __future__ import annotations

import torch

NAN_E4M3_BYTE = 0x7F  # e4m3fn has no inf; 0x7F is its NaN (the fp8 pool stores bytes)


def kit():
    from mla_backend_plugin.sglang import register

    register.register()
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention

    _state_one_attention_rank()
    return mla_attention


_one_rank = None


def _state_one_attention_rank() -> None:
    """SGLang reads the attention's parallel layout from a process context that a server publishes; 0.5.23's MLA
    kit states the TP size only, and its context no longer derives the decode-context-parallel rank that SGLang's
    Triton backend (which ours extends) reads: stated here for the rest of the process, as SGLang's dense-attention
    kit does (0.5.17 derives the same 0)."""
    global _one_rank
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # an SGLang without the context
        return
    if _one_rank is None:
        _one_rank = get_parallel().override(attn_dcp_rank=0)
        _one_rank.__enter__()


def write_kv_without_triton(monkeypatch) -> None:
    """SGLang writes latent + rope into its pool with a Triton kernel, which needs a GPU: on the CPU the same
    bytes go in through the pool's plain indexed write."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        self.set_kv_buffer(layer, loc, torch.cat([cache_k_nope, cache_k_rope], dim=-1), None)

    monkeypatch.setattr(MLATokenToKVPool, "set_mla_kv_buffer", set_mla_kv_buffer)


def poison(fixture) -> int:
    """NaN in every pool slot no request of the case owns below its length (the rest of each last page, the
    pages of nobody), and in the backend's output buffers, before the step. The step writes its own tokens'
    KV first, so only what the kernels must not read stays NaN. Returns the number of poisoned slots."""
    case, runner = fixture.case, fixture.runner
    pool = runner.token_to_kv_pool
    buf = pool.kv_buffer[0]
    used = torch.zeros(buf.shape[0], dtype=torch.bool, device=buf.device)
    req_to_token = runner.req_to_token_pool.req_to_token
    for row, seq_len in enumerate(case.seq_lens):
        used[req_to_token[row, :seq_len].long()] = True
    unused = ~used
    buf[unused] = NAN_E4M3_BYTE if buf.dtype == torch.uint8 else float("nan")
    workspace = fixture.backend.workspace
    workspace.out_buffer.fill_(float("nan"))
    workspace.lse_buffer.fill_(float("nan"))
    return int(unused.sum())
