"""CUTE_MLA: an out-of-tree MLA decode attention backend for vLLM and SGLang.

Importing this package does no CUDA work and imports neither vLLM, SGLang nor Triton. The kernel API lives in
``mla_backend_plugin.ops``; the integrations in ``mla_backend_plugin.vllm`` and ``mla_backend_plugin.sglang``,
each entered through its ``register.py`` (the ``vllm.general_plugins`` and ``sglang.srt.plugins`` entry points).
"""

__version__ = "0.1.0"

BACKEND_NAME = "CUTE_MLA"
