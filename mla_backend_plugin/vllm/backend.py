"""The CUTE_MLA attention backend for vLLM: decode through ``mla_backend_plugin.ops.mla_decode``.

Prefill (``forward_mha``) stays with vLLM's MLA common implementation; this backend only replaces the
decode path (``forward_mqa``), where the latent KV cache is read once per step for all heads. What is not
vLLM's contract (sizing, refusals, the decode call) lives in ``ops/serving.py``, shared with SGLang.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config

from mla_backend_plugin import BACKEND_NAME, envs
from mla_backend_plugin.ops import DcpLayout, serving
from mla_backend_plugin.ops.constants import MAX_Q_LEN, PREFERRED_BLOCK_SIZE, QK_HEAD_DIM, SUPPORTED_BLOCK_SIZES
from mla_backend_plugin.ops.workspace import MLAWorkspace
from mla_backend_plugin.testing.reference_check import engine_check
from mla_backend_plugin.vllm import compat  # every vLLM class this module builds on, version-resolved


@dataclasses.dataclass
class CuteMLADecodeMetadata(compat.MLACommonDecodeMetadata):
    workspace: MLAWorkspace | None = None
    max_seq_len: int | None = None  # host-known longest length of the step (the tuned choice's bucket, eager)
    # decode context parallelism with q_len > 1: [B, q_len] keys of this rank's shard each query row sees (a
    # view of the builder's persistent buffer); None otherwise (seq_lens alone gives every row's limit)
    row_kv_lens: torch.Tensor | None = None
    # with row_kv_lens: the layout they come from (world, rank, interleave, the global lengths in the builder's
    # persistent buffer), for a kernel that applies the DCP rule itself (FlashInfer's cute-dsl DCP mode)
    dcp: DcpLayout | None = None
    # a batch of mixed q_lens or of q_len > MAX_Q_LEN (short prefills after a prefix-cache hit, drafts of mixed
    # counts), recast as requests of a few consecutive query tokens each (serving.token_requests): what decode
    # launches; block_table and seq_lens stay the step's own
    token_requests: serving.TokenRequests | None = None
    # what this step has planned on the device (one per step: every layer's split kernel reads the step's plan)
    step: serving.StepPlans = dataclasses.field(default_factory=serving.StepPlans)


@dataclasses.dataclass
class CuteMLAMetadata(compat.MLACommonMetadata[CuteMLADecodeMetadata]):
    pass


class CuteMLAMetadataBuilder(compat.MLACommonMetadataBuilder[CuteMLAMetadata]):
    # Full CUDA graphs serve uniform decode batches (q_len 1 + speculative tokens), one graph per batch size: the
    # kernels read seq_lens and block tables on the device. Decode also takes requests of other q_lens (VARLEN)
    # up to reorder_batch_threshold: vLLM runs those steps eagerly, and the builder recasts them as token requests
    # (serving.token_requests: 64 / heads consecutive tokens of one request each), so the tail of a prefix-cache
    # hit or a step of mixed draft counts never takes vLLM's prefill path, which up-projects the whole context.
    _cudagraph_support: ClassVar[compat.AttentionCGSupport] = compat.AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[compat.QueryLenSupport] = compat.QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device: torch.device):
        # Decode context parallelism (DCP): vLLM hands decode this rank's local lengths (seq_lens) and the
        # global ones (dcp_tot_seq_lens). Declaring supports_dcp_with_varlen keeps q_len > 1 (MTP) requests on
        # the decode path under DCP (else vLLM sets reorder_batch_threshold to 1 and verifies drafts through
        # the prefill path); each query row then gets its causal limit in this rank's local positions
        # (row_kv_lens, any interleave size).
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, CuteMLAMetadata,
                         supports_dcp_with_varlen=True)
        num_spec = num_speculative_tokens(vllm_config)
        max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        # vLLM set the threshold to the speculative q_len (or 1 under DCP without varlen support)
        self.reorder_batch_threshold = max(self.reorder_batch_threshold or 1,
                                           serving.decode_query_len_threshold(num_spec, self.dcp_world_size))
        if self.dcp_world_size > 1:
            self.query_len_support = compat.QueryLenSupport.UNIFORM  # token requests are not built for DCP
        # Before warm-up and CUDA-graph capture: split-KV partials and the outputs that forward_mqa returns views
        # of. Under DCP, q holds the heads of the whole DCP group (gathered by vLLM). With short prefills on the
        # decode path it also serves their slices of token requests. The layers' impls reserved it when the model
        # was built (CuteMLAImpl.reserve_workspace), so the KV cache was sized around it.
        self.workspace = engine_workspace(
            vllm_config, device, serving.check_num_heads(self.num_heads, self.dcp_world_size),
            token_requests=self.reorder_batch_threshold > serving.max_decode_q_len(num_spec))
        # The autotuner's warm-up (ops/serving.py): the decode shapes this engine runs, prepared (and with
        # CUTE_MLA_AUTOTUNE=1 tuned) on the first build outside capture (_build_decode), before any decode call:
        # vLLM builds the metadata of its eager warm-up runs before capturing graphs.
        # With full decode graphs the choice must not follow the step's lengths: vLLM's eager warm-up of each
        # graph size then compiles exactly what the capture runs.
        self.tuning = serving.DeploymentTuning(deployment_for(vllm_config, self.workspace.num_heads,
                                                              kv_cache_spec.block_size),
                                               host_lengths=not compat.full_decode_graphs(vllm_config))
        self.dcp_rank = compat.dcp_rank() if self.dcp_world_size > 1 else 0
        max_q_len = serving.max_decode_q_len(num_spec)
        # the per-row limits and the global lengths (DcpLayout) a CUDA graph reads: refreshed in place by every build
        with_rows = self.dcp_world_size > 1 and max_q_len > 1
        self.row_kv_lens_buffer = (torch.zeros(max_num_seqs * max_q_len, dtype=torch.int32, device=device)
                                   if with_rows else None)
        self.global_seq_lens_buffer = (torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
                                       if with_rows else None)

    def build_for_cudagraph_capture(self, common_attn_metadata) -> CuteMLAMetadata:
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if metadata.decode is not None and metadata.decode.token_requests is not None:
            # token requests are tensors made per step: a graph would replay stale ones
            raise RuntimeError(f"{BACKEND_NAME}: a full CUDA graph of a decode batch of mixed q_lens (or q_len > "
                               f"{MAX_Q_LEN}) was requested; full graphs serve uniform decode batches only")
        return metadata

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      **kwargs) -> CuteMLADecodeMetadata:
        self.tuning.run_once(self.workspace.device, self.workspace)  # acts once
        dcp_tot_seq_lens = compat.dcp_tot_seq_lens(kwargs)
        if self.dcp_world_size == 1:
            num_tokens = kwargs["num_decode_tokens"]
            query_lens = compat.decode_query_lens(kwargs)
            q_len = serving.uniform_query_len(query_lens, num_tokens)
            # a uniform q_len past the workspace's (1 + speculative tokens, or the token requests' q_len), e.g. a
            # step of 3-token prefix-cache tails without speculation, is recast too: vLLM runs such a step eagerly
            if q_len is None or q_len > self.workspace.max_q_len:
                max_seq_len = compat.decode_max_seq_len(kwargs)
                # page_size: vLLM hands builders the kernel block size (the block table's unit)
                token_requests = serving.token_requests(
                    compat.decode_query_start_loc(kwargs), query_lens, seq_lens_device, block_table_tensor,
                    num_tokens, q_len=serving.token_request_q_len(self.workspace.num_heads),
                    max_seq_len=max_seq_len, block_size=self.page_size)
                return CuteMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                             dcp_tot_seq_lens=None, workspace=self.workspace,
                                             max_seq_len=self.tuning.choice_seq_len(max_seq_len),
                                             token_requests=token_requests)
        row_kv_lens, dcp = self._row_kv_lens(dcp_tot_seq_lens, seq_lens_device.shape[0], kwargs)
        return CuteMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                     dcp_tot_seq_lens=dcp_tot_seq_lens, workspace=self.workspace,
                                     max_seq_len=self.tuning.choice_seq_len(compat.decode_max_seq_len(kwargs)),
                                     row_kv_lens=row_kv_lens, dcp=dcp)

    def _row_kv_lens(self, dcp_tot_seq_lens: torch.Tensor | None, num_decodes: int,
                     build_decode_kwargs: dict) -> tuple[torch.Tensor | None, DcpLayout | None]:
        """Under DCP with q_len > 1: the keys of this rank's shard each query row sees, computed from the global
        lengths into the persistent buffer (device ops, no host sync), and the layout they come from, its global
        lengths copied into a persistent buffer too. (None, None) when seq_lens says it all."""
        if self.row_kv_lens_buffer is None or num_decodes == 0:
            return None, None
        num_tokens = build_decode_kwargs["num_decode_tokens"]
        q_len = serving.uniform_query_len(compat.decode_query_lens(build_decode_kwargs), num_tokens)
        if q_len is None:  # vLLM keeps DCP decode batches uniform (UNIFORM, as declared under DCP)
            raise RuntimeError(f"decode batch of {num_decodes} requests has {num_tokens} tokens: q_len is not "
                               f"uniform")
        if q_len == 1:
            return None, None  # one row: it sees every local key
        if dcp_tot_seq_lens is None or num_decodes * q_len > self.row_kv_lens_buffer.numel():
            raise RuntimeError(f"{BACKEND_NAME}: decode batch of {num_decodes} requests x q_len {q_len} under "
                               f"decode context parallelism does not fit the builder's per-row buffer "
                               f"({self.row_kv_lens_buffer.numel()} rows) or has no global lengths")
        out = self.row_kv_lens_buffer[:num_decodes * q_len].view(num_decodes, q_len)
        global_lens = self.global_seq_lens_buffer[:num_decodes]
        global_lens.copy_(dcp_tot_seq_lens[:num_decodes])
        rows = serving.dcp_row_kv_lens(global_lens, q_len, self.dcp_world_size, self.dcp_rank,
                                       self.cp_kv_cache_interleave_size, out=out)
        return rows, DcpLayout(self.dcp_world_size, self.dcp_rank, self.cp_kv_cache_interleave_size, global_lens)


def num_speculative_tokens(vllm_config: VllmConfig) -> int:
    spec = vllm_config.speculative_config
    return spec.num_speculative_tokens if spec is not None else 0


# The decode workspaces the layers' impls reserved when the model was built (and vLLM >= 0.33's profiling run
# reserves again, finding them), by what sizes them; the builder takes the one of its sizes.
_reserved_workspaces: dict[tuple, MLAWorkspace] = {}


def _workspace_key(vllm_config: VllmConfig, device, num_heads: int, token_requests: bool) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (device, vllm_config.scheduler_config.max_num_seqs, num_speculative_tokens(vllm_config), num_heads,
            vllm_config.model_config.dtype, token_requests)


def engine_workspace(vllm_config: VllmConfig, device, num_heads: int, token_requests: bool,
                     reserve: bool = False) -> MLAWorkspace:
    """The decode workspace of an engine (``num_heads``: the query heads of one decode call, the DCP group's under
    decode context parallelism): the one reserved for these sizes if any, else a new one, kept as the reserved one
    when ``reserve`` (vLLM's profiling run; reserving again finds it)."""
    key = _workspace_key(vllm_config, device, num_heads, token_requests)
    workspace = _reserved_workspaces.get(key)
    if workspace is None:
        num_spec = num_speculative_tokens(vllm_config)
        workspace = serving.make_workspace(
            key[0], max_num_seqs=vllm_config.scheduler_config.max_num_seqs, num_speculative_tokens=num_spec,
            num_heads=num_heads, out_dtype=vllm_config.model_config.dtype, token_requests=token_requests)
        if reserve:
            _reserved_workspaces[key] = workspace
    return workspace


def engine_fp8_query() -> bool:
    """CUTE_MLA_FP8_QUERY on this engine's GPU (serving.fp8_query)."""
    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return serving.fp8_query(envs.CUTE_MLA_FP8_QUERY, cc)


def deployment_for(vllm_config: VllmConfig, num_heads: int, block_size: int):
    """The autotuner's view of this engine: its full-CUDA-graph batch sizes (without full decode graphs: powers of
    two up to max_num_seqs), max_model_len, dtypes, speculative q_len and kernel block size."""
    capture_sizes = (vllm_config.compilation_config.cudagraph_capture_sizes
                     if compat.full_decode_graphs(vllm_config) else None)
    return serving.make_deployment(
        num_heads=num_heads, max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        num_speculative_tokens=num_speculative_tokens(vllm_config),
        model_dtype=vllm_config.model_config.dtype, kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        block_size=block_size, max_model_len=vllm_config.model_config.max_model_len, capture_sizes=capture_sizes,
        fp8_query=engine_fp8_query())


def prebuild_decode_kernels(num_heads: int) -> None:
    """At model construction (the first layer's impl; later ones find it done), with ``CUTE_MLA_PREBUILD=1``:
    start compiling the decode variants this engine will launch in background processes, so that they overlap
    the model load and torch.compile instead of delaying the first decode warm-up (ops/serving.py
    prebuild_kernels)."""
    if not envs.CUTE_MLA_PREBUILD or not torch.cuda.is_available():
        return
    vllm_config = get_current_vllm_config()
    block_size = vllm_config.cache_config.block_size
    if block_size is None:
        return
    serving.prebuild_kernels(deployment_for(vllm_config, num_heads, block_size),
                             torch.device("cuda", torch.cuda.current_device()), envs.CUTE_MLA_KERNEL)


class CuteMLAImpl(compat.MLACommonImpl[CuteMLAMetadata]):
    can_return_lse_for_decode: bool = True  # so vLLM asks for the LSE under DCP and merges the ranks with it
    lse_base_on_e: bool = True  # mla_decode returns natural-log LSE
    # row_kv_lens gives each query row its causal limit in local positions for any cp_kv_cache_interleave_size,
    # so MTP with an interleave > 1 works (vLLM refuses that combination for impls that do not declare it)
    supports_mtp_with_cp_non_trivial_interleave_size: bool = True
    supports_dcp: bool = True  # vLLM >= 0.33 refuses decode context parallelism for impls that do not declare it

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        serving.check_attention_features(alibi_slopes, sliding_window, logits_soft_cap)
        if attn_type != compat.AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} supports decoder self-attention only, got {attn_type}")
        dcp_size = compat.configured_dcp_size()
        self.total_heads = serving.check_num_heads(num_heads, dcp_size)
        serving.check_mla_dims(self.kv_lora_rank, self.qk_rope_head_dim)
        prebuild_decode_kernels(self.total_heads)
        # what reserve_workspace sizes the workspace by (the builder's sizes: its reorder threshold decides whether
        # short prefills are decoded as token requests)
        self.engine_config = get_current_vllm_config()
        num_spec = num_speculative_tokens(self.engine_config)
        self.token_requests = (serving.decode_query_len_threshold(num_spec, dcp_size)
                               > serving.max_decode_q_len(num_spec))
        # vLLM quantises q to fp8 for an fp8 cache only when the backend asks (serving.fp8_query: on Hopper by
        # default, where cute_sm90 runs it fastest; otherwise the kernels widen or split the model-dtype q)
        self.supports_quant_query_input = engine_fp8_query()
        self.runner = serving.DecodeRunner(scale, kv_cache_dtype, check=engine_check())
        # at model construction, before any memory profile: vLLM 0.26 .. 0.32 never call reserve_workspace and
        # measure the KV cache's room after loading the model, so the workspace must exist by then (else it is
        # allocated past that budget); 0.33's profiling-run call then finds it
        self.reserve_workspace()

    def reserve_workspace(self) -> None:
        """Allocate the workspace the metadata builder will take, so that the KV cache is sized around it: from
        ``__init__`` (every vLLM release) and vLLM >= 0.33's memory-profiling run (every layer; once is enough)."""
        engine_workspace(self.engine_config, self.engine_config.device_config.device, self.total_heads,
                         self.token_requests, reserve=True)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: CuteMLAMetadata, layer):
        decode = attn_metadata.decode
        assert decode is not None and decode.workspace is not None
        # vLLM's scales are dequantisation scales (real = stored * scale), as mla_decode defines them. Under
        # DCP, seq_lens are this rank's local lengths and vLLM merges the ranks' outputs with the returned LSE.
        return self.runner.decode(q, kv_c_and_k_pe_cache, decode.block_table, decode.seq_lens, decode.workspace,
                                  q_scale=layer._q_scale, kv_scale=layer._k_scale, max_seq_len=decode.max_seq_len,
                                  row_kv_lens=decode.row_kv_lens, dcp=decode.dcp,
                                  token_requests=decode.token_requests, step=decode.step)


