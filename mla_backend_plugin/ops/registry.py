"""The one place that maps a GPU architecture to the decode kernels that may run on it.

``KERNELS`` holds every kernel family's manifest (``kernels/<family>/__init__.py`` exports ``MANIFEST``, or
``MANIFESTS`` when one adapter serves several kernels; the folders are found by walking ``kernels/`` on first
use, so a new family is one folder plus its entry in ``AUTO_ORDER``). ``AUTO_ORDER`` says, per
compute-capability major version, which kernels ``kernel="auto"`` tries, best first: the static choice
(``api.select_kernel`` takes the first that supports the call and passes its first-use self-check,
ops/selfcheck.py); the autotuner replaces it per shape when it has timed the candidates on this GPU
(``candidate_kernels``: what it times; ops/tuned.py: what it chose). ``kernels_for_device``, ``plan_rows_for``
and ``scratch_for`` say what a workspace made for a device must serve.

Importing this module imports no kernel family: ``KERNELS`` loads the manifests (cheap ``__init__`` modules)
the first time it is read.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Iterator, Mapping

from mla_backend_plugin import envs
from mla_backend_plugin.ops.arch import device_capability, device_smem_per_block, runs_on
from mla_backend_plugin.ops.manifest import KernelManifest

# kernel="auto": tried in this order per compute-capability major version (SM80/86/89, SM90, SM100/103,
# SM120/121). The reference is never chosen automatically.
# On SM90 the CuTe kernel is faster than Triton (docs/perf/triton.md); xqa_sm120 is not (it runs on SM90 only for
# testing). On SM100/103 two CuTe-DSL Blackwell kernels: FlashInfer's MLA decode (kernels/flashinfer; every vLLM
# 0.26 install has flashinfer-python; its authors publish B200 numbers) first where it runs, and cute_sm100 (ours,
# tcgen05 2-CTA MMA, TMEM) for what FlashInfer refuses (an fp8 cache with a 16-bit q, device-tensor scales, fp16
# output): none has run on Blackwell hardware here, so each passes the first-use self-check first, and the
# autotuner ranks them where it has timed a shape. FlashInfer's trtllm-gen kernel is a tuner candidate only (it
# downloads its cubins when they are not installed). On SM120/121 xqa_sm120 is the kernel written for them (99 KB
# of shared memory, mma.sync); neither it nor Triton has run on SM120 hardware, so both pass the first-use
# self-check before they are used there. FlashInfer's SM120 XQA MLA decode writes no LSE: a tuner candidate there
# for shapes whose calls pass return_lse=False, never auto's choice.
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


def available_kernels() -> tuple[str, ...]:
    return tuple(KERNELS)


def candidate_kernels(cc, wanted: Iterable[str] | None = None) -> list[str]:
    """The kernels the tuner times on compute capability ``cc``: the arch's AUTO_ORDER, then FlashInfer's
    trtllm-gen on SM100/103, FlashInfer's XQA MLA decode on SM120/121 (no LSE: only for calls with
    ``return_lse=False``); ``CUTE_MLA_CANDIDATES=a,b`` (or ``wanted``) replaces that list, ``+c`` entries add
    to it."""
    if cc is None:
        return []
    default = list(AUTO_ORDER.get(cc[0], ()))
    default += {10: ["flashinfer_trtllm"], 12: ["flashinfer_xqa"]}.get(cc[0], [])
    wanted = tuple(envs.CUTE_MLA_CANDIDATES if wanted is None else wanted)
    replace = [n for n in wanted if not n.startswith("+")]
    names = (replace or default) + [n[1:] for n in wanted if n.startswith("+")]
    for name in names:
        if name not in KERNELS or name == "reference":
            allowed = ", ".join(k for k in KERNELS if k != "reference")
            raise ValueError(f"CUTE_MLA_CANDIDATES: unknown kernel {name!r}; allowed: {allowed}")
    return list(dict.fromkeys(names))


def kernels_for_device(device) -> tuple[str, ...]:
    """Every kernel that may run on ``device`` (what a workspace made for it must serve): the device major's
    AUTO_ORDER, every family built for its arch and the autotuner's extra candidates (CUTE_MLA_CANDIDATES);
    every kernel for a device that is not a GPU."""
    cc = device_capability(device)
    if cc is None:
        return tuple(KERNELS)
    names = AUTO_ORDER.get(cc[0], ()) + tuple(n for n, m in KERNELS.items() if any(runs_on(a, cc) for a in m.archs))
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


def unsupported_reason(spec: KernelManifest, args, cc) -> str | None:
    """Why ``spec`` cannot run this call: what the registry checks for every family (per-row key counts, the
    LSE), then the family's own ``unsupported_reason``."""
    if getattr(args, "row_kv_lens", None) is not None and not spec.supports_row_kv_lens:
        return "does not support row_kv_lens (per-row key counts, used by decode context parallelism)"
    if getattr(args, "need_lse", True) and not spec.writes_lse:
        return ("writes no LSE and this call needs one (mla_decode's return_lse=True, the default); a caller that "
                "does not use the LSE passes return_lse=False")
    return spec.unsupported_reason(args, cc)


__all__ = ["AUTO_ORDER", "KERNELS", "available_kernels", "candidate_kernels", "device_capability",
           "kernels_for_device", "plan_rows_for", "scratch_for", "unsupported_reason"]
