"""XQA-style MLA decode in CUDA C++ (csrc/xqa_mla): mma.sync + TMA, for SM120/SM121, also built for sm_90a.

``build.py`` compiles the sources with nvcc into a cached cubin per architecture; ``cuda_driver.py`` loads it
through the CUDA driver API (ctypes, no torch C++ extension); ``launch.py`` holds the registry entry points.
Nothing here imports a GPU toolchain at import time.
"""

from mla_backend_plugin.ops.manifest import KernelManifest, lazy

_HERE = "mla_backend_plugin.kernels.xqa_sm120"

MANIFEST = KernelManifest(
    name="xqa_sm120",
    description="CUDA C++ XQA-style decode: mma.sync + TMA (SM120/121; sm_90a build for tests)",
    archs=("sm_90a", "sm_120a", "sm_121a"),
    # H100 through the sm_90a build; SM120/121 never run here, so the self-check guards them
    verified_archs=frozenset({(9, 0)}),
    unsupported_reason=lazy(f"{_HERE}.launch", "unsupported_reason"),
    launch=lazy(f"{_HERE}.launch", "launch"),
    default_config=lazy(f"{_HERE}.launch", "default_config"),
    configs=lazy(f"{_HERE}.launch", "configs"),
    plan_tile=lazy(f"{_HERE}.launch", "plan_tile"),
    combine="own",  # its own combine kernel, uniform-plan layout (csrc/xqa_mla)
    compile_variants=lazy(f"{_HERE}.build", "compile_variants"),
    supports_row_kv_lens=True,
)
