"""The SGLang plugin without a GPU: the version gate, registration through SGLang's plugin loader, argument
resolution, the page-table builder and a decode step through the backend against SGLang's own MLA reference
(its attention test kit, run on the CPU with our float32 reference kernel).

The tests that need SGLang run in CI's third environment (sglang 0.5.23) and skip where it is not installed."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import unittest
from types import SimpleNamespace

import pytest
import sglang_kit
import torch
from sglang_kit import write_kv_without_triton

from mla_backend_plugin.sglang import compat as sgl_compat
from mla_backend_plugin.sglang import register as sgl_register

# --- no SGLang needed


@pytest.mark.parametrize("version", ["0.5.14", "0.5.16", "0.5.17", "0.5.17.post1", "0.5.18", "0.5.20rc1",
                                     "0.5.23", "0.5.23.post1"])
def test_version_gate_accepts(version):
    sgl_compat.check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.5.13", "0.5.24", "0.5.24rc0", "0.6.0", "0.4.9"])
def test_version_gate_refuses_naming_the_version_and_the_range(version):
    with pytest.raises(RuntimeError, match=rf"SGLang {version} is not supported; supported: sglang 0\.5\.14 \.\. "
                                            r"0\.5\.23 \(pip install 'sglang==0\.5\.23'\)"):
        sgl_compat.check_sglang_version(version)


def test_extra_matches_the_supported_range():
    """setup.cfg's ``sglang`` extra allows exactly the versions the gate accepts."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    low, high = sgl_compat.SUPPORTED_SGLANG_VERSIONS
    assert cfg["options.extras_require"]["sglang"].split() == [f"sglang>={low},<={high}"]


def test_entry_point_declared():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.value == "mla_backend_plugin.sglang.register:register"]
    assert [ep.name for ep in ours] == ["cute_mla"]


def test_import_is_light():
    """The entry point's module imports neither SGLang nor torch (SGLang loads plugins in every process)."""
    code = ("import sys, mla_backend_plugin.sglang.register as m; "
            "print(sorted(k for k in ('sglang', 'torch', 'vllm') if k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- with SGLang (CI: 0.5.23)

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")


@needs_sglang
def test_register_is_idempotent():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    sgl_register.register()
    sgl_register.register()
    assert ATTENTION_BACKEND_CHOICES.count("cute_mla") == 1
    assert ATTENTION_BACKENDS["cute_mla"] is sgl_register.create_backend
    assert "cutedsl_mla" in ATTENTION_BACKEND_CHOICES  # SGLang's own, different backend keeps its name


@needs_sglang
def test_sglang_plugin_loader_registers_us_and_the_cli_resolves():
    """What ``python -m sglang.launch_server`` does: load_plugins() (our entry point, whitelisted by
    SGLANG_PLUGINS), then parse arguments, in a fresh process."""
    code = """
import argparse
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs
load_plugins()
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
full = parser.parse_args(["--model-path", "m", "--attention-backend", "cute_mla", "--page-size", "64"])
hybrid = parser.parse_args(["--model-path", "m", "--decode-attention-backend", "cute_mla",
                            "--prefill-attention-backend", "fa3", "--page-size", "32"])
print(full.attention_backend, full.page_size, hybrid.decode_attention_backend, hybrid.prefill_attention_backend)
"""
    env = dict(os.environ, SGLANG_PLUGINS="cute_mla")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-4:] == ["cute_mla", "64", "cute_mla", "fa3"]


@needs_sglang
def test_server_args_resolve_to_cute_mla():
    """SGLang's argument resolution (ServerArgs.__post_init__, on the tiny DeepSeek-V3 config) keeps cute_mla as
    the backend of both phases, or of decode beside the prefill backend asked for. device="cpu": resolution
    needs an accelerator otherwise; the CUDA-only rules it skips do not name our backend."""
    code = """
import os
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs
load_plugins()
model = os.path.join("examples", "tiny_deepseek", "model")
full = ServerArgs(model_path=model, page_size=64, device="cpu", load_format="dummy", skip_tokenizer_init=True,
                  attention_backend="cute_mla")
hybrid = ServerArgs(model_path=model, page_size=32, device="cpu", load_format="dummy", skip_tokenizer_init=True,
                    decode_attention_backend="cute_mla", prefill_attention_backend="triton")
if hasattr(ServerArgs, "get_attention_backends"):  # sglang <= 0.5.17
    backends = ServerArgs.get_attention_backends
else:  # 0.5.23: the resolution moved into arg_groups
    from sglang.srt.arg_groups.overrides import attention_backends_of as backends
print("BACKENDS", *backends(full), *backends(hybrid), full.page_size)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SGLANG_PLUGINS="cute_mla")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("BACKENDS")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    assert lines[-1].split()[1:] == ["cute_mla", "cute_mla", "triton", "cute_mla", "64"]


@needs_sglang
def test_cli_refuses_the_name_without_the_plugin():
    code = """
