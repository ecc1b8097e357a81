"""First-use self-check of a kernel on an architecture where it was never verified on hardware, and the gate
every kernel choice passes (``self_check_failure``).

Our GPU test suite runs on Hopper only. A kernel compiled for another architecture (SM80/89, SM100, SM120)
is therefore checked, the first time it is about to run on such a GPU, against the float32 reference on a few
small random decode problems (paged, ragged, q_len > 1, NaN in the slots no request may read, fp8 with a
non-unit scale where supported; ``out`` alone for a kernel that writes no LSE), with the inputs and tolerances
the test suite uses (ops/inputs.py, ops/tolerances.py); a kernel that supports none of the cases fails (nothing
was checked). The result is cached per (kernel, device) for the life of the process; the arch table's
choice (``api.select_kernel``), the tuned table (ops/tuned.py) and the tuner skip a kernel that fails.

``CUTE_MLA_SELF_CHECK=always`` checks on verified architectures too; ``=never`` disables the check.
"""

from __future__ import annotations

import torch

from mla_backend_plugin import envs
from mla_backend_plugin.ops import registry
from mla_backend_plugin.ops.args import prepare_args
from mla_backend_plugin.ops.constants import FP8_DTYPE
from mla_backend_plugin.ops.inputs import make_decode_inputs
from mla_backend_plugin.ops.tolerances import compare_decode
from mla_backend_plugin.ops.workspace import MLAWorkspace, capturing

SELF_CHECK_ENV_VAR = "CUTE_MLA_SELF_CHECK"

# (kernel name, device) -> None when the kernel passed, else why it failed
_RESULTS: dict[tuple[str, str], str | None] = {}

# (num_heads, q_len, block_size, kv dtype, kv scale, q form, seq_lens): lengths not multiples of a page or tile,
# one shorter than q_len (a padded request), and one long enough to be split. The fp8-q case is the one FlashInfer's
# kernels take with an fp8 cache (q in the cache's dtype); kernels that refuse a case skip it.
_CASES = (
    (128, 2, 64, torch.bfloat16, None, "cat", (1, 77, 300, 1500)),
    (16, 1, 16, FP8_DTYPE, 2.0, "cat", (5, 190, 1025)),
    (128, 1, 32, FP8_DTYPE, 2.0, "fp8", (3, 130, 700)),
    (128, 1, 64, torch.bfloat16, None, "cat", (2, 129, 900)),  # what q_len-1-only kernels take (FlashInfer's XQA)
)


def self_check_mode() -> str:
    return envs.get(SELF_CHECK_ENV_VAR)


def run_self_check(spec, device: torch.device) -> str | None:
    """Run ``spec`` on the self-check cases; None when every output matches the reference, else the reason."""
    cc = registry.device_capability(device)
    ran = 0
    for i, (num_heads, q_len, block_size, kv_dtype, kv_scale, q_form, seq_lens) in enumerate(_CASES):
        inputs = make_decode_inputs(len(seq_lens), list(seq_lens), q_len, num_heads, block_size, kv_dtype, q_form,
                                    device, seed=1234 + i, kv_scale=kv_scale, poison="nan",
                                    q_scale=0.5 if q_form == "fp8" else None)
        args = prepare_args(*inputs.call_args(), softmax_scale=inputs.softmax_scale, out_dtype=inputs.out_dtype,
                            **inputs.scale_kwargs(), need_lse=spec.writes_lse)
        if spec.unsupported_reason(args, cc) is not None:
            continue  # e.g. fp8 on a GPU without fp8: the registry never picks the kernel for such calls
        ran += 1
        args.out.fill_(float("nan"))
        args.lse.fill_(float("nan"))
        workspace = MLAWorkspace(device, max_batch=len(seq_lens), max_q_len=q_len, num_heads=num_heads,
                                 num_sms=4 if device.type != "cuda" else None) if spec.needs_workspace else None
        try:
            spec.launch(args, workspace, spec.default_config(args, cc))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run fails its check
            return f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        ref_out, ref_lse = inputs.reference()
        result = compare_decode(args.out, args.lse if spec.writes_lse else None, ref_out, ref_lse, kv_dtype)
        if not result.ok:
            label = (f"{num_heads} heads, q_len {q_len}, {str(kv_dtype).replace('torch.', '')} KV"
                     + (", fp8 q" if q_form == "fp8" else ""))
            return f"{label}: {result.problems[0]}"
    if not ran:
        return "none of the self-check cases is a call it supports, so nothing could be checked"
    return None


def self_check_failure(spec, device: torch.device, cc: tuple[int, int] | None) -> str | None:
    """None when ``spec`` may run on this device; else why its first-use self-check failed (``self_check`` on an
    arch outside the kernel's ``verified_archs``, or on every arch with ``CUTE_MLA_SELF_CHECK=always``)."""
    mode = self_check_mode()
    verified = spec.verified_archs is None or (cc is not None and cc in spec.verified_archs)
    if mode == "never" or (verified and mode != "always"):
        return None
    return self_check(spec, device)


def self_check(spec, device: torch.device) -> str | None:
    """Cached ``run_self_check``; must first run outside CUDA-graph capture (it synchronises)."""
    key = (spec.name, str(device))
    if key not in _RESULTS:
        if capturing(device):
            raise RuntimeError(
                f"mla_decode: kernel {spec.name!r} has not been self-checked on {device} yet and cannot be "
                "during CUDA-graph capture; run one decode call before capturing (vLLM's warm-up does)")
        _RESULTS[key] = run_self_check(spec, device)
    return _RESULTS[key]


def clear_results() -> None:
    _RESULTS.clear()
