"""One condition in a worker process: one vLLM engine (or the torch model) generating every problem's answer
with the full next-token distribution of each generated token."""

from __future__ import annotations

import json
import math
import os
import signal
import sys

from mla_backend_plugin.evals import tasks
from mla_backend_plugin.evals.plan import TORCH, Condition
from mla_backend_plugin.evals.reference import TorchReference, torch_device

MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 32768  # four 8k prompts per step: the prefill of 600 prompts takes ~100 engine steps
# with a fixed KV cache (kv_cache_memory_bytes) vLLM uses gpu_memory_utilization only to demand that much free
# memory at startup: keep it small so that --jobs engines start side by side
STARTUP_FREE_FRACTION = 0.05


def kv_cache_bytes(hf: dict, max_model_len: int, max_num_seqs: int = MAX_NUM_SEQS) -> int:
    """A KV cache that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens at 2 bytes per value (an fp8
    cache gets twice the blocks), plus a quarter for block rounding and n-gram lookahead slots: no request waits
    or is preempted for cache space, in any run."""
    per_token = hf["num_hidden_layers"] * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * 2
    return int(per_token * max_model_len * max_num_seqs * 1.25)


def engine_kwargs(cond: Condition, hf: dict, max_prompt_len: int) -> dict:
    """vLLM ``LLM(...)`` arguments of a condition; the same whatever ``--jobs`` is. ``kv_cache_memory_bytes`` is
    per GPU: every TP rank holds the whole latent cache, a DCP rank its share of the tokens."""
    max_len = max_prompt_len + 16
    kwargs = dict(attention_backend=cond.backend, skip_tokenizer_init=True, enforce_eager=cond.mode == "eager",
                  kv_cache_dtype=cond.kv_dtype, max_model_len=max_len, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=max(MAX_NUM_BATCHED_TOKENS, max_len),
                  max_logprobs=hf["vocab_size"], kv_cache_memory_bytes=kv_cache_bytes(hf, max_len),
                  gpu_memory_utilization=STARTUP_FREE_FRACTION, seed=0)
    if cond.spec:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": cond.spec,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    if cond.tp > 1:
        kwargs["tensor_parallel_size"] = cond.tp
    if cond.dcp > 1:
        kwargs.update(decode_context_parallel_size=cond.dcp, cp_kv_cache_interleave_size=cond.interleave)
        if cond.interleave > 1:  # vLLM: the block size a multiple of the interleave; equal = block-level dealing
            kwargs["block_size"] = cond.interleave
    return kwargs


def worker_env(cond: Condition, jobs: int, cache_root: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               # the engine core in the worker itself: every request is queued before the first step, so the
               # batches (and the numerics) do not depend on timing, and one process group holds everything
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               # vLLM writes its compile cache index in place: two engines of one config must not share it
               VLLM_CACHE_ROOT=cache_root)
    env.pop("CUTE_MLA_KERNEL", None)
    if cond.ours and cond.kernel != "auto":
        env["CUTE_MLA_KERNEL"] = cond.kernel
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if jobs > 1:  # N engines on the host's cores: a share each for torch's CPU threads (vLLM compiles on one)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def run_condition(cond: Condition, model_dir: str, problems: list[tasks.Problem]) -> list[dict]:
    """Generate every problem's answer under ``cond``; per problem the tokens and the full log-probability vector
    [tokens, vocab] of each generated token."""
    import torch

    if cond.backend == TORCH:
        from mla_backend_plugin.evals.model import EvalModel

        device = torch_device()
        run = TorchReference(EvalModel.load_hf(model_dir, device=device, dtype=torch.bfloat16), problems, device)
        paths = run.greedy()
        return [{"tokens": p, "logprobs": lp} for p, lp in zip(paths, run.logprobs(paths))]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    vocab = hf["vocab_size"]
    llm = LLM(model=model_dir, **engine_kwargs(cond, hf, max(p.context_len for p in problems)))
    params = [SamplingParams(temperature=0.0, max_tokens=len(p.answer), logprobs=vocab, detokenize=False)
              for p in problems]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p.prompt) for p in problems], params, use_tqdm=False)
    results = []
    for o in outs:
        comp = o.outputs[0]
        dists = torch.full((len(comp.logprobs or []), vocab), -math.inf)
        for row, step in zip(dists, comp.logprobs or []):
            row[list(step)] = torch.tensor([lp.logprob for lp in step.values()])
        results.append({"tokens": list(comp.token_ids), "logprobs": dists})
    return results


def _die_with(parent_pid: int) -> None:
    """SIGKILL this process when the runner dies, however it dies (an OOM kill runs no cleanup): an orphaned
    engine would hold GPU memory and cores for the rest of the call."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the call above
        os._exit(1)


def worker_main(spec_path: str) -> int:
    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    _die_with(spec["runner_pid"])
    with open(spec["problems"]) as f:
        problems = [tasks.Problem(**p) for p in json.load(f)]
    results = run_condition(Condition(**spec["condition"]), spec["model_dir"], problems)
    torch.save(results, spec["out"])
    return 0

