"""End-to-end check of the cute_mla backend inside SGLang on a GPU (run by tests/test_sglang_gpu.py).

    python tests/sglang_gpu_check.py MODE [--kv-cache-dtype fp8_e4m3] [--page-size 64] [--decode-only]

Runs ``sglang.Engine`` on the tiny DeepSeek-V3 config (examples/tiny_deepseek/model: 128 heads, kv_lora 512,
rope 64, 2 dense layers, dummy weights, no tokenizer) with ragged prompts, MODE ``eager`` (no CUDA graphs) or
``graphs``. SGLang runs the model in a scheduler process; ``CUTE_MLA_CHECK_DIR`` (inherited) makes every decode
call there that is not being captured recompute itself with the float32 reference and append its errors
(ops/serving.py). Prints one JSON line ``RESULT {...}``: the summed check records and the generated tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                         "tiny_deepseek", "model")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["eager", "graphs"])
    parser.add_argument("--backend", default="cute_mla")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--decode-only", action="store_true", help="--decode-attention-backend only")
    parser.add_argument("--prefill-backend", default=None,
                        help="with --decode-only: SGLang's prefill backend (default: SGLang's choice, FA3 on Hopper)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    check_dir = tempfile.mkdtemp(prefix="cute_mla_sglang_check_")
    os.environ["CUTE_MLA_CHECK_DIR"] = check_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import sglang

    from mla_backend_plugin.testing.reference_check import read_check_records

    backend_args = ({"decode_attention_backend": args.backend} if args.decode_only
                    else {"attention_backend": args.backend})
    if args.prefill_backend:
        backend_args["prefill_attention_backend"] = args.prefill_backend
    engine = sglang.Engine(model_path=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True,
                           page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                           disable_cuda_graph=args.mode == "eager", mem_fraction_static=0.4,
                           cuda_graph_max_bs_decode=16, context_length=4096, random_seed=0, **backend_args)
    try:
        # ragged prompts (not multiples of any page size), a few spanning many pages
        prompts = [[(11 * i + 5 * j) % 4000 + 2 for j in range(n)]
                   for i, n in enumerate([1, 5, 17, 64, 100, 333, 1000, 2047])]
        outputs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True})
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps({"mode": args.mode, "backend": args.backend, "stats": read_check_records(check_dir),
                                  "tokens": [out["output_ids"] for out in outputs]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
