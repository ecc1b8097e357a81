// XQA-style paged MLA decode for consumer Blackwell (SM120/SM121), also built for sm_90a so that it runs and is
// tested on Hopper. Semantics are those of kernels/triton_decode/kernel.py (the package's reference kernel).
//
// Why it looks the way it does:
// * SM120 has neither wgmma nor tcgen05, so every product is a warp-level mma.sync fed by ldmatrix from shared
//   memory: m16n8k16 (bf16/fp16 in, fp32 accumulate) for 16-bit caches, m16n8k32 e4m3 for fp8 caches.
// * KV pages arrive by TMA (cp.async.bulk.tensor, 4-D tensor map over the cache: 64 columns x 9 column chunks
//   x tokens of a page x pages, one box per page slice of a tile, gathered through the block table) into a
//   ring of stages completed by mbarriers (arrive.expect_tx / try_wait.parity). The boxes are swizzled (128 B
//   for 16-bit rows, 64 B for fp8 rows), which keeps every ldmatrix of 8 consecutive keys conflict-free.
//   A page slice that starts at or past the end of the split is fetched from page -1: TMA zero-fills it and the
//   block-table entry (possibly garbage) is never read. Rows of the last tile past the split's end are zeroed
//   in shared memory after they land (stale cache slots may hold NaN, and 0 * NaN would poison P V).
// * A block may use at most 99 KB of dynamic shared memory on SM120: 2 stages of 32 keys x 1152 B (16-bit) or
//   4 stages of 32 keys x 576 B (fp8), plus the S reduction buffer, ~93 KB. Q stays in registers.
// * A 32-row x 512-column fp32 output accumulator is split over 8 warps: warp (rg, cq) owns rows
//   16*rg..16*rg+15 and V columns 128*cq..128*cq+127 (64 accumulator registers per thread). For S = Q K^T the
//   same four warps of a row group split the 576-long dot products (144 dims each) and sum their partial S
//   through shared memory in a fixed order, so all four hold bit-identical S and run the same online softmax.
// * fp8 e4m3 caches run natively in fp8 (m16n8k32 e4m3, twice the bf16 rate on SM120):
//   - Q K^T: a 16-bit q is quantised per row to e4m3 as hi + lo (hi = e4m3(q / s), lo = e4m3(q / s - hi), with
//     s = amax(|q row|) / 448 folded into the row's logit scale); hi and lo accumulate into the same S, so the
//     logits keep ~bf16 accuracy (a single e4m3 q measured 0.2 abs error on short rows, over the 0.15 budget).
//     An fp8 q is used as it is, with q_scale (one mma per k-step).
//   - P V: P (<= 1) is scaled by 256 (exact) and quantised to e4m3; the output divides it out. The V operand
//     needs key-contiguous bytes: an ldmatrix .b8 transpose exists only on SM100+, so V is read with the 16-bit
//     transpose (ldmatrix.trans.b16 on byte pairs) and the bytes are regrouped with two prmt per register. Keys
//     sit in the k slots in the order {2t, 2t+1, 8+2t, 9+2t} (per 16 keys), the same order P's A fragment is
//     packed in straight from the S accumulator, and each register holds two interleaved V columns, so the two
//     n-tiles of a 16-column span hold the even and the odd columns (undone in the epilogue).
//   - On sm_90a (no native fp8 mma.sync) each m16n8k32 e4m3 mma is emulated exactly by two m16n8k16 f16 mmas
//     on the same fragments (e4m3 -> f16 is exact; a dot product does not change under a permutation of k
//     applied to both operands). So the whole fp8 logic runs, and is tested, on Hopper.
// * Split-KV: the grid's split count is fixed on the host per batch size; each request trims it on the device
//   (request_splits, identical to _request_splits of the Triton kernel with BLOCK_N = this kernel's tile).
// * PDL: griddepcontrol.wait precedes every global read or write, griddepcontrol.launch_dependents follows
//   the last store.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "xqa_mla_params.h"

// Native e4m3 mma.sync: SM120/SM121. Elsewhere (sm_90a) it is emulated with f16 mmas. -DXQA_MLA_NATIVE_FP8_MMA=1
// forces the PTX instruction everywhere (on sm_90a ptxas then emulates it itself; used to cross-check).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1200 || (defined(XQA_MLA_NATIVE_FP8_MMA) && XQA_MLA_NATIVE_FP8_MMA))
#define XQA_MLA_FP8_MMA_NATIVE 1
#else
#define XQA_MLA_FP8_MMA_NATIVE 0
#endif

