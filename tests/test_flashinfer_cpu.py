"""The FlashInfer adapters (kernels/flashinfer) without a GPU: what they refuse and why, the scratch they declare,
and how one of our calls maps onto ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` - with FlashInfer's
module faked in sys.modules (the real one needs a Blackwell GPU to run), checked against the real signature
when flashinfer-python is importable."""

from __future__ import annotations

import inspect
import math
import sys
import types

import pytest
import torch

from mla_backend_plugin.kernels.flashinfer import MANIFESTS
from mla_backend_plugin.kernels.flashinfer import launch as fi
from mla_backend_plugin.ops import DcpLayout, LaunchConfig, prepare_args, registry, serving
from mla_backend_plugin.testing import make_decode_inputs

B200 = (10, 0)
FP8 = torch.float8_e4m3fn
# The parameters of trtllm_batch_decode_with_kv_cache_mla in the FlashInfer releases the engines pin
_V0_6 = ("query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
         "block_tables", "seq_lens", "max_seq_len", "sparse_mla_top_k", "out", "bmm1_scale", "bmm2_scale", "sinks",
         "skip_softmax_threshold_scale_factor", "enable_pdl", "backend", "is_var_seq", "uses_shared_paged_kv_idx",
         "lse", "return_lse", "cute_dsl_impl", "kv_scale_format", "cum_seq_lens_q", "max_q_len")  # 0.6.14 (vLLM 0.26)
_V0_7 = _V0_6 + ("multi_ctas_kv_counter_buffer", "sparse_mla_top_k_lens", "enable_dcp", "cp_world", "cp_rank",
                 "causal_seqlens_kv_global", "use_fp16_softmax", "return_lse_base")  # 0.7.2 (vLLM 0.33, SGLang 0.5.23)
FLASHINFER_APIS = {"0.6.14": _V0_6, "0.7.2": _V0_7}


@pytest.fixture
def importable(monkeypatch):
    monkeypatch.setattr(fi, "import_failure", lambda: None)


def _args(q_form="cat", kv_dtype=torch.bfloat16, block_size=64, q_len=2, heads=16, tensor_scales=False, **kw):
    inputs = make_decode_inputs(3, [70, 300, 5], q_len, heads, block_size, kv_dtype, q_form, "cpu", 0, **kw)
    args = prepare_args(*inputs.call_args(), softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype,
                        **inputs.scale_kwargs(as_tensor=tensor_scales))
    return args, inputs


def test_manifests_are_registered_unverified_and_plan_nothing():
    names = [m.name for m in MANIFESTS]
    assert names == ["flashinfer_cute_dsl", "flashinfer_trtllm", "flashinfer_xqa"]
    for m in MANIFESTS:
        assert registry.KERNELS[m.name] is m
        assert m.verified_archs == frozenset() and m.plan_tile is None and m.needs_workspace and m.archs == ()
        assert m.writes_lse == (m.name != "flashinfer_xqa")
    assert registry.AUTO_ORDER[10][0] == "flashinfer_cute_dsl" and "flashinfer_trtllm" not in registry.AUTO_ORDER[10]
    # XQA: a tuner candidate on SM120/121 beside ours, never auto's choice
    assert "flashinfer_xqa" not in registry.AUTO_ORDER[12]
    assert registry.candidate_kernels((12, 0)) == ["xqa_sm120", "triton", "flashinfer_xqa"]
    assert "flashinfer_xqa" not in registry.candidate_kernels((10, 0))