import argparse
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
parser.parse_args(["--model-path", "m", "--attention-backend", "cute_mla"])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0 and "invalid choice: 'cute_mla'" in res.stderr


@needs_sglang
def test_factory_refuses_an_unsupported_sglang(monkeypatch):
    monkeypatch.setattr(sgl_compat, "installed_sglang_version", lambda: "0.5.24")
    with pytest.raises(RuntimeError,
                       match=r"SGLang 0\.5\.24 is not supported; supported: sglang 0\.5\.14 \.\. 0\.5\.23"):
        sgl_register.create_backend(object())


@needs_sglang
def test_deepseek_dispatch_is_tritons():
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        handle_attention_triton,
    )

    sgl_register._register_deepseek_dispatch()
    assert AttentionBackendRegistry.get_handler("cute_mla") is handle_attention_triton


@needs_sglang
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("new_tokens", [0, 3])
def test_page_tables_from_req_to_token(page_size, new_tokens):
    """Each request's pages in a permuted order; the table holds slot // page_size of every page's first slot,
    and lengths get the verify step's draft tokens added."""
    from mla_backend_plugin.sglang.backend import PagedDecodeTables

    gen = torch.Generator().manual_seed(page_size + new_tokens)
    pool_reqs, max_context, num_pages = 6, 8 * page_size, 64
    perm = torch.randperm(num_pages, generator=gen)
    req_to_token = torch.zeros(pool_reqs, max_context, dtype=torch.int32)
    pages_of = {}
    for r in range(pool_reqs):
        pages = perm[r * 8:(r + 1) * 8]
        pages_of[r] = pages
        slots = pages[:, None] * page_size + torch.arange(page_size)[None, :]
        req_to_token[r] = slots.reshape(-1).to(torch.int32)
    tables = PagedDecodeTables(req_to_token, page_size, max_batch=4)
    req_pool_indices = torch.tensor([5, 0, 3], dtype=torch.int64)
    seq_lens = torch.tensor([1, 8 * page_size - 3, page_size + 1], dtype=torch.int64)
    tables.fill(req_pool_indices, seq_lens, batch=3, new_tokens=new_tokens)
    page_table, lens = tables.views(3)
    assert page_table.dtype == torch.int32 and lens.dtype == torch.int32
    for row, r in enumerate(req_pool_indices.tolist()):
        assert torch.equal(page_table[row], pages_of[r].to(torch.int32))
    assert lens.tolist() == [int(x) + new_tokens for x in seq_lens]
    with pytest.raises(RuntimeError, match="exceeds"):
        tables.views(5)


@needs_sglang
@pytest.mark.parametrize("page_size,num_heads,prefix_lens,fp8", [(16, 16, (14, 15, 16, 40), False),
                                                                  (64, 32, (7, 129), False),
                                                                  (32, 16, (31, 70), True)])