namespace xqa_mla {

constexpr int D_NOPE = 512;               // latent width: q_nope/k_nope and the whole of V
constexpr int D_QK = 576;                 // latent + rope
constexpr int D_PE = D_QK - D_NOPE;       // 64
constexpr int BLOCK_M = XQA_MLA_BLOCK_M;  // query rows (q_len * heads folded) per CTA
constexpr int BLOCK_N = XQA_MLA_BLOCK_N;  // keys per KV tile
constexpr int THREADS = XQA_MLA_THREADS;
constexpr int COL_GROUPS = 4;                          // warps sharing one 16-row group
constexpr int ROW_GROUPS = BLOCK_M / 16;               // 2
constexpr int QK_DIMS_PER_WARP = D_QK / COL_GROUPS;    // 144
constexpr int QK_KSTEPS = QK_DIMS_PER_WARP / 16;       // 9 (16-bit path)
constexpr int V_COLS_PER_WARP = D_NOPE / COL_GROUPS;   // 128
constexpr int V_NTILES = V_COLS_PER_WARP / 8;          // 16
constexpr int S_NTILES = BLOCK_N / 8;                  // 4
// fp8 path: each warp takes 128 latent dims (4 k32 steps) and 16 rope dims (half a k32 step)
constexpr int NOPE_K32_PER_WARP = D_NOPE / COL_GROUPS / 32;  // 4
constexpr int PE_DIMS_PER_WARP = D_PE / COL_GROUPS;          // 16
static_assert(ROW_GROUPS * COL_GROUPS * 32 == THREADS, "8 warps: 2 row groups x 4 column groups");
static_assert(QK_DIMS_PER_WARP % 16 == 0, "each warp's share of the dot product is whole k-steps");
static_assert(BLOCK_N == 32, "the fp8 P V step is one k32 mma per tile");

// Shared memory (from a 1024-aligned base): the KV ring, the S reduction buffer, the mbarriers.
// A KV row is stored unpadded (TMA writes dense boxes); the swizzle gives conflict-free ldmatrix instead.
constexpr int ROW16_BYTES = D_QK * 2;                                       // 1152 = 9 x 128 B
constexpr int ROW8_BYTES = D_QK;                                            // 576 = 9 x 64 B
constexpr int TILE16_BYTES = BLOCK_N * ROW16_BYTES;                         // 36864
constexpr int TILE8_BYTES = BLOCK_N * ROW8_BYTES;                           // 18432
constexpr int STAGES16 = 2;
constexpr int STAGES8 = 4;
constexpr int RING_BYTES = STAGES16 * TILE16_BYTES;                         // 73728
static_assert(STAGES8 * TILE8_BYTES == RING_BYTES, "both rings use the same bytes");
constexpr int SRED_STRIDE = BLOCK_N + 8;                                    // floats per S row (padded)
constexpr int SRED_BYTES = ROW_GROUPS * COL_GROUPS * 16 * SRED_STRIDE * 4;  // 20480
constexpr int SMEM_ALIGN = 1024;  // the 128 B swizzle pattern repeats every 1024 B: boxes start on it
constexpr int BAR_OFFSET = RING_BYTES + SRED_BYTES;
constexpr int SMEM_NEEDED = SMEM_ALIGN + BAR_OFFSET + 8 * 8;
static_assert(SMEM_NEEDED <= XQA_MLA_SMEM_BYTES, "smem constant out of date");
static_assert(XQA_MLA_SMEM_BYTES <= 99 * 1024, "SM120 allows at most 99 KB of dynamic shared memory per block");
static_assert(STAGES16 <= 8 && STAGES8 <= 8, "8 mbarrier slots");
static_assert(TILE16_BYTES % SMEM_ALIGN == 0 && TILE8_BYTES % SMEM_ALIGN == 0 && (16 * ROW8_BYTES) % SMEM_ALIGN == 0,
              "every TMA box (a tile or half a tile) starts 1024-aligned");

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float FP8_MAX = 448.f;
constexpr float P_SCALE = 256.f;  // P (<= 1) is scaled into e4m3's range before quantising; a power of two

// ---------------------------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier + TMA ----
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// One box of the 4-D KV tensor map: (column 0, chunk 0, token, page) -> dst, completing on bar.
__device__ __forceinline__ void tma_load_kv(uint32_t dst, const CUtensorMap* map, int token, int page, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(0), "r"(token), "r"(page), "r"(bar)
      : "memory");
}

// Shared address of byte `byte` of key `key` in a KV tile at `tile` (1024-aligned), through the TMA swizzle:
// 128 B (16-bit rows: 16-byte unit bits [4:6] ^= bits [7:9]) or 64 B (fp8 rows: bits [4:5] ^= bits [7:8]).
template <bool KV_FP8>
__device__ __forceinline__ uint32_t kv_addr(uint32_t tile, int key, int byte) {
  const uint32_t a = tile + static_cast<uint32_t>(key * (KV_FP8 ? ROW8_BYTES : ROW16_BYTES) + byte);
  return KV_FP8 ? a ^ ((a >> 3) & 0x30u) : a ^ ((a >> 3) & 0x70u);
}

