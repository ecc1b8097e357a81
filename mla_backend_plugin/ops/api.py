"""``mla_decode``: the one kernel API every decode kernel of this package sits behind.

A call is validated (ops/args.py), then decided: the tuned choice for its shape (ops/tuned.py) when the tuner
has one, else the arch table's (``select_kernel``: the first kernel of ``registry.AUTO_ORDER`` that supports the
call and passes its first-use self-check, ops/selfcheck.py), checked to fit the workspace (ops/workspace.py), and
launched. A workspace keeps the checks' verdict and the decision of each call fingerprint, so an engine's layers
and steps check and decide once per shape.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.ops import registry, selfcheck, tuned
from mla_backend_plugin.ops.arch import device_smem_per_block
from mla_backend_plugin.ops.args import (
    DcpLayout,
    DecodeArgs,
    Scale,
    bind,
    call_fingerprint,
    check_call,
    fail,
    prepare_args,
)
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.manifest import FP8_DESIGNS, KernelManifest, LaunchConfig
from mla_backend_plugin.ops.workspace import MLAWorkspace, StepPlans, capturing, default_workspace

logger = logging.getLogger("mla_backend_plugin")

__all__ = ["DcpLayout", "DecodeArgs", "expected_launch", "mla_decode", "prepare_args", "select_kernel"]


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
    return_lse: bool = True,
    dcp: DcpLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
            tensor, read on the device, so no host sync), positive: a float <= 0 is refused; a tensor <= 0 gives
            NaN rows from cute_sm90's fp8 design C. Must be None for 16-bit tensors.
        out / lse: optional preallocated outputs ``[T, H, 512]`` and float32 ``[T, H]``.
            ``cute_sm90`` writes whole rows of ``out`` with 16-byte stores: it refuses an ``out`` whose rows are
            not 16-byte aligned (``auto`` then picks another kernel).
        out_dtype: output dtype (bf16/fp16); required when q is fp8 and ``out`` is not given.
        workspace: an ``MLAWorkspace``; required for CUDA-graph capture (a cached one is used otherwise).
        kernel: ``"auto"`` (the autotuner's choice for this GPU and shape when it has one, ops/tuned.py,
            else the best verified kernel of the arch table), or a kernel name from ``available_kernels()``.
            The environment variable ``CUTE_MLA_KERNEL`` overrides ``"auto"``.
        enable_pdl: programmatic dependent launch (SM90+); None = the kernel's default (``CUTE_MLA_PDL``).
        fp8_design: cute_sm90 with an fp8 cache: ``"fp8mma"``, ``"dequant"`` or ``"fp8seesaw"`` (fp8 q only; a
            tuner candidate, not chosen by ``auto``); None = ``CUTE_MLA_FP8_DESIGN``.
            Kernels without the choice ignore it.
        config: a complete ``LaunchConfig`` (one of the kernel's ``configs()``, e.g. a tuner's choice); the
            two keywords above still override its fields. With ``kernel="auto"`` it applies to the arch table's
            kernel (no tuned choice is looked up).
        max_seq_len: the longest KV length of this call when the caller knows it on the host (eager engines):
            the tuned choice of that length bucket. Ignored under CUDA-graph capture, where one graph serves
            every length: there the deployment's context profile decides (``tuned.set_seq_profile``).
        row_kv_lens: optional int32 ``[batch, q_len]`` device tensor: row t of request b attends to its first
            ``min(row_kv_lens[b, t], seq_lens[b])`` keys instead of ``seq_len - q_len + t + 1``. For a KV cache
            sharded across ranks (decode context parallelism), where the q block's own new tokens are not all
            stored on this rank: ``ops.serving.dcp_row_kv_lens`` computes it from the global lengths. Read on
            the device (CUDA-graph safe); kernels whose manifest lacks ``supports_row_kv_lens`` refuse it.
        step: a ``StepPlans`` shared by every layer's call of one decode step (same seq_lens tensor and values;
            a serving integration makes one per step): the split schedule of the step is planned on the device
            once (cute_sm90's step-plan kernel) instead of once per call. None: each call plans for itself.
        return_lse: False when the caller does not use the LSE (no split-KV merge across ranks after the call):
            kernels that write no LSE (FlashInfer's SM120 XQA MLA decode) may then run, and None is returned in
            its place (a given ``lse`` buffer may or may not be written). True (the default): every kernel chosen
            writes it.
        dcp: with ``row_kv_lens``, the ``DcpLayout(world, rank, interleave, global_seq_lens)`` those counts come
            from: kernels that apply the DCP rule themselves (FlashInfer's cute-dsl DCP mode, interleave 1) take
            ``row_kv_lens`` only with it; every other kernel ignores it. None: no layout given.

    Returns:
        ``(out [T, H, 512], lse [T, H] float32)``; lse is the natural-log log-sum-exp of the scaled logits, or
        None with ``return_lse=False``.
    """
    # An engine calls with one workspace and the same shapes every layer and step: the checks of a call's inputs
    # and the decision are kept in the workspace per call fingerprint (what both depend on of the inputs:
    # args.call_fingerprint), so only the first call of a shape pays them (they cost more host time than the
    # launch itself, and eager steps - chunked prefill's mixed batches - would pay them once per layer). The key
    # also holds all a decision depends on besides the inputs: the tuner's table version, the environment
    # (CUTE_MLA_KERNEL included, so "auto" is resolved on a miss only), capture (which pins tuned choices).
    key = form = decided = None
    if workspace is not None and (config is None or isinstance(config, LaunchConfig)):
        fingerprint = call_fingerprint(q, kv_cache, block_table, seq_lens, softmax_scale, q_len, q_scale, kv_scale,
                                       out, lse, out_dtype, row_kv_lens, return_lse, dcp)
        if fingerprint is not None:
            device = (q[0] if isinstance(q, (tuple, list)) else q).device
            key = (fingerprint, kernel, config, enable_pdl, fp8_design,
                   None if max_seq_len is None else tuned.seq_bucket(max_seq_len),
                   capturing(device), tuned.table_version(),
                   envs.raw_values())
            form, decided = workspace.decisions.get(key, (None, None))
    if form is None:
        form = check_call(q, kv_cache, block_table, seq_lens, softmax_scale=softmax_scale, q_len=q_len,
                          q_scale=q_scale, kv_scale=kv_scale, out=out, lse=lse, out_dtype=out_dtype,
                          row_kv_lens=row_kv_lens, need_lse=return_lse, dcp=dcp)
    args = bind(form, q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, kv_scale, out, lse, row_kv_lens,
                return_lse, dcp)
    if step is not None:
        if not isinstance(step, StepPlans):
            fail("step", f"must be a StepPlans (one per decode step) or None, got {type(step).__name__}")
        args.step = step
    if config is not None and not isinstance(config, LaunchConfig):
        fail("config", f"must be a LaunchConfig, got {type(config).__name__}")
    if decided is None:
        if kernel == "auto":
            kernel = envs.CUTE_MLA_KERNEL
        decided = _decide(args, kernel, config, workspace, enable_pdl, fp8_design, max_seq_len)
        if key is not None:
            workspace.decisions[key] = (form, decided)
    spec, config, workspace = decided
    spec.launch(args, workspace, config)
    return args.out, args.lse if return_lse else None


