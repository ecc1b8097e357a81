"""The engine-neutral half of a serving backend (vLLM's ``vllm/backend.py``, SGLang's ``sglang/backend.py``).

What every engine's MLA decode backend needs from us, apart from the engine's own classes: the supported
settings and the words that refuse the others, the workspace sized from the engine's limits (allocated once,
before CUDA-graph capture), the cache and scale forms the kernels take, the decode call that returns views
of the workspace's output buffers (no allocation per step), and the autotuner's warm-up (``DeploymentTuning``:
the engine's decode shapes, prepared on the first decode call not being captured).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from mla_backend_plugin import BACKEND_NAME, envs
from mla_backend_plugin.ops import autotune
from mla_backend_plugin.ops.api import mla_decode
from mla_backend_plugin.ops.constants import (
    FP8_DTYPE,
    KV_LORA_RANK,
    MAX_Q_LEN,
    OUT_DTYPES,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_NUM_HEADS,
    dtype_names,
)
from mla_backend_plugin.ops.workspace import SPLIT_CAPACITY, MLAWorkspace

logger = logging.getLogger("mla_backend_plugin")

MIN_COMPUTE_CAPABILITY = (9, 0)
# KV-cache dtype names as engines spell them ("auto" = the model dtype)
KV_CACHE_DTYPE_NAMES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")


def max_decode_q_len(num_speculative_tokens: int | None) -> int:
    """Query tokens per request in a decode step: 1 plus the speculative (MTP / draft) tokens."""
    num_spec = num_speculative_tokens or 0
    q_len = 1 + num_spec
    if q_len > MAX_Q_LEN:
        raise ValueError(
            f"{BACKEND_NAME}: num_speculative_tokens={num_spec} gives {q_len} query tokens per decode step; "
            f"{BACKEND_NAME} supports at most {MAX_Q_LEN} (num_speculative_tokens <= {MAX_Q_LEN - 1})")
    return q_len


def check_num_heads(num_heads: int, dcp_world_size: int = 1) -> int:
    """The query heads of one decode call, refused unless a kernel supports them: the rank's heads, times the
    decode-context-parallel size (the engine gathers the q heads of the DCP group before decode)."""
    total = num_heads * dcp_world_size
    if total not in SUPPORTED_NUM_HEADS:
        if dcp_world_size > 1:
            raise ValueError(
                f"{BACKEND_NAME}: {num_heads} attention heads per rank x decode_context_parallel_size "
                f"{dcp_world_size} = {total} query heads per decode call is not supported; allowed: "
                f"{SUPPORTED_NUM_HEADS}")
        raise ValueError(f"{BACKEND_NAME}: {num_heads} attention heads per rank is not supported; "
                         f"allowed: {SUPPORTED_NUM_HEADS}")
    return total


def dcp_local_kv_lens(global_lens: torch.Tensor, world: int, rank: int, interleave: int) -> torch.Tensor:
    """Decode context parallelism: how many of a request's first ``global_lens`` tokens rank ``rank`` of the
    ``world`` ranks stores, when the tokens are dealt out ``interleave`` at a time (token p lives on rank
    (p // interleave) % world, at local position (p // (world * interleave)) * interleave + p % interleave;
    vLLM's cp_kv_cache_interleave_size). Elementwise on an integer tensor of any shape (int32 result);
    negative lengths count as 0. No host sync."""
    n = global_lens.to(torch.int32).clamp(min=0)
    cycle = world * interleave
    full = torch.div(n, cycle, rounding_mode="floor")
    return (full * interleave + (n - full * cycle - rank * interleave).clamp(0, interleave)).to(torch.int32)


def dcp_row_kv_lens(global_seq_lens: torch.Tensor, q_len: int, world: int, rank: int, interleave: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_decode``'s ``row_kv_lens`` ([B, q_len] int32) on rank ``rank`` of a decode-context-parallel group:
    row t of a request sees the global keys below ``seq_len - q_len + 1 + t``, and this rank holds
    ``dcp_local_kv_lens`` of them. That is not ``local_len - q_len + 1 + t``: the q block's new tokens are
    dealt out across the ranks too (the last row's count is the local length). Written into ``out`` when given
    (a persistent buffer that a CUDA graph reads); device ops only, no host sync."""
    t = torch.arange(q_len, dtype=torch.int32, device=global_seq_lens.device)
    lens = dcp_local_kv_lens(global_seq_lens.to(torch.int32)[:, None] - (q_len - 1) + t[None, :], world, rank,
                             interleave)
    if out is None:
        return lens
    out.copy_(lens)
    return out


def check_mla_dims(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    if (kv_lora_rank, qk_rope_head_dim) != (KV_LORA_RANK, QK_ROPE_HEAD_DIM):
        raise ValueError(f"{BACKEND_NAME} needs kv_lora_rank={KV_LORA_RANK} and qk_rope_head_dim={QK_ROPE_HEAD_DIM} "
                         f"(DeepSeek-V2/V3/R1), got {kv_lora_rank} and {qk_rope_head_dim}")


def check_attention_features(alibi_slopes=None, sliding_window=None, logits_soft_cap=None) -> None:
    if any(x is not None and x is not False and x != 0 for x in (alibi_slopes, sliding_window, logits_soft_cap)):
        raise NotImplementedError(f"{BACKEND_NAME} does not support alibi_slopes, sliding_window or "
                                  "logits_soft_cap")


def check_block_size(block_size: int) -> None:
    """For engines that pass the page size straight to the kernel (SGLang); vLLM splits its blocks."""
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{BACKEND_NAME}: page size {block_size} is not supported; allowed: "
                         f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")


def unsupported_reasons(*, head_size=None, dtype=None, kv_cache_dtype=None, block_size=None,
                        compute_capability=None, sparse=None) -> dict[str, str]:
    """The refusal of each setting, naming the value and what is allowed (keyed like vLLM's generic reasons,
    so the vLLM backend can substitute them; other engines pick the ones they check)."""
    cc = compute_capability
    cc_str = f"{cc[0]}.{cc[1]}" if cc is not None else "unknown"
    return {
        "head_size not supported": (
            f"head_size {head_size} not supported: {BACKEND_NAME} needs DeepSeek MLA dims "
            f"(kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim {QK_ROPE_HEAD_DIM} = {QK_HEAD_DIM})"),
        "dtype not supported": f"dtype {dtype} not supported; allowed: {dtype_names(OUT_DTYPES)}",
        "kv_cache_dtype not supported": (
            f"kv_cache_dtype {kv_cache_dtype!r} not supported; allowed: {', '.join(KV_CACHE_DTYPE_NAMES)}"),
        "block_size not supported": (
            f"block_size {block_size} not supported; allowed: multiples of {min(SUPPORTED_BLOCK_SIZES)} (kernel "
            f"block sizes {SUPPORTED_BLOCK_SIZES})"),
        "compute capability not supported": (
            f"compute capability {cc_str} not supported; {BACKEND_NAME} needs >= "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (Hopper, Blackwell)"),
        "sparse not supported": f"sparse MLA (DeepSeek-V3.2 indexer) is not supported by {BACKEND_NAME}",
    }


def make_workspace(device, *, max_num_seqs: int, num_speculative_tokens: int | None, num_heads: int,
                   out_dtype: torch.dtype) -> MLAWorkspace:
    """The workspace of one engine: split-KV partials for up to ``max_num_seqs`` requests of the decode q_len,
    and the output buffers decode returns views of. Make it before warm-up and CUDA-graph capture.
    ``num_heads``: the query heads of one decode call (under DCP the rank's heads x the DCP size)."""
    check_num_heads(num_heads)
    # room for every split cap a tuned launch config may ask for (the default cap stays the workspace's)
    return MLAWorkspace(device, max_batch=max_num_seqs, max_q_len=max_decode_q_len(num_speculative_tokens),
                        num_heads=num_heads, out_dtype=out_dtype, split_capacity=SPLIT_CAPACITY)


def kernel_cache(kv_cache: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """The cache as the kernels take it: an fp8 cache that the engine stores as bytes, viewed as e4m3."""
    if kv_cache_dtype.startswith("fp8") and kv_cache.dtype == torch.uint8:
        return kv_cache.view(FP8_DTYPE)
    return kv_cache


def dequant_scale(scale) -> torch.Tensor | float:
    """An engine's dequantisation scale (real = stored * scale) as mla_decode takes it: a device tensor stays
    one (read in the kernel: no host sync), None means 1."""
    return 1.0 if scale is None else scale


def make_deployment(*, num_heads: int, max_num_seqs: int, num_speculative_tokens: int | None,
                    model_dtype: torch.dtype, kv_cache_dtype: str, block_size: int, max_model_len: int,
                    capture_sizes=None, fp8_query: bool = False, tensor_scales: bool = True) -> autotune.Deployment:
    """The decode shapes an engine runs, for the autotuner: its CUDA-graph sizes (tokens; None = powers of two up
    to ``max_num_seqs``) as request counts, and its context profile (``CUTE_MLA_TUNE_SEQ_LENS``, else
    ``max_model_len``). ``tensor_scales``: the engine passes fp8 scales as device tensors (vLLM does)."""
    q_len = max_decode_q_len(num_speculative_tokens)
    model = autotune.DTYPE_NAMES[model_dtype]
    kv = "fp8" if kv_cache_dtype.startswith("fp8") else model
    q = "fp8" if kv == "fp8" and fp8_query else model
    if capture_sizes:
        batches = sorted({t // q_len for t in capture_sizes if q_len <= t and t // q_len <= max_num_seqs})
    else:
        batches = [1 << i for i in range(max(1, max_num_seqs).bit_length()) if 1 << i <= max_num_seqs]
    return autotune.Deployment(
        num_heads=num_heads, q_len=q_len, kv_dtype=kv, q_dtype=q, out_dtype=model, block_size=block_size,
        batches=tuple(batches or [1]), seq_lens=tuple(envs.CUTE_MLA_TUNE_SEQ_LENS or (max_model_len,)),
        q_form="cat" if q == "fp8" else "pair",
        scale_form="none" if kv != "fp8" else ("tensor" if tensor_scales else "float"),
        max_blocks=-(-max_model_len // block_size))


_PREBUILT: set = set()  # (deployment, device, kernel) whose builds this process started


def prebuild_kernels(deployment: autotune.Deployment, device, kernel: str = "auto") -> list[str]:
    """Start compiling, in background processes, the kernel variants the deployment's decode calls will launch
    (``autotune.prebuild_deployment``), once per process; an engine calls it at model construction, so that the
    compiles overlap its model load and torch.compile instead of following them. Only with
    ``CUTE_MLA_PREBUILD=1``: measured on an H100 host it hid the compile but did not shorten a cold start (the
    builds compete with torch.compile for the CPU). Never raises: a failure only means compiling on first use."""
    key = (repr(deployment), str(device), kernel)
    if not envs.CUTE_MLA_PREBUILD or key in _PREBUILT:
        return []
    _PREBUILT.add(key)
    try:
        started = autotune.prebuild_deployment(deployment, device, kernel)
    except Exception as e:  # noqa: BLE001 - start-up must go on: the first call compiles what it needs
        logger.warning("mla_decode: prebuilding the decode kernels failed (they compile on first use): %s: %s",
                       type(e).__name__, e)
        return []
    if started:
        logger.info("mla_decode: compiling %d kernel variant(s) in the background for this engine: %s", len(started),
                    ", ".join(started))
    return started


class DeploymentTuning:
    """The autotuner's part of an engine's warm-up: ``run_once`` (on every decode call; it acts once) sets the
    deployment's context profile, installs the tuning cache's results for its shapes and, with
    ``CUTE_MLA_AUTOTUNE=1``, times the missing ones within ``CUTE_MLA_AUTOTUNE_BUDGET_S`` - on the first decode
    call that is not being captured into a CUDA graph. vLLM makes that call eagerly before it captures any graph
    (its warm-up runs of each size), so every graph captures a tuned or cached choice; in eager mode it is the
    first decode step."""

    def __init__(self, deployment: autotune.Deployment, *, tune: bool | None = None, budget_s: float | None = None,
                 host_lengths: bool = True):
        self.deployment = deployment
        # whether decode calls may pick by the step's longest length (eager engines); False with full CUDA
        # graphs, so that the engine's eager warm-up of a graph size runs (and compiles) what its capture runs
        self.host_lengths = host_lengths
        self.tune = envs.CUTE_MLA_AUTOTUNE if tune is None else tune
        self.budget_s = envs.CUTE_MLA_AUTOTUNE_BUDGET_S if budget_s is None else budget_s
        self.report: dict | None = None

    def run_once(self, device) -> None:
        if self.report is not None:
            return
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return  # timing needs synchronisation; the next eager call does it
        self.report = {}
        try:
            self.report = autotune.prepare_deployment(self.deployment, device, tune=self.tune, budget_s=self.budget_s)
        except Exception as e:  # noqa: BLE001 - tuning must never take the engine down: the static table serves
            logger.warning("mla_decode: autotune: warm-up tuning failed, the static kernel table is used: %s: %s",
                           type(e).__name__, e)


class DecodeRunner:
    """One layer's decode: which kernel (``CUTE_MLA_KERNEL``, read once), the cache dtype, the softmax scale;
    ``decode`` writes into the workspace's output buffers and returns views of them."""

    def __init__(self, softmax_scale: float, kv_cache_dtype: str):
        self.softmax_scale = float(softmax_scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8_kv_cache = kv_cache_dtype.startswith("fp8")
        self.kernel = envs.CUTE_MLA_KERNEL
        self.check_dir = envs.CUTE_MLA_CHECK_DIR  # read once: decode runs per layer and step

    def decode(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               workspace: MLAWorkspace, *, q_scale=None, kv_scale=None, max_seq_len: int | None = None,
               tuning: DeploymentTuning | None = None,
               row_kv_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``max_seq_len``: the step's longest KV length when the engine knows it on the host (picks the tuned
        choice of its bucket in eager steps; ignored under graph capture). ``tuning``: the warm-up hook.
        ``row_kv_lens``: per-row key counts (decode context parallelism, ``dcp_row_kv_lens``)."""
        if tuning is not None:
            tuning.run_once(workspace.device)
            if not tuning.host_lengths:
                max_seq_len = None
        q_is_fp8 = isinstance(q, torch.Tensor) and q.dtype == FP8_DTYPE
        num_tokens = (q[0] if isinstance(q, (tuple, list)) else q).shape[0]
        out, lse = workspace.output_views(num_tokens)
        cache = kernel_cache(kv_cache, self.kv_cache_dtype)
        q_scale = dequant_scale(q_scale) if q_is_fp8 else None
        kv_scale = dequant_scale(kv_scale) if self.is_fp8_kv_cache else None
        mla_decode(q, cache, block_table, seq_lens, softmax_scale=self.softmax_scale, q_scale=q_scale,
                   kv_scale=kv_scale, out=out, lse=lse, workspace=workspace, kernel=self.kernel,
                   max_seq_len=max_seq_len, row_kv_lens=row_kv_lens)
        if self.check_dir and not (workspace.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            record = reference_check(q, cache, block_table, seq_lens, self.softmax_scale, out, lse,
                                     q_scale=q_scale, kv_scale=kv_scale, row_kv_lens=row_kv_lens)
            append_check_record(self.check_dir, record)
        return out, lse


def reference_check(q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, *, q_scale=None, kv_scale=None,
                    row_kv_lens: torch.Tensor | None = None) -> dict:
    """One decode call recomputed with the float32 reference on the very inputs the engine passed: the
    relative error of the output (Frobenius), the largest LSE error where the reference LSE is finite, and
    whether the infinite LSEs (rows with no key) agree. Plus what the call was (q_len, dtypes, heads, longest
    length), so a test can check which paths an engine exercised. Summed across calls by
    ``merge_check_records``."""
    from mla_backend_plugin.kernels.reference import mla_decode_reference

    q_nope, q_pe = q if isinstance(q, (tuple, list)) else (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])
    q_len = q_nope.shape[0] // block_table.shape[0]
    ref_out, ref_lse = mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, q_len, softmax_scale,
                                            q_scale=q_scale, kv_scale=kv_scale, row_kv_lens=row_kv_lens)
    rel = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return {"calls": 1, "q_lens": {str(q_len): 1}, "max_rel_err": rel, "max_lse_err": lse_err,
            "lse_inf_mismatch": int(not torch.equal(torch.isinf(lse), ~finite)),
            "q_dtypes": {str(q_nope.dtype): 1}, "kv_dtypes": {str(kv_cache.dtype): 1},
            "block_sizes": {str(kv_cache.shape[1]): 1}, "max_seq_len": int(seq_lens.max().item()),
            "heads": {str(q_nope.shape[1]): 1}, "row_kv_lens_calls": int(row_kv_lens is not None)}


def append_check_record(check_dir: str, record: dict) -> None:
    os.makedirs(check_dir, exist_ok=True)
    with open(os.path.join(check_dir, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def merge_check_records(total: dict, record: dict) -> dict:
    """Sum ``reference_check`` records: counts add, per-value tallies add, ``max_*`` take the maximum."""
    for key, value in record.items():
        if isinstance(value, dict):
            tally = total.setdefault(key, {})
            for k, n in value.items():
                tally[k] = tally.get(k, 0) + n
        elif key.startswith("max_"):
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def read_check_records(check_dir: str) -> dict:
    """Every record the processes of a run appended under ``check_dir``, summed (plus ``processes``)."""
    total: dict = {"calls": 0, "processes": 0}
    for name in sorted(os.listdir(check_dir)) if os.path.isdir(check_dir) else ():
        with open(os.path.join(check_dir, name)) as f:
            for line in f:
                merge_check_records(total, json.loads(line))
        total["processes"] += 1
    return total
