"""CPU tests of cute_sm90's fp8 "design C" (kernels/cute_sm90/kernel_fp8seesaw.py, ``fp8_design="fp8seesaw"``).

* The V^T fragments: an emulation of what the kernel issues per tile, with the kernel's own index functions
  (kernels/cute_sm90/fp8seesaw_layout.py): the K tile as TMA leaves it in shared memory, each lane's
  ``ldmatrix.trans.x4`` at ``ldsm_offset``, ``prmt`` 0x6420 / 0x7531, the byte mask of keys past the split's end;
  P stored at ``p_offset(row, slot_of_key(key))``; then the wgmma m64n64k32 as the PTX ISA defines its A (register
  fragment: row lane / 4 (+ 8) of warp w, k 4 (lane % 4) .. + 3 (+ 16)) and K-major B operands, the accumulator's
  rows mapped back by ``latent_of_row``. The product must equal V^T P^T of the unpermuted bytes exactly.
* One real sm_90a compile (no GPU needed) whose SASS must hold e4m3 wgmma only, ldmatrix.trans, TMA loads, no
  spills and no serialised wgmma; and the wiring (the design is chosen only by name, and refuses a 16-bit q).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import numpy as np
import pytest

from mla_backend_plugin.kernels.cute_sm90 import fp8seesaw_layout as lay
from mla_backend_plugin.kernels.cute_sm90.config import Variant

HAS_DSL = all(importlib.util.find_spec(m) is not None for m in ("cutlass", "tvm_ffi"))
KEYS, D_NOPE, D_QK = 64, 512, 576


def k_tile_smem(v: np.ndarray) -> np.ndarray:
    """One stage of the K ring: v [64 keys, 576] bytes placed at ``tile_offset``."""
    smem = np.zeros(KEYS * D_QK, dtype=np.int64)
    for key in range(KEYS):
        for col in range(D_QK):
            smem[lay.tile_offset(key, col)] = v[key, col]
    return smem


def ldmatrix_trans_x4(smem: np.ndarray, addrs: list[int]) -> np.ndarray:
    """[lane, matrix, 4 bytes]: matrix i's row r is the 16 bytes at lane 8 i + r's address; .trans hands lane t
    the 16-bit element t / 4 of rows 2 (t % 4) and 2 (t % 4) + 1."""
    regs = np.zeros((32, 4, 4), dtype=np.int64)
    for i in range(4):
        m = np.stack([smem[a:a + 16] for a in addrs[8 * i:8 * i + 8]])
        for t in range(32):
            c, r0 = t // 4, 2 * (t % 4)
            regs[t, i] = np.concatenate([m[r0, 2 * c:2 * c + 2], m[r0 + 1, 2 * c:2 * c + 2]])
    return regs


def prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    both = np.concatenate([a, b])
    return np.array([both[(selector >> (4 * k)) & 7] for k in range(4)])


def emulate_fragments(smem: np.ndarray, side: int, valid: int) -> np.ndarray:
    """What ``load_vt`` leaves in the registers, k-step by k-step: [warp, lane, m-tile, k-step, reg, byte]."""
    out = np.zeros((4, 32, 4, 2, 4, 4), dtype=np.int64)
    for warp in range(4):
        base = [lay.ldsm_thread_base(lane, warp) for lane in range(32)]
        for k in range(2):
            keep = np.array([[[lay.fragment_key(lane, k, 2 * h, q) < valid for q in range(4)] for h in range(2)]
                             for lane in range(32)])
            for mt in range(4):
                regs = ldmatrix_trans_x4(smem, [b + lay.ldsm_immediate(4 * side + mt, k) for b in base])
                for lane in range(32):
                    r = regs[lane]
                    frag = [prmt(r[0], r[1], lay.PRMT_LO), prmt(r[0], r[1], lay.PRMT_HI),
                            prmt(r[2], r[3], lay.PRMT_LO), prmt(r[2], r[3], lay.PRMT_HI)]
                    for reg in range(4):
                        out[warp, lane, mt, k, reg] = frag[reg] * keep[lane, reg >> 1]
    return out


def wgmma_pv(frags: np.ndarray, pt: np.ndarray) -> np.ndarray:
    """O^T [256 accumulator rows, 64 query rows] of 2 k-steps x 4 m-tiles of m64n64k32: A from the register
    fragments as the wgmma A layout places them (``a_value_coord``), B = the P^T tile [row n][slot] (K-major)."""
    a = np.zeros((256, 64), dtype=np.int64)  # [accumulator row m, k slot of the tile]
    for warp in range(4):
        for lane in range(32):
            for k in range(2):
                for v in range(64):
                    m, slot = lay.a_value_coord(lane, warp, v)
                    a[m, 32 * k + slot] = frags[warp, lane, v // 16, k, (v // 4) % 4, v % 4]
    return a @ pt.T


def store_pt(p: np.ndarray) -> np.ndarray:
    """What ``store_p_t`` writes: each thread's 32 S-accumulator values (at ``s_value_coord``, the wgmma C
    layout, checked against CuTe's by ``test_accumulator_layouts_are_the_kernels``) at
    ``(p_thread_base ^ xor) + immediate``; read back as the B operand [row n][k slot] through ``p_offset``, the
    K-major swizzled layout the wgmma descriptor reads."""
    smem = np.full(64 * KEYS, -1, dtype=np.int64)
    for warp in range(4):
        for lane in range(32):
            base = lay.p_thread_base(lane, warp)
            for v in range(32):
                row, key = lay.s_value_coord(lane, warp, v)
                xor, imm = lay.p_value_terms(v)
                smem[(base ^ xor) + imm] = p[row, key]
    assert (smem >= 0).all()  # every byte written once
    return np.array([[smem[lay.p_offset(n, s)] for s in range(KEYS)] for n in range(64)])


@pytest.mark.parametrize("valid", [64, 37, 0])
@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_fragments_give_vt_pt(seed, valid):
    """The emulated register fragments times the stored P^T equal V^T P^T over every latent column (both
    groups), with the keys >= ``valid`` contributing nothing even where their bytes are not finite."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 256, size=(KEYS, D_QK))
    p = rng.integers(0, 256, size=(64, KEYS))
    smem = k_tile_smem(v)
    pt = store_pt(p)
    ref = (v[:valid, :D_NOPE].T @ p[:, :valid].T)  # [512 latent, 64 rows]
    for side in range(2):
        acc = wgmma_pv(emulate_fragments(smem, side, valid), pt)
        got = np.zeros((256, 64), dtype=np.int64)
        for m in range(256):
            got[lay.latent_of_row(m)] = acc[m]
        np.testing.assert_array_equal(got, ref[256 * side:256 * side + 256])