// ---- ldmatrix / mma ----
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 bytes (low byte first) -> f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// D += A B for A 16x32 e4m3 (row), B 32x8 e4m3 (col), fp32 accumulate: PTX fragment layouts of m16n8k32
// (a0: row g, k 4t..4t+3; a1: row g+8, same k; a2/a3: k + 16; b0: k 4t..4t+3 of column g; b1: k + 16).
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if XQA_MLA_FP8_MMA_NATIVE
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // Exact emulation: k16 slot 2t+e <- k 4t+e and slot 8+2t+e <- k 4t+2+e (e = 0, 1), for both operands: the
  // low f16x2 of a converted e4m3x4 register is its bytes 0-1, the high one bytes 2-3.
  const uint32_t lo = 0, hi = 16;
  const uint32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  const uint32_t f0[4] = {e4m3x2_to_f16x2(a0 >> lo), e4m3x2_to_f16x2(a1 >> lo), e4m3x2_to_f16x2(a0 >> hi),
                          e4m3x2_to_f16x2(a1 >> hi)};
  mma_16816<__half>(c, f0, e4m3x2_to_f16x2(b0 >> lo), e4m3x2_to_f16x2(b0 >> hi));
  const uint32_t f1[4] = {e4m3x2_to_f16x2(a2 >> lo), e4m3x2_to_f16x2(a3 >> lo), e4m3x2_to_f16x2(a2 >> hi),
                          e4m3x2_to_f16x2(a3 >> hi)};
  mma_16816<__half>(c, f1, e4m3x2_to_f16x2(b1 >> lo), e4m3x2_to_f16x2(b1 >> hi));
#endif
}

// The same with the k 16..31 half zero (a2 = a3 = b1 = 0): one f16 mma when emulated.
__device__ __forceinline__ void mma_e4m3_khalf(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
#if XQA_MLA_FP8_MMA_NATIVE
  const uint32_t a[4] = {a0, a1, 0u, 0u};
  mma_e4m3(c, a, b0, 0u);
#else
  const uint32_t f[4] = {e4m3x2_to_f16x2(a0), e4m3x2_to_f16x2(a1), e4m3x2_to_f16x2(a0 >> 16),
                         e4m3x2_to_f16x2(a1 >> 16)};
  mma_16816<__half>(c, f, e4m3x2_to_f16x2(b0), e4m3x2_to_f16x2(b0 >> 16));
#endif
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// exp2 with -inf -> +0 (ex2.approx does that), the only special value the softmax feeds it.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Four floats -> four e4m3 bytes (round to nearest, saturating), x0 in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return (lo & 0xffffu) | (hi << 16);
}

// The four e4m3 bytes of a register back to floats.
__device__ __forceinline__ float4 unpack_e4m3x4(uint32_t v) {
  const uint32_t h0 = e4m3x2_to_f16x2(v), h1 = e4m3x2_to_f16x2(v >> 16);
  const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&h0));
  const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&h1));
  return make_float4(f0.x, f0.y, f1.x, f1.y);
}

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(*reinterpret_cast<__half*>(&h));
}

__device__ __forceinline__ int cdiv(int a, int b) { return (a + b - 1) / b; }

