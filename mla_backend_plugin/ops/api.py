"""``mla_decode``: the one kernel API every decode kernel of this package sits behind."""

from __future__ import annotations

import dataclasses

import torch

from mla_backend_plugin import envs
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
from mla_backend_plugin.ops.manifest import FP8_DESIGNS, LaunchConfig
from mla_backend_plugin.ops.workspace import MLAWorkspace, StepPlans, default_workspace

Scale = float | torch.Tensor | None


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
    # the decode step this call belongs to (mla_decode's ``step``): a family with a step-plan kernel plans once
    # per step; not part of the signature (it changes every step, the decision does not)
    step: StepPlans | None = None

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
                type(self.q_scale), type(self.kv_scale), self.row_kv_lens is None, qn.device)


def _fail(arg: str, msg: str):
    raise ValueError(f"mla_decode: {arg}: {msg}")


def _check_scale(name: str, scale: Scale, tensor_is_fp8: bool, device: torch.device) -> Scale:
    if scale is None:
        return None
    if not tensor_is_fp8:
        _fail(name, "is a dequantisation scale of an fp8 tensor; pass None when that tensor is 16-bit")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            _fail(name, f"must be a float or a 1-element float32 tensor, got {tuple(scale.shape)} {scale.dtype}")
        if scale.device != device:
            _fail(name, f"must be on {device}, got {scale.device}")
        return scale.reshape(1)  # one shape for every kernel (vLLM passes 0-d scales); a view, no copy
    return float(scale)


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _split_q(q) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            _fail("q", "a tuple must be (q_nope [T, H, 512], q_pe [T, H, 64])")
        q_nope, q_pe = q
        for name, t, d in (("q_nope", q_nope, KV_LORA_RANK), ("q_pe", q_pe, QK_ROPE_HEAD_DIM)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != d:
                _fail(name, f"must be a 3-D tensor [tokens, heads, {d}], got "
                            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if q_nope.shape[:2] != q_pe.shape[:2]:
            _fail("q", f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} disagree on [tokens, heads]")
        if q_nope.dtype != q_pe.dtype:
            _fail("q", f"q_nope is {q_nope.dtype} but q_pe is {q_pe.dtype}")
        if q_nope.dtype not in Q_DTYPES:
            _fail("q", f"dtype {q_nope.dtype} is not supported for the (q_nope, q_pe) form; "
                       f"allowed: {dtype_names(Q_DTYPES)}")
        return q_nope, q_pe
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != QK_HEAD_DIM:
        _fail("q", f"must be a [tokens, heads, {QK_HEAD_DIM}] tensor or a (q_nope, q_pe) pair, got "
                   f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.dtype not in Q_DTYPES + (FP8_DTYPE,):
        _fail("q", f"dtype {q.dtype} is not supported; allowed: {dtype_names(Q_DTYPES + (FP8_DTYPE,))}")
    return q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]


def prepare_args(q, kv_cache, block_table, seq_lens, *, softmax_scale: float, q_len: int | None = None,
                 q_scale: Scale = None, kv_scale: Scale = None, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 row_kv_lens: torch.Tensor | None = None) -> DecodeArgs:
    """Validate every input of ``mla_decode`` (no device sync) and allocate out/lse if not given."""
    q_nope, q_pe = _split_q(q)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.stride(-1) != 1:
            _fail(name, "last dimension must be contiguous (stride 1)")
    num_tokens, num_heads = q_nope.shape[:2]
    device = q_nope.device
    if num_heads not in SUPPORTED_NUM_HEADS:
        _fail("q", f"{num_heads} heads is not supported; allowed heads per rank: {SUPPORTED_NUM_HEADS}")

    if not isinstance(kv_cache, torch.Tensor):
        _fail("kv_cache", f"must be a tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.squeeze(2)  # [num_blocks, block_size, 1, 576] (one latent "head")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != QK_HEAD_DIM:
        _fail("kv_cache", f"must be [num_blocks, block_size, {QK_HEAD_DIM}], got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        hint = " (view a uint8 fp8 cache as torch.float8_e4m3fn)" if kv_cache.dtype == torch.uint8 else ""
        _fail("kv_cache", f"dtype {kv_cache.dtype} is not supported; allowed: {dtype_names(KV_CACHE_DTYPES)}{hint}")
    if kv_cache.stride(-1) != 1:
        _fail("kv_cache", "last dimension must be contiguous (stride 1)")
    if kv_cache.shape[1] not in SUPPORTED_BLOCK_SIZES:
        _fail("kv_cache", f"block size {kv_cache.shape[1]} is not supported; allowed: {SUPPORTED_BLOCK_SIZES}")

    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        _fail("block_table", "must be an int32 tensor [batch, max_blocks_per_request]")
    if block_table.stride(-1) != 1:
        _fail("block_table", "last dimension must be contiguous (stride 1)")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        _fail("seq_lens", "must be an int32 tensor [batch]")
    if not seq_lens.is_contiguous():
        _fail("seq_lens", "must be contiguous")
    batch = block_table.shape[0]
    if seq_lens.shape[0] != batch:
        _fail("seq_lens", f"has {seq_lens.shape[0]} entries but block_table has {batch} rows")
    if batch == 0:
        _fail("block_table", "batch is empty")
    if num_tokens % batch != 0:
        _fail("q", f"{num_tokens} tokens is not a multiple of the batch ({batch}): q_len must be uniform")
    derived_q_len = num_tokens // batch
    if q_len is not None and q_len != derived_q_len:
        _fail("q_len", f"is {q_len} but q has {num_tokens} tokens for {batch} requests ({derived_q_len} each)")
    q_len = derived_q_len
    if q_len not in SUPPORTED_Q_LENS:
        _fail("q_len", f"{q_len} query tokens per request is not supported; allowed: {SUPPORTED_Q_LENS}")
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != device:
            _fail(name, f"is on {t.device} but q is on {device}")

    if row_kv_lens is not None:
        if not isinstance(row_kv_lens, torch.Tensor) or row_kv_lens.dtype != torch.int32 \
                or tuple(row_kv_lens.shape) != (batch, q_len):
            _fail("row_kv_lens", f"must be an int32 tensor [batch, q_len] = [{batch}, {q_len}] (keys each query "
                                 f"row sees), got {_describe(row_kv_lens)}")
        if not row_kv_lens.is_contiguous():
            _fail("row_kv_lens", "must be contiguous")
        if row_kv_lens.device != device:
            _fail("row_kv_lens", f"is on {row_kv_lens.device} but q is on {device}")

    q_is_fp8 = q_nope.dtype == FP8_DTYPE
    kv_is_fp8 = kv_cache.dtype == FP8_DTYPE
    if out is not None and out_dtype is not None and out.dtype != out_dtype:
        _fail("out_dtype", f"is {out_dtype} but out is {out.dtype}")
    if out_dtype is None:
        out_dtype = out.dtype if out is not None else (None if q_is_fp8 else q_nope.dtype)
    if out_dtype is None:
        _fail("out_dtype", f"q is fp8, so the output dtype must be given (out= or out_dtype=); "
                           f"allowed: {dtype_names(OUT_DTYPES)}")
    if out_dtype not in OUT_DTYPES:
        _fail("out_dtype", f"{out_dtype} is not supported; allowed: {dtype_names(OUT_DTYPES)}")
    compute_dtype = out_dtype if q_is_fp8 else q_nope.dtype
    if not kv_is_fp8 and kv_cache.dtype != compute_dtype:
        _fail("kv_cache", f"a 16-bit cache must have q's dtype ({compute_dtype}), got {kv_cache.dtype}")
    q_scale = _check_scale("q_scale", q_scale, q_is_fp8, device)
    kv_scale = _check_scale("kv_scale", kv_scale, kv_is_fp8, device)
    if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        _fail("softmax_scale", f"must be a positive Python float, got {softmax_scale!r}")

    out_shape = (num_tokens, num_heads, KV_LORA_RANK)
    if out is None:
        out = torch.empty(out_shape, dtype=out_dtype, device=device)
    elif tuple(out.shape) != out_shape or out.device != device or out.stride(-1) != 1:
        _fail("out", f"must be a {out_shape} tensor on {device} with a contiguous last dim, "
                     f"got {tuple(out.shape)} on {out.device}")
    if lse is None:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device)
    elif tuple(lse.shape) != (num_tokens, num_heads) or lse.dtype != torch.float32 or lse.device != device:
        _fail("lse", f"must be a float32 tensor {(num_tokens, num_heads)} on {device}, "
                     f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    return DecodeArgs(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                      batch=batch, q_len=q_len, num_heads=num_heads, softmax_scale=float(softmax_scale),
                      q_scale=q_scale, kv_scale=kv_scale, out=out, lse=lse, compute_dtype=compute_dtype,
                      row_kv_lens=row_kv_lens)


def mla_decode(
    q,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    q_len: int | None = None,
    q_scale: Scale = None,
    kv_scale: Scale = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    workspace: MLAWorkspace | None = None,
    kernel: str = "auto",
    enable_pdl: bool | None = None,
    fp8_design: str | None = None,
    config: LaunchConfig | None = None,
    max_seq_len: int | None = None,
    row_kv_lens: torch.Tensor | None = None,
    step: StepPlans | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode: ``softmax(softmax_scale * q k^T) v`` over each request's KV pages.

    Args:
        q: ``[T, H, 576]`` (bf16, fp16 or fp8 e4m3) or the pair ``(q_nope [T, H, 512], q_pe [T, H, 64])``
            (bf16 or fp16; q_pe may be a strided view). ``T = batch * q_len``, tokens grouped by request.
        kv_cache: ``[num_blocks, block_size, 576]`` latent + rope cache (bf16, fp16 or float8_e4m3fn).
        block_table: int32 ``[batch, max_blocks]``, page ids of each request in order.
        seq_lens: int32 ``[batch]``, KV lengths including this step's q_len new tokens. Row t of a request
            attends to its first ``seq_len - q_len + t + 1`` keys.
        softmax_scale: multiplies q.k before the softmax.
        q_len: query tokens per request (1..4); derived from the shapes when None.
        q_scale / kv_scale: dequantisation scales of an fp8 q / fp8 cache (float or 1-element float32 device
            tensor, read on the device, so no host sync). Must be None for 16-bit tensors.
        out / lse: optional preallocated outputs ``[T, H, 512]`` and float32 ``[T, H]``.
            ``cute_sm90`` writes whole rows of ``out`` with 16-byte stores: it refuses an ``out`` whose rows are
            not 16-byte aligned (``auto`` then picks another kernel).
        out_dtype: output dtype (bf16/fp16); required when q is fp8 and ``out`` is not given.
        workspace: an ``MLAWorkspace``; required for CUDA-graph capture (a cached one is used otherwise).
        kernel: ``"auto"`` (the autotuner's choice for this GPU and shape when it has one, ops/autotune.py,
            else the best verified kernel of the arch table), or a kernel name from ``available_kernels()``.
            The environment variable ``CUTE_MLA_KERNEL`` overrides ``"auto"``.
        enable_pdl: programmatic dependent launch (SM90+); None = the kernel's default (``CUTE_MLA_PDL``).
        fp8_design: cute_sm90 with an fp8 cache: ``"fp8mma"`` or ``"dequant"``; None = ``CUTE_MLA_FP8_DESIGN``.
            Kernels without the choice ignore it.
        config: a complete ``LaunchConfig`` (one of the kernel's ``configs()``, e.g. a tuner's choice); the
            two keywords above still override its fields. With ``kernel="auto"`` it applies to the arch table's
            kernel (no tuned choice is looked up).
        max_seq_len: the longest KV length of this call when the caller knows it on the host (eager engines):
            the tuned choice of that length bucket. Ignored under CUDA-graph capture, where one graph serves
            every length: there the deployment's context profile decides (``autotune.set_seq_profile``).
        row_kv_lens: optional int32 ``[batch, q_len]`` device tensor: row t of request b attends to its first
            ``min(row_kv_lens[b, t], seq_lens[b])`` keys instead of ``seq_len - q_len + t + 1``. For a KV cache
            sharded across ranks (decode context parallelism), where the q block's own new tokens are not all
            stored on this rank: ``ops.serving.dcp_row_kv_lens`` computes it from the global lengths. Read on
            the device (CUDA-graph safe); kernels whose manifest lacks ``supports_row_kv_lens`` refuse it.
        step: a ``StepPlans`` shared by every layer's call of one decode step (same seq_lens tensor and values;
            a serving integration makes one per step): the split schedule of the step is planned on the device
            once (cute_sm90's step-plan kernel) instead of once per call. None: each call plans for itself.

    Returns:
        ``(out [T, H, 512], lse [T, H] float32)``; lse is the natural-log log-sum-exp of the scaled logits.
    """
    from mla_backend_plugin.ops import autotune

    args = prepare_args(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale, q_len=q_len,
                        q_scale=q_scale, kv_scale=kv_scale, out=out, lse=lse, out_dtype=out_dtype,
                        row_kv_lens=row_kv_lens)
    if step is not None:
        if not isinstance(step, StepPlans):
            _fail("step", f"must be a StepPlans (one per decode step) or None, got {type(step).__name__}")
        args.step = step
    if config is not None and not isinstance(config, LaunchConfig):
        _fail("config", f"must be a LaunchConfig, got {type(config).__name__}")
    if kernel == "auto":
        kernel = envs.CUTE_MLA_KERNEL
    # An engine calls with one workspace and the same shapes every layer and step: the decision of a signature is
    # kept in the workspace (the checks behind it cost more host time than the launch itself, and eager steps -
    # chunked prefill's mixed batches - pay it once per layer). The key holds all a decision depends on besides
    # the call's shapes: the tuner's table version, the environment, capture (which pins tuned choices).
    key = decided = None
    if workspace is not None:
        device = args.q_nope.device
        key = (kernel, config, enable_pdl, fp8_design, args.signature(),
               None if max_seq_len is None else autotune.seq_bucket(max_seq_len),
               device.type == "cuda" and torch.cuda.is_current_stream_capturing(), autotune.table_version(),
               envs.raw_values())
        decided = workspace.decisions.get(key)
    if decided is None:
        decided = _decide(args, kernel, config, workspace, enable_pdl, fp8_design, max_seq_len)
        if key is not None:
            workspace.decisions[key] = decided
    spec, config, workspace = decided
    spec.launch(args, workspace, config)
    return args.out, args.lse


def _choice(args: DecodeArgs, kernel: str, config: LaunchConfig | None, cc, max_seq_len: int | None,
            check: bool = True):
    """(kernel spec, launch config or None, whether tuned): the tuner's choice for ``kernel="auto"`` without a
    given config, else the arch table's (or the named) kernel with ``config``. ``check=False``: no self-check is
    run (what a later call will most likely launch, for prebuilding)."""
    from mla_backend_plugin.ops import autotune
    from mla_backend_plugin.ops.registry import select_kernel

    tuned = autotune.lookup(args, cc, max_seq_len, check=check) if kernel == "auto" and config is None else None
    if tuned is not None:
        return tuned.spec, tuned.config, True
    return select_kernel(args, kernel, self_check=check), config, False


def expected_launch(args: DecodeArgs, kernel: str = "auto"):
    """(kernel spec, launch config) ``mla_decode`` will most likely launch for ``args`` once the engine runs, as far
    as it is known before its first call: no self-check is run, no workspace is made. Raises ValueError when no
    kernel supports the call."""
    from mla_backend_plugin.ops.registry import device_capability

    cc = device_capability(args.q_nope.device)
    spec, config, _ = _choice(args, kernel, None, cc, None, check=False)
    return spec, config if config is not None else spec.default_config(args, cc)


def _decide(args: DecodeArgs, kernel: str, config: LaunchConfig | None, workspace: MLAWorkspace | None,
            enable_pdl: bool | None, fp8_design: str | None, max_seq_len: int | None):
    """(kernel spec, launch config, workspace) of a call: the tuned choice or the arch table's, checked to fit."""
    from mla_backend_plugin.ops.registry import device_capability, select_kernel

    cc = device_capability(args.q_nope.device)
    spec, config, tuned = _choice(args, kernel, config, cc, max_seq_len)
    if spec.needs_workspace:
        if workspace is None:
            workspace = default_workspace(args.q_nope.device, args.batch, args.q_len, args.num_heads)
        workspace.check_fits(args.batch, args.q_len, args.num_heads, args.q_nope.device)
        if tuned and spec.plan_tile is not None:
            from mla_backend_plugin.ops.arch import device_smem_per_block

            tile = spec.plan_tile(args.num_heads, device_smem_per_block(args.q_nope.device), config)
            if workspace.refusal(args.batch, args.q_len, tile, config) is not None:  # e.g. a smaller split capacity
                spec, config = select_kernel(args, kernel), None
    if config is None:
        config = spec.default_config(args, cc)
    if enable_pdl is not None:
        if enable_pdl and (cc is None or cc < (9, 0)):
            _fail("enable_pdl", f"PDL needs compute capability >= 9.0, device has {cc}; pass None or False")
        config = dataclasses.replace(config, enable_pdl=bool(enable_pdl))
    if fp8_design is not None:
        if fp8_design not in FP8_DESIGNS:
            _fail("fp8_design", f"{fp8_design!r} is not a design; allowed: {', '.join(FP8_DESIGNS)}")
        if args.kv_dtype == FP8_DTYPE:
            config = dataclasses.replace(config, fp8_design=fp8_design)
    if spec.needs_workspace and workspace is None:  # a static choice after a tuned one the workspace refused
        workspace = default_workspace(args.q_nope.device, args.batch, args.q_len, args.num_heads)
    return spec, config, workspace
