"""The SGLang side of the plugin: ``--attention-backend cute_mla`` (and ``--decode-attention-backend cute_mla``).

``register`` is the ``sglang.srt.plugins`` entry point; SGLang calls it in the launcher, the engine and every
scheduler process (``SGLANG_PLUGINS`` may whitelist it). Importing this module imports neither SGLang nor torch.
"""

from mla_backend_plugin.sglang.plugin import (
    SGLANG_BACKEND_NAME,
    SUPPORTED_SGLANG_VERSIONS,
    check_sglang_version,
    register,
)

__all__ = ["SGLANG_BACKEND_NAME", "SUPPORTED_SGLANG_VERSIONS", "check_sglang_version", "register"]
