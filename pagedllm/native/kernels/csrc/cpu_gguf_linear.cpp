// y = x @ W^T (+ bias) with W kept in a GGML block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K; gguf_blocks.h), activations and accumulation in float32.
//
// Why: a GGUF model's weights are 4-8.5 bits each; dequantized to float32 at load they take 4-8x
// the memory and, since batch-1 decode streams every weight once per token, 4-8x the time. Here
// each block is unpacked in registers inside the dot product (as llama.cpp's ggml does), so only
// the quantized bytes are read from memory. The result equals x @ dequantize(W)^T up to the
// order of the float32 sums.
//
// Layout: x [M, K] float32 (row stride ldx), w [N, row_bytes] uint8 with row_bytes = K /
// kWeights * block bytes (K a multiple of the type's block: 32, or 256 for K-quants), bias [N]
// float32 or null, y [M, N] float32 (row stride ldy). A weight may be split into row segments
// of different types (a fused qkv of a Q4_K_M file: Q4_K q/k rows, Q6_K v rows); each segment
// writes its own output columns. Register blocking: MB rows of x times NB rows of w per
// micro-kernel call. Threads split work items (a block of x rows, a tile of w rows) as
// linear_kernel.h does (OpenMP, sharing torch's runtime); `linear_segments_tiles` is also
// called inside the fused decoder's parallel region (cpu_decoder.cpp).
//
// The same linears on activations rounded to 8 bits per block (integer dot products, llama.cpp's
// scheme) are in cpu_gguf_q8_linear.cpp / gguf_q8_dot.h.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "gguf_blocks.h"