def _choice(args: DecodeArgs, kernel: str, config: LaunchConfig | None, cc, max_seq_len: int | None,
            check: bool = True):
    """(kernel spec, launch config or None, whether tuned): the tuner's choice for ``kernel="auto"`` without a
    given config, else the arch table's (or the named) kernel with ``config``. ``check=False``: no self-check is
    run (what a later call will most likely launch, for prebuilding)."""
    choice = tuned.lookup(args, cc, max_seq_len, check=check) if kernel == "auto" and config is None else None
    if choice is not None:
        return choice.spec, choice.config, True
    return select_kernel(args, kernel, self_check=check), config, False


def expected_launch(args: DecodeArgs, kernel: str = "auto"):
    """(kernel spec, launch config) ``mla_decode`` will most likely launch for ``args`` once the engine runs, as far
    as it is known before its first call: no self-check is run, no workspace is made. Raises ValueError when no
    kernel supports the call."""
    cc = registry.device_capability(args.q_nope.device)
    spec, config, _ = _choice(args, kernel, None, cc, None, check=False)
    return spec, config if config is not None else spec.default_config(args, cc)


def _decide(args: DecodeArgs, kernel: str, config: LaunchConfig | None, workspace: MLAWorkspace | None,
            enable_pdl: bool | None, fp8_design: str | None, max_seq_len: int | None):
    """(kernel spec, launch config, workspace) of a call: the tuned choice or the arch table's, checked to fit."""
    cc = registry.device_capability(args.q_nope.device)
    spec, config, is_tuned = _choice(args, kernel, config, cc, max_seq_len)
    if spec.needs_workspace:
        if workspace is None:
            workspace = default_workspace(args.q_nope.device, args.batch, args.q_len, args.num_heads)
        workspace.check_fits(args.batch, args.q_len, args.num_heads, args.q_nope.device)
        if is_tuned and spec.plan_tile is not None:
            tile = spec.plan_tile(args.num_heads, device_smem_per_block(args.q_nope.device), config)
            if workspace.refusal(args.batch, args.q_len, tile, config) is not None:  # e.g. a smaller split capacity
                spec, config = select_kernel(args, kernel), None
    if config is None:
        config = spec.default_config(args, cc)
    if enable_pdl is not None:
        if enable_pdl and (cc is None or cc < (9, 0)):
            fail("enable_pdl", f"PDL needs compute capability >= 9.0, device has {cc}; pass None or False")
        config = dataclasses.replace(config, enable_pdl=bool(enable_pdl))
    if fp8_design is not None:
        if fp8_design not in FP8_DESIGNS:
            fail("fp8_design", f"{fp8_design!r} is not a design; allowed: {', '.join(FP8_DESIGNS)}")
        if args.kv_dtype == FP8_DTYPE:
            if fp8_design == "fp8seesaw" and args.q_dtype != FP8_DTYPE:
                fail("fp8_design", f"'fp8seesaw' needs an fp8 q (q is {args.q_dtype}); allowed with this q: "
                     "fp8mma, dequant")
            config = dataclasses.replace(config, fp8_design=fp8_design)
    if spec.needs_workspace and workspace is None:  # a static choice after a tuned one the workspace refused
        workspace = default_workspace(args.q_nope.device, args.batch, args.q_len, args.num_heads)
    return spec, config, workspace


