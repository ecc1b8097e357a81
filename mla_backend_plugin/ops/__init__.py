"""Kernel API of the plugin: ``mla_decode`` plus its workspace, launch configs and kernel registry.

Nothing here touches CUDA or imports a kernel family at import time.
"""

from mla_backend_plugin.ops.api import DecodeArgs, mla_decode, prepare_args
from mla_backend_plugin.ops.manifest import KernelManifest, LaunchConfig, PlanTile
from mla_backend_plugin.ops.registry import AUTO_ORDER, KERNELS, available_kernels, select_kernel
from mla_backend_plugin.ops.workspace import MLAWorkspace, plan_splits

__all__ = [
    "AUTO_ORDER",
    "DecodeArgs",
    "KERNELS",
    "KernelManifest",
    "LaunchConfig",
    "MLAWorkspace",
    "PlanTile",
    "available_kernels",
    "mla_decode",
    "plan_splits",
    "prepare_args",
    "select_kernel",
]