namespace pagedllm {
namespace gguf {

#ifdef PAGEDLLM_AVX2
template <int MB, int NB, typename Q>
inline void micro(const float* x, int64_t ldx, const uint8_t* w, int64_t row_stride,
                  int64_t block_stride, int64_t prefetch, int64_t num_blocks, const float* bias,
                  float* y, int64_t ldy) {
  // Two accumulator sets at MB == 1 halve the FMA dependency chains; at MB > 1 the rows of x
  // give independent chains already.
  constexpr int kSets = MB == 1 ? 2 : 1;
  constexpr int kSubs = Q::kWeights / kBlock;
  __m256 acc[kSets][MB][NB];
  for (int s = 0; s < kSets; ++s)
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[s][i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (prefetch != 0)   // see RowLayout::prefetch_offset
      for (int j = 0; j < NB; ++j)
        prefetch_block<Q::kBytes>(w + j * row_stride + b * block_stride + prefetch);
    for (int sub = 0; sub < kSubs; ++sub) {
      for (int j = 0; j < NB; ++j) {
        __m256 wv[4];
        Q::unpack(w + j * row_stride + b * block_stride, sub, wv);
        for (int i = 0; i < MB; ++i) {
          const float* xp = x + i * ldx + b * Q::kWeights + sub * kBlock;
          for (int c = 0; c < 4; ++c) {
            __m256& a = acc[c % kSets][i][j];
            a = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8 * c), wv[c], a);
          }
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      __m256 a = acc[0][i][j];
      if constexpr (kSets == 2) a = _mm256_add_ps(a, acc[1][i][j]);
      y[i * ldy + j] = hsum(a) + (bias != nullptr ? bias[j] : 0.f);
    }
}
#else
template <int MB, int NB, typename Q>
inline void micro(const float* x, int64_t ldx, const uint8_t* w, int64_t row_stride,
                  int64_t block_stride, int64_t /*prefetch*/, int64_t num_blocks,
                  const float* bias, float* y, int64_t ldy) {
  constexpr int kSubs = Q::kWeights / kBlock;
  float acc[MB][NB] = {};
  float wv[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b)
    for (int sub = 0; sub < kSubs; ++sub)
      for (int j = 0; j < NB; ++j) {
        Q::unpack(w + j * row_stride + b * block_stride, sub, wv);
        for (int i = 0; i < MB; ++i) {
          const float* xp = x + i * ldx + b * Q::kWeights + sub * kBlock;
          float s = 0.f;
          for (int k = 0; k < kBlock; ++k) s += xp[k] * wv[k];
          acc[i][j] += s;
        }
      }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = acc[i][j] + (bias != nullptr ? bias[j] : 0.f);
}
#endif

// Rows [m0, m1) of x (m1 - m0 a multiple of MB) against w rows [n0, n1) (n0 a multiple of
// kGroupRows, so the NB-row runs stay within a row group).
template <int MB, typename Q>
void rows_block(const float* x, int64_t ldx, int64_t m0, int64_t m1, const RowLayout& w,
                int64_t num_blocks, int64_t n0, int64_t n1, const float* bias, float* y,
                int64_t ldy) {
  constexpr int NB = MB == 1 ? 4 : 2;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    int64_t n = n0;
    for (; n + NB <= n1; n += NB)
      micro<MB, NB, Q>(x + m * ldx, ldx, w.row(n), w.row_stride(n), w.block_stride(n),
                       w.prefetch_offset(n, NB), num_blocks,
                       bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
    for (; n < n1; ++n)
      micro<MB, 1, Q>(x + m * ldx, ldx, w.row(n), w.row_stride(n), w.block_stride(n),
                      w.prefetch_offset(n, 1), num_blocks,
                      bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
  }
}

// One work item: x rows [r0, r1) against the segment's weight rows [n0, n1) (segment-relative;
// `bias` and `y` already point at the segment's first output column). Lane-grouped rows
// (gguf_blocks.h) are read from plain copies.
template <typename Q>
void work_item(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t K,
               const Segment& seg, int64_t n0, int64_t n1, const float* bias, float* y,
               int64_t ldy) {
  const int64_t num_blocks = K / Q::kWeights, row_bytes = num_blocks * Q::kBytes;
  const int64_t r4 = r0 + (r1 - r0) / 4 * 4;
  if constexpr (LaneGroup<Q>::kLanes) {
    if (seg.grouped != 0) {
      std::vector<uint8_t> buf;
      int64_t first;
      const RowLayout w(readable_rows<Q>(seg, row_bytes, n0, n1, buf, &first), row_bytes,
                        Q::kBytes);
      const int64_t shift = n0 - first;   // the copy's row n is seg's row n + shift
      const float* b = bias != nullptr ? bias + shift : nullptr;
      rows_block<4, Q>(x, ldx, r0, r4, w, num_blocks, first, n1 - shift, b, y + shift, ldy);
      rows_block<1, Q>(x, ldx, r4, r1, w, num_blocks, first, n1 - shift, b, y + shift, ldy);
      return;
    }
  }
  const RowLayout w(seg, row_bytes, Q::kBytes);
  rows_block<4, Q>(x, ldx, r0, r4, w, num_blocks, n0, n1, bias, y, ldy);
  rows_block<1, Q>(x, ldx, r4, r1, w, num_blocks, n0, n1, bias, y, ldy);
}

using WorkItemFn = void (*)(const float*, int64_t, int64_t, int64_t, int64_t, const Segment&,
                            int64_t, int64_t, const float*, float*, int64_t);

// The work item of a GGML type code (ggml.h's enum ggml_type), or null for a type not taken.
WorkItemFn work_item_for(int64_t ggml_type) {
  WorkItemFn fn = nullptr;
  visit_block_type(ggml_type, [&](auto q) { fn = work_item<decltype(q)>; });
  return fn;
}

bool segments_supported(const Segment* segments, int64_t num_segments) {
  for (int64_t s = 0; s < num_segments; ++s)
    if (work_item_for(segments[s].ggml_type) == nullptr) return false;
  return true;
}

void linear_segments_tiles(const float* x, int64_t ldx, int64_t M, int64_t K,
                           const Segment* segments, int64_t num_segments, const float* bias,
                           float* y, int64_t ldy) {
  for_each_segment_item(M, segments, num_segments, bias, y,
                        [&](const Segment& seg, int64_t r0, int64_t r1, int64_t n0, int64_t n1,
                            const float* seg_bias, float* seg_y) {
                          work_item_for(seg.ggml_type)(x, ldx, r0, r1, K, seg, n0, n1,
                                                       seg_bias, seg_y, ldy);
                        });
}

// out[i] = dequantize(row ids[i] of the segment) for an embedding lookup, one row per work item.
template <typename Q>
void dequantize_rows(const Segment& seg, int64_t K, const int64_t* ids, int64_t num_ids,
                     float* out) {
  const int64_t num_blocks = K / Q::kWeights, row_bytes = num_blocks * Q::kBytes;
#pragma omp parallel for if (num_ids > 1)
  for (int64_t i = 0; i < num_ids; ++i) {
    std::vector<uint8_t> buf;
    int64_t n;
    const RowLayout w(readable_rows<Q>(seg, row_bytes, ids[i], ids[i] + 1, buf, &n), row_bytes,
                      Q::kBytes);
    const uint8_t* row = w.row(n);
    const int64_t stride = w.block_stride(n);
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int sub = 0; sub < Q::kWeights / kBlock; ++sub)
        Q::unpack(row + b * stride, sub, out + i * K + b * Q::kWeights + sub * kBlock);
  }
}

// Rows [0, rows / kGroupRows * kGroupRows) of a weight between plain rows and the row-group
// layout (gguf_blocks.h): src plain -> dst grouped, or back with `inverse`; one group per
// work item.
template <typename Q>
void regroup_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes,
                  bool inverse) {
  using L = LaneGroup<Q>;
  const int64_t num_blocks = row_bytes / Q::kBytes, groups = rows / kGroupRows;
  const int64_t group_bytes = kGroupRows * row_bytes;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int64_t r = 0; r < kGroupRows; ++r) {
        const int64_t plain = g * group_bytes + r * row_bytes + b * Q::kBytes;
        const int64_t rec = g * group_bytes + b * kGroupRows * Q::kBytes;
        auto move = [&](int64_t plain_at, int64_t grouped_at, int64_t n) {
          if (inverse)
            std::memcpy(dst + plain_at, src + grouped_at, static_cast<size_t>(n));
          else
            std::memcpy(dst + grouped_at, src + plain_at, static_cast<size_t>(n));
        };
        if constexpr (!L::kLanes) {
          move(plain, rec + r * Q::kBytes, Q::kBytes);
        } else {   // the 2-byte units and 4-byte chunks of LaneGroup's layout
          for (int o = 0; o < Q::kBytes; o += o < L::kScaleBytes ? 2 : 4)
            move(plain + o, rec + L::record_offset(o, r), o < L::kScaleBytes ? 2 : 4);
        }
      }
  }
}

}  // namespace gguf
}  // namespace pagedllm

