"""The vLLM 0.26 .. 0.33 differences the backend depends on, in one place.

* ``MLACommon*`` live in ``vllm.model_executor.layers.attention.mla_attention`` throughout 0.26 .. 0.33.
* ``MLACommonMetadataBuilder._build_decode`` gained ``max_query_len`` in 0.32; vLLM calls it with keywords
  only, so the override takes ``**kwargs`` and reads what it needs.
* ``AttentionBackend.get_supported_kernel_block_sizes`` gained an optional ``kv_cache_spec`` in 0.32.
* ``AttentionBackend.validate_configuration`` grows keyword arguments over releases (``use_dcp``, ...).
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.version import Version

VLLM_VERSION = Version(version("vllm"))
MIN_VLLM = Version("0.26.0")
MAX_VLLM_EXCLUSIVE = Version("0.34.0")

# Both 0.26 and 0.32 keep the MLA common classes here (older trees had vllm.v1.attention.backends.mla.common).
from vllm.model_executor.layers.attention.mla_attention import (  # noqa: E402,F401
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType  # noqa: E402,F401


def check_vllm_version() -> str | None:
    """None when this vLLM is one we support, else the reason."""
    if not MIN_VLLM <= VLLM_VERSION < MAX_VLLM_EXCLUSIVE:
        return f"vLLM {VLLM_VERSION} is not supported; CUTE_MLA supports vLLM >= {MIN_VLLM}, < {MAX_VLLM_EXCLUSIVE}"
    return None
