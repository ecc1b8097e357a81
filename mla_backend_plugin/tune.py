"""Fill the autotuner's cache ahead of time (ops/autotune.py): ``python -m mla_backend_plugin.tune``.

    python -m mla_backend_plugin.tune                                  # batches 1..256 x S 1k..32k, bf16 + fp8
    python -m mla_backend_plugin.tune --batches 1,8,64 --seq-lens 4096 --q-lens 1,2 --kv-dtypes bf16
    python -m mla_backend_plugin.tune --model DIR --tp 8 --max-model-len 32768   # heads, dtype from config.json
    python -m mla_backend_plugin.tune --dry-run --assume-cc 9.0        # shapes and candidates with reasons, no GPU
    python -m mla_backend_plugin.tune --kv-dtypes bf16 --batches 64 --seq-lens 8192 --triton-tiles quick
                                                                        # the Triton tile sweep, printed only

Shapes are what a vLLM deployment runs: batch and KV-length buckets (powers of two) x q_len x KV dtype, with
the q form and scale form vLLM passes (a (q_nope, q_pe) pair, scale tensors; ``--q-form`` / ``--scales``
change them). Each shape's candidates are timed under CUDA graphs with the KV rotated past L2 (the same timing
core as benchmarks/bench_decode.py), the winner is kept in the tuning cache (``CUTE_MLA_TUNE_CACHE``, written
after every shape), and a table of winners vs the static choice is printed. Shapes already in the cache are
skipped (``--force`` times them again). A later process (vLLM, or any ``mla_decode(kernel="auto")`` call)
loads the cache when it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from mla_backend_plugin.ops.constants import SUPPORTED_BLOCK_SIZES, SUPPORTED_NUM_HEADS, SUPPORTED_Q_LENS

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SEQ_LENS = (1024, 4096, 8192, 32768)
TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def model_shape(model_dir: str, tp: int) -> dict:
    """Heads per rank, model dtype and context length from a Hugging Face / vLLM model directory's config.json
    (DeepSeek-V2/V3/R1 style MLA)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if (cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")) != (512, 64):
        raise SystemExit(f"{model_dir}: kv_lora_rank {cfg.get('kv_lora_rank')} / qk_rope_head_dim "
                         f"{cfg.get('qk_rope_head_dim')}: CUTE_MLA needs 512 / 64 (DeepSeek MLA)")
    heads = cfg["num_attention_heads"]
    if heads % tp:
        raise SystemExit(f"{model_dir}: {heads} heads do not split over --tp {tp}")
    return {"num_heads": heads // tp, "dtype": TORCH_DTYPE_NAMES.get(str(cfg.get("torch_dtype", "bfloat16")), "bf16"),
            "max_model_len": cfg.get("max_position_embeddings")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("shapes")
    g.add_argument("--batches", type=_ints, default=DEFAULT_BATCHES,
                   help="decode batch sizes (requests; rounded up to powers of two)")
    g.add_argument("--seq-lens", type=_ints, help="KV lengths (rounded up to powers of two; default: "
                   "CUTE_MLA_TUNE_SEQ_LENS, else --max-model-len, else 1024,4096,8192,32768)")
    g.add_argument("--q-lens", type=_ints, default=(1,), help="query tokens per request (1 + speculative)")
    g.add_argument("--kv-dtypes", type=_names, default=("bf16", "fp8"),
                   help="KV-cache dtypes: fp8, or bf16/fp16 (a 16-bit cache has the model's dtype)")
    g.add_argument("--q-dtype", choices=("auto", "model", "fp8"), default="auto",
                   help="q with an fp8 cache: the model dtype (CUTE_MLA_FP8_QUERY=0), fp8 (=1), or auto: what "
                        "a vLLM engine on this GPU takes under this environment's CUTE_MLA_FP8_QUERY (by "
                        "default fp8 on SM90)")
    g.add_argument("--dtype", choices=("bf16", "fp16"), help="model dtype (default: --model's, else bf16)")
    g.add_argument("--heads", type=int, help="query heads per rank (default: --model's / --tp, else 128)")
    g.add_argument("--block-size", type=int, default=64, choices=SUPPORTED_BLOCK_SIZES, help="KV page size")
    g.add_argument("--q-form", choices=("pair", "cat"), default="pair",
                   help="how q arrives: vLLM's (q_nope, q_pe) pair (default) or one [T, H, 576] tensor")
    g.add_argument("--scales", choices=("tensor", "float"), default="tensor",
                   help="fp8 scales as device tensors (vLLM) or host floats")
    g.add_argument("--model", help="a model directory (config.json): heads, dtype, max context")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with --model)")
    g.add_argument("--max-model-len", type=int, help="the engine's max_model_len: its block-table width")
    t = p.add_argument_group("tuning")
    t.add_argument("--candidates", help="kernels to time, as CUTE_MLA_CANDIDATES (a,b replaces the arch's set, "
                   "+c adds)")
    t.add_argument("--triton-tiles", choices=("none", "quick", "full"), default="none",
                   help="also time a sweep of Triton tiles (printed; not written to the cache unless --cache)")
    t.add_argument("--budget-s", type=float, help="stop after this many seconds (default: no limit)")
    t.add_argument("--time-per-candidate", type=float, default=0.05, help="seconds of timed replays each")
    t.add_argument("--cache", help="the cache file (default: CUTE_MLA_TUNE_CACHE, else "
                   "~/.cache/mla_backend_plugin/autotune.json)")
    t.add_argument("--force", action="store_true", help="time shapes the cache already holds again")
    t.add_argument("--json", help="also write the results (every candidate's time) to this file")
    t.add_argument("--dry-run", action="store_true", help="list shapes and candidates with reasons; no timing")
    t.add_argument("--assume-cc", default=None, help="--dry-run without a GPU: compute capability, e.g. 9.0")
    args = p.parse_args(argv)
    model = model_shape(args.model, args.tp) if args.model else {}
    args.heads = args.heads or model.get("num_heads") or 128
    if args.heads not in SUPPORTED_NUM_HEADS:
        p.error(f"--heads {args.heads}: allowed {SUPPORTED_NUM_HEADS}")
    args.dtype = args.dtype or model.get("dtype") or "bf16"
    args.max_model_len = args.max_model_len or model.get("max_model_len")
    from mla_backend_plugin import envs

    args.seq_lens = args.seq_lens or envs.CUTE_MLA_TUNE_SEQ_LENS or (
        (args.max_model_len,) if args.max_model_len else DEFAULT_SEQ_LENS)
    for q in args.q_lens:
        if q not in SUPPORTED_Q_LENS:
            p.error(f"--q-lens {q}: allowed {SUPPORTED_Q_LENS}")
    for d in args.kv_dtypes:
        if d not in ("bf16", "fp16", "fp8"):
            p.error(f"--kv-dtypes {d}: allowed bf16, fp16, fp8")
    args.candidates = _names(args.candidates) if args.candidates is not None else None
    return args


def shape_keys(args, cc) -> list:
    from mla_backend_plugin import envs
    from mla_backend_plugin.ops import serving
    from mla_backend_plugin.ops.autotune import Deployment

    keys = []
    for kv in dict.fromkeys("fp8" if d == "fp8" else args.dtype for d in args.kv_dtypes):  # 16-bit = the model's
        fp8_q = args.q_dtype == "fp8" or (args.q_dtype == "auto" and serving.fp8_query(envs.CUTE_MLA_FP8_QUERY, cc))
        q = "fp8" if kv == "fp8" and fp8_q else args.dtype
        for q_len in args.q_lens:
            dep = Deployment(num_heads=args.heads, q_len=q_len, kv_dtype=kv, q_dtype=q,
                             out_dtype=args.dtype, block_size=args.block_size, batches=args.batches,
                             seq_lens=args.seq_lens, q_form="cat" if q == "fp8" else args.q_form,
                             scale_form="none" if kv != "fp8" else args.scales,
                             max_blocks=-(-args.max_model_len // args.block_size) if args.max_model_len else None)
            keys += dep.keys(cc)
    return list(dict.fromkeys(keys))


def _meta_args(key):
    """DecodeArgs of ``key`` on meta tensors (no memory, no GPU): for support checks."""
    from mla_backend_plugin.ops.api import prepare_args
    from mla_backend_plugin.ops.tuned import DTYPES

    meta = torch.device("meta")
    tokens, pages = key.batch * key.q_len, -(-key.seq // key.block_size)
    q_dtype = DTYPES[key.q_dtype]
    q = torch.empty(tokens, key.num_heads, 576, dtype=q_dtype, device=meta)
    q = (q[..., :512], q[..., 512:].clone()) if key.q_form == "pair" else q
    kv = torch.empty(key.batch * pages + 1, key.block_size, 576, dtype=DTYPES[key.kv_dtype], device=meta)
    bt = torch.empty(key.batch, -(-pages // 16) * 16, dtype=torch.int32, device=meta)
    sl = torch.empty(key.batch, dtype=torch.int32, device=meta)
    one = (torch.ones(1, device=meta) if key.scale_form == "tensor" else 1.0) if key.scale_form != "none" else None
    return prepare_args(q, kv, bt, sl, softmax_scale=0.1, q_scale=one if key.q_dtype == "fp8" else None,
                        kv_scale=one if key.kv_dtype == "fp8" else None, out_dtype=DTYPES[key.out_dtype],
                        need_lse=key.lse)


def dry_run(args, cc) -> int:
    from mla_backend_plugin.ops.autotune import candidates_for
    from mla_backend_plugin.ops.registry import candidate_kernels

    keys = shape_keys(args, cc)
    kernels = candidate_kernels(cc, args.candidates)
    print(f"{len(keys)} shapes on compute capability {cc[0]}.{cc[1]}; kernels timed: {', '.join(kernels)}")
    for key in keys:
        found, refused = candidates_for(_meta_args(key), cc, kernels=kernels, check=False)
        print(f"\n{key.id()}: {len(found)} candidates")
        for cand in found:
            print(f"  {cand.label}")
        for what, why in refused.items():
            print(f"  n/a {what}: {why}")
    return 0


class _LineProgress:
    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        for i, item in enumerate(self.items):
            print(f"[{i + 1}/{len(self.items)}] {item.id()}", flush=True)
            yield item


def progress(items):
    """A progress bar over shape keys (tqdm when installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(items)
    return tqdm(list(items), desc="autotune", unit="shape", dynamic_ncols=True, file=sys.stdout)


def print_table(results) -> None:
    """Per shape: the winner, its time and the static choice's on uniform lengths, and where the shape was also
    timed with one long request among short ones (``one-long``), the same two there: the winner is the best worst
    case over both, so it may trail the static choice on one of them."""
    print(f"\n{'shape':<80} {'winner':<42} {'us':>9} {'static us':>9} {'gain':>6}  one-long us (static)")
    for r in results:
        if r.winner is None:
            print(f"{r.key.id():<80} {'(nothing timed)':<42}")
            continue
        best = r.timings_us[r.winner]
        static = r.timings_us.get(r.static)
        gain = f"{static / best:.2f}x" if static else "-"
        static_text = f"{static:.1f}" if static else "-"
        other = r.profile_timings_us.get("one-long", {})
        one_long = (f"  {other[r.winner]:.1f} ({other[r.static]:.1f})" if r.winner in other and r.static in other
                    else "")
        print(f"{r.key.id():<80} {r.labels.get(r.winner, r.winner)[:42]:<42} {best:>9.1f} {static_text:>9} "
              f"{gain:>6}{one_long}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        if args.assume_cc:
            cc = tuple(int(x) for x in args.assume_cc.split("."))
        elif torch.cuda.is_available():
            cc = torch.cuda.get_device_capability()
        else:
            print("--dry-run without a GPU needs --assume-cc (e.g. 9.0)", file=sys.stderr)
            return 2
        return dry_run(args, cc)
    if not torch.cuda.is_available():
        print("python -m mla_backend_plugin.tune needs a CUDA device (--dry-run --assume-cc 9.0 lists the plan)",
              file=sys.stderr)
        return 2
    from mla_backend_plugin.ops import autotune, registry, tuned

    device = torch.device("cuda", torch.cuda.current_device())
    cc = torch.cuda.get_device_capability(device)
    keys = shape_keys(args, cc)
    extra = {}
    if args.triton_tiles != "none":
        from mla_backend_plugin.kernels.triton_decode.config import sweep_configs

        extra["triton"] = sweep_configs(full=args.triton_tiles == "full")
    path = args.cache if args.cache else (None if extra else tuned.default_cache_path())
    cache = tuned.TuneCache(path, tuned.context_for(device))
    cached = cache.load()
    kernels = registry.candidate_kernels(cc, args.candidates)
    print(f"{torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]}); {len(keys)} shapes, "
          f"kernels {', '.join(kernels)}; cache {path or '(none)'} holds {cached} of this context", flush=True)
    t0 = time.monotonic()
    report = autotune.tune_keys(keys, device, budget_s=args.budget_s, cache=cache, force=args.force,
                                progress=progress, time_per_candidate=args.time_per_candidate, kernels=kernels,
                                extra_configs=extra or None,
                                max_blocks=-(-args.max_model_len // args.block_size) if args.max_model_len else None)
    print_table(report["results"])
    print(f"\n{report['tuned']} tuned, {report['cached']} from the cache, {len(report['not_reached'])} not reached "
          f"(budget) in {time.monotonic() - t0:.1f} s; cache: {path or '(none)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": cache.context, "results": [r.as_entry() for r in report["results"]]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