# --------------------------------------------------------------------------------------------------------
# The arch table's choice (what kernel="auto" runs without a tuned choice, and a kernel named by the caller)
# --------------------------------------------------------------------------------------------------------

_WARNED: set[tuple[str, str]] = set()
_ANNOUNCED: set[tuple[str, str]] = set()


def _announce(spec: KernelManifest, device, cc) -> None:
    key = (spec.name, str(device))
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        where = f"compute capability {cc[0]}.{cc[1]}" if cc else str(device)
        logger.info("mla_decode: kernel %r on %s (%s)", spec.name, device, where)


def select_kernel(args, name: str = "auto", self_check: bool = True) -> KernelManifest:
    """The kernel ``name`` (checked to support the call) or, for ``"auto"``, the first of the arch's AUTO_ORDER
    that supports it and passes its self-check. ``self_check=False``: no self-check run and nothing announced
    (a guess of what a later call will run, for prebuilding)."""
    cc = registry.device_capability(args.q_nope.device)
    if name != "auto":
        spec = registry.KERNELS.get(name)
        if spec is None:
            raise ValueError(f"mla_decode: kernel: unknown kernel {name!r}; allowed: 'auto', "
                             + ", ".join(repr(k) for k in registry.KERNELS))
        reason = registry.unsupported_reason(spec, args, cc)
        if reason is not None:
            raise ValueError(f"mla_decode: kernel: {name!r} cannot run this call: {reason}")
        if not self_check:
            return spec
        failure = selfcheck.self_check_failure(spec, args.q_nope.device, cc)
        if failure is not None:
            raise RuntimeError(f"mla_decode: kernel {name!r} failed its self-check on compute capability "
                               f"{cc}: {failure}")
        _announce(spec, args.q_nope.device, cc)
        return spec
    if cc is None:
        raise ValueError(f"mla_decode: q: kernels need a CUDA device, got {args.q_nope.device} "
                         "(kernel='reference' runs anywhere)")
    order = registry.AUTO_ORDER.get(cc[0])
    if order is None:
        raise ValueError(f"mla_decode: device: compute capability {cc[0]}.{cc[1]} has no decode kernel; "
                         f"supported majors: {sorted(registry.AUTO_ORDER)}")
    reasons = []
    for kname in order:
        spec = registry.KERNELS[kname]
        reason = registry.unsupported_reason(spec, args, cc)
        if reason is None and not self_check:
            return spec
        if reason is None:
            failure = selfcheck.self_check_failure(spec, args.q_nope.device, cc)
            if failure is None:
                _announce(spec, args.q_nope.device, cc)
                return spec
            if (kname, str(args.q_nope.device)) not in _WARNED:  # once per kernel and device
                _WARNED.add((kname, str(args.q_nope.device)))
                warnings.warn(f"mla_decode: kernel {kname!r} failed its self-check on compute capability {cc} "
                              f"and is skipped: {failure}", RuntimeWarning, stacklevel=3)
            reason = f"failed its self-check: {failure}"
        reasons.append(f"{kname}: {reason}")
    raise ValueError("mla_decode: no kernel supports this call: " + "; ".join(reasons))