class CuteMLABackend(compat.MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(serving.KV_CACHE_DTYPE_NAMES)

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

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int = 16, *args, **kwargs) -> int:
        """The page size vLLM gives CUTE_MLA when the user passes no ``--block-size`` (vLLM's default, 16, would be
        kept since 16 is supported): PREFERRED_BLOCK_SIZE, the page the kernels are tuned, prebuilt and
        benchmarked at (one page per 64-key tile: one TMA box and one block-table read per tile where 16-token
        pages take four). A user's ``--block-size`` of any supported size still wins."""
        return PREFERRED_BLOCK_SIZE

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # The kernels address pages through the block stride, so a cross-layer allocation (layers
        # innermost of the block dim) works as well as per-layer tensors.
        if include_num_layers_dimension:
            return (1, 0, 2, 3)
        return (0, 1, 2)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= serving.MIN_COMPUTE_CAPABILITY

    @classmethod
    def validate_configuration(cls, **kwargs) -> list[str]:
        reasons = super().validate_configuration(**kwargs)
        cc = kwargs.get("device_capability")
        details = serving.unsupported_reasons(
            head_size=kwargs.get("head_size"), dtype=kwargs.get("dtype"), kv_cache_dtype=kwargs.get("kv_cache_dtype"),
            block_size=kwargs.get("block_size"), compute_capability=(cc.major, cc.minor) if cc is not None else None)
        reasons = [details.get(r, r) for r in reasons]
        version_reason = compat.check_vllm_version()
        return reasons + [version_reason] if version_reason else reasons