def test_refusals_name_the_reason(importable, monkeypatch, tmp_path):
    monkeypatch.setattr(fi, "api_parameters", lambda: frozenset(FLASHINFER_APIS["0.7.2"]))
    cute, trt = fi.unsupported_reason_cute_dsl, fi.unsupported_reason_trtllm
    bf16, _ = _args()
    assert cute(bf16, None) == "needs a CUDA device"
    assert "runs on SM100/SM103 (B200, GB200, B300), device has compute capability 9.0" in cute(bf16, (9, 0))
    assert cute(bf16, B200) is None and cute(bf16, (10, 3)) is None
    fp16, _ = _args(kv_dtype=torch.float16)
    assert cute(fp16, B200) == "writes bf16 output only, out is float16"
    mixed, _ = _args(kv_dtype=FP8, kv_scale=2.0)  # bf16 q on an fp8 cache
    assert "needs q in the cache's dtype (q is bfloat16, cache float8_e4m3fn)" in cute(mixed, B200)
    fp8, _ = _args(q_form="fp8", kv_dtype=FP8, kv_scale=2.0, q_scale=0.5)
    assert cute(fp8, B200) is None
    fp8_tensor, _ = _args(q_form="fp8", kv_dtype=FP8, kv_scale=2.0, q_scale=0.5, tensor_scales=True)
    assert "takes its scales as host floats" in cute(fp8_tensor, B200)
    small_blocks, _ = _args(block_size=16)
    assert cute(small_blocks, B200) is None
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path))  # empty: the cubins would be downloaded
    assert trt(small_blocks, B200) == "trtllm-gen needs block size 32 or 64, the cache has 16"
    assert "trtllm-gen's cubins are not installed" in trt(bf16, B200)
    (tmp_path / "fmha.cubin").write_bytes(b"x")
    assert trt(bf16, B200) is None
    monkeypatch.setattr(fi, "import_failure", lambda: "flashinfer-python is not installed")
    assert cute(bf16, B200) == "flashinfer-python is not installed"


@pytest.mark.parametrize("version", sorted(FLASHINFER_APIS))
def test_block_table_must_cover_multiples_of_128_tokens(importable, monkeypatch, tmp_path, version):
    """cute-dsl needs whole 128-token tiles of block table; trtllm-gen since FlashInfer 0.7 takes any width."""
    monkeypatch.setattr(fi, "api_parameters", lambda: frozenset(FLASHINFER_APIS[version]))
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path))
    (tmp_path / "fmha.cubin").write_bytes(b"x")
    args, inputs = _args(block_size=32)  # 16 columns of 32 tokens: 512 tokens
    narrow = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table[:, :13].contiguous(), inputs.seq_lens,
                          softmax_scale=0.1)  # 13 x 32 = 416 tokens
    assert fi.unsupported_reason_cute_dsl(args, B200) is None and fi.unsupported_reason_trtllm(args, B200) is None
    reason = "needs a block table covering a multiple of 128 tokens; it has 13 columns of 32-token blocks"
    assert reason in fi.unsupported_reason_cute_dsl(narrow, B200)
    assert fi.unsupported_reason_trtllm(narrow, B200) == (None if version == "0.7.2" else reason)


def test_scratch_is_declared_only_where_flashinfer_runs(monkeypatch):
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: object())
    assert fi.scratch((9, 0), 8, 2, 128, 132) is None and fi.scratch(None, 8, 2, 128, 132) is None
    key, nbytes = fi.scratch(B200, 8, 2, 128, 148)
    assert key == "flashinfer" and nbytes == fi.SHARED_BYTES + 8 * 2 * 128 * 576 * 2
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: None)
    assert fi.scratch(B200, 8, 2, 128, 148) is None


class _Workspace:
    def __init__(self, nbytes):
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)

    def scratch_for(self, key):
        assert key == "flashinfer"
        return self.buf


@pytest.fixture(params=sorted(FLASHINFER_APIS))
def fake_flashinfer(monkeypatch, request):
    """``flashinfer.mla`` replaced by a recorder with the signature of one FlashInfer release that writes out = 1
    and lse = 1 (base 2 for trtllm-gen unless asked for base e, as its kernels would write)."""
    calls = []

    def trtllm_batch_decode_with_kv_cache_mla(**kwargs):
        calls.append(kwargs)
        kwargs["out"].fill_(1.0)
        base2 = kwargs["backend"] == "trtllm-gen" and kwargs.get("return_lse_base") != "basee"
        kwargs["lse"].fill_(1.0 / math.log(2.0) if base2 else 1.0)
        return kwargs["out"], kwargs["lse"]

    params = FLASHINFER_APIS[request.param]
    trtllm_batch_decode_with_kv_cache_mla.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in params])
    trtllm_batch_decode_with_kv_cache_mla.version = request.param
    mla = types.ModuleType("flashinfer.mla")
    mla.trtllm_batch_decode_with_kv_cache_mla = trtllm_batch_decode_with_kv_cache_mla
    pkg = types.ModuleType("flashinfer")
    pkg.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    monkeypatch.setattr(fi, "SHARED_BYTES", 1 << 20)  # small scratch on the CPU
    monkeypatch.setattr(fi, "COUNTER_BYTES", 1 << 16)
    fi.api_parameters.cache_clear()
    yield calls
    fi.api_parameters.cache_clear()


