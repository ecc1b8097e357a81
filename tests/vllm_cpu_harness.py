"""Scenarios that exercise the vLLM integration on a machine without a GPU, one per fresh process.

Run as ``python tests/vllm_cpu_harness.py SCENARIO``; exits 0 and prints ``PASS SCENARIO`` when every check
holds. tests/test_vllm_plugin.py runs each scenario in a subprocess because vLLM's platform and plugin state
are process-global. A fake Hopper platform (vLLM's real CudaPlatform with the device capability pinned) is
installed before anything binds ``current_platform``, so vLLM's real config parsing and backend selection
run unchanged.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = os.path.join(os.path.dirname(HERE), "examples", "tiny_deepseek", "model")
OUR_CLASS = "mla_backend_plugin.vllm.backend.CuteMLABackend"


def install_fake_gpu(major: int = 9, minor: int = 0) -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class FakeCudaPlatform(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major, minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"fake sm_{major}{minor}"

    platforms.current_platform = FakeCudaPlatform()


def engine_config(*cli_args: str, **engine_kwargs):
    """A VllmConfig made the way `vllm serve` makes it (CLI) or the way LLM(...) does (kwargs)."""
    from vllm.engine.arg_utils import EngineArgs

    if cli_args:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", TINY_MODEL, "--skip-tokenizer-init", "--load-format", "dummy",
                                  "--max-model-len", "4096", *cli_args])
        engine_args = EngineArgs.from_cli_args(args)
    else:
        engine_args = EngineArgs(model=TINY_MODEL, skip_tokenizer_init=True, load_format="dummy",
                                 max_model_len=4096, **engine_kwargs)
    return engine_args.create_engine_config()


def selected_mla_backend(vllm_config, use_mla: bool = True) -> str:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    _cached_get_attn_backend.cache_clear()
    with set_current_vllm_config(vllm_config):
        head_size = 576 if use_mla else 128
        cls = get_attn_backend(head_size, torch.bfloat16, "auto", use_mla=use_mla)
    return f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------------- scenarios


def scenario_entry_point() -> None:
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value == "mla_backend_plugin:register"]
    assert len(eps) == 1, f"entry point not found: {list(entry_points(group='vllm.general_plugins'))}"
    import mla_backend_plugin  # noqa: F401

    assert "vllm" not in sys.modules and "triton" not in sys.modules, "package import must stay lazy"
    eps[0].load()()
    eps[0].load()()  # idempotent
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum["CUTE_MLA"].get_path() == OUR_CLASS
    assert AttentionBackendEnum.CUSTOM.get_path() == OUR_CLASS
    assert list(AttentionBackendEnum.__members__).count("CUTE_MLA") == 1
    assert not torch.cuda.is_initialized(), "registration must not initialise CUDA"


def scenario_cli_routes() -> None:
    install_fake_gpu()
    cfg = engine_config("--attention-backend", "CUTE_MLA")
    assert cfg.attention_config.backend.name == "CUTE_MLA"
    assert selected_mla_backend(cfg) == OUR_CLASS
    # lower case, as users type it
    assert selected_mla_backend(engine_config("--attention-backend", "cute_mla")) == OUR_CLASS
    assert selected_mla_backend(engine_config("--attention-backend", "CUSTOM")) == OUR_CLASS
    per_kind = engine_config("--attention-config", '{"backend_per_kind": {"mla_attention": "CUTE_MLA"}}')
    assert per_kind.attention_config.backend is None
    assert selected_mla_backend(per_kind) == OUR_CLASS
    # LLM(attention_backend="CUTE_MLA") builds EngineArgs from its kwargs
    assert selected_mla_backend(engine_config(attention_backend="CUTE_MLA")) == OUR_CLASS
    # a non-MLA layer asking for CUTE_MLA is refused with vLLM's reason
    try:
        selected_mla_backend(cfg, use_mla=False)
    except ValueError as e:
        assert "non-MLA not supported" in str(e), e
    else:
        raise AssertionError("CUTE_MLA accepted a non-MLA layer")


def scenario_env_var() -> None:
    os.environ["VLLM_ATTENTION_BACKEND"] = "CUTE_MLA"
    install_fake_gpu()
    # vLLM raises on unknown VLLM_* variables with this flag (it only warns without): ours is declared.
    cfg = engine_config(fail_on_environ_validation=True)
    assert cfg.attention_config.backend is None
    assert selected_mla_backend(cfg) == OUR_CLASS
    # an explicit --attention-backend still wins over the variable
    explicit = engine_config("--attention-backend", "TRITON_MLA")
    assert selected_mla_backend(explicit).endswith("TritonMLABackend"), selected_mla_backend(explicit)
    # and so does backend_per_kind
    per_kind = engine_config("--attention-config", '{"backend_per_kind": {"mla_attention": "TRITON_MLA"}}')
    assert selected_mla_backend(per_kind).endswith("TritonMLABackend")
    # non-MLA layers are left to vLLM's own choice
    assert selected_mla_backend(cfg, use_mla=False) != OUR_CLASS


def _spawned_child(vllm_config, queue) -> None:
    # A fresh interpreter: the plugin was never loaded here. Unpickling vllm_config (before this runs)
    # must already have registered CUTE_MLA; then resolve the backend as a worker would.
    try:
        install_fake_gpu()
        queue.put(("ok", vllm_config.attention_config.backend.name, selected_mla_backend(vllm_config)))
    except BaseException as e:  # report instead of hanging the parent
        queue.put(("error", repr(e), ""))


def scenario_spawn() -> None:
    import multiprocessing as mp

    install_fake_gpu()
    cfg = engine_config("--attention-backend", "CUTE_MLA")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawned_child, args=(cfg, queue))
    proc.start()
    status, name, path = queue.get(timeout=300)
    proc.join(timeout=60)
    assert status == "ok", name
    assert name == "CUTE_MLA" and path == OUR_CLASS, (name, path)


def scenario_validation_reasons() -> None:
    import torch
    from vllm.platforms.interface import DeviceCapability

    from mla_backend_plugin.vllm.backend import CuteMLABackend

    install_fake_gpu()
    base = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type="decoder")
    assert CuteMLABackend.validate_configuration(**base) == []
    for bs in (16, 32, 64, 128, 256):
        assert CuteMLABackend.validate_configuration(**{**base, "block_size": bs}) == [], bs
    for kv in ("fp8", "fp8_e4m3", "bfloat16"):
        assert CuteMLABackend.validate_configuration(**{**base, "kv_cache_dtype": kv}) == [], kv
    cases = {
        "device_capability": (DeviceCapability(8, 0), "compute capability 8.0 not supported; CUTE_MLA needs >= 9.0"),
        "head_size": (320, "head_size 320 not supported: CUTE_MLA needs DeepSeek MLA dims"),
        "dtype": (torch.float32, "dtype torch.float32 not supported; allowed: bfloat16, float16"),
        "kv_cache_dtype": ("fp8_e5m2", "kv_cache_dtype 'fp8_e5m2' not supported; allowed: auto"),
        "block_size": (8, "block_size 8 not supported; allowed: multiples of 16"),
        "use_sparse": (True, "sparse MLA (DeepSeek-V3.2 indexer) is not supported"),
    }
    for key, (value, expected) in cases.items():
        reasons = CuteMLABackend.validate_configuration(**{**base, key: value})
        assert any(expected in r for r in reasons), (key, reasons)
    # A vLLM outside the supported range is refused with the range
    from packaging.version import Version

    import mla_backend_plugin.vllm.compat as compat

    compat.VLLM_VERSION, real_version = Version("0.25.1"), compat.VLLM_VERSION
    reasons = CuteMLABackend.validate_configuration(**base)
    compat.VLLM_VERSION = real_version
    expected = "vLLM 0.25.1 is not supported; CUTE_MLA supports vLLM >= 0.26.0, < 0.34.0"
    assert any(expected in r for r in reasons), reasons
    # The reason reaches the user through vLLM's selector
    install_fake_gpu(8, 0)
    try:
        selected_mla_backend(engine_config("--attention-backend", "CUTE_MLA"))
    except ValueError as e:
        assert "compute capability 8.0 not supported" in str(e), e
    else:
        raise AssertionError("CUTE_MLA was selected on compute capability 8.0")


def scenario_autotune_deployment() -> None:
    """What the autotuner's warm-up takes from vLLM's config: graph sizes as request counts, max_model_len as the
    context profile and block-table width, the cache and q dtypes; and the builder hands it to forward_mqa."""
    import dataclasses

    import torch

    from mla_backend_plugin.vllm import compat
    from mla_backend_plugin.vllm.backend import CuteMLADecodeMetadata, deployment_for

    install_fake_gpu()
    os.environ.pop("CUTE_MLA_TUNE_SEQ_LENS", None)
    cfg = engine_config("--attention-backend", "CUTE_MLA", "--max-num-seqs", "32", "--kv-cache-dtype", "fp8")
    sizes = cfg.compilation_config.cudagraph_capture_sizes
    assert sizes, "vLLM made no CUDA-graph sizes"
    assert compat.full_decode_graphs(cfg), cfg.compilation_config.cudagraph_mode
    dep = deployment_for(cfg, 16, 64)
    assert dep.batches == tuple(sorted({s for s in sizes if s <= 32})), (dep.batches, sizes)
    assert (dep.q_len, dep.seq_lens, dep.max_blocks) == (1, (4096,), 64)
    assert (dep.kv_dtype, dep.q_dtype, dep.out_dtype, dep.q_form, dep.scale_form) == (
        "fp8", "bf16", "bf16", "pair", "tensor"), dep
    eager = deployment_for(engine_config("--attention-backend", "CUTE_MLA", "--max-num-seqs", "20", "--enforce-eager",
                                         "--dtype", "float16"), 16, 32)
    assert eager.batches == (1, 2, 4, 8, 16) and eager.kv_dtype == eager.out_dtype == "fp16", eager
    assert not compat.full_decode_graphs(engine_config("--attention-backend", "CUTE_MLA", "--enforce-eager"))
    piecewise = engine_config("--attention-backend", "CUTE_MLA", "--compilation-config",
                              '{"cudagraph_mode": "PIECEWISE"}')
    assert not compat.full_decode_graphs(piecewise), piecewise.compilation_config.cudagraph_mode
    os.environ["CUTE_MLA_TUNE_SEQ_LENS"] = "1000,9000"
    assert deployment_for(cfg, 16, 64).seq_lens == (1000, 9000)
    fields = {f.name for f in dataclasses.fields(CuteMLADecodeMetadata)}
    assert {"workspace", "max_seq_len", "tuning"} <= fields, fields
    assert compat.decode_max_seq_len({"max_seq_len": 77, "seq_lens_device": torch.zeros(1)}) == 77
    assert compat.decode_max_seq_len({}) is None


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"PASS {name}")
