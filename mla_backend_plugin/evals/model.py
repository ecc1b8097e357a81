"""The eval model in plain torch: DeepSeek-V3's architecture with MLA exactly as vLLM runs it, dense MLP.

Parameter names and shapes are those of a Hugging Face ``DeepseekV3ForCausalLM`` checkpoint (what vLLM's
``deepseek_v2.py`` loads), with ``q_lora_rank: null`` (q through ``q_proj``, as DeepSeek-V2-Lite):

    model.embed_tokens.weight                          [vocab, hidden]
    model.layers.N.input_layernorm.weight              [hidden]
    model.layers.N.self_attn.q_proj.weight             [heads * (nope + rope), hidden]
    model.layers.N.self_attn.kv_a_proj_with_mqa.weight [kv_lora_rank + rope, hidden]
    model.layers.N.self_attn.kv_a_layernorm.weight     [kv_lora_rank]
    model.layers.N.self_attn.kv_b_proj.weight          [heads * (nope + v), kv_lora_rank]
    model.layers.N.self_attn.o_proj.weight             [hidden, heads * v]
    model.layers.N.post_attention_layernorm.weight     [hidden]
    model.layers.N.mlp.{gate,up}_proj.weight           [intermediate, hidden]; down_proj [hidden, intermediate]
    model.norm.weight, lm_head.weight

Rotary embedding as vLLM applies it to DeepSeek (``is_neox_style=False``: rotation of interleaved pairs), on
q's rope part and on the one shared k_pe, with DeepSeek's YaRN scaling when the config has ``rope_scaling``
(vLLM's ``deepseek_yarn``: frequencies blended between interpolation and extrapolation by a ramp over the rotary
dims, cos/sin times mscale / mscale_all_dim, and the softmax scale (nope + rope) ** -0.5 times
yarn_mscale(factor, mscale_all_dim) ** 2). Attention is the expanded (prefill) form; vLLM's decode runs the
absorbed form, the same function.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class EvalModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    # DeepSeek's YaRN (``rope_scaling``); factor 1 = none
    yarn_factor: float = 1.0
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0

    @classmethod
    def from_hf(cls, hf: dict) -> EvalModelConfig:
        if hf.get("q_lora_rank") is not None:
            raise ValueError("the eval model has q_lora_rank null (q_proj)")
        if hf.get("first_k_dense_replace", 0) < hf["num_hidden_layers"]:
            raise ValueError("the eval model has dense MLPs only (first_k_dense_replace = num_hidden_layers)")
        yarn = {}
        scaling = hf.get("rope_scaling")
        if scaling:
            kind = scaling.get("type", scaling.get("rope_type"))
            if kind != "yarn":
                raise ValueError(f"rope_scaling type {kind!r}; the eval model knows DeepSeek's 'yarn' or none")
            yarn = dict(yarn_factor=float(scaling["factor"]),
                        yarn_original_max_position=int(scaling["original_max_position_embeddings"]),
                        yarn_beta_fast=float(scaling.get("beta_fast", 32)),
                        yarn_beta_slow=float(scaling.get("beta_slow", 1)),
                        yarn_mscale=float(scaling.get("mscale", 1)),
                        yarn_mscale_all_dim=float(scaling.get("mscale_all_dim", 0)))
        plain = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("yarn_")]
        return cls(**{name: hf[name] for name in plain}, **yarn)

    @classmethod
    def load(cls, model_dir: str) -> EvalModelConfig:
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls.from_hf(json.load(f))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """vLLM's DeepSeek attention scale: with YaRN it grows by yarn_mscale(factor, mscale_all_dim) ** 2."""
        m = yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim)
        return self.qk_head_dim ** -0.5 * m * m


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 1.0 + 0.1 * mscale * math.log(factor)