def _fake_version() -> str:
    return sys.modules["flashinfer.mla"].trtllm_batch_decode_with_kv_cache_mla.version


@pytest.mark.parametrize("backend", ["cute-dsl", "trtllm-gen"])
def test_argument_mapping_of_a_joined_q(fake_flashinfer, backend):
    args, inputs = _args(q_form="cat")
    ws = _Workspace(fi.SHARED_BYTES + 3 * 2 * 16 * 576 * 2)
    launch = fi.launch_cute_dsl if backend == "cute-dsl" else fi.launch_trtllm
    launch(args, ws, LaunchConfig(enable_pdl=False))
    (kw,) = fake_flashinfer
    assert kw["backend"] == backend  # never "auto": it would instantiate trtllm-gen and may download cubins
    assert kw.get("cute_dsl_impl") == ("monolithic" if backend == "cute-dsl" else None)
    q = kw["query"]
    assert q.shape == (3, 2, 16, 576) and q.data_ptr() == inputs.q.data_ptr()  # a view: no copy
    assert torch.equal(q.reshape(6, 16, 576), inputs.q)
    assert kw["kv_cache"] is args.kv_cache and kw["block_tables"] is args.block_table
    assert kw["seq_lens"] is args.seq_lens
    assert kw["max_seq_len"] == args.block_table.shape[1] * 64  # from shapes: the same in every graph replay
    assert (kw["qk_nope_head_dim"], kw["kv_lora_rank"], kw["qk_rope_head_dim"]) == (128, 512, 64)
    assert kw["out"].shape == (3, 2, 16, 512) and kw["out"].data_ptr() == args.out.data_ptr()
    assert kw["lse"] is args.lse and kw["return_lse"] is True and kw["enable_pdl"] is False
    assert kw["bmm1_scale"] == pytest.approx(args.softmax_scale) and kw["bmm2_scale"] == 1.0
    region = kw["workspace_buffer"]
    assert region.dtype == torch.int8
    v0_7 = _fake_version() == "0.7.2"
    # cute-dsl never touches trtllm-gen's semaphores; FlashInfer 0.6's trtllm-gen finds them at the region's head,
    # 0.7's in a buffer of their own (without one it would allocate one per call)
    start = fi.COUNTER_BYTES if backend == "cute-dsl" or v0_7 else 0
    assert region.data_ptr() == ws.buf.data_ptr() + start and region.numel() == fi.SHARED_BYTES - start
    counters = kw.get("multi_ctas_kv_counter_buffer")
    if backend == "trtllm-gen" and v0_7:
        assert counters.data_ptr() == ws.buf.data_ptr() and counters.numel() == fi.COUNTER_BYTES
        assert counters.is_contiguous() and counters.dtype == torch.uint8
    else:
        assert counters is None
    # mla_decode returns natural log: 0.7 writes it so (return_lse_base), 0.6's trtllm-gen base 2 is converted
    assert kw.get("return_lse_base") == ("basee" if v0_7 else None)
    assert torch.allclose(args.lse, torch.ones_like(args.lse))


def test_argument_mapping_of_a_pair_and_fp8_scales(fake_flashinfer):
    args, inputs = _args(q_form="pair")
    ws = _Workspace(fi.SHARED_BYTES + 3 * 2 * 16 * 576 * 2)
    fi.launch_cute_dsl(args, ws, LaunchConfig(enable_pdl=True))
    q = fake_flashinfer[-1]["query"]
    assert q.data_ptr() == ws.buf.data_ptr() + fi.SHARED_BYTES  # joined in the staging area
    assert torch.equal(q.reshape(6, 16, 576), torch.cat([inputs.q_nope, inputs.q_pe], dim=-1))
    assert fake_flashinfer[-1]["enable_pdl"] is True
    with pytest.raises(ValueError, match="FlashInfer's q staging holds 100 bytes"):
        fi.launch_cute_dsl(args, _Workspace(fi.SHARED_BYTES + 100), LaunchConfig())
    fp8, _ = _args(q_form="fp8", kv_dtype=FP8, kv_scale=2.0, q_scale=0.5, q_len=1)
    fi.launch_trtllm(fp8, ws, LaunchConfig())
    kw = fake_flashinfer[-1]
    assert kw["bmm1_scale"] == pytest.approx(fp8.softmax_scale * 0.5 * 2.0) and kw["bmm2_scale"] == 2.0
    assert kw["query"].dtype == FP8 and kw["query"].shape == (3, 1, 16, 576)


