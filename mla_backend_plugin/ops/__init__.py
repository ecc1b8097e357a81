"""Kernel API of the plugin: ``mla_decode`` plus its workspace, launch configs and kernel registry.

The ground floor of the package: its modules import nothing above ``ops/`` (no kernel family, no ``testing/``,
no integration; the registry only walks ``kernels/`` for the families' manifests) and form a stack, each
importing only those below it (tests/test_import_layers.py checks both):

    constants, arch, files, manifest, timing   facts, the fingerprint of sources, the timing core
    plan                                       the split planner (SplitPlan, schedules, combine tiles)
    registry                                   arch -> kernels, tuner candidates, what a workspace must serve
    workspace                                  the buffers (MLAWorkspace, StepPlans)
    args                                       a call's validated inputs (prepare_args, DecodeArgs, DcpLayout)
    inputs, tolerances                         decode inputs and the comparison against the reference
    selfcheck                                  the first-use self-check of unverified kernels
    tuned                                      the tuned-choice table and the tuning cache
    api                                        mla_decode: validate, decide (tuned -> arch table), launch
    autotune                                   the tuner: timing candidates, deployments
    serving                                    the engine-neutral half of a serving backend

Nothing here touches CUDA or imports a kernel family at import time.
"""

from mla_backend_plugin.ops.api import DcpLayout, DecodeArgs, mla_decode, prepare_args, select_kernel
from mla_backend_plugin.ops.manifest import KernelManifest, LaunchConfig, PlanTile
from mla_backend_plugin.ops.plan import plan_splits
from mla_backend_plugin.ops.registry import AUTO_ORDER, KERNELS, available_kernels
from mla_backend_plugin.ops.workspace import MLAWorkspace

__all__ = [
    "AUTO_ORDER",
    "DcpLayout",
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
