"""Ahead-of-time build of the CuTe-DSL SM90 kernel's variants with no GPU (``python -m mla_backend_plugin.compile
--arch sm_90a``): each variant is compiled for sm_90a, its cubin is inspected with cuobjdump, and a variant
fails unless the SASS holds wgmma (HGMMA; e4m3 QGMMA and no HGMMA for the fp8-wgmma design), TMA loads
(UTMALDG) for 16-bit caches and that design, no local-memory
spills (STL/LDL, non-zero stack), and no wgmma serialisation (ptxas waits after every wgmma it cannot prove
warp-group uniform). Every variant is built with PDL on and off, and exported (the cache, ``--export-dir`` or
``--into-package``) in both forms."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import tempfile
import time

from mla_backend_plugin.kernels.cute_common import sass as sass_tools
from mla_backend_plugin.kernels.cute_common.aot import build_in_pool
from mla_backend_plugin.kernels.cute_sm90 import MANIFEST
from mla_backend_plugin.kernels.cute_sm90.config import (
    FP8_SEESAW_MAX_SLACK,
    SEESAW_KV_MULTICAST_BLOCK_SIZES,
    SEESAW_L2_PREFETCH,
    SEESAW_MAX_SLACK,
    PlanVariant,
    Variant,
    multicast_fits,
    shared_bytes,
)
from mla_backend_plugin.kernels.cute_sm90.launch import AOT, STEP_PLAN
from mla_backend_plugin.ops.manifest import VariantResult


def serving_variants() -> list[Variant]:
    """What DeepSeek deployments on vLLM call: bf16 q/out, bf16 or fp8 cache (vLLM passes the fp8 scale as a
    device tensor), every head count (TP 1/2/4/8) and q_len (MTP), vLLM's default page of 64, with an fp8 cache
    both q forms (an fp8 q with a tensor scale is vLLM's default on Hopper: CUTE_MLA_FP8_QUERY); plus the other
    page sizes and fp16 at one shape each, and the per-row key-count variants of DCP with MTP and of short
    prefills at 16 and 32 heads."""
    out = [Variant(kv, q_dtype, "bf16", h, q, 64, q_dtype == "fp8", kv == "fp8", fp8_mma=kv == "fp8")
           for (kv, q_dtype), h, q in itertools.product((("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8")),
                                                        (16, 32, 64, 128), (1, 2, 3, 4))]
    out += [Variant("bf16", "bf16", "bf16", 128, 1, bs, False, False) for bs in (16, 32, 128)]
    out += [Variant("fp8", q_dtype, "bf16", 128, 2, bs, q_dtype == "fp8", True, fp8_mma=True)
            for bs in (16, 128) for q_dtype in ("bf16", "fp8")]
    out += [Variant("fp16", "fp16", "fp16", 128, 1, 64, False, False)]
    # design A of the fp8 path, the default at batch 1-2 (launch.fp8_design_for): every head count and q_len
    out += [Variant("fp8", "bf16", "bf16", h, q, 64, False, True, fp8_mma=False)
            for h, q in itertools.product((16, 32, 64, 128), (1, 2, 3, 4))]
    out += [Variant("fp8", "fp8", "bf16", 128, 1, 64, True, True, fp8_mma=False)]
    # design C (fp8 wgmma on the seesaw, an fp8 q only), auto's choice from batch 6 (launch.fp8_design_for): every
    # head count at q_len 1 (a deployment's decode shape) and 2 (MTP with one draft token, DeepSeek's own); q_len 3-4
    # compile on first use (~11-20 s each on CI's cores, where the whole every-variant compile is the longest phase:
    # 22 shapes put CI at 30.5 min; vLLM installs the DSL)
    out += [Variant("fp8", "fp8", "bf16", h, q, 64, True, True, fp8_mma=True, fp8_seesaw=True,
                    max_slack=FP8_SEESAW_MAX_SLACK) for h in (16, 32, 64, 128) for q in (1, 2)]
    # the lock-step schedule of 16-bit caches (CUTE_MLA_SM90_SCHEDULE=lockstep) at one shape: its code is design A's
    out += [Variant("bf16", "bf16", "bf16", 128, 1, 64, False, False, schedule="lockstep")]
    # per-row key counts: decode context parallelism with MTP, 128 heads per kernel call (e.g. TP8 x DCP8), and
    # vLLM's short prefills as token requests of 4 tokens at 16 heads (TP8) and 2 at 32 (ops/serving.py)
    rows = (("bf16", "bf16", False), ("fp8", "bf16", True), ("fp8", "bf16", False), ("fp8", "fp8", True))
    out += [Variant(kv, q_dtype, "bf16", h, q, 64, q_dtype == "fp8", kv == "fp8", fp8_mma=mma, row_kv_lens=True)
            for (kv, q_dtype, mma), (h, q) in itertools.product(rows, ((128, 2), (128, 4), (16, 4), (32, 2)))]
    # the 16-bit seesaw with the L2 prefetch distance a default config runs (launch.l2_prefetch_for)
    out = [dataclasses.replace(v, l2_prefetch=SEESAW_L2_PREFETCH, max_slack=SEESAW_MAX_SLACK)
           if v.kv_dtype != "fp8" and v.schedule == "seesaw" else v for v in out]
    # and, where its m-blocks pair up at a page size the default multicasts, its KV-multicast twin: what the same
    # shape runs in split grids too large to run at once (launch.kv_multicast_for; ~10 s each on CI's cores)
    return out + [dataclasses.replace(v, kv_multicast=True) for v in out
                  if multicast_fits(v) and v.block_size in SEESAW_KV_MULTICAST_BLOCK_SIZES]


def builds() -> list[Variant | PlanVariant]:
    """What the family exports (cache, ``--into-package``) and CI checks: every serving variant and the step-plan
    kernel they all read their work items from."""
    return serving_variants() + [STEP_PLAN]


def kernel_class(variant: Variant | PlanVariant) -> tuple:
    """The kernel ``launch.compile_variant`` instantiates for a variant (design B's fp8 wgmma, design A's widened
    tiles, or a 16-bit schedule; the step plan), with the dtypes and per-row key counts it is specialised on."""
    if isinstance(variant, PlanVariant):
        return ("step plan",)
    kernel = ("fp8seesaw" if variant.fp8_seesaw else "fp8mma" if variant.fp8_mma else "dequant"
              if variant.kv_dtype == "fp8" else variant.schedule)
    return kernel, variant.q_dtype, variant.kv_dtype, variant.row_kv_lens


def _cuobjdump() -> str:
    return sass_tools.find_cuobjdump()


def inspect_cubin(path: str) -> dict:
    """Registers, stack/local bytes and counts of the SASS instructions CI checks, from cuobjdump."""
    tool = _cuobjdump()
    usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    num = lambda key: int(m.group(1)) if (m := re.search(rf"{key}:(\d+)", usage)) else None  # noqa: E731
    return dict(registers=num("REG"), stack=num("STACK"), local=num("LOCAL"), shared_static=num("SHARED"),
                hgmma=len(re.findall(r"\bHGMMA\.", sass)), qgmma=len(re.findall(r"\bQGMMA\.", sass)),
                utmaldg=len(re.findall(r"\bUTMALDG", sass)), ublkpf=len(re.findall(r"\bUBLKPF", sass)),
                utmaldg_multicast=len(re.findall(r"\bUTMALDG\.\w+\.MULTICAST", sass)),
                ldsm_t=len(re.findall(r"\bLDSM\.16\.MT88", sass)),
                wgmma_waits=len(re.findall(r"\bWARPGROUP\.DEPBAR", sass)),
                spill_ops=len(re.findall(r"\b(?:STL|LDL)\b", sass)))


def _build_one(variant: Variant | PlanVariant, arch: str, use_pdl: bool = True):
    from mla_backend_plugin.kernels.cute_sm90.launch import compile_variant

    t0 = time.time()
    name = variant.name + ("" if use_pdl else " pdl=off")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            compiled = compile_variant(variant, use_pdl=use_pdl, arch=arch, keep_dir=tmp)
            path = sass_tools.write_cubin(compiled, tmp)
            info = inspect_cubin(path)
            AOT.export_for_build(compiled, variant, use_pdl, arch)
        except Exception as e:  # noqa: BLE001 - reported per variant; the command fails
            return VariantResult(name, False, seconds=time.time() - t0, error=str(e).strip().splitlines()[-1])
    spills = (info["stack"] or 0) + (info["local"] or 0)
    problems = sass_problems(variant, info)
    smem = 0 if isinstance(variant, PlanVariant) else shared_bytes(variant)
    return VariantResult(name, not problems, info["registers"], smem, spills, time.time() - t0,
                         error="; ".join(problems))


def sass_problems(variant: Variant | PlanVariant, info: dict) -> list[str]:
    """What CI refuses in a variant's SASS (``inspect_cubin``'s counts); empty when it passes."""
    spills = (info["stack"] or 0) + (info["local"] or 0)
    problems = []
    if isinstance(variant, PlanVariant):  # integer work only: no matrix units, no TMA
        if spills or info["spill_ops"]:
            problems.append(f"spills: stack {info['stack']} B, local {info['local']} B, {info['spill_ops']} STL/LDL")
        return problems
    if variant.fp8_seesaw and info["ldsm_t"] == 0:  # design C: V^T fragments by ldmatrix.trans
        problems.append("no LDSM.16.MT88 (ldmatrix.trans) in the SASS")
    if variant.fp8_mma:  # designs B and C: both products as e4m3 wgmma, nothing in 16 bits
        if info["qgmma"] == 0 or info["hgmma"]:
            problems.append(f"fp8 wgmma expected: {info['qgmma']} QGMMA, {info['hgmma']} HGMMA in the SASS")
    elif info["hgmma"] == 0:
        problems.append("no HGMMA (wgmma) in the SASS")
    # ptxas serialises every wgmma it cannot prove warp-group uniform (C7518: a wait after each instruction);
    # the kernels wait a handful of times per tile, so more waits than a quarter of the wgmmas means that
    if 4 * info["wgmma_waits"] > info["hgmma"] + info["qgmma"]:
        problems.append(f"wgmma serialised: {info['wgmma_waits']} WARPGROUP.DEPBAR for "
                        f"{info['hgmma'] + info['qgmma']} wgmma")
    if variant.l2_prefetch and info["ublkpf"] == 0:  # the seesaw producer's L2 prefetch of pairs ahead
        problems.append("no UBLKPF (cp.async.bulk.prefetch.L2) in the SASS of an l2_prefetch variant")
    if variant.kv_multicast and info["utmaldg_multicast"] == 0:  # the seesaw's KV tiles shared over a cluster
        problems.append("no UTMALDG.*.MULTICAST (TMA multicast) in the SASS of a kv_multicast variant")
    if (variant.kv_dtype != "fp8" or variant.fp8_mma) and info["utmaldg"] == 0:
        problems.append("no UTMALDG (TMA load) in the SASS")
    if spills or info["spill_ops"]:
        problems.append(f"spills: stack {info['stack']} B, local {info['local']} B, {info['spill_ops']} STL/LDL")
    return problems


def compile_variants(arch: str, variants: list[Variant] | None = None, jobs: int | None = None,
                     one_per_class: bool = False):
    """Every variant for ``arch`` with PDL on, exported (cute_common/aot.py ``build_in_pool``); ``one_per_class``:
    the first variant of each ``kernel_class`` and the PDL-off path once."""
    if arch not in MANIFEST.archs:
        raise ValueError(f"cute_sm90 is built for {MANIFEST.archs}, not {arch!r}")
    variants = builds() if variants is None else variants
    return build_in_pool(_build_one, variants, arch, jobs, kernel_class, one_per_class)
