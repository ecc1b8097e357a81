"""Shared helpers of the kernel tests (imported by the test modules; not a test module itself).

``make_decode_inputs`` builds adversarial but valid decode inputs: physical KV pages randomly permuted, spare
pages that no request owns, block-table columns past each request's pages filled with garbage page ids,
q_pe as a strided view, and every KV slot that no request may read (spare pages, the tail of each request's
last page) filled with a large "poison" value, so a kernel that reads a slot it must not read gets a visibly
wrong answer instead of a lucky one.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from mla_backend_plugin.kernels.reference import mla_decode_reference
from mla_backend_plugin.kernels.triton_decode.config import config_for
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM, QK_ROPE_HEAD_DIM

# DeepSeek-V2/V3: softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1/sqrt(128 + 64).
SOFTMAX_SCALE = 192 ** -0.5
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Written into every KV slot no request may read (as +-POISON per dimension); finite, so a kernel that loads
# such a slot but masks it correctly (probability exactly 0) is not punished, while one that lets it into
# the softmax or the output is off by orders of magnitude.
POISON_16BIT = 8192.0  # exact in bf16 and fp16
POISON_FP8 = FP8_MAX

TILE_N = config_for(128).block_n  # KV tile of the Triton kernel: lengths not a multiple of it hit the masked tail


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


@dataclasses.dataclass
class DecodeInputs:
    """One decode call's inputs plus what is needed to call ``mla_decode`` and the reference on them."""

    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # [T, H, 576] or (q_nope [T, H, 512], q_pe [T, H, 64])
    kv_cache: torch.Tensor  # [num_blocks, block_size, 576]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    seq_lens_list: list[int]
    q_len: int
    num_heads: int
    softmax_scale: float
    q_scale: float | None  # None for a 16-bit q
    kv_scale: float | None  # None for a 16-bit cache
    out_dtype: torch.dtype

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
    def q_nope(self) -> torch.Tensor:
        return self.q[0] if isinstance(self.q, tuple) else self.q[..., :KV_LORA_RANK]

    @property
    def q_pe(self) -> torch.Tensor:
        return self.q[1] if isinstance(self.q, tuple) else self.q[..., KV_LORA_RANK:]

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

    def call_args(self) -> tuple:
        return (self.q, self.kv_cache, self.block_table, self.seq_lens)

    def poisoned_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Preallocated (out, lse) filled with NaN: any element the kernel forgets to write stays NaN."""
        out = torch.full((self.num_tokens, self.num_heads, KV_LORA_RANK), math.nan, dtype=self.out_dtype,
                         device=self.device)
        lse = torch.full((self.num_tokens, self.num_heads), math.nan, dtype=torch.float32, device=self.device)
        return out, lse

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (out, lse) of the package's torch reference on these inputs."""
        return mla_decode_reference(self.q_nope, self.q_pe, self.kv_cache, self.block_table, self.seq_lens,
                                    self.q_len, self.softmax_scale, self.q_scale, self.kv_scale)