def test_keywords_match_flashinfers_signature(monkeypatch):
    """Every keyword the adapter passes is a parameter of the installed FlashInfer's function (CI: 0.6.14 with
    vLLM 0.26, 0.7.2 with vLLM 0.33 and SGLang 0.5.23; ``import flashinfer.mla`` works without a GPU), and the
    parameter lists the fake releases above are made of are the real ones of that release."""
    monkeypatch.setattr(fi, "SHARED_BYTES", 1 << 20)
    monkeypatch.setattr(fi, "COUNTER_BYTES", 1 << 16)
    fi.api_parameters.cache_clear()
    try:
        import flashinfer
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla as real
    except ImportError as e:
        pytest.skip(f"flashinfer-python is not installed here: {e}")
    params = tuple(inspect.signature(real).parameters)
    version = flashinfer.__version__.split("+")[0]
    release = ".".join(version.split(".")[:3]).removesuffix(".post1")
    if release in FLASHINFER_APIS:
        assert params == FLASHINFER_APIS[release], version
    args, _ = _args(q_form="pair")
    for backend in ("cute-dsl", "trtllm-gen"):
        kw = fi.call_kwargs(args, _Workspace(fi.SHARED_BYTES + 3 * 2 * 16 * 576 * 2), backend, LaunchConfig())
        assert set(kw) <= set(params), set(kw) - set(params)
        if "multi_ctas_kv_counter_buffer" in params and backend == "trtllm-gen":
            assert "multi_ctas_kv_counter_buffer" in kw  # else FlashInfer >= 0.7 allocates one on every call
        if "return_lse_base" in params:
            assert kw["return_lse_base"] == "basee"
    if "enable_dcp" in params:  # FlashInfer >= 0.7: row_kv_lens as cute-dsl's DCP mode
        assert fi.has_dcp_mode()
        dcp, global_lens = _dcp_args(world=2, rank=1)
        kw = fi.call_kwargs(dcp, _Workspace(fi.SHARED_BYTES + 3 * 2 * 16 * 576 * 2), "cute-dsl", LaunchConfig())
        bound = inspect.signature(real).bind(**kw)  # every keyword a parameter, none missing
        assert bound.arguments["enable_dcp"] is True and bound.arguments["causal_seqlens_kv_global"] is global_lens
        assert (bound.arguments["cp_world"], bound.arguments["cp_rank"]) == (2, 1)
        assert bound.arguments["return_lse"] is True and bound.arguments["backend"] == "cute-dsl"
        assert bound.arguments["query"].dim() == 4  # FlashInfer's DCP takes a dense query without cum_seq_lens_q
    else:
        assert not fi.has_dcp_mode()
    fi.api_parameters.cache_clear()


# --------------------------------------------------------------------------------------------------------
# row_kv_lens as FlashInfer's cute-dsl DCP mode (enable_dcp, FlashInfer >= 0.7)
# --------------------------------------------------------------------------------------------------------

# rank 0 of 2, cyclic: the global lengths whose rank-0 shards are _args' seq_lens [70, 300, 5]
GLOBAL_LENS = [139, 599, 9]


def _dcp_args(world=2, rank=0, interleave=1, with_layout=True, with_rows=True, q_len=2):
    _, inputs = _args(q_len=q_len)
    global_lens = torch.tensor(GLOBAL_LENS, dtype=torch.int32)
    rows = serving.dcp_row_kv_lens(global_lens, q_len, world, rank, interleave) if with_rows else None
    dcp = DcpLayout(world, rank, interleave, global_lens) if with_layout else None
    args = prepare_args(*inputs.call_args(), softmax_scale=inputs.softmax_scale, row_kv_lens=rows, dcp=dcp)
    return args, global_lens


