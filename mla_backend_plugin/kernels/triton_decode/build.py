"""Ahead-of-time build of the Triton decode kernels and the shared combine for one architecture, with no GPU
(``python -m mla_backend_plugin.compile --arch sm_80``): each variant is compiled by Triton for the arch's
compute capability, its PTX is assembled again by ptxas -v for registers and spills, and a variant fails when
its shared memory exceeds what a block gets on that arch."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time

from mla_backend_plugin.ops.arch import ARCHS
from mla_backend_plugin.ops.manifest import VariantResult, first_of_each_class

# the balanced grid with its one-wave search compiled in (batch < WORK), the larger of its two forms
BALANCED_CONSTEXPRS = {"WORK": 66, "SCAN": 128, "ONE_WAVE": True}


def _find_ptxas() -> str:
    """Triton's bundled ptxas (it matches the PTX Triton emits), else the CUDA toolkit's."""
    import triton.backends.nvidia as nvidia_backend

    bundled = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "ptxas")
    found = bundled if os.path.exists(bundled) else shutil.which("ptxas")
    if found is None:
        raise RuntimeError("no ptxas found (neither Triton's bundled one nor one on PATH)")
    return found


def ptxas_report(ptx: str, gpu_name: str) -> tuple[int | None, int | None]:
    """(registers, spill store + load bytes) of the PTX's kernel, from ptxas -v."""
    ptxas = _find_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={gpu_name}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
    return (int(regs.group(1)) if regs else None, sum(int(s) for s in spills) if spills else None)


def triton_split_spec(cfg, num_heads: int, q_len: int, kv_name: str, splits: int, cc: int = 90,
                      row_kv_lens: bool = False):
    """(signature pointers, constexprs, options) of one Triton split-kernel build (``row_kv_lens``: the variant
    that reads per-row key counts, decode context parallelism)."""
    import triton.language as tl

    from mla_backend_plugin.kernels.triton_decode.config import compiler_options
    from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_ROPE_HEAD_DIM

    constexprs = dict(NUM_HEADS=num_heads, Q_LEN=q_len, PAGE_SIZE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      NUM_SPLITS=splits, MIN_CHUNK=128, Q_SCALE_IS_PTR=False, KV_SCALE_IS_PTR=kv_name == "fp8",
                      D_NOPE=KV_LORA_RANK, D_PE=QK_ROPE_HEAD_DIM, COMPUTE_DTYPE=tl.bfloat16,
                      HAS_ROW_KV_LENS=row_kv_lens)
    pointers = dict(q_nope_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*fp8e4nv" if kv_name == "fp8" else "*bf16",
                    block_table_ptr="*i32", seq_lens_ptr="*i32", row_kv_lens_ptr="*i32", out_ptr="*bf16",
                    lse_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32", q_scale_ptr="*fp32",
                    kv_scale_ptr="*fp32", q_scale_val="fp32", kv_scale_val="fp32", sm_scale="fp32")
    return pointers, constexprs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **compiler_options(cc))


