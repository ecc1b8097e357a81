"""The inputs of one decode call, validated: ``prepare_args`` checks every argument of ``mla_decode`` (no device
sync; a bad one is a ValueError naming it and what is allowed) and returns the normalised ``DecodeArgs`` a
kernel's ``launch`` receives.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mla_backend_plugin.ops.constants import (
    FP8_DTYPE,
    KV_CACHE_DTYPES,
    KV_LORA_RANK,
    OUT_DTYPES,
    Q_DTYPES,
    QK_HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_NUM_HEADS,
    SUPPORTED_Q_LENS,
    dtype_names,
)
from mla_backend_plugin.ops.workspace import StepPlans

Scale = float | torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class DcpLayout:
    """How a decode-context-parallel group shards the KV cache, for kernels that apply the DCP visibility rule
    themselves (FlashInfer's cute-dsl DCP mode) instead of reading ``row_kv_lens``: rank ``rank`` of ``world``
    stores global token positions ``p`` with ``(p // interleave) % world == rank``; ``global_seq_lens`` is the
    int32 ``[batch]`` device tensor of each request's global KV length (this step's tokens included, the
    lengths ``ops.serving.dcp_row_kv_lens`` takes). Given next to ``row_kv_lens``, which it must agree with."""

    world: int
    rank: int
    interleave: int
    global_seq_lens: torch.Tensor


def _check_dcp(dcp, batch: int, device: torch.device) -> DcpLayout | None:
    if dcp is None:
        return None
    if not isinstance(dcp, DcpLayout):
        fail("dcp", f"must be an ops.DcpLayout(world, rank, interleave, global_seq_lens) or None, "
                    f"got {type(dcp).__name__}")
    for name in ("world", "rank", "interleave"):
        value = getattr(dcp, name)
        if not isinstance(value, int) or isinstance(value, bool):
            fail("dcp", f"{name} must be a Python int, got {value!r}")
    if dcp.world < 1:
        fail("dcp", f"world must be >= 1, got {dcp.world}")
    if not 0 <= dcp.rank < dcp.world:
        fail("dcp", f"rank must be in [0, {dcp.world - 1}] (0 <= rank < world), got {dcp.rank}")
    if dcp.interleave < 1:
        fail("dcp", f"interleave must be >= 1 (tokens per rank before the next rank), got {dcp.interleave}")
    lens = dcp.global_seq_lens
    if not isinstance(lens, torch.Tensor) or lens.dtype != torch.int32 or tuple(lens.shape) != (batch,):
        fail("dcp", f"global_seq_lens must be an int32 tensor [batch] = [{batch}], got {_describe(lens)}")
    if not lens.is_contiguous():
        fail("dcp", "global_seq_lens must be contiguous")
    if lens.device != device:
        fail("dcp", f"global_seq_lens is on {lens.device} but q is on {device}")
    return dcp


@dataclasses.dataclass
class DecodeArgs:
    """Validated, normalised inputs of one decode call (what a kernel's ``launch`` receives)."""

    q_nope: torch.Tensor  # [B*q_len, H, 512] view, last dim contiguous
    q_pe: torch.Tensor  # [B*q_len, H, 64] view, last dim contiguous
    kv_cache: torch.Tensor  # [num_blocks, block_size, 576], last dim contiguous
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    batch: int
    q_len: int
    num_heads: int
    softmax_scale: float
    q_scale: Scale  # dequantisation scale of an fp8 q (None for 16-bit q)
    kv_scale: Scale  # dequantisation scale of an fp8 KV cache (None for 16-bit caches)
    out: torch.Tensor  # [B*q_len, H, 512]
    lse: torch.Tensor  # [B*q_len, H] float32, natural log
    compute_dtype: torch.dtype  # 16-bit dtype the matrix products run in
    # [B, q_len] int32: keys each query row sees (at most seq_len), or None for the usual causal rule
    # (seq_len - q_len + t + 1). Given for a KV cache sharded across ranks (decode context parallelism).
    row_kv_lens: torch.Tensor | None = None
    # how the KV cache is sharded across a decode-context-parallel group (mla_decode's ``dcp``), or None; only a
    # kernel that applies the DCP rule itself reads it (FlashInfer's cute-dsl, which takes row_kv_lens only so)
    dcp: DcpLayout | None = None
    # the decode step this call belongs to (mla_decode's ``step``): a family with a step-plan kernel plans once
    # per step; not part of the signature (it changes every step, the decision does not)
    step: StepPlans | None = None
    # the caller reads the LSE (mla_decode's ``return_lse``): False lets a kernel that writes none
    # (``KernelManifest.writes_lse = False``) run; kernels that write one still write it to ``lse``, whose
    # contents are then unspecified
    need_lse: bool = True

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache.dtype

    @property
    def q_dtype(self) -> torch.dtype:
        return self.q_nope.dtype

    def signature(self) -> tuple:
        """Everything of this call that a kernel decision (registry support, tuned lookup, launch config, workspace
        fit) may depend on: shapes, dtypes, strides, the 16-byte alignment of the rows kernels load by TMA or
        vectors, the scale forms, the device. Two calls with one signature get one decision."""
        qn, qp, kv, out = self.q_nope, self.q_pe, self.kv_cache, self.out
        return (self.batch, self.q_len, self.num_heads, qn.dtype, kv.dtype, out.dtype, kv.shape[1],
                self.block_table.shape[1], qn.stride(), qp.stride(), kv.stride(), out.stride(), self.lse.stride(),
                qn.data_ptr() % 16, qp.data_ptr() % 16, kv.data_ptr() % 16, out.data_ptr() % 16,
                type(self.q_scale), type(self.kv_scale), self.row_kv_lens is None, self.need_lse, qn.device,
                # whether row_kv_lens can be served by FlashInfer's DCP mode (compile-time world, interleave 1)
                None if self.dcp is None else (self.dcp.world, self.dcp.interleave))


def fail(arg: str, msg: str):
    """Raise the ValueError of a bad ``mla_decode`` argument ``arg``."""
    raise ValueError(f"mla_decode: {arg}: {msg}")


def _check_scale(name: str, scale: Scale, tensor_is_fp8: bool, device: torch.device) -> None:
    if scale is None:
        return
    if not tensor_is_fp8:
        fail(name, "is a dequantisation scale of an fp8 tensor; pass None when that tensor is 16-bit")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            fail(name, f"must be a float or a 1-element float32 tensor, got {tuple(scale.shape)} {scale.dtype}")
        if scale.device != device:
            fail(name, f"must be on {device}, got {scale.device}")
    else:
        value = float(scale)  # a number (else its TypeError / ValueError)
        if not (math.isfinite(value) and value > 0):
            fail(name, f"must be a positive finite number (a dequantisation scale), got {scale!r}")


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _split_q(q) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            fail("q", "a tuple must be (q_nope [T, H, 512], q_pe [T, H, 64])")
        q_nope, q_pe = q
        for name, t, d in (("q_nope", q_nope, KV_LORA_RANK), ("q_pe", q_pe, QK_ROPE_HEAD_DIM)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != d:
                fail(name, f"must be a 3-D tensor [tokens, heads, {d}], got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if q_nope.shape[:2] != q_pe.shape[:2]:
            fail("q", f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} disagree on [tokens, heads]")
        if q_nope.dtype != q_pe.dtype:
            fail("q", f"q_nope is {q_nope.dtype} but q_pe is {q_pe.dtype}")
        if q_nope.dtype not in Q_DTYPES:
            fail("q", f"dtype {q_nope.dtype} is not supported for the (q_nope, q_pe) form; "
                       f"allowed: {dtype_names(Q_DTYPES)}")
        return q_nope, q_pe
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != QK_HEAD_DIM:
        fail("q", f"must be a [tokens, heads, {QK_HEAD_DIM}] tensor or a (q_nope, q_pe) pair, got "
                   f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype not in Q_DTYPES + (FP8_DTYPE,):
        fail("q", f"dtype {q.dtype} is not supported; allowed: {dtype_names(Q_DTYPES + (FP8_DTYPE,))}")
    return _q_parts(q)


def _q_parts(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope and q_pe as views of one [T, H, 576] q."""
    return q.split_with_sizes((KV_LORA_RANK, QK_ROPE_HEAD_DIM), -1)


@dataclasses.dataclass(frozen=True)
class CallForm:
    """What ``check_call`` found of a valid call, all that ``bind`` needs to make its ``DecodeArgs`` without checking
    again: every call with the same ``call_fingerprint`` has this form."""

    pair: bool  # q is the (q_nope, q_pe) pair, else one [T, H, 576] tensor
    squeeze: bool  # the cache is [num_blocks, block_size, 1, 576]
    batch: int
    q_len: int
    num_heads: int
    out_dtype: torch.dtype
    compute_dtype: torch.dtype


def prepare_args(q, kv_cache, block_table, seq_lens, *, softmax_scale: float, q_len: int | None = None,
                 q_scale: Scale = None, kv_scale: Scale = None, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 row_kv_lens: torch.Tensor | None = None, need_lse: bool = True,
                 dcp: DcpLayout | None = None) -> DecodeArgs:
    """Validate every input of ``mla_decode`` (no device sync) and allocate out/lse if not given."""
    form = check_call(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale, q_len=q_len, q_scale=q_scale,
                      kv_scale=kv_scale, out=out, lse=lse, out_dtype=out_dtype, row_kv_lens=row_kv_lens,
                      need_lse=need_lse, dcp=dcp)
    return bind(form, q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, kv_scale, out, lse, row_kv_lens,
                need_lse, dcp)


def bind(form: CallForm, q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, kv_scale, out, lse,
         row_kv_lens, need_lse, dcp) -> DecodeArgs:
    """The ``DecodeArgs`` of a call whose inputs ``check_call`` found valid with ``form`` (no check here): q split,
    the cache squeezed, scales in their normal form, out / lse allocated when not given."""
    q_nope, q_pe = q if form.pair else _q_parts(q)
    if form.squeeze:
        kv_cache = kv_cache.squeeze(2)
    num_tokens = form.batch * form.q_len
    if out is None:
        out = torch.empty((num_tokens, form.num_heads, KV_LORA_RANK), dtype=form.out_dtype, device=q_nope.device)
    if lse is None:
        lse = torch.empty((num_tokens, form.num_heads), dtype=torch.float32, device=q_nope.device)
    return DecodeArgs(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                      batch=form.batch, q_len=form.q_len, num_heads=form.num_heads,
                      softmax_scale=float(softmax_scale), q_scale=kernel_scale(q_scale),
                      kv_scale=kernel_scale(kv_scale), out=out, lse=lse, compute_dtype=form.compute_dtype,
                      row_kv_lens=row_kv_lens, need_lse=need_lse, dcp=dcp)


def kernel_scale(scale: Scale) -> Scale:
    """A checked scale as kernels take it: one shape for every kernel (vLLM passes 0-d tensors: a [1] view, no
    copy; serving.DecodeRunner hands them in that shape already), a number as a Python float."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return scale if scale.dim() == 1 else scale.reshape(1)
    return float(scale)


def _meta(t) -> tuple:
    """What the checks read of a tensor argument (TypeError for anything else)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device


def _aligned_meta(t) -> tuple:
    """``_meta`` and the 16-byte alignment the decision may depend on (DecodeArgs.signature)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def _scale_meta(scale) -> tuple | type | None:
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return scale.shape, scale.dtype, scale.device
    if type(scale) not in (float, int):
        raise TypeError  # other numbers: checked every call
    return type(scale), math.isfinite(scale) and scale > 0  # the check refuses the rest


def call_fingerprint(q, kv_cache, block_table, seq_lens, softmax_scale, q_len, q_scale, kv_scale, out, lse,
                     out_dtype, row_kv_lens, need_lse, dcp) -> tuple | None:
    """Everything of a call's inputs that ``check_call``'s verdict and ``CallForm``, and the kernel decision
    (``DecodeArgs.signature``), depend on: types, shapes, strides, dtypes, devices, the 16-byte alignment of the
    tensors kernels load, the scale forms, whether softmax_scale and a float q / kv scale are positive. Calls with
    one fingerprint are all valid or all not, and share one form and one decision (mla_decode keeps both per
    workspace, so an engine's layers and steps check a shape once). None for inputs of other kinds (they are
    checked every call)."""
    try:
        if type(need_lse) is not bool or type(softmax_scale) not in (float, int) \
                or not (q_len is None or type(q_len) is int) \
                or not (out_dtype is None or isinstance(out_dtype, torch.dtype)):
            return None
        if isinstance(q, (tuple, list)):
            if len(q) != 2:
                return None
            q_key = (_aligned_meta(q[0]), _aligned_meta(q[1]))
        else:
            q_key = _aligned_meta(q)
        if dcp is None:
            dcp_key = None
        elif type(dcp) is DcpLayout and type(dcp.world) is int and type(dcp.rank) is int \
                and type(dcp.interleave) is int:
            dcp_key = (dcp.world, dcp.rank, dcp.interleave, _meta(dcp.global_seq_lens))
        else:
            return None
        return (q_key, _aligned_meta(kv_cache), _meta(block_table), _meta(seq_lens), softmax_scale > 0, q_len,
                _scale_meta(q_scale), _scale_meta(kv_scale), None if out is None else _aligned_meta(out),
                None if lse is None else _meta(lse), out_dtype, None if row_kv_lens is None else _meta(row_kv_lens),
                need_lse, dcp_key)
    except TypeError:
        return None


def check_call(q, kv_cache, block_table, seq_lens, *, softmax_scale: float, q_len: int | None = None,
               q_scale: Scale = None, kv_scale: Scale = None, out: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               row_kv_lens: torch.Tensor | None = None, need_lse: bool = True,
               dcp: DcpLayout | None = None) -> CallForm:
    """Check every input of ``mla_decode`` (no device sync; a bad one is a ValueError naming it and what is
    allowed); the call's ``CallForm``."""
    if not isinstance(need_lse, bool):
        fail("return_lse", f"must be True or False, got {need_lse!r}")
    q_nope, q_pe = _split_q(q)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1:
            fail(name, "last dimension must be contiguous (stride 1)")
    num_tokens, num_heads = q_nope.shape[:2]
    device = q_nope.device
    if num_heads not in SUPPORTED_NUM_HEADS:
        fail("q", f"{num_heads} heads is not supported; allowed heads per rank: {SUPPORTED_NUM_HEADS}")

    if not isinstance(kv_cache, torch.Tensor):
        fail("kv_cache", f"must be a tensor, got {type(kv_cache).__name__}")
    squeeze = kv_cache.dim() == 4 and kv_cache.shape[2] == 1  # [num_blocks, block_size, 1, 576] (one latent "head")
    if squeeze:
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != QK_HEAD_DIM:
        fail("kv_cache", f"must be [num_blocks, block_size, {QK_HEAD_DIM}], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        hint = " (view a uint8 fp8 cache as torch.float8_e4m3fn)" if kv_cache.dtype == torch.uint8 else ""
        fail("kv_cache", f"dtype {kv_cache.dtype} is not supported; allowed: {dtype_names(KV_CACHE_DTYPES)}{hint}")
    if kv_cache.stride(-1) != 1:
        fail("kv_cache", "last dimension must be contiguous (stride 1)")
    if kv_cache.shape[1] not in SUPPORTED_BLOCK_SIZES:
        fail("kv_cache", f"block size {kv_cache.shape[1]} is not supported; allowed: {SUPPORTED_BLOCK_SIZES}")

    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        fail("block_table", "must be an int32 tensor [batch, max_blocks_per_request]")
    if block_table.stride(-1) != 1:
        fail("block_table", "last dimension must be contiguous (stride 1)")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        fail("seq_lens", "must be an int32 tensor [batch]")
    if not seq_lens.is_contiguous():
        fail("seq_lens", "must be contiguous")
    batch = block_table.shape[0]
    if seq_lens.shape[0] != batch:
        fail("seq_lens", f"has {seq_lens.shape[0]} entries but block_table has {batch} rows")
    if batch == 0:
        fail("block_table", "batch is empty")
    if num_tokens % batch != 0:
        fail("q", f"{num_tokens} tokens is not a multiple of the batch ({batch}): q_len must be uniform")
    derived_q_len = num_tokens // batch
    if q_len is not None and q_len != derived_q_len:
        fail("q_len", f"is {q_len} but q has {num_tokens} tokens for {batch} requests ({derived_q_len} each)")
    q_len = derived_q_len
    if q_len not in SUPPORTED_Q_LENS:
        fail("q_len", f"{q_len} query tokens per request is not supported; allowed: {SUPPORTED_Q_LENS}")
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            fail(name, f"is on {t.device} but q is on {device}")

    if row_kv_lens is not None:
        if not isinstance(row_kv_lens, torch.Tensor) or row_kv_lens.dtype != torch.int32 \
                or tuple(row_kv_lens.shape) != (batch, q_len):
            fail("row_kv_lens", f"must be an int32 tensor [batch, q_len] = [{batch}, {q_len}] (keys each query "
                                 f"row sees), got {_describe(row_kv_lens)}")
        if not row_kv_lens.is_contiguous():
            fail("row_kv_lens", "must be contiguous")
        if row_kv_lens.device != device:
            fail("row_kv_lens", f"is on {row_kv_lens.device} but q is on {device}")

    dcp = _check_dcp(dcp, batch, device)

    q_is_fp8 = q_nope.dtype == FP8_DTYPE
    kv_is_fp8 = kv_cache.dtype == FP8_DTYPE
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        fail("out_dtype", f"is {out_dtype} but out is {out.dtype}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (None if q_is_fp8 else q_nope.dtype)
    if out_dtype is None:
        fail("out_dtype", f"q is fp8, so the output dtype must be given (out= or out_dtype=); "
                           f"allowed: {dtype_names(OUT_DTYPES)}")
    if out_dtype not in OUT_DTYPES:
        fail("out_dtype", f"{out_dtype} is not supported; allowed: {dtype_names(OUT_DTYPES)}")
    compute_dtype = out_dtype if q_is_fp8 else q_nope.dtype
    if not kv_is_fp8 and kv_cache.dtype != compute_dtype:
        fail("kv_cache", f"a 16-bit cache must have q's dtype ({compute_dtype}), got {kv_cache.dtype}")
    _check_scale("q_scale", q_scale, q_is_fp8, device)
    _check_scale("kv_scale", kv_scale, kv_is_fp8, device)
    if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        fail("softmax_scale", f"must be a positive Python float, got {softmax_scale!r}")

    out_shape = (num_tokens, num_heads, KV_LORA_RANK)
    if out is not None and (tuple(out.shape) != out_shape or out.device != device or out.stride(-1) != 1):
        fail("out", f"must be a {out_shape} tensor on {device} with a contiguous last dim, "
                     f"got {tuple(out.shape)} on {out.device}")
    if lse is not None and (tuple(lse.shape) != (num_tokens, num_heads) or lse.dtype != torch.float32
                            or lse.device != device):
        fail("lse", f"must be a float32 tensor {(num_tokens, num_heads)} on {device}, "
                     f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    return CallForm(pair=isinstance(q, (tuple, list)), squeeze=squeeze, batch=batch, q_len=q_len,
                    num_heads=num_heads, out_dtype=out_dtype, compute_dtype=compute_dtype)
