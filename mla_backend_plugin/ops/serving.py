"""The engine-neutral half of a serving backend (vLLM's ``vllm/backend.py``, SGLang's ``sglang/backend.py``).

What every engine's MLA decode backend needs from us, apart from the engine's own classes: the supported
settings and the words that refuse the others, the workspace sized from the engine's limits (allocated once,
before CUDA-graph capture), the cache and scale forms the kernels take, the decode call that returns views
of the workspace's output buffers (no allocation per step, no warm-up work: ``DecodeRunner``), and the
autotuner's warm-up (``DeploymentTuning``: the engine's decode shapes, prepared by the engine's metadata builder
on its first build outside CUDA-graph capture; ``prebuild_kernels``: background compiles at model construction).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from mla_backend_plugin import BACKEND_NAME, envs
from mla_backend_plugin.ops import autotune, tuned
from mla_backend_plugin.ops.api import mla_decode
from mla_backend_plugin.ops.args import DcpLayout, kernel_scale
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
from mla_backend_plugin.ops.plan import SPLIT_CAPACITY
from mla_backend_plugin.ops.workspace import MLAWorkspace, StepPlans, capturing

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


# Token requests (``TokenRequests``) per decode launch at least: an engine whose max_num_seqs is smaller gets a
# workspace of this many requests when it decodes short prefills, so that a 100-token tail is one or two launches
# (128 requests x 2 m-blocks fill an H100) rather than one per max_num_seqs tokens.
TOKEN_REQUEST_SLICE = 128
# An engine pads a step's tokens up to its next CUDA-graph size (vLLM: multiples of 8 up to 256, then of 16); a
# speculative step's token requests count that padding too
TOKEN_REQUEST_PADDING = 16
# Query rows (q_len x heads) one CTA of the CuTe kernels owns (cute_sm90, and each CTA of cute_sm100's pair):
# token requests take this many rows of query tokens, so that small head counts fill the tile as MTP does.
TOKEN_REQUEST_ROWS = 64


def decode_query_len_threshold(num_speculative_tokens: int | None, dcp_world_size: int = 1) -> int:
    """The most new tokens a request may bring and still be decoded (the engine's reorder threshold): at least the
    speculative q_len; without decode context parallelism up to ``CUTE_MLA_DECODE_MAX_QUERY_LEN`` (a batch of mixed
    q_lens, or of q_len above MAX_Q_LEN, runs as token requests: ``TokenRequests``)."""
    q_len = max_decode_q_len(num_speculative_tokens)
    if dcp_world_size > 1:
        return q_len  # token requests would need per-token local lengths on every rank: not built
    return max(q_len, envs.CUTE_MLA_DECODE_MAX_QUERY_LEN)


def token_request_q_len(num_heads: int) -> int:
    """Query tokens per token request: as many as fill TOKEN_REQUEST_ROWS rows (4 at 16 heads, 1 from 64 heads on,
    where every token's heads fill whole CTAs by themselves)."""
    return max(1, min(MAX_Q_LEN, TOKEN_REQUEST_ROWS // num_heads))


def uniform_query_len(query_lens, num_tokens: int) -> int | None:
    """The q_len every request of a decode batch has, or None when they differ. ``query_lens``: the host's
    per-request token counts; an engine's padding requests of a full-CUDA-graph batch count 0 (vLLM) and take
    the batch's q_len, since ``num_tokens`` counts their padding tokens."""
    lens = np.asarray(query_lens)
    if lens.size == 0 or num_tokens % lens.size:
        return None
    q_len = num_tokens // lens.size
    if (lens == q_len).all():  # the common case first: a builder runs this every step (~3 us)
        return q_len
    return q_len if bool(((lens == q_len) | (lens == 0)).all()) else None


@dataclasses.dataclass
class TokenRequests:
    """A decode batch of any q_lens recast as requests of at most ``q_len`` consecutive query tokens of one request
    each (one call of uniform q_len): request r's block-table row is its request's, row t sees the keys the causal
    rule gives that token (``row_kv_lens``; the keys of the last one are ``seq_lens[r]``), rows past a request's
    last token see none. With ``q_len`` 1 the tokens are the requests (no gather). Built by ``token_requests``."""

    block_table: torch.Tensor  # [R, cols] int32
    seq_lens: torch.Tensor  # [R] int32
    q_len: int
    query_lens: list[int]  # the step's own requests' token counts (host), for the reference check
    row_kv_lens: torch.Tensor | None = None  # [R, q_len] int32 when q_len > 1
    rows: torch.Tensor | None = None  # [R * q_len] int64: the query token of each row (0 for a row past the end)
    row_of_token: torch.Tensor | None = None  # [num_tokens] int64: each query token's row

    def gather_q(self, q):
        """q ([num_tokens, H, D] or the (q_nope, q_pe) pair) in rows of the token requests."""
        if self.rows is None:
            return q
        return tuple(_take(t, self.rows) for t in q) if isinstance(q, (tuple, list)) else _take(q, self.rows)

    def scatter(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs in rows of the token requests back in token order."""
        if self.row_of_token is None:
            return out, lse
        return out.index_select(0, self.row_of_token), lse.index_select(0, self.row_of_token)


def _take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of t (an fp8 tensor through its bytes: not every index kernel takes e4m3)."""
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)
    return t.index_select(0, index)


def token_requests(query_start_loc: torch.Tensor, query_lens, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   num_tokens: int, q_len: int = 1, max_seq_len: int | None = None,
                   block_size: int | None = None) -> TokenRequests:
    """Recast a decode batch (request b brings ``query_lens[b]`` tokens, from ``query_start_loc[b]`` on, and has
    ``seq_lens[b]`` keys with them) as ``TokenRequests`` of ``q_len`` tokens. Token t of request b sees
    ``seq_len_b - q_len_b + t + 1`` keys, exactly the causal rule of a folded q block; tokens past the last
    request's (an engine's padding) see none. At q_len 1 and >= 64 heads, and at q_len = 64 / heads below
    (``token_request_q_len``), each token request fills its CTAs' rows as a folded q block does, so the KV read
    per query token is the same (the requests of one request's tokens read its pages from L2 mostly).

    ``query_start_loc``: device ``[B + 1]``; ``query_lens``: the same counts on the host (they size the result:
    no device sync). ``max_seq_len`` / ``block_size`` (host ints), when given, keep only the block-table columns a
    request can use. Device ops only."""
    device = seq_lens.device
    query_lens = own_query_lens = [int(n) for n in query_lens]
    num_requests = len(query_lens)
    padding = num_tokens - sum(query_lens)
    if padding < 0 or num_requests == 0:
        raise ValueError(f"token_requests: {num_tokens} tokens for query lengths {query_lens}")
    if max_seq_len is not None and block_size is not None:
        block_table = block_table[:, :max(1, min(block_table.shape[1], -(-int(max_seq_len) // block_size)))]
    starts = query_start_loc[:num_requests + 1].to(torch.int64)
    lens = seq_lens[:num_requests].to(torch.int64)
    if padding:  # the padding tokens as one more request with no keys
        starts = torch.cat([starts, starts.new_full((1,), num_tokens)])
        lens = torch.cat([lens, lens.new_zeros(1)])
        query_lens = query_lens + [padding]
        block_table = torch.cat([block_table, block_table[:1]])
    counts = starts[1:] - starts[:-1]
    # request b takes cdiv(q_len_b, q_len) token requests, the first at first_b = sum of those of b' < b
    num_rows = sum(-(-n // q_len) for n in query_lens)
    per_request = torch.div(counts + q_len - 1, q_len, rounding_mode="floor")
    last = torch.cumsum(per_request, 0)  # one past each request's last token request
    first = last - per_request
    r = torch.arange(num_rows, dtype=torch.int64, device=device)
    request = torch.searchsorted(last, r, right=True)
    offset = (r - first[request])[:, None] * q_len + torch.arange(q_len, dtype=torch.int64, device=device)
    valid = offset < counts[request][:, None]  # [R, q_len]
    keys = torch.where(valid, lens[request][:, None] - counts[request][:, None] + offset + 1, 0).clamp_(min=0)
    block_table = block_table.index_select(0, request).contiguous()
    if q_len == 1:  # the tokens are the requests: nothing to gather, no per-row counts
        return TokenRequests(block_table=block_table, seq_lens=keys[:, 0].to(torch.int32), q_len=1,
                             query_lens=own_query_lens)
    token = torch.arange(num_tokens, dtype=torch.int64, device=device)
    owner = torch.searchsorted(starts[1:], token, right=True)
    within = token - starts[owner]
    return TokenRequests(
        block_table=block_table, seq_lens=keys.max(dim=1).values.to(torch.int32), q_len=q_len,
        query_lens=own_query_lens, row_kv_lens=keys.to(torch.int32).contiguous(),
        rows=torch.where(valid, starts[request][:, None] + offset, 0).reshape(-1),
        row_of_token=(first[owner] + torch.div(within, q_len, rounding_mode="floor")) * q_len + within % q_len)


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


def fp8_query(setting: str, cc: tuple[int, int] | None) -> bool:
    """Whether the engine should hand the kernels an fp8 q with an fp8 KV cache (``CUTE_MLA_FP8_QUERY``:
    ``auto`` / ``1`` / ``0``; ``cc`` is the GPU's compute capability, None without one). ``auto`` says yes on
    SM90: cute_sm90 design B then runs one e4m3 Q K^T product instead of a split q's two, 1.3x faster at large
    batch and at batch 1-2 faster than widening the cache, at the error of FlashMLA's fp8 path, which takes the
    same q (docs/perf/cute_sm90_fp8.md). Elsewhere no such measurement exists: the model dtype stays."""
    if setting == "auto":
        return cc is not None and cc[0] == 9
    return setting == "1"


def make_workspace(device, *, max_num_seqs: int, num_speculative_tokens: int | None, num_heads: int,
                   out_dtype: torch.dtype, token_requests: bool = False) -> MLAWorkspace:
    """The workspace of one engine: split-KV partials for up to ``max_num_seqs`` requests of the decode q_len,
    and the output buffers decode returns views of. Make it before warm-up and CUDA-graph capture.
    ``num_heads``: the query heads of one decode call (under DCP the rank's heads x the DCP size).
    ``token_requests``: the engine also decodes short prefills (``TokenRequests``): room for slices of at least
    TOKEN_REQUEST_SLICE requests of their q_len, and with one draft token (MTP's or n-gram's) for a whole step of
    mixed q_lens (requests with and without a draft) in one call: in slices, each layer would launch the
    step-plan kernel, the split kernel and the combine once per slice (2026-11-28, n-gram 1 at 128 requests: 3 CuTe
    launches and 1.7 combines per eager call, 290 us of host time a call). Not with more draft tokens: the buffers
    hold max_batch requests at every q_len up to max_q_len, so a workspace of the whole step's token requests would
    be max_q_len times the rows the step needs (at 128 heads, 256 requests and 3 drafts: 522 MiB against 129); those
    steps run in slices."""
    check_num_heads(num_heads)
    max_batch, max_q_len = max_num_seqs, max_decode_q_len(num_speculative_tokens)
    if token_requests:
        per_token_request = token_request_q_len(num_heads)
        spec_step = max_num_seqs * -(-max_q_len // per_token_request) + TOKEN_REQUEST_PADDING if max_q_len == 2 else 0
        max_batch = max(max_batch, TOKEN_REQUEST_SLICE, spec_step)
        max_q_len = max(max_q_len, per_token_request)
    # room for every split cap a tuned launch config may ask for (the default cap stays the workspace's)
    return MLAWorkspace(device, max_batch=max_batch, max_q_len=max_q_len, num_heads=num_heads, out_dtype=out_dtype,
                        split_capacity=SPLIT_CAPACITY)


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
    model = tuned.DTYPE_NAMES[model_dtype]
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
    """The autotuner's part of an engine's warm-up: ``run_once`` sets the deployment's context profile, installs
    the tuning cache's results for its shapes and, with ``CUTE_MLA_AUTOTUNE=1``, times the missing ones within
    ``CUTE_MLA_AUTOTUNE_BUDGET_S``. The engine's metadata builder calls it on every build (it acts once, on the
    first build outside CUDA-graph capture): vLLM and SGLang build the metadata of their eager warm-up runs of
    each graph size before capturing it, so every graph captures a tuned or cached choice, and the decode calls
    themselves (and graph replays) do no warm-up work; in eager mode it is the first decode step's build."""

    def __init__(self, deployment: autotune.Deployment, *, tune: bool | None = None, budget_s: float | None = None,
                 host_lengths: bool = True):
        self.deployment = deployment
        # whether decode calls may pick by the step's longest length (eager engines); False with full CUDA
        # graphs, so that the engine's eager warm-up of a graph size runs (and compiles) what its capture runs
        self.host_lengths = host_lengths
        self.tune = envs.CUTE_MLA_AUTOTUNE if tune is None else tune
        self.budget_s = envs.CUTE_MLA_AUTOTUNE_BUDGET_S if budget_s is None else budget_s
        self.report: dict | None = None

    def choice_seq_len(self, max_seq_len: int | None) -> int | None:
        """What a decode call may pick its tuned choice by (``mla_decode``'s ``max_seq_len``): the step's longest
        length, known on the host, for an eager engine; None under full CUDA graphs (``host_lengths=False``)."""
        return max_seq_len if self.host_lengths else None

    def run_once(self, device, workspace: MLAWorkspace | None = None) -> None:
        """Once, outside capture: the tuning above, then (given the engine's ``workspace``, on a GPU, unless
        ``CUTE_MLA_DECODE_WARMUP=0``) ``warm_up_decode``: every decode shape the engine's eager steps can bring."""
        if self.report is not None:
            return
        device = torch.device(device)
        if capturing(device):
            return  # timing needs synchronisation; the next build outside capture does it
        self.report = {}
        try:
            self.report = autotune.prepare_deployment(self.deployment, device, tune=self.tune, budget_s=self.budget_s)
        except Exception as e:  # noqa: BLE001 - tuning must never take the engine down: the static table serves
            logger.warning("mla_decode: autotune: warm-up tuning failed, the static kernel table is used: %s: %s",
                           type(e).__name__, e)
        if workspace is not None and device.type == "cuda" and envs.CUTE_MLA_DECODE_WARMUP:
            # once per workspace and deployment: vLLM 0.26's CUDA-graph memory profile builds a throw-away
            # builder before the real one, and both take the layers' reserved workspace
            key = ("decode_warm_up", repr(self.deployment))
            if key in workspace.decisions:
                self.report["warm_up"] = workspace.decisions[key][0]
                return
            try:
                self.report["warm_up"] = warm_up_decode(self.deployment, workspace)
                workspace.decisions[key] = (self.report["warm_up"],)
            except Exception as e:  # noqa: BLE001 - a failed warm-up only leaves work to the first calls
                logger.warning("mla_decode: decode warm-up failed (first calls of new shapes compile what they "
                               "need): %s: %s", type(e).__name__, e)


def warm_up_decode(deployment: autotune.Deployment, workspace: MLAWorkspace) -> dict:
    """One eager decode of every shape an engine's eager steps can bring, before its first request: every batch
    size 1 .. ``workspace.max_batch`` at every q_len 1 .. ``workspace.max_q_len``, through the serving call
    (``DecodeRunner.decode`` into ``workspace``) on stand-in inputs of one page per request, with the deployment's
    dtypes, q form and scale form. An engine's CUDA-graph warm-up runs only its graph sizes at its decode q_len;
    its eager steps (chunked prefill beside decodes, and with speculation the steps with requests that have no
    draft: q_len 1, or token requests) bring other batch sizes and q_lens, and what a call launches depends on
    them: the split plan is made per (batch, q_len), and Triton compiles the split-KV combine once per plan
    constants (the 2026-11-28 n-gram serving run JIT-compiled it during inference: its p99 TTFT was 868 ms against
    FA3-MLA's 123). The kernels' choice follows the context profile (``max_seq_len`` None, as under full
    graphs). Returns {"calls", "seconds", "skipped"} (q_lens no kernel serves at this deployment)."""
    t0 = time.perf_counter()
    cc = torch.cuda.get_device_capability(workspace.device)
    runner = DecodeRunner(1.0 / 24.0, "fp8" if deployment.kv_dtype == "fp8" else "auto")
    calls, skipped = 0, []
    for q_len in range(1, workspace.max_q_len + 1):
        key = autotune.ShapeKey(tuple(cc), deployment.kv_dtype, deployment.q_dtype, deployment.out_dtype,
                                deployment.num_heads, q_len, deployment.block_size, deployment.q_form,
                                deployment.scale_form, workspace.max_batch, deployment.block_size, deployment.lse)
        inputs, _ = autotune.tuning_inputs(key, workspace.device, max_blocks=1)
        scales = inputs.scale_kwargs(as_tensor=deployment.scale_form == "tensor")
        try:
            for batch in range(1, workspace.max_batch + 1):
                runner.decode(_rows(inputs.q, slice(0, batch * q_len)), inputs.kv_cache, inputs.block_table[:batch],
                              inputs.seq_lens[:batch], workspace, max_seq_len=None, **scales)
                calls += 1
        except ValueError as e:  # no kernel for this q_len here (e.g. a head count's q_len limit): not ours to run
            skipped.append(f"q_len {q_len}: {e}")
    torch.cuda.synchronize(workspace.device)
    seconds = time.perf_counter() - t0
    logger.info("mla_decode: decode warm-up: %d eager calls (batch 1-%d x q_len 1-%d) in %.1f s%s", calls,
                workspace.max_batch, workspace.max_q_len, seconds, f"; skipped {skipped}" if skipped else "")
    return {"calls": calls, "seconds": round(seconds, 2), "skipped": skipped}


class DecodeRunner:
    """One layer's decode: which kernel (``CUTE_MLA_KERNEL``, read once), the cache dtype, the softmax scale;
    ``decode`` writes into the workspace's output buffers and returns views of them. ``check``: a debugging hook
    called with every decode call made outside CUDA-graph capture and its outputs (``check(q, kv_cache,
    block_table, seq_lens, softmax_scale, out, lse, q_scale=, kv_scale=, row_kv_lens=, query_lens=)``; the
    engines pass ``testing.reference_check.engine_check()``, the float32 reference under ``CUTE_MLA_CHECK_DIR``)."""

    def __init__(self, softmax_scale: float, kv_cache_dtype: str, check: Callable[..., None] | None = None):
        self.softmax_scale = float(softmax_scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8_kv_cache = kv_cache_dtype.startswith("fp8")
        self.kernel = envs.CUTE_MLA_KERNEL
        self.check = check
        # the scales an engine last passed and their kernel forms (an engine passes one layer's same scale tensors
        # every step: one view made, not one per call); not the cache, which a view would keep alive
        self._scale_forms: tuple = (None, None, None, None)

    def decode(self, q, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               workspace: MLAWorkspace, *, q_scale=None, kv_scale=None, max_seq_len: int | None = None,
               row_kv_lens: torch.Tensor | None = None, token_requests: TokenRequests | None = None,
               step: StepPlans | None = None, dcp: DcpLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``max_seq_len``: the step's longest KV length when the engine knows it on the host and may pick the
        tuned choice of its bucket by it (``DeploymentTuning.choice_seq_len``; ignored under graph capture).
        ``row_kv_lens``: per-row key counts (decode context parallelism, ``dcp_row_kv_lens``). ``token_requests``:
        a step of mixed q_lens recast by ``token_requests`` (what is launched; ``block_table`` and ``seq_lens``
        stay the step's own, per request). q and the returned outputs are in token order either way. ``step``: the
        decode step's ``StepPlans``, shared by its layers (mla_decode's ``step``). ``dcp``: the layout
        ``row_kv_lens`` comes from (mla_decode's ``dcp``); not passed on for a recast step (its requests are not
        the layout's)."""
        q_is_fp8 = isinstance(q, torch.Tensor) and q.dtype == FP8_DTYPE
        cache = kernel_cache(kv_cache, self.kv_cache_dtype)
        q_scale, kv_scale = self._scales(q_scale, kv_scale, q_is_fp8)
        if token_requests is None:
            out, lse = self._launch(q, cache, block_table, seq_lens, row_kv_lens, workspace, q_scale, kv_scale,
                                    max_seq_len, step, dcp)
        else:
            tr = token_requests
            out, lse = tr.scatter(*self._launch(tr.gather_q(q), cache, tr.block_table, tr.seq_lens, tr.row_kv_lens,
                                                workspace, q_scale, kv_scale, max_seq_len, step, None))
        if self.check is not None and not capturing(workspace.device):
            self.check(q, cache, block_table, seq_lens, self.softmax_scale, out, lse, q_scale=q_scale,
                       kv_scale=kv_scale, row_kv_lens=row_kv_lens,
                       query_lens=token_requests.query_lens if token_requests is not None else None)
        return out, lse

    def _scales(self, q_scale, kv_scale, q_is_fp8: bool):
        """(q_scale, kv_scale) as mla_decode takes them: ``dequant_scale`` for an fp8 q / cache, else None; a
        1-element device tensor as the [1] view mla_decode would make of it (``args.kernel_scale``). Kept for the
        tensors last passed (an engine passes one layer's same scale tensors every step); a float is converted
        every call."""
        given_q, given_kv, given_fp8, forms = self._scale_forms
        if q_scale is given_q and kv_scale is given_kv and q_is_fp8 is given_fp8:
            return forms
        forms = (kernel_scale(dequant_scale(q_scale)) if q_is_fp8 else None,
                 kernel_scale(dequant_scale(kv_scale)) if self.is_fp8_kv_cache else None)
        if all(s is None or isinstance(s, torch.Tensor) for s in (q_scale, kv_scale)):
            self._scale_forms = (q_scale, kv_scale, q_is_fp8, forms)
        return forms

    def _launch(self, q, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                row_kv_lens: torch.Tensor | None, workspace: MLAWorkspace, q_scale, kv_scale, max_seq_len: int | None,
                step: StepPlans | None, dcp: DcpLayout | None) -> tuple[torch.Tensor, torch.Tensor]:
        """mla_decode into the workspace's output buffers (fresh outputs past them). A batch of more requests than
        the workspace holds (token requests) runs in slices of at most max_batch requests, each writing its rows."""
        num_rows = (q[0] if isinstance(q, (tuple, list)) else q).shape[0]
        out, lse = self._outputs(workspace, num_rows, q)
        batch = block_table.shape[0]
        if batch <= workspace.max_batch:
            mla_decode(q, cache, block_table, seq_lens, softmax_scale=self.softmax_scale, out=out, lse=lse,
                       workspace=workspace, kernel=self.kernel, row_kv_lens=row_kv_lens, dcp=dcp, q_scale=q_scale,
                       kv_scale=kv_scale, max_seq_len=max_seq_len, step=step)
            return out, lse
        q_len = num_rows // batch
        for start in range(0, batch, workspace.max_batch):
            part = slice(start, min(batch, start + workspace.max_batch))
            rows = slice(part.start * q_len, part.stop * q_len)
            mla_decode(_rows(q, rows), cache, block_table[part], seq_lens[part], softmax_scale=self.softmax_scale,
                       out=out[rows], lse=lse[rows], workspace=workspace, kernel=self.kernel,
                       row_kv_lens=row_kv_lens[part] if row_kv_lens is not None else None,
                       dcp=dataclasses.replace(dcp, global_seq_lens=dcp.global_seq_lens[part]) if dcp is not None
                       else None, q_scale=q_scale, kv_scale=kv_scale, max_seq_len=max_seq_len, step=step)
        return out, lse

    @staticmethod
    def _outputs(workspace: MLAWorkspace, num_tokens: int, q) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the workspace's output buffers; a step of more query tokens than they hold (short prefills on
        the decode path, eager only) gets fresh tensors, as vLLM's own prefill path allocates its outputs."""
        if workspace.out_buffer is None or num_tokens <= workspace.out_buffer.shape[0]:
            return workspace.output_views(num_tokens)
        if capturing(workspace.device):
            raise RuntimeError(f"mla_decode: {num_tokens} query tokens exceed the workspace's output buffers "
                               f"({workspace.out_buffer.shape[0]} rows) inside CUDA-graph capture")
        heads = (q[0] if isinstance(q, (tuple, list)) else q).shape[1]
        return (torch.empty(num_tokens, heads, KV_LORA_RANK, dtype=workspace.out_buffer.dtype, device=workspace.device),
                torch.empty(num_tokens, heads, dtype=torch.float32, device=workspace.device))


def _rows(q, part: slice):
    """Query tokens ``part`` of q in either form (a tensor or the (q_nope, q_pe) pair)."""
    return tuple(t[part] for t in q) if isinstance(q, (tuple, list)) else q[part]
