"""The fake tensors a CuTe family compiles its decode kernel with (device side: imports cutlass).

``compile_variant`` in each family's launch module compiles against these instead of real tensors: batch, token
count, page count, block-table width and strides are symbolic, so one binary serves every batch and cache size.
What is fixed is what the kernels rely on: 16-byte aligned rows of q, the cache and the output (TMA, 16-byte
vector loads and stores; ``host.aligned_rows_reason`` refuses other calls), a 64-bit page stride (a cache past
2 GiB, e.g. B=128 x 32k tokens of fp8, overflows 32-bit offsets) and contiguous last dimensions.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_HEAD_DIM, QK_ROPE_HEAD_DIM

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp8": cutlass.Float8E4M3FN}


def sym(divisibility: int = 1):
    """A symbolic size or stride, a multiple of ``divisibility``."""
    return cute.sym_int(divisibility=divisibility)


def int32_vector():
    """A 1-D int32 tensor of symbolic length (split lists, work items, counters, per-row key counts)."""
    return make_fake_tensor(cutlass.Int32, (sym(),), (1,), assumed_align=4)


def fp32_scalar_tensor():
    """A (1,) fp32 tensor: a scale read from device memory."""
    return make_fake_tensor(cutlass.Float32, (1,), (1,), assumed_align=4)


@dataclasses.dataclass(frozen=True)
class DecodeTensors:
    """The tensors every CuTe decode kernel takes, in the order the kernels take them."""

    q_nope: object  # [tokens, H, 512]
    q_pe: object  # [tokens, H, 64]
    kv: object  # [pages, block_size, 576]
    block_table: object  # [B, max_blocks] int32
    seq_lens: object  # [B] int32
    out: object  # [tokens, H, 512]
    lse: object  # [tokens, H] fp32
    part_o: object  # [slots x rows, 512]: the split partials, in ``partial_dtype``
    part_lse: object  # [slots x rows] fp32
    q_scale: object  # (1,) fp32
    kv_scale: object  # (1,) fp32


def decode_tensors(variant, partial_dtype=None) -> DecodeTensors:
    """The fake tensors of ``variant`` (a cute_common ``Variant``); split partials in ``partial_dtype`` (a cutlass
    type; None: the output dtype)."""
    qd, kvd, od = DTYPES[variant.q_dtype], DTYPES[variant.kv_dtype], DTYPES[variant.out_dtype]
    q_align = 16 // (qd.width // 8)
    kv_align = 16 // (kvd.width // 8)
    o_align = 16 // (od.width // 8)
    H, D = variant.num_heads, KV_LORA_RANK
    tokens = sym()
    q_nope = make_fake_tensor(qd, (tokens, H, D), (sym(q_align), sym(q_align), 1), assumed_align=16)
    q_pe = make_fake_tensor(qd, (tokens, H, QK_ROPE_HEAD_DIM), (sym(q_align), sym(q_align), 1), assumed_align=16)
    kv = make_fake_tensor(kvd, (sym(), variant.block_size, QK_HEAD_DIM),
                          (cute.sym_int(64, divisibility=kv_align), sym(kv_align), 1), assumed_align=16)
    batch = sym()
    return DecodeTensors(
        q_nope=q_nope,
        q_pe=q_pe,
        kv=kv,
        block_table=make_fake_tensor(cutlass.Int32, (batch, sym()), (sym(), 1), assumed_align=4),
        seq_lens=make_fake_tensor(cutlass.Int32, (batch,), (1,), assumed_align=4),
        out=make_fake_tensor(od, (tokens, H, D), (sym(o_align), sym(o_align), 1), assumed_align=16),
        lse=make_fake_tensor(cutlass.Float32, (tokens, H), (sym(), sym()), assumed_align=4),
        part_o=make_fake_tensor(od if partial_dtype is None else partial_dtype, (sym(), D), (D, 1), assumed_align=16),
        part_lse=make_fake_tensor(cutlass.Float32, (sym(),), (1,), assumed_align=4),
        q_scale=fp32_scalar_tensor(),
        kv_scale=fp32_scalar_tensor(),
    )
