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

    eps = [ep for ep in entry_points(group="vllm.general_plugins")
           if ep.value == "mla_backend_plugin.vllm.register:register"]
    assert len(eps) == 1, f"entry point not found: {list(entry_points(group='vllm.general_plugins'))}"
    import mla_backend_plugin  # noqa: F401

    assert "vllm" not in sys.modules and "triton" not in sys.modules, "package import must stay lazy"
    assert not [m for m in sys.modules if m.startswith("mla_backend_plugin.vllm")], "the package imports vllm/"
    eps[0].load()()
    eps[0].load()()  # idempotent
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum["CUTE_MLA"].get_path() == OUR_CLASS
    assert AttentionBackendEnum.CUSTOM.get_path() == OUR_CLASS
    assert list(AttentionBackendEnum.__members__).count("CUTE_MLA") == 1
    assert not torch.cuda.is_initialized(), "registration must not initialise CUDA"
    # our INFO lines (kernel choice, tuning, compile times) reach a vLLM user's log through vLLM's handlers
    import logging

    ours, theirs = logging.getLogger("mla_backend_plugin"), logging.getLogger("vllm")
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    catch, level = Catch(), theirs.level
    theirs.addHandler(catch)
    try:
        theirs.setLevel(logging.INFO)
        ours.info("routed through vLLM's logger")
        theirs.setLevel(logging.WARNING)
        ours.info("below vLLM's level")
        ours.warning("a warning")
    finally:
        theirs.removeHandler(catch)
        theirs.setLevel(level)
    assert seen == ["routed through vLLM's logger", "a warning"], seen


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
    # with no --block-size vLLM asks the backend (get_preferred_block_size(16)): 64, the page the kernels are tuned
    # at, where vLLM's own rule keeps 16; every supported size stays accepted when a user names it
    from vllm.v1.attention.backend import AttentionBackend

    from mla_backend_plugin.vllm.backend import CuteMLABackend

    assert AttentionBackend.get_preferred_block_size.__func__(CuteMLABackend, 16) == 16
    assert CuteMLABackend.get_preferred_block_size(16) == 64
    assert all(CuteMLABackend.supports_block_size(b) for b in (16, 32, 64, 128))
    assert not CuteMLABackend.supports_block_size(8)


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
    import inspect

    from vllm.v1.attention.backend import AttentionBackend

    if "use_dcp" in inspect.signature(AttentionBackend.validate_configuration).parameters:  # vLLM >= 0.33
        assert CuteMLABackend.validate_configuration(**base, use_dcp=True) == []
    # A vLLM outside the supported range is refused with the range
    from packaging.version import Version

    import mla_backend_plugin.vllm.compat as compat

    real_version = compat.VLLM_VERSION
    for outside in ("0.25.1", "0.34.0"):
        compat.VLLM_VERSION = Version(outside)
        reasons = CuteMLABackend.validate_configuration(**base)
        expected = f"vLLM {outside} is not supported; CUTE_MLA supports vLLM >= 0.26.0, < 0.34.0"
        assert any(expected in r for r in reasons), reasons
    compat.VLLM_VERSION = real_version
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
    assert {"workspace", "max_seq_len"} <= fields and "tuning" not in fields, fields  # warm-up: the builder's
    assert compat.decode_max_seq_len({"max_seq_len": 77, "seq_lens_device": torch.zeros(1)}) == 77
    assert compat.decode_max_seq_len({}) is None


# ---------------------------------------------------------------------------------- decode context parallelism


def _dcp_config(dcp: int, interleave: int, block_size: int, spec_tokens: int):
    """A TP = DCP config of the tiny model (128 heads: 128 / TP per rank, 128 gathered per decode call)."""
    import json

    extra = []
    if spec_tokens:
        spec = {"method": "ngram", "num_speculative_tokens": spec_tokens, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4}
        extra = ["--speculative-config", json.dumps(spec)]
    cfg = engine_config("--attention-backend", "CUTE_MLA", "--tensor-parallel-size", str(dcp),
                        "--decode-context-parallel-size", str(dcp), "--cp-kv-cache-interleave-size", str(interleave),
                        "--block-size", str(block_size), "--distributed-executor-backend", "mp",
                        "--max-num-seqs", "16", *extra)
    assert cfg.parallel_config.decode_context_parallel_size == dcp
    assert cfg.parallel_config.cp_kv_cache_interleave_size == interleave
    return cfg


