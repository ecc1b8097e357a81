"""The one generator of decode inputs for tests, benchmarks, the self-check and the tuner (testing/ re-exports it).

``make_decode_inputs`` builds adversarial but valid inputs: physical KV pages randomly permuted, spare pages
that no request owns, block-table columns past each request's pages filled with ids of spare pages, q_pe as
a strided view (``q_form="pair"``), and every KV slot no request may read (spare pages, the tail of each
request's last page) poisoned, so that a kernel reading a slot it must not read gets a visibly wrong answer:

* ``poison="nan"`` (default) / ``"inf"``: NaN or +-inf (an fp8 e4m3fn cache has no inf: NaN there). What vLLM
  hands a kernel can be exactly that (slots past a request's length hold whatever their block held before, and
  e4m3 has NaN encodings); P = 0 times V = NaN is NaN, so this also catches a kernel that masks the logits but
  multiplies a masked probability into V.
* ``poison="finite"``: +-8192 (16-bit caches) / +-448 (fp8) per dimension: a kernel that loads such a slot but
  masks it (probability exactly 0) passes; one that lets it into the softmax is off by orders of magnitude.

KV values are N(0, 1) dequantised values: an fp8 cache stores ``value / kv_scale`` (clipped to the e4m3 range);
``kv_scale`` below 1 (e.g. 1/64) makes the stored values fill that range. ``kv_copies`` > 1 adds identical
copies of the cache at other addresses (benchmarks rotate through them so that L2 cannot serve them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import torch

from mla_backend_plugin.ops import registry
from mla_backend_plugin.ops.args import DecodeArgs
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM, QK_ROPE_HEAD_DIM

# DeepSeek-V2/V3: softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(128 + 64).
SOFTMAX_SCALE = 192 ** -0.5
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
POISON_16BIT = 8192.0  # exact in bf16 and fp16
POISON_FP8 = FP8_MAX
POISONS = (None, "finite", "nan", "inf")
# KV generation works in chunks of this many float32 bytes, so that a 10 GB cache needs no 20 GB temporary.
_FILL_CHUNK_BYTES = 1 << 28


@dataclasses.dataclass
class DecodeInputs:
    """One decode call's inputs plus what is needed to call ``mla_decode``, the reference or a peer on them."""

    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # [T, H, 576] or (q_nope [T, H, 512], q_pe [T, H, 64])
    kv_caches: list[torch.Tensor]  # identical copies of [num_blocks, block_size, 576]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    seq_lens_list: list[int]
    q_len: int
    num_heads: int
    softmax_scale: float
    q_scale: float | None  # None for a 16-bit q
    kv_scale: float | None  # None for a 16-bit cache
    out_dtype: torch.dtype
    # [B, q_len] int32 keys each query row sees (one rank's shard under decode context parallelism:
    # testing/dcp.py), or None for the usual causal rule; pass it to mla_decode as row_kv_lens=
    row_kv_lens: torch.Tensor | None = None
    _fp8_query: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.kv_caches[0]

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_cache.dtype

    @property
    def q_nope(self) -> torch.Tensor:
        return self.q[0] if isinstance(self.q, tuple) else self.q[..., :KV_LORA_RANK]

    @property
    def q_pe(self) -> torch.Tensor:
        return self.q[1] if isinstance(self.q, tuple) else self.q[..., KV_LORA_RANK:]

    @functools.cached_property
    def query_start_loc(self) -> torch.Tensor:
        """vLLM's cu_seqlens_q: [B + 1] int32 (made once: peers capture it in CUDA graphs)."""
        return torch.arange(self.batch + 1, dtype=torch.int32, device=self.device) * self.q_len

    def kv_scale_tensor(self) -> torch.Tensor | None:
        return None if self.kv_scale is None else torch.tensor([self.kv_scale], dtype=torch.float32,
                                                                device=self.device)

    def scale_kwargs(self, as_tensor: bool | tuple[bool, bool] = False) -> dict:
        """q_scale / kv_scale for ``mla_decode``: Python floats, or 1-element float32 tensors on the device.

        ``as_tensor`` may be a pair (q_scale as tensor?, kv_scale as tensor?) to mix the two forms.
        """
        q_t, kv_t = (as_tensor, as_tensor) if isinstance(as_tensor, bool) else as_tensor

        def conv(v, t):
            if v is None:
                return None
            return torch.tensor([v], dtype=torch.float32, device=self.device) if t else float(v)

        return {"q_scale": conv(self.q_scale, q_t), "kv_scale": conv(self.kv_scale, kv_t)}

    def call_args(self, copy: int = 0) -> tuple:
        return (self.q, self.kv_caches[copy], self.block_table, self.seq_lens)

    def query(self, q_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q as one [T, H, 576] tensor, its dequantisation scale tensor or None) in the dtype a kernel takes:
        ``"bf16"``/``"fp16"`` (this q), or ``"fp8"``: this q quantised per tensor as vLLM does for backends that
        take an fp8 q (computed once)."""
        q = self.q if not isinstance(self.q, tuple) else torch.cat(self.q, dim=-1)
        if q_dtype != "fp8":
            return q, None
        if q.dtype == FP8_DTYPE:
            return q, torch.tensor([self.q_scale], dtype=torch.float32, device=self.device)
        if self._fp8_query is None:
            self._fp8_query = quantize_fp8(q)
        return self._fp8_query

    def load_(self, new: DecodeInputs) -> None:
        """Copy ``new``'s q, KV cache (copy 0), block table and lengths into this one's tensors in place: the
        buffers a CUDA graph captured. Shapes and scales must match (a graph keeps the scales it captured)."""
        if (new.q_scale, new.kv_scale) != (self.q_scale, self.kv_scale):
            raise ValueError(f"load_: scales {(new.q_scale, new.kv_scale)} differ from the captured "
                             f"{(self.q_scale, self.kv_scale)}")
        pairs = [*zip(self.q if isinstance(self.q, tuple) else (self.q,),
                      new.q if isinstance(new.q, tuple) else (new.q,)),
                 (self.kv_cache, new.kv_cache), (self.block_table, new.block_table), (self.seq_lens, new.seq_lens)]
        if self.row_kv_lens is not None:
            pairs.append((self.row_kv_lens, new.row_kv_lens))
        for dst, src in pairs:
            dst.copy_(src)
        self._fp8_query = None

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Preallocated (out, lse) filled with NaN: any element the kernel forgets to write stays NaN."""
        out = torch.full((self.num_tokens, self.num_heads, KV_LORA_RANK), math.nan, dtype=self.out_dtype,
                         device=self.device)
        lse = torch.full((self.num_tokens, self.num_heads), math.nan, dtype=torch.float32, device=self.device)
        return out, lse

    def reference(self, q_dtype: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (out, lse) of the package's torch reference (the registry's ``"reference"`` kernel,
        kernels/reference) on KV copy 0, with this q (or with the q a kernel took: ``query(q_dtype)``)."""
        if q_dtype is None:
            q_nope, q_pe, q_scale = self.q_nope, self.q_pe, self.q_scale
        else:
            q, q_scale = self.query(q_dtype)
            q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
        out = torch.empty(self.num_tokens, self.num_heads, KV_LORA_RANK, dtype=torch.float32, device=self.device)
        lse = torch.empty(self.num_tokens, self.num_heads, dtype=torch.float32, device=self.device)
        args = DecodeArgs(q_nope=q_nope, q_pe=q_pe, kv_cache=self.kv_cache, block_table=self.block_table,
                          seq_lens=self.seq_lens, batch=self.batch, q_len=self.q_len, num_heads=self.num_heads,
                          softmax_scale=self.softmax_scale, q_scale=q_scale, kv_scale=self.kv_scale, out=out, lse=lse,
                          compute_dtype=torch.float32, row_kv_lens=self.row_kv_lens)
        spec = registry.KERNELS["reference"]
        spec.launch(args, None, spec.default_config(args, None))
        return out, lse


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic e4m3 quantisation, as vLLM's fp8 q path: (x / scale as fp8, scale [1] float32)."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp_(min=1e-12).reshape(1)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fill_normal_(kv: torch.Tensor, generator: torch.Generator, kv_scale: float | None) -> None:
    """N(0, 1) entries; an fp8 cache stores value / kv_scale clipped to +-448 (nothing saturates to NaN)."""
    if kv.dtype != FP8_DTYPE:
        kv.normal_(generator=generator)
        return
    rows = kv.view(-1, kv.shape[-1])
    step = max(1, _FILL_CHUNK_BYTES // (4 * rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        chunk = torch.randn(rows[start:start + step].shape, device=kv.device, generator=generator)
        rows[start:start + step] = (chunk / kv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _poison_row(kv_dtype: torch.dtype, poison: str, signs: torch.Tensor) -> torch.Tensor:
    fp8 = kv_dtype == FP8_DTYPE
    if poison == "finite":
        row = signs * (POISON_FP8 if fp8 else POISON_16BIT)
    elif poison == "inf" and not fp8:
        row = signs * math.inf
    else:  # "nan", and "inf" for e4m3fn, which has no inf encoding
        row = torch.full_like(signs, math.nan)
    return row.to(kv_dtype)


def _cpu_by_default(fn):
    """Engines build models under a default-device context (vLLM: ``with torch.device("cuda")``), and the
    serving hooks make stand-in inputs there: tensors this module means for the CPU (and its CPU generator's
    draws) must stay on the CPU; every device tensor names its device."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.device("cpu"):
            return fn(*args, **kwargs)

    return wrapper


