"""Index arithmetic of the fp8 "design C" kernel (kernel_fp8seesaw.py), shared with its CPU test (no cutlass import).

Every function takes and returns integers built with ``+ * // % & | ^ << >>`` only, so the kernel calls it on its
dynamic ``cutlass.Int32`` lane / row / key values and tests/test_cute_fp8seesaw_cpu.py on Python ints: the test
emulates exactly the addresses and byte moves the kernel issues (docs/design/sm90_decode_budget.md section 2, C2).

* The K tile of a stage (64 keys x 576 e4m3, as TMA leaves it): 64-column chunks of 4 KB, 64-byte rows, the
  64-byte swizzle (16-byte unit XOR (key >> 1) & 3).
* V^T as the register A operand of ``wgmma.m64n64k32.e4m3`` (O^T = V^T P^T): per k-step of 32 keys, lane l of a
  warp gives ``ldmatrix.trans.x4`` the row address of key 32 k + l at the warp's 16 latent columns of a chunk;
  ``prmt`` 0x6420 / 0x7531 of registers (0, 1) and (2, 3) yield the fragment's a0..a3.
* The permutations that make this the A fragment: k slot s of a k-step holds key ``key_of_slot(s)`` (P^T, the B
  operand, is stored in that order), and accumulator row m of a warp's 16 holds latent column
  ``latent_of_row``: the two rows a thread holds (r, r + 8) are adjacent latent columns.
"""

from __future__ import annotations

CHUNK_BYTES = 64 * 64  # one 64-column chunk of a 64-key fp8 tile (and one 64 x 64 e4m3 P^T tile)
PRMT_LO = 0x6420  # bytes 0 and 2 of each of two registers: the first key of each 16-bit pair
PRMT_HI = 0x7531  # bytes 1 and 3: the second