// Device half of split planning; the combine kernel calls the same function, so both agree on the splits.
__device__ __forceinline__ void request_splits(int seq_len, int num_splits, int min_chunk, int& n, int& chunk) {
  n = min(max(cdiv(seq_len, min_chunk), 1), num_splits);
  chunk = max(cdiv(cdiv(seq_len, n), BLOCK_N), 1) * BLOCK_N;
  // Rounding the chunk up to BLOCK_N can leave the last splits empty: count only non-empty ones.
  n = max(min(n, cdiv(seq_len, chunk)), 1);
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

// One element of q (dimension d of row (tok, head)) as float; d < 512 reads q_nope, else q_pe.
template <typename T>
__device__ __forceinline__ float load_q(const XqaMlaParams& p, int tok, int head, int d) {
  const bool nope = d < D_NOPE;
  const int64_t off = nope ? tok * p.stride_qn_t + head * p.stride_qn_h + d
                           : tok * p.stride_qp_t + head * p.stride_qp_h + (d - D_NOPE);
  const void* base = nope ? p.q_nope : p.q_pe;
  if (p.q_fp8) return fp8_to_float(static_cast<const uint8_t*>(base)[off]);
  return static_cast<float>(static_cast<const T*>(base)[off]);
}

// Four consecutive e4m3 bytes of an fp8 q (dims d..d+3, never straddling q_nope / q_pe), low byte first.
__device__ __forceinline__ uint32_t load_q8x4(const XqaMlaParams& p, int tok, int head, int d) {
  const bool nope = d < D_NOPE;
  const int64_t off = nope ? tok * p.stride_qn_t + head * p.stride_qn_h + d
                           : tok * p.stride_qp_t + head * p.stride_qp_h + (d - D_NOPE);
  const uint8_t* q = static_cast<const uint8_t*>(nope ? p.q_nope : p.q_pe) + off;
  return static_cast<uint32_t>(q[0]) | (static_cast<uint32_t>(q[1]) << 8) | (static_cast<uint32_t>(q[2]) << 16) |
         (static_cast<uint32_t>(q[3]) << 24);
}

// ---------------------------------------------------------------------------------------------------------
// split kernel: one CTA = one request x BLOCK_M query rows x one KV split
// ---------------------------------------------------------------------------------------------------------

// KV_FP8: the cache is e4m3 (fp8 mma path); Q8: q is e4m3 too (used as is; else a 16-bit q of type T is
// quantised as hi + lo). For 16-bit caches Q8 is false and an fp8 q is widened to T (runtime flag p.q_fp8).
template <typename T, bool KV_FP8, bool Q8>
__device__ __forceinline__ void split_kernel(const XqaMlaParams& p, const CUtensorMap* kv_map) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  constexpr int STAGES = KV_FP8 ? STAGES8 : STAGES16;
  constexpr int ROW_BYTES = KV_FP8 ? ROW8_BYTES : ROW16_BYTES;
  constexpr int TILE_BYTES = KV_FP8 ? TILE8_BYTES : TILE16_BYTES;
  static_assert(!Q8 || KV_FP8, "an fp8 q with a 16-bit cache is widened (Q8 = false)");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rg = warp / COL_GROUPS;  // row group: rows 16*rg .. 16*rg+15 of the CTA
  const int cq = warp % COL_GROUPS;  // column group: QK dims, V columns 128*cq..
  const int g = lane >> 2;           // mma fragment row (and row + 8)
  const int t = lane & 3;            // mma fragment column pair / quad
  const int m_blk = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;

  if (dynamic_smem_bytes() < static_cast<uint32_t>(SMEM_NEEDED)) __trap();
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base_u32 = (raw_u32 + SMEM_ALIGN - 1) & ~static_cast<uint32_t>(SMEM_ALIGN - 1);
  uint8_t* smem = smem_raw + (base_u32 - raw_u32);
  float* sred = reinterpret_cast<float*>(smem + RING_BYTES);
  const uint32_t bar0 = base_u32 + BAR_OFFSET;  // STAGES mbarriers, 8 bytes each
  auto stage_u32 = [&](int i) { return base_u32 + static_cast<uint32_t>((i % STAGES) * TILE_BYTES); };

  if (threadIdx.x == 0) {
    tma_prefetch_map(kv_map);  // a kernel parameter: independent of the previous kernel
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    mbar_init_fence();
  }
  __syncthreads();

  pdl_wait();  // everything below may read what the previous kernel wrote

  const int seq_len = p.seq_lens[b];
  int n_splits, chunk;
  request_splits(seq_len, p.num_splits, p.min_chunk, n_splits, chunk);
  if (split >= n_splits) {
    pdl_launch_dependents();
    return;  // the combine reads only this request's first n_splits partials
  }
  const int rows_total = p.q_len * p.num_heads;
  const int start = split * chunk;
  const int end = min(start + chunk, seq_len);
  const int num_tiles = end > start ? cdiv(end - start, BLOCK_N) : 0;
  const int* bt_row = p.block_table + static_cast<int64_t>(b) * p.stride_bt;
  // a tile is one box (pages of >= 32 tokens) or two (16-token pages)
  const int box_rows = p.page_size < BLOCK_N ? p.page_size : BLOCK_N;

  // Thread 0 issues tile i into stage i % STAGES: one box per page slice; a slice at or past `end` reads page
  // -1 (all out of bounds: TMA writes zeros and still counts the bytes), so its block-table entry is not read.
  auto issue_tile = [&](int i) {
    const int n0 = start + i * BLOCK_N;
    const uint32_t dst = stage_u32(i);
    const uint32_t bar = bar0 + 8 * (i % STAGES);
    mbar_arrive_expect_tx(bar, TILE_BYTES);
    for (int r = 0; r < BLOCK_N; r += box_rows) {
      const int key = n0 + r;
      const int page = key < end ? __ldg(bt_row + key / p.page_size) : -1;
      tma_load_kv(dst + r * ROW_BYTES, kv_map, key < end ? key % p.page_size : 0, page, bar);
    }
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES && i < num_tiles; ++i) issue_tile(i);
  }

  const float q_scale = p.q_scale_ptr ? *p.q_scale_ptr : p.q_scale_val;
  const float kv_scale = p.kv_scale_ptr ? *p.kv_scale_ptr : p.kv_scale_val;

  // The two rows this thread's fragments touch: g and g + 8 of its row group.
  int row[2], tok[2], head[2], limit[2];
  bool row_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row[i] = m_blk * BLOCK_M + rg * 16 + g + 8 * i;
    row_ok[i] = row[i] < rows_total;
    const int tq = row_ok[i] ? row[i] / p.num_heads : 0;
    head[i] = row_ok[i] ? row[i] - tq * p.num_heads : 0;
    tok[i] = b * p.q_len + tq;
    // causal inside the q block: token tq sees the first seq_len - q_len + tq + 1 keys, unless the count is
    // given per row (decode context parallelism: the q block's own tokens are not all in this rank's cache)
    int row_kv_len = 0;
    if (row_ok[i]) {
      row_kv_len = p.row_kv_lens ? min(p.row_kv_lens[b * p.q_len + tq], seq_len) : seq_len - p.q_len + 1 + tq;
    }
    limit[i] = min(row_kv_len, end);
  }

  // ---- Q as mma A fragments, and the logit scale (log2 domain) of each of the two rows ----
  float qk_scale[2];
  // 16-bit path: this warp's 144 dims (9 k16 steps). fp8 path: 4 k32 steps of latent dims (128*cq + 32*ks) and
  // one k32 step of rope (512 + 16*cq: hi in k 0..15 and lo in k 16..31, or q8 with k 16..31 zero).
  constexpr int QREGS = KV_FP8 ? (Q8 ? 4 * 4 + 2 : 2 * 4 * 4 + 4) : QK_KSTEPS * 4;
  uint32_t qf[QREGS];
  if constexpr (!KV_FP8) {
#pragma unroll
    for (int ks = 0; ks < QK_KSTEPS; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r & 1;
        const int d = cq * QK_DIMS_PER_WARP + ks * 16 + 2 * t + (r >> 1) * 8;
        float lo = 0.f, hi = 0.f;
        if (row_ok[i]) {
          lo = load_q<T>(p, tok[i], head[i], d);
          hi = load_q<T>(p, tok[i], head[i], d + 1);
        }
        qf[ks * 4 + r] = pack2<T>(lo, hi);
      }
    }
    qk_scale[0] = qk_scale[1] = p.sm_scale * q_scale * kv_scale * LOG2E;
  } else if constexpr (Q8) {
#pragma unroll
    for (int ks = 0; ks < NOPE_K32_PER_WARP; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int i = r & 1;
        const int d = cq * (D_NOPE / COL_GROUPS) + ks * 32 + (r >> 1) * 16 + 4 * t;
        qf[ks * 4 + r] = row_ok[i] ? load_q8x4(p, tok[i], head[i], d) : 0u;
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      qf[16 + i] = row_ok[i] ? load_q8x4(p, tok[i], head[i], D_NOPE + cq * PE_DIMS_PER_WARP + 4 * t) : 0u;
    }
    qk_scale[0] = qk_scale[1] = p.sm_scale * q_scale * kv_scale * LOG2E;
  } else {
    // 16-bit q -> per-row e4m3 hi + lo. Pass 1: the row's amax over all 576 dims (4 lanes x 4 warps).
    float amax[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (row_ok[i]) {
#pragma unroll 4
        for (int k = 0; k < NOPE_K32_PER_WARP * 8 + 4; ++k) {
          const int d = k < 32 ? cq * (D_NOPE / COL_GROUPS) + (k >> 3) * 32 + ((k >> 2) & 1) * 16 + 4 * t + (k & 3)
                               : D_NOPE + cq * PE_DIMS_PER_WARP + 4 * t + (k - 32);
          amax[i] = fmaxf(amax[i], fabsf(load_q<T>(p, tok[i], head[i], d)));
        }
      }
      amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 1));
      amax[i] = fmaxf(amax[i], __shfl_xor_sync(0xffffffffu, amax[i], 2));
    }
    float* red = sred + (rg * COL_GROUPS + cq) * 16;
    if (t == 0) {
      red[g] = amax[0];
      red[g + 8] = amax[1];
    }
    __syncthreads();
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float m = 0.f;
#pragma unroll
      for (int c = 0; c < COL_GROUPS; ++c) m = fmaxf(m, sred[(rg * COL_GROUPS + c) * 16 + g + 8 * i]);
      // s = amax / 448 maps the row onto e4m3's range; an all-zero row keeps s = 1
      const float s = m > 0.f ? m / FP8_MAX : 1.f;
      inv[i] = m > 0.f ? FP8_MAX / m : 1.f;
      qk_scale[i] = p.sm_scale * q_scale * kv_scale * s * LOG2E;
    }
    __syncthreads();  // sred is the S buffer from here on
    // Pass 2: quantise. Register layout: qf[ks*4 + r] = hi, qf[16 + ks*4 + r] = lo, qf[32..35] = rope.
    auto quant = [&](int i, int d, uint32_t& hi_reg, uint32_t& lo_reg) {
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = row_ok[i] ? load_q<T>(p, tok[i], head[i], d + e) * inv[i] : 0.f;
      hi_reg = pack_e4m3x4(x[0], x[1], x[2], x[3]);
      const float4 h = unpack_e4m3x4(hi_reg);
      lo_reg = pack_e4m3x4(x[0] - h.x, x[1] - h.y, x[2] - h.z, x[3] - h.w);
    };