def test_dcp_layout_is_validated():
    _, inputs = _args()
    lens = torch.tensor(GLOBAL_LENS, dtype=torch.int32)

    def prepare(dcp):
        return prepare_args(*inputs.call_args(), softmax_scale=0.1, dcp=dcp)

    assert prepare(None).dcp is None
    good = DcpLayout(2, 1, 1, lens)
    assert prepare(good).dcp is good
    for bad, match in (((2, 1), "must be an ops.DcpLayout"),
                       (DcpLayout(0, 0, 1, lens), "world must be >= 1, got 0"),
                       (DcpLayout(2, 2, 1, lens), r"rank must be in \[0, 1\] \(0 <= rank < world\), got 2"),
                       (DcpLayout(2, -1, 1, lens), "rank must be in"),
                       (DcpLayout(2, 0, 0, lens), "interleave must be >= 1"),
                       (DcpLayout(2.0, 0, 1, lens), "world must be a Python int, got 2.0"),
                       (DcpLayout(2, True, 1, lens), "rank must be a Python int"),
                       (DcpLayout(2, 0, 1, lens.long()), r"global_seq_lens must be an int32 tensor \[batch\] = \[3\]"),
                       (DcpLayout(2, 0, 1, lens[:2]), "global_seq_lens must be an int32 tensor"),
                       (DcpLayout(2, 0, 1, [139, 599, 9]), "global_seq_lens must be an int32 tensor"),
                       (DcpLayout(2, 0, 1, torch.tensor([139, 0, 599, 0, 9, 0], dtype=torch.int32)[::2]),
                        "global_seq_lens must be contiguous")):
        with pytest.raises(ValueError, match=f"mla_decode: dcp: {match}"):
            prepare(bad)
    # one decision per layout kind where a kernel's support depends on it; none for the rank or the lengths
    none, cyclic, other_rank, interleaved = (prepare(d).signature() for d in (
        None, good, DcpLayout(2, 0, 1, lens.clone()), DcpLayout(2, 1, 2, lens)))
    assert len({none, cyclic, interleaved}) == 3 and cyclic == other_rank


@pytest.mark.parametrize("version", sorted(FLASHINFER_APIS))
def test_row_kv_lens_needs_flashinfers_dcp_mode(importable, monkeypatch, version):
    """cute-dsl takes row_kv_lens only as FlashInfer's DCP mode: with the layout, interleave 1, FlashInfer >= 0.7;
    trtllm-gen never; without row_kv_lens the layout changes nothing."""
    monkeypatch.setattr(fi, "api_parameters", lambda: frozenset(FLASHINFER_APIS[version]))
    monkeypatch.setattr(fi, "installed_version", lambda: version)
    cute, trt = registry.KERNELS["flashinfer_cute_dsl"], registry.KERNELS["flashinfer_trtllm"]

    def reason(spec, args):
        return registry.unsupported_reason(spec, args, B200)

    cyclic, _ = _dcp_args()
    if version == "0.7.2":
        assert reason(cute, cyclic) is None
    else:
        assert reason(cute, cyclic) == (f"FlashInfer {version} has no DCP mode (enable_dcp, cp_world, cp_rank, "
                                        "causal_seqlens_kv_global: FlashInfer >= 0.7)")
    assert reason(cute, _dcp_args(interleave=2)[0]) == \
        "FlashInfer's DCP mode shards cyclically (interleave 1); got 2"
    assert "takes row_kv_lens only in FlashInfer's DCP mode" in reason(cute, _dcp_args(with_layout=False)[0])
    assert reason(trt, cyclic) == \
        "does not support row_kv_lens (per-row key counts, used by decode context parallelism)"
    assert reason(cute, _dcp_args(interleave=2, with_rows=False)[0]) is None


def test_dcp_argument_mapping(fake_flashinfer):
    v0_7 = _fake_version() == "0.7.2"
    ws = _Workspace(fi.SHARED_BYTES + 3 * 2 * 16 * 576 * 2)
    args, global_lens = _dcp_args(world=2, rank=0)
    if v0_7:
        fi.launch_cute_dsl(args, ws, LaunchConfig())
        kw = fake_flashinfer[-1]
        assert kw["enable_dcp"] is True and kw["cp_world"] == 2 and kw["cp_rank"] == 0
        assert kw["causal_seqlens_kv_global"] is global_lens
        assert kw["seq_lens"] is args.seq_lens and kw["query"].dim() == 4  # rank-local lengths; a dense query
        assert kw["return_lse"] is True and kw["backend"] == "cute-dsl" and kw["cute_dsl_impl"] == "monolithic"
        rank1, _ = _dcp_args(world=4, rank=3)
        fi.launch_cute_dsl(rank1, ws, LaunchConfig())
        assert (fake_flashinfer[-1]["cp_world"], fake_flashinfer[-1]["cp_rank"]) == (4, 3)
    # without row_kv_lens (q_len 1 under DCP: the usual rule on the rank's own lengths) no DCP keyword is passed
    for plain in (_dcp_args(with_rows=False)[0], _args()[0]):
        fi.launch_cute_dsl(plain, ws, LaunchConfig())
        assert not {"enable_dcp", "cp_world", "cp_rank", "causal_seqlens_kv_global"} & set(fake_flashinfer[-1])
        fi.launch_trtllm(plain, ws, LaunchConfig())
        assert not {"enable_dcp", "cp_world", "cp_rank", "causal_seqlens_kv_global"} & set(fake_flashinfer[-1])


