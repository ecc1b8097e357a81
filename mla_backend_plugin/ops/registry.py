"""The one place that maps a GPU architecture to the decode kernels that may run on it.

``KERNELS`` holds every kernel family's manifest (``kernels/<family>/__init__.py`` exports ``MANIFEST``, or
``MANIFESTS`` when one adapter serves several kernels; the folders are found by walking ``kernels/`` on first
use, so a new family is one folder plus its entry in ``AUTO_ORDER``). ``AUTO_ORDER`` says, per
compute-capability major version, which kernels ``kernel="auto"`` tries, best first. A kernel is picked only
when it supports the GPU and the call's shapes and dtypes; otherwise the next one is tried. On an architecture
outside a kernel's ``verified_archs`` (where our GPU test suite has not run it), the kernel must first pass a
self-check against the reference (ops/selfcheck.py); one that fails is skipped with a warning. ``AUTO_ORDER``
is the static choice: the autotuner (ops/autotune.py) replaces it per shape when it has timed the candidates
on this GPU.

Importing this module imports no kernel family: ``KERNELS`` loads the manifests (cheap ``__init__`` modules)
the first time it is read.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import warnings
from collections.abc import Iterator, Mapping

import torch

from mla_backend_plugin.ops.arch import arch_for_cc, device_capability, device_smem_per_block
from mla_backend_plugin.ops.manifest import KernelManifest, LaunchConfig

logger = logging.getLogger("mla_backend_plugin")

# Kept for callers that name the manifest by its old role.
KernelSpec = KernelManifest

# kernel="auto": tried in this order per compute-capability major version (SM80/86/89, SM90, SM100/103,
# SM120/121). The reference is never chosen automatically.
# On SM90 the CuTe kernel is faster than Triton (benchmarks/NOTES.md); xqa_sm120 is not (it runs on SM90 only for
# testing). On SM100/103 two CuTe-DSL Blackwell kernels: FlashInfer's MLA decode (kernels/flashinfer; every vLLM
# 0.26 install has flashinfer-python; its authors publish B200 numbers) first where it runs, and cute_sm100 (ours,
# tcgen05 2-CTA MMA, TMEM) for what FlashInfer refuses (an fp8 cache with a 16-bit q, device-tensor scales, fp16
# output): none has run on Blackwell hardware here, so each passes the first-use self-check first, and the
# autotuner ranks them where it has timed a shape. FlashInfer's trtllm-gen kernel is a tuner candidate only (it
# downloads its cubins when they are not installed). On SM120/121 xqa_sm120 is the kernel written for them (99 KB
# of shared memory, mma.sync); neither it nor Triton has run on SM120 hardware, so both pass the first-use
# self-check before they are used there.
AUTO_ORDER: dict[int, tuple[str, ...]] = {
    8: ("triton",),
    9: ("cute_sm90", "triton"),
    10: ("flashinfer_cute_dsl", "cute_sm100", "triton"),
    12: ("xqa_sm120", "triton"),
}


def _discover() -> dict[str, KernelManifest]:
    import mla_backend_plugin.kernels as kernels_pkg

    found: dict[str, KernelManifest] = {}
    for info in sorted(pkgutil.iter_modules(kernels_pkg.__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        module = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        manifests = getattr(module, "MANIFESTS", None)
        if manifests is None:
            manifests = (module.MANIFEST,) if hasattr(module, "MANIFEST") else ()  # none: cute_common, combine
        for manifest in manifests:
            if manifest.name in found:
                raise RuntimeError(f"two kernel families are named {manifest.name!r}")
            found[manifest.name] = manifest
    order = [name for names in AUTO_ORDER.values() for name in names]
    missing = sorted(set(order) - set(found))
    if missing:
        raise RuntimeError(f"AUTO_ORDER names kernels no family declares: {missing}")
    return found


class _Manifests(Mapping):
    """name -> KernelManifest, read from the kernel folders on first access."""

    def __init__(self):
        self._loaded: dict[str, KernelManifest] | None = None

    def _all(self) -> dict[str, KernelManifest]:
        if self._loaded is None:
            self._loaded = _discover()
        return self._loaded

    def __getitem__(self, name: str) -> KernelManifest:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


KERNELS: Mapping[str, KernelManifest] = _Manifests()

_WARNED: set[tuple[str, str]] = set()
_ANNOUNCED: set[tuple[str, str]] = set()


def available_kernels() -> tuple[str, ...]:
    return tuple(KERNELS)


def kernels_for_device(device) -> tuple[str, ...]:
    """Every kernel that may run on ``device`` (what a workspace made for it must serve): the device major's
    AUTO_ORDER, every family built for its arch and the autotuner's extra candidates (CUTE_MLA_CANDIDATES);
    every kernel for a device that is not a GPU."""
    cc = device_capability(device)
    if cc is None:
        return tuple(KERNELS)
    from mla_backend_plugin.ops.autotune import candidate_kernels

    arch = arch_for_cc(cc)
    names = AUTO_ORDER.get(cc[0], ()) + tuple(n for n, m in KERNELS.items() if arch and arch.name in m.archs)
    return tuple(dict.fromkeys(names + tuple(candidate_kernels(cc))))


def plan_rows_for(num_heads: int, device) -> tuple[int, ...]:
    """The CTA row heights of every kernel that may run on ``device`` (``kernels_for_device``) with its default
    tile, so that a workspace sized for all of them serves ``kernel="auto"`` and any kernel asked for by name."""
    smem = device_smem_per_block(device)
    rows = {KERNELS[name].plan_tile(num_heads, smem, None).rows_per_cta
            for name in kernels_for_device(device) if KERNELS[name].plan_tile is not None}
    return tuple(sorted(rows)) or (64,)


def scratch_for(device, max_batch: int, max_q_len: int, num_heads: int, num_sms: int) -> dict[str, int]:
    """key -> bytes of every family scratch buffer (``KernelManifest.scratch``) a workspace for ``device`` holds."""
    cc = device_capability(device)
    need: dict[str, int] = {}
    for name in kernels_for_device(device):
        spec = KERNELS[name]
        asked = spec.scratch(cc, max_batch, max_q_len, num_heads, num_sms) if spec.scratch is not None else None
        if asked is not None:
            key, nbytes = asked
            need[key] = max(need.get(key, 0), int(nbytes))
    return need


def self_check_failure(spec: KernelManifest, device: torch.device, cc: tuple[int, int] | None) -> str | None:
    """None when ``spec`` may run on this device; else why its first-use self-check failed."""
    from mla_backend_plugin.ops.selfcheck import self_check, self_check_mode

    mode = self_check_mode()
    verified = spec.verified_archs is None or (cc is not None and cc in spec.verified_archs)
    if mode == "never" or (verified and mode != "always"):
        return None
    return self_check(spec, device)


def _announce(spec: KernelManifest, device, cc) -> None:
    key = (spec.name, str(device))
    if key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        where = f"compute capability {cc[0]}.{cc[1]}" if cc else str(device)
        logger.info("mla_decode: kernel %r on %s (%s)", spec.name, device, where)


def unsupported_reason(spec: KernelManifest, args, cc) -> str | None:
    """Why ``spec`` cannot run this call: what the registry checks for every family, then the family's own
    ``unsupported_reason``."""
    if getattr(args, "row_kv_lens", None) is not None and not spec.supports_row_kv_lens:
        return "does not support row_kv_lens (per-row key counts, used by decode context parallelism)"
    return spec.unsupported_reason(args, cc)


def select_kernel(args, name: str = "auto", self_check: bool = True) -> KernelManifest:
    """The kernel ``name`` (checked to support the call) or, for ``"auto"``, the first of the arch's AUTO_ORDER
    that supports it and passes its self-check. ``self_check=False``: no self-check run and nothing announced
    (a guess of what a later call will run, for prebuilding)."""
    cc = device_capability(args.q_nope.device)
    if name != "auto":
        spec = KERNELS.get(name)
        if spec is None:
            raise ValueError(f"mla_decode: kernel: unknown kernel {name!r}; allowed: 'auto', "
                             + ", ".join(repr(k) for k in KERNELS))
        reason = unsupported_reason(spec, args, cc)
        if reason is not None:
            raise ValueError(f"mla_decode: kernel: {name!r} cannot run this call: {reason}")
        if not self_check:
            return spec
        failure = self_check_failure(spec, args.q_nope.device, cc)
        if failure is not None:
            raise RuntimeError(f"mla_decode: kernel {name!r} failed its self-check on compute capability "
                               f"{cc}: {failure}")
        _announce(spec, args.q_nope.device, cc)
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
        reason = unsupported_reason(spec, args, cc)
        if reason is None and not self_check:
            return spec
        if reason is None:
            failure = self_check_failure(spec, args.q_nope.device, cc)
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


__all__ = ["AUTO_ORDER", "KERNELS", "KernelManifest", "KernelSpec", "LaunchConfig", "available_kernels",
           "device_capability", "kernels_for_device", "plan_rows_for", "scratch_for", "select_kernel",
           "self_check_failure", "unsupported_reason"]
