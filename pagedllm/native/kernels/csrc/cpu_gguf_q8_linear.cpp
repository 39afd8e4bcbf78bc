// The 8-bit-activation GGUF linears of gguf_q8_dot.h (see there for the scheme): the
// register-blocked micro-kernels (MB rows of x times NB rows of w, as cpu_gguf_linear.cpp's float
// path) and their work sharing, plus the module path's entry points `linear_gguf_segments_q8` and
// `quantize_rows_gguf_q8`. The rounding of x and the per-type weight decoders are in
// gguf_q8_blocks.h, the lane-group micro-kernels in gguf_q8_lanes.h.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "gguf_q8_blocks.h"
#include "gguf_q8_dot.h"
#include "gguf_q8_lanes.h"

namespace pagedllm {
namespace gguf {

int q8_dot_isa() {
#if defined(PAGEDLLM_VNNI)
  return 2;
#elif defined(PAGEDLLM_AVX2)
  return 1;
#else
  return 0;
#endif
}

namespace {

// --- micro-kernels: y[i][j] = dot(x_q row i, w row j) (+ bias[j]) for i < MB, j < NB.
// `x` holds the MB rows' rounded activations from the block under the row's first weight
// (row strides ldq bytes of q, ldb scales, ldg bsums).

#ifdef PAGEDLLM_AVX2
// Block b of NB rows (w: block b of the first row, rows row_stride apart) requested ahead, at
// `prefetch` bytes on (see RowLayout::prefetch_offset; 0: nothing).
template <int NB, typename Q>
inline void prefetch_rows(const uint8_t* w, int64_t row_stride, int64_t prefetch) {
  if (prefetch != 0)
    for (int j = 0; j < NB; ++j) prefetch_block<Q::kBytes>(w + j * row_stride + prefetch);
}

// y[i * ldy + j] = the sum of acc[i][j]'s lanes (+ bias[j]).
template <int MB, int NB>
inline void store_sums(const __m256 (&acc)[MB][NB], const float* bias, float* y, int64_t ldy) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[i * ldy + j] = hsum(acc[i][j]) + (bias != nullptr ? bias[j] : 0.f);
}

// The 32-value types. Per (x row, block): the float scale dx, and the start of the integer
// dots: -kBias sum(qx) per 4-byte lane (zero without a bias). Per (w row, block): the scale.
// Per pair: one integer dot, a conversion and one FMA.
template <int MB, int NB, typename Q>
inline void micro_q8(const Q8View& x, const uint8_t* w, int64_t row_stride, int64_t block_stride,
                     int64_t prefetch, int64_t num_blocks, const float* bias, float* y,
                     int64_t ldy) {
  using W = Q8Weights<Q>;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    prefetch_rows<NB, Q>(w + b * block_stride, row_stride, prefetch);
    typename W::Scales sc[NB];
    for (int j = 0; j < NB; ++j) W::scales(w + j * row_stride + b * block_stride, &sc[j]);
    __m256i qx[MB], start[MB];
    float dx[MB];
    for (int i = 0; i < MB; ++i) {
      qx[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + i * x.ldq + b * kBlock));
      dx[i] = x.d[i * x.ldb + b];
      start[i] = _mm256_setzero_si256();
      if constexpr (W::kBias != 0)   // -kBias * (sums of qx per lane)
        start[i] = _mm256_sub_epi32(
            start[i], dot_u8s8(start[i], _mm256_set1_epi8(static_cast<char>(W::kBias)), qx[i]));
      if constexpr (W::kMin) {   // m ds / 8 in each lane (exact: a power of two)
        const __m256 ds = _mm256_set1_ps(x.ds[i * x.ldb + b] * 0.125f);
        for (int j = 0; j < NB; ++j)
          acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(sc[j].m), ds, acc[i][j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m256i qw = W::quants(w + j * row_stride + b * block_stride);
      const __m256i uw = W::kSigned ? _mm256_sign_epi8(qw, qw) : qw;
      for (int i = 0; i < MB; ++i) {
        const __m256i sx = W::kSigned ? _mm256_sign_epi8(qx[i], qw) : qx[i];
        const __m256 prod = _mm256_cvtepi32_ps(dot_u8s8(start[i], uw, sx));
        acc[i][j] = _mm256_fmadd_ps(prod, _mm256_set1_ps(sc[j].d * dx[i]), acc[i][j]);
      }
    }
  }
  store_sums<MB, NB>(acc, bias, y, ldy);
}

// The K-quants on 256-value activation blocks. Per (w row, block) its KScales; per (x row,
// w row) and sub-block: maddubs (int16 pair sums) and one int16 dot with the sub-block's
// scales into an int32 sum; per block the bsums term, one conversion and one FMA (two for the
// min of Q4_K / Q5_K).
template <int MB, int NB, typename Q>
inline void micro_q8k(const Q8View& x, const uint8_t* w, int64_t row_stride,
                      int64_t block_stride, int64_t prefetch, int64_t num_blocks,
                      const float* bias, float* y, int64_t ldy) {
  using W = KWeights<Q>;
  constexpr int kSubs = Q::kWeights / kBlock;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    prefetch_rows<NB, Q>(w + b * block_stride, row_stride, prefetch);
    KScales sc[NB];
    for (int j = 0; j < NB; ++j) W::scales(w + j * row_stride + b * block_stride, &sc[j]);
    __m256i isum[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) isum[i][j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < kSubs; ++s) {
      __m256i qx[MB];
      for (int i = 0; i < MB; ++i)
        qx[i] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.q + i * x.ldq + b * Q::kWeights + s * kBlock));
      for (int j = 0; j < NB; ++j) {
        const __m256i qw = W::quants(w + j * row_stride + b * block_stride, s);
        const __m256i scale = W::sub_scale(sc[j], s);
        for (int i = 0; i < MB; ++i)
          isum[i][j] = dot_s16(isum[i][j], _mm256_maddubs_epi16(qw, qx[i]), scale);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m256i bs =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsums + i * x.ldg + b * 16));
      const float dx = x.d[i * x.ldb + b];
      for (int j = 0; j < NB; ++j) {
        const __m256i g = _mm256_madd_epi16(sc[j].group, bs);
        if constexpr (W::kMin) {
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]),
                                      _mm256_set1_ps(sc[j].d * dx), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g), _mm256_set1_ps(-sc[j].dmin * dx),
                                      acc[i][j]);
        } else {   // Q6_K: minus 32 sc[g] bsum[g]
          const __m256i total = _mm256_sub_epi32(isum[i][j], _mm256_slli_epi32(g, 5));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(sc[j].d * dx),
                                      acc[i][j]);
        }
      }
    }
  }
  store_sums<MB, NB>(acc, bias, y, ldy);
}
#else
template <int MB, int NB, typename Q>
inline void micro_q8(const Q8View& x, const uint8_t* w, int64_t row_stride, int64_t block_stride,
                     int64_t /*prefetch*/, int64_t num_blocks, const float* bias, float* y,
                     int64_t ldy) {
  using W = Q8Weights<Q>;
  float acc[MB][NB] = {};
  int32_t qw[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = w + j * row_stride + b * block_stride;
      typename W::Scales sc;
      W::scales(blk, &sc);
      W::quants(blk, qw);
      for (int i = 0; i < MB; ++i) {
        const int8_t* qx = x.q + i * x.ldq + b * kBlock;
        int32_t dot = 0;   // (biased quants: minus kBias sum(qx))
        for (int l = 0; l < kBlock; ++l) dot += (qw[l] - W::kBias) * qx[l];
        acc[i][j] += x.d[i * x.ldb + b] * sc.d * static_cast<float>(dot);
        if constexpr (W::kMin) acc[i][j] += sc.m * x.ds[i * x.ldb + b];
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = acc[i][j] + (bias != nullptr ? bias[j] : 0.f);
}

template <int MB, int NB, typename Q>
inline void micro_q8k(const Q8View& x, const uint8_t* w, int64_t row_stride,
                      int64_t block_stride, int64_t /*prefetch*/, int64_t num_blocks,
                      const float* bias, float* y, int64_t ldy) {
  using W = KWeights<Q>;
  constexpr int kSubs = Q::kWeights / kBlock;
  float acc[MB][NB] = {};
  int32_t qw[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = w + j * row_stride + b * block_stride;
      KScales sc;
      W::scales(blk, &sc);
      int32_t isum[MB] = {};
      for (int s = 0; s < kSubs; ++s) {
        W::quants(blk, s, qw);
        for (int i = 0; i < MB; ++i) {
          const int8_t* qx = x.q + i * x.ldq + b * Q::kWeights + s * kBlock;
          for (int l = 0; l < kBlock; ++l) isum[i] += sc.sub[2 * s + l / 16] * qw[l] * qx[l];
        }
      }
      for (int i = 0; i < MB; ++i) {
        const int16_t* bs = x.bsums + i * x.ldg + b * 16;
        int32_t g = 0;
        for (int k = 0; k < 16; ++k) g += sc.group[k] * bs[k];
        const float dx = x.d[i * x.ldb + b];
        if constexpr (W::kMin)
          acc[i][j] += sc.d * dx * static_cast<float>(isum[i]) -
                       sc.dmin * dx * static_cast<float>(g);
        else
          acc[i][j] += sc.d * dx * static_cast<float>(isum[i] - 32 * g);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = acc[i][j] + (bias != nullptr ? bias[j] : 0.f);
}
#endif

// Rows [m0, m1) of x (m1 - m0 a multiple of MB) against w rows [n0, n1) (n0 a multiple of
// kGroupRows, so the NB-row runs stay within a row group).
template <int MB, typename Q>
void rows_block_q8(const Q8Rows& xq, int64_t K, int64_t m0, int64_t m1, const RowLayout& w,
                   int64_t num_blocks, int64_t n0, int64_t n1, const float* bias, float* y,
                   int64_t ldy) {
  constexpr int NB = MB == 1 ? 4 : 2;
  constexpr bool kSuperBlocks = Q::kWeights == kSuper;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    const Q8View x = q8_view<Q>(xq, K, m);
    int64_t n = n0;
    auto run = [&](auto nb) {
      constexpr int kNB = decltype(nb)::value;
      const float* b = bias != nullptr ? bias + n : nullptr;
      if constexpr (kSuperBlocks)
        micro_q8k<MB, kNB, Q>(x, w.row(n), w.row_stride(n), w.block_stride(n),
                              w.prefetch_offset(n, kNB), num_blocks, b, y + m * ldy + n, ldy);
      else
        micro_q8<MB, kNB, Q>(x, w.row(n), w.row_stride(n), w.block_stride(n),
                             w.prefetch_offset(n, kNB), num_blocks, b, y + m * ldy + n, ldy);
    };
    for (; n + NB <= n1; n += NB) run(std::integral_constant<int, NB>{});
    for (; n < n1; ++n) run(std::integral_constant<int, 1>{});
  }
}

// The row passes of a work item's x rows [r0, r1): `pass(std::integral_constant<int, MB>,
// m0, m1)` for row ranges of a multiple of MB rows, MB <= kMaxRows. Each pass of a
// micro-kernel decodes every weight block once for its MB rows, so a small batch (a
// speculative verification step's 1 + drafts rows) goes in as few passes as the registers
// allow: up to 2 kMaxRows rows as ceil(rows / kMaxRows) passes as even as possible (3 rows one
// pass of 3, 9 rows 5 + 4 with kMaxRows 8), where passes of 4 and then of 1 (what larger
// batches use) read the weights once per pass. More rows: passes of 4, then one pass of the 1-3
// left.
template <int kMaxRows, typename Fn>
void row_passes(int64_t r0, int64_t r1, Fn&& pass) {
  static_assert(kMaxRows >= 4 && kMaxRows <= 8, "row passes of 1..8 rows");
  auto one = [&](int64_t rows, int64_t m0, int64_t m1) {
    auto call = [&](auto mb) {
      if constexpr (decltype(mb)::value <= kMaxRows) pass(mb, m0, m1);
    };
    switch (rows) {
      case 1: return call(std::integral_constant<int, 1>{});
      case 2: return call(std::integral_constant<int, 2>{});
      case 3: return call(std::integral_constant<int, 3>{});
      case 4: return call(std::integral_constant<int, 4>{});
      case 5: return call(std::integral_constant<int, 5>{});
      case 6: return call(std::integral_constant<int, 6>{});
      case 7: return call(std::integral_constant<int, 7>{});
      case 8: return call(std::integral_constant<int, 8>{});
    }
  };
  const int64_t rows = r1 - r0;
  if (rows <= 0) return;
  if (rows <= 2 * kMaxRows) {
    const int64_t passes = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t p = 0, m = r0; p < passes; ++p) {
      const int64_t size = rows / passes + (p < rows % passes ? 1 : 0);
      one(size, m, m + size);
      m += size;
    }
    return;
  }
  const int64_t r4 = r0 + rows / 4 * 4;
  one(4, r0, r4);
  if (r4 < r1) one(r1 - r4, r4, r1);
}

// Rows per pass at most: the lane kernels (one accumulator per x row) 8, the row-per-pair
// kernels (MB x NB accumulators, NB = 2) 4.
constexpr int kMaxLaneRows = 8, kMaxPairRows = 4;

// `work_item_q8` on a lane-grouped segment: the whole groups by lanes (AVX2), the plain rows
// after them by rows_block_q8; without AVX2 all of them by rows_block_q8 on plain copies.
template <typename Q>
void lane_group_item_q8(const Q8Rows& xq, int64_t r0, int64_t r1, int64_t K, const Segment& seg,
                        int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  const int64_t num_blocks = K / Q::kWeights, row_bytes = num_blocks * Q::kBytes;
#ifdef PAGEDLLM_AVX2
  const int64_t end = std::min(n1, seg.rows / kGroupRows * kGroupRows);
  if (end > n0) {
    row_passes<kMaxLaneRows>(r0, r1, [&](auto mb, int64_t m0, int64_t m1) {
      lanes_block_q8<decltype(mb)::value, Q>(xq, K, m0, m1, seg.data, row_bytes, n0, end, bias,
                                             y, ldy);
    });
    n0 = end;
  }
#endif
  if (n0 >= n1) return;
  std::vector<uint8_t> buf;
  int64_t first;
  const RowLayout w(readable_rows<Q>(seg, row_bytes, n0, n1, buf, &first), row_bytes,
                    Q::kBytes);
  const int64_t shift = n0 - first;   // the rows' row n is seg's row n + shift
  if (bias != nullptr) bias += shift;
  y += shift;
  row_passes<kMaxPairRows>(r0, r1, [&](auto mb, int64_t m0, int64_t m1) {
    rows_block_q8<decltype(mb)::value, Q>(xq, K, m0, m1, w, num_blocks, first, n1 - shift, bias,
                                          y, ldy);
  });
}

// One work item: rounded x rows [r0, r1) against the segment's weight rows [n0, n1)
// (segment-relative; `bias` and `y` already point at the segment's first output column).
template <typename Q>
void work_item_q8(const Q8Rows& xq, int64_t r0, int64_t r1, int64_t K, const Segment& seg,
                  int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  if constexpr (LaneGroup<Q>::kLanes) {
    if (seg.grouped != 0) return lane_group_item_q8<Q>(xq, r0, r1, K, seg, n0, n1, bias, y, ldy);
  }
  const int64_t num_blocks = K / Q::kWeights;
  const RowLayout w(seg, num_blocks * Q::kBytes, Q::kBytes);
  row_passes<kMaxPairRows>(r0, r1, [&](auto mb, int64_t m0, int64_t m1) {
    rows_block_q8<decltype(mb)::value, Q>(xq, K, m0, m1, w, num_blocks, n0, n1, bias, y, ldy);
  });
}

using WorkItemQ8Fn = void (*)(const Q8Rows&, int64_t, int64_t, int64_t, const Segment&, int64_t,
                              int64_t, const float*, float*, int64_t);

WorkItemQ8Fn work_item_q8_for(int64_t ggml_type) {
  WorkItemQ8Fn fn = nullptr;
  visit_block_type(ggml_type, [&](auto q) { fn = work_item_q8<decltype(q)>; });
  return fn;
}

}  // namespace

int q8_formats(const Segment* segments, int64_t num_segments) {
  int formats = 0;
  for (int64_t s = 0; s < num_segments; ++s)
    visit_block_type(segments[s].ggml_type, [&](auto q) {
      formats |= decltype(q)::kWeights == kSuper ? kQ8Blocks256 : kQ8Blocks32;
    });
  return formats;
}

void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, const Q8Rows& out,
                      int formats) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    if (formats & kQ8Blocks32)
      quantize_row(x + m * ldx, K, out.q + m * K, out.d + m * (K / kBlock),
                   out.ds + m * (K / kBlock));
    if (formats & kQ8Blocks256)
      quantize_row_k(x + m * ldx, K, out.qk + m * K, out.dk + m * (K / kSuper),
                     out.bsums + m * (K / 16));
  }
}