def triton_variants(cc: int):
    """(name, jit function, signature, constexprs, options) of every Triton decode variant worth building."""
    from mla_backend_plugin.kernels.combine import kernel as combine
    from mla_backend_plugin.kernels.triton_decode import kernel as k
    from mla_backend_plugin.kernels.triton_decode.config import config_for
    from mla_backend_plugin.ops.constants import KV_LORA_RANK

    smem = next(a.smem_per_block for a in ARCHS.values() if a.cc_int == cc)
    kv_names = ["bf16"] + (["fp8"] if cc >= 89 else [])
    for num_heads, q_len in ((128, 2), (16, 1)):
        cfg = config_for(num_heads, smem)
        for kv_name in kv_names:
            for splits in (1, 8):
                yield (f"triton_split h{num_heads} q{q_len} kv={kv_name} splits={splits}",
                       k._mla_decode_split_kernel, *triton_split_spec(cfg, num_heads, q_len, kv_name, splits, cc))
            # the balanced work-item grid (the default split plan of the Triton path, ops/plan.py)
            pointers, constexprs, options = triton_split_spec(cfg, num_heads, q_len, kv_name, 32, cc)
            yield (f"triton_split_balanced h{num_heads} q{q_len} kv={kv_name}", k._mla_decode_split_balanced_kernel,
                   {**pointers, "split_index_ptr": "*i32"}, constexprs | BALANCED_CONSTEXPRS, options)
    # per-row key counts (decode context parallelism with MTP), the default balanced plan
    cfg = config_for(128, smem)
    pointers, constexprs, options = triton_split_spec(cfg, 128, 2, "bf16", 32, cc, row_kv_lens=True)
    yield ("triton_split_balanced h128 q2 kv=bf16 row_kv_lens", k._mla_decode_split_balanced_kernel,
           {**pointers, "split_index_ptr": "*i32"}, constexprs | BALANCED_CONSTEXPRS, options)
    pointers = dict(out_ptr="*bf16", lse_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32",
                    seq_lens_ptr="*i32", kv_scale_ptr="*fp32", kv_scale_val="fp32")
    # griddepcontrol (PDL) exists from SM90 on: the combine waits on it only when launched as a dependent
    for use_pdl in (False, True) if cc >= 90 else (False,):
        constexprs = dict(NUM_HEADS=128, Q_LEN=2, BLOCK_N=64, NUM_SPLITS=8, MIN_CHUNK=128, KV_SCALE_IS_PTR=True,
                          D_NOPE=KV_LORA_RANK, SPLITS_P2=8, USE_PDL=use_pdl)
        yield (f"combine_uniform h128 q2 splits=8{' pdl' if use_pdl else ''}", combine.combine_uniform_kernel,
               pointers, constexprs, dict(num_warps=4))
    # the tiles of a large batch (16 rows, one split per round) and of a few split requests (2 rows, 16 splits at
    # once: ops/plan.py combine_tiles), over fp32 partials (Triton, cute_sm100) and partials in the output
    # dtype (cute_sm90)
    for (rows, d_block, split_block), parts in itertools.product(((16, 512, 1), (2, 512, 16)), ("fp32", "bf16")):
        yield (f"combine_balanced h128 q1 rows={rows} cols={d_block} splits/round={split_block} parts={parts}",
               combine.combine_balanced_kernel,
               {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": f"*{parts}", "part_lse_ptr": "*fp32",
                "split_index_ptr": "*i32", "kv_scale_ptr": "*fp32", "kv_scale_val": "fp32"},
               {"NUM_HEADS": 128, "Q_LEN": 1, "ROWS": rows, "KV_SCALE_IS_PTR": True, "D_NOPE": KV_LORA_RANK,
                "SPLITS_P2": 32, "USE_PDL": cc >= 90, "D_BLOCK": d_block, "SPLIT_BLOCK": split_block},
               dict(num_warps=4))


def build_triton(fn, pointers: dict, constexprs: dict, options: dict, cc: int):
    """Compile one Triton kernel for compute capability ``cc`` with no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {arg: pointers.get(arg, "constexpr" if arg in constexprs else "i32") for arg in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", cc, 32),
                          options=options)


def compile_variants(arch: str, one_per_class: bool = False) -> list[VariantResult]:
    """Every variant of ``triton_variants`` for ``arch``; ``one_per_class``: the first of each kernel and
    pointer signature (the cache and partials dtypes)."""
    info = ARCHS[arch]
    cc, gpu_name, smem = info.cc_int, arch, info.smem_per_block
    variants = list(triton_variants(cc))
    if one_per_class:
        variants = first_of_each_class(variants, lambda v: (v[1], tuple(sorted(v[2].items()))))
    results = []
    for name, fn, pointers, constexprs, options in variants:
        t0 = time.time()
        try:
            compiled = build_triton(fn, pointers, constexprs, options, cc)
            regs, spills = ptxas_report(compiled.asm["ptx"], gpu_name)
            shared = compiled.metadata.shared
            fits = shared <= smem
            results.append(VariantResult(name, fits, regs, shared, spills, time.time() - t0,
                                         error="" if fits else f"{shared} B of shared memory > the "
                                                               f"{smem} B a block gets on {arch}"))
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, and fails the command
            results.append(VariantResult(name, False, seconds=time.time() - t0, error=str(e).splitlines()[-1]))
    return results
