"""The ``cute_mla`` attention backend for SGLang: MLA decode (and chain verify) through ``mla_decode``.

What runs where:

- DECODE (q_len 1) and, for a chain draft (``--speculative-eagle-topk 1``) of at most 4 tokens, TARGET_VERIFY
  (q_len = the draft tokens; SGLang routes verify here with ``--speculative-attention-mode decode``, or when
  ``cute_mla`` is also the prefill backend): our kernels, through the same workspace, decode call and
  autotuner warm-up as the vLLM backend (``ops/serving.py``).
- Everything else (prefill and extend, tree verify, draft extend, the draft model's multi-step decode): SGLang's
  Triton backend, which this class extends. With ``--decode-attention-backend cute_mla`` alone SGLang builds its
  hybrid backend and prefill runs on its default (FA3 on Hopper).

CUDA graphs: the page table and lengths our kernels read are persistent buffers filled by device ops in
``init_forward_metadata_in_graph``, so SGLang records the fill into each decode graph and a replay does no
host work of ours. The workspace (split-KV partials and the outputs ``forward_decode`` returns views of) is
allocated once, in ``__init__``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

from mla_backend_plugin.ops import serving
from mla_backend_plugin.ops.constants import MAX_Q_LEN, QK_HEAD_DIM, SUPPORTED_BLOCK_SIZES, V_HEAD_DIM
from mla_backend_plugin.sglang import compat
from mla_backend_plugin.sglang.compat import SGLANG_BACKEND_NAME
from mla_backend_plugin.testing.reference_check import engine_check

logger = logging.getLogger("mla_backend_plugin")


class PagedDecodeTables:
    """The kernel inputs SGLang does not have in our form, in persistent buffers: the page table (page ids of
    each request, from ``req_to_token``: slot // page_size of every page's first token) and int32 KV lengths.

    ``fill`` is device ops only (no host sync, static shapes): CUDA-graph recordable. It gathers the full page
    width of the pool (``req_to_token``'s context length), so one graph serves every length; the kernels read
    only the pages below each request's length, so stale ids past it are never dereferenced."""

    def __init__(self, req_to_token: torch.Tensor, page_size: int, max_batch: int):
        self.req_to_token = req_to_token
        self.page_size = page_size
        device = req_to_token.device
        max_context = req_to_token.shape[1]
        self.max_pages = -(-max_context // page_size)
        # the first slot of each page (int64: an index tensor)
        self.page_starts = torch.arange(self.max_pages, dtype=torch.int64, device=device) * page_size
        self.page_table = torch.zeros(0, self.max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self.reserve(max_batch)

    @property
    def max_batch(self) -> int:
        return self.seq_lens.shape[0]

    def reserve(self, max_batch: int) -> None:
        """Grow the buffers to ``max_batch`` requests. Only before CUDA-graph capture (a graph holds addresses)."""
        if max_batch > self.max_batch:
            device = self.req_to_token.device
            self.page_table = torch.zeros(max_batch, self.max_pages, dtype=torch.int32, device=device)
            self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)

    def views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if batch > self.max_batch:
            raise RuntimeError(f"{SGLANG_BACKEND_NAME}: a batch of {batch} requests exceeds the backend's "
                               f"{self.max_batch} (max running requests / CUDA-graph batch)")
        return self.page_table[:batch], self.seq_lens[:batch]

    def fill(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, batch: int, new_tokens: int = 0) -> None:
        """Page table and lengths of the first ``batch`` requests; ``new_tokens`` is added to SGLang's lengths
        (TARGET_VERIFY: SGLang's seq_lens exclude the draft tokens, whose KV is already written)."""
        page_table, lens = self.views(batch)
        if batch == 0:
            return
        rows = req_pool_indices[:batch].to(torch.int64)
        first_slots = self.req_to_token[rows[:, None], self.page_starts[None, :]]
        page_table.copy_(torch.div(first_slots, self.page_size, rounding_mode="floor"))
        lens.copy_(seq_lens[:batch] + new_tokens if new_tokens else seq_lens[:batch])


@dataclasses.dataclass
class CuteMLAForwardMetadata:
    """One step of ours: views of the persistent tables, the query tokens per request, and the longest length
    when the host knows it (eager steps; picks the tuned choice of its bucket)."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor
    q_len: int
    max_seq_len: int | None = None
    # what this step has planned on the device (one per step: every layer's split kernel reads the step's plan)
    step: serving.StepPlans = dataclasses.field(default_factory=serving.StepPlans)


def kernel_kv_cache(key_buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """SGLang's MLA key buffer ``(slots, 1, 576)`` (fp8 as an e4m3 view of the stored bytes) as the kernels'
    paged cache ``[pages, page_size, 576]``; slot s is token s % page_size of page s // page_size."""
    pages = key_buffer.shape[0] // page_size
    return key_buffer[: pages * page_size].view(pages, page_size, key_buffer.shape[-1])


class CuteMLAAttnBackend(TritonAttnBackend):
    # our replay path never reads seq_lens_cpu (eager steps use it when the batch carries it)
    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf: torch.Tensor | None = None):
        server_args = model_runner.server_args
        page_size = getattr(model_runner, "page_size", None) or server_args.page_size or 1
        if page_size not in SUPPORTED_BLOCK_SIZES:  # refuse before the Triton base allocates anything
            raise ValueError(f"{SGLANG_BACKEND_NAME}: --page-size {page_size} is not supported; allowed: "
                             f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))} (SGLang defaults to 1 on CUDA: pass "
                             f"e.g. --page-size 64)")
        super().__init__(model_runner, skip_prefill, kv_indptr_buf)
        config = model_runner.model_config
        if not self.use_mla:
            raise ValueError(f"{SGLANG_BACKEND_NAME} serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2); this model's "
                             f"attention is {config.attention_arch}")
        serving.check_mla_dims(config.kv_lora_rank, config.qk_rope_head_dim)
        if self.dcp_size > 1:
            raise NotImplementedError(f"{SGLANG_BACKEND_NAME}: decode context parallelism (--dcp-size "
                                      f"{self.dcp_size}) is not supported on SGLang yet")
        if model_runner.sliding_window_size is not None:
            raise NotImplementedError(f"{SGLANG_BACKEND_NAME} does not support sliding-window attention")
        self.num_heads = serving.check_num_heads(self.num_head)  # heads of this rank
        self.model_dtype = model_runner.dtype
        self.kv_cache_dtype = _kv_cache_dtype_name(model_runner.kv_cache_dtype, self.model_dtype)
        # the speculative settings as the Triton base read them (SGLang's runtime config: in 0.5.23 the server args a
        # model runner holds need not carry them)
        self.verify_q_len = _chain_verify_q_len(self.num_draft_tokens, self.topk)
        max_requests = model_runner.req_to_token_pool.size
        self.workspace = serving.make_workspace(
            self.device, max_num_seqs=max_requests, num_speculative_tokens=(self.verify_q_len or 1) - 1,
            num_heads=self.num_heads, out_dtype=self.model_dtype)
        self.tables = PagedDecodeTables(model_runner.req_to_token_pool.req_to_token, page_size, max_requests)
        graphs = compat.decode_cuda_graphs_enabled(server_args)
        self.tuning = serving.DeploymentTuning(
            serving.make_deployment(
                num_heads=self.num_heads, max_num_seqs=max_requests,
                num_speculative_tokens=(self.verify_q_len or 1) - 1, model_dtype=self.model_dtype,
                kv_cache_dtype=self.kv_cache_dtype, block_size=page_size, max_model_len=self.max_context_len,
                tensor_scales=False),
            # one graph serves every length: the choice must not follow the step's lengths under graphs
            host_lengths=not graphs)
        self.runners: dict[float, serving.DecodeRunner] = {}
        self.cute_metadata: CuteMLAForwardMetadata | None = None
        # Triton's CUDA-graph buffers (fp32 split-KV logits per token, head and split) are needed only when a
        # graphed mode falls to it: speculative modes we do not serve
        self.triton_graph_modes = not model_runner.spec_algorithm.is_none() and (
            self.verify_q_len is None or model_runner.is_draft_worker)

    # --- which steps are ours
    def _serves(self, forward_batch) -> bool:
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            return forward_batch.spec_info is None  # multi-step draft decode brings its own kv indices
        return (mode.is_target_verify() and self.verify_q_len is not None
                and _is_chain(forward_batch.spec_info, self.verify_q_len))

    def _step_q_len(self, forward_batch) -> int:
        return self.verify_q_len if forward_batch.forward_mode.is_target_verify() else 1

    @staticmethod
    def _new_tokens(forward_batch, q_len: int) -> int:
        """What to add to SGLang's seq_lens for the kernels' lengths: in TARGET_VERIFY they exclude the draft
        tokens (whose KV is written before attention); in DECODE they include the current token."""
        return q_len if forward_batch.forward_mode.is_target_verify() else 0

    # --- metadata: host part (eager, before capture and before each replay) and device part (recordable)
    def init_forward_metadata(self, forward_batch):
        if not self._serves(forward_batch):
            super().init_forward_metadata(forward_batch)
            return
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not self._serves(forward_batch):
            super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
            return
        # the autotuner's and the decode warm-up (ops/serving.py): acts once, outside capture
        self.tuning.run_once(self.device, self.workspace)
        batch = forward_batch.batch_size
        q_len = self._step_q_len(forward_batch)
        page_table, seq_lens = self.tables.views(batch)
        max_seq_len = None
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if not in_capture and lens_cpu is not None and batch > 0:
            max_seq_len = int(lens_cpu[:batch].max()) + self._new_tokens(forward_batch, q_len)
        self.cute_metadata = CuteMLAForwardMetadata(page_table, seq_lens, q_len,
                                                    self.tuning.choice_seq_len(max_seq_len))

    def init_forward_metadata_in_graph(self, forward_batch):
        if not self._serves(forward_batch):
            super().init_forward_metadata_in_graph(forward_batch)
            return
        self.tables.fill(forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.batch_size,
                         new_tokens=self._new_tokens(forward_batch, self._step_q_len(forward_batch)))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, kv_indices_buf=None,
                              cuda_graph_num_kv_splits_buf=None):
        self.tables.reserve(max_bs)
        if self.workspace.max_batch < max_bs:
            self.workspace = serving.make_workspace(
                self.device, max_num_seqs=max_bs, num_speculative_tokens=(self.verify_q_len or 1) - 1,
                num_heads=self.num_heads, out_dtype=self.model_dtype)
        if self.triton_graph_modes:
            super().init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf, cuda_graph_num_kv_splits_buf)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1  # a padded request reads one key of a valid page: finite, and its output is discarded

    # --- attention
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self._serves(forward_batch):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._forward_ours(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self._serves(forward_batch):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self._forward_ours(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward_ours(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope=None, k_rope=None, **kwargs):
        unsupported = {key for key, value in kwargs.items() if value is not None}
        if unsupported:
            raise NotImplementedError(f"{SGLANG_BACKEND_NAME}: decode arguments {sorted(unsupported)} are not "
                                      "supported")
        if k is not None and save_kv_cache:
            self._save_kv(layer, forward_batch, k, v, k_rope)
        meta = self.cute_metadata
        num_heads = layer.tp_q_head_num
        if q_rope is not None:  # q_nope and q_pe apart (absorbed-MLA backends' form)
            q_in = (q.view(-1, num_heads, V_HEAD_DIM), q_rope.view(-1, num_heads, QK_HEAD_DIM - V_HEAD_DIM))
        else:
            q_in = q.reshape(-1, num_heads, QK_HEAD_DIM)
        if layer.qk_head_dim != QK_HEAD_DIM or layer.v_head_dim != V_HEAD_DIM:
            raise ValueError(f"{SGLANG_BACKEND_NAME}: layer {layer.layer_id} has head_dim {layer.qk_head_dim} and "
                             f"v_head_dim {layer.v_head_dim}; the kernels need {QK_HEAD_DIM} and {V_HEAD_DIM}")
        cache = kernel_kv_cache(self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.tables.page_size)
        out, _lse = self._runner(layer.scaling).decode(
            q_in, cache, meta.page_table, meta.seq_lens, self.workspace,
            kv_scale=_kv_dequant_scale(layer) if self.kv_cache_dtype.startswith("fp8") else None,
            max_seq_len=meta.max_seq_len, step=meta.step)
        return out.view(-1, num_heads * V_HEAD_DIM)

    def _runner(self, softmax_scale: float) -> serving.DecodeRunner:
        runner = self.runners.get(softmax_scale)
        if runner is None:
            runner = self.runners[softmax_scale] = serving.DecodeRunner(softmax_scale, self.kv_cache_dtype,
                                                                        check=engine_check())
        return runner

    def _save_kv(self, layer, forward_batch, k, v, k_rope) -> None:
        """This step's latent + rope into the pool, as SGLang's Triton backend stores it (an fp8 pool holds
        k / k_scale cast to e4m3)."""
        pool = self.token_to_kv_pool
        if k_rope is not None:
            if layer.k_scale is not None:
                k, k_rope = k / layer.k_scale, k_rope / layer.k_scale
            pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
            return
        if layer.k_scale is not None:
            k = k / layer.k_scale
        pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)


def _kv_cache_dtype_name(kv_cache_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    if kv_cache_dtype == torch.float8_e4m3fn:
        return "fp8_e4m3"
    if kv_cache_dtype == model_dtype and kv_cache_dtype in (torch.bfloat16, torch.float16):
        return "auto"
    raise ValueError(f"{SGLANG_BACKEND_NAME}: --kv-cache-dtype giving {kv_cache_dtype} is not supported with model "
                     f"dtype {model_dtype}; allowed: auto (the model dtype: bfloat16 or float16), fp8_e4m3")


def _kv_dequant_scale(layer) -> float:
    """The fp8 pool stores k / k_scale (SGLang's write path), so k_scale dequantises; 1.0 without one."""
    scale = getattr(layer, "k_scale_float", None)
    if scale is None and layer.k_scale is not None:
        scale = float(layer.k_scale)
    return 1.0 if scale is None else float(scale)


def _chain_verify_q_len(num_draft_tokens: int | None, topk: int | None) -> int | None:
    """Query tokens per request of TARGET_VERIFY when our kernels can serve it: a chain draft (topk 1) of
    ``speculative_num_draft_tokens`` <= 4 tokens, each attending causally to the ones before it (the kernels'
    rule). None without speculative decoding or for tree drafts (SGLang's Triton path serves those)."""
    draft = num_draft_tokens or 0
    if draft == 0:
        return None
    topk = topk or 1
    if topk != 1 or draft > MAX_Q_LEN:
        logger.info("%s: verify of %s draft tokens with topk %s runs on SGLang's Triton path (ours: a chain of "
                    "at most %d)", SGLANG_BACKEND_NAME, draft, topk, MAX_Q_LEN)
        return None
    return draft


def _is_chain(spec_info, q_len: int) -> bool:
    """An EAGLE-family verify input of a chain (topk 1) of ``q_len`` tokens per request. Anything else (n-gram
    verify, whose drafts form a tree under a custom mask and carry no topk; DFlash blocks) is not ours."""
    return getattr(spec_info, "topk", None) == 1 and getattr(spec_info, "draft_token_num", q_len) == q_len