# --------------------------------------------------------------------------------------------------------
# FlashInfer's SM120 XQA MLA decode (writes no LSE)
# --------------------------------------------------------------------------------------------------------

RTX_PRO = (12, 0)
# The parameters of flashinfer.decode.xqa_batch_decode_with_kv_cache_mla: the same in 0.6.14 and 0.7.2
XQA_API = ("query", "kv_cache", "workspace_buffer", "qk_nope_head_dim", "kv_lora_rank", "qk_rope_head_dim",
           "block_tables", "seq_lens", "max_seq_len", "out", "bmm1_scale", "bmm2_scale", "sinks", "enable_pdl")
XQA = registry.KERNELS["flashinfer_xqa"]


def _xqa_args(q_form="cat", kv_dtype=torch.bfloat16, block_size=64, q_len=1, heads=128, need_lse=False, **kw):
    inputs = make_decode_inputs(3, [70, 300, 5], q_len, heads, block_size, kv_dtype, q_form, "cpu", 0, **kw)
    return prepare_args(*inputs.call_args(), softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype,
                        **inputs.scale_kwargs(), need_lse=need_lse), inputs


def test_xqa_refusals_name_the_reason(importable):
    why = fi.unsupported_reason_xqa
    args, _ = _xqa_args()
    assert why(args, RTX_PRO) is None and why(args, (12, 1)) is None
    assert why(args, None) == "needs a CUDA device"
    assert why(args, B200) == ("FlashInfer's XQA MLA decode runs on SM120/SM121 (RTX PRO 6000 Blackwell, RTX 50, "
                               "DGX Spark), device has compute capability 10.0")
    assert why(_xqa_args(kv_dtype=torch.float16)[0], RTX_PRO) == "writes bf16 output only, out is float16"
    mixed, _ = _xqa_args(kv_dtype=FP8, kv_scale=2.0)
    assert "needs q in the cache's dtype (q is bfloat16, cache float8_e4m3fn)" in why(mixed, RTX_PRO)
    fp8, _ = _xqa_args(q_form="fp8", kv_dtype=FP8, kv_scale=2.0, q_scale=0.5)
    assert why(fp8, RTX_PRO) is None
    assert why(_xqa_args(heads=64)[0], RTX_PRO) == "XQA's MLA kernel is built for 128 heads, the call has 64"
    assert why(_xqa_args(q_len=2)[0], RTX_PRO) == ("XQA's MLA kernel takes one query token per request, the call "
                                                   "has q_len 2")
    for block_size in (16, 32, 128):  # every page size mla_decode takes has an XQA build
        assert why(_xqa_args(block_size=block_size)[0], RTX_PRO) is None
    inputs = _xqa_args(block_size=32)[1]
    narrow = prepare_args(inputs.q, inputs.kv_cache, inputs.block_table[:, :13].contiguous(), inputs.seq_lens,
                          softmax_scale=0.1, need_lse=False)
    assert "needs a block table covering a multiple of 128 tokens; it has 13 columns" in why(narrow, RTX_PRO)


