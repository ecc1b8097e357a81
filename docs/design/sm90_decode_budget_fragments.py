"""CPU check of design C's V fragments (docs/design/sm90_decode_budget.md, section 2, C2): no GPU, numpy only.

Models one 64-key x 64-byte TMA box of an fp8 KV tile in shared memory (64-byte swizzle: the 16-byte chunk index
XOR (row / 2) & 3), `ldmatrix.trans.x4` on 16-bit elements (lane t gets rows 2(t%4), 2(t%4)+1 of column t/4 of
each 8x8 matrix, the matrix's 8 rows addressed by 8 lanes) and `prmt` with selectors 0x6420 / 0x7531, and checks
that the four registers each lane ends with are the A fragment of an m64nNk32 e4m3 wgmma (a0: row t/4, k slots
4(t%4)..+3; a1: row t/4 + 8; a2, a3: k slots + 16) of V^T under

    latent column of fragment row r (per 16-column warp block):  2r for r < 8, 2(r - 8) + 1 for r >= 8
    key of k slot s (per 32-key k-step):  16 h + (2j + q if q < 2 else 8 + 2j + q - 2), s = 16 h + 4 j + q

(so P^T, the B operand, must store key sigma(s) at k slot s), and that every `ldmatrix` phase touches 8 distinct
16-byte bank groups. This models the instructions as the PTX ISA describes them; it checks the plan's index
algebra, not the hardware.

    python docs/design/sm90_decode_budget_fragments.py
"""

from __future__ import annotations

import numpy as np

KEYS, BOX_BYTES = 64, 64


def swizzled(row: int, byte: int) -> int:
    """Byte offset of (key row, byte) in a TMA box of 64-byte rows with the 64-byte swizzle."""
    return row * BOX_BYTES + ((byte // 16) ^ ((row // 2) & 3)) * 16 + byte % 16


def ldmatrix_trans_x4(smem: np.ndarray, rows: list[list[tuple[int, int]]]) -> tuple[np.ndarray, bool]:
    """Registers [lane, matrix, 4 bytes] of ldmatrix.trans.x4 over 4 matrices of 8 (row, byte) starts; and
    whether each matrix's 8 row addresses fall in 8 distinct 16-byte bank groups."""
    regs = np.zeros((32, 4, 4), dtype=np.uint8)
    conflict_free = True
    for i, starts in enumerate(rows):
        m = np.stack([smem[swizzled(r, b):swizzled(r, b) + 16] for r, b in starts])  # 8 rows x 16 bytes
        conflict_free &= len({(swizzled(r, b) // 16) % 8 for r, b in starts}) == 8
        for lane in range(32):
            c, r0 = lane // 4, 2 * (lane % 4)
            regs[lane, i] = np.concatenate([m[r0, 2 * c:2 * c + 2], m[r0 + 1, 2 * c:2 * c + 2]])
    return regs, conflict_free


def prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    both = np.concatenate([a, b])
    return np.array([both[(selector >> (4 * k)) & 7] for k in range(4)], dtype=np.uint8)


def key_of_slot(slot: int) -> int:
    half, rest = divmod(slot, 16)
    j, q = divmod(rest, 4)
    return 16 * half + (2 * j + q if q < 2 else 8 + 2 * j + q - 2)


def check(seed: int = 0) -> bool:
    v = np.random.default_rng(seed).integers(0, 256, size=(KEYS, BOX_BYTES), dtype=np.uint8)  # [key][latent]
    smem = np.zeros(KEYS * BOX_BYTES, dtype=np.uint8)
    for r in range(KEYS):
        for b in range(BOX_BYTES):
            smem[swizzled(r, b)] = v[r, b]
    ok = True
    for kstep in range(KEYS // 32):
        base = 32 * kstep
        for block in range(BOX_BYTES // 16):  # one warp's 16 latent columns
            starts = [[(base + 16 * (i // 2) + 8 * (i % 2) + j, 16 * block) for j in range(8)] for i in range(4)]
            regs, conflict_free = ldmatrix_trans_x4(smem, starts)
            ok &= conflict_free
            for lane in range(32):
                m0, m1, m2, m3 = regs[lane]
                frags = {(0, 0): prmt(m0, m1, 0x6420), (1, 0): prmt(m0, m1, 0x7531),
                         (0, 1): prmt(m2, m3, 0x6420), (1, 1): prmt(m2, m3, 0x7531)}
                for (upper, half), reg in frags.items():  # upper: fragment row lane/4 + 8
                    latent = 16 * block + 2 * (lane // 4) + upper
                    for q in range(4):
                        slot = 16 * half + 4 * (lane % 4) + q
                        ok &= bool(reg[q] == v[base + key_of_slot(slot), latent])
    return ok


if __name__ == "__main__":
    result = all(check(seed) for seed in range(4))
    print("design C V^T fragments and conflict-free ldmatrix:", "ok" if result else "MISMATCH")
    raise SystemExit(0 if result else 1)
