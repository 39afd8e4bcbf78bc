// GGUF block linears on activations quantized to 8 bits: integer dot products per 32 weights
// instead of unpacking every weight to float32 (llama.cpp's `ggml_vec_dot_<type>_q8_0` scheme).
//
// Activations: each row of x [M, K] is rounded once per linear, per block of 32 values b:
//   d[b] = max|x_b| / 127,  q[i] = round_half_even(x[i] * (1 / d[b])) in [-127, 127],
//   ds[b] = d[b] * sum(q_b)                      (for the weight types with a min / offset)
// stored structure-of-arrays (`Q8Rows`: q [M, K] int8, d and ds [M, K / 32] float32), so a
// K-quant super-block's 8 scales load as one vector. Unlike llama.cpp's q8_K (one scale per
// 256 values) the K-quants use these 32-value blocks too: one rounding of x serves every type of
// a mixed fused weight (Q4_K q/k rows next to Q6_K v rows), and the activation error stays that
// of Q8_0.
//
// Weights: per 32-weight (sub-)block the quants as 32 bytes, an integer dot with q in int32,
// then float scales:
//   signed quants    Q8_0 q, Q4_0 n - 8, Q5_0 n - 16, Q6_K q - 32:  acc += d_w d_x I
//   unsigned + min   Q4_1, Q5_1 (w = d n + m):                      acc += d_w d_x I + m ds
//                    Q4_K, Q5_K (w = d sc[s] n - dmin m[s]):        acc += d sc[s] d_x I
//                                                                          - dmin m[s] ds
// with Q6_K's two 16-weight groups per sub-block scaled separately (lanes 0-3 / 4-7 of I).
// The integer dots: AVX512-VNNI `_mm256_dpbusd_epi32` (u8 x s8 -> i32) when compiled for it;
// else AVX2 `_mm256_maddubs_epi16` + `_mm256_madd_epi16` (exact while an int16 pair sum stays
// within 32767: u <= 63 or |w| <= 128 against |q| <= 127); else portable scalar code. Signed
// quants are read unsigned, u = w + B (Q4_0 B = 8, Q5_0 16, Q6_K 32, and Q8_0 128 with VNNI),
// and the dot starts from -B sum(q) (sum(u q) - B sum(q) = sum(w q)); Q8_0 without VNNI, whose
// u would overflow maddubs's pair sums, keeps the sign trick (|w| times q carrying w's sign).
// The result equals x_q @ dequantize(W)^T, x_q = d * q the rounded activations, up to the
// order of the float32 sums.
//
// In the row-group layout (gguf_blocks.h) Q8_0, Q4_0 and Q4_1 weights are read by lanes
// instead: one integer dot covers 4 rows of a group (lanes r and r + 4 hold row r; x's bytes
// are permuted to match), so the conversion, the scaling and the FMA serve 4 rows and no
// horizontal sum is needed per row; the offsets (Q4_1's m, Q4_0's -8 d, Q8_0's -128 d with
// VNNI, whose quants are then biased to unsigned) enter as m ds. On a 2-core Zen 4 this made
// batched (32-row) GEMMs 1.6-2.1x faster than the per-row kernels, and batch 1 at least as fast.
//
// Work sharing is `linear_segments_tiles`'s (gguf_blocks.h), with the rounding of x first as one
// more work-sharing loop, so `linear_segments_tiles_q8` also runs inside the fused decoder's
// parallel region (cpu_decoder.cpp).
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

#if defined(PAGEDLLM_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDLLM_VNNI 1
#endif

namespace pagedllm {
namespace gguf {

// Rounded activations of M rows of K values (K a multiple of 32), the scratch of one linear.
struct Q8Rows {
  int8_t* q;   // [M, K]
  float* d;    // [M, K / 32]
  float* ds;   // [M, K / 32]
};

// Which integer dot `linear_segments_tiles_q8` was compiled with: 0 portable, 1 AVX2, 2 VNNI.
int q8_dot_isa();

// Round rows [0, M) of x (row stride ldx) into `out` (layout above), one row per iteration of
// a work-sharing loop (ends with a barrier; serial outside a parallel region).
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, const Q8Rows& out);

// `linear_segments_tiles` on x rounded to 8 bits per block: x is rounded into `scratch` (sized
// for M rows of K), then every segment's work items run on it. Types must have passed
// `segments_supported`. For every thread of an enclosing parallel region; ends with a barrier.
void linear_segments_tiles_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                              const Segment* segments, int64_t num_segments, const float* bias,
                              float* y, int64_t ldy, const Q8Rows& scratch);

}  // namespace gguf
}  // namespace pagedllm