def test_xqa_is_refused_when_the_lse_is_needed(importable):
    """The registry (what auto, the tuned table and the tuner ask) refuses a kernel that writes no LSE for a call
    that needs one, and the tuner never lists it as a candidate for such a call."""
    from mla_backend_plugin.ops import autotune

    needs, _ = _xqa_args(need_lse=True)
    free, _ = _xqa_args(need_lse=False)
    reason = registry.unsupported_reason(XQA, needs, RTX_PRO)
    assert reason.startswith("writes no LSE and this call needs one (mla_decode's return_lse=True, the default)")
    assert registry.unsupported_reason(XQA, free, RTX_PRO) is None
    for m in MANIFESTS[:2]:  # kernels that write the LSE: the flag changes nothing for them
        assert registry.unsupported_reason(m, needs, B200) == registry.unsupported_reason(m, free, B200)
    found, refused = autotune.candidates_for(needs, RTX_PRO, kernels=["flashinfer_xqa"], check=False)
    assert found == [] and refused["flashinfer_xqa"] == reason
    found, refused = autotune.candidates_for(free, RTX_PRO, kernels=["flashinfer_xqa"], check=False)
    assert [c.kernel for c in found] == ["flashinfer_xqa", "flashinfer_xqa"] and refused == {}
    assert needs.signature() != free.signature()  # one decision per need: a workspace never mixes them up


def test_mla_decode_return_lse_contract():
    """return_lse=False returns (out, None) with the same out (a given lse buffer is accepted, its contents
    unspecified); return_lse must be a bool."""
    from mla_backend_plugin.ops import mla_decode

    inputs = make_decode_inputs(2, [40, 9], 1, 16, 16, torch.bfloat16, "cat", "cpu", 3)
    kw = dict(softmax_scale=inputs.softmax_scale, kernel="reference")
    out, lse = mla_decode(*inputs.call_args(), **kw)
    out2, none = mla_decode(*inputs.call_args(), **kw, return_lse=False)
    assert none is None and lse.shape == (2, 16) and torch.equal(out, out2)
    out3, none = mla_decode(*inputs.call_args(), **kw, return_lse=False, lse=torch.empty(2, 16))
    assert none is None and torch.equal(out, out3)
    with pytest.raises(ValueError, match="mla_decode: return_lse: must be True or False, got None"):
        mla_decode(*inputs.call_args(), **kw, return_lse=None)


def test_tuned_shapes_keep_the_lse_need_apart(importable):
    """A shape key says whether its calls read the LSE: the tuner lists the no-LSE kernel only for keys that do
    not, the live table never hands a no-LSE key's choice to a call that needs the LSE, and old cache entries
    (no "lse") read as needing it."""
    from mla_backend_plugin.ops import autotune, tuned

    needs, _ = _xqa_args(need_lse=True)
    free, _ = _xqa_args(need_lse=False)
    k_needs, k_free = tuned.ShapeKey.of(needs, RTX_PRO, 300), tuned.ShapeKey.of(free, RTX_PRO, 300)
    assert k_needs.lse and not k_free.lse and k_needs.shape != k_free.shape
    assert k_free.id() == k_needs.id() + " no-lse"
    old = k_needs.as_dict()
    del old["lse"]
    assert tuned.ShapeKey.from_dict(old) == k_needs and tuned.ShapeKey.from_dict(k_free.as_dict()) == k_free
    assert tuned._live_shape(free, RTX_PRO) == k_free.shape and tuned._live_shape(needs, RTX_PRO) == k_needs.shape
    dep = autotune.Deployment(128, 1, "bf16", "bf16", "bf16", 64, (3,), (300,), lse=False)
    assert [k.lse for k in dep.keys(RTX_PRO)] == [False]
    found, _ = autotune.candidates_for(free, RTX_PRO, check=False)
    assert "flashinfer_xqa" in {c.kernel for c in found}
    found, refused = autotune.candidates_for(needs, RTX_PRO, check=False)
    assert "flashinfer_xqa" not in {c.kernel for c in found} and "writes no LSE" in refused["flashinfer_xqa"]


def test_self_check_of_a_kernel_without_lse_compares_out_alone(monkeypatch):
    """The self-check hands a no-LSE kernel calls with need_lse=False and checks its out alone; a kernel that
    supports none of the cases fails (nothing was checked)."""
    import dataclasses

    from mla_backend_plugin.ops import selfcheck

    ref = registry.KERNELS["reference"]
    seen = []

    def launch(args, workspace, config):  # the reference's out, an LSE left unwritten (NaN)
        seen.append(args.need_lse)
        ref.launch(args, workspace, config)
        args.lse.fill_(float("nan"))

    no_lse = dataclasses.replace(ref, name="no_lse", launch=launch, writes_lse=False)
    assert selfcheck.run_self_check(no_lse, torch.device("cpu")) is None and seen and not any(seen)
    with_lse = dataclasses.replace(no_lse, writes_lse=True)
    assert "lse" in selfcheck.run_self_check(with_lse, torch.device("cpu"))
    nothing = dataclasses.replace(ref, name="nothing", unsupported_reason=lambda args, cc: "no")
    assert "none of the self-check cases" in selfcheck.run_self_check(nothing, torch.device("cpu"))


