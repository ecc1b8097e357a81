"""Ahead-of-time compilation of every decode kernel variant for one GPU architecture, with no GPU needed.

    python -m mla_backend_plugin.compile --arch sm_90a
    python -m mla_backend_plugin.compile --arch sm_120a --kernels triton
    python -m mla_backend_plugin.compile --arch sm_90a --kernels cute_sm90 --into-package   # then build the wheel
    python -m mla_backend_plugin.compile --arch sm_100f --kernels cute_sm100 --one-per-class   # another DSL version

Builds every kernel family whose manifest (``kernels/<family>/__init__.py``) lists the arch, through the
family's own ``compile_variants``, which also runs its SASS checks (matrix instructions, TMA, spills). Prints
one row per variant (name, registers, shared memory, spill bytes, seconds) and exits non-zero if any variant
fails. CI runs it for every architecture a kernel claims, and with ``--one-per-class`` (one variant of each
kernel class, PDL on) against the newer CuTe-DSL release that later vLLM versions pin.
"""

from __future__ import annotations

import argparse
import os
import sys

from mla_backend_plugin import envs
from mla_backend_plugin.ops.arch import ARCHS
from mla_backend_plugin.ops.manifest import VariantResult
from mla_backend_plugin.ops.registry import KERNELS

__all__ = ["VariantResult", "families", "main"]


def families() -> dict[str, tuple[tuple[str, ...], object]]:
    """kernel family -> (archs it is built for, its compile_variants(arch))."""
    return {m.name: (m.archs, m.compile_variants) for m in KERNELS.values() if m.compile_variants is not None}


def main(argv: list[str] | None = None) -> int:
    fams = families()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="target architecture")
    parser.add_argument("--kernels", default="all", help="comma-separated kernel families, or all "
                        f"(families: {', '.join(fams)})")
    parser.add_argument("--export-dir", metavar="DIR", help="export the CuTe-DSL variants as prebuilt TVM-FFI "
                        "libraries into DIR (a relocatable cache: copy it to a GPU host and point "
                        "CUTE_MLA_CUTE_CACHE at it; it needs no nvidia-cutlass-dsl there)")
    parser.add_argument("--into-package", action="store_true", help="export them into the package itself "
                        "(mla_backend_plugin/kernels/prebuilt, shipped by a wheel built afterwards: an engine "
                        "then loads them instead of compiling at its first start)")
    parser.add_argument("--one-per-class", action="store_true", help="build one variant of each kernel class "
                        "(the kernel it instantiates, its dtypes and specialisations; PDL on) instead of every "
                        "variant: a check that another toolchain version compiles every class")
    args = parser.parse_args(argv)
    if args.into_package:
        if args.export_dir:
            parser.error("--into-package and --export-dir name two destinations; give one")
        from mla_backend_plugin.kernels.cute_common.aot import PACKAGED_ROOT

        args.export_dir = PACKAGED_ROOT
    if args.export_dir:  # read by kernels/cute_common/aot.py, here and in the build's worker processes
        os.environ[envs.VARIABLES["CUTE_MLA_CUTE_CACHE"].name] = os.path.abspath(args.export_dir)
    selected = list(fams) if args.kernels == "all" else args.kernels.split(",")
    unknown = [f for f in selected if f not in fams]
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; allowed: {', '.join(fams)} or all")
    failed = 0
    print(f"{'variant':48s} {'arch':8s} {'regs':>5s} {'smem':>8s} {'spills':>7s} {'s':>6s}")
    for family in selected:
        archs, build = fams[family]
        if args.arch not in archs:
            print(f"{family}: not built for {args.arch} (built for {', '.join(archs)})")
            continue
        for r in build(args.arch, one_per_class=args.one_per_class):
            if r.ok:
                print(f"{r.name:48s} {args.arch:8s} {r.registers or '?':>5} {r.shared_bytes:>8d} "
                      f"{r.spill_bytes if r.spill_bytes is not None else '?':>7} {r.seconds:6.1f}")
            else:
                failed += 1
                print(f"{r.name:48s} {args.arch:8s} FAILED: {r.error}")
    print(f"{'FAILED' if failed else 'OK'}: {failed} variant(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