def _yarn_dim_of_rotations(rotations: float, dim: int, base: float, original_max: int) -> float:
    """The rotary dim whose wavelength fits ``rotations`` times into the original context."""
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(c: EvalModelConfig, device=None) -> torch.Tensor:
    dim = c.qk_rope_head_dim
    pos_freqs = c.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if c.yarn_factor <= 1:
        return 1.0 / pos_freqs
    # dims that turn fast (many rotations in the original context) keep their frequency, slow ones are
    # interpolated by the factor, with a linear ramp between the two rotation counts
    low = max(math.floor(_yarn_dim_of_rotations(c.yarn_beta_fast, dim, c.rope_theta, c.yarn_original_max_position)), 0)
    high = min(math.ceil(_yarn_dim_of_rotations(c.yarn_beta_slow, dim, c.rope_theta, c.yarn_original_max_position)),
               dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (1.0 / (c.yarn_factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_cos_sin(positions: torch.Tensor, c: EvalModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rope / 2] of the positions, with YaRN's magnitude mscale / mscale_all_dim."""
    freqs = positions.float()[:, None] * rope_inv_freq(c, positions.device)[None, :]
    scale = yarn_mscale(c.yarn_factor, c.yarn_mscale) / yarn_mscale(c.yarn_factor, c.yarn_mscale_all_dim)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style: pairs (x[2i], x[2i + 1]) rotate by angle i; x [..., T, dim], cos/sin [T, dim / 2]."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


class MLA(nn.Module):
    def __init__(self, c: EvalModelConfig):
        super().__init__()
        self.c = c
        h = c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, h * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.Parameter(torch.ones(c.kv_lora_rank))
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * c.v_head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, _ = x.shape
        h = c.num_attention_heads
        q = self.q_proj(x).view(b, t, h, c.qk_head_dim).transpose(1, 2)  # [B, H, T, nope + rope]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_layernorm, c.rms_norm_eps)
        kv = self.kv_b_proj(latent).view(b, t, h, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe[:, None], cos, sin).expand(b, h, t, c.qk_rope_head_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, h * c.v_head_dim))


class MLP(nn.Module):
    def __init__(self, c: EvalModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: EvalModelConfig):
        super().__init__()
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.self_attn = MLA(c)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, self.c.rms_norm_eps), cos, sin)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.c.rms_norm_eps))


