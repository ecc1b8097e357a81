"""Registration of CUTE_MLA with vLLM: ``register`` is the ``vllm.general_plugins`` entry point.

What it does, once per process (vLLM calls plugins in the API process, the engine core and every worker):

1. Makes ``CUTE_MLA`` a member of ``AttentionBackendEnum``, so ``--attention-backend CUTE_MLA``,
   ``LLM(attention_backend="CUTE_MLA")`` and ``backend_per_kind`` resolve it. vLLM >= 0.32 has
   ``register_backend("NAME", path)`` for this; 0.26 .. 0.31 have a closed enum, to which the member is added
   the same way 0.32 adds it. ``CUSTOM`` is pointed at the backend too.
2. Makes the new member survive pickling into processes that have not loaded plugins yet (vLLM spawns its
   engine core with the pickled config when CUDA is already initialised): the member pickles as a call to
   :func:`backend_enum_member`, which registers first and then returns the member.
3. Honours ``VLLM_ATTENTION_BACKEND=CUTE_MLA`` (vLLM dropped the variable and only warns that it is unknown):
   the variable is declared to vLLM, so the warning goes away, and MLA layers for which no backend was
   chosen explicitly (``--attention-backend`` or ``backend_per_kind``) get the named backend.
"""

from __future__ import annotations

import logging
import os

from mla_backend_plugin import BACKEND_NAME

logger = logging.getLogger(__name__)

BACKEND_CLASS_PATH = "mla_backend_plugin.vllm.backend.CuteMLABackend"
ENV_BACKEND_VAR = "VLLM_ATTENTION_BACKEND"

_registered = False


def backend_enum_member(name: str = BACKEND_NAME):
    """Unpickling hook: the enum member named ``name``, registering the plugin first if needed."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _add_enum_member(enum_cls, name: str, value: str):
    """Add a member to a closed Enum the way vLLM 0.32's ``AttentionBackendEnum.register`` does."""
    if name in enum_cls._member_map_:
        return enum_cls._member_map_[name]
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    setattr(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _ensure_member(enum_cls, registry_module):
    if BACKEND_NAME in enum_cls._member_map_:
        member = enum_cls._member_map_[BACKEND_NAME]
        registry_module.register_backend(member, BACKEND_CLASS_PATH)
        return member
    from mla_backend_plugin.vllm.compat import has_named_backends

    if has_named_backends(enum_cls):
        registry_module.register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
        return enum_cls[BACKEND_NAME]
    return _add_enum_member(enum_cls, BACKEND_NAME, BACKEND_CLASS_PATH)


def _install_pickle_hook(enum_cls) -> None:
    original = enum_cls.__reduce_ex__
    if getattr(original, "_cute_mla_hook", False):
        return

    def __reduce_ex__(self, protocol):
        if self._name_ == BACKEND_NAME:
            return backend_enum_member, (BACKEND_NAME,)
        return original(self, protocol)

    __reduce_ex__._cute_mla_hook = True
    enum_cls.__reduce_ex__ = __reduce_ex__


def env_selected_backend():
    """The backend named by ``VLLM_ATTENTION_BACKEND``, or None when unset or "auto"."""
    value = os.environ.get(ENV_BACKEND_VAR, "").strip()
    if not value or value.lower() == "auto":
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[value.upper()]  # vLLM's error lists the valid names


def _honour_env_backend(selector_module) -> None:
    """Wrap vLLM's cached backend lookup so MLA layers with no explicit choice follow the env variable.

    ``get_attn_backend`` resolves ``--attention-backend`` and ``backend_per_kind`` into ``backend`` before it
    calls ``_cached_get_attn_backend``; ``backend is None`` therefore means nobody chose explicitly.
    """
    cached = selector_module._cached_get_attn_backend
    if getattr(cached, "_cute_mla_hook", False):
        return

    def _cached_get_attn_backend(backend, attn_selector_config, *args, **kwargs):
        if backend is None and attn_selector_config.use_mla and not attn_selector_config.use_sparse:
            backend = env_selected_backend()
        return cached(backend, attn_selector_config, *args, **kwargs)

    _cached_get_attn_backend._cute_mla_hook = True
    _cached_get_attn_backend.cache_clear = getattr(cached, "cache_clear", lambda: None)
    _cached_get_attn_backend.__wrapped__ = cached
    selector_module._cached_get_attn_backend = _cached_get_attn_backend


def _declare_env_var() -> None:
    import vllm.envs as envs

    if ENV_BACKEND_VAR not in envs.environment_variables:
        envs.environment_variables[ENV_BACKEND_VAR] = lambda: os.getenv(ENV_BACKEND_VAR)


class _ToVllmLogger(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger when that logger is enabled for its level, so it is written by
    whatever handlers, format and level vLLM configures, whenever it configures them (0.26 at import, 0.32 when
    the engine starts)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def _log_through_vllm() -> None:
    """The package logs under ``mla_backend_plugin`` (engine-neutral); vLLM configures only its own ``vllm``
    logger, so without this our INFO lines (kernel choice, tuned shapes, compile times) would never reach a vLLM
    user's log."""
    ours = logging.getLogger("mla_backend_plugin")
    if any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmLogger())
    ours.setLevel(logging.DEBUG)  # vLLM's logger decides (the handler checks its level)
    ours.propagate = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. vLLM calls it in every process it starts (API server,
    engine core, workers), so it is cheap and idempotent: it imports only vLLM's registry modules (no CUDA work,
    no kernel imports)."""
    global _registered
    if _registered:
        return
    from vllm.v1.attention import selector as selector_module
    from vllm.v1.attention.backends import registry as registry_module

    enum_cls = registry_module.AttentionBackendEnum
    _ensure_member(enum_cls, registry_module)
    registry_module.register_backend(enum_cls.CUSTOM, BACKEND_CLASS_PATH)
    _install_pickle_hook(enum_cls)
    _declare_env_var()
    _honour_env_backend(selector_module)
    _log_through_vllm()
    from mla_backend_plugin import envs

    if envs.CUTE_MLA_STEP_TRACE:  # diagnostics, any backend: the model steps' timeline (vllm/step_trace.py)
        from mla_backend_plugin.vllm import step_trace

        step_trace.install(envs.CUTE_MLA_STEP_TRACE)
    _registered = True
    logger.debug("registered %s -> %s", BACKEND_NAME, BACKEND_CLASS_PATH)