#pragma unroll
    for (int ks = 0; ks < NOPE_K32_PER_WARP; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int d = cq * (D_NOPE / COL_GROUPS) + ks * 32 + (r >> 1) * 16 + 4 * t;
        quant(r & 1, d, qf[ks * 4 + r], qf[16 + ks * 4 + r]);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) quant(i, D_NOPE + cq * PE_DIMS_PER_WARP + 4 * t, qf[32 + i], qf[34 + i]);
  }

  float o[V_NTILES][4];
#pragma unroll
  for (int n = 0; n < V_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this thread's share of the row sum; lanes are summed at the end

  for (int it = 0; it < num_tiles; ++it) {
    const int n0 = start + it * BLOCK_N;
    const uint32_t tile_u32 = stage_u32(it);
    mbar_wait(bar0 + 8 * (it % STAGES), static_cast<uint32_t>((it / STAGES) & 1));
    if (n0 + BLOCK_N > end) {
      // last tile of the split: zero the rows past its end (stale slots of the last page may hold NaN)
      uint8_t* tile = smem + (it % STAGES) * TILE_BYTES;
      for (int off = (end - n0) * ROW_BYTES + threadIdx.x * 16; off < TILE_BYTES; off += THREADS * 16) {
        *reinterpret_cast<uint4*>(tile + off) = make_uint4(0u, 0u, 0u, 0u);
      }
      __syncthreads();
    }

    // ---- partial S over this warp's dims ----
    float s[S_NTILES][4];
#pragma unroll
    for (int n = 0; n < S_NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    if constexpr (!KV_FP8) {
#pragma unroll
      for (int ks = 0; ks < QK_KSTEPS; ++ks) {
        const int d0 = cq * QK_DIMS_PER_WARP + ks * 16;
        const uint32_t (&a)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&qf[ks * 4]);
#pragma unroll
        for (int np = 0; np < S_NTILES / 2; ++np) {
          const int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
          const int dim = d0 + ((lane >> 3) & 1) * 8;
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(kv_addr<false>(tile_u32, key, dim * 2), b0, b1, b2, b3);
          mma_16816<T>(s[2 * np], a, b0, b1);
          mma_16816<T>(s[2 * np + 1], a, b2, b3);
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < NOPE_K32_PER_WARP; ++ks) {
        const int d0 = cq * (D_NOPE / COL_GROUPS) + ks * 32;
#pragma unroll
        for (int np = 0; np < S_NTILES / 2; ++np) {
          // matrices: keys +0..7 / dims +0..15, keys +0..7 / +16..31, keys +8..15 / +0..15, keys +8..15 / +16..31
          const int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
          const int byte = d0 + ((lane >> 3) & 1) * 16;
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(kv_addr<true>(tile_u32, key, byte), b0, b1, b2, b3);
          const uint32_t (&ahi)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&qf[ks * 4]);
          mma_e4m3(s[2 * np], ahi, b0, b1);
          mma_e4m3(s[2 * np + 1], ahi, b2, b3);
          if constexpr (!Q8) {
            const uint32_t (&alo)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&qf[16 + ks * 4]);
            mma_e4m3(s[2 * np], alo, b0, b1);
            mma_e4m3(s[2 * np + 1], alo, b2, b3);
          }
        }
      }
      {
        // rope: 16 dims of 32 keys, one 8-key block per matrix
        uint32_t k4[4];
        ldmatrix_x4(kv_addr<true>(tile_u32, lane, D_NOPE + cq * PE_DIMS_PER_WARP), k4[0], k4[1], k4[2], k4[3]);
#pragma unroll
        for (int n = 0; n < S_NTILES; ++n) {
          if constexpr (Q8) {
            mma_e4m3_khalf(s[n], qf[16], qf[17], k4[n]);
          } else {
            const uint32_t (&a)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&qf[32]);  // hi, lo of the rope
            mma_e4m3(s[n], a, k4[n], k4[n]);
          }
        }
      }
    }
    float* my_red = sred + (rg * COL_GROUPS + cq) * 16 * SRED_STRIDE;
