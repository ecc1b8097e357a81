"""Triton split-KV combine kernels and their launcher (see the package docstring for the two layouts)."""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from mla_backend_plugin import envs
from mla_backend_plugin.ops.constants import KV_LORA_RANK


@triton.jit
def request_splits(seq_len, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BALANCED: tl.constexpr = False, per_work=1):
    """Device half of split planning: (splits, chunk tokens) of a request (seq_len may be a block of them).

    BALANCED=False, the uniform plan: min(NUM_SPLITS, cdiv(seq_len, MIN_CHUNK)) splits
    (ops/plan.py ``uniform_request_splits``). BALANCED=True: ``per_work`` = p tiles of the balanced plan,
    NUM_SPLITS the cap; the exact formula is in ops/plan.py ``balanced_schedule``."""
    if BALANCED:
        tiles = tl.maximum(tl.cdiv(seq_len, BLOCK_N), 1)
        n = tl.minimum(tl.cdiv(tiles, per_work), NUM_SPLITS)
        ct = tl.cdiv(tiles, n)
        return tl.cdiv(tiles, ct), ct * BLOCK_N
    else:
        n = tl.minimum(tl.maximum(tl.cdiv(seq_len, MIN_CHUNK), 1), NUM_SPLITS)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, n), BLOCK_N), 1) * BLOCK_N
        # Rounding the chunk up to BLOCK_N can leave the last splits empty: count only non-empty ones.
        n = tl.maximum(tl.minimum(n, tl.cdiv(seq_len, chunk)), 1)
        return n, chunk



