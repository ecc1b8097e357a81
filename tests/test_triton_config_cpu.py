"""The Triton tile is chosen to fit each GPU's shared memory per block, and the shared-memory table it is chosen
from matches what Triton actually allocates (recompiled here, no GPU needed)."""

from __future__ import annotations

import pytest

from mla_backend_plugin.kernels.triton_decode.build import build_triton, triton_split_spec
from mla_backend_plugin.kernels.triton_decode.config import SMEM_BYTES, config_for, smem_bytes
from mla_backend_plugin.ops.arch import ARCHS

SMEM_PER_BLOCK = {a.cc_int: a.smem_per_block for a in ARCHS.values()}


@pytest.mark.parametrize("cc", sorted(SMEM_PER_BLOCK))
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_chosen_tile_fits_the_gpu(cc, heads):
    cfg = config_for(heads, SMEM_PER_BLOCK[cc])
    assert smem_bytes(cfg) <= SMEM_PER_BLOCK[cc] and cfg.block_m <= max(heads, 16)


def test_fastest_tile_where_it_fits():
    assert (config_for(128, SMEM_PER_BLOCK[90]).block_m, config_for(128, SMEM_PER_BLOCK[90]).block_n) == (64, 64)
    assert config_for(128, None) == config_for(128, SMEM_PER_BLOCK[90])
    assert (config_for(128, SMEM_PER_BLOCK[80]).block_m, config_for(128, SMEM_PER_BLOCK[80]).block_n) == (64, 32)
    assert (config_for(128, SMEM_PER_BLOCK[120]).block_m, config_for(128, SMEM_PER_BLOCK[120]).block_n) == (32, 32)
    assert config_for(16, SMEM_PER_BLOCK[120]).block_n == 64  # 16 x 64 fits 99 KB


@pytest.mark.parametrize("key", sorted(SMEM_BYTES))
def test_smem_table_matches_triton(key):
    pytest.importorskip("triton")
    from mla_backend_plugin.kernels.triton_decode import kernel as k
    from mla_backend_plugin.kernels.triton_decode.config import TritonDecodeConfig

    block_m, block_n, warps = key
    cfg = TritonDecodeConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=2)
    for kv_name in ("bf16", "fp8"):
        compiled = build_triton(k._mla_decode_split_kernel, *triton_split_spec(cfg, 128, 1, kv_name, 1), cc=120)
        assert compiled.metadata.shared <= SMEM_BYTES[key], (key, kv_name, compiled.metadata.shared)
    assert compiled.metadata.shared > 0