def _set_dcp_group(world: int, rank: int) -> None:
    """What get_dcp_group() returns in a worker of a DCP group (vLLM's builders read world size and rank)."""
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state

    parallel_state._DCP = SimpleNamespace(world_size=world, rank_in_group=rank)


def _make_builder(cfg, block_size: int):
    from types import SimpleNamespace

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from mla_backend_plugin.vllm.backend import CuteMLAMetadataBuilder

    # the one layer the builder looks up: its prefill backend is cloned (prefill stays vLLM's; 0.33 asks its name
    # when a step has prefills); vLLM >= 0.32 also reads the MLA dims from it and, under DCP, its MLADCPManager
    # (the prefill path's KV gather)
    prefill = SimpleNamespace(clone=lambda: SimpleNamespace(prepare_metadata=lambda metadata: None,
                                                            get_name=lambda: "FLASH_ATTN"))
    layer = SimpleNamespace(prefill_backend=prefill, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128)
    try:
        from vllm.v1.attention.ops.dcp import MLADCPManager
    except ImportError:  # vLLM < 0.32
        pass
    else:
        layer.dcp_manager = object.__new__(MLADCPManager)
        layer.dcp_manager.init_kv_gather = lambda *args, **kwargs: None
    cfg.compilation_config.static_forward_context["model.layers.0.self_attn.attn"] = layer
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with set_current_vllm_config(cfg):
        return CuteMLAMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu"))


def _decode_metadata(builder, inp, global_lens, local_lens):
    """builder.build(...) on a decode-only batch of ``inp`` (uniform q_len), as vLLM's model runner calls it under
    DCP: seq_lens global, dcp_local_seq_lens this rank's."""
    return builder.build(0, _common_metadata(inp.block_table, global_lens, [inp.q_len] * inp.batch,
                                             dcp_local_seq_lens=local_lens))


def scenario_dcp_decode() -> None:
    """Under DCP 2 and 4 (interleave 1 and the page size, q_len 1..4): our builder keeps q_len > 1 on the decode
    path, sizes the workspace for the gathered heads, hands decode the local lengths and per-row limits in
    local positions (in a persistent buffer), and each rank's decode (reference kernel, CPU) merged by the LSE
    equals attention over the unsplit cache."""
    import functools

    import torch
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    from mla_backend_plugin.ops import serving
    from mla_backend_plugin.testing import assert_close_decode, make_decode_inputs
    from mla_backend_plugin.testing.dcp import merge_partials, shard_decode_inputs, shard_row_kv_lens
    from mla_backend_plugin.vllm.backend import CuteMLAImpl

    os.environ["CUTE_MLA_KERNEL"] = "reference"
    install_fake_gpu()
    # the builder's workspace on the CPU: an H100's SM count instead of asking the (absent) GPU
    serving.MLAWorkspace = functools.partial(serving.MLAWorkspace, num_sms=132)
    page = 16
    for dcp, interleave, spec_tokens in ((2, 1, 1), (2, page, 3), (4, 1, 2), (4, page, 0), (2, 1, 0)):
        cfg = _dcp_config(dcp, interleave, page, spec_tokens)
        q_len = 1 + spec_tokens
        heads = 128  # 128 / TP per rank, gathered over the DCP group (TP = DCP here)
        lens = [q_len, q_len + 1, 5, 17, 64, 130, 333]
        inp = make_decode_inputs(len(lens), lens, q_len, heads, page, torch.bfloat16, "cat", "cpu", dcp + q_len)
        outs, lses = [], []
        for rank in range(dcp):
            _set_dcp_group(dcp, rank)
            builder = _make_builder(cfg, page)
            # vLLM keeps the MTP block on the decode path only because we declare supports_dcp_with_varlen
            assert builder.reorder_batch_threshold == q_len, (builder.reorder_batch_threshold, q_len)
            assert builder.workspace.num_heads == heads, builder.workspace.num_heads
            assert builder.dcp_rank == rank and builder.dcp_world_size == dcp
            shard = shard_decode_inputs(inp, dcp, rank, interleave, seed=rank)
            local = get_dcp_local_seq_lens(torch.tensor(lens), dcp, rank, interleave).tolist()  # vLLM's runner
            assert local == shard.seq_lens_list, (local, shard.seq_lens_list)
            meta = _decode_metadata(builder, shard, lens, local)
            decode = meta.decode
            assert meta.num_decodes == len(lens) and decode is not None
            assert decode.seq_lens.tolist() == local
            assert decode.dcp_tot_seq_lens.tolist() == lens
            if q_len == 1:
                assert decode.row_kv_lens is None and decode.dcp is None
            else:
                expected = shard_row_kv_lens(lens, q_len, dcp, rank, interleave)
                assert decode.row_kv_lens.tolist() == expected, (decode.row_kv_lens.tolist(), expected)
                assert decode.row_kv_lens.data_ptr() == builder.row_kv_lens_buffer.data_ptr()
                # the layout for FlashInfer's DCP mode: the global lengths in the builder's persistent buffer
                layout = decode.dcp
                assert (layout.world, layout.rank, layout.interleave) == (dcp, rank, interleave), layout
                assert layout.global_seq_lens.tolist() == lens
                assert layout.global_seq_lens.data_ptr() == builder.global_seq_lens_buffer.data_ptr()
                naive = [[max(s - q_len + 1 + t, 0) for t in range(q_len)] for s in local]
                assert expected != naive or dcp == 1  # the local causal rule is not seq_len - q_len + 1 + t
            runner = serving.DecodeRunner(inp.softmax_scale, "auto")
            assert runner.kernel == "reference"
            out, lse = runner.decode(shard.q, shard.kv_cache, decode.block_table, decode.seq_lens,
                                     decode.workspace, row_kv_lens=decode.row_kv_lens, dcp=decode.dcp)
            outs.append(out.clone())
            lses.append(lse.clone())
        merged_out, merged_lse = merge_partials(outs, lses)
        assert_close_decode(merged_out, merged_lse, *inp.reference(), torch.bfloat16,
                            msg=f"dcp={dcp} interleave={interleave} q_len={q_len}")
    # vLLM asks for the LSE under DCP and merges in the natural-log base; MTP with interleave > 1 is allowed
    _set_dcp_group(2, 1)
    impl = CuteMLAImpl.__new__(CuteMLAImpl)
    assert impl.need_to_return_lse_for_decode and impl.lse_base_on_e
    assert impl.supports_mtp_with_cp_non_trivial_interleave_size


