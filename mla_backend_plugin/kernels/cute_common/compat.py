"""What differs between the nvidia-cutlass-dsl releases the CuTe families support, in one place.

vLLM 0.26 pins 4.6.0 and vLLM 0.32/0.33 pin 4.8.0; CI compiles every CuTe variant against both. A kernel
imports a moved or renamed DSL name from here, never with its own version check, so the next DSL release is
one edit in this file. What differs (read from both releases' sources and no-GPU compiles of our kernels and
of CUTLASS's Blackwell MLA example under each):

* ``SmemAllocator``, ``TmemAllocator``, ``get_num_tmem_alloc_cols``: ``cutlass.memory`` from 4.8 (the
  ``cutlass.utils`` names warn on every construction there); only ``cutlass.utils`` in 4.6.
* ``LayoutEnum``: ``cutlass.tensor_utils`` from 4.8 (``cutlass.utils.LayoutEnum`` warns); ``cutlass.utils`` in 4.6.
* ``Arch``: ``cutlass.Arch`` from 4.8; ``cutlass.base_dsl.arch.Arch`` in 4.6.
* ``cute.arch.shuffle_sync_up``: clamp 31 by default and positional in 4.6, keyword-only with default 0 in
  4.8. An inclusive up-scan needs 0: always pass ``mask_and_clamp=SHFL_UP_CLAMP`` by keyword.
* A wrong-arch MMA or copy atom raises ``cute.nvgpu.OpError`` in 4.6 and ``DSLUserCodeError`` in 4.8 (OpError
  is gone): catch ``DslError``, their common base.
* Compile options (``--enable-tvm-ffi``, ``--gpu-arch``, ``--keep-ptx/--keep-cubin``, ``--dump-dir``) are spelt
  the same; with no ``--gpu-arch`` and no GPU both silently target sm_100a, so we always name the arch.
"""

from __future__ import annotations

import cutlass  # noqa: F401  (the DSL must be importable: this module is for device code and builds)
from cutlass import cute
from cutlass.base_dsl.common import DSLBaseError as DslError

try:  # >= 4.8
    from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
except ImportError:  # 4.6
    from cutlass.utils import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols

try:  # >= 4.8
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # 4.6
    from cutlass.utils import LayoutEnum

try:  # >= 4.8
    from cutlass import Arch
except ImportError:  # 4.6
    from cutlass.base_dsl.arch import Arch

SHFL_UP_CLAMP = 0  # shfl.up's lower lane bound (PTX c = 0): 4.6's default (31) breaks an inclusive scan


def compile_options(arch: str | None, keep_dir: str | None = None, tvm_ffi: bool = True) -> str:
    opts = ["--enable-tvm-ffi"] if tvm_ffi else []
    if arch:
        opts.append(f"--gpu-arch {arch}")
    if keep_dir:  # the DSL writes the PTX/cubin there (else into the working directory)
        opts.append(f"--keep-ptx --keep-cubin --dump-dir {keep_dir}")
    return " ".join(opts)


def find_runtime_library(name: str) -> str:
    """Path of one of the DSL's runtime shared libraries (``libcute_dsl_runtime.so``)."""
    found = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False) if p.endswith("/" + name)]
    if not found:
        raise RuntimeError(f"nvidia-cutlass-dsl's {name} not found (cute.runtime.find_runtime_libraries)")
    return found[0]


__all__ = ["Arch", "DslError", "LayoutEnum", "SHFL_UP_CLAMP", "SmemAllocator", "TmemAllocator", "compile_options",
           "find_runtime_library", "get_num_tmem_alloc_cols"]