def test_permutations_are_bijections_and_ldmatrix_is_conflict_free():
    assert sorted(lay.key_of_slot(s) for s in range(64)) == list(range(64))
    assert all(lay.slot_of_key(lay.key_of_slot(s)) == s for s in range(64))
    assert sorted(lay.latent_of_row(m) for m in range(256)) == list(range(256))
    assert sorted(lay.p_offset(n, s) for n in range(64) for s in range(64)) == list(range(4096))
    # each 8-lane phase of an ldmatrix reads 8 distinct 16-byte bank groups
    for warp in range(4):
        for k in range(2):
            for phase in range(4):
                units = {(lay.ldsm_offset(lane, warp, 0, k) // 16) % 8 for lane in range(8 * phase, 8 * phase + 8)}
                assert len(units) == 8


def test_design_c_with_an_fp8_q_only_and_prebuilt():
    from mla_backend_plugin.kernels.cute_sm90 import build
    from mla_backend_plugin.ops.manifest import LaunchConfig

    with pytest.raises(ValueError, match="fp8_design='fp8seesaw' needs an fp8 q"):
        Variant("fp8", "bf16", "bf16", 128, 1, 64, False, True, fp8_mma=True, fp8_seesaw=True)
    v = Variant("fp8", "fp8", "bf16", 128, 1, 64, True, True, fp8_mma=True, fp8_seesaw=True)
    assert v.name.endswith(" fp8seesaw") and build.kernel_class(v)[0] == "fp8seesaw"
    # auto's decode shapes prebuilt for every head count (vLLM's fp8 q and scale tensors): q_len 1 and 2 (MTP with
    # one draft token); q_len 3-4 on first use
    seesaw = {(x.num_heads, x.q_len, x.block_size, x.row_kv_lens, x.q_scale_is_ptr, x.kv_scale_is_ptr)
              for x in build.serving_variants() if x.fp8_seesaw}
    assert seesaw == {(h, q, 64, False, True, True) for h in (16, 32, 64, 128) for q in (1, 2)}
    assert LaunchConfig(fp8_design="fp8seesaw").fp8_design == "fp8seesaw"


PROBE = """
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from mla_backend_plugin.kernels.cute_sm90 import fp8seesaw_layout as lay
F8, K = cutlass.Float8E4M3FN, cute.nvgpu.OperandMajorMode.K
bad = []
THREADS = tuple(range(0, 128, 3))  # (a plain Python loop at trace time: the DSL turns a range() loop dynamic)

@cute.jit
def probe():
    qk = sm90_utils.make_trivial_tiled_mma(F8, F8, K, K, cutlass.Float32, (1, 1, 1), (64, 64))
    pv = sm90_utils.make_trivial_tiled_mma(F8, F8, K, K, cutlass.Float32, (1, 1, 1), (64, 64),
                                           warpgroup.OperandSource.RMEM)
    for t in THREADS:
        s = qk.get_slice(t).partition_C(cute.make_identity_tensor((64, 64)))
        o = pv.get_slice(t).partition_C(cute.make_identity_tensor((256, 64)))
        bad.extend((t, v) for v in range(32) if tuple(s[v]) != lay.s_value_coord(t % 32, t // 32, v))
        bad.extend((t, v) for v in range(128) if tuple(o[v]) != lay.ot_value_coord(t % 32, t // 32, v))
        a = pv.get_slice(t).partition_A(cute.make_identity_tensor((256, 32)))
        bad.extend((t, v) for v in range(64) if tuple(a[v]) != lay.a_value_coord(t % 32, t // 32, v))

probe()
print("BAD", bad[:4] if bad else "none")
"""


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_accumulator_layouts_are_the_kernels(tmp_path):
    """The (row, key) / (latent row, query row) of every accumulator value and the (row, k) of every A-fragment
    byte, as CuTe's wgmma partitions give them (traced for sm_90a on the CPU), are the formulas the kernel's P
    stores, V^T fragments, O^T rescale and epilogue use."""
    import os
    import sys

    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    probe = tmp_path / "probe.py"  # (the DSL reads a jit function's source file)
    probe.write_text(PROBE)
    run = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "BAD none" in run.stdout, run.stdout[-2000:]
    for v in range(128):  # the rescale's column index is the accumulator's column
        _, n = lay.ot_value_coord(0, 0, v)
        assert lay.ot_column_index(v) == 2 * (n // 8) + n % 2


def test_epilogue_stage_offsets_are_the_accumulators_coordinates():
    """The epilogue's staging addresses (``stage_thread_base`` + ``stage_value_offset``) put each O^T value at its
    (query row, latent column) of ``ot_value_coord`` and ``latent_of_row``, and values v, v + 2 (v & 2 == 0) at
    adjacent columns of one row (its 4-byte stores); every element of a group's 64 x 256 half is written once."""
    from mla_backend_plugin.kernels.cute_sm90.config import STAGE_ROW

    seen = set()
    for warp in range(4):
        for lane in range(32):
            base = lay.stage_thread_base(lane, warp, STAGE_ROW)
            for v in range(128):
                m, n = lay.ot_value_coord(lane, warp, v)
                at = base + lay.stage_value_offset(v, STAGE_ROW)
                assert at == n * STAGE_ROW + lay.latent_of_row(m), (lane, warp, v)
                if v & 2 == 0:
                    assert base + lay.stage_value_offset(v + 2, STAGE_ROW) == at + 1
                seen.add(at)
    assert seen == {n * STAGE_ROW + c for n in range(64) for c in range(256)}


def test_fp8seesaw_with_a_16_bit_q_is_refused_by_name():
    import torch

    from mla_backend_plugin.ops import mla_decode
    from mla_backend_plugin.ops.inputs import make_decode_inputs

    inp = make_decode_inputs(2, [70, 300], 1, 16, 16, torch.float8_e4m3fn, "cat", "cpu", 0, kv_scale=2.0)
    with pytest.raises(ValueError, match=r"fp8_design: 'fp8seesaw' needs an fp8 q \(q is torch.bfloat16\); "
                                         r"allowed with this q: fp8mma, dequant"):
        mla_decode(*inp.call_args(), softmax_scale=0.1, kernel="reference", out_dtype=torch.bfloat16,
                   fp8_design="fp8seesaw", **inp.scale_kwargs())


@pytest.mark.skipif(not HAS_DSL, reason="nvidia-cutlass-dsl / apache-tvm-ffi not installed")
def test_fp8seesaw_compiles_to_e4m3_wgmma_with_ldmatrix_trans(tmp_path):
    from mla_backend_plugin.kernels.cute_sm90.build import _cuobjdump, inspect_cubin, sass_problems
    from mla_backend_plugin.kernels.cute_sm90.launch import compile_variant

    v = Variant("fp8", "fp8", "bf16", 128, 1, 64, True, True, fp8_mma=True, fp8_seesaw=True)
    compiled = compile_variant(v, use_pdl=True, arch="sm_90a", keep_dir=str(tmp_path))
    path = tmp_path / "k.cubin"
    path.write_bytes(compiled.__cubin__)
    info = inspect_cubin(str(path))
    assert not sass_problems(v, info), sass_problems(v, info)
    sass = subprocess.run([_cuobjdump(), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    mma = len(re.findall(r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3", sass))
    # S over 18 k-steps at 4 call sites (each group's first tile and its next ones); P V at 4 (P_A V_A and P_B V_B
    # in each group) x 2 k-steps x 4 m-tiles, all m64n64k32
    assert mma == 4 * 18 + 4 * 8, mma
    assert info["ldsm_t"] == 4 * 8, info  # one ldmatrix.trans.x4 per P V wgmma
    assert len(re.findall(r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass)) == 4 * 2 + 4 * 8  # RS


def test_fp8seesaw_in_the_environment_is_a_preference(monkeypatch):
    """CUTE_MLA_FP8_DESIGN=fp8seesaw runs design C for an fp8 q and design B for a 16-bit q (where the argument
    ``fp8_design="fp8seesaw"`` is refused), so a whole serving run or test suite can take design C."""
    from types import SimpleNamespace

    import torch

    from mla_backend_plugin.kernels.cute_sm90.launch import fp8_design_for

    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "fp8seesaw")
    assert fp8_design_for(SimpleNamespace(batch=64, q_dtype=torch.float8_e4m3fn)) == "fp8seesaw"
    assert fp8_design_for(SimpleNamespace(batch=64, q_dtype=torch.bfloat16)) == "fp8mma"
    assert fp8_design_for(SimpleNamespace(batch=1, q_dtype=torch.float16)) == "fp8mma"
    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "auto")
    assert fp8_design_for(SimpleNamespace(batch=1, q_dtype=torch.bfloat16)) == "dequant"


def test_auto_takes_design_c_for_an_fp8_q_from_fp8_seesaw_min_batch(monkeypatch):
    """``auto``: an fp8 q runs design C from FP8_SEESAW_MIN_BATCH (where it measured faster than design B and
    FlashMLA), design B below; a 16-bit q never runs design C (it takes an fp8 q only)."""
    from types import SimpleNamespace

    import torch

    from mla_backend_plugin.kernels.cute_sm90.launch import FP8_SEESAW_MIN_BATCH, fp8_design_for

    monkeypatch.setenv("CUTE_MLA_FP8_DESIGN", "auto")
    fp8 = torch.float8_e4m3fn
    assert FP8_SEESAW_MIN_BATCH == 6
    assert [fp8_design_for(SimpleNamespace(batch=b, q_dtype=fp8)) for b in (1, 2, 5, 6, 256)] == [
        "fp8mma", "fp8mma", "fp8mma", "fp8seesaw", "fp8seesaw"]
    assert [fp8_design_for(SimpleNamespace(batch=b, q_dtype=torch.bfloat16)) for b in (2, 3, 32, 256)] == [
        "dequant", "fp8mma", "fp8mma", "fp8mma"]
