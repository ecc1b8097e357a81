"""The benchmark's inputs and the peer MLA decode kernels it compares against, each called like vLLM 0.26.

Every peer is used only when importable, through its public entry point, on the same q, paged KV cache,
block table and lengths as ours. A peer adapter has:

* ``available() -> (bool, reason)``: its modules import and the device can run it;
* ``unsupported_reason(cell, cc) -> str | None``: why it cannot run a cell (q_len, dtype, arch, block size);
* ``query_dtype(cell, cc) -> "bf16" | "fp8"``: the q dtype vLLM hands this backend (vLLM quantises q to fp8
  for fp8 KV caches unless the backend opts out, as TRITON_MLA does);
* ``prepare(inputs) -> PeerCall``: does the peer's planning / metadata (vLLM does it in its metadata builder,
  outside the CUDA graph) and returns the call to time.

A ``PeerCall`` is callable: ``call(copy)`` runs one decode on KV copy ``copy`` and returns
``(out [T, H, 512], lse [T, H] natural log float32, or None)``. Its ``launch(copy)`` is the graph-captured,
timed part (no host syncs); ``standardize(raw)`` turns the raw result into that layout outside the timing.

Smoke-test peers on a tiny problem against the float32 reference (this is also how bench_decode.py JIT-warms
FlashInfer in a subprocess with a time limit):

    python benchmarks/peers.py --smoke flashmla fa3_mla triton_mla flashinfer_mla
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from report import PEER  # sibling module: benchmarks/ is the script directory

from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM, QK_ROPE_HEAD_DIM
from mla_backend_plugin.testing import DecodeInputs, compare_decode, make_decode_inputs

REPO_ROOT = Path(__file__).resolve().parents[1]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448 for e4m3fn
# KV values are N(0, 1) clipped to +-KV_FP8_CLIP and stored as value / KV_FP8_SCALE, so they fill the e4m3
# range (|stored| <= 448) and a kernel that ignores the scale is off by 64x.
KV_FP8_SCALE = 1.0 / 64.0
KV_FP8_CLIP = FP8_MAX * KV_FP8_SCALE
# DeepSeek-V2/V3: 128 "nope" dims before the absorption of W_UK (FlashInfer's trtllm-gen API asks for it).
DEEPSEEK_QK_NOPE_HEAD_DIM = 128
DEFAULT_SOFTMAX_SCALE = (DEEPSEEK_QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM) ** -0.5
# vLLM 0.26 FLASH_ATTN_MLA under full CUDA graphs: attention_config.flash_attn_max_num_splits_for_cuda_graph.
FA3_MAX_NUM_SPLITS_FOR_CUDA_GRAPH = 32
# vLLM's FlashInfer MLA workspace with return_lse (FLASHINFER_MLA_LSE_WORKSPACE_BUFFER_SIZE), and FlashInfer's
# recommended float workspace of BatchMLAPagedAttentionWrapper.
FLASHINFER_TRTLLM_WORKSPACE_BYTES = 256 * 1024 * 1024
FLASHINFER_WRAPPER_WORKSPACE_BYTES = 128 * 1024 * 1024
# KV generation works in chunks of this many bytes of float32 so that a 10 GB cache needs no 20 GB temporary.
_FILL_CHUNK_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the benchmark grid. Every request has the same KV length ``seq_len``."""

    batch: int
    seq_len: int  # includes this step's q_len new tokens
    q_len: int
    kv_dtype: str  # "bf16" | "fp8"
    num_heads: int = 128
    block_size: int = 64

    @property
    def tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def pages_per_request(self) -> int:
        return -(-self.seq_len // self.block_size)

    @property
    def num_blocks(self) -> int:
        return self.batch * self.pages_per_request

    @property
    def kv_bytes_per_copy(self) -> int:
        return self.num_blocks * self.block_size * QK_HEAD_DIM * torch.finfo(TORCH_DTYPES[self.kv_dtype]).bits // 8

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def label(self) -> str:
        return f"B={self.batch} S={self.seq_len} q_len={self.q_len} kv={self.kv_dtype}"


def cell_inputs(cell: Cell, device, copies: int = 1, softmax_scale: float = DEFAULT_SOFTMAX_SCALE,
                seed: int = 0) -> DecodeInputs:
    """The cell's inputs from the package's generator: every request has S tokens on pages in random order (as
    after a while of serving), ``copies`` identical caches at other addresses (each like one layer's cache:
    vLLM's layers share the block table, not the cache), a bf16 q; an fp8 cache stores values / KV_FP8_SCALE."""
    return make_decode_inputs(
        cell.batch, [cell.seq_len] * cell.batch, cell.q_len, cell.num_heads, cell.block_size,
        TORCH_DTYPES[cell.kv_dtype], "cat", device, seed, q_dtype=torch.bfloat16, softmax_scale=softmax_scale,
        kv_scale=KV_FP8_SCALE if cell.kv_dtype == "fp8" else None, num_blocks=cell.num_blocks + 1,
        max_blocks=cell.pages_per_request, kv_copies=copies)


@dataclasses.dataclass
class PeerCall:
    launch: Callable[[int], object]  # timed: one decode on KV copy i, graph-capturable
    standardize: Callable[[object], tuple]  # untimed: raw result -> (out [T, H, 512], lse [T, H] natural or None)

    def __call__(self, copy: int = 0):
        return self.standardize(self.launch(copy))


def _needs_sm90(cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc[0] != 9:
        return f"SM90 (Hopper) only; device is SM{cc[0]}{cc[1]}"
    return None


class Peer:
    kind = PEER
    name = ""
    description = ""
    opt_in = False  # run only when asked for by name (FlashInfer: JIT-compiles with nvcc on first use)

    def __init__(self):
        self._modules = None

    def _import(self):
        """The peer's public entry points, as a namespace; raises when not importable."""
        raise NotImplementedError

    def modules(self):
        if self._modules is None:
            self._modules = self._import()
        return self._modules

    def _device_reason(self) -> str | None:
        """Why the current CUDA device cannot run this peer at all (None = it can)."""
        return None

    def available(self) -> tuple[bool, str]:
        try:
            self.modules()
        except Exception as e:  # noqa: BLE001 - any import failure means "not importable", with its reason
            return False, f"not importable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not torch.cuda.is_available():
            return False, "importable; no CUDA device here"
        reason = self._device_reason()
        return (False, reason) if reason else (True, "available")

    def unsupported_reason(self, cell: Cell, cc) -> str | None:
        raise NotImplementedError

    def query_dtype(self, cell: Cell, cc) -> str:
        return "bf16"

    def mma_dtype(self, cell: Cell, cc) -> str:
        """Operand dtype of the peer's Q K^T and P V tensor-core products in this cell (report.MMA_DTYPES, or
        "QK/PV" when they differ): bf16 unless the peer says otherwise (an fp8 cache widened before its MMAs)."""
        return "bf16"

    def prepare(self, cell: Cell, inputs: DecodeInputs) -> PeerCall:
        raise NotImplementedError


def _flashmla_standardize(cell: Cell):
    """FlashMLA returns out [B, q_len, H, 512] and lse [B, H, q_len] (natural log)."""

    def standardize(raw):
        out, lse = raw
        return (out.reshape(cell.tokens, cell.num_heads, KV_LORA_RANK),
                lse.transpose(1, 2).reshape(cell.tokens, cell.num_heads))

    return standardize


class VllmFlashMLA(Peer):
    """vLLM FLASHMLA backend: FlashMLA dense decode (bf16), or vLLM's dense fp8 FlashMLA extension with fp8 q."""

    name = "flashmla"
    description = ("vLLM FLASHMLA: vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache (bf16) / "
                   "flash_mla_with_kvcache_fp8 (fp8 q + fp8 KV)")

    def _import(self):
        from vllm.v1.attention.ops import flashmla

        return flashmla

    def _device_reason(self):
        ok, reason = self.modules().is_flashmla_dense_supported()
        return None if ok else reason

    def unsupported_reason(self, cell, cc):
        if reason := _needs_sm90(cc):
            return f"FlashMLA dense decode: {reason}"
        if cell.block_size != 64:
            return f"FlashMLA needs block size 64, cell has {cell.block_size}"
        if cell.kv_dtype == "fp8" and cc != (9, 0):
            return f"FlashMLA dense fp8 needs SM90 exactly, device is SM{cc[0]}{cc[1]}"
        return None

    def query_dtype(self, cell, cc):
        return "fp8" if cell.kv_dtype == "fp8" else "bf16"  # FlashMLAImpl keeps supports_quant_query_input

    def mma_dtype(self, cell, cc):
        # vLLM's vendored SM90 dense fp8 kernel (FlashMLA PR 54, csrc/extension/sm90/dense_fp8): Q K^T as an SS
        # e4m3 wgmma, P V as an RS e4m3 wgmma on V transposed in shared memory
        return "fp8" if cell.kv_dtype == "fp8" else "bf16"

    def prepare(self, cell, inputs):
        ops = self.modules()
        q, q_scale = inputs.query(self.query_dtype(cell, None))
        q = q.view(cell.batch, cell.q_len, cell.num_heads, QK_HEAD_DIM)  # reshape_query_for_spec_decode
        # FlashMLAMetadataBuilder._build_decode: num_q_tokens_per_head_k = q_len * H, one KV head.
        sched_meta, _ = ops.get_mla_metadata(inputs.seq_lens, cell.q_len * cell.num_heads, 1,
                                             is_fp8_kvcache=cell.kv_dtype == "fp8")
        if cell.kv_dtype == "fp8":
            kv_scale = inputs.kv_scale_tensor()
            tile_scheduler_metadata, num_splits = ops.get_mla_metadata_dense_fp8(
                inputs.seq_lens, cell.q_len * cell.num_heads, 1)

            def launch(i):  # FlashMLAImpl.forward_mqa, quantized KV branch
                return ops.flash_mla_with_kvcache_fp8(
                    q=q, k_cache=inputs.kv_caches[i].unsqueeze(-2), block_table=inputs.block_table,
                    cache_seqlens=inputs.seq_lens, head_dim_v=KV_LORA_RANK,
                    tile_scheduler_metadata=tile_scheduler_metadata, num_splits=num_splits,
                    softmax_scale=inputs.softmax_scale, causal=True,
                    descale_q=q_scale, descale_k=kv_scale)
        else:
            def launch(i):  # FlashMLAImpl.forward_mqa, bf16 branch
                return ops.flash_mla_with_kvcache(
                    q=q, k_cache=inputs.kv_caches[i].unsqueeze(-2), block_table=inputs.block_table,
                    cache_seqlens=inputs.seq_lens, head_dim_v=KV_LORA_RANK, tile_scheduler_metadata=sched_meta,
                    softmax_scale=inputs.softmax_scale, causal=True, is_fp8_kvcache=False)

            # FlashMLA plans its tile schedule inside the first call on a fresh FlashMLASchedMeta and reuses
            # it afterwards (same lengths and shapes); make that first call here, outside the timed graph.
            launch(0)
        return PeerCall(launch, _flashmla_standardize(cell))


class VllmFlashAttnMLA(Peer):
    """vLLM FLASH_ATTN_MLA backend: FlashAttention-3 with q_v, on SM90."""

    name = "fa3_mla"
    description = ("vLLM FLASH_ATTN_MLA: vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3) + "
                   "get_scheduler_metadata")

    def _import(self):
        from vllm.v1.attention.backends.fa_utils import flash_attn_supports_mla
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

        return argparse.Namespace(flash_attn_supports_mla=flash_attn_supports_mla,
                                  flash_attn_varlen_func=flash_attn_varlen_func,
                                  get_scheduler_metadata=get_scheduler_metadata)

    def _device_reason(self):
        return None if self.modules().flash_attn_supports_mla() else "FA3 MLA is not supported on this device"

    def unsupported_reason(self, cell, cc):
        if reason := _needs_sm90(cc):
            return f"FA3: {reason}"
        if cell.kv_dtype == "fp8":
            return "vLLM 0.26 FLASH_ATTN_MLA rejects an fp8 KV cache (NotImplementedError)"
        if cell.block_size % 16:
            return f"FLASH_ATTN_MLA needs a block size that is a multiple of 16, cell has {cell.block_size}"
        return None

    def prepare(self, cell, inputs):
        fa = self.modules()
        query_start_loc = inputs.query_start_loc
        q_nope, q_pe = inputs.q[..., :KV_LORA_RANK], inputs.q[..., KV_LORA_RANK:]
        # FlashAttnMLAMetadataBuilder._schedule_decode with full CUDA graphs (max_num_splits = 32).
        scheduler_metadata = fa.get_scheduler_metadata(
            batch_size=cell.batch, max_seqlen_q=cell.q_len, max_seqlen_k=cell.seq_len,
            num_heads_q=cell.num_heads, num_heads_kv=1, headdim=QK_ROPE_HEAD_DIM,
            cache_seqlens=inputs.seq_lens, qkv_dtype=TORCH_DTYPES[cell.kv_dtype], headdim_v=KV_LORA_RANK,
            page_size=cell.block_size, cu_seqlens_q=query_start_loc, causal=True,
            num_splits=FA3_MAX_NUM_SPLITS_FOR_CUDA_GRAPH)

        def launch(i):  # FlashAttnMLAImpl.forward_mqa
            kv = inputs.kv_caches[i]
            return fa.flash_attn_varlen_func(
                q=q_pe, k=kv[..., KV_LORA_RANK:].unsqueeze(-2), v=kv[..., :KV_LORA_RANK].unsqueeze(-2),
                q_v=q_nope, max_seqlen_q=cell.q_len, cu_seqlens_q=query_start_loc,
                max_seqlen_k=cell.seq_len, seqused_k=inputs.seq_lens, block_table=inputs.block_table,
                softmax_scale=inputs.softmax_scale, causal=True, return_softmax_lse=True, fa_version=3,
                scheduler_metadata=scheduler_metadata, num_splits=FA3_MAX_NUM_SPLITS_FOR_CUDA_GRAPH)

        def standardize(raw):
            out, lse = raw  # lse is [H, T] (natural log)
            return out, lse.transpose(0, 1)

        return PeerCall(launch, standardize)


class VllmTritonMLA(Peer):
    """vLLM TRITON_MLA backend: split-KV Triton decode (stage 1 + reduce), bf16 q, any SM80+ GPU."""

    name = "triton_mla"
    description = ("vLLM TRITON_MLA: vllm.v1.attention.ops.triton_decode_attention.decode_attention_fwd "
                   "(num_kv_splits from triton_mla._compute_num_kv_splits)")

    def _import(self):
        from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

        return argparse.Namespace(decode_attention_fwd=decode_attention_fwd,
                                  compute_num_kv_splits=_compute_num_kv_splits)

    def unsupported_reason(self, cell, cc):
        if cc is None:
            return "needs a CUDA device"
        if cell.q_len != 1:
            return ("vLLM TRITON_MLA decodes one query token per request (UNIFORM_SINGLE_TOKEN_DECODE); "
                    "q_len > 1 goes to its prefill path")
        if cell.kv_dtype == "fp8" and cc < (8, 9):
            return "fp8 KV needs SM89+"
        return None

    def prepare(self, cell, inputs):
        ops = self.modules()
        device = inputs.device
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        num_kv_splits = ops.compute_num_kv_splits(cell.seq_len, sm_count)  # from attn_metadata.max_seq_len
        # forward_mqa allocates o and lse (in q's dtype) per call; allocated once here, outside the timing.
        out = torch.zeros(cell.tokens, cell.num_heads, KV_LORA_RANK, dtype=inputs.q.dtype, device=device)
        lse = torch.zeros(cell.tokens, cell.num_heads, dtype=inputs.q.dtype, device=device)
        attn_logits = torch.empty(cell.tokens, cell.num_heads, num_kv_splits, KV_LORA_RANK + 1,
                                  dtype=torch.float32, device=device)
        # vLLM always passes layer._k_scale (1.0 for a bf16 cache) as both k and v scale.
        k_scale = inputs.kv_scale_tensor() if inputs.kv_scale is not None else torch.ones(1, device=device)

        def launch(i):  # TritonMLAImpl.forward_mqa
            kv = inputs.kv_caches[i].unsqueeze(2)  # add a head dim of 1
            ops.decode_attention_fwd(inputs.q, kv, kv[..., :KV_LORA_RANK], out, lse, inputs.block_table,
                                     inputs.seq_lens, attn_logits, num_kv_splits, inputs.softmax_scale,
                                     cell.block_size, k_scale=k_scale, v_scale=k_scale, is_mla=True)
            return out, lse

        return PeerCall(launch, lambda raw: (raw[0], raw[1].float()))


class FlashInferMLA(Peer):
    """FlashInfer MLA decode: BatchMLAPagedAttentionWrapper(backend="fa3") on SM90 (vLLM 0.26 has no SM90
    FlashInfer MLA backend); trtllm_batch_decode_with_kv_cache_mla on SM100, as vLLM's FLASHINFER_MLA."""

    name = "flashinfer_mla"
    description = ("FlashInfer MLA: SM90 flashinfer.mla.BatchMLAPagedAttentionWrapper(backend='fa3') plan/run; "
                   "SM100 flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla (vLLM FLASHINFER_MLA)")
    opt_in = True

    def _import(self):
        import flashinfer
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, trtllm_batch_decode_with_kv_cache_mla

        return argparse.Namespace(version=flashinfer.__version__, wrapper=BatchMLAPagedAttentionWrapper,
                                  trtllm_decode=trtllm_batch_decode_with_kv_cache_mla)

    def unsupported_reason(self, cell, cc):
        if cc is None:
            return "needs a CUDA device"
        if cc[0] == 9:
            return None  # fa3 wrapper: bf16 q with a bf16 or fp8 cache, any page size
        if cc[0] == 10:
            if cell.block_size not in (32, 64):
                return f"trtllm-gen MLA needs block size 32 or 64, cell has {cell.block_size}"
            return None
        return f"wired for SM90 (fa3 wrapper) and SM100 (trtllm-gen) only; device is SM{cc[0]}{cc[1]}"

    def query_dtype(self, cell, cc):
        # SM90 fa3 wrapper: fp8 KV "only supports q_data_type=torch.bfloat16"; SM100: vLLM quantises q.
        return "fp8" if cell.kv_dtype == "fp8" and cc is not None and cc[0] == 10 else "bf16"

    def mma_dtype(self, cell, cc):
        # SM90 (0.6.14 mla_hopper.cuh): an fp8 cache is dequantised to bf16 in shared memory before bf16 wgmmas;
        # SM100 trtllm-gen takes the fp8 q and cache as they are
        return self.query_dtype(cell, cc)

    def prepare(self, cell, inputs):
        cc = torch.cuda.get_device_capability(inputs.device)
        return self._prepare_trtllm(cell, inputs, cc) if cc[0] == 10 else self._prepare_fa3_wrapper(cell, inputs)

    def _prepare_fa3_wrapper(self, cell, inputs):
        fi = self.modules()
        device = inputs.device
        workspace = torch.empty(FLASHINFER_WRAPPER_WORKSPACE_BYTES, dtype=torch.int8, device=device)
        wrapper = fi.wrapper(workspace, backend="fa3")
        pages = cell.pages_per_request
        kv_indptr = torch.arange(cell.batch + 1, dtype=torch.int32, device=device) * pages
        kv_indices = inputs.block_table[:, :pages].reshape(-1).contiguous()
        kv_dtype = TORCH_DTYPES[cell.kv_dtype]
        wrapper.plan(inputs.query_start_loc, kv_indptr, kv_indices, inputs.seq_lens, cell.num_heads,
                     KV_LORA_RANK, QK_ROPE_HEAD_DIM, cell.block_size, True, inputs.softmax_scale,
                     inputs.q.dtype, kv_dtype)
        q_nope, q_pe = inputs.q[..., :KV_LORA_RANK], inputs.q[..., KV_LORA_RANK:]
        out = torch.empty(cell.tokens, cell.num_heads, KV_LORA_RANK, dtype=inputs.q.dtype, device=device)
        lse = torch.empty(cell.tokens, cell.num_heads, dtype=torch.float32, device=device)
        scales = {}
        if cell.kv_dtype == "fp8":
            scales = dict(ckv_scale=inputs.kv_scale, kpe_scale=inputs.kv_scale)

        def launch(i):
            kv = inputs.kv_caches[i]
            return wrapper.run(q_nope, q_pe, kv[..., :KV_LORA_RANK], kv[..., KV_LORA_RANK:], out=out, lse=lse,
                               return_lse=True, return_lse_base_on_e=True, **scales)

        return PeerCall(launch, lambda raw: raw)  # the closure keeps the planned wrapper and its buffers alive

    def _prepare_trtllm(self, cell, inputs, cc):
        fi = self.modules()
        device = inputs.device
        q_dtype = self.query_dtype(cell, cc)
        q, q_scale = inputs.query(q_dtype)
        q = q.view(cell.batch, cell.q_len, cell.num_heads, QK_HEAD_DIM)
        # FlashInferMLAImpl: bmm1 = scale * q_scale * k_scale and bmm2 = k_scale for an fp8 cache.
        bmm1_scale, bmm2_scale = inputs.softmax_scale, 1.0
        if cell.kv_dtype == "fp8":
            bmm1_scale *= (float(q_scale) if q_scale is not None else 1.0) * inputs.kv_scale
            bmm2_scale *= inputs.kv_scale
        workspace = torch.zeros(FLASHINFER_TRTLLM_WORKSPACE_BYTES, dtype=torch.int8, device=device)

        def launch(i):  # FlashInferMLAImpl.forward_mqa
            return fi.trtllm_decode(
                query=q, kv_cache=inputs.kv_caches[i].unsqueeze(1), workspace_buffer=workspace,
                qk_nope_head_dim=DEEPSEEK_QK_NOPE_HEAD_DIM, kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM, block_tables=inputs.block_table, seq_lens=inputs.seq_lens,
                max_seq_len=cell.seq_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, return_lse=True)

        def standardize(raw):
            out, lse = raw  # trtllm-gen's LSE is base 2 (vLLM: FlashInferMLAImpl.lse_base_on_e = False)
            return (out.reshape(cell.tokens, cell.num_heads, KV_LORA_RANK),
                    lse.reshape(cell.tokens, cell.num_heads).float() * math.log(2.0))

        return PeerCall(launch, standardize)


PEERS: dict[str, Peer] = {p.name: p for p in (VllmFlashMLA(), VllmFlashAttnMLA(), VllmTritonMLA(), FlashInferMLA())}

def check_against_reference(out: torch.Tensor, lse: torch.Tensor | None, ref_out: torch.Tensor,
                            ref_lse: torch.Tensor, kv_dtype: str):
    """The package's comparison (mla_backend_plugin.testing); the benchmark fails a kernel on its output only:
    an LSE off the reference is reported in the note (vLLM uses the LSE only to merge context-parallel
    shards, and some peers return it in bf16)."""
    return compare_decode(out, lse, ref_out, ref_lse, kv_dtype)


# Exit codes of ``peers.py --smoke``: bench_decode.py treats a peer that ran (even wrongly) as usable, since
# the benchmark checks every cell itself, and one that raised or is unavailable as not.
SMOKE_OK, SMOKE_WRONG, SMOKE_ERROR = 0, 1, 3


def smoke(names: list[str], kv_dtypes: list[str], q_lens: list[int], block_size: int, num_heads: int) -> int:
    """Run each named peer on a tiny problem and compare with the reference; returns an exit code.

    For FlashInfer the first call JIT-compiles its kernels (minutes), which later processes reuse.
    """
    cc = torch.cuda.get_device_capability()
    errors = wrong = 0
    for name in names:
        peer = PEERS[name]
        ok, reason = peer.available()
        if not ok:
            print(f"{name}: unavailable: {reason}")
            errors += 1
            continue
        for kv_dtype in kv_dtypes:
            for q_len in q_lens:
                cell = Cell(batch=3, seq_len=300, q_len=q_len, kv_dtype=kv_dtype, num_heads=num_heads,
                            block_size=block_size)
                if reason := peer.unsupported_reason(cell, cc):
                    print(f"{name} {cell.label()}: n/a: {reason}")
                    continue
                try:
                    inputs = cell_inputs(cell, "cuda", copies=2)
                    out, lse = peer.prepare(cell, inputs)(1)
                    torch.cuda.synchronize()
                    check = check_against_reference(out, lse, *inputs.reference(peer.query_dtype(cell, cc)),
                                                    kv_dtype)
                except Exception:  # noqa: BLE001 - report and go on with the next peer
                    print(f"{name} {cell.label()}: ERROR\n{traceback.format_exc()}")
                    errors += 1
                    continue
                wrong += not check.out_ok
                print(f"{name} {cell.label()}: {'ok' if check.out_ok else 'WRONG'} max|err| {check.max_abs_err:.3g}"
                      f" lse max|err| {check.lse_max_abs_err}" + (f" ({check.summary()})" if check.problems else ""))
    return SMOKE_ERROR if errors else SMOKE_WRONG if wrong else SMOKE_OK


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", nargs="+", metavar="PEER", choices=sorted(PEERS), required=True,
                        help="peers to run on a tiny problem against the reference")
    parser.add_argument("--kv-dtypes", default="bf16,fp8")
    parser.add_argument("--q-lens", default="1,2")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=128)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("peers.py --smoke needs a CUDA device", file=sys.stderr)
        return SMOKE_ERROR
    return smoke(args.smoke, args.kv_dtypes.split(","), [int(x) for x in args.q_lens.split(",")],
                 args.block_size, args.num_heads)


if __name__ == "__main__":
    sys.exit(main())
