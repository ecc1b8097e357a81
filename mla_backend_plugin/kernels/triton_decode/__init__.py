"""Triton split-KV decode + the shared combine: the fallback on every SM80+ GPU (``kernel.py``; tiles and
registry entry points in ``config.py``, ahead-of-time build in ``build.py``)."""

from mla_backend_plugin.ops.manifest import KernelManifest, lazy

_HERE = "mla_backend_plugin.kernels.triton_decode"

MANIFEST = KernelManifest(
    name="triton",
    description="Triton split-KV decode + combine (any SM80+ GPU)",
    archs=("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a"),
    verified_archs=frozenset({(9, 0)}),  # H100 (tests/test_ops_gpu.py, docs/STATUS.md)
    unsupported_reason=lazy(f"{_HERE}.config", "unsupported_reason"),
    launch=lazy(f"{_HERE}.kernel", "launch"),
    default_config=lazy(f"{_HERE}.config", "default_config"),
    configs=lazy(f"{_HERE}.config", "configs"),
    plan_tile=lazy(f"{_HERE}.config", "plan_tile"),
    combine="shared",  # kernels/combine, in the layout of the config's split plan
    compile_variants=lazy(f"{_HERE}.build", "compile_variants"),
    supports_row_kv_lens=True,
)