#pragma unroll
    for (int n = 0; n < S_NTILES; ++n) {
      *reinterpret_cast<float2*>(my_red + g * SRED_STRIDE + n * 8 + 2 * t) = make_float2(s[n][0], s[n][1]);
      *reinterpret_cast<float2*>(my_red + (g + 8) * SRED_STRIDE + n * 8 + 2 * t) = make_float2(s[n][2], s[n][3]);
    }
    __syncthreads();
    // Full S, summed in the same order by all four warps of the row group (bit-identical softmax state).
#pragma unroll
    for (int n = 0; n < S_NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int c = 0; c < COL_GROUPS; ++c) {
      const float* red = sred + (rg * COL_GROUPS + c) * 16 * SRED_STRIDE;
#pragma unroll
      for (int n = 0; n < S_NTILES; ++n) {
        const float2 lo = *reinterpret_cast<const float2*>(red + g * SRED_STRIDE + n * 8 + 2 * t);
        const float2 hi = *reinterpret_cast<const float2*>(red + (g + 8) * SRED_STRIDE + n * 8 + 2 * t);
        s[n][0] += lo.x;
        s[n][1] += lo.y;
        s[n][2] += hi.x;
        s[n][3] += hi.y;
      }
    }

    // ---- online softmax (log2 domain) ----
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < S_NTILES; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n0 + n * 8 + 2 * t + e;
          float v = s[n][2 * i + e] * qk_scale[i];
          v = j < limit[i] ? v : -INFINITY;
          s[n][2 * i + e] = v;
          mx = fmaxf(mx, v);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[i], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // rows that saw no key yet stay at 0
      const float alpha = fast_exp2(m_run[i] - m_use);
      m_run[i] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < S_NTILES; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(s[n][2 * i + e] - m_use);
          s[n][2 * i + e] = pv;
          sum += pv;
        }
      }
      l_run[i] = l_run[i] * alpha + sum;
