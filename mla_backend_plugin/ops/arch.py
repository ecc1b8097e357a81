"""The GPU architectures the package builds for: name, compute capability, shared memory per block.

The one table of arch facts; ``compile.py`` offers these names, kernel families list the ones they are built
for (``KernelManifest.archs``) and size their tiles from ``smem_per_block``.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str  # the compiler's target name, e.g. "sm_90a"
    cc: tuple[int, int]  # compute capability
    smem_per_block: int  # opt-in shared memory per block, bytes
    gpus: str  # what it stands for
    # a family target ("f"): one binary for every device of its major whose minor is listed (CUDA 12.9+);
    # () for an arch-specific target ("a") or a plain one, which serve their own compute capability only
    family_ccs: tuple[tuple[int, int], ...] = ()

    @property
    def cc_int(self) -> int:  # 90 for (9, 0): how Triton's GPUTarget names it
        return 10 * self.cc[0] + self.cc[1]


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("sm_80", (8, 0), 166_912, "A100"),
    Arch("sm_89", (8, 9), 101_376, "L4, L40S, RTX 40xx"),
    Arch("sm_90a", (9, 0), 232_448, "H100, H200"),
    Arch("sm_100a", (10, 0), 232_448, "B200, GB200"),
    Arch("sm_103a", (10, 3), 232_448, "B300, GB300"),
    # the sm_100 family: the cubin of sm_100a (byte-identical SASS for cute_sm100), loadable on sm_103 as well
    Arch("sm_100f", (10, 0), 232_448, "B200, GB200, B300, GB300", family_ccs=((10, 0), (10, 3))),
    Arch("sm_120a", (12, 0), 101_376, "RTX 50xx, RTX PRO 6000"),
    Arch("sm_121a", (12, 1), 101_376, "DGX Spark (GB10)"),
)}


def arch_for_cc(cc: tuple[int, int] | None) -> Arch | None:
    """The device's own (arch-specific) target."""
    if cc is None:
        return None
    for arch in ARCHS.values():
        if arch.cc == tuple(cc) and not arch.family_ccs:
            return arch
    return None


def runs_on(arch_name: str, cc: tuple[int, int] | None) -> bool:
    """Whether a binary built for ``arch_name`` runs on a device of compute capability ``cc``."""
    arch = ARCHS.get(arch_name)
    if arch is None or cc is None:
        return False
    return tuple(cc) in arch.family_ccs if arch.family_ccs else arch.cc == tuple(cc)


def device_capability(device) -> tuple[int, int] | None:
    """Compute capability of a torch device; None for anything that is not a CUDA device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def device_smem_per_block(device) -> int | None:
    """Opt-in shared memory per block of a CUDA device (None for other devices)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_smem_per_block(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_smem_per_block(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin
