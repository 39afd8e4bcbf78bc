// GGUF block linears on activations quantized to 8 bits: integer dot products per 32 weights
// instead of unpacking every weight to float32 (llama.cpp's `ggml_vec_dot_<type>_q8_0` scheme).
//
// Activations: each row of x [M, K] is rounded once per linear, in one or both of two formats
// (whichever the segments' types read), stored structure-of-arrays (`Q8Rows`):
//   32-value blocks b (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; llama.cpp's q8_0 / q8_1):
//     d[b] = max|x_b| / 127,  q[i] = round_half_even(x[i] * (1 / d[b])) in [-127, 127],
//     ds[b] = d[b] * sum(q_b)                      (for the weight types with an offset)
//   256-value blocks B (the K-quants Q4_K, Q5_K, Q6_K; llama.cpp's q8_K, symmetric here):
//     dk[B] = max|x_B| / 127, qk rounded as above with dk[B], bsums[B][g] = the int16 sum of
//     qk over values 16 g .. 16 g + 15.
// One scale per 256 values lets a K-quant block apply its sub-block scales in integer
// arithmetic (below); the activation error is then that of llama.cpp's q8_K, not of Q8_0.
// A fused weight of mixed families (Q4_K rows next to Q8_0 rows) rounds x both ways.
//
// Weights of the 32-value types: per block the quants as 32 bytes, an integer dot with q in
// int32, then float scales:
//   signed quants    Q8_0 q, Q4_0 n - 8, Q5_0 n - 16:  acc += d_w d_x I
//   unsigned + min   Q4_1, Q5_1 (w = d n + m):         acc += d_w d_x I + m ds
// K-quants (w = d sc[s] u - dmin m[s] for Q4_K / Q5_K, d sc[g] (u - 32) for Q6_K), per
// 256-weight block and x row: the products of each 32-weight sub-block summed in int16 pairs
// (`_mm256_maddubs_epi16`, u <= 63 against |q| <= 127 stays within 32767), multiplied by the
// sub-block's integer scale and summed in int32 (`_mm256_dpwssd_epi32` with VNNI, else
// `_mm256_madd_epi16`), the min / bias terms from bsums (sum m[s] bsum[s], 32 sum sc[g]
// bsum[g]) likewise, then one conversion and one FMA per block:
//   acc += d_w dk (I - 32 S)  (Q6_K)   or   acc += d_w dk I - dmin dk M  (Q4_K, Q5_K)
// (llama.cpp's ggml_vec_dot_<type>_q8_K scheme).
// The integer dots: AVX512-VNNI `_mm256_dpbusd_epi32` (u8 x s8 -> i32) when compiled for it;
// else AVX2 `_mm256_maddubs_epi16` + `_mm256_madd_epi16` (exact while an int16 pair sum stays
// within 32767: u <= 63 or |w| <= 128 against |q| <= 127); else portable scalar code. Signed
// quants are read unsigned, u = w + B (Q4_0 B = 8, Q5_0 16, and Q8_0 128 with VNNI), and the
// dot starts from -B sum(q) (sum(u q) - B sum(q) = sum(w q)); Q8_0 without VNNI, whose u would
// overflow maddubs's pair sums, keeps the sign trick (|w| times q carrying w's sign).
// The result equals x_q @ dequantize(W)^T, x_q = d * q the rounded activations, up to the
// order of the float32 sums.
//
// In the row-group layout (gguf_blocks.h) Q8_0, Q4_0 and Q4_1 weights are read by lanes
// instead: one integer dot covers 4 rows of a group (lanes r and r + 4 hold row r; x's bytes
// are permuted to match), so the conversion, the scaling and the FMA serve 4 rows and no
// horizontal sum is needed per row; the offsets (Q4_1's m, Q4_0's -8 d, Q8_0's -128 d with
// VNNI, whose quants are then biased to unsigned) enter as m ds. This made batched GEMMs much
// faster than the per-row kernels, and batch 1 at least as fast (docs/benchmarks.md,
// "Measurements behind choices in the code").
// Q4_K and Q5_K groups are read by lanes too, per 32-weight sub-block: 4 integer dots (u8 x
// s8, no int16 pair sums), then one conversion and one FMA with the 4 rows' float scales
// d sc[s]; the mins term per block from the x sub-block sums (two int16 dots), and dk once per
// block (batched GEMMs faster than with the per-row maddubs kernel, batch 1 unchanged; same
// section of docs/benchmarks.md).
//
// Small batches (a speculative verification step's 1 + drafts rows) run in as few row passes
// as the registers allow (`row_passes`, cpu_gguf_q8_linear.cpp: up to 8 x rows per pass of
// the lane kernels, 4 of the row-per-pair ones), each pass decoding every weight block once
// for all its rows; on AVX2 the nibble types' lane dots sum their 4 maddubs results in int16
// before one madd (exact: at most 8 products of u <= 31 by |q| <= 127 per element). Every
// row's sums run in the same order whatever the pass size, so a row's output does not depend
// on the batch it came in.
//
// Work sharing is `linear_segments_tiles`'s (gguf_blocks.h), with the rounding of x first as one
// more work-sharing loop, so `linear_segments_tiles_q8` also runs inside the fused decoder's
// parallel region (cpu_decoder.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_blocks.h"

