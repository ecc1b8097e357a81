"""The eval package on CPU (issue 12): the tasks, the model's MLA against the absorbed decode form our kernels
compute, its checkpoint layout, the statistics and the eval CLI's plan."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from mla_backend_plugin.evals import __main__ as ev
from mla_backend_plugin.evals import tasks
from mla_backend_plugin.evals.model import EvalModel, EvalModelConfig, apply_rope, hf_config, rope_cos_sin
from mla_backend_plugin.kernels.reference import mla_decode_reference


def _facts(prompt: list[int]) -> dict[int, int]:
    return {prompt[i + 1]: prompt[i + 2] for i in range(len(prompt) - 2) if prompt[i] == tasks.PAIR}


@pytest.mark.parametrize("length", [64, 1000, 8192])
def test_problems_are_well_formed_and_reproducible(length):
    for seed in range(5):
        r = tasks.make_problem("retrieve", length, seed)
        assert len(r.prompt) == length and r == tasks.make_problem("retrieve", length, seed)
        facts = _facts(r.prompt)
        assert len(facts) == tasks.pairs_for(length)
        keys = r.prompt[-tasks.RETRIEVE_KEYS - 1:-1]
        assert r.prompt[-tasks.RETRIEVE_KEYS - 2] == tasks.QUERY and r.prompt[-1] == tasks.ANSWER
        assert r.answer == [facts[k] for k in keys]
        h = tasks.make_problem("hop2", length, seed)
        facts = _facts(h.prompt)
        assert h.prompt[-3] == tasks.HOP and h.answer == [facts[h.prompt[-2]], facts[facts[h.prompt[-2]]]]
    assert max(tasks.make_problem("retrieve", 8192, 0).prompt) < tasks.VOCAB_SIZE
    assert tasks.eval_problems("hop2", 256, 3)[0].seed >= tasks.EVAL_SEED_BASE


def test_training_sequences_supervise_only_answers():
    seq, mask = tasks.training_sequence(2048, 7)
    assert len(seq) == len(mask) == 2048 and sum(mask) > 100
    facts = _facts(seq)
    for i, m in enumerate(mask):
        if m:  # every supervised token follows a key it answers for, or is the next link of a chain
            assert seq[i] in facts.values()


def _naive_attention_rows(model: EvalModel, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output of the last position, the absorbed way vLLM decodes: q_nope through W_UK into
    the latent space, softmax over [latent, k_pe] with the package's float32 MLA reference, W_UV, o_proj."""
    c = model.c
    layer = model.layers[0]
    a = layer.self_attn
    h = c.num_attention_heads
    xn = torch.nn.functional.rms_norm(x, (c.hidden_size,), layer.input_layernorm, c.rms_norm_eps)
    t = x.shape[1]
    cos, sin = rope_cos_sin(torch.arange(t), c)
    q = a.q_proj(xn[:, -1]).view(h, c.qk_head_dim)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
    q_pe = apply_rope(q_pe, cos[-1:], sin[-1:])
    latent, k_pe = a.kv_a_proj_with_mqa(xn[0]).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    latent = torch.nn.functional.rms_norm(latent, (c.kv_lora_rank,), a.kv_a_layernorm, c.rms_norm_eps)
    k_pe = apply_rope(k_pe, cos, sin)
    w = a.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    w_uk, w_uv = w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]
    q_lat = torch.einsum("hn,hnl->hl", q_nope, w_uk)
    cache = torch.cat([latent, k_pe], dim=-1).view(t // 16, 16, 576)
    out_lat, _ = mla_decode_reference(q_lat[None], q_pe[None], cache, torch.arange(t // 16, dtype=torch.int32)[None],
                                      torch.tensor([t], dtype=torch.int32), 1, c.softmax_scale)
    o = torch.einsum("hl,hvl->hv", out_lat[0].to(w_uv.dtype), w_uv)
    return a.o_proj(o.reshape(1, -1))


def test_model_attention_is_the_absorbed_mla_our_kernels_compute():
    torch.manual_seed(0)
    c = EvalModelConfig.from_hf(hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=1))
    model = EvalModel(c).double()
    for p in model.parameters():
        p.data.normal_(0, 0.2)  # not the small init: make the softmax far from uniform
    x = torch.randn(1, 48, c.hidden_size, dtype=torch.float64)
    layer = model.layers[0]
    cos, sin = rope_cos_sin(torch.arange(48), c)
    xn = torch.nn.functional.rms_norm(x, (c.hidden_size,), layer.input_layernorm, c.rms_norm_eps)
    expanded = layer.self_attn(xn, cos, sin)[:, -1]
    absorbed = _naive_attention_rows(model, x)
    # the reference runs in float32: agreement to float32 rounding
    torch.testing.assert_close(expanded, absorbed.to(expanded.dtype), rtol=1e-4, atol=1e-5)
    assert expanded.abs().max() > 1e-2


def test_rope_is_gptj_style():
    """Pairs (x[2i], x[2i+1]) rotate by position / theta^(2i/d): what vLLM applies to DeepSeek (not neox)."""
    x = torch.zeros(1, 64)
    x[0, 2], x[0, 3] = 1.0, 0.0  # pair 1
    c = EvalModelConfig.from_hf(hf_config(tasks.VOCAB_SIZE, rope_scaling=None))
    cos, sin = rope_cos_sin(torch.tensor([5]), c)
    y = apply_rope(x, cos, sin)
    angle = 5 / 10000 ** (2 / 64)
    assert torch.allclose(y[0, 2:4], torch.tensor([math.cos(angle), math.sin(angle)]), atol=1e-6)
    assert y[0, :2].abs().max() == 0 and y[0, 4:].abs().max() == 0


def test_checkpoint_round_trip_in_hf_layout(tmp_path):
    import json

    hf = hf_config(tasks.VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = EvalModel(EvalModelConfig.from_hf(hf))
    model.save_hf(str(tmp_path), dtype=torch.float32)
    again = EvalModel.load_hf(str(tmp_path))
    names = set(again.hf_state_dict())
    assert "model.layers.1.self_attn.kv_b_proj.weight" in names and "lm_head.weight" in names
    assert again.hf_state_dict()["model.layers.1.self_attn.kv_b_proj.weight"].shape == (16 * 64, 512)
    tokens = torch.tensor([tasks.make_problem("retrieve", 64, 0).prompt])
    torch.testing.assert_close(again(tokens), model.eval()(tokens))
    with pytest.raises(ValueError, match="q_lora_rank null"):
        EvalModelConfig.from_hf({**hf, "q_lora_rank": 1536})


def test_statistics():
    lo, hi = ev.wilson(50, 100)
    assert 0.40 < lo < 0.41 and 0.59 < hi < 0.60
    assert ev.wilson(0, 10)[0] == 0.0 and ev.wilson(10, 10)[1] == 1.0
    assert ev.worse_p_value(40, 100, 80, 100) < 1e-6 and ev.worse_p_value(80, 100, 40, 100) > 0.99
    p = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    q = torch.log_softmax(torch.tensor([1.0, 2.0, 2.5]), 0)
    assert ev.kl_divergence(p, p) == 0 and ev.kl_divergence(p, q) > 0


def test_verdicts_flag_a_worse_kernel_only():
    def row(cond, ours, hits, kl=1e-4):
        return {"condition": cond, "ours": ours, "kv_dtype": "auto", "task": "retrieve", "length": 1024,
                "hits": hits, "n": 100, "accuracy": hits / 100, "kl_mean": kl}
    rows = [row("reference", False, 90, 0.0), row("FLASHMLA", False, 89), row("CUTE_MLA[cute_sm90]", True, 88)]
    assert ev.verdicts(rows) == []
    bad = rows + [row("CUTE_MLA[triton]", True, 60), row("CUTE_MLA[xqa_sm120]", True, 89, kl=0.5)]
    found = ev.verdicts(bad)
    assert len(found) == 3 and all("triton" in f or "xqa" in f for f in found), found


def test_outputs_and_dry_run(tmp_path):
    rows = [{"condition": "reference", "ours": False, "kv_dtype": "auto", "mode": "-", "spec": 0, "task": t,
             "length": n, "hits": 9, "n": 10, "accuracy": 0.9, "ci_low": 0.6, "ci_high": 0.98, "kl_mean": 0.0,
             "kl_max": 0.0, "kl_tokens": 0} for t in tasks.TASKS for n in (1024, 4096)]
    paths = ev.write_outputs(rows, str(tmp_path))
    assert any(p.endswith(".png") for p in paths)
    with open(paths[1]) as f:
        assert "| reference | retrieve | 1024 | 0.900" in f.read()
    conds = ev.conditions(["CUTE_MLA", "TRITON_MLA", "FLASH_ATTN_MLA"], ["auto", "triton"], ["auto", "fp8"],
                          ["eager", "graphs"], [0, 3])
    labels = {c.label for c in conds}
    assert "CUTE_MLA[triton] kv=fp8 graphs spec3" in labels and "TRITON_MLA kv=bf16 eager" in labels
    assert not any("TRITON_MLA" in lb and "spec" in lb for lb in labels)  # one token per step there
    assert not any("FLASH_ATTN_MLA" in lb and "fp8" in lb for lb in labels)
    out = subprocess.run([sys.executable, "-m", "mla_backend_plugin.evals", "--dry-run", "--problems", "2"],
                         capture_output=True, text=True, check=True).stdout
    assert "conditions x" in out and "CUTE_MLA[cute_sm90] kv=fp8 graphs spec3" in out


@pytest.mark.parametrize("rope_scaling", [None, "deepseek_v3"])
def test_rope_and_softmax_scale_are_vllms(rope_scaling):
    """The model's rope (YaRN as DeepSeek-V3 configures it, or none) equals vLLM's own rotary embedding for
    DeepSeek (get_rope with rope_type deepseek_yarn, not neox), at positions across and past the original 4096,
    and the softmax scale equals the one vLLM's DeepSeek attention computes."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from mla_backend_plugin.evals.model import DEEPSEEK_V3_YARN, yarn_mscale

    scaling = DEEPSEEK_V3_YARN if rope_scaling else None
    hf = hf_config(tasks.VOCAB_SIZE, rope_scaling=scaling)
    c = EvalModelConfig.from_hf(hf)
    params = ({**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "deepseek_yarn"} if scaling
              else {"rope_type": "default", "rope_theta": c.rope_theta})
    if scaling:
        params["rope_theta"] = c.rope_theta
    positions = torch.tensor([0, 1, 17, 1000, 4095, 4096, 8191, 16000])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, c.qk_rope_head_dim, generator=gen)  # as DeepSeek calls it: [T, H, 64]
    k = torch.randn(len(positions), 1, c.qk_rope_head_dim, generator=gen)
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    # vLLM's custom ops read the current config when built
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(c.qk_rope_head_dim, max_position=hf["max_position_embeddings"], rope_parameters=params,
                        is_neox_style=False, dtype=torch.float32)
        q_vllm, k_vllm = rope.forward_native(positions, q.clone(), k.clone())
    cos, sin = rope_cos_sin(positions, c)
    q_ours = apply_rope(q.transpose(0, 1), cos, sin).transpose(0, 1)  # ours: [..., T, 64]
    torch.testing.assert_close(q_ours, q_vllm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k[:, 0], cos, sin), k_vllm[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q_ours, q, atol=1e-2)  # it rotated
    # vLLM's DeepseekV2(MLA)Attention: scaling = qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2
    m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) if scaling else 1.0
    assert c.softmax_scale == pytest.approx(c.qk_head_dim ** -0.5 * m * m)
    if scaling:
        assert m > 1.3 and hf["max_position_embeddings"] == 163840
