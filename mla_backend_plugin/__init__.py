"""CUTE_MLA: an out-of-tree MLA decode attention backend for vLLM.

Importing this package does no CUDA work and imports neither vLLM nor Triton; the kernel API lives in
``mla_backend_plugin.ops`` and the vLLM integration in ``mla_backend_plugin.vllm``.
"""

__version__ = "0.1.0"

BACKEND_NAME = "CUTE_MLA"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group.

    vLLM calls it in every process it starts (engine core, workers), so it must be cheap and idempotent.
    """
    from mla_backend_plugin.vllm.register import register_with_vllm

    register_with_vllm()