def test_decode_through_sglang_kit_on_cpu(monkeypatch, page_size, num_heads, prefix_lens, fp8):
    """One DECODE step of SGLang's tiny DeepSeek MLA layer (its attention test kit, dims 512 + 64) through our
    backend with the float32 reference kernel, against the kit's own attention reference. The kit writes the
    KV cache itself (shuffled pages) and passes the concatenated q, as DeepSeek does for our backend."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    sgl_register.register()
    kit = sglang_kit.kit()
    write_kv_without_triton(monkeypatch)
    case = kit.MLAAttentionCase(name=f"cute_mla_decode_p{page_size}_h{num_heads}", backend="cute_mla",
                                forward_mode=kit.ForwardMode.DECODE, num_heads=num_heads, page_size=page_size,
                                prefix_lens=prefix_lens)
    fixture = kit.build_mla_attention_fixture(unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64,
                                              hidden_size=64, max_context_len=4 * 64, dtype=torch.bfloat16,
                                              device="cpu", fp8_kv_cache=fp8)
    from mla_backend_plugin.sglang.backend import CuteMLAAttnBackend

    assert isinstance(fixture.backend, CuteMLAAttnBackend)
    assert fixture.backend.kv_cache_dtype == ("fp8_e4m3" if fp8 else "auto")
    assert sglang_kit.poison(fixture) > 0
    actual = kit.run_mla_fixture_eager(fixture)
    expected = kit.expected_mla_fixture_output(fixture)  # from the unquantised latents
    atol = 0.15 if fp8 else 3e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=3e-2)


@needs_sglang
def test_page_size_one_is_refused_with_the_allowed_values(monkeypatch):
    sgl_register.register()
    kit = sglang_kit.kit()
    case = kit.MLAAttentionCase(name="cute_mla_page1", backend="cute_mla", forward_mode=kit.ForwardMode.DECODE,
                                num_heads=16, page_size=1, prefix_lens=(3,))
    with pytest.raises(ValueError, match=r"--page-size 1 is not supported; allowed: 16, 32, 64, 128"):
        kit.build_mla_attention_fixture(unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64,
                                        max_context_len=64, dtype=torch.bfloat16, device="cpu")


@needs_sglang
def test_wrong_mla_dims_are_refused():
    sgl_register.register()
    kit = sglang_kit.kit()
    case = kit.MLAAttentionCase(name="cute_mla_dims", backend="cute_mla", forward_mode=kit.ForwardMode.DECODE,
                                num_heads=16, page_size=16, prefix_lens=(3,))
    with pytest.raises(ValueError, match="kv_lora_rank=512 and qk_rope_head_dim=64"):
        kit.build_mla_attention_fixture(unittest.TestCase(), case, kv_lora_rank=32, qk_rope_head_dim=0,
                                        max_context_len=64, dtype=torch.bfloat16, device="cpu")


@needs_sglang
@pytest.mark.parametrize("page_size,q_len,prefix_lens", [(16, 2, (14, 33)), (32, 4, (5, 31, 64))])
def test_chain_verify_through_sglang_kit_on_cpu(monkeypatch, page_size, q_len, prefix_lens):
    """TARGET_VERIFY of a chain draft (EAGLE, topk 1) of q_len tokens: SGLang's seq_lens exclude the drafts, whose
    KV the kit writes first; each draft row attends causally. Against the kit's custom-mask reference."""
    monkeypatch.setenv("CUTE_MLA_KERNEL", "reference")
    sgl_register.register()
    kit = sglang_kit.kit()
    write_kv_without_triton(monkeypatch)
    case = kit.MLAAttentionCase(name=f"cute_mla_verify_p{page_size}_q{q_len}", backend="cute_mla",
                                forward_mode=kit.ForwardMode.TARGET_VERIFY, num_heads=16, page_size=page_size,
                                prefix_lens=prefix_lens, extend_lens=(q_len,) * len(prefix_lens))
    fixture = kit.build_mla_attention_fixture(unittest.TestCase(), case, kv_lora_rank=512, qk_rope_head_dim=64,
                                              max_context_len=4 * 64, dtype=torch.bfloat16, device="cpu")
    # what SGLang's verify step hands the backend (the kit's verify runner does the same; it imports
    # sgl_kernel, which needs a GPU): lengths without the drafts, and the chain draft's spec info
    batch = fixture.forward_batch
    batch.seq_lens = torch.tensor(prefix_lens, dtype=torch.int32)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    batch.seq_lens_sum = sum(prefix_lens)
    batch.spec_info = SimpleNamespace(topk=1, draft_token_num=q_len, custom_mask=None)
    served = []
    from mla_backend_plugin.sglang.backend import CuteMLAAttnBackend

    original = CuteMLAAttnBackend._forward_ours

    def spy(self, *args, **kwargs):
        served.append(self.cute_metadata.q_len)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CuteMLAAttnBackend, "_forward_ours", spy)
    assert sglang_kit.poison(fixture) > 0
    actual = kit.run_mla_fixture_eager(fixture)
    expected = kit.expected_mla_fixture_output(fixture)  # row t of a request sees prefix + t + 1 keys
    torch.testing.assert_close(actual.float(), expected.float(), atol=3e-2, rtol=3e-2)
    assert served == [q_len]  # ours served it, not the Triton fallback


@needs_sglang
def test_which_steps_are_ours():
    """DECODE without spec info and chain TARGET_VERIFY are ours; the draft's multi-step decode (spec info),
    tree verify and extend go to SGLang's Triton path."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from mla_backend_plugin.sglang.backend import CuteMLAAttnBackend, _chain_verify_q_len

    assert _chain_verify_q_len(None, 0) is None
    assert _chain_verify_q_len(3, 1) == 3 and _chain_verify_q_len(3, 0) == 3
    assert _chain_verify_q_len(3, 4) is None
    assert _chain_verify_q_len(6, 1) is None
    backend = object.__new__(CuteMLAAttnBackend)
    backend.verify_q_len = 3

    def fb(mode, spec_info=None):
        return SimpleNamespace(forward_mode=mode, spec_info=spec_info)

    assert backend._serves(fb(ForwardMode.DECODE))
    assert backend._serves(fb(ForwardMode.IDLE))
    assert not backend._serves(fb(ForwardMode.DECODE, SimpleNamespace(topk=1)))
    assert backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(topk=1)))
    assert not backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(topk=2)))
    assert not backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(draft_token_num=3)))  # n-gram tree
    assert not backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(topk=1, draft_token_num=2)))
    assert backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(topk=1, draft_token_num=3)))
    assert not backend._serves(fb(ForwardMode.EXTEND))
    assert not backend._serves(fb(ForwardMode.DRAFT_EXTEND_V2))
    backend.verify_q_len = None
    assert not backend._serves(fb(ForwardMode.TARGET_VERIFY, SimpleNamespace(topk=1)))
