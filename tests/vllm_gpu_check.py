"""End-to-end check of the CUTE_MLA backend inside vLLM on a GPU (run by tests/test_vllm_gpu.py).

    python tests/vllm_gpu_check.py MODE [--kv-cache-dtype fp8] [--speculative-tokens N] [--block-size B]
        [--tp N --dcp N --interleave I]

MODE ``eager``: vLLM runs the tiny DeepSeek model eagerly with the engine in this process, and every call
of ``CuteMLAImpl.forward_mqa`` is checked against the float32 reference on the very inputs vLLM passed (q,
paged cache, block table and seq_lens from our metadata builder). MODE ``graphs``: the same model with CUDA
graphs; generated token ids and their logprobs are printed for comparison with an eager run. Prints one
JSON line ``RESULT {...}``.

With ``--tp`` > 1 the workers are forked from this process (so they inherit the checker) and append each
call's numbers to files that this process sums up. Under DCP (``--dcp``) every rank's call is checked on its
own shard (local lengths, the per-row limits our builder computed); the merge across ranks is vLLM's, checked
by comparing the generated tokens with a run at the same TP without DCP (tests/test_vllm_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: the patch applies
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STATS_DIR_ENV = "MLA_GPU_CHECK_STATS_DIR"  # where forked workers append their per-call numbers

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                         "tiny_deepseek", "model")


def install_checker(stats: dict) -> None:
    import torch

    from mla_backend_plugin.ops import serving
    from mla_backend_plugin.ops.constants import FP8_DTYPE
    from mla_backend_plugin.testing import reference_check as checks
    from mla_backend_plugin.vllm.backend import CuteMLAImpl

    original = CuteMLAImpl.forward_mqa

    def checked_forward_mqa(self, q, kv_cache, attn_metadata, layer):
        out, lse = original(self, q, kv_cache, attn_metadata, layer)
        if torch.cuda.is_current_stream_capturing():
            return out, lse
        decode = attn_metadata.decode
        q_is_fp8 = (q[0] if isinstance(q, tuple) else q).dtype == FP8_DTYPE
        # DCP with q_len > 1: row_kv_lens holds the limits in local positions; a step of mixed q_lens (token
        # requests) is recomputed request by request from vLLM's own block table and lengths
        token_requests = getattr(decode, "token_requests", None)
        record = checks.reference_check(
            q, serving.kernel_cache(kv_cache, self.runner.kv_cache_dtype), decode.block_table, decode.seq_lens,
            self.scale, out, lse, q_scale=layer._q_scale if q_is_fp8 else None,
            kv_scale=layer._k_scale if self.runner.is_fp8_kv_cache else None,
            row_kv_lens=getattr(decode, "row_kv_lens", None),
            query_lens=token_requests.query_lens if token_requests is not None else None)
        record["dcp_world_sizes"] = {str(max(self.dcp_world_size, 1)): 1}
        stats_dir = os.environ.get(STATS_DIR_ENV)
        if stats_dir:
            checks.append_check_record(stats_dir, record)
        else:
            checks.merge_check_records(stats, record)
        return out, lse

    CuteMLAImpl.forward_mqa = checked_forward_mqa


def collect_worker_stats(stats: dict, stats_dir: str) -> None:
    from mla_backend_plugin.testing.reference_check import merge_check_records, read_check_records

    workers = read_check_records(stats_dir)
    stats["workers"] += workers.pop("processes")
    merge_check_records(stats, workers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["eager", "graphs"])
    parser.add_argument("--backend", default="CUTE_MLA")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--speculative-tokens", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fp8-query", action="store_true", help="let vLLM quantise q to fp8 (fp8 KV only)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    parser.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size (divides --tp)")
    parser.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size under DCP")
    parser.add_argument("--prefix-tails", action="store_true",
                        help="prefix caching on; the prompts are generated once, then again with 5..100 new tokens "
                             "appended: vLLM recomputes only each prompt's uncached tail")
    parser.add_argument("--decode-max-query-len", type=int, default=None,
                        help="CUTE_MLA_DECODE_MAX_QUERY_LEN (1: the tails take vLLM's prefill path)")
    args = parser.parse_args()
    if args.decode_max_query_len is not None:
        os.environ["CUTE_MLA_DECODE_MAX_QUERY_LEN"] = str(args.decode_max_query_len)
    os.environ["CUTE_MLA_FP8_QUERY"] = "1" if args.fp8_query else "0"
    stats_dir = None
    if args.tp > 1 and args.mode == "eager":
        import tempfile

        stats_dir = tempfile.mkdtemp(prefix="cute_mla_check_")
        os.environ[STATS_DIR_ENV] = stats_dir
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the workers inherit the patched forward_mqa

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    stats = {"calls": 0, "q_lens": {}, "q_dtypes": {}, "max_rel_err": 0.0, "max_lse_err": 0.0,
             "lse_inf_mismatch": 0, "max_seq_len": 0, "heads": {}, "dcp_world_sizes": {}, "row_kv_lens_calls": 0,
             "token_request_calls": 0, "workers": 0}
    if args.mode == "eager":
        install_checker(stats)
    extra = {}
    if args.block_size:
        extra["block_size"] = args.block_size
    if args.speculative_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.speculative_tokens,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if args.tp > 1:
        extra["tensor_parallel_size"] = args.tp
    if args.dcp > 1:
        extra["decode_context_parallel_size"] = args.dcp
        extra["cp_kv_cache_interleave_size"] = args.interleave
    if args.prefix_tails:
        extra["enable_prefix_caching"] = True
    llm = LLM(model=MODEL_DIR, attention_backend=args.backend, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=args.mode == "eager", kv_cache_dtype=args.kv_cache_dtype, max_model_len=4096,
              max_num_seqs=32, gpu_memory_utilization=0.4, seed=0, **extra)
    # Ragged prompts (lengths not multiples of any block size), a few long enough to span many pages.
    prompts = [TokensPrompt(prompt_token_ids=[(11 * i + 5 * j) % 4000 + 2 for j in range(n)])
               for i, n in enumerate([1, 5, 17, 64, 100, 333, 1000, 2047])]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=1)
    if args.prefix_tails:
        # cache the prompts, then extend each by 5..100 tokens: every full cached block is reused and the rest
        # (the new tokens plus the partial last block) is one short extend per request
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False))
        prompts = [TokensPrompt(prompt_token_ids=p["prompt_token_ids"] + [(7 * i + 3 * j) % 4000 + 2 for j in range(n)])
                   for i, (p, n) in enumerate(zip(prompts, [5, 9, 17, 40, 100, 33, 64, 21]))]
    results = llm.generate(prompts, params)
    if stats_dir:
        collect_worker_stats(stats, stats_dir)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    logprobs = [[lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)] for r in results]
    print("RESULT " + json.dumps({"mode": args.mode, "backend": args.backend, "tp": args.tp, "dcp": args.dcp,
                                  "interleave": args.interleave, "stats": stats, "tokens": tokens,
                                  "logprobs": logprobs}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