#pragma unroll
      for (int n = 0; n < V_NTILES; ++n) {
        o[n][2 * i] *= alpha;
        o[n][2 * i + 1] *= alpha;
      }
    }

    // ---- O += P V: the S accumulator layout is the A fragment layout of the next mma ----
    if constexpr (!KV_FP8) {
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t pf[4];
        pf[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        pf[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        pf[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pf[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int key = kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
        for (int np = 0; np < V_NTILES / 2; ++np) {
          const int dim = cq * V_COLS_PER_WARP + np * 16 + (lane >> 4) * 8;
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4_trans(kv_addr<false>(tile_u32, key, dim * 2), b0, b1, b2, b3);
          mma_16816<T>(o[2 * np], pf, b0, b1);
          mma_16816<T>(o[2 * np + 1], pf, b2, b3);
        }
      }
    } else {
      // k slot order per 16 keys: {2t, 2t+1, 8+2t, 9+2t} -> P's a0 = (row g: S tiles 0 and 1), a2 = tiles 2, 3
      uint32_t pf[4];
      pf[0] = pack_e4m3x4(s[0][0] * P_SCALE, s[0][1] * P_SCALE, s[1][0] * P_SCALE, s[1][1] * P_SCALE);
      pf[1] = pack_e4m3x4(s[0][2] * P_SCALE, s[0][3] * P_SCALE, s[1][2] * P_SCALE, s[1][3] * P_SCALE);
      pf[2] = pack_e4m3x4(s[2][0] * P_SCALE, s[2][1] * P_SCALE, s[3][0] * P_SCALE, s[3][1] * P_SCALE);
      pf[3] = pack_e4m3x4(s[2][2] * P_SCALE, s[2][3] * P_SCALE, s[3][2] * P_SCALE, s[3][3] * P_SCALE);
#pragma unroll
      for (int sp = 0; sp < V_NTILES / 2; ++sp) {
        // 16 columns x 32 keys, transposed as byte pairs: r_m (keys 8m..8m+7) holds, for lane (g, t), keys
        // 2t and 2t+1 of columns cb+2g and cb+2g+1 (bytes: [2t][2g], [2t][2g+1], [2t+1][2g], [2t+1][2g+1])
        const int cb = cq * V_COLS_PER_WARP + sp * 16;
        uint32_t r0, r1, r2, r3;
        ldmatrix_x4_trans(kv_addr<true>(tile_u32, lane, cb), r0, r1, r2, r3);
        mma_e4m3(o[2 * sp], pf, prmt(r0, r1, 0x6420u), prmt(r2, r3, 0x6420u));      // columns cb + 2g
        mma_e4m3(o[2 * sp + 1], pf, prmt(r0, r1, 0x7531u), prmt(r2, r3, 0x7531u));  // columns cb + 2g + 1
      }
    }
    __syncthreads();  // every warp is done with this stage and the S buffer
    if (threadIdx.x == 0 && it + STAGES < num_tiles) issue_tile(it + STAGES);
  }

  // ---- epilogue ----
  // Output columns of accumulator o[n][2i + e]: 16-bit path 128*cq + 8n + 2t + e; fp8 path (n = 2 sp + h, the
  // even / odd column tiles of span sp) 128*cq + 16 sp + 4t + 2e + h. Either way the thread writes 16 pairs of
  // adjacent columns per row: (col_pair(k), first value, second value).
  auto col_pair = [&](int k) {
    return KV_FP8 ? cq * V_COLS_PER_WARP + (k >> 1) * 16 + 4 * t + 2 * (k & 1) : cq * V_COLS_PER_WARP + k * 8 + 2 * t;
  };
  auto pair_val = [&](int k, int i, int h) {
    return KV_FP8 ? o[2 * (k >> 1) + h][2 * i + (k & 1)] : o[k][2 * i + h];
  };
  const float p_unscale = KV_FP8 ? 1.f / P_SCALE : 1.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const bool has_keys = l > 0.f;
    const float inv_l = has_keys ? p_unscale / l : 0.f;
    const float lse2 = has_keys ? m_run[i] + __log2f(l) : -INFINITY;
    if (!row_ok[i]) continue;
    if (p.num_splits == 1) {
      const float f = inv_l * kv_scale;
      char* orow = static_cast<char*>(p.out) + (tok[i] * p.stride_o_t + head[i] * p.stride_o_h) * 2;
#pragma unroll
      for (int k = 0; k < V_NTILES; ++k) {
        const int col = col_pair(k);
        const float a = pair_val(k, i, 0) * f, c = pair_val(k, i, 1) * f;
        const uint32_t v = p.out_bf16 ? pack2<__nv_bfloat16>(a, c) : pack2<__half>(a, c);
        if (p.out_vec2) {
          *reinterpret_cast<uint32_t*>(orow + col * 2) = v;
        } else {
          reinterpret_cast<uint16_t*>(orow)[col] = static_cast<uint16_t>(v & 0xffff);
          reinterpret_cast<uint16_t*>(orow)[col + 1] = static_cast<uint16_t>(v >> 16);
        }
      }
      if (cq == 0 && t == 0) p.lse[tok[i] * p.stride_lse_t + head[i] * p.stride_lse_h] = lse2 * LN2;
    } else {
      const int64_t part = (static_cast<int64_t>(b) * rows_total + row[i]) * p.num_splits + split;
      float* prow = p.part_out + part * D_NOPE;
#pragma unroll
      for (int k = 0; k < V_NTILES; ++k) {
        *reinterpret_cast<float2*>(prow + col_pair(k)) =
            make_float2(pair_val(k, i, 0) * inv_l, pair_val(k, i, 1) * inv_l);
      }
      if (cq == 0 && t == 0) p.part_lse[part] = lse2;
    }
  }
  pdl_launch_dependents();
}