void linear_segments_tiles_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                              const Segment* segments, int64_t num_segments, const float* bias,
                              float* y, int64_t ldy, const Q8Rows& scratch) {
  quantize_rows_q8(x, ldx, M, K, scratch, q8_formats(segments, num_segments));
  for_each_segment_item(M, segments, num_segments, bias, y,
                        [&](const Segment& seg, int64_t r0, int64_t r1, int64_t n0, int64_t n1,
                            const float* seg_bias, float* seg_y) {
                          work_item_q8_for(seg.ggml_type)(scratch, r0, r1, K, seg, n0, n1,
                                                          seg_bias, seg_y, ldy);
                        });
}

}  // namespace gguf
}  // namespace pagedllm

extern "C" {

// `linear_gguf_segments` (cpu_gguf_linear.cpp) with x rounded to 8 bits first (per 32-value
// block, and per 256 for the K-quants: gguf_q8_dot.h). Returns 0, or -1 if a segment's type is
// not taken (nothing written).
int linear_gguf_segments_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                            const pagedllm::gguf::Segment* segments, int64_t num_segments,
                            const float* bias, float* y, int64_t ldy) {
  using namespace pagedllm::gguf;
  if (!segments_supported(segments, num_segments)) return -1;
  Q8Buffers buffers(M, K);
  const Q8Rows scratch = buffers.rows();
#pragma omp parallel
  linear_segments_tiles_q8(x, ldx, M, K, segments, num_segments, bias, y, ldy, scratch);
  return 0;
}

// The rounding of `linear_gguf_segments_q8` alone, per 32-value block: q [M, K] int8, d and ds
// [M, K / 32] float32 (gguf_q8_dot.h), K a multiple of 32.
void quantize_rows_gguf_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q,
                           float* d, float* ds) {
  using namespace pagedllm::gguf;
  quantize_rows_q8(x, ldx, M, K, Q8Rows{q, d, ds, nullptr, nullptr, nullptr}, kQ8Blocks32);
}

// The same per 256-value block (the K-quants'): qk [M, K] int8, dk [M, K / 256] float32,
// bsums [M, K / 16] int16, K a multiple of 256.
void quantize_rows_gguf_q8k(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* qk,
                            float* dk, int16_t* bsums) {
  using namespace pagedllm::gguf;
  quantize_rows_q8(x, ldx, M, K, Q8Rows{nullptr, nullptr, nullptr, qk, dk, bsums},
                   kQ8Blocks256);
}

// 0: portable integer dots, 1: AVX2, 2: AVX512-VNNI (what this build compiled).
int gguf_q8_dot_isa() { return pagedllm::gguf::q8_dot_isa(); }

}  // extern "C"
