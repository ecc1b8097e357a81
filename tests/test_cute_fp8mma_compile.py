"""CPU test of the SM90 fp8 "design B" kernel (kernels/cute_sm90/kernel_fp8mma.py): one real sm_90a compile
(no GPU needed) whose SASS must hold fp8 wgmma (QGMMA ... E4M3.E4M3) for both products and TMA loads, and no
local-memory spills."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from mla_backend_plugin.kernels.cute_sm90.config import Variant

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_fp8mma_compiles_to_e4m3_wgmma_without_spills(tmp_path):
    from mla_backend_plugin.kernels.cute_sm90.build import _cuobjdump, inspect_cubin
    from mla_backend_plugin.kernels.cute_sm90.launch import compile_variant

    # a 16-token page: 4 page slices per tile, the producer's tightest register case
    v = Variant("fp8", "bf16", "bf16", 128, 2, 16, False, True, fp8_mma=True)
    compiled = compile_variant(v, use_pdl=True, arch="sm_90a", keep_dir=str(tmp_path))
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.__cubin__)
    info = inspect_cubin(str(path))
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    qk = len(re.findall(r"QGMMA\.64x32x32\.F32\.E4M3\.E4M3", sass))
    pv = len(re.findall(r"QGMMA\.64x256x32\.F32\.E4M3\.E4M3", sass))
    # q hi + lo over K = 576; P V over 64 keys, emitted twice: grouped with the next tile's Q K^T, and alone in
    # the last step
    assert qk == 2 * 18 and pv == 2 * 2, (qk, pv)
    assert info["wgmma_waits"] == 1, info  # one wait per step: P V j and Q K^T j + 1 are one group
    assert info["hgmma"] == 0  # no 16-bit wgmma left
    assert info["utmaldg"] > 0
    assert not (info["stack"] or info["local"] or info["spill_ops"]), info
