"""Ahead-of-time compilation of every decode kernel variant for one GPU architecture, with no GPU needed.

    python -m mla_backend_plugin.compile --arch sm_90a
    python -m mla_backend_plugin.compile --arch sm_120a --kernels triton

Prints one row per variant (name, registers, shared memory, spill bytes, seconds) and exits non-zero if any
variant fails to compile. CI runs it for every architecture a kernel claims. Registers and spills come from
``ptxas -v`` on the PTX the kernel compiler produced (Triton ships its own ptxas).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

# arch name -> (compute capability as Triton's GPUTarget takes it, ptxas --gpu-name)
ARCHS = {
    "sm_80": (80, "sm_80"),
    "sm_89": (89, "sm_89"),
    "sm_90a": (90, "sm_90a"),
    "sm_100a": (100, "sm_100a"),
    "sm_120a": (120, "sm_120a"),
    "sm_121a": (121, "sm_121a"),
}


@dataclasses.dataclass
class VariantResult:
    name: str
    ok: bool
    registers: int | None = None
    shared_bytes: int | None = None
    spill_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""


def _find_ptxas() -> str:
    """Triton's bundled ptxas (it matches the PTX Triton emits), else the CUDA toolkit's."""
    import triton.backends.nvidia as nvidia_backend

    bundled = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "ptxas")
    found = bundled if os.path.exists(bundled) else shutil.which("ptxas")
    if found is None:
        raise RuntimeError("no ptxas found (neither Triton's bundled one nor one on PATH)")
    return found


def _ptxas_report(ptx: str, gpu_name: str) -> tuple[int | None, int | None]:
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


# opt-in shared memory per block of the GPUs each arch stands for (A100; RTX 40xx / L4; H100/H200; B200;
# RTX 50xx / RTX PRO 6000 / DGX Spark): the Triton tile is chosen to fit it (triton_decode/config.py)
SMEM_PER_BLOCK = {80: 166_912, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376, 121: 101_376}


def triton_split_spec(cfg, num_heads: int, q_len: int, kv_name: str, splits: int, cc: int = 90):
    """(signature pointers, constexprs, options) of one Triton split-kernel build."""
    import triton.language as tl

    from mla_backend_plugin.kernels.triton_decode.config import compiler_options
    from mla_backend_plugin.ops.constants import KV_LORA_RANK, QK_ROPE_HEAD_DIM

    constexprs = dict(NUM_HEADS=num_heads, Q_LEN=q_len, PAGE_SIZE=64, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      NUM_SPLITS=splits, MIN_CHUNK=128, Q_SCALE_IS_PTR=False, KV_SCALE_IS_PTR=kv_name == "fp8",
                      D_NOPE=KV_LORA_RANK, D_PE=QK_ROPE_HEAD_DIM, COMPUTE_DTYPE=tl.bfloat16)
    pointers = dict(q_nope_ptr="*bf16", q_pe_ptr="*bf16", kv_ptr="*fp8e4nv" if kv_name == "fp8" else "*bf16",
                    block_table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32",
                    part_o_ptr="*fp32", part_lse_ptr="*fp32", q_scale_ptr="*fp32", kv_scale_ptr="*fp32",
                    q_scale_val="fp32", kv_scale_val="fp32", sm_scale="fp32")
    return pointers, constexprs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **compiler_options(cc))


def triton_variants(cc: int):
    """(name, jit function, signature, constexprs, options) of every Triton decode variant worth building."""
    from mla_backend_plugin.kernels.triton_decode import kernel as k
    from mla_backend_plugin.kernels.triton_decode.config import config_for
    from mla_backend_plugin.ops.constants import KV_LORA_RANK

    kv_names = ["bf16"] + (["fp8"] if cc >= 89 else [])
    for num_heads, q_len in ((128, 2), (16, 1)):
        cfg = config_for(num_heads, SMEM_PER_BLOCK[cc])
        for kv_name in kv_names:
            for splits in (1, 8):
                yield (f"triton_split h{num_heads} q{q_len} kv={kv_name} splits={splits}",
                       k._mla_decode_split_kernel, *triton_split_spec(cfg, num_heads, q_len, kv_name, splits, cc))
            # the balanced work-item grid (the default split plan of the Triton path, ops/workspace.py)
            pointers, constexprs, options = triton_split_spec(cfg, num_heads, q_len, kv_name, 32, cc)
            yield (f"triton_split_balanced h{num_heads} q{q_len} kv={kv_name}", k._mla_decode_split_balanced_kernel,
                   {**pointers, "split_index_ptr": "*i32"}, {**constexprs, "WORK": 66, "SCAN": 128}, options)
    pointers = dict(out_ptr="*bf16", lse_ptr="*fp32", part_o_ptr="*fp32", part_lse_ptr="*fp32",
                    seq_lens_ptr="*i32", kv_scale_ptr="*fp32", kv_scale_val="fp32")
    # griddepcontrol (PDL) exists from SM90 on: the combine waits on it only when launched after cute_sm90
    for use_pdl in (False, True) if cc >= 90 else (False,):
        constexprs = dict(NUM_HEADS=128, Q_LEN=2, BLOCK_N=64, NUM_SPLITS=8, MIN_CHUNK=128, KV_SCALE_IS_PTR=True,
                          D_NOPE=KV_LORA_RANK, SPLITS_P2=8, USE_PDL=use_pdl)
        yield (f"triton_combine h128 q2 splits=8{' pdl' if use_pdl else ''}", k._mla_decode_combine_kernel,
               pointers, constexprs, dict(num_warps=4))
    yield ("triton_combine_balanced h128 q1", k._mla_decode_combine_balanced_kernel,
           {"out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "split_index_ptr": "*i32", "kv_scale_ptr": "*fp32", "kv_scale_val": "fp32"},
           {"NUM_HEADS": 128, "Q_LEN": 1, "ROWS": 4, "KV_SCALE_IS_PTR": True, "D_NOPE": KV_LORA_RANK,
            "SPLITS_P2": 32, "USE_PDL": cc >= 90}, dict(num_warps=4))


def build_triton(fn, pointers: dict, constexprs: dict, options: dict, cc: int):
    """Compile one Triton kernel for compute capability ``cc`` with no GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {arg: pointers.get(arg, "constexpr" if arg in constexprs else "i32") for arg in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", cc, 32),
                          options=options)


