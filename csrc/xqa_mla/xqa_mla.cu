// XQA-style paged MLA decode for consumer Blackwell (SM120/SM121), also built for sm_90a so that it runs and is
// tested on Hopper. Semantics are those of kernels/triton_decode/kernel.py (the package's reference kernel).
//
// Why it looks the way it does:
// * SM120 has neither wgmma nor tcgen05, so every product is a warp-level mma.sync m16n8k16 (bf16 or fp16 in,
//   fp32 accumulate) fed by ldmatrix from shared memory; this also compiles unchanged for sm_90a.
// * A block may use at most 99 KB of dynamic shared memory on SM120. The 576-wide KV tile (32 keys, double
//   buffered) and the S reduction buffer take ~94 KB, so Q stays in registers as mma A fragments.
// * A 32-row x 512-column fp32 output accumulator is split over 8 warps: warp (rg, cq) owns rows
//   16*rg..16*rg+15 and V columns 128*cq..128*cq+127 (64 accumulator registers per thread). For S = Q K^T the
//   same four warps of a row group split the 576-long dot products (144 dims each) and sum their partial S
//   through shared memory in a fixed order, so all four hold bit-identical S and run the same online softmax.
// * fp8 e4m3 KV is widened to the compute dtype in shared memory (exact), so the fp8 and 16-bit caches share
//   one mma path; q_scale * kv_scale * softmax_scale scale the logits and kv_scale the output.
// * Split-KV: the grid's split count is fixed on the host per batch size; each request trims it on the device
//   (request_splits, identical to _request_splits of the Triton kernel with BLOCK_N = this kernel's tile).
// * PDL: griddepcontrol.wait precedes every global read or write, griddepcontrol.launch_dependents follows
//   the last store.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include <type_traits>

#include "xqa_mla_params.h"

