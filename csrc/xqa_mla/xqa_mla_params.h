// Kernel parameters of the XQA MLA decode kernels, passed by value as one struct.
// mla_backend_plugin/kernels/xqa_sm120/launch.py mirrors this layout with ctypes (XqaMlaParams there): change
// both together. Pointers and 64-bit strides first, then 32-bit fields, so there is no padding to mirror.
// The split kernels take a second by-value parameter: the CUtensorMap of the KV cache (TMA), encoded on the
// host (launch.py kv_tensor_map) with the box and swizzle that xqa_mla.cu expects.
#pragma once
#include <stdint.h>

// Tile shape and launch geometry; launch.py reads these numbers from this file.
#define XQA_MLA_BLOCK_M 32
#define XQA_MLA_BLOCK_N 32
#define XQA_MLA_THREADS 256
#define XQA_MLA_COMBINE_THREADS 128
// 1024 (alignment slack for the swizzled TMA boxes) + 73728 (KV ring: 2 x 36864 for 16-bit caches, 4 x 18432
// for fp8) + 20480 (S reduction buffer) + 64 (mbarriers)
#define XQA_MLA_SMEM_BYTES 95296

struct XqaMlaParams {
  const void* q_nope;         // [T, H, 512] q dtype (16-bit or fp8)
  const void* q_pe;           // [T, H, 64]
  const void* kv;             // [num_blocks, page_size, 576] compute dtype or fp8 (read through the tensor map)
  const int* block_table;     // [B, max_blocks]
  const int* seq_lens;        // [B]
  const int* row_kv_lens;     // [B, q_len] keys each query row sees (capped at seq_len), or null: causal rule
  void* out;                  // [T, H, 512] bf16/fp16
  float* lse;                 // [T, H], natural log
  float* part_out;            // [rows * splits, 512] fp32 partial outputs (normalised)
  float* part_lse;            // [rows * splits], log2 domain
  const float* q_scale_ptr;   // null: use q_scale_val
  const float* kv_scale_ptr;  // null: use kv_scale_val
  int64_t stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h;  // elements
  int64_t stride_kv_blk_bytes, stride_kv_tok_bytes;            // bytes
  int64_t stride_bt;                                           // elements
  int64_t stride_o_t, stride_o_h, stride_lse_t, stride_lse_h;  // elements
  float q_scale_val, kv_scale_val, sm_scale;
  int num_heads, q_len, page_size, num_splits, min_chunk;
  int q_fp8;     // q is float8_e4m3fn (16-bit caches: widened to the compute dtype on load)
  int out_bf16;  // out is bf16 (else fp16)
  int out_vec2;  // out is 4-byte aligned with even strides: store column pairs as one 32-bit word
};
