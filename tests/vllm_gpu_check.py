"""End-to-end check of the CUTE_MLA backend inside vLLM on a GPU (run by tests/test_vllm_gpu.py).

    python tests/vllm_gpu_check.py MODE [--kv-cache-dtype fp8] [--speculative-tokens N] [--block-size B]

MODE ``eager``: vLLM runs the tiny DeepSeek model eagerly with the engine in this process, and every call
of ``CuteMLAImpl.forward_mqa`` is checked against the float32 reference on the very inputs vLLM passed (q,
paged cache, block table and seq_lens from our metadata builder). MODE ``graphs``: the same model with CUDA
graphs; generated token ids and their logprobs are printed for comparison with an eager run. Prints one
JSON line ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: the patch applies
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                         "tiny_deepseek", "model")


def install_checker(stats: dict) -> None:
    import torch

    from mla_backend_plugin.kernels.reference import mla_decode_reference
    from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK
    from mla_backend_plugin.vllm.backend import CuteMLAImpl

    original = CuteMLAImpl.forward_mqa

    def checked_forward_mqa(self, q, kv_cache, attn_metadata, layer):
        out, lse = original(self, q, kv_cache, attn_metadata, layer)
        if torch.cuda.is_current_stream_capturing():
            return out, lse
        decode = attn_metadata.decode
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
        q_len = q_nope.shape[0] // decode.block_table.shape[0]
        cache = kv_cache.view(FP8_DTYPE) if self.runner.is_fp8_kv_cache else kv_cache
        ref_out, ref_lse = mla_decode_reference(
            q_nope, q_pe, cache, decode.block_table, decode.seq_lens, q_len, self.scale,
            q_scale=layer._q_scale if q_nope.dtype == FP8_DTYPE else None,
            kv_scale=layer._k_scale if self.runner.is_fp8_kv_cache else None)
        rel = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
        finite = torch.isfinite(ref_lse)
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        lse_inf_ok = bool(torch.equal(torch.isinf(lse), ~finite))
        stats["calls"] += 1
        stats["q_lens"][str(q_len)] = stats["q_lens"].get(str(q_len), 0) + 1
        stats["max_rel_err"] = max(stats["max_rel_err"], rel)
        stats["max_lse_err"] = max(stats["max_lse_err"], lse_err)
        stats["lse_inf_mismatch"] += int(not lse_inf_ok)
        stats["q_dtypes"][str(q_nope.dtype)] = 1
        stats["max_seq_len"] = max(stats["max_seq_len"], int(decode.seq_lens.max().item()))
        return out, lse

    CuteMLAImpl.forward_mqa = checked_forward_mqa


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["eager", "graphs"])
    parser.add_argument("--backend", default="CUTE_MLA")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--speculative-tokens", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fp8-query", action="store_true", help="let vLLM quantise q to fp8 (fp8 KV only)")
    args = parser.parse_args()
    if args.fp8_query:
        os.environ["CUTE_MLA_FP8_QUERY"] = "1"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stats = {"calls": 0, "q_lens": {}, "q_dtypes": {}, "max_rel_err": 0.0, "max_lse_err": 0.0,
             "lse_inf_mismatch": 0, "max_seq_len": 0}
    if args.mode == "eager":
        install_checker(stats)
    extra = {}
    if args.block_size:
        extra["block_size"] = args.block_size
    if args.speculative_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.speculative_tokens,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    llm = LLM(model=MODEL_DIR, attention_backend=args.backend, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=args.mode == "eager", kv_cache_dtype=args.kv_cache_dtype, max_model_len=4096,
              max_num_seqs=32, gpu_memory_utilization=0.4, seed=0, **extra)
    # Ragged prompts (lengths not multiples of any block size), a few long enough to span many pages.
    prompts = [TokensPrompt(prompt_token_ids=[(11 * i + 5 * j) % 4000 + 2 for j in range(n)])
               for i, n in enumerate([1, 5, 17, 64, 100, 333, 1000, 2047])]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=1)
    results = llm.generate(prompts, params)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    logprobs = [[lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)] for r in results]
    print("RESULT " + json.dumps({"mode": args.mode, "backend": args.backend, "stats": stats, "tokens": tokens,
                                  "logprobs": logprobs}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
