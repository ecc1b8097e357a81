"""Ahead-of-time build of the CuTe-DSL SM100 kernel's variants with no GPU (``python -m mla_backend_plugin.compile
--arch sm_100f``).

Each variant is compiled for the arch (``--gpu-arch``), its cubin is disassembled (cute_common/sass.py: an
nvdisasm that decodes the arch, cuobjdump for the resource usage), and the variant fails unless:

* its SASS holds the 2-CTA tensor-core MMA of its kind: UTCHMMA (kind::f16) for 16-bit caches, UTCQMMA
  (kind::f8f6f4) and no UTCHMMA for fp8 caches;
* it reads TMEM (LDTM) and loads the cache with TMA (UTMALDG);
* with PDL on, ``griddepcontrol.wait`` (ACQBULK) comes before its first global or TMA load;
* it uses no local memory and no stack (no spills: STL/LDL).

Every variant is built with PDL on and off. With ``--export-dir`` / ``--into-package`` (or CUTE_MLA_CUTE_CACHE
set) each is also exported to the relocatable kernel cache or the package (cute_common/aot.py), so an SM100 host
can run them without compiling.
"""

from __future__ import annotations

import itertools
import tempfile
import time

from mla_backend_plugin.kernels.cute_common import sass
from mla_backend_plugin.kernels.cute_common.aot import build_in_pool
from mla_backend_plugin.kernels.cute_sm100 import MANIFEST
from mla_backend_plugin.kernels.cute_sm100.config import Variant, shared_bytes
from mla_backend_plugin.ops.manifest import VariantResult

# global and TMA loads (generic LD included: a generic load may read global memory)
GLOBAL_LOAD = r"(?:LDG|LD|UTMALDG|LDGSTS|ATOMG|REDG)\b"


def serving_variants() -> list[Variant]:
    """What DeepSeek deployments on vLLM call: bf16 q/out, a bf16 or fp8 cache (vLLM passes the fp8 scale as a
    device tensor), every head count (TP 1/2/4/8) and q_len (MTP) at vLLM's default page of 64; plus the other
    page sizes at one shape (they change the TMA boxes and the V tail) and the fp8-q path (one product). 36
    variants, ~15 s each on one CI core (the list is what issue 13 asks; CI compiles it for two archs under two
    DSL versions)."""
    out = [Variant(kv, "bf16", "bf16", h, q, 64, False, kv == "fp8")
           for kv, h, q in itertools.product(("bf16", "fp8"), (16, 32, 64, 128), (1, 2, 3, 4))]
    out += [Variant("bf16", "bf16", "bf16", 128, 1, bs, False, False) for bs in (16, 32, 128)]
    out += [Variant("fp8", "fp8", "bf16", 128, 1, 64, True, True)]
    return out


def builds() -> list[Variant]:
    """What the family exports and CI checks: its serving variants (the split kernels plan in-kernel here)."""
    return serving_variants()


def kernel_class(variant: Variant) -> tuple:
    """One kernel serves every variant; its MMA kind (kind::f16 or kind::f8f6f4) and Q path (one product, or a
    16-bit q as e4m3 hi + lo) follow the dtypes."""
    return variant.q_dtype, variant.kv_dtype


def check_sass(variant: Variant, text: str, usage: dict, use_pdl: bool = True) -> list[str]:
    """What is wrong with a variant's SASS (empty when it passes); ``usage`` from sass.resource_usage."""
    problems = []
    hmma, qmma = sass.count(text, r"UTCHMMA\b"), sass.count(text, r"UTCQMMA\b")
    if variant.fp8:
        if qmma == 0 or hmma:
            problems.append(f"fp8 MMA expected: {qmma} UTCQMMA, {hmma} UTCHMMA in the SASS")
    elif hmma == 0 or qmma:
        problems.append(f"16-bit MMA expected: {hmma} UTCHMMA, {qmma} UTCQMMA in the SASS")
    if sass.count(text, r"LDTM\b") == 0:
        problems.append("no LDTM (tensor-memory load) in the SASS")
    if sass.count(text, r"UTMALDG\b") == 0:
        problems.append("no UTMALDG (TMA load) in the SASS")
    if use_pdl:
        wait = sass.first_line(text, r"ACQBULK\b")
        load = sass.first_line(text, GLOBAL_LOAD)
        if wait is None:
            problems.append("PDL on but no ACQBULK (griddepcontrol.wait) in the SASS")
        elif load is not None and load < wait:
            problems.append(f"a global/TMA load (SASS line {load}) precedes griddepcontrol.wait (line {wait})")
    spill_ops = sass.count(text, r"(?:STL|LDL)\b")
    if usage.get("stack") or usage.get("local") or spill_ops:
        problems.append(f"spills: stack {usage.get('stack')} B, local {usage.get('local')} B, {spill_ops} STL/LDL")
    return problems


def build_one(variant: Variant, arch: str, use_pdl: bool = True) -> VariantResult:
    from mla_backend_plugin.kernels.cute_sm100.launch import AOT, compile_variant

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            compiled = compile_variant(variant, use_pdl=use_pdl, arch=arch, keep_dir=tmp)
            path = sass.write_cubin(compiled, tmp)
            usage = sass.resource_usage(path)
            text, _ = sass.disassemble(path)
            AOT.export_for_build(compiled, variant, use_pdl, arch)
        except Exception as e:  # noqa: BLE001 - reported per variant; the command fails
            return VariantResult(variant.name, False, seconds=time.time() - t0, error=str(e).strip().splitlines()[-1])
    problems = check_sass(variant, text, usage, use_pdl)
    spills = (usage.get("stack") or 0) + (usage.get("local") or 0)
    return VariantResult(variant.name + ("" if use_pdl else " pdl=off"), not problems, usage.get("registers"),
                         shared_bytes(variant), spills,
                         time.time() - t0, error="; ".join(problems))


def compile_variants(arch: str, variants: list[Variant] | None = None, jobs: int | None = None,
                     one_per_class: bool = False):
    """Every variant for ``arch`` with PDL on, exported (cute_common/aot.py ``build_in_pool``); ``one_per_class``:
    the first variant of each ``kernel_class`` and the PDL-off path once."""
    if arch not in MANIFEST.archs:
        raise ValueError(f"cute_sm100 is built for {MANIFEST.archs}, not {arch!r}")
    variants = builds() if variants is None else variants
    return build_in_pool(build_one, variants, arch, jobs, kernel_class, one_per_class)