// ---------------------------------------------------------------------------------------------------------
// combine kernel: one CTA (128 threads x 4 columns) per (request, row)
// ---------------------------------------------------------------------------------------------------------

__device__ __forceinline__ void combine_kernel(const XqaMlaParams& p) {
  const int row = blockIdx.x;
  const int b = blockIdx.y;
  pdl_wait();
  const int seq_len = p.seq_lens[b];
  int n_splits, chunk;
  request_splits(seq_len, p.num_splits, p.min_chunk, n_splits, chunk);
  const float kv_scale = p.kv_scale_ptr ? *p.kv_scale_ptr : p.kv_scale_val;
  const int rows_total = p.q_len * p.num_heads;
  const int64_t base = (static_cast<int64_t>(b) * rows_total + row) * p.num_splits;

  float lse_max = -INFINITY;
  for (int s = 0; s < n_splits; ++s) lse_max = fmaxf(lse_max, p.part_lse[base + s]);
  const float lse_use = lse_max == -INFINITY ? 0.f : lse_max;
  float w_sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < n_splits; ++s) {
    const float w = fast_exp2(p.part_lse[base + s] - lse_use);
    w_sum += w;
    const float4 v = reinterpret_cast<const float4*>(p.part_out + (base + s) * D_NOPE)[threadIdx.x];
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  }
  const float inv = w_sum > 0.f ? kv_scale / w_sum : 0.f;
  const int tq = row / p.num_heads;
  const int head = row - tq * p.num_heads;
  const int tok = b * p.q_len + tq;
  char* orow = static_cast<char*>(p.out) + (tok * p.stride_o_t + head * p.stride_o_h) * 2;
  const int col = threadIdx.x * 4;
  const float a[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t v = p.out_bf16 ? pack2<__nv_bfloat16>(a[k], a[k + 1]) : pack2<__half>(a[k], a[k + 1]);
    if (p.out_vec2) {
      *reinterpret_cast<uint32_t*>(orow + (col + k) * 2) = v;
    } else {
      reinterpret_cast<uint16_t*>(orow)[col + k] = static_cast<uint16_t>(v & 0xffff);
      reinterpret_cast<uint16_t*>(orow)[col + k + 1] = static_cast<uint16_t>(v >> 16);
    }
  }
  if (threadIdx.x == 0) {
    p.lse[tok * p.stride_lse_t + head * p.stride_lse_h] =
        w_sum > 0.f ? (lse_use + __log2f(w_sum)) * LN2 : -INFINITY;
  }
  pdl_launch_dependents();
}

}  // namespace xqa_mla

// Entry points, unmangled so the driver-API loader finds them by name: q dtype x KV-cache kind. Out dtype (and
// for 16-bit caches an fp8 q) are runtime flags, read once per CTA.
#define XQA_MLA_SPLIT(NAME, T, KV_FP8, Q8)                                                                    \
  extern "C" __global__ void __launch_bounds__(XQA_MLA_THREADS, 1)                                           \
      NAME(const __grid_constant__ XqaMlaParams p, const __grid_constant__ CUtensorMap kv_map) {              \
    xqa_mla::split_kernel<T, KV_FP8, Q8>(p, &kv_map);                                                       \
  }
XQA_MLA_SPLIT(xqa_mla_split_bf16_kv16, __nv_bfloat16, false, false)
XQA_MLA_SPLIT(xqa_mla_split_fp16_kv16, __half, false, false)
XQA_MLA_SPLIT(xqa_mla_split_bf16_kv8, __nv_bfloat16, true, false)
XQA_MLA_SPLIT(xqa_mla_split_fp16_kv8, __half, true, false)
XQA_MLA_SPLIT(xqa_mla_split_fp8_kv8, __nv_bfloat16, true, true)

extern "C" __global__ void __launch_bounds__(XQA_MLA_COMBINE_THREADS) xqa_mla_combine(const XqaMlaParams p) {
  xqa_mla::combine_kernel(p);
}