def _make_impl(cfg):
    """CuteMLAImpl as vLLM's MLAAttention layer makes it for the tiny model (DeepSeek dims, this rank's heads)."""
    import torch
    from vllm.config import set_current_vllm_config

    from mla_backend_plugin.vllm.backend import CuteMLAImpl

    heads = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    kv_b_proj = torch.nn.Linear(512, heads * 256, bias=False)
    with set_current_vllm_config(cfg):
        return CuteMLAImpl(heads, 576, 0.1, 1, None, None, cfg.cache_config.cache_dtype, None, "decoder", None,
                           q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                           qk_head_dim=192, v_head_dim=128, kv_b_proj=kv_b_proj)


def scenario_reserve_workspace() -> None:
    """Each layer's impl reserves the decode workspace when the model is built (before any vLLM release measures
    memory for the KV cache; vLLM >= 0.33 calls reserve_workspace again in its profiling run): the workspace
    reserved there is the one the metadata builder takes (and its sizes are the builder's: heads, requests, q_len,
    token requests); reserving again allocates nothing. Without a reservation a builder allocates its own."""
    import functools
    import json

    import torch

    from mla_backend_plugin.ops import serving
    from mla_backend_plugin.vllm import backend

    os.environ["CUTE_MLA_KERNEL"] = "reference"
    install_fake_gpu()
    serving.MLAWorkspace = functools.partial(serving.MLAWorkspace, num_sms=132)
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    for extra in ([], ["--speculative-config", json.dumps(spec), "--tensor-parallel-size", "8",
                       "--distributed-executor-backend", "mp"]):
        cfg = engine_config("--attention-backend", "CUTE_MLA", "--block-size", "64", "--max-num-seqs", "8", *extra)
        cfg.device_config.device = torch.device("cpu")
        unreserved = _make_builder(cfg, 64).workspace
        assert _make_builder(cfg, 64).workspace is not unreserved  # nothing reserved: each builder its own
        impl = _make_impl(cfg)
        (reserved,) = [w for w in backend._reserved_workspaces.values() if w.num_heads == unreserved.num_heads]
        impl.reserve_workspace()
        impl.reserve_workspace()
        _make_impl(cfg).reserve_workspace()  # the next layer
        assert [w for w in backend._reserved_workspaces.values() if w.num_heads == unreserved.num_heads] == [reserved]
        builder = _make_builder(cfg, 64)
        assert builder.workspace is reserved, "the builder allocated a second workspace"
        for field in ("max_batch", "max_q_len", "num_heads"):
            assert getattr(reserved, field) == getattr(unreserved, field), (field, extra)