@triton.jit
def combine_uniform_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, seq_lens_ptr, kv_scale_ptr, kv_scale_val,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr,
    D_NOPE: tl.constexpr, SPLITS_P2: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        gdc_wait()  # launched as a programmatic dependent of the split kernel: wait for its partials
    b = tl.program_id(0)
    row = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    n_splits, chunk = request_splits(seq_len, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    kv_scale = 1.0
    if KV_SCALE_IS_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_val

    base = (b * (Q_LEN * NUM_HEADS) + row) * NUM_SPLITS
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < n_splits
    lse_s = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse_s, axis=0)
    lse_use = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.where(s_ok, tl.exp2(lse_s - lse_use), 0.0)
    w_sum = tl.sum(w, axis=0)
    offs_d = tl.arange(0, D_NOPE)
    acc = tl.zeros([D_NOPE], dtype=tl.float32)
    for s in range(0, n_splits):
        # the split's weight from its own LSE (an L1 hit), not picked out of ``w`` with a cross-warp sum per split
        w_s = tl.exp2(tl.load(part_lse_ptr + base + s) - lse_use)
        acc += w_s * tl.load(part_o_ptr + (base + s).to(tl.int64) * D_NOPE + offs_d).to(tl.float32)
    inv = tl.where(w_sum > 0.0, kv_scale / w_sum, 0.0)
    t = row // NUM_HEADS
    h = row % NUM_HEADS
    tok = b * Q_LEN + t
    tl.store(out_ptr + tok * stride_o_t + h * stride_o_h + offs_d, (acc * inv).to(out_ptr.dtype.element_ty))
    lse = tl.where(w_sum > 0.0, (lse_use + tl.log2(w_sum)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + tok * stride_lse_t + h * stride_lse_h, lse)


@triton.jit
def _load_round(part_o_ptr, part_lse_ptr, slot0, s0, n_splits, rows, offs_b, offs_d,
                Q_LEN: tl.constexpr, NUM_HEADS: tl.constexpr, D_NOPE: tl.constexpr):
    """Splits [s0, s0 + SPLIT_BLOCK) of one request's partials: their LSEs (ROWS, SPLIT_BLOCK) and O columns
    (ROWS, SPLIT_BLOCK, D_BLOCK); the slots past n_b load -inf and 0 (never the workspace's stale values), so they
    weigh 0. part = (S_b + split) * Q_LEN * H + row."""
    b_ok = s0 + offs_b < n_splits
    row_part = (slot0 + s0 + offs_b[None, :]).to(tl.int64) * (Q_LEN * NUM_HEADS) + rows[:, None]
    lse = tl.load(part_lse_ptr + row_part, mask=b_ok[None, :], other=float("-inf"))
    o = tl.load(part_o_ptr + row_part[:, :, None] * D_NOPE + offs_d[None, None, :], mask=b_ok[None, :, None],
                other=0.0).to(tl.float32)
    return lse, o


@triton.jit
def combine_balanced_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, split_index_ptr, kv_scale_ptr, kv_scale_val,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, ROWS: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr,
    D_NOPE: tl.constexpr, SPLITS_P2: tl.constexpr, USE_PDL: tl.constexpr = False,
    D_BLOCK: tl.constexpr = 512, SPLIT_BLOCK: tl.constexpr = 1,
):
    """Balanced plan: grid (cdiv(Q_LEN * H, ROWS), J_max, D_NOPE / D_BLOCK); CTA (r, j, c) merges columns
    [c * D_BLOCK, (c + 1) * D_BLOCK) of ROWS rows of the j-th split request, whose (b, S_b, n_b) the split kernel
    wrote to split_index[1 + 3 j:] (split_index[0] = J). SPLIT_BLOCK partials are loaded per iteration as one
    (ROWS, SPLIT_BLOCK, D_BLOCK) tile: at small batches a CTA merges all of its splits with one round of
    independent loads instead of a chain of n_b dependent ones (one L2 latency each). SPLITS_P2 covers the most
    splits the plan gives a request (its long cap when it has one: ops/plan.py balanced_schedule)."""
    if USE_PDL:
        gdc_wait()  # launched as a programmatic dependent of the split kernel: wait for its partials
    j = tl.program_id(1)
    if j >= tl.load(split_index_ptr):
        return
    b = tl.load(split_index_ptr + 1 + 3 * j)
    slot0 = tl.load(split_index_ptr + 2 + 3 * j)
    n_splits = tl.load(split_index_ptr + 3 + 3 * j)
    kv_scale = 1.0
    if KV_SCALE_IS_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_val

    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # the grid covers Q_LEN * H exactly
    offs_s = tl.arange(0, SPLITS_P2)
    s_ok = offs_s < n_splits
    part = (slot0 + offs_s[None, :]).to(tl.int64) * (Q_LEN * NUM_HEADS) + rows[:, None]
    lse_s = tl.load(part_lse_ptr + part, mask=s_ok[None, :], other=float("-inf"))
    offs_d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    offs_b = tl.arange(0, SPLIT_BLOCK)
    # the first round's partials are loaded before the LSEs are reduced (a reduction across warps is a barrier
    # the loads would otherwise wait behind): a request of at most SPLIT_BLOCK splits costs one load latency
    lse_r, o = _load_round(part_o_ptr, part_lse_ptr, slot0, 0, n_splits, rows, offs_b, offs_d, Q_LEN, NUM_HEADS,
                           D_NOPE)
    lse_max = tl.max(lse_s, axis=1)
    lse_use = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.where(s_ok[None, :], tl.exp2(lse_s - lse_use[:, None]), 0.0)
    w_sum = tl.sum(w, axis=1)
    # each split's weight from its own LSE (L1 hits), not picked out of ``w`` with a cross-warp sum
    acc = tl.sum(tl.exp2(lse_r - lse_use[:, None])[:, :, None] * o, axis=1)
    for s0 in range(SPLIT_BLOCK, n_splits, SPLIT_BLOCK):
        lse_r, o = _load_round(part_o_ptr, part_lse_ptr, slot0, s0, n_splits, rows, offs_b, offs_d, Q_LEN,
                               NUM_HEADS, D_NOPE)
        acc += tl.sum(tl.exp2(lse_r - lse_use[:, None])[:, :, None] * o, axis=1)
    inv = tl.where(w_sum > 0.0, kv_scale / w_sum, 0.0)
    tok = b * Q_LEN + rows // NUM_HEADS
    h = rows % NUM_HEADS
    tl.store(out_ptr + tok[:, None] * stride_o_t + h[:, None] * stride_o_h + offs_d[None, :],
             (acc * inv[:, None]).to(out_ptr.dtype.element_ty))
    if tl.program_id(2) == 0:
        lse = tl.where(w_sum > 0.0, (lse_use + tl.log2(w_sum)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + tok * stride_lse_t + h * stride_lse_h, lse)


# ------------------------------------------------------------------------------------------------------------
# Launching a combine kernel again without Triton's per-launch Python
# ------------------------------------------------------------------------------------------------------------
# ``kernel[grid](...)`` re-derives on every launch what a decode call of one shape never changes: the binder and
# its argument specialisation, the cache key, the launch metadata (~40% of an eager decode call's host time under
# cProfile on an H100 host, 2026-11-28; benchmarks/results/host/). A launch whose specialisation key (below)
# was launched before calls that compiled kernel's launcher directly, with the same arguments in the same order.
# The key holds everything Triton specialises on: each tensor's dtype and 16-byte alignment, each int's value,
# each float's type, the constexprs, the grid, the warps, PDL and the device. Only where Triton's launch hooks are
# unset (a profiler's hooks get the ordinary path) and for the Triton versions whose launcher convention this was
# written against (the ordinary path elsewhere). On by default since tests/test_host_path_gpu.py passed on an H200
# (2026-11-28); CUTE_MLA_PREPARED_COMBINE=0 turns it off.
PREPARED_TRITON_VERSIONS = ((3, 4), (3, 5), (3, 6))
_PREPARED: dict = {}
_PREPARED_MAX = 256


@functools.cache
def _triton_version() -> tuple[int, int]:
    major, minor = (triton.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def _runtime_knobs():
    from triton import knobs

    return knobs.runtime


def _hooks_unset() -> bool:
    """Triton's launch hooks: None (older versions) or an empty HookChain (3.6)."""
    runtime = _runtime_knobs()
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _stream_getter():
    """The current-stream query of Triton's own launch path."""
    from triton.runtime import driver

    return driver.active.get_current_stream


def _specialisation(args) -> tuple:
    """What Triton specialises a launch's runtime arguments on: each tensor's dtype and 16-byte alignment, each
    int's value, each other argument's type (one loop, no call per argument: this runs on every launch)."""
    key = []
    for a in args:
        if type(a) is int:
            key.append(a)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        else:
            key.append(type(a))
    return tuple(key)


def prepared_launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int, use_pdl: bool) -> str:
    """Launch Triton kernel ``fn`` on ``grid`` with positional ``args`` (its non-constexpr parameters, in order)
    and ``constexprs`` (keywords); the launch path taken: ``"prepared"`` (a specialisation launched before:
    straight to its launcher) or ``"triton"`` (``fn[grid](...)``, which also prepares the next launch)."""
    extra = {"launch_pdl": True} if use_pdl else {}
    if not (envs.CUTE_MLA_PREPARED_COMBINE and args[0].is_cuda):  # (Triton's CPU interpreter: the ordinary path)
        fn[grid](*args, **constexprs, num_warps=num_warps, **extra)
        return "triton"
    device = args[0].device.index
    key = (fn, grid, device, num_warps, use_pdl, tuple(constexprs.items()), _specialisation(args))
    prepared = _PREPARED.get(key)
    if prepared is not None and _hooks_unset():
        compiled, tail, get_stream = prepared
        compiled.run(*grid, get_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *tail)
        return "prepared"
    compiled = fn[grid](*args, **constexprs, num_warps=num_warps, **extra)
    if _triton_version() in PREPARED_TRITON_VERSIONS and len(grid) == 3 and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        # the launcher takes every parameter in signature order, constexprs (with their defaults) included
        names = list(fn.arg_names)
        bound = {**{p.name: p.default for p in fn.params if p.default is not inspect.Parameter.empty},
                 **constexprs}
        tail = tuple(bound[n] for n in names[len(args):])
        if len(_PREPARED) >= _PREPARED_MAX:
            _PREPARED.clear()
        _PREPARED[key] = (compiled, tail, _stream_getter())
    return "triton"


def scale_args(scale):
    """(pointer or None, float, is_pointer): a device scalar is read in the kernel (no host sync)."""
    if isinstance(scale, torch.Tensor):
        return scale, 1.0, True
    return None, 1.0 if scale is None else float(scale), False


def launch_combine(args, workspace, plan, block_n: int, use_pdl: bool = False,
                   partial_dtype: torch.dtype = torch.float32) -> None:
    """Merge the split partials of ``workspace`` (rows of ``partial_dtype``, as the split kernel stored them:
    ``Workspace.partials_as``) into args.out / args.lse, for every split kernel that writes the workspace layout
    of ``plan`` (the plan the split kernel ran):

    * uniform plan: part = (request * q_len * H + row) * num_splits + split, the split count of each request
      recomputed here from seq_lens (``request_splits``, with the split kernel's ``block_n``);
    * balanced plan: part = slot * q_len * H + row, the split requests and their slots read from
      ``workspace.split_index`` as the split kernel wrote it (ops/plan.py ``balanced_schedule``).

    ``use_pdl`` launches it as a programmatic dependent of the split kernel (it waits with griddepcontrol).
    """
    kv_scale_ptr, kv_scale_val, kv_is_ptr = scale_args(args.kv_scale)
    kv_scale_ptr = workspace.partial_lse if kv_scale_ptr is None else kv_scale_ptr
    out, lse = args.out, args.lse
    if plan.balanced and plan.max_split_requests == 0:
        return
    partials = workspace.partials_as(partial_dtype)
    strides = (out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))
    if plan.balanced:
        rows = args.q_len * args.num_heads
        prepared_launch(
            combine_balanced_kernel, (rows // plan.combine_rows, plan.max_split_requests, plan.combine_col_blocks),
            (out, lse, partials, workspace.partial_lse, workspace.split_index, kv_scale_ptr, kv_scale_val, *strides),
            dict(NUM_HEADS=args.num_heads, Q_LEN=args.q_len, ROWS=plan.combine_rows, KV_SCALE_IS_PTR=kv_is_ptr,
                 D_NOPE=KV_LORA_RANK, SPLITS_P2=triton.next_power_of_2(plan.request_split_limit), USE_PDL=use_pdl,
                 D_BLOCK=KV_LORA_RANK // plan.combine_col_blocks, SPLIT_BLOCK=plan.combine_split_block),
            4, use_pdl)
        return
    prepared_launch(
        combine_uniform_kernel, (args.batch, args.q_len * args.num_heads, 1),
        (out, lse, partials, workspace.partial_lse, args.seq_lens, kv_scale_ptr, kv_scale_val, *strides),
        dict(NUM_HEADS=args.num_heads, Q_LEN=args.q_len, BLOCK_N=block_n, NUM_SPLITS=plan.num_splits,
             MIN_CHUNK=plan.min_chunk, KV_SCALE_IS_PTR=kv_is_ptr, D_NOPE=KV_LORA_RANK,
             SPLITS_P2=triton.next_power_of_2(plan.num_splits), USE_PDL=use_pdl),
        4, use_pdl)
