"""Host side of the CuTe-DSL SM90 decode kernel: support checks, the compile cache and the launch.

Importable without cutlass (the registry asks ``unsupported_reason`` on any machine); the DSL is imported on
first compile. Each variant (config.Variant: dtypes, heads, q_len, block size, scale forms) is compiled once
per process with fake tensors whose batch, lengths and strides are symbolic, so one binary serves every batch
size and cache size; ``--enable-tvm-ffi`` lets the compiled function take torch tensors directly.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from mla_backend_plugin.kernels.cute_sm90.config import Variant
from mla_backend_plugin.ops.constants import FP8_DTYPE, KV_LORA_RANK

PDL_ENV_VAR = "CUTE_MLA_PDL"  # "0" launches without programmatic dependent launch
# fp8 caches: "fp8mma" (design B, kernel_fp8mma.py; default: 1.4-1.5x faster from B=64 on an H100) or
# "dequant" (design A, kernel.py: 6x smaller error, ~10% faster at B=1); benchmarks/NOTES.md has both
FP8_DESIGN_ENV_VAR = "CUTE_MLA_FP8_DESIGN"
FP8_DESIGNS = ("fp8mma", "dequant")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", FP8_DTYPE: "fp8"}


def pdl_enabled() -> bool:
    return os.environ.get(PDL_ENV_VAR, "1").strip() not in ("0", "false", "off")


@functools.cache
def _dsl_missing() -> str | None:
    """None when the DSL can compile here; else what is missing (prebuilt libraries may still run)."""
    for mod, dist in (("cutlass", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi"),
                      ("cuda.bindings", "cuda-python")):
        try:
            if importlib.util.find_spec(mod) is not None:
                continue
        except (ImportError, ValueError):
            pass
        return f"Python package {mod!r} is not installed (pip install {dist})"
    return None


def unsupported_reason(args, cc) -> str | None:
    if cc is None:
        return "needs a CUDA device"
    if cc != (9, 0):
        return f"is built for sm_90a (H100/H200) only, device has compute capability {cc[0]}.{cc[1]}"
    # TMA descriptors and 16-byte vector loads need 16-byte aligned rows
    for name, t in (("kv_cache", args.kv_cache), ("q_nope", args.q_nope), ("q_pe", args.q_pe)):
        if t.data_ptr() % 16 or any(s % (16 // t.element_size()) for s in t.stride()[:-1]):
            return f"{name} needs 16-byte aligned rows (strides {t.stride()}, {t.element_size()}-byte elements)"
    missing = _dsl_missing()
    if missing:  # no JIT here: only a prebuilt library of this variant can run (aot.py)
        from mla_backend_plugin.kernels.cute_sm90 import aot

        variant = variant_for(args)
        why = aot.prebuilt_reason(variant, pdl_enabled(), ARCH)
        if why:
            return f"{missing} and no prebuilt library can be used: {why}; {aot.PREBUILD_HINT}"
    return None


def fp8_design() -> str:
    design = os.environ.get(FP8_DESIGN_ENV_VAR, "fp8mma").strip() or "fp8mma"
    if design not in FP8_DESIGNS:
        raise ValueError(f"{FP8_DESIGN_ENV_VAR}={design!r}: allowed {', '.join(FP8_DESIGNS)}")
    return design


def variant_for(args) -> Variant:
    fp8_mma = args.kv_dtype == FP8_DTYPE and fp8_design() == "fp8mma"
    return Variant(kv_dtype=_DTYPE_NAMES[args.kv_dtype], q_dtype=_DTYPE_NAMES[args.q_dtype],
                   out_dtype=_DTYPE_NAMES[args.out.dtype], num_heads=args.num_heads, q_len=args.q_len,
                   block_size=args.block_size, q_scale_is_ptr=isinstance(args.q_scale, torch.Tensor),
                   kv_scale_is_ptr=isinstance(args.kv_scale, torch.Tensor), fp8_mma=fp8_mma)


def compile_variant(variant: Variant, use_pdl: bool = True, arch: str | None = None, keep_dir: str | None = None):
    """Compile one variant with symbolic sizes; ``arch`` (e.g. "sm_90a") compiles with no GPU present."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from mla_backend_plugin.kernels.cute_sm90.kernel import DTYPES, Sm90MlaDecode

    if variant.fp8_mma:
        from mla_backend_plugin.kernels.cute_sm90.kernel_fp8mma import Sm90MlaDecodeFp8Mma as kernel_class
    else:
        kernel_class = Sm90MlaDecode

    def sym(div=1):
        return cute.sym_int(divisibility=div)

    qd, kvd, od = DTYPES[variant.q_dtype], DTYPES[variant.kv_dtype], DTYPES[variant.out_dtype]
    q_align = 16 // (qd.width // 8)
    kv_align = 16 // (kvd.width // 8)
    H, D = variant.num_heads, KV_LORA_RANK
    tokens = sym()
    q_nope = make_fake_tensor(qd, (tokens, H, D), (sym(q_align), sym(q_align), 1), assumed_align=16)
    q_pe = make_fake_tensor(qd, (tokens, H, 64), (sym(q_align), sym(q_align), 1), assumed_align=16)
    # 64-bit page stride: a cache past 2 GiB (B=128 x 32k tokens of fp8) overflows 32-bit offsets
    kv = make_fake_tensor(kvd, (sym(), variant.block_size, 576),
                          (cute.sym_int(64, divisibility=kv_align), sym(kv_align), 1),
                          assumed_align=16)
    batch = sym()
    block_table = make_fake_tensor(cutlass.Int32, (batch, sym()), (sym(), 1), assumed_align=4)
    seq_lens = make_fake_tensor(cutlass.Int32, (batch,), (1,), assumed_align=4)
    out = make_fake_tensor(od, (tokens, H, D), (sym(), sym(), 1), assumed_align=4)
    lse = make_fake_tensor(cutlass.Float32, (tokens, H), (sym(), sym()), assumed_align=4)
    part_o = make_fake_tensor(cutlass.Float32, (sym(), D), (D, 1), assumed_align=16)
    part_lse = make_fake_tensor(cutlass.Float32, (sym(),), (1,), assumed_align=4)
    q_scale_t = make_fake_tensor(cutlass.Float32, (1,), (1,), assumed_align=4)
    kv_scale_t = make_fake_tensor(cutlass.Float32, (1,), (1,), assumed_align=4)
    split_index = make_fake_tensor(cutlass.Int32, (sym(),), (1,), assumed_align=4)
    options = ["--enable-tvm-ffi"]
    if arch:
        options.append(f"--gpu-arch {arch}")
    if keep_dir:  # the DSL writes the PTX/cubin there (else into the working directory)
        options.append(f"--keep-ptx --keep-cubin --dump-dir {keep_dir}")
    op = kernel_class(variant, use_pdl=use_pdl)
    return cute.compile(op, q_nope, q_pe, kv, block_table, seq_lens, out, lse, part_o, part_lse, q_scale_t,
                        kv_scale_t, cutlass.Float32(1.0), cutlass.Float32(1.0), cutlass.Float32(1.0), split_index,
                        cutlass.Int32(1), cutlass.Int32(128), cutlass.Int32(1), cutlass.Int32(1),
                        make_fake_stream(), options=" ".join(options))