@_cpu_by_default
def make_decode_inputs(
    batch: int,
    seq_lens: list[int],
    q_len: int,
    num_heads: int,
    block_size: int,
    kv_dtype: torch.dtype,
    q_form: str,
    device,
    seed: int,
    *,
    q_dtype: torch.dtype | None = None,
    q_scale: float | None = None,
    kv_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
    softmax_scale: float = SOFTMAX_SCALE,
    poison: str | None = "nan",
    kv_copies: int = 1,
    share_pages: bool = False,
) -> DecodeInputs:
    """Random decode inputs (see the module docstring for what makes them adversarial).

    Args:
        seq_lens: per-request KV lengths (including the q_len new tokens); 0 and lengths < q_len are allowed.
        kv_dtype: bfloat16, float16 or float8_e4m3fn.
        q_form: ``"pair"`` ((q_nope, q_pe) with q_pe a strided view), ``"cat"`` (one [T, H, 576] tensor) or
            ``"fp8"`` (one [T, H, 576] float8_e4m3fn tensor).
        q_dtype: 16-bit dtype of q for "pair"/"cat" (default: the cache dtype if it is 16-bit, else bf16).
        q_scale / kv_scale: dequantisation scales of an fp8 q / cache (default 1.0 for fp8, None otherwise).
        out_dtype: output dtype (default: q's 16-bit dtype; for fp8 q the cache dtype if 16-bit, else bf16).
        num_blocks / max_blocks: fix the physical page count and the block-table width (e.g. to refill the
            static tensors of a captured CUDA graph); by default they are sized from the lengths, with spare
            pages and garbage columns.
        poison: what unread KV slots hold: ``"nan"``, ``"inf"``, ``"finite"`` or None (random values).
        kv_copies: identical copies of the cache (``DecodeInputs.kv_caches``).
        share_pages: with ``num_blocks`` smaller than the pages the lengths need, requests share physical pages
            of a pool of ``num_blocks`` (assigned in a random order, cycling): timing inputs for batches whose
            KV would not fit (the tuner's). Needs ``poison=None`` (a shared page has no unread slots).
    """
    device = torch.device(device)
    if len(seq_lens) != batch:
        raise ValueError(f"{len(seq_lens)} seq_lens for batch {batch}")
    if q_form not in ("pair", "cat", "fp8"):
        raise ValueError(f"q_form must be 'pair', 'cat' or 'fp8', got {q_form!r}")
    if poison not in POISONS:
        raise ValueError(f"poison must be one of {POISONS}, got {poison!r}")
    kv_fp8 = kv_dtype == FP8_DTYPE
    if q_form == "fp8":
        if q_dtype not in (None, FP8_DTYPE):
            raise ValueError("q_form='fp8' makes an fp8 q")
        q_dtype = FP8_DTYPE
        q_scale = 1.0 if q_scale is None else float(q_scale)
        if out_dtype is None:
            out_dtype = torch.bfloat16 if kv_fp8 else kv_dtype
    else:
        if q_dtype is None:
            q_dtype = torch.bfloat16 if kv_fp8 else kv_dtype
        if q_scale is not None:
            raise ValueError("q_scale is only for an fp8 q")
        if out_dtype is None:
            out_dtype = q_dtype
    if kv_fp8:
        kv_scale = 1.0 if kv_scale is None else float(kv_scale)
    elif kv_scale is not None:
        raise ValueError("kv_scale is only for an fp8 cache")

    rng = random.Random(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)

    # ---- block table: permuted physical pages, ids of spare pages past each request's pages ----
    pages_needed = [_cdiv(max(int(s), 0), block_size) for s in seq_lens]
    total_pages = sum(pages_needed)
    if num_blocks is None:
        num_blocks = total_pages + max(2, total_pages // 8) + rng.randint(0, 3)
    shared = share_pages and num_blocks < total_pages + 1
    if shared and poison is not None:
        raise ValueError("share_pages needs poison=None: pages shared by requests have no unread slots")
    if num_blocks < total_pages + 1 and not shared:
        raise ValueError(f"num_blocks={num_blocks} leaves no spare page for {total_pages} used pages")
    width = max_blocks if max_blocks is not None else _cdiv(max(pages_needed + [1]) + 2, 16) * 16
    if max(pages_needed + [0]) > width:
        raise ValueError(f"a request needs {max(pages_needed)} pages but the block table has {width} columns")
    perm = torch.randperm(num_blocks, generator=cpu_gen)
    if shared:
        used = perm[torch.arange(total_pages) % num_blocks]
        spare = perm
    else:
        used = perm[:total_pages]
        spare = perm[total_pages:]
    bt = spare[torch.randint(0, spare.numel(), (batch, width), generator=cpu_gen)]  # garbage everywhere first
    start = 0
    for b, n in enumerate(pages_needed):
        bt[b, :n] = used[start:start + n]
        start += n
    block_table = bt.to(torch.int32).to(device)
    seq_lens_t = torch.tensor([int(s) for s in seq_lens], dtype=torch.int32, device=device)

    # ---- KV cache ----
    kv = torch.empty(num_blocks, block_size, QK_HEAD_DIM, device=device, dtype=kv_dtype)
    _fill_normal_(kv, dev_gen, kv_scale)
    if poison is not None:
        signs = (torch.randint(0, 2, (QK_HEAD_DIM,), generator=cpu_gen) * 2 - 1).to(torch.float32)
        # written through an integer view of the same bits: indexed stores are not implemented for every
        # dtype (e4m3fn)
        bits = torch.uint8 if kv_fp8 else torch.int16
        raw = kv.view(bits)
        poison_row = _poison_row(kv_dtype, poison, signs).view(bits).to(device)
        if spare.numel():
            raw[spare.to(device)] = poison_row
        start = 0
        for b, n in enumerate(pages_needed):
            s = int(seq_lens[b])
            if n and s % block_size:
                raw[int(used[start + n - 1]), s % block_size:] = poison_row
            start += n

    # ---- q ----
    num_tokens = batch * q_len
    if q_form == "pair":
        q_nope = torch.randn(num_tokens, num_heads, KV_LORA_RANK, generator=dev_gen, device=device, dtype=q_dtype)
        # q_pe as a strided view: a column slice of a head-major buffer, transposed to [T, H, 64]
        big = torch.randn(num_heads, num_tokens, QK_ROPE_HEAD_DIM + 16, generator=dev_gen, device=device,
                          dtype=q_dtype)
        q_pe = big[:, :, 8:8 + QK_ROPE_HEAD_DIM].transpose(0, 1)
        q = (q_nope, q_pe)
    else:
        q = torch.randn(num_tokens, num_heads, QK_HEAD_DIM, generator=dev_gen, device=device, dtype=torch.float32)
        q = (q / q_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) if q_form == "fp8" else q.to(q_dtype)

    return DecodeInputs(q=q, kv_caches=[kv] + [kv.clone() for _ in range(kv_copies - 1)], block_table=block_table,
                        seq_lens=seq_lens_t, seq_lens_list=[int(s) for s in seq_lens], q_len=q_len,
                        num_heads=num_heads, softmax_scale=float(softmax_scale), q_scale=q_scale,
                        kv_scale=kv_scale, out_dtype=out_dtype)