namespace xqa_mla {

constexpr int D_NOPE = 512;               // latent width: q_nope/k_nope and the whole of V
constexpr int D_QK = 576;                 // latent + rope
constexpr int BLOCK_M = XQA_MLA_BLOCK_M;  // query rows (q_len * heads folded) per CTA
constexpr int BLOCK_N = XQA_MLA_BLOCK_N;  // keys per KV tile
constexpr int THREADS = XQA_MLA_THREADS;
constexpr int COL_GROUPS = 4;                          // warps sharing one 16-row group
constexpr int ROW_GROUPS = BLOCK_M / 16;               // 2
constexpr int QK_DIMS_PER_WARP = D_QK / COL_GROUPS;    // 144
constexpr int QK_KSTEPS = QK_DIMS_PER_WARP / 16;       // 9
constexpr int V_COLS_PER_WARP = D_NOPE / COL_GROUPS;   // 128
constexpr int V_NTILES = V_COLS_PER_WARP / 8;          // 16
constexpr int S_NTILES = BLOCK_N / 8;                  // 4
static_assert(ROW_GROUPS * COL_GROUPS * 32 == THREADS, "8 warps: 2 row groups x 4 column groups");
static_assert(QK_DIMS_PER_WARP % 16 == 0, "each warp's share of the dot product is whole k-steps");

// Shared memory. Rows are padded by 16 bytes so that the 8 row addresses of one ldmatrix fall in 8 different
// bank groups (an unpadded 1152-byte row starts every row at bank 0).
constexpr int ROW16_BYTES = D_QK * 2 + 16;                                    // 1168
constexpr int TILE16_BYTES = BLOCK_N * ROW16_BYTES;                           // 37376
constexpr int ROW8_BYTES = D_QK + 16;                                         // 592
constexpr int TILE8_BYTES = BLOCK_N * ROW8_BYTES;                             // 18944
constexpr int SRED_STRIDE = BLOCK_N + 8;                                      // floats per S row (padded)
constexpr int SRED_BYTES = ROW_GROUPS * COL_GROUPS * 16 * SRED_STRIDE * 4;    // 20480
constexpr int SMEM_KV16 = 2 * TILE16_BYTES + SRED_BYTES;                      // 95232
constexpr int SMEM_KV8 = 2 * TILE8_BYTES + TILE16_BYTES + SRED_BYTES;         // 95744
static_assert(SMEM_KV16 <= XQA_MLA_SMEM_BYTES && SMEM_KV8 <= XQA_MLA_SMEM_BYTES, "smem constant out of date");
static_assert(XQA_MLA_SMEM_BYTES <= 99 * 1024, "SM120 allows at most 99 KB of dynamic shared memory per block");

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

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

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (keys past the chunk must not be stale smem:
// 0 * NaN would poison the P V product).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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

// Two e4m3 bytes -> two compute-dtype values, exactly (every e4m3 value is a bf16 and an fp16 value).
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t v) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
  if constexpr (std::is_same<T, __half>::value) {
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
  } else {
    __half2 hh = *reinterpret_cast<__half2*>(&h);
    float2 f = __half22float2(hh);
    return pack2<T>(f.x, f.y);
  }
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

// ---------------------------------------------------------------------------------------------------------
// KV tile loads
// ---------------------------------------------------------------------------------------------------------

// Gather keys [n0, n0 + BLOCK_N) of request b into a padded smem tile; keys >= end are zero-filled and their
// block-table entries are never read (they may lie past the table's width).
template <bool KV_FP8>
__device__ __forceinline__ void load_kv_tile(const XqaMlaParams& p, uint8_t* tile, const int* bt_row, int n0,
                                             int end) {
  constexpr int ROW_BYTES = KV_FP8 ? ROW8_BYTES : ROW16_BYTES;
  constexpr int CHUNKS_PER_ROW = D_QK * (KV_FP8 ? 1 : 2) / 16;  // 36 or 72
  const uint8_t* kv = static_cast<const uint8_t*>(p.kv);
  const uint32_t base = smem_u32(tile);
  for (int c = threadIdx.x; c < BLOCK_N * CHUNKS_PER_ROW; c += THREADS) {
    const int key = c / CHUNKS_PER_ROW;
    const int ch = c - key * CHUNKS_PER_ROW;
    const int j = n0 + key;
    const uint8_t* src = kv;
    int bytes = 0;
    if (j < end) {
      const int page = __ldg(bt_row + j / p.page_size);
      src = kv + static_cast<int64_t>(page) * p.stride_kv_blk_bytes +
            static_cast<int64_t>(j % p.page_size) * p.stride_kv_tok_bytes + ch * 16;
      bytes = 16;
    }
    cp_async_16(base + key * ROW_BYTES + ch * 16, src, bytes);
  }
}

// fp8 tile (row stride ROW8_BYTES) -> compute-dtype tile (row stride ROW16_BYTES), 8 values per step.
template <typename T>
__device__ __forceinline__ void widen_fp8_tile(const uint8_t* src, uint8_t* dst) {
  constexpr int GROUPS_PER_ROW = D_QK / 8;  // 72
  for (int c = threadIdx.x; c < BLOCK_N * GROUPS_PER_ROW; c += THREADS) {
    const int key = c / GROUPS_PER_ROW;
    const int grp = c - key * GROUPS_PER_ROW;
    const uint2 v = *reinterpret_cast<const uint2*>(src + key * ROW8_BYTES + grp * 8);
    uint4 w;
    w.x = fp8x2_to<T>(static_cast<uint16_t>(v.x & 0xffff));
    w.y = fp8x2_to<T>(static_cast<uint16_t>(v.x >> 16));
    w.z = fp8x2_to<T>(static_cast<uint16_t>(v.y & 0xffff));
    w.w = fp8x2_to<T>(static_cast<uint16_t>(v.y >> 16));
    *reinterpret_cast<uint4*>(dst + key * ROW16_BYTES + grp * 16) = w;
  }
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

// ---------------------------------------------------------------------------------------------------------
// split kernel: one CTA = one request x BLOCK_M query rows x one KV split
// ---------------------------------------------------------------------------------------------------------

template <typename T, bool KV_FP8>
__device__ __forceinline__ void split_kernel(const XqaMlaParams& p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int rg = warp / COL_GROUPS;  // row group: rows 16*rg .. 16*rg+15 of the CTA
  const int cq = warp % COL_GROUPS;  // column group: QK dims 144*cq.., V columns 128*cq..
  const int g = lane >> 2;           // mma fragment row (and row + 8)
  const int t = lane & 3;            // mma fragment column pair
  const int m_blk = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;

  if (dynamic_smem_bytes() < static_cast<uint32_t>(KV_FP8 ? SMEM_KV8 : SMEM_KV16)) __trap();

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

  constexpr int STAGE_BYTES = KV_FP8 ? TILE8_BYTES : TILE16_BYTES;
  auto stage = [&](int i) { return smem + (i & 1) * STAGE_BYTES; };  // arithmetic, not an array: no stack
  uint8_t* wide = smem + 2 * TILE8_BYTES;  // fp8 only: the widened tile
  float* sred = reinterpret_cast<float*>(smem + (KV_FP8 ? 2 * TILE8_BYTES + TILE16_BYTES : 2 * TILE16_BYTES));

  if (num_tiles > 0) load_kv_tile<KV_FP8>(p, stage(0), bt_row, start, end);
  cp_async_commit();

  const float q_scale = p.q_scale_ptr ? *p.q_scale_ptr : p.q_scale_val;
  const float kv_scale = p.kv_scale_ptr ? *p.kv_scale_ptr : p.kv_scale_val;
  const float qk_scale = p.sm_scale * q_scale * kv_scale * LOG2E;  // logits in the log2 domain

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
    // causal inside the q block: token tq sees the first seq_len - q_len + tq + 1 keys
    const int row_kv_len = row_ok[i] ? seq_len - p.q_len + 1 + tq : 0;
    limit[i] = min(row_kv_len, end);
  }

  // Q as mma A fragments (this warp's 144 dims of its 16 rows), widened from fp8 when q is fp8.
  uint32_t qf[QK_KSTEPS][4];
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
      qf[ks][r] = pack2<T>(lo, hi);
    }
  }

  float o[V_NTILES][4];