def draw_seq_lens(batch: int, around: int, *, block_size: int, seed: int, max_total_tokens: int | None = None,
                  max_len: int | None = None) -> list[int]:
    """Ragged per-request KV lengths drawn around ``around`` (at least 1 each).

    With two or more requests, one length is exactly ``around`` and one is odd (so neither a multiple of the
    block size nor of the kernel's KV tile); the order is shuffled. With one request, the length is
    ``around`` itself. ``max_total_tokens`` bounds the KV of the whole batch: when ``batch * around`` would
    exceed it, only some requests are long and the rest are drawn around what the budget leaves.
    ``max_len`` caps every length (e.g. the block-table width times the block size).
    """
    rng = random.Random(seed)
    cap = max_len if max_len is not None else 1 << 62
    around = min(around, cap)
    if batch == 1:
        return [around]

    def near(center: int) -> int:
        d = max(2, center // 8)
        return max(1, min(cap, center + rng.randint(-d, d)))

    n_long = batch
    short_center = around
    if max_total_tokens is not None and batch * (around + around // 8 + 2) > max_total_tokens:
        n_long = max(2, min(batch, (max_total_tokens // 2) // (around + around // 8 + 2)))
        short_center = max(1, (max_total_tokens - n_long * (around + around // 8 + 2)) // max(1, batch - n_long)
                           * 7 // 8)
        short_center = min(short_center, around)
    lens = [near(around) if i < n_long else near(short_center) for i in range(batch)]
    lens[0] = around
    odd = lens[1] if lens[1] % 2 == 1 else lens[1] + (1 if lens[1] + 1 <= cap else -1)
    lens[1] = max(1, odd)
    rng.shuffle(lens)
    return lens


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    poison: bool = True,
) -> DecodeInputs:
    """Random decode inputs (see the module docstring for what makes them adversarial).

    Args:
        seq_lens: per-request KV lengths (including the q_len new tokens); 0 and lengths < q_len are allowed.
        kv_dtype: bfloat16, float16 or float8_e4m3fn.
        q_form: ``"pair"`` ((q_nope, q_pe) with q_pe a strided view), ``"cat"`` (one [T, H, 576] tensor) or
            ``"fp8"`` (one [T, H, 576] float8_e4m3fn tensor).
        q_dtype: 16-bit dtype of q for "pair"/"cat" (default: the cache dtype if it is 16-bit, else bf16).
        q_scale / kv_scale: dequantisation scales of an fp8 q / cache (default 1.0 for fp8, None otherwise).
            Values are drawn as N(0, 1) / scale before the fp8 cast, so the dequantised values are ~N(0, 1).
        out_dtype: output dtype (default: q's 16-bit dtype; for fp8 q the cache dtype if 16-bit, else bf16).
        num_blocks / max_blocks: fix the physical page count and the block-table width (e.g. to refill the
            static tensors of a captured CUDA graph); by default they are sized from the lengths.
    """
    device = torch.device(device)
    if len(seq_lens) != batch:
        raise ValueError(f"{len(seq_lens)} seq_lens for batch {batch}")
    if q_form not in ("pair", "cat", "fp8"):
        raise ValueError(f"q_form must be 'pair', 'cat' or 'fp8', got {q_form!r}")
    kv_fp8 = _is_fp8(kv_dtype)
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
    # 16-bit dtype the random values are drawn in before an fp8 cast
    gen_dtype = torch.bfloat16 if kv_fp8 else kv_dtype

    rng = random.Random(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)

    # ---- block table: permuted physical pages, garbage past each request's pages ----
    pages_needed = [_cdiv(max(int(s), 0), block_size) for s in seq_lens]
    total_pages = sum(pages_needed)
    if num_blocks is None:
        num_blocks = total_pages + max(2, total_pages // 8) + rng.randint(0, 3)
    if num_blocks < total_pages + 1:
        raise ValueError(f"num_blocks={num_blocks} leaves no spare page for {total_pages} used pages")
    width = max_blocks if max_blocks is not None else _cdiv(max(pages_needed + [1]) + 2, 16) * 16
    if max(pages_needed + [0]) > width:
        raise ValueError(f"a request needs {max(pages_needed)} pages but the block table has {width} columns")
    perm = torch.randperm(num_blocks, generator=cpu_gen)
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
    kv = torch.randn(num_blocks, block_size, QK_HEAD_DIM, generator=dev_gen, device=device, dtype=gen_dtype)
    if kv_fp8:
        kv.div_(kv_scale)
    if poison:
        value = POISON_FP8 if kv_fp8 else POISON_16BIT
        signs = torch.randint(0, 2, (QK_HEAD_DIM,), generator=cpu_gen).to(device) * 2 - 1
        poison_row = (signs * value).to(gen_dtype)
        if spare.numel():
            kv[spare.to(device)] = poison_row
        start = 0
        for b, n in enumerate(pages_needed):
            s = int(seq_lens[b])
            if n and s % block_size:
                kv[int(used[start + n - 1]), s % block_size:] = poison_row
            start += n
    kv_cache = kv.to(kv_dtype) if kv_fp8 else kv

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
        if q_form == "fp8":
            q = (q / q_scale).to(FP8_DTYPE)
        else:
            q = q.to(q_dtype)

    return DecodeInputs(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens_t,
                        seq_lens_list=[int(s) for s in seq_lens], q_len=q_len, num_heads=num_heads,
                        softmax_scale=float(softmax_scale), q_scale=q_scale, kv_scale=kv_scale,
                        out_dtype=out_dtype)


def tolerances(kv_dtype: torch.dtype) -> dict:
    """(out rtol, out atol, lse atol) for a cache dtype."""
    if _is_fp8(kv_dtype):
        return {"rtol": 1e-2, "atol": 0.15, "lse_atol": 5e-2}
    return {"rtol": 1e-2, "atol": 1e-2, "lse_atol": 1e-2}


def assert_close_decode(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                        kv_dtype: torch.dtype, msg: str = "") -> None:
    """Compare a kernel's (out, lse) with the reference's.

    NaN never passes (in out or lse); lse is -inf exactly where the reference's is (rows that see no key),
    and out is exactly 0 there; elsewhere out within rtol/atol and lse within an absolute tolerance.
    """
    tol = tolerances(kv_dtype)
    where = f" [{msg}]" if msg else ""
    assert tuple(out.shape) == tuple(ref_out.shape), f"out shape {tuple(out.shape)} != {tuple(ref_out.shape)}{where}"
    assert tuple(lse.shape) == tuple(ref_lse.shape), f"lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}{where}"
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}{where}"
    out_f = out.float()
    lse_f = lse.float()
    ref_out = ref_out.float().to(out_f.device)
    ref_lse = ref_lse.float().to(lse_f.device)
    n_nan = int(torch.isnan(out_f).sum())
    assert n_nan == 0, f"{n_nan} NaN in out (unwritten or bad math){where}"
    nan_rows = torch.isnan(lse_f)
    assert not nan_rows.any(), (f"{int(nan_rows.sum())} NaN in lse, first at (token, head) "
                                f"{tuple(nan_rows.nonzero()[0].tolist())}{where}")
    assert not torch.isnan(ref_out).any() and not torch.isnan(ref_lse).any(), f"NaN in the reference{where}"
    assert not torch.isposinf(lse_f).any(), f"+inf in lse{where}"
    ref_dead = torch.isneginf(ref_lse)
    dead = torch.isneginf(lse_f)
    if not torch.equal(ref_dead, dead):
        bad = (ref_dead != dead).nonzero()[0].tolist()
        raise AssertionError(f"lse is -inf at {int(dead.sum())} rows but the reference at {int(ref_dead.sum())}; "
                             f"first mismatch at (token, head) {tuple(bad)}: lse={lse_f[tuple(bad)].item()} "
                             f"ref={ref_lse[tuple(bad)].item()}{where}")
    if ref_dead.any():
        dead_out = out_f[ref_dead]
        assert (dead_out == 0).all(), (f"rows with no visible key must be 0, max |out| there = "
                                       f"{dead_out.abs().max().item()}{where}")
    torch.testing.assert_close(out_f, ref_out, rtol=tol["rtol"], atol=tol["atol"], equal_nan=False,
                               msg=lambda m: f"out mismatch{where}\n{m}")
    live = ~ref_dead
    torch.testing.assert_close(lse_f[live], ref_lse[live], rtol=0.0, atol=tol["lse_atol"], equal_nan=False,
                               msg=lambda m: f"lse mismatch{where}\n{m}")


def kernel_unsupported_reason(name: str, device: str = "cuda") -> str | None:
    """Why registry kernel ``name`` cannot run on this machine's GPU (arch, toolchain), from a representative
    bf16 call; None when it can. GPU test files use it to skip a kernel cleanly."""
    from mla_backend_plugin.ops import prepare_args, registry

    if not torch.cuda.is_available():
        return "no GPU"
    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16, device=device)
    kv = torch.zeros(1, 64, 576, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    args = prepare_args(q, kv, bt, torch.ones(1, dtype=torch.int32, device=device), softmax_scale=0.1)
    return registry.KERNELS[name].unsupported_reason(args, registry.device_capability(q.device))


def capture_graph(run, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Warm ``run`` up on a side stream (kernels compile and cache their launchers), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph


def select_kernel_for_test(name: str, namespace: dict, monkeypatch, device: str = "cuda") -> str:
    """Body of a per-kernel parametrized fixture: skip when ``name`` cannot run here (or is filtered out by
    ``MLA_TEST_KERNELS=a,b``), else make it the test module's ``KERNEL`` for this test."""
    import os

    import pytest

    wanted = os.environ.get("MLA_TEST_KERNELS")
    reason = f"MLA_TEST_KERNELS={wanted}" if wanted and name not in wanted.split(",") else \
        kernel_unsupported_reason(name, device)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    monkeypatch.setitem(namespace, "KERNEL", name)
    return name

