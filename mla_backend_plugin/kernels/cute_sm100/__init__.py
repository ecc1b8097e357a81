"""CuTe-DSL MLA decode for Blackwell (sm_100f: B200 and B300): tcgen05 2-CTA MMA, accumulators in tensor memory, TMA
paging, warp-specialised, split-KV on the balanced plan with the shared combine.

``kernel.py`` (the kernel: 16-bit caches on kind::f16, fp8 caches on kind::f8f6f4 with q as e4m3 hi + lo or an
fp8 q), ``config.py`` (tile, budgets, variant key; no cutlass), ``launch.py`` (registry entry points, compile cache,
launch), ``build.py`` (ahead-of-time build with SASS checks). Design: docs/design/sm100_cute_mla.md.

Never run on Blackwell hardware: ``verified_archs`` is empty, so ``auto`` uses it only after the first-use
self-check (ops/selfcheck.py) passes on the device.
"""

from mla_backend_plugin.ops.manifest import KernelManifest, lazy

_HERE = "mla_backend_plugin.kernels.cute_sm100"

MANIFEST = KernelManifest(
    name="cute_sm100",
    description="CuTe-DSL SM100 decode: tcgen05 2-CTA MMA, TMEM, TMA, warp-specialised (Blackwell B200/B300)",
    archs=("sm_100f",),  # one family binary for sm_100 and sm_103 (launch.py ARCH)
    verified_archs=frozenset(),  # compiled and SASS-checked only; never run on an SM100 GPU
    unsupported_reason=lazy(f"{_HERE}.launch", "unsupported_reason"),
    launch=lazy(f"{_HERE}.launch", "launch"),
    default_config=lazy(f"{_HERE}.launch", "default_config"),
    configs=lazy(f"{_HERE}.launch", "configs"),
    plan_tile=lazy(f"{_HERE}.launch", "plan_tile"),
    combine="shared",  # balanced layout (kernels/combine)
    compile_variants=lazy(f"{_HERE}.build", "compile_variants"),
    prebuild=lazy(f"{_HERE}.launch", "prebuild"),
)