extern "C" {

// `regroup_rows` for a GGML type code: returns 0, or -1 for a type not taken here.
int gguf_regroup_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes,
                      int64_t ggml_type, int inverse) {
  using namespace pagedllm::gguf;
  const bool taken = visit_block_type(ggml_type, [&](auto q) {
    regroup_rows<decltype(q)>(src, dst, rows, row_bytes, inverse != 0);
  });
  return taken ? 0 : -1;
}

// y[:, r : r + rows] = x @ W_s^T (+ bias[r : r + rows]) for each segment s = (data, r, rows,
// type) of one weight, in one parallel region. Returns 0, or -1 if a segment's type is not
// taken here (nothing is written then).
int linear_gguf_segments(const float* x, int64_t ldx, int64_t M, int64_t K,
                         const pagedllm::gguf::Segment* segments, int64_t num_segments,
                         const float* bias, float* y, int64_t ldy) {
  using namespace pagedllm::gguf;
  if (!segments_supported(segments, num_segments)) return -1;
#pragma omp parallel
  linear_segments_tiles(x, ldx, M, K, segments, num_segments, bias, y, ldy);
  return 0;
}


}  // extern "C"

extern "C" {

// out [num_ids, K] float32 = the rows `ids` of the segment (its data K / kWeights * block
// bytes per row, plain or grouped, gguf_blocks.h). Returns 0, -1 for a type not taken here,
// or -2 for an id outside [0, rows) (nothing written either way).
int dequantize_rows_gguf(const pagedllm::gguf::Segment* segment, int64_t K, const int64_t* ids,
                         int64_t num_ids, float* out) {
  using namespace pagedllm::gguf;
  for (int64_t i = 0; i < num_ids; ++i)
    if (ids[i] < 0 || ids[i] >= segment->rows) return -2;
  const bool taken = visit_block_type(segment->ggml_type, [&](auto q) {
    dequantize_rows<decltype(q)>(*segment, K, ids, num_ids, out);
  });
  return taken ? 0 : -1;
}

}  // extern "C"
