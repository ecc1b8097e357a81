"""The SGLang versions the plugin supports and their differences, in one place.

* 0.5.14 introduced the ``init_forward_metadata_out_graph`` / ``init_forward_metadata_in_graph`` hooks the backend
  implements (0.5.23 keeps them: the out_graph hook runs before capture and before each replay, the in_graph hook
  is recorded into the graph), the attention-backend registry and ``add_attention_backend_choices``.
* 0.5.18 moved to torch 2.13 (0.5.23: torch 2.14.1, FlashInfer 0.7.2); 0.5.14 .. 0.5.17 run on torch 2.11.
* The CUDA-graph switch is ``cuda_graph_config`` (``check_cuda_graph_backend``) where it exists, the legacy
  ``--disable-cuda-graph`` flag otherwise.

Importing this module imports neither SGLang nor torch (the plugin's registration runs in every SGLang process).
"""

from __future__ import annotations

import importlib.metadata

SGLANG_BACKEND_NAME = "cute_mla"
# inclusive: the releases this plugin registers with; tested: 0.5.17 (CPU and GPU), 0.5.23 (CPU)
SUPPORTED_SGLANG_VERSIONS = ("0.5.14", "0.5.23")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers a version leads to (0.5.17rc1, 0.5.17.post1 -> (0, 5, 17))."""
    from packaging.version import Version

    return Version(version).release[:3]


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported_range() -> str:
    low, high = SUPPORTED_SGLANG_VERSIONS
    return f"sglang {low} .. {high}"


def check_sglang_version(version: str | None = None) -> None:
    """Raise a RuntimeError naming the installed SGLang and the supported range unless it is supported."""
    version = installed_sglang_version() if version is None else version
    low, high = SUPPORTED_SGLANG_VERSIONS
    if version is None:
        raise RuntimeError(f"{SGLANG_BACKEND_NAME}: SGLang is not installed; supported: {supported_range()}")
    if not _release(low) <= _release(version) <= _release(high):
        raise RuntimeError(f"{SGLANG_BACKEND_NAME}: SGLang {version} is not supported; supported: "
                           f"{supported_range()} (pip install 'sglang=={high}')")


def decode_cuda_graphs_enabled(server_args) -> bool:
    """Whether decode steps replay CUDA graphs."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    except ImportError:  # a layout without cuda_graph_config: the legacy flag says it
        return not getattr(server_args, "disable_cuda_graph", False)
    return not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