def scenario_dcp_refusals() -> None:
    """A head count the kernels lack once q is gathered over the DCP group is refused when the builder is made
    (before warm-up), naming both numbers."""
    install_fake_gpu()
    import json

    cfg = engine_config("--attention-backend", "CUTE_MLA", "--tensor-parallel-size", "2",
                        "--decode-context-parallel-size", "2", "--distributed-executor-backend", "mp",
                        "--hf-overrides", json.dumps({"num_attention_heads": 48}))
    assert cfg.model_config.get_num_attention_heads(cfg.parallel_config) == 24
    _set_dcp_group(2, 0)
    try:
        _make_builder(cfg, 64)
    except ValueError as e:
        assert "24 attention heads per rank x decode_context_parallel_size 2 = 48 query heads per decode call is " \
               "not supported" in str(e), e
    else:
        raise AssertionError("48 gathered heads accepted")


# ------------------------------------------------------------------------- short prefills on the decode path


def _varlen_metadata(builder, block_table, seq_lens: list[int], query_lens: list[int], num_tokens: int | None = None):
    """builder.build(...) on a batch whose requests bring ``query_lens`` new tokens each (vLLM's reorder put the
    ones at or under the threshold first), as vLLM's model runner calls it without DCP. ``num_tokens`` > the sum
    pads the batch with tokens of no request (a full-graph batch's padding)."""
    return builder.build(0, _common_metadata(block_table, seq_lens, query_lens, num_tokens))


def _common_metadata(block_table, seq_lens: list[int], query_lens: list[int], num_tokens: int | None = None,
                     dcp_local_seq_lens: list[int] | None = None):
    """vLLM's CommonAttentionMetadata of a batch (request b brings ``query_lens[b]`` tokens and has ``seq_lens[b]``
    keys; ``dcp_local_seq_lens``: this rank's under DCP); fields a vLLM version lacks are left out (the CPU
    shadows went in 0.32)."""
    import dataclasses

    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    num_tokens = int(qsl[-1]) if num_tokens is None else num_tokens
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    fields = dict(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=len(query_lens),
        num_actual_tokens=num_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens.clone(), _seq_lens_cpu=lens.clone(),
        _num_computed_tokens_cpu=lens - torch.tensor(query_lens, dtype=torch.int32))
    if dcp_local_seq_lens is not None:
        fields["dcp_local_seq_lens"] = torch.tensor(dcp_local_seq_lens, dtype=torch.int32)
    known = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in known})


