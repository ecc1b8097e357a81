"""Triton split-KV MLA decode with a combine step: the fallback on every SM80+ GPU.

Design (one CTA = one request x BLOCK_M query rows x one KV split):
* q_len and heads are folded into the M dimension (row r of a request is token r // H, head r % H), so one
  pass over a KV tile serves every head and every speculative token of the request;
* the KV cache is gathered page by page through the block table; fp8 entries are widened to the q dtype
  (exact for e4m3) and the per-tensor scales are folded into the softmax scale and the final output;
* split-KV is planned in two halves (graph-safe): the host fixes the grid from shapes, the device reads
  seq_lens. By default the balanced plan (ops/plan.py ``balanced_schedule``: every CTA reads all seq_lens
  and derives the same schedule of work items, so long requests get more splits than short ones); the uniform
  plan (``_mla_decode_split_kernel``) when the launch config asks for it (comparisons, the tuner);
* an unsplit request's CTA writes the final output and LSE itself; split ones go through the fp32 partials
  of the workspace and the shared combine (kernels/combine).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mla_backend_plugin.kernels.combine.kernel import launch_combine, request_splits, scale_args
from mla_backend_plugin.kernels.triton_decode.config import TritonDecodeConfig, compiler_options
from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_ROPE_HEAD_DIM
from mla_backend_plugin.ops.manifest import PlanTile

# fp8 operands are widened to the 16-bit dtype of the other operand before tl.dot (exact for e4m3).
_COMPUTE_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _balanced_per_work(seq_lens_ptr, batch, WORK: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
                       BLOCK_N: tl.constexpr, SCAN: tl.constexpr, ONE_WAVE: tl.constexpr):
    """p, the tiles per work item of the balanced schedule, with its one-wave search (the formula:
    ops/plan.py ``balanced_schedule``). ONE_WAVE (batch < WORK, known on the host) compiles the search in;
    without it the kernel has none of its code (measured: the unused code alone cost the H100 build up to 8%
    at B=64, q_len 2, where batch >= WORK; docs/perf/triton.md)."""
    total = 0
    min_tiles = 1 << 30
    max_tiles = 0
    for start in range(0, batch, SCAN):
        offs = start + tl.arange(0, SCAN)
        ok = offs < batch
        tiles = tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + offs, mask=ok, other=0), BLOCK_N), 1)
        total += tl.sum(tl.where(ok, tiles, 0), axis=0)
        if ONE_WAVE:
            min_tiles = tl.minimum(min_tiles, tl.min(tl.where(ok, tiles, 1 << 30), axis=0))
            max_tiles = tl.maximum(max_tiles, tl.max(tl.where(ok, tiles, 0), axis=0))
    p = tl.maximum(tl.cdiv(MIN_CHUNK, BLOCK_N), tl.cdiv(total, WORK))
    if ONE_WAVE:
        # batch < WORK <= SCAN: the whole batch is one SCAN block, so each I(p) is a sum over registers (a pass
        # over seq_lens per bisection step, a loop inside the loop, made the H100 build spill 1.6x more and
        # run its bf16 kernel up to 3x slower)
        offs = tl.arange(0, SCAN)
        ok = offs < batch
        lens = tl.load(seq_lens_ptr + offs, mask=ok, other=0)
        n, _ = request_splits(lens, NUM_SPLITS, 1, BLOCK_N, True, p)
        search = (batch <= SCAN) & (2 * min_tiles >= p) & (batch * tl.cdiv(max_tiles, p) > WORK)
        search = search & (tl.sum(tl.where(ok, n, 0), axis=0) > WORK)
        # the answer is taken only up to 1.5 p: test there first, bisect only when it fits
        hi = tl.minimum(tl.minimum(tl.cdiv(total - batch, tl.maximum(WORK - batch, 1)), max_tiles), 3 * p // 2)
        n, _ = request_splits(lens, NUM_SPLITS, 1, BLOCK_N, True, hi)
        search = search & (tl.sum(tl.where(ok, n, 0), axis=0) <= WORK)
        lo = p
        hi = tl.where(search, hi, p)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            n, _ = request_splits(lens, NUM_SPLITS, 1, BLOCK_N, True, mid)
            fits = tl.sum(tl.where(ok, n, 0), axis=0) <= WORK
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid)
        p = hi
    return p


@triton.jit
def _balanced_item(seq_lens_ptr, batch, w, WORK: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
                   BLOCK_N: tl.constexpr, SCAN: tl.constexpr, ONE_WAVE: tl.constexpr):
    """Work item w of the balanced schedule -> (request + 1 or 0 when w is past the end, split, splits of that
    request, its chunk in tokens, its index j among split requests, J = number of split requests)."""
    p = _balanced_per_work(seq_lens_ptr, batch, WORK, NUM_SPLITS, MIN_CHUNK, BLOCK_N, SCAN, ONE_WAVE)
    # items of split requests first (w = S_b + split), in order of b
    hit_b = 0
    hit_s = 0
    hit_n = 0
    hit_c = 0
    hit_j = 0
    num_slots = 0
    num_split = 0
    num_single = 0
    for start in range(0, batch, SCAN):
        offs = start + tl.arange(0, SCAN)
        ok = offs < batch
        lens = tl.load(seq_lens_ptr + offs, mask=ok, other=0)
        n, chunk = request_splits(lens, NUM_SPLITS, MIN_CHUNK, BLOCK_N, True, p)
        is_split = ok & (n > 1)
        cnt = tl.where(is_split, n, 0)
        incl = num_slots + tl.cumsum(cnt, axis=0)
        excl = incl - cnt
        sp = is_split.to(tl.int32)
        j_excl = num_split + tl.cumsum(sp, axis=0) - sp
        hit = is_split & (excl <= w) & (w < incl)
        hit_b += tl.sum(tl.where(hit, offs + 1, 0), axis=0)
        hit_s += tl.sum(tl.where(hit, w - excl, 0), axis=0)
        hit_n += tl.sum(tl.where(hit, n, 0), axis=0)
        hit_c += tl.sum(tl.where(hit, chunk, 0), axis=0)
        hit_j += tl.sum(tl.where(hit, j_excl, 0), axis=0)
        num_slots += tl.sum(cnt, axis=0)
        num_split += tl.sum(sp, axis=0)
    # then one item per unsplit request (w = NS + #unsplit before b), in order of b
    r = w - num_slots
    for start in range(0, batch, SCAN):
        offs = start + tl.arange(0, SCAN)
        ok = offs < batch
        lens = tl.load(seq_lens_ptr + offs, mask=ok, other=0)
        n, chunk = request_splits(lens, NUM_SPLITS, MIN_CHUNK, BLOCK_N, True, p)
        single = (ok & (n == 1)).to(tl.int32)
        excl = num_single + tl.cumsum(single, axis=0) - single
        hit = (single > 0) & (excl == r)
        hit_b += tl.sum(tl.where(hit, offs + 1, 0), axis=0)
        hit_n += tl.sum(tl.where(hit, 1, 0), axis=0)
        hit_c += tl.sum(tl.where(hit, chunk, 0), axis=0)
        num_single += tl.sum(single, axis=0)
    return hit_b, hit_s, hit_n, hit_c, hit_j, num_split


@triton.jit
def _attend(q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, row_kv_lens_ptr, qk_scale, b, m_blk, seq_len, start,
            end, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv_blk, stride_kv_tok, stride_bt,
            NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_NOPE: tl.constexpr, D_PE: tl.constexpr,
            COMPUTE_DTYPE: tl.constexpr, HAS_ROW_KV_LENS: tl.constexpr):
    """Online softmax of BLOCK_M query rows of request b over keys [start, end): (acc, m_i, l_i), log2 domain."""
    compute_dtype: tl.constexpr = COMPUTE_DTYPE
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Q_LEN * NUM_HEADS
    t = rows // NUM_HEADS
    h = rows % NUM_HEADS
    tok = b * Q_LEN + t
    if HAS_ROW_KV_LENS:
        # keys each row sees given per row (decode context parallelism: a sharded cache), at most seq_len
        given = tl.load(row_kv_lens_ptr + b * Q_LEN + t, mask=row_ok, other=0)
        row_kv_len = tl.where(row_ok, tl.minimum(given, seq_len), 0)
    else:
        # causal inside the q block: row t sees seq_len - Q_LEN + t + 1 keys
        row_kv_len = tl.where(row_ok, seq_len - Q_LEN + 1 + t, 0)

    offs_dn = tl.arange(0, D_NOPE)
    offs_dp = tl.arange(0, D_PE)
    q_nope = tl.load(q_nope_ptr + tok[:, None] * stride_qn_t + h[:, None] * stride_qn_h + offs_dn[None, :],
                     mask=row_ok[:, None], other=0.0).to(compute_dtype)
    q_pe = tl.load(q_pe_ptr + tok[:, None] * stride_qp_t + h[:, None] * stride_qp_h + offs_dp[None, :],
                   mask=row_ok[:, None], other=0.0).to(compute_dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_NOPE], dtype=tl.float32)

    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_row = kv_ptr + page * stride_kv_blk + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kv_tok
        k_nope = tl.load(kv_row[:, None] + offs_dn[None, :], mask=n_ok[:, None], other=0.0).to(compute_dtype)
        k_pe = tl.load(kv_row[:, None] + D_NOPE + offs_dp[None, :], mask=n_ok[:, None], other=0.0).to(compute_dtype)

        s = tl.dot(q_nope, tl.trans(k_nope))
        s = tl.dot(q_pe, tl.trans(k_pe), s)
        s = s * qk_scale
        visible = offs_n[None, :] < row_kv_len[:, None]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet stay at 0
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(compute_dtype), k_nope, acc)  # V is the latent part of the same cache entry
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _scales(q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, sm_scale,
            Q_SCALE_IS_PTR: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr):
    """(log2-domain QK scale, kv scale)."""
    q_scale = 1.0
    if Q_SCALE_IS_PTR:
        q_scale = tl.load(q_scale_ptr).to(tl.float32)
    else:
        q_scale = q_scale_val
    kv_scale = 1.0
    if KV_SCALE_IS_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_val
    return sm_scale * q_scale * kv_scale * 1.4426950408889634, kv_scale


@triton.jit
def _store_final(out_ptr, lse_ptr, acc, m_i, l_i, kv_scale, b, m_blk, stride_o_t, stride_o_h, stride_lse_t,
                 stride_lse_h, NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr,
                 D_NOPE: tl.constexpr):
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Q_LEN * NUM_HEADS
    tok = b * Q_LEN + rows // NUM_HEADS
    h = rows % NUM_HEADS
    offs_dn = tl.arange(0, D_NOPE)
    has_keys = l_i > 0.0
    inv_l = tl.where(has_keys, 1.0 / l_i, 0.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(l_i), float("-inf"))
    o = acc * (inv_l * kv_scale)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_o_t + h[:, None] * stride_o_h + offs_dn[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + tok * stride_lse_t + h * stride_lse_h, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, slot_row0, m_blk, NUM_HEADS: tl.constexpr,
                   Q_LEN: tl.constexpr, BLOCK_M: tl.constexpr, D_NOPE: tl.constexpr, ROW_STRIDE: tl.constexpr):
    """fp32 O / l and log2 LSE of each row to part = slot_row0 + row * ROW_STRIDE."""
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Q_LEN * NUM_HEADS
    offs_dn = tl.arange(0, D_NOPE)
    has_keys = l_i > 0.0
    inv_l = tl.where(has_keys, 1.0 / l_i, 0.0)
    lse2 = tl.where(has_keys, m_i + tl.log2(l_i), float("-inf"))
    part = (slot_row0 + rows * ROW_STRIDE).to(tl.int64)
    tl.store(part_o_ptr + part[:, None] * D_NOPE + offs_dn[None, :], acc * inv_l[:, None], mask=row_ok[:, None])
    tl.store(part_lse_ptr + part, lse2, mask=row_ok)


@triton.jit
def _mla_decode_split_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, row_kv_lens_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, sm_scale,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_kv_blk, stride_kv_tok, stride_bt,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
    Q_SCALE_IS_PTR: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr,
    D_NOPE: tl.constexpr, D_PE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, HAS_ROW_KV_LENS: tl.constexpr,
):
    """Uniform plan: grid (B, m_blocks, NUM_SPLITS); part = (b * Q_LEN * H + row) * NUM_SPLITS + split."""
    b = tl.program_id(0)
    m_blk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    n_splits, chunk = request_splits(seq_len, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    if split >= n_splits:
        return  # the combine kernel reads only this request's first n_splits partials

    qk_scale, kv_scale = _scales(q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, sm_scale,
                                 Q_SCALE_IS_PTR, KV_SCALE_IS_PTR)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    acc, m_i, l_i = _attend(q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, row_kv_lens_ptr, qk_scale, b, m_blk,
                            seq_len, start, end, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv_blk,
                            stride_kv_tok, stride_bt, NUM_HEADS, Q_LEN, PAGE_SIZE, BLOCK_M, BLOCK_N, D_NOPE, D_PE,
                            COMPUTE_DTYPE, HAS_ROW_KV_LENS)
    if NUM_SPLITS == 1:
        _store_final(out_ptr, lse_ptr, acc, m_i, l_i, kv_scale, b, m_blk, stride_o_t, stride_o_h, stride_lse_t,
                     stride_lse_h, NUM_HEADS, Q_LEN, BLOCK_M, D_NOPE)
    else:
        _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, b * (Q_LEN * NUM_HEADS) * NUM_SPLITS + split,
                       m_blk, NUM_HEADS, Q_LEN, BLOCK_M, D_NOPE, NUM_SPLITS)


@triton.jit
def _mla_decode_split_balanced_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, row_kv_lens_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, split_index_ptr,
    q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, sm_scale, batch,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_kv_blk, stride_kv_tok, stride_bt,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h,
    NUM_HEADS: tl.constexpr, Q_LEN: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
    WORK: tl.constexpr, SCAN: tl.constexpr, ONE_WAVE: tl.constexpr,
    Q_SCALE_IS_PTR: tl.constexpr, KV_SCALE_IS_PTR: tl.constexpr,
    D_NOPE: tl.constexpr, D_PE: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, HAS_ROW_KV_LENS: tl.constexpr,
):
    """Balanced plan (ops/plan.py balanced_schedule): grid (m_blocks, G work items); a split item w stores
    its partial to slot w (part = w * Q_LEN * H + row), an unsplit one writes the output."""
    m_blk = tl.program_id(0)
    w = tl.program_id(1)
    b1, split, n_splits, chunk, j, num_split = _balanced_item(seq_lens_ptr, batch, w, WORK, NUM_SPLITS, MIN_CHUNK,
                                                              BLOCK_N, SCAN, ONE_WAVE)
    # the combine's list: J, then (b, S_b, n_b) of each split request
    tl.store(split_index_ptr, num_split, mask=(m_blk == 0) & (w == 0))
    is_first = (m_blk == 0) & (split == 0) & (n_splits > 1)
    tl.store(split_index_ptr + 1 + 3 * j, b1 - 1, mask=is_first)
    tl.store(split_index_ptr + 2 + 3 * j, w, mask=is_first)
    tl.store(split_index_ptr + 3 + 3 * j, n_splits, mask=is_first)
    if b1 == 0:
        return  # past the end of the schedule

    b = b1 - 1
    seq_len = tl.load(seq_lens_ptr + b)
    qk_scale, kv_scale = _scales(q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, sm_scale,
                                 Q_SCALE_IS_PTR, KV_SCALE_IS_PTR)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    acc, m_i, l_i = _attend(q_nope_ptr, q_pe_ptr, kv_ptr, block_table_ptr, row_kv_lens_ptr, qk_scale, b, m_blk,
                            seq_len, start, end, stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv_blk,
                            stride_kv_tok, stride_bt, NUM_HEADS, Q_LEN, PAGE_SIZE, BLOCK_M, BLOCK_N, D_NOPE, D_PE,
                            COMPUTE_DTYPE, HAS_ROW_KV_LENS)
    if n_splits > 1:
        _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, w * (Q_LEN * NUM_HEADS), m_blk, NUM_HEADS, Q_LEN,
                       BLOCK_M, D_NOPE, 1)
    else:
        _store_final(out_ptr, lse_ptr, acc, m_i, l_i, kv_scale, b, m_blk, stride_o_t, stride_o_h, stride_lse_t,
                     stride_lse_h, NUM_HEADS, Q_LEN, BLOCK_M, D_NOPE)


@functools.cache
def _compiler_options_of(index: int) -> dict:
    major, minor = torch.cuda.get_device_capability(index)
    return compiler_options(10 * major + minor)


def _compiler_options(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}  # the Triton interpreter (tests) runs on CPU tensors
    return _compiler_options_of(device.index if device.index is not None else torch.cuda.current_device())


def launch(args, workspace, config) -> None:
    """Run the Triton decode on validated ``DecodeArgs`` (see ops/api.py) under ``config`` (LaunchConfig:
    ``tile`` = (block_m, block_n, warps, stages), ``split_plan``, ``max_splits`` / ``min_chunk``), writing
    args.out and args.lse."""
    if config.split_plan not in ("balanced", "uniform"):
        raise ValueError(f"triton: config: split_plan {config.split_plan!r}; allowed: balanced, uniform")
    cfg = TritonDecodeConfig(*config.tile)
    batch, q_len, num_heads = args.batch, args.q_len, args.num_heads
    plan = workspace.plan_for(args, PlanTile(cfg.block_m, cfg.block_n), config)
    rows = q_len * num_heads
    m_blocks = triton.cdiv(rows, cfg.block_m)
    q_scale_ptr, q_scale_val, q_is_ptr = scale_args(args.q_scale)
    kv_scale_ptr, kv_scale_val, kv_is_ptr = scale_args(args.kv_scale)
    # Triton needs a real pointer even for a branch it compiles out: any fp32 buffer will do.
    dummy = workspace.partial_lse
    q_scale_ptr = dummy if q_scale_ptr is None else q_scale_ptr
    kv_scale_ptr = dummy if kv_scale_ptr is None else kv_scale_ptr
    out, lse, kv = args.out, args.lse, args.kv_cache
    common = dict(
        NUM_HEADS=num_heads, Q_LEN=q_len, PAGE_SIZE=kv.shape[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_SPLITS=plan.num_splits, MIN_CHUNK=plan.min_chunk,
        Q_SCALE_IS_PTR=q_is_ptr, KV_SCALE_IS_PTR=kv_is_ptr,
        D_NOPE=KV_LORA_RANK, D_PE=QK_ROPE_HEAD_DIM, COMPUTE_DTYPE=_COMPUTE_DTYPE[args.compute_dtype],
        HAS_ROW_KV_LENS=args.row_kv_lens is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_compiler_options(args.q_nope.device),
    )
    # never read without row_kv_lens (compiled out), but Triton needs a pointer
    row_kv_lens = args.row_kv_lens if args.row_kv_lens is not None else args.seq_lens
    strides = (args.q_nope.stride(0), args.q_nope.stride(1), args.q_pe.stride(0), args.q_pe.stride(1),
               kv.stride(0), kv.stride(1), args.block_table.stride(0),
               out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))
    if plan.balanced:
        _mla_decode_split_balanced_kernel[(m_blocks, plan.grid_items)](
            args.q_nope, args.q_pe, kv, args.block_table, args.seq_lens, row_kv_lens,
            out, lse, workspace.partial_out, workspace.partial_lse, workspace.split_index,
            q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, args.softmax_scale, batch, *strides,
            WORK=plan.work_target, SCAN=min(1024, max(16, triton.next_power_of_2(batch))),
            ONE_WAVE=batch < plan.work_target, **common,
        )
    else:
        _mla_decode_split_kernel[(batch, m_blocks, plan.num_splits)](
            args.q_nope, args.q_pe, kv, args.block_table, args.seq_lens, row_kv_lens,
            out, lse, workspace.partial_out, workspace.partial_lse,
            q_scale_ptr, kv_scale_ptr, q_scale_val, kv_scale_val, args.softmax_scale, *strides, **common,
        )
    if plan.has_combine:
        # PDL (when the config asks): the combine waits on the split kernel with griddepcontrol
        launch_combine(args, workspace, plan, cfg.block_n, use_pdl=config.enable_pdl)
