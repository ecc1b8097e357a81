"""Float32 torch reference of paged MLA decode: the ground truth every kernel is tested against.

Written for clarity, not speed: it gathers each request's pages through the block table, dequantises with
the fp8 scales, and runs a causal softmax inside the q block. It allocates and loops over requests on the
host, so it never runs inside a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from mla_backend_plugin.ops.constants import KV_LORA_RANK


def _as_f32_scale(scale, device) -> torch.Tensor | float:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        return scale.to(device=device, dtype=torch.float32).reshape(())
    return float(scale)


@torch.no_grad()
def mla_decode_reference(
    q_nope: torch.Tensor,  # [B*q_len, H, 512]
    q_pe: torch.Tensor,  # [B*q_len, H, 64]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 576]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, full lengths including this step's q_len tokens
    q_len: int,
    softmax_scale: float,
    q_scale=None,
    kv_scale=None,
    row_kv_lens: torch.Tensor | None = None,  # [B, q_len] int32: keys each row sees (capped at seq_len)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B*q_len, H, 512] float32, lse [B*q_len, H] float32, natural log).

    Row t (0-based) of request b attends to keys 0 .. seq_len[b] - q_len + t (inclusive), or to its first
    min(row_kv_lens[b, t], seq_len[b]) keys when ``row_kv_lens`` is given. A row that sees no key (seq_len <
    q_len, e.g. a padded request) gets out = 0 and lse = -inf.
    """
    device = q_nope.device
    num_tokens, num_heads, _ = q_nope.shape
    batch = block_table.shape[0]
    assert num_tokens == batch * q_len
    block_size = kv_cache.shape[1]
    qs = _as_f32_scale(q_scale, device)
    ks = _as_f32_scale(kv_scale, device)
    q = torch.cat([q_nope.float(), q_pe.float()], dim=-1) * qs  # [T, H, 576]
    out = torch.zeros(num_tokens, num_heads, KV_LORA_RANK, dtype=torch.float32, device=device)
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float32, device=device)
    seq_lens_host = seq_lens.tolist()
    row_lens_host = row_kv_lens.tolist() if row_kv_lens is not None else None
    for b in range(batch):
        seq_len = int(seq_lens_host[b])
        if seq_len <= 0:
            continue
        n_pages = (seq_len + block_size - 1) // block_size
        pages = block_table[b, :n_pages].long()
        kv = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len].float() * ks  # [S, 576]
        qb = q[b * q_len : (b + 1) * q_len]  # [q_len, H, 576]
        scores = torch.einsum("thd,sd->ths", qb, kv) * softmax_scale  # [q_len, H, S]
        key_pos = torch.arange(seq_len, device=device)
        if row_lens_host is None:
            visible = seq_len - q_len + torch.arange(q_len, device=device) + 1  # keys each row may see
        else:
            visible = torch.tensor(row_lens_host[b], device=device).clamp(max=seq_len)
        mask = key_pos[None, :] < visible[:, None]  # [q_len, S]
        scores = scores.masked_fill(~mask[:, None, :], -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [q_len, H]
        has_keys = (visible > 0)[:, None].expand_as(row_lse)
        probs = torch.where(has_keys[..., None], torch.exp(scores - row_lse[..., None]), 0.0)
        out[b * q_len : (b + 1) * q_len] = torch.einsum("ths,sd->thd", probs, kv[:, :KV_LORA_RANK])
        lse[b * q_len : (b + 1) * q_len] = torch.where(has_keys, row_lse, -math.inf)
    return out, lse