#if defined(PAGEDLLM_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDLLM_VNNI 1
#endif

namespace pagedllm {
namespace gguf {

// Rounded activations of M rows of K values, the scratch of one linear: the 32-value-block
// format (K a multiple of 32) and the 256-value-block one (K a multiple of 256), each filled
// only where a segment reads it (its pointers may be null otherwise).
struct Q8Rows {
  int8_t* q;         // [M, K]
  float* d;          // [M, K / 32]
  float* ds;         // [M, K / 32]
  int8_t* qk;        // [M, K]
  float* dk;         // [M, K / 256]
  int16_t* bsums;    // [M, K / 16]
};

// The buffers of a Q8Rows for M rows of up to K values, both formats.
struct Q8Buffers {
  std::vector<int8_t> q, qk;
  std::vector<float> d, ds, dk;
  std::vector<int16_t> bsums;
  Q8Buffers(int64_t M, int64_t K)
      : q(static_cast<size_t>(M * K)), qk(q.size()), d(static_cast<size_t>(M * (K / 32))),
        ds(d.size()), dk(static_cast<size_t>(M * (K / 256))),
        bsums(static_cast<size_t>(M * (K / 16))) {}
  Q8Rows rows() { return {q.data(), d.data(), ds.data(), qk.data(), dk.data(), bsums.data()}; }
};

// Which formats of Q8Rows a set of segments reads (bit mask).
enum : int { kQ8Blocks32 = 1, kQ8Blocks256 = 2 };
int q8_formats(const Segment* segments, int64_t num_segments);

// Which integer dot `linear_segments_tiles_q8` was compiled with: 0 portable, 1 AVX2, 2 VNNI.
int q8_dot_isa();

// Round rows [0, M) of x (row stride ldx) into the `formats` (kQ8Blocks32 | kQ8Blocks256) of
// `out` (layout above), one row per iteration of a work-sharing loop (ends with a barrier;
// serial outside a parallel region).
void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, const Q8Rows& out,
                      int formats);

// `linear_segments_tiles` on x rounded to 8 bits per block: x is rounded into `scratch` (sized
// for M rows of K), then every segment's work items run on it. Types must have passed
// `segments_supported`. For every thread of an enclosing parallel region; ends with a barrier.
void linear_segments_tiles_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                              const Segment* segments, int64_t num_segments, const float* bias,
                              float* y, int64_t ldy, const Q8Rows& scratch);

}  // namespace gguf
}  // namespace pagedllm