def compile_triton(arch: str) -> list[VariantResult]:
    cc, gpu_name = ARCHS[arch]
    results = []
    for name, fn, pointers, constexprs, options in triton_variants(cc):
        t0 = time.time()
        try:
            compiled = build_triton(fn, pointers, constexprs, options, cc)
            regs, spills = _ptxas_report(compiled.asm["ptx"], gpu_name)
            shared = compiled.metadata.shared
            fits = shared <= SMEM_PER_BLOCK[cc]
            results.append(VariantResult(name, fits, regs, shared, spills, time.time() - t0,
                                         error="" if fits else f"{shared} B of shared memory > the "
                                                               f"{SMEM_PER_BLOCK[cc]} B a block gets on {arch}"))
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, and fails the command
            results.append(VariantResult(name, False, seconds=time.time() - t0, error=str(e).splitlines()[-1]))
    return results


def _family_builder(module: str):
    """A kernel family's ``compile_variants(arch) -> list[VariantResult]``, imported only when that family is built."""
    def build(arch: str) -> list[VariantResult]:
        import importlib

        return importlib.import_module(f"mla_backend_plugin.kernels.{module}").compile_variants(arch)
    return build


# kernel family -> (archs it is built for, builder)
FAMILIES = {
    "triton": (("sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a"), compile_triton),
    "cute_sm90": (("sm_90a",), _family_builder("cute_sm90.build")),
    "xqa_sm120": (("sm_90a", "sm_120a", "sm_121a"), _family_builder("xqa_sm120.build")),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS), help="target architecture")
    parser.add_argument("--kernels", default="all", help="comma-separated kernel families, or all "
                        f"(families: {', '.join(FAMILIES)})")
    parser.add_argument("--export-dir", metavar="DIR", help="export the cute_sm90 variants as prebuilt TVM-FFI "
                        "libraries into DIR (a relocatable cache: copy it to a GPU host and point "
                        "CUTE_MLA_CUTE_CACHE at it; it needs no nvidia-cutlass-dsl there)")
    args = parser.parse_args(argv)
    if args.export_dir:  # read by kernels/cute_sm90/aot.py, here and in the build's worker processes
        os.environ["CUTE_MLA_CUTE_CACHE"] = os.path.abspath(args.export_dir)
    families = list(FAMILIES) if args.kernels == "all" else args.kernels.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; allowed: {', '.join(FAMILIES)} or all")
    failed = 0
    print(f"{'variant':48s} {'arch':8s} {'regs':>5s} {'smem':>8s} {'spills':>7s} {'s':>6s}")
    for family in families:
        archs, build = FAMILIES[family]
        if args.arch not in archs:
            print(f"{family}: not built for {args.arch} (built for {', '.join(archs)})")
            continue
        for r in build(args.arch):
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