class _FakeXqa:
    def __init__(self):
        self.calls = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        kwargs["out"].fill_(1.0)
        return kwargs["out"]


@pytest.fixture
def fake_xqa(monkeypatch):
    fake = _FakeXqa()
    fake.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in XQA_API])
    decode = types.ModuleType("flashinfer.decode")
    decode.xqa_batch_decode_with_kv_cache_mla = fake
    pkg = types.ModuleType("flashinfer")
    pkg.decode = decode
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", decode)
    monkeypatch.setattr(fi, "SHARED_BYTES", 1 << 20)
    return fake.calls


@pytest.mark.parametrize("q_form", ["cat", "pair"])
def test_xqa_argument_mapping(fake_xqa, q_form):
    args, inputs = _xqa_args(q_form=q_form)
    ws = _Workspace(fi.SHARED_BYTES + 3 * 128 * 576 * 2)
    args.lse.fill_(-7.0)
    fi.launch_xqa(args, ws, LaunchConfig(enable_pdl=False))
    (kw,) = fake_xqa
    assert set(kw) <= set(XQA_API)
    q = kw["query"]
    assert q.shape == (3, 1, 128, 576)
    if q_form == "cat":
        assert q.data_ptr() == inputs.q.data_ptr()
    else:  # joined past the semaphores and partials, in the staging area
        assert q.data_ptr() == ws.buf.data_ptr() + fi.SHARED_BYTES
    assert torch.equal(q.reshape(3, 128, 576), torch.cat([args.q_nope, args.q_pe], dim=-1))
    # the workspace: XQA's semaphores at its head (zero at allocation), its partials after them
    region = kw["workspace_buffer"]
    assert region.data_ptr() == ws.buf.data_ptr() and region.numel() == fi.SHARED_BYTES
    assert kw["kv_cache"] is args.kv_cache and kw["block_tables"] is args.block_table
    assert kw["seq_lens"] is args.seq_lens and kw["max_seq_len"] == args.block_table.shape[1] * 64
    assert (kw["kv_lora_rank"], kw["qk_rope_head_dim"]) == (512, 64)
    assert kw["out"].shape == (3, 128, 512) and kw["out"].data_ptr() == args.out.data_ptr()
    assert kw["enable_pdl"] is False and "lse" not in kw and "sinks" not in kw
    assert kw["bmm1_scale"] == pytest.approx(args.softmax_scale) and kw["bmm2_scale"] == 1.0
    assert torch.all(args.out == 1) and torch.all(args.lse == -7.0)  # out written, no LSE touched


def test_xqa_fp8_scales(fake_xqa):
    """XQA scales the logits by bmm1_scale * bmm2_scale and the output by bmm2_scale (csrc/xqa/mla_sm120.cu)."""
    fp8, _ = _xqa_args(q_form="fp8", kv_dtype=FP8, kv_scale=2.0, q_scale=0.5)
    fi.launch_xqa(fp8, _Workspace(fi.SHARED_BYTES), LaunchConfig())
    kw = fake_xqa[-1]
    assert kw["bmm1_scale"] * kw["bmm2_scale"] == pytest.approx(fp8.softmax_scale * 0.5 * 2.0)
    assert kw["bmm2_scale"] == 2.0 and kw["query"].dtype == FP8


def test_xqa_keywords_match_flashinfers_signature():
    """Every keyword the XQA adapter passes is a parameter of the installed FlashInfer's function (0.6.14 and 0.7.2
    have the same one), and XQA_API is that parameter list."""
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache_mla as real
    except ImportError as e:
        pytest.skip(f"flashinfer-python is not installed here: {e}")
    params = tuple(inspect.signature(real).parameters)
    assert params == XQA_API
    args, _ = _xqa_args(q_form="pair")
    kw = fi.xqa_call_kwargs(args, _Workspace(fi.SHARED_BYTES + 3 * 128 * 576 * 2), LaunchConfig())
    assert set(kw) <= set(params), set(kw) - set(params)