class EvalModel(nn.Module):
    """``forward(tokens [B, T]) -> logits [B, T, vocab]`` (positions 0 .. T-1)."""

    def __init__(self, c: EvalModelConfig):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.c)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(rms_norm(x, self.norm, self.c.rms_norm_eps))

    # ---- Hugging Face checkpoint names (what vLLM loads) ----
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm,
               "lm_head.weight": self.lm_head.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            out.update({
                p + "input_layernorm.weight": layer.input_layernorm,
                p + "post_attention_layernorm.weight": layer.post_attention_layernorm,
                p + "self_attn.q_proj.weight": a.q_proj.weight,
                p + "self_attn.kv_a_proj_with_mqa.weight": a.kv_a_proj_with_mqa.weight,
                p + "self_attn.kv_a_layernorm.weight": a.kv_a_layernorm,
                p + "self_attn.kv_b_proj.weight": a.kv_b_proj.weight,
                p + "self_attn.o_proj.weight": a.o_proj.weight,
                p + "mlp.gate_proj.weight": layer.mlp.gate_proj.weight,
                p + "mlp.up_proj.weight": layer.mlp.up_proj.weight,
                p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
            })
        return out

    def save_hf(self, model_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
        from safetensors.torch import save_file

        path = os.path.join(model_dir, "model.safetensors")
        save_file({k: v.detach().to(dtype).contiguous().cpu() for k, v in self.hf_state_dict().items()}, path,
                  metadata={"format": "pt"})
        return path

    @classmethod
    def load_hf(cls, model_dir: str, device="cpu", dtype: torch.dtype = torch.float32) -> EvalModel:
        from safetensors.torch import load_file

        model = cls(EvalModelConfig.load(model_dir))
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
        params = model.hf_state_dict()
        missing = sorted(set(params) - set(tensors))
        extra = sorted(set(tensors) - set(params))
        if missing or extra:
            raise ValueError(f"{model_dir}: checkpoint does not match the config: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(p.shape) != tuple(tensors[name].shape):
                    raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, config wants {tuple(p.shape)}")
                p.copy_(tensors[name])
        return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def greedy_answer(model: EvalModel, prompt: list[int], n: int, device="cpu") -> list[int]:
    """n tokens by greedy decoding (full recompute each step: the reference, not fast)."""
    tokens = torch.tensor([prompt], device=device)
    out = []
    for _ in range(n):
        nxt = int(model(tokens)[0, -1].argmax())
        out.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def widen_heads(src_dir: str, dst_dir: str, factor: int) -> str:
    """Write into ``dst_dir`` the model of ``src_dir`` with every attention head repeated ``factor`` times, the same
    function with ``factor`` x the heads (so that tensor parallelism leaves a head count our kernels take, e.g. the
    16-head eval model as 32 heads: 16 per rank at TP 2). A head's rows of ``q_proj`` and ``kv_b_proj`` are
    repeated, so each copy computes that head's attention output; its columns of ``o_proj`` are repeated and
    divided by ``factor`` (exact in binary floating point), so the copies sum back to the original. Returns
    ``dst_dir``."""
    from safetensors.torch import load_file, save_file

    if factor < 1:
        raise ValueError(f"widen_heads: factor {factor}; allowed: an integer >= 1")
    with open(os.path.join(src_dir, "config.json")) as f:
        hf = json.load(f)
    c = EvalModelConfig.from_hf(hf)
    h = c.num_attention_heads
    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for name, per_head in (("q_proj", c.qk_head_dim), ("kv_b_proj", c.qk_nope_head_dim + c.v_head_dim)):
            w = tensors[p + name + ".weight"]
            tensors[p + name + ".weight"] = w.view(h, per_head, -1).repeat_interleave(factor, 0).reshape(
                h * factor * per_head, -1)
        w = tensors[p + "o_proj.weight"]
        tensors[p + "o_proj.weight"] = (w.view(w.shape[0], h, c.v_head_dim).repeat_interleave(factor, 1)
                                        / factor).reshape(w.shape[0], -1).to(w.dtype)
    os.makedirs(dst_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump({**hf, "num_attention_heads": h * factor, "num_key_value_heads": h * factor}, f, indent=2)
    return dst_dir


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# DeepSeek-V3's rope scaling (its config.json): YaRN stretching a 4096-token original context 40 times
DEEPSEEK_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(vocab_size: int, hidden_size: int = 256, intermediate_size: int = 768, num_hidden_layers: int = 3,
              num_attention_heads: int = 16, qk_nope_head_dim: int = 64, v_head_dim: int = 128,
              rope_scaling: dict | None = DEEPSEEK_V3_YARN, max_position_embeddings: int | None = None,
              rope_theta: float = 10000.0) -> dict:
    """A DeepseekV3ForCausalLM config vLLM 0.26 loads, with DeepSeek's MLA (kv_lora_rank 512, rope 64, YaRN rope
    scaling as DeepSeek-V3 configures it unless ``rope_scaling=None``) and dense MLPs (the MoE fields are required
    by the config class, unused with first_k_dense_replace = all layers). ``max_position_embeddings`` defaults
    to DeepSeek's: the original context times the YaRN factor (163840), else 16384."""
    if max_position_embeddings is None:
        max_position_embeddings = (int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"])
                                   if rope_scaling else 16384)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "moe_intermediate_size": 64, "num_hidden_layers": num_hidden_layers,
        "first_k_dense_replace": num_hidden_layers, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "num_attention_heads": num_attention_heads, "num_key_value_heads": num_attention_heads,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": 64,
        "v_head_dim": v_head_dim, "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 1, "initializer_range": 0.02, "use_cache": True,
    }


__all__ = ["EvalModel", "EvalModelConfig", "apply_rope", "greedy_answer", "hf_config", "num_parameters",
           "rope_cos_sin", "widen_heads"]