def scenario_varlen_decode() -> None:
    """Requests of up to CUTE_MLA_DECODE_MAX_QUERY_LEN new tokens with KV context (the uncached tail of a prefix-cache
    hit, drafts of mixed counts) stay on the decode path: vLLM's split keeps them there (VARLEN, threshold 128),
    the builder recasts the step as token requests (q_len 1 at 128 heads, 4 at 16 heads: TP 8), and the decode
    (reference kernel, CPU, in slices of the workspace) equals each request's causal attention over its own pages;
    longer requests go to prefill; uniform MTP batches keep the folded q block and vLLM's tensors (what full CUDA
    graphs read); the threshold follows the environment and never drops below the speculative q_len."""
    import functools
    import json

    import torch

    from mla_backend_plugin.kernels.reference import mla_decode_reference
    from mla_backend_plugin.ops import serving
    from mla_backend_plugin.testing import assert_close_decode, make_decode_inputs

    os.environ["CUTE_MLA_KERNEL"] = "reference"
    install_fake_gpu()
    serving.MLAWorkspace = functools.partial(serving.MLAWorkspace, num_sms=132)
    # the prefill half's context chunks are vLLM's (pinned host memory: a GPU host's); not what is tested here
    from vllm.model_executor.layers.attention import mla_attention
    mla_attention.build_mla_chunked_context_metadata = lambda **kwargs: None
    mla_attention.PIN_MEMORY = False  # vLLM >= 0.32 pins the prefill lengths' host copy
    page = 16
    # decodes (1), drafts of mixed counts (2, 3), prefix-cache tails (16, 41, 128), then a 200-token extend (prefill)
    query_lens = [1, 3, 1, 2, 16, 41, 128, 200]
    seq_lens = [7, 300, 1000, 19, 16 * 33 + 16, 41 + 5, 128 + 700, 1200]
    for tp, heads, group in ((1, 128, 1), (8, 16, 4)):
        cfg = engine_config("--attention-backend", "CUTE_MLA", "--block-size", str(page), "--max-num-seqs", "4",
                            "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp")
        builder = _make_builder(cfg, page)
        assert builder.reorder_batch_threshold == 128, builder.reorder_batch_threshold
        assert builder.workspace.num_heads == heads
        # room for a slice of 128 token requests of their q_len (vLLM's max_num_seqs is 4)
        assert (builder.workspace.max_batch, builder.workspace.max_q_len) == (serving.TOKEN_REQUEST_SLICE, group)
        builder.workspace.max_batch = 4  # slices of 4 token requests here, to run the slicing
        inp = make_decode_inputs(len(seq_lens), seq_lens, 1, heads, page, torch.bfloat16, "cat", "cpu", 5)
        assert builder.tuning.report is None
        meta = _varlen_metadata(builder, inp.block_table, seq_lens, query_lens)
        assert builder.tuning.report is not None  # the autotuner's warm-up ran on the first build, not in decode
        assert (meta.num_decodes, meta.num_prefills) == (7, 1), (meta.num_decodes, meta.num_prefills)
        decode, tokens = meta.decode, sum(query_lens[:7])
        tr = decode.token_requests
        assert meta.num_decode_tokens == tokens and tr is not None and tr.q_len == group
        assert tr.block_table.shape == (sum(-(-n // group) for n in query_lens[:7]), -(-max(seq_lens) // page))
        assert decode.seq_lens.tolist() == seq_lens[:7]  # the step's own lengths stay the metadata's
        q = torch.randn(tokens, heads, 576, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        runner = serving.DecodeRunner(inp.softmax_scale, "auto")
        out, lse = runner.decode(q, inp.kv_cache, decode.block_table, decode.seq_lens, decode.workspace,
                                 max_seq_len=decode.max_seq_len, token_requests=tr)
        start = 0
        for b, n in enumerate(query_lens[:7]):
            ref_out, ref_lse = mla_decode_reference(q[start:start + n, :, :512], q[start:start + n, :, 512:],
                                                    inp.kv_cache, inp.block_table[b:b + 1], inp.seq_lens[b:b + 1], n,
                                                    inp.softmax_scale)
            assert_close_decode(out[start:start + n], lse[start:start + n], ref_out, ref_lse, torch.bfloat16,
                                msg=f"{heads} heads: request {b} (q_len {n}, seq_len {seq_lens[b]})")
            start += n

    # A uniform batch of q_len 16 (every request a 16-token tail, the case FlashMLA's UNIFORM threshold serves) is
    # recast too; a full-graph batch's padding tokens see no key.
    cfg = engine_config("--attention-backend", "CUTE_MLA", "--block-size", str(page), "--max-num-seqs", "4")
    builder = _make_builder(cfg, page)
    meta = _varlen_metadata(builder, inp.block_table[:3], seq_lens[4:7], [16, 16, 16], num_tokens=50)
    tr = meta.decode.token_requests
    assert meta.num_decodes == 3 and tr is not None and tr.seq_lens.shape[0] == 50
    assert tr.seq_lens.tolist()[-2:] == [0, 0]
    # A uniform batch of q_len 3 without speculation (3-token tails of prefix-cache hits, seen at TP 2 on two H100s:
    # the folded call raised "q_len 3 exceeds the workspace's max_q_len=1") is recast as well, and decodes
    assert builder.workspace.max_q_len == 1
    meta = _varlen_metadata(builder, inp.block_table[:3], seq_lens[4:7], [3, 3, 3])
    tr = meta.decode.token_requests
    assert meta.num_decodes == 3 and tr is not None and tr.q_len == 1 and tr.seq_lens.shape[0] == 9
    q3 = torch.randn(9, 128, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    runner.decode(q3, inp.kv_cache, meta.decode.block_table, meta.decode.seq_lens, meta.decode.workspace,
                  max_seq_len=meta.decode.max_seq_len, token_requests=tr)

    # full CUDA graphs are captured for uniform batches only: a mixed one is refused, not replayed stale
    assert builder.build_for_cudagraph_capture(
        _common_metadata(inp.block_table[:3], seq_lens[:3], [1, 1, 1])).decode.token_requests is None
    try:
        builder.build_for_cudagraph_capture(_common_metadata(inp.block_table[:3], seq_lens[4:7], [16, 16, 2]))
    except RuntimeError as e:
        assert "full graphs serve uniform decode batches only" in str(e), e
    else:
        raise AssertionError("a full CUDA graph of token requests was built")

    # MTP: a uniform q_len 2 batch keeps the folded q block and vLLM's own tensors (what full CUDA graphs read)
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    cfg = engine_config("--attention-backend", "CUTE_MLA", "--block-size", str(page), "--max-num-seqs", "4",
                        "--speculative-config", json.dumps(spec))
    builder = _make_builder(cfg, page)
    meta = _varlen_metadata(builder, inp.block_table[:3], seq_lens[:3], [2, 2, 2])
    assert meta.decode.token_requests is None and meta.decode.block_table.data_ptr() == inp.block_table.data_ptr()
    # padding requests of a full-graph batch (0 tokens) keep it uniform
    meta = _varlen_metadata(builder, inp.block_table[:4], seq_lens[:4], [2, 2, 2, 0], num_tokens=8)
    assert meta.num_decodes == 4 and meta.decode.token_requests is None
    meta = _varlen_metadata(builder, inp.block_table[:3], seq_lens[:3], [2, 1, 2])  # a request without drafts
    assert meta.num_decodes == 3 and meta.decode.token_requests is not None

    os.environ["CUTE_MLA_DECODE_MAX_QUERY_LEN"] = "1"  # vLLM's own threshold: the speculative q_len
    builder = _make_builder(cfg, page)
    assert builder.reorder_batch_threshold == 2 and builder.workspace.max_batch == 4
    os.environ["CUTE_MLA_DECODE_MAX_QUERY_LEN"] = "32"
    builder = _make_builder(cfg, page)
    assert builder.reorder_batch_threshold == 32
    meta = _varlen_metadata(builder, inp.block_table[:3], seq_lens[4:7], [16, 41, 2])
    assert (meta.num_decodes, meta.num_prefills) == (1, 2), (meta.num_decodes, meta.num_prefills)


def scenario_eval_engine_args() -> None:
    """The model-level eval's engine arguments (mla_backend_plugin.evals: a fixed KV cache, n-gram speculation,
    eager or graphs) for every vLLM condition of its device plan make a config through vLLM's own parsing, with
    the condition's backend; CUTE_MLA's resolves to our backend class."""
    import json
    import tempfile

    from mla_backend_plugin.evals import plan, tasks, worker
    from mla_backend_plugin.evals.model import hf_config

    install_fake_gpu()
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    hf = hf_config(tasks.VOCAB_SIZE)
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(hf, f)
        for cond in plan.device_plan().conditions:
            if cond.backend == plan.TORCH:
                continue
            kwargs = worker.engine_kwargs(cond, hf, 8192)
            cfg = EngineArgs(model=model_dir, load_format="dummy", **kwargs).create_engine_config()
            assert cfg.attention_config.backend.name == cond.backend, (cond.label, cfg.attention_config.backend)
            assert cfg.cache_config.kv_cache_memory_bytes == kwargs["kv_cache_memory_bytes"], cond.label
            assert cfg.cache_config.cache_dtype == cond.kv_dtype, cond.label
            assert cfg.model_config.max_model_len == kwargs["max_model_len"] > 8192, cond.label
            assert cfg.scheduler_config.max_num_batched_tokens == kwargs["max_num_batched_tokens"], cond.label
            graphs = cfg.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
            assert graphs == (cond.mode == "graphs"), (cond.label, cfg.compilation_config.cudagraph_mode)
            spec = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0
            assert spec == cond.spec, (cond.label, spec)
            if cond.ours:
                assert selected_mla_backend(cfg) == OUR_CLASS, cond.label
        # the two-GPU layouts of benchmarks/run_dcp_two_gpus.sh: vLLM takes the eval's arguments for them
        base = plan.conditions(["CUTE_MLA", "FLASHMLA"], ["auto"], ["auto", "fp8"], ["graphs"], [0, plan.NGRAM_TOKENS])
        for cond in plan.with_layouts(base, plan.parallel_layouts([2], [1, 2], [1, 64])):
            kwargs = worker.engine_kwargs(cond, hf, 8192)
            cfg = EngineArgs(model=model_dir, load_format="dummy", distributed_executor_backend="mp",
                             **kwargs).create_engine_config()
            par = cfg.parallel_config
            assert (par.tensor_parallel_size, par.decode_context_parallel_size) == (cond.tp, cond.dcp), cond.label
            assert par.cp_kv_cache_interleave_size == cond.interleave, cond.label
            assert cfg.cache_config.block_size == kwargs.get("block_size", cfg.cache_config.block_size), cond.label
            assert cfg.attention_config.backend.name == cond.backend, cond.label


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"PASS {name}")