#pragma unroll
  for (int n = 0; n < V_NTILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // this thread's share of the row sum; lanes are summed at the end

  for (int it = 0; it < num_tiles; ++it) {
    const int n0 = start + it * BLOCK_N;
    if (it + 1 < num_tiles) load_kv_tile<KV_FP8>(p, stage(it + 1), bt_row, n0 + BLOCK_N, end);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint8_t* tile = stage(it);
    if constexpr (KV_FP8) {
      widen_fp8_tile<T>(stage(it), wide);
      __syncthreads();
      tile = wide;
    }
    const uint32_t tile_u32 = smem_u32(tile);

    // ---- partial S over this warp's 144 dims ----
    float s[S_NTILES][4];
#pragma unroll
    for (int n = 0; n < S_NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < QK_KSTEPS; ++ks) {
      const int d0 = cq * QK_DIMS_PER_WARP + ks * 16;
#pragma unroll
      for (int np = 0; np < S_NTILES / 2; ++np) {
        const int key = np * 16 + (lane >> 4) * 8 + (lane & 7);
        const int dim = d0 + ((lane >> 3) & 1) * 8;
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(tile_u32 + key * ROW16_BYTES + dim * 2, b0, b1, b2, b3);
        mma_16816<T>(s[2 * np], qf[ks], b0, b1);
        mma_16816<T>(s[2 * np + 1], qf[ks], b2, b3);
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
          float v = s[n][2 * i + e] * qk_scale;
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
        ldmatrix_x4_trans(tile_u32 + key * ROW16_BYTES + dim * 2, b0, b1, b2, b3);
        mma_16816<T>(o[2 * np], pf, b0, b1);
        mma_16816<T>(o[2 * np + 1], pf, b2, b3);
      }
    }
    __syncthreads();  // the next iteration overwrites this tile's stage and the S buffer
  }
  cp_async_wait<0>();

  // ---- epilogue ----
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = l_run[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const bool has_keys = l > 0.f;
    const float inv_l = has_keys ? 1.f / l : 0.f;
    const float lse2 = has_keys ? m_run[i] + __log2f(l) : -INFINITY;
    if (!row_ok[i]) continue;
    if (p.num_splits == 1) {
      const float f = inv_l * kv_scale;
      char* orow = static_cast<char*>(p.out) + (tok[i] * p.stride_o_t + head[i] * p.stride_o_h) * 2;
#pragma unroll
      for (int n = 0; n < V_NTILES; ++n) {
        const int col = cq * V_COLS_PER_WARP + n * 8 + 2 * t;
        const float a = o[n][2 * i] * f, c = o[n][2 * i + 1] * f;
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
      for (int n = 0; n < V_NTILES; ++n) {
        const int col = cq * V_COLS_PER_WARP + n * 8 + 2 * t;
        *reinterpret_cast<float2*>(prow + col) = make_float2(o[n][2 * i] * inv_l, o[n][2 * i + 1] * inv_l);
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

// Entry points, unmangled so the driver-API loader finds them by name. Compute dtype x KV-cache kind; q dtype
// (16-bit or fp8) and out dtype are runtime flags (read once per CTA, not per tile).
#define XQA_MLA_SPLIT(NAME, T, KV_FP8)                                                                    \
  extern "C" __global__ void __launch_bounds__(XQA_MLA_THREADS, 1) NAME(const XqaMlaParams p) {         \
    xqa_mla::split_kernel<T, KV_FP8>(p);                                                                \
  }
XQA_MLA_SPLIT(xqa_mla_split_bf16_kv16, __nv_bfloat16, false)
XQA_MLA_SPLIT(xqa_mla_split_bf16_kv8, __nv_bfloat16, true)
XQA_MLA_SPLIT(xqa_mla_split_fp16_kv16, __half, false)
XQA_MLA_SPLIT(xqa_mla_split_fp16_kv8, __half, true)

extern "C" __global__ void __launch_bounds__(XQA_MLA_COMBINE_THREADS) xqa_mla_combine(const XqaMlaParams p) {
  xqa_mla::combine_kernel(p);
}
