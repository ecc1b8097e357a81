"""Generate with a tiny DeepSeek-V3-shaped model through vLLM, decode attention on the CUTE_MLA backend.

The model (model/config.json) has DeepSeek-V3's attention exactly (128 heads, q_lora_rank 1536,
kv_lora_rank 512, rope 64, yarn) but 2 dense layers and a small hidden size, with dummy weights, so it runs
offline on one GPU in seconds. Token ids go in and come out (no tokenizer).

    python examples/tiny_deepseek/run.py                 # CUDA graphs (vLLM's default)
    python examples/tiny_deepseek/run.py --eager         # no CUDA graphs
    python examples/tiny_deepseek/run.py --kv-cache-dtype fp8 --speculative-tokens 2

Decode context parallelism on two GPUs (the KV cache sharded over the 2 TP ranks; each rank decodes over its
share and vLLM merges the two results with their LSE), compared with the same TP without DCP:

    python examples/tiny_deepseek/run.py --tensor-parallel-size 2 --save /tmp/tp2.json
    python examples/tiny_deepseek/run.py --tensor-parallel-size 2 --decode-context-parallel-size 2 \
        --compare /tmp/tp2.json [--cp-kv-cache-interleave-size 64] [--speculative-tokens 2] [--eager]

Dummy weights depend on how the weights are sharded (vLLM seeds each shard by its size), so a TP 2 run has
other weights than a one-GPU run: compare DCP with the same TP. With dummy weights every backend tends to
produce the same repeating tokens, so equal tokens across backends prove little; tests/test_vllm_gpu.py
compares the attention outputs themselves against the reference.
"""

from __future__ import annotations

import argparse
import json
import os

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="CUTE_MLA", help="attention backend (default: %(default)s)")
    parser.add_argument("--eager", action="store_true", help="disable CUDA graphs (enforce_eager=True)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    parser.add_argument("--block-size", type=int, default=None, help="KV-cache block size (default: vLLM's)")
    parser.add_argument("--speculative-tokens", type=int, default=0,
                        help="n-gram speculative decoding with this many draft tokens (q_len = 1 + n)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (default: %(default)s)")
    parser.add_argument("--decode-context-parallel-size", type=int, default=1,
                        help="shard the KV cache over this many of the TP ranks (divides the TP size)")
    parser.add_argument("--cp-kv-cache-interleave-size", type=int, default=1,
                        help="under DCP: tokens dealt to a rank at a time (1, or a divisor of the block size)")
    parser.add_argument("--save", help="write the generated token ids and their logprobs to this JSON file")
    parser.add_argument("--compare", help="a JSON file written by --save: report where this run differs from it")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {}
    if args.block_size is not None:
        extra["block_size"] = args.block_size
    if args.speculative_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.speculative_tokens,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if args.tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = args.tensor_parallel_size
    if args.decode_context_parallel_size > 1:
        extra["decode_context_parallel_size"] = args.decode_context_parallel_size
        extra["cp_kv_cache_interleave_size"] = args.cp_kv_cache_interleave_size
    llm = LLM(
        model=MODEL_DIR,
        attention_backend=args.backend,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=args.eager,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=4096,
        max_num_seqs=64,
        gpu_memory_utilization=0.5,
        seed=0,
        **extra,
    )
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 4000 + 2 for j in range(16 + 37 * i)])
               for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False,
                            logprobs=1)
    runs = []
    for i, result in enumerate(llm.generate(prompts, params)):
        out = result.outputs[0]
        runs.append({"tokens": list(out.token_ids),
                     "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]})
        print(f"prompt {i} ({len(prompts[i]['prompt_token_ids'])} tokens) -> {out.token_ids}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)["runs"]
        same = True
        for i, (a, b) in enumerate(zip(runs, other)):
            n = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
            common = len(a["tokens"]) if n is None else n
            diff = max((abs(x - y) for x, y in zip(a["logprobs"][:common], b["logprobs"][:common])), default=0.0)
            same &= n is None
            print(f"prompt {i}: " + ("same tokens" if n is None else f"first different token at {n}")
                  + f", max |logprob difference| over the common tokens {diff:.3g}")
        print("COMPARE: " + ("same tokens as " if same else "tokens differ from ") + args.compare)


if __name__ == "__main__":
    main()
