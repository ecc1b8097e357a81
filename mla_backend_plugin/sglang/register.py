"""Registration of ``cute_mla`` with SGLang: ``register`` is the ``sglang.srt.plugins`` entry point.

Once per process it (1) adds ``cute_mla`` to SGLang's attention-backend choices, which feed
``--attention-backend``, ``--prefill-attention-backend`` and ``--decode-attention-backend`` (the launcher loads
plugins before it parses arguments), and (2) registers the backend factory that SGLang's model runner calls
as ``factory(model_runner)``. The name is ours: SGLang's own ``cutedsl_mla`` is a different backend (FlashInfer's
CuTe-DSL MLA decode on Blackwell, with decode context parallelism).

SGLang catches and logs a plugin's exceptions, so an unsupported SGLang would only leave a log line and an
"invalid choice" from argparse. Instead the name is registered whenever SGLang's hooks exist, and the factory
refuses an unsupported version naming it and the supported range (compat.py).
"""

from __future__ import annotations

import logging

from mla_backend_plugin.sglang.compat import (
    SGLANG_BACKEND_NAME,
    check_sglang_version,
    installed_sglang_version,
    supported_range,
)

logger = logging.getLogger("mla_backend_plugin")

_registered = False


def create_backend(model_runner):
    """The factory SGLang calls (``ATTENTION_BACKENDS['cute_mla'](model_runner)``) when it builds the attention
    backend of a model runner (target, and draft with ``--speculative-draft-attention-backend cute_mla``)."""
    check_sglang_version()
    _register_deepseek_dispatch()
    from mla_backend_plugin.sglang.backend import CuteMLAAttnBackend

    return CuteMLAAttnBackend(model_runner)


def _register_deepseek_dispatch() -> None:
    """DeepSeek models pick their attention path (MHA prefill, absorbed MLA) by the backend's name. Ours takes
    Triton's rule, since our extend path is SGLang's Triton backend: MHA for a prefill without cached prefix,
    absorbed MLA (a concatenated q of 576 per head) for decode, verify and extend onto a cached prefix. Unknown
    names fall back to that rule today; registering it keeps it if the fallback changes. Imported here, not in
    ``register``, because the model modules are heavy and only the model runner needs them."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        handle_attention_triton,
    )

    AttentionBackendRegistry.register(SGLANG_BACKEND_NAME, handle_attention_triton)


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: cheap and idempotent."""
    global _registered
    if _registered:
        return
    version = installed_sglang_version()
    try:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    except ImportError as e:
        raise RuntimeError(f"{SGLANG_BACKEND_NAME}: SGLang {version} lacks the attention-backend registry this "
                           f"plugin uses ({e}); supported: {supported_range()}") from e
    if SGLANG_BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([SGLANG_BACKEND_NAME])
    if ATTENTION_BACKENDS.get(SGLANG_BACKEND_NAME) is not create_backend:
        register_attention_backend(SGLANG_BACKEND_NAME)(create_backend)
    _registered = True
    try:
        check_sglang_version(version)
    except RuntimeError as e:  # registered anyway, so that choosing the backend gives this message
        logger.warning("%s", e)
