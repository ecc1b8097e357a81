"""The vLLM 0.26 .. 0.33 differences the backend depends on, in one place.

* ``MLACommon*`` live in ``vllm.model_executor.layers.attention.mla_attention`` throughout 0.26 .. 0.33 (0.33
  split ``MLACommonImpl`` over a new ``MLACommonBaseImpl`` there; the backend extends ``MLACommonImpl`` as before).
* 0.33 calls ``MLAAttentionImpl.reserve_workspace()`` in its memory-profiling run, before it sizes the KV cache:
  the impl reserves the decode workspace there and the builder takes it (earlier releases never call it, and the
  builder allocates it). 0.33 also refuses decode context parallelism for an impl without ``supports_dcp``.
* 0.33 replaced ``AttentionBackend.get_kv_cache_stride_order`` with ``supported_kv_cache_layouts`` (None: any
  layout). The backend keeps the former for 0.26 .. 0.32 and declares no layout: each layer's cache still reaches
  ``forward_mqa`` as ``[blocks, block_size, 576]`` (``MLAAttention.bind_kv_cache`` drops the head dim of 1), and
  the kernels address pages through the block stride, so a cross-layer allocation works in every layout.
* ``MLACommonMetadataBuilder._build_decode`` gained ``max_query_len`` in 0.32; vLLM calls it with keywords
  only, so the override takes ``**kwargs`` and reads what it needs (``max_seq_len``, ``dcp_tot_seq_lens_device``).
* ``AttentionBackend.get_supported_kernel_block_sizes`` gained an optional ``kv_cache_spec`` in 0.32.
* ``AttentionBackend.validate_configuration`` grows keyword arguments over releases (``use_dcp``, ...).
* ``AttentionBackendEnum`` is closed in 0.26 .. 0.31; 0.32 added ``register`` for named out-of-tree backends.
* Decode context parallelism is the same contract throughout 0.26 .. 0.33: ``MLACommonMetadataBuilder`` takes
  ``supports_dcp_with_varlen``, ``_build_decode`` gets ``dcp_tot_seq_lens_device`` and ``num_decode_tokens``,
  seq_lens are the rank's local lengths, vLLM gathers q over the DCP group's heads and merges the ranks' outputs
  with the impl's LSE (0.32 moved the collectives into ``MLADCPManager``).
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

VLLM_VERSION = Version(version("vllm"))
MIN_VLLM = Version("0.26.0")
MAX_VLLM_EXCLUSIVE = Version("0.34.0")

# Where each vLLM class the backend builds on lives (0.26 .. 0.33 keep the MLA common classes in
# mla_attention; older trees had vllm.v1.attention.backends.mla.common). Imported on first use, so that the
# plugin's registration, which runs in every vLLM process, imports only vLLM's registry modules.
_CLASSES = {
    **{name: "vllm.model_executor.layers.attention.mla_attention" for name in (
        "MLACommonBackend", "MLACommonDecodeMetadata", "MLACommonImpl", "MLACommonMetadata",
        "MLACommonMetadataBuilder", "QueryLenSupport")},
    "AttentionCGSupport": "vllm.v1.attention.backend",
    "AttentionType": "vllm.v1.attention.backend",
}


def __getattr__(name: str):
    if name in _CLASSES:
        import importlib

        value = getattr(importlib.import_module(_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_vllm_version() -> str | None:
    """None when this vLLM is one we support, else the reason."""
    if not MIN_VLLM <= VLLM_VERSION < MAX_VLLM_EXCLUSIVE:
        return f"vLLM {VLLM_VERSION} is not supported; CUTE_MLA supports vLLM >= {MIN_VLLM}, < {MAX_VLLM_EXCLUSIVE}"
    return None


def dcp_tot_seq_lens(build_decode_kwargs: dict):
    """The total (all-rank) lengths ``_build_decode`` receives under decode context parallelism, if any."""
    return build_decode_kwargs.get("dcp_tot_seq_lens_device")


def decode_max_seq_len(build_decode_kwargs: dict) -> int | None:
    """The step's longest KV length (a host int) ``_build_decode`` receives (0.26 .. 0.33)."""
    value = build_decode_kwargs.get("max_seq_len")
    return int(value) if value is not None else None


def full_decode_graphs(vllm_config) -> bool:
    """Whether decode steps replay full CUDA graphs (one per batch size; ``cudagraph_mode`` FULL for decode)."""
    if vllm_config.model_config.enforce_eager:
        return False
    decode_mode = getattr(vllm_config.compilation_config.cudagraph_mode, "decode_mode", None)
    return decode_mode is not None and decode_mode().name == "FULL"


def decode_query_lens(build_decode_kwargs: dict):
    """Each decode request's new tokens (a numpy array), from the host copy of query_start_loc ``_build_decode``
    receives (no device sync; full-graph padding requests have 0)."""
    starts = build_decode_kwargs["query_start_loc_cpu"].numpy()
    return starts[1:] - starts[:-1]


def decode_query_start_loc(build_decode_kwargs: dict):
    """The device copy of the decode requests' query_start_loc (``[num_decodes + 1]``)."""
    return build_decode_kwargs["query_start_loc_device"]


def dcp_rank() -> int:
    """This process's rank in the decode-context-parallel group (0 when the group is not initialised)."""
    from vllm.distributed.parallel_state import get_dcp_group

    try:
        return get_dcp_group().rank_in_group
    except AssertionError:  # as vLLM's own builders: DCP may not be initialised (tests)
        return 0


def configured_dcp_size() -> int:
    """decode_context_parallel_size of the config being built (the impl's own dcp_world_size is set lazily)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().parallel_config.decode_context_parallel_size


def has_named_backends(enum_cls) -> bool:
    """vLLM >= 0.32: ``AttentionBackendEnum`` takes out-of-tree members through ``register``."""
    return hasattr(enum_cls, "register")