def tile_offset(key, col):
    """Byte of (key, column) in one stage of the TMA-loaded K tile."""
    return (col // 64) * CHUNK_BYTES + key * 64 + ((((col % 64) // 16) ^ ((key >> 1) & 3)) << 4) + col % 16


def ldsm_offset(lane, warp, chunk, kstep):
    """The row address lane ``lane`` of consumer warp ``warp`` (0..3 in its group) gives ``ldmatrix.trans.x4``
    for k-step ``kstep`` (keys 32 kstep .. + 31) of chunk ``chunk``: matrix lane // 8 is keys 8 (lane // 8) ..
    + 7, each row the 16 bytes of the warp's latent columns 16 warp .. + 15 of the chunk."""
    key = 32 * kstep + lane
    return chunk * CHUNK_BYTES + key * 64 + ((warp ^ ((key >> 1) & 3)) << 4)


def ldsm_thread_base(lane, warp):
    """The kernel's form of ``ldsm_offset``: this per-thread part plus ``ldsm_immediate`` (the swizzle term
    depends on the lane only), so one register per thread serves every fragment load."""
    return lane * 64 + ((warp ^ ((lane >> 1) & 3)) << 4)


def ldsm_immediate(chunk, kstep):
    return chunk * CHUNK_BYTES + kstep * 32 * 64


def key_of_slot(slot):
    """The key (of 64) at k slot ``slot`` of P^T and of the V^T fragments: within each 16, slot 4 j + q holds
    key 2 j + q (q < 2) or 8 + 2 j + q - 2."""
    return (slot & 0x31) | ((slot & 2) << 2) | ((slot >> 1) & 6)


def slot_of_key(key):
    """The inverse of ``key_of_slot``."""
    return (key & 0x31) | ((key & 8) >> 2) | ((key & 6) << 1)


def fragment_key(lane, kstep, reg, byte):
    """The key that byte ``byte`` of A-fragment register ``reg`` (a0..a3) of lane ``lane`` holds at k-step
    ``kstep``: k slot 16 (reg >> 1) + 4 (lane % 4) + byte."""
    return 32 * kstep + key_of_slot(16 * (reg >> 1) + 4 * (lane % 4) + byte)


def latent_of_row(m):
    """The latent column (of a group's 256) of accumulator row ``m`` of O^T (64 rows per m-tile, 16 per warp):
    row r < 8 of a warp's 16 is column 2 r, row r + 8 is 2 r + 1."""
    r = m % 16
    return (m // 16) * 16 + 2 * (r % 8) + r // 8


def p_offset(row, slot):
    """Byte of (query row, k slot) in a 64 x 64 e4m3 P^T tile (K-major B operand, 64-byte swizzle)."""
    return row * 64 + (((slot >> 4) ^ ((row >> 1) & 3)) << 4) + (slot & 15)


def p_thread_base(lane, warp):
    """The kernel's form of ``p_offset(row, slot_of_key(key))`` for the 32 values of this thread's S accumulator
    (value v: row 16 warp + lane // 4 + 8 ((v >> 1) & 1), key 8 (v >> 2) + 2 (lane % 4) + (v & 1)):
    ``(base ^ xor) + immediate`` with this per-thread base and ``p_value_terms(v)`` (a 1 KB-aligned tile keeps the
    XOR on the offset's bits 4-5, which the base's row and key parts leave free for it)."""
    return (16 * warp + lane // 4) * 64 + 4 * (lane % 4) + (((lane >> 3) & 3) << 4)


def p_value_terms(v):
    """(xor, immediate) of value ``v`` for ``p_thread_base``: (v >> 3) << 4 and 512 ((v >> 1) & 1) + 2 ((v >> 2)
    & 1) + (v & 1)."""
    return (v >> 3) << 4, 512 * ((v >> 1) & 1) + 2 * ((v >> 2) & 1) + (v & 1)


def p_word_values(w):
    """The 4 values (v0, v0 + 1, v0 + 4, v0 + 5) of a thread's S accumulator that ``store_p_t`` writes as its
    4-byte word ``w`` (0..7), v0 = 8 (w >> 1) + 2 (w & 1): one row (same (v >> 1) & 1), keys 8 j + 2 (lane % 4)
    + (0, 1) and + 8 + (0, 1), which ``slot_of_key`` puts at slots 4 (lane % 4) + 0..3 of one 16-slot group;
    ``p_value_terms`` of the four are (xor, imm) .. (xor, imm + 3) with imm % 4 == 0, so the word is one aligned
    ``st.shared.b32`` at ``p_value_terms(v0)`` (the 32 lanes' words of one store fall in 32 distinct banks)."""
    v0 = 8 * (w >> 1) + 2 * (w & 1)
    return v0, v0 + 1, v0 + 4, v0 + 5


def s_value_coord(lane, warp, v):
    """(query row, key) of value ``v`` of a consumer thread's m64n64 S accumulator (the wgmma C layout)."""
    return 16 * warp + lane // 4 + 8 * ((v >> 1) & 1), 8 * (v >> 2) + 2 * (lane % 4) + (v & 1)


def ot_value_coord(lane, warp, v):
    """(accumulator row m, query row n) of value ``v`` of the 4 m-tiles of O^T a consumer thread holds."""
    row, col = s_value_coord(lane, warp, v % 32)
    return 64 * (v // 32) + row, col


def stage_thread_base(lane, warp, pitch):
    """The epilogue's staging tile (query rows ``pitch`` elements apart, a group's 256 latent columns): the element
    of this thread's O^T value 0 in its group's half, ``n * pitch + latent_of_row(m)`` of ``ot_value_coord``; value
    v is at this base + ``stage_value_offset(v, pitch)``. Values v and v + 2 (rows m and m + 8) are adjacent
    latent columns of one query row: one 4-byte store of two 16-bit outputs."""
    return 2 * (lane % 4) * pitch + 16 * warp + 2 * (lane // 4)


def stage_value_offset(v, pitch):
    """Value ``v``'s element offset from ``stage_thread_base``: query row 8 ((v >> 2) & 7) + (v & 1) further,
    latent column 64 (v >> 5) (its m-tile) + ((v >> 1) & 1) further."""
    return (8 * ((v >> 2) & 7) + (v & 1)) * pitch + 64 * (v >> 5) + ((v >> 1) & 1)


def ot_column_index(v):
    """Which of the thread's 16 query rows (columns of O^T: 8 j + 2 (lane % 4) + e, index 2 j + e) value ``v``
    of its O^T accumulator belongs to."""
    return 2 * ((v >> 2) & 7) + (v & 1)


def a_value_coord(lane, warp, v):
    """(accumulator row m, k slot) of byte ``v`` of a thread's V^T A fragments of one k-step (4 m-tiles x
    a0..a3 x 4 bytes, the order ``load_vt`` fills: register v // 4 = 4 m-tile + reg, byte v % 4): the wgmma
    m64nNk32 8-bit A layout, row 16 warp + lane // 4 (+ 8 for a1, a3), k 4 (lane % 4) + byte (+ 16 for a2, a3)."""
    i = v % 16
    return 64 * (v // 16) + 16 * warp + lane // 4 + 8 * ((i >> 2) & 1), 16 * (i >> 3) + 4 * (lane % 4) + (i & 3)
