"""First-use self-check of a kernel on an architecture where it was never verified on hardware.

Our GPU test suite runs on Hopper only. A kernel compiled for another architecture (SM80/89, SM100, SM120)
is therefore checked, the first time it is about to run on such a GPU, against the float32 reference on a few
small random decode problems (paged, ragged, q_len > 1, fp8 with a non-unit scale where supported). The
result is cached per (kernel, device) for the life of the process; ops/registry.py skips a kernel that fails.

``CUTE_MLA_SELF_CHECK=always`` checks on verified architectures too; ``=never`` disables the check.
"""

from __future__ import annotations

import os

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK, QK_HEAD_DIM

SELF_CHECK_ENV_VAR = "CUTE_MLA_SELF_CHECK"

# (kernel name, device) -> None when the kernel passed, else why it failed
_RESULTS: dict[tuple[str, str], str | None] = {}

# (num_heads, q_len, block_size, kv dtype, kv scale, seq_lens): lengths not multiples of a page or tile, one
# shorter than q_len (a padded request), and one long enough to be split.
_CASES = (
    (128, 2, 64, torch.bfloat16, None, (1, 77, 300, 1500)),
    (16, 1, 16, FP8_DTYPE, 2.0, (5, 190, 1025)),
)


def self_check_mode() -> str:
    mode = os.environ.get(SELF_CHECK_ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"{SELF_CHECK_ENV_VAR}={mode!r}: allowed values are auto, always, never")
    return mode


def _case_inputs(device, num_heads, q_len, block_size, kv_dtype, seq_lens, gen):
    batch = len(seq_lens)
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3  # spare pages nobody owns
    kv = torch.randn(num_blocks, block_size, QK_HEAD_DIM, generator=gen, device=device)
    kv = kv.to(kv_dtype) if kv_dtype != FP8_DTYPE else (kv * 8).to(FP8_DTYPE)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = torch.zeros(batch, max(pages), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = perm[start:start + n]
        start += n
    q = torch.randn(batch * q_len, num_heads, QK_HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kv, block_table, seq


def run_self_check(spec, device: torch.device) -> str | None:
    """Run ``spec`` on the self-check cases; None when every output matches the reference, else the reason."""
    from mla_backend_plugin.kernels.reference import mla_decode_reference
    from mla_backend_plugin.ops.api import prepare_args
    from mla_backend_plugin.ops.registry import device_capability
    from mla_backend_plugin.ops.workspace import MLAWorkspace

    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    cc = device_capability(device)
    scale = 192 ** -0.5
    for num_heads, q_len, block_size, kv_dtype, kv_scale, seq_lens in _CASES:
        q, kv, block_table, seq = _case_inputs(device, num_heads, q_len, block_size, kv_dtype, seq_lens, gen)
        args = prepare_args(q, kv, block_table, seq, softmax_scale=scale, kv_scale=kv_scale)
        if spec.unsupported_reason(args, cc) is not None:
            continue  # e.g. fp8 on a GPU without fp8: the registry never picks the kernel for such calls
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        workspace = MLAWorkspace(device, max_batch=len(seq_lens), max_q_len=q_len, num_heads=num_heads,
                                 num_sms=4 if device.type != "cuda" else None) if spec.needs_workspace else None
        try:
            spec.launch(args, workspace)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run fails its check
            return f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ref_out, ref_lse = mla_decode_reference(args.q_nope, args.q_pe, kv, block_table, seq, q_len, scale,
                                                None, kv_scale)
        out = args.out.float()
        atol = 0.15 if kv_dtype == FP8_DTYPE else 1e-2
        label = f"{num_heads} heads, q_len {q_len}, {str(kv_dtype).replace('torch.', '')} KV"
        if not torch.isfinite(out).all():
            return f"{label}: output has NaN/inf (unwritten or overflowed elements)"
        err = (out - ref_out).abs() - 1e-2 * ref_out.abs()
        if err.max().item() > atol:
            return f"{label}: max |out - ref| exceeds tolerance by {err.max().item() - atol:.3g}"
        finite = torch.isfinite(ref_lse)
        if not torch.equal(finite, torch.isfinite(args.lse)):
            return f"{label}: LSE finite/-inf pattern differs from the reference"
        if finite.any() and (args.lse[finite] - ref_lse[finite]).abs().max().item() > 5e-2:
            return f"{label}: LSE differs from the reference"
        assert out.shape[-1] == KV_LORA_RANK
    return None


def self_check(spec, device: torch.device) -> str | None:
    """Cached ``run_self_check``; must first run outside CUDA-graph capture (it synchronises)."""
    key = (spec.name, str(device))
    if key not in _RESULTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mla_decode: kernel {spec.name!r} has not been self-checked on {device} yet and cannot be "
                "during CUDA-graph capture; run one decode call before capturing (vLLM's warm-up does)")
        _RESULTS[key] = run_self_check(spec, device)
    return _RESULTS[key]


def clear_results() -> None:
    _RESULTS.clear()
