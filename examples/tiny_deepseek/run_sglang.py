"""Generate with the tiny DeepSeek-V3-shaped model through SGLang, decode attention on the cute_mla backend.

The SGLang counterpart of run.py: the same model directory (DeepSeek-V3's attention, 2 dense layers, dummy
weights, no tokenizer: token ids in and out), one GPU, sglang 0.5.14 .. 0.5.17 with this package installed
(its ``sglang.srt.plugins`` entry point registers ``cute_mla``).

    python examples/tiny_deepseek/run_sglang.py                     # cute_mla for decode and (via SGLang's
                                                                    # Triton backend) prefill; CUDA graphs
    python examples/tiny_deepseek/run_sglang.py --decode-only       # decode on cute_mla, prefill on SGLang's
                                                                    # default (FA3 on Hopper)
    python examples/tiny_deepseek/run_sglang.py --eager --kv-cache-dtype fp8_e4m3 --page-size 32
    python examples/tiny_deepseek/run_sglang.py --backend triton --save /tmp/triton.json
    python examples/tiny_deepseek/run_sglang.py --compare /tmp/triton.json

SGLang's page size defaults to 1 on CUDA; cute_mla needs 16, 32, 64 or 128 (default here: 64). With dummy
weights every backend tends to produce the same repeating tokens, so equal tokens prove little; the attention
outputs themselves are compared with the reference in tests/test_sglang_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os

MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cute_mla", help="SGLang attention backend (default: %(default)s)")
    parser.add_argument("--decode-only", action="store_true",
                        help="--decode-attention-backend only: SGLang keeps its default prefill backend")
    parser.add_argument("--eager", action="store_true", help="disable CUDA graphs")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8_e4m3")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per KV page: 16, 32, 64 or 128")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--save", help="write the generated token ids to this JSON file")
    parser.add_argument("--compare", help="a JSON file written by --save: report where this run differs from it")
    args = parser.parse_args()

    import sglang

    backend_args = ({"decode_attention_backend": args.backend} if args.decode_only
                    else {"attention_backend": args.backend})
    engine = sglang.Engine(model_path=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True,
                           page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                           disable_cuda_graph=args.eager, mem_fraction_static=0.5, cuda_graph_max_bs_decode=16,
                           random_seed=0, **backend_args)
    try:
        # prompts of different lengths, crossing page edges
        prompts = [[(7 * i + 13 * j) % 1000 + 1 for j in range(5 + 37 * i)] for i in range(args.num_prompts)]
        outputs = engine.generate(input_ids=prompts,
                                  sampling_params={"max_new_tokens": args.max_tokens, "temperature": 0.0})
    finally:
        engine.shutdown()
    tokens = [out["output_ids"] for out in outputs]
    for i, ids in enumerate(tokens):
        print(f"prompt {i} ({len(prompts[i])} tokens) -> {ids}")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"backend": args.backend, "tokens": tokens}, f)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        same = sum(a == b for a, b in zip(tokens, other["tokens"]))
        print(f"{same}/{len(tokens)} prompts generate the same tokens as {other['backend']}")


if __name__ == "__main__":
    main()