ARCH = "sm_90a"


@functools.cache
def _compiled(variant: Variant, use_pdl: bool):
    """The variant's function: from the on-disk cache when it holds a usable entry (aot.py), else compiled now
    and exported to the cache (when the cache is on). Without the DSL only the cache can serve it. Runs
    outside CUDA-graph capture: vLLM's warm-up and the first eager call reach it first."""
    from mla_backend_plugin.kernels.cute_sm90 import aot

    path, why = aot.check_entry(variant, use_pdl, ARCH)
    if path is not None:
        try:
            return aot.load_path(path)
        except Exception as e:  # noqa: BLE001 - a broken library is rebuilt when the DSL is here
            why = f"loading {path} failed: {e}"
            if _dsl_missing() is None:
                warnings.warn(f"cute_sm90: ignoring the cached {variant.name}: {why}", RuntimeWarning,
                              stacklevel=2)
    missing = _dsl_missing()
    if missing:
        raise RuntimeError(f"cute_sm90: cannot run {variant.name}: {missing} and no prebuilt library can be "
                           f"used: {why}; {aot.PREBUILD_HINT}")
    compiled = compile_variant(variant, use_pdl, arch=ARCH)
    if aot.cache_root() is not None:
        try:
            aot.export(compiled, variant, use_pdl, ARCH)
        except Exception as e:  # noqa: BLE001 - the JIT result still runs
            warnings.warn(f"cute_sm90: could not cache {variant.name}: {e}", RuntimeWarning, stacklevel=2)
    return compiled


def launch(args, workspace) -> None:
    import cuda.bindings.driver as cuda

    from mla_backend_plugin.kernels.cute_sm90.config import softmax_scale_log2
    from mla_backend_plugin.kernels.triton_decode.kernel import launch_combine

    use_pdl = pdl_enabled()
    variant = variant_for(args)
    fn = _compiled(variant, use_pdl)
    plan = workspace.plan(args.batch, args.q_len, balanced=True)
    # the kernel's schedule packs a 128-request step's partial-slot count into 16 bits (kernel.py schedule_step)
    if plan.num_splits * 128 >= 1 << 16:
        raise ValueError(f"cute_sm90: max_splits={plan.num_splits} is too large (allowed <= 511)")
    dummy = workspace.partial_lse[:1]  # stands in for a scale given as a Python float
    q_scale_t = args.q_scale if isinstance(args.q_scale, torch.Tensor) else dummy  # shape (1,): prepare_args
    kv_scale_t = args.kv_scale if isinstance(args.kv_scale, torch.Tensor) else dummy
    q_scale = 1.0 if args.q_scale is None or isinstance(args.q_scale, torch.Tensor) else float(args.q_scale)
    kv_scale = 1.0 if args.kv_scale is None or isinstance(args.kv_scale, torch.Tensor) else float(args.kv_scale)
    stream = cuda.CUstream(torch.cuda.current_stream(args.q_nope.device).cuda_stream)
    fn(args.q_nope, args.q_pe, args.kv_cache, args.block_table, args.seq_lens, args.out, args.lse,
       workspace.partial_out, workspace.partial_lse, q_scale_t, kv_scale_t, q_scale, kv_scale,
       softmax_scale_log2(args.softmax_scale), workspace.split_index, plan.num_splits, plan.min_chunk,
       plan.work_target, plan.grid_items, stream)
    if plan.has_combine:
        # The combine is an ordinary stream-ordered launch (it starts once the split kernel has finished), not a
        # programmatic dependent: launched early it cost 14 us at B=1 S=8192 q_len 2 on an H100 (52.7 vs 38.6
        # us per call) and changed no other measured cell by more than 2.5 us (benchmarks/NOTES.md, v3).
        launch_combine(args, workspace, plan, block_n=64, use_pdl=False, balanced=True)
