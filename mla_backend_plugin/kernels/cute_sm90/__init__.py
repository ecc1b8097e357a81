"""CuTe-DSL MLA decode for Hopper (sm_90a): TMA + wgmma, warp-specialised, split-KV on the balanced plan.

``kernel_seesaw.py`` (16-bit caches, the default: the two consumer warp groups alternate tiles, the producer
prefetches the next tile pair into L2), ``kernel.py`` (the lock-step schedule: fp8 caches widened to 16 bits, design
A, and 16-bit caches with ``LaunchConfig.schedule="lockstep"``), ``kernel_fp8mma.py`` (fp8 wgmma on fp8 caches:
design B), ``kernel_fp8seesaw.py`` (design C, ``fp8_design="fp8seesaw"`` only: fp8 wgmma on the seesaw, O^T = V^T
P^T; index arithmetic in ``fp8seesaw_layout.py``), ``config.py`` (tile, budgets, variant key), ``launch.py``
(registry entry points, compile cache, launch), ``build.py`` (ahead-of-time build with SASS checks). Shared CuTe
pieces: kernels/cute_common.
"""

from mla_backend_plugin.ops.manifest import KernelManifest, lazy

_HERE = "mla_backend_plugin.kernels.cute_sm90"

MANIFEST = KernelManifest(
    name="cute_sm90",
    description="CuTe-DSL SM90 decode: wgmma, TMA, warp-specialised (Hopper only)",
    archs=("sm_90a",),
    verified_archs=frozenset({(9, 0)}),  # H100: tests/test_ops_gpu.py + test_kernel_features_gpu.py
    unsupported_reason=lazy(f"{_HERE}.launch", "unsupported_reason"),
    launch=lazy(f"{_HERE}.launch", "launch"),
    default_config=lazy(f"{_HERE}.launch", "default_config"),
    configs=lazy(f"{_HERE}.launch", "configs"),
    plan_tile=lazy(f"{_HERE}.launch", "plan_tile"),
    combine="shared",  # balanced layout (kernels/combine)
    compile_variants=lazy(f"{_HERE}.build", "compile_variants"),
    prebuild=lazy(f"{_HERE}.launch", "prebuild"),
    scratch=lazy(f"{_HERE}.launch", "scratch"),  # the fused combine's counters
    supports_row_kv_lens=True,
)
