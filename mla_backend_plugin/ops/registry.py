"""The one place that maps a GPU architecture to the decode kernels that may run on it.

``KERNELS`` lists every kernel this package has; ``AUTO_ORDER`` says, per compute-capability major
version, which kernels ``kernel="auto"`` tries, best first. A kernel is picked only when it supports
the GPU and the call's shapes and dtypes; otherwise the next one is tried. On an architecture outside a
kernel's ``verified_archs`` (where our GPU test suite has not run it), the kernel must first pass a
self-check against the reference (ops/selfcheck.py); one that fails is skipped with a warning.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable

import torch

from mla_backend_plugin.ops.constants import FP8_DTYPE


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    description: str
    # returns None when the kernel can run this call on this device, else the reason it cannot
    unsupported_reason: Callable[["DecodeArgs", tuple[int, int] | None], str | None]  # noqa: F821
    launch: Callable[["DecodeArgs", object], None]  # noqa: F821
    needs_workspace: bool
    # compute capabilities where the GPU test suite passed on real hardware; None = everywhere (reference)
    verified_archs: frozenset[tuple[int, int]] | None = None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def _triton_unsupported(args, cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc < (8, 0):
        return f"needs compute capability >= 8.0, device has {cc[0]}.{cc[1]}"
    if FP8_DTYPE in (args.kv_dtype, args.q_dtype) and cc < (8, 9):
        return f"fp8 needs compute capability >= 8.9, device has {cc[0]}.{cc[1]}"
    return None


def _triton_launch(args, workspace) -> None:
    from mla_backend_plugin.kernels.triton_decode.kernel import launch

    launch(args, workspace)


def _family(module: str, attr: str):
    """A kernel family's function, imported on first use so that the registry imports no kernel toolchain."""
    def call(*a):
        return getattr(importlib.import_module(f"mla_backend_plugin.kernels.{module}"), attr)(*a)
    call.__name__ = f"{module}.{attr}"
    return call


def _reference_launch(args, workspace) -> None:
    from mla_backend_plugin.kernels.reference import mla_decode_reference

    out, lse = mla_decode_reference(args.q_nope, args.q_pe, args.kv_cache, args.block_table, args.seq_lens,
                                    args.q_len, args.softmax_scale, args.q_scale, args.kv_scale)
    args.out.copy_(out)
    args.lse.copy_(lse)


KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec("triton", "Triton split-KV decode + combine (any SM80+ GPU)",
                   _triton_unsupported, _triton_launch, needs_workspace=True,
                   verified_archs=frozenset({(9, 0)})),  # H100 (tests/test_ops_gpu.py, docs/STATUS.md)
        # CuTe-DSL wgmma + TMA kernel for Hopper (kernels/cute_sm90)
        KernelSpec("cute_sm90", "CuTe-DSL SM90 decode: wgmma, TMA, warp-specialised (Hopper only)",
                   _family("cute_sm90.launch", "unsupported_reason"), _family("cute_sm90.launch", "launch"),
                   needs_workspace=True,
                   verified_archs=frozenset({(9, 0)})),  # H100: tests/test_ops_gpu.py + test_kernel_features_gpu.py

        # CUDA C++ mma.sync kernel for SM120/121, also built for sm_90a (kernels/xqa_sm120, csrc/xqa_mla)
        KernelSpec("xqa_sm120", "CUDA C++ XQA-style decode: mma.sync + TMA (SM120/121; sm_90a build for tests)",
                   _family("xqa_sm120.launch", "unsupported_reason"), _family("xqa_sm120.launch", "launch"),
                   # H100 through the sm_90a build; SM120/121 never run here, so the self-check guards them
                   needs_workspace=True, verified_archs=frozenset({(9, 0)})),
        KernelSpec("reference", "float32 torch reference (slow, host loop, not CUDA-graph safe)",
                   lambda args, cc: None, _reference_launch, needs_workspace=False),
    )
}

# kernel="auto": tried in this order per compute-capability major version (SM80/86/89, SM90, SM100/103,
# SM120/121). The reference is never chosen automatically.
# On SM90 the CuTe kernel is faster than Triton (benchmarks/NOTES.md); xqa_sm120 is not (it runs on SM90 only for
# testing). On SM120/121 xqa_sm120 is the kernel written for them (99 KB of shared memory, mma.sync); neither it
# nor Triton has run on SM120 hardware, so both pass the first-use self-check before they are used there.
AUTO_ORDER: dict[int, tuple[str, ...]] = {
    8: ("triton",),
    9: ("cute_sm90", "triton"),
    10: ("triton",),
    12: ("xqa_sm120", "triton"),
}


_WARNED: set[tuple[str, str]] = set()


def available_kernels() -> tuple[str, ...]:
    return tuple(KERNELS)


def self_check_failure(spec: KernelSpec, device: torch.device, cc: tuple[int, int] | None) -> str | None:
    """None when ``spec`` may run on this device; else why its first-use self-check failed."""
    from mla_backend_plugin.ops.selfcheck import self_check, self_check_mode

    mode = self_check_mode()
    verified = spec.verified_archs is None or (cc is not None and cc in spec.verified_archs)
    if mode == "never" or (verified and mode != "always"):
        return None
    return self_check(spec, device)


def select_kernel(args, name: str = "auto") -> KernelSpec:
    cc = device_capability(args.q_nope.device)
    if name != "auto":
        spec = KERNELS.get(name)
        if spec is None:
            raise ValueError(f"mla_decode: kernel: unknown kernel {name!r}; allowed: 'auto', "
                             + ", ".join(repr(k) for k in KERNELS))
        reason = spec.unsupported_reason(args, cc)
        if reason is not None:
            raise ValueError(f"mla_decode: kernel: {name!r} cannot run this call: {reason}")
        failure = self_check_failure(spec, args.q_nope.device, cc)
        if failure is not None:
            raise RuntimeError(f"mla_decode: kernel {name!r} failed its self-check on compute capability "
                               f"{cc}: {failure}")
        return spec
    if cc is None:
        raise ValueError(f"mla_decode: q: kernels need a CUDA device, got {args.q_nope.device} "
                         "(kernel='reference' runs anywhere)")
    order = AUTO_ORDER.get(cc[0])
    if order is None:
        raise ValueError(f"mla_decode: device: compute capability {cc[0]}.{cc[1]} has no decode kernel; "
                         f"supported majors: {sorted(AUTO_ORDER)}")
    reasons = []
    for kname in order:
        spec = KERNELS[kname]
        reason = spec.unsupported_reason(args, cc)
        if reason is None:
            failure = self_check_failure(spec, args.q_nope.device, cc)
            if failure is None:
                return spec
            if (kname, str(args.q_nope.device)) not in _WARNED:  # once per kernel and device
                _WARNED.add((kname, str(args.q_nope.device)))
                warnings.warn(f"mla_decode: kernel {kname!r} failed its self-check on compute capability {cc} "
                              f"and is skipped: {failure}", RuntimeWarning, stacklevel=3)
            reason = f"failed its self-check: {failure}"
        reasons.append(f"{kname}: {reason}")
    raise ValueError("mla_decode: no kernel supports this call: " + "; ".join(reasons))
