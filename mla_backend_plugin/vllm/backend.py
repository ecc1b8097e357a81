"""The CUTE_MLA attention backend for vLLM: decode through ``mla_backend_plugin.ops.mla_decode``.

Prefill (``forward_mha``) stays with vLLM's MLA common implementation; this backend only replaces the
decode path (``forward_mqa``), where the latent KV cache is read once per step for all heads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config

from mla_backend_plugin import BACKEND_NAME
from mla_backend_plugin.ops import MLAWorkspace, mla_decode
from mla_backend_plugin.ops.constants import (
    FP8_DTYPE,
    KV_LORA_RANK,
    MAX_Q_LEN,
    OUT_DTYPES,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_NUM_HEADS,
    dtype_names,
)
from mla_backend_plugin.vllm import compat  # every vLLM class this module builds on, version-resolved

# The decode kernel the impl asks mla_decode for ("auto" = best verified kernel for the GPU).
KERNEL_ENV_VAR = "CUTE_MLA_KERNEL"
# Let vLLM quantise q to fp8 when the KV cache is fp8 (as FlashMLA's fp8 path does). Off by default: the
# current kernels widen fp8 to bf16 before the matrix products, so an fp8 q only costs accuracy.
FP8_QUERY_ENV_VAR = "CUTE_MLA_FP8_QUERY"

MIN_COMPUTE_CAPABILITY = (9, 0)


@dataclasses.dataclass
class CuteMLADecodeMetadata(compat.MLACommonDecodeMetadata):
    workspace: MLAWorkspace | None = None


@dataclasses.dataclass
class CuteMLAMetadata(compat.MLACommonMetadata[CuteMLADecodeMetadata]):
    pass


def _max_decode_q_len(vllm_config: VllmConfig) -> int:
    spec = vllm_config.speculative_config
    num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
    q_len = 1 + num_spec
    if q_len > MAX_Q_LEN:
        raise ValueError(
            f"{BACKEND_NAME}: num_speculative_tokens={num_spec} gives {q_len} query tokens per decode step; "
            f"{BACKEND_NAME} supports at most {MAX_Q_LEN} (num_speculative_tokens <= {MAX_Q_LEN - 1})")
    return q_len


class CuteMLAMetadataBuilder(compat.MLACommonMetadataBuilder[CuteMLAMetadata]):
    # Every request of a decode batch has the same q_len (1 + speculative tokens), so one graph per batch
    # size serves all replays: the kernels read seq_lens and block tables on the device.
    _cudagraph_support: ClassVar[compat.AttentionCGSupport] = compat.AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[compat.QueryLenSupport] = compat.QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, CuteMLAMetadata)
        if self.dcp_world_size > 1:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support decode context parallelism yet "
                f"(decode_context_parallel_size={self.dcp_world_size}); use 1")
        num_heads = self.num_heads
        if num_heads not in SUPPORTED_NUM_HEADS:
            raise ValueError(f"{BACKEND_NAME}: {num_heads} attention heads per rank is not supported; "
                             f"allowed: {SUPPORTED_NUM_HEADS}")
        # Allocated once, before warm-up and CUDA-graph capture: split-KV partials and the outputs that
        # forward_mqa returns views of.
        self.workspace = MLAWorkspace(
            device,
            max_batch=vllm_config.scheduler_config.max_num_seqs,
            max_q_len=_max_decode_q_len(vllm_config),
            num_heads=num_heads,
            out_dtype=vllm_config.model_config.dtype,
        )

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      **kwargs) -> CuteMLADecodeMetadata:
        # vLLM passes keywords only; 0.32 added max_query_len (unused: q_len is derived from the shapes).
        return CuteMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=kwargs.get("dcp_tot_seq_lens_device"),
            workspace=self.workspace,
        )


class CuteMLAImpl(compat.MLACommonImpl[CuteMLAMetadata]):
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True  # mla_decode returns natural-log LSE

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError(f"{BACKEND_NAME} does not support alibi_slopes, sliding_window or "
                                      "logits_soft_cap")
        if attn_type != compat.AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} supports decoder self-attention only, got {attn_type}")
        if num_heads not in SUPPORTED_NUM_HEADS:
            raise ValueError(f"{BACKEND_NAME}: {num_heads} attention heads per rank is not supported; "
                             f"allowed: {SUPPORTED_NUM_HEADS}")
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
            raise ValueError(f"{BACKEND_NAME} needs kv_lora_rank={KV_LORA_RANK} and "
                             f"qk_rope_head_dim={QK_ROPE_HEAD_DIM} (DeepSeek-V2/V3/R1), got "
                             f"{self.kv_lora_rank} and {self.qk_rope_head_dim}")
        self.is_fp8_kv_cache = kv_cache_dtype.startswith("fp8")
        self.supports_quant_query_input = os.environ.get(FP8_QUERY_ENV_VAR, "0") == "1"
        self.kernel = os.environ.get(KERNEL_ENV_VAR, "auto") or "auto"
        self.out_dtype = get_current_vllm_config().model_config.dtype

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: CuteMLAMetadata, layer):
        decode = attn_metadata.decode
        assert decode is not None and decode.workspace is not None
        q_is_fp8 = isinstance(q, torch.Tensor) and q.dtype == FP8_DTYPE
        num_tokens = (q[0] if isinstance(q, (tuple, list)) else q).shape[0]
        out, lse = decode.workspace.output_views(num_tokens)
        mla_decode(
            q, kv_c_and_k_pe_cache, decode.block_table, decode.seq_lens,
            softmax_scale=self.scale,
            # vLLM's scales are dequantisation scales (real = stored * scale), as mla_decode defines them.
            q_scale=layer._q_scale if q_is_fp8 else None,
            kv_scale=layer._k_scale if self.is_fp8_kv_cache else None,
            out=out, lse=lse, workspace=decode.workspace, kernel=self.kernel,
        )
        return out, lse


def _reason_details(kw: dict) -> dict[str, str]:
    """vLLM's generic validation reasons, rewritten to name the value and what CUTE_MLA allows."""
    cc = kw.get("device_capability")
    cc_str = f"{cc.major}.{cc.minor}" if cc is not None else "unknown"
    return {
        "head_size not supported": (
            f"head_size {kw.get('head_size')} not supported: {BACKEND_NAME} needs DeepSeek MLA dims "
            f"(kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim {QK_ROPE_HEAD_DIM} = {QK_HEAD_DIM})"),
        "dtype not supported": (
            f"dtype {kw.get('dtype')} not supported; allowed: {dtype_names(OUT_DTYPES)}"),
        "kv_cache_dtype not supported": (
            f"kv_cache_dtype {kw.get('kv_cache_dtype')!r} not supported; allowed: "
            f"{', '.join(CuteMLABackend.supported_kv_cache_dtypes)}"),
        "block_size not supported": (
            f"block_size {kw.get('block_size')} not supported; allowed: multiples of "
            f"{min(SUPPORTED_BLOCK_SIZES)} (kernel block sizes {SUPPORTED_BLOCK_SIZES})"),
        "compute capability not supported": (
            f"compute capability {cc_str} not supported; {BACKEND_NAME} needs >= "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (Hopper, Blackwell)"),
        "sparse not supported": f"sparse MLA (DeepSeek-V3.2 indexer) is not supported by {BACKEND_NAME}",
    }


class CuteMLABackend(compat.MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[CuteMLAMetadataBuilder]:
        return CuteMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[CuteMLAImpl]:
        return CuteMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [QK_HEAD_DIM]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # The kernels address pages through the block stride, so a cross-layer allocation (layers
        # innermost of the block dim) works as well as per-layer tensors.
        if include_num_layers_dimension:
            return (1, 0, 2, 3)
        return (0, 1, 2)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= MIN_COMPUTE_CAPABILITY

    @classmethod
    def validate_configuration(cls, **kwargs) -> list[str]:
        reasons = super().validate_configuration(**kwargs)
        details = _reason_details(kwargs)
        reasons = [details.get(r, r) for r in reasons]
        version_reason = compat.check_vllm_version()
        return reasons + [version_reason] if version_reason else reasons
