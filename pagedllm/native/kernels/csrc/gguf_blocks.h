// GGML block formats (llama.cpp's ggml-common.h) and their unpacking to float32, 32 weights (one
// sub-block) at a time, in scalar form and (with AVX2) as four 8-lane vectors.
//
// Blocks of 32 weights (fp16 scales d, m; a nibble's 5th bit comes from qh, bit i for weight i):
//   Q8_0 (34 bytes): d | int8 q[32]                          w[i] = d * q[i]
//   Q4_0 (18 bytes): d | uint8 qs[16]                        w[i] = d * (nibble_i - 8)
//   Q4_1 (20 bytes): d | m | uint8 qs[16]                    w[i] = d * nibble_i + m
//   Q5_0 (22 bytes): d | uint32 qh | uint8 qs[16]            w[i] = d * (nibble_i + 16 hbit_i - 16)
//   Q5_1 (24 bytes): d | m | uint32 qh | uint8 qs[16]        w[i] = d * (nibble_i + 16 hbit_i) + m
// Nibble order of these: weight i < 16 is the low nibble of qs[i], weight i + 16 its high nibble.
//
// K-quant super-blocks of 256 weights = 8 sub-blocks s of 32 (Q6_K: 16 groups of 16):
//   Q4_K (144 bytes): d | dmin | scales[12] (6-bit sc[s], m[s]) | qs[128]
//                     w = d * sc[s] * q - dmin * m[s];  sub-block s: nibble (s & 1) of qs[32 (s/2) + l]
//   Q5_K (176 bytes): d | dmin | scales[12] | qh[32] | qs[128]
//                     as Q4_K with q += 16 * bit s of qh[l]
//   Q6_K (210 bytes): ql[128] | qh[64] | int8 scales[16] | d
//                     w = d * scales[g] * (q - 32), q = 4 bits of ql + 2 bits of qh (below)
// A row of K weights is K / kWeights consecutive blocks; `unpack(block, s, ...)` yields the
// weights [32 s, 32 s + 32) of a block (s = 0 for the 32-weight types).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "pagedllm_abi.h"

#if defined(__F16C__) && !defined(PAGEDLLM_AVX2)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace gguf {

constexpr int kBlock = 32;  // weights per sub-block (the unit of `unpack`)

// GGML type codes (ggml.h's enum ggml_type) of the block formats here.
enum : int64_t {
  kGGMLTypeQ4_0 = 2, kGGMLTypeQ4_1 = 3, kGGMLTypeQ5_0 = 6, kGGMLTypeQ5_1 = 7, kGGMLTypeQ8_0 = 8,
  kGGMLTypeQ4_K = 12, kGGMLTypeQ5_K = 13, kGGMLTypeQ6_K = 14,
};

// Rows [row_start, row_start + rows) of a weight whose rows are [K / kWeights] blocks of one
// type, e.g. the q, k and v parts of a fused qkv weight of mixed types: `GGUFSegment` of the ABI
// (pagedllm/native/kernels/abi.py).
using Segment = ::GGUFSegment;

// The row-group layout of a segment (`grouped` = 1; made at load by the GGUF linear method,
// layers/quantization/gguf.py): the rows [0, R) with R = rows / kGroupRows * kGroupRows form
// groups of kGroupRows consecutive rows whose blocks alternate, so block b of row
// kGroupRows g + j lies at byte (kGroupRows (g nb + b) + j) * block_bytes (nb blocks per row);
// the rows from R on stay plain rows (row n at n * row_bytes). Q8_0, Q4_0, Q4_1, Q4_K and Q5_K
// ("lane groups", LaneGroup below) store each such set of 4 blocks as one record whose quant bytes
// alternate between the rows every 4 bytes, for one-row-per-lane integer dots (only the
// 8-bit-activation kernels read them so; the others read plain copies). The bytes are the file's,
// reordered: a micro-kernel reading the blocks of a group's rows side by side then reads one
// sequential stream instead of kGroupRows streams a row apart, which the hardware prefetcher
// follows (llama.cpp repacks its Q4_0 / Q4_K / Q8_0 weights at load for the same reason,
// ggml-cpu/repack.cpp). Batch-1 GEMVs stream grouped rows much faster than plain ones
// (docs/benchmarks.md, "Measurements behind choices in the code").
constexpr int64_t kGroupRows = 4;

// Where the blocks of a segment's rows lie: block b of row n at row(n) + b * block_stride(n),
// row n + 1 at row(n) + row_stride(n) while both are in the same group (or both plain). Row
// runs of 1, 2 or kGroupRows rows starting at a multiple of the run length stay in one group.
// Whole-block groups only: lane groups (below) are read by the lane kernel or through
// `readable_rows`.
struct RowLayout {
  const uint8_t* data;
  int64_t row_bytes, block_bytes, grouped_rows;

  RowLayout(const Segment& seg, int64_t row_bytes_, int64_t block_bytes_)
      : data(seg.data), row_bytes(row_bytes_), block_bytes(block_bytes_),
        grouped_rows(seg.grouped != 0 ? seg.rows / kGroupRows * kGroupRows : 0) {}

  const uint8_t* row(int64_t n) const {
    if (n >= grouped_rows) return data + n * row_bytes;
    return data + (n / kGroupRows) * kGroupRows * row_bytes + (n % kGroupRows) * block_bytes;
  }
  int64_t row_stride(int64_t n) const { return n < grouped_rows ? block_bytes : row_bytes; }
  int64_t block_stride(int64_t n) const {
    return n < grouped_rows ? kGroupRows * block_bytes : block_bytes;
  }
  // What a micro-kernel over rows [n, n + nb) prefetches, as an offset from the block it
  // reads: plain rows, the same block of the next nb rows (the next call's); grouped rows
  // are one sequential stream the hardware prefetcher follows, so nothing (0).
  int64_t prefetch_offset(int64_t n, int64_t nb) const {
    return n < grouped_rows ? 0 : nb * row_bytes;
  }
};

// Whether every segment's type has a kernel (cpu_gguf_linear.cpp).
bool segments_supported(const Segment* segments, int64_t num_segments);

// y[:, seg.row_start + n] = x @ seg row n (+ bias) for every segment, x [M, K] float32 (row
// stride ldx), y row stride ldy; K a multiple of each type's block. The work-sharing loops of
// one linear, for every thread of an enclosing OpenMP parallel region (they end with a barrier);
// outside one it runs serially. Types must have passed `segments_supported`.
void linear_segments_tiles(const float* x, int64_t ldx, int64_t M, int64_t K,
                           const Segment* segments, int64_t num_segments, const float* bias,
                           float* y, int64_t ldy);

// The work-sharing loop of one block linear, shared by the float-activation and the 8-bit-
// activation kernels: for each segment, items (block of up to 64 x rows, tile of the segment's
// weight rows, a multiple of kGroupRows) handed out statically (M <= 8) or dynamically,
// `item(seg, r0, r1, n0, n1, seg_bias, seg_y)` per item (segment-relative rows; bias and y
// already offset to the segment's first output column), then one barrier. For every thread of an enclosing parallel region (serial outside one).
template <typename ItemFn>
void for_each_segment_item(int64_t M, const Segment* segments, int64_t num_segments,
                           const float* bias, float* y, ItemFn&& item) {
  constexpr int64_t kRowBlock = 64;  // rows of x per work item (a multiple of the 4-row kernel)
  const int64_t num_row_blocks = (M + kRowBlock - 1) / kRowBlock;
  for (int64_t s = 0; s < num_segments; ++s) {
    const Segment& seg = segments[s];
    const int64_t N = seg.rows;
    // Tiles of whole row groups (a multiple of kGroupRows rows).
    const int64_t tile = std::max<int64_t>(
        kGroupRows, std::min<int64_t>(64, N / (8 * omp_get_num_threads())) / kGroupRows *
                        kGroupRows);
    const int64_t num_tiles = (N + tile - 1) / tile;
    const float* seg_bias = bias != nullptr ? bias + seg.row_start : nullptr;
    float* seg_y = y + seg.row_start;
    auto run = [&](int64_t it) {
      const int64_t t = it % num_tiles, rb = it / num_tiles;
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      const int64_t r0 = rb * kRowBlock, r1 = std::min(M, r0 + kRowBlock);
      item(seg, r0, r1, n0, n1, seg_bias, seg_y);
    };
    // Few rows of x (decode): each thread one contiguous range of weight rows, a single
    // stream from memory; more rows: dynamic, for balance when compute dominates.
    if (M <= 8) {
#pragma omp for schedule(static) nowait
      for (int64_t it = 0; it < num_row_blocks * num_tiles; ++it) run(it);
    } else {
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t it = 0; it < num_row_blocks * num_tiles; ++it) run(it);
    }
  }
#pragma omp barrier
}

// IEEE half -> float (exact; subnormals, infinities and NaN included).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise the mantissa
      exp = 113;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34;
  static void unpack(const uint8_t* b, int /*sub*/, float* out) {
    const float d = half_to_float(b);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int /*sub*/, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    for (int c = 0; c < 4; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c));
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
#endif
};

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18;
  static void unpack(const uint8_t* b, int /*sub*/, float* out) {
    const float d = half_to_float(b);
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((b[2 + i] & 0x0f) - 8);
      out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int /*sub*/, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
  }
#endif
};

struct Q4_1 {
  static constexpr int kWeights = 32, kBytes = 20;
  static void unpack(const uint8_t* b, int /*sub*/, float* out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(b[4 + i] & 0x0f) + m;
      out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int /*sub*/, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b)), m = _mm256_set1_ps(half_to_float(b + 2));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), d, m);
  }
#endif
};


#ifdef PAGEDLLM_AVX2
// The four 8-lane int32 vectors of 32 unsigned bytes (lanes 0-7, 8-15, 16-23, 24-31).
inline void widen_u8(__m256i bytes, __m256i out[4]) {
  const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
  out[0] = _mm256_cvtepu8_epi32(lo);
  out[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  out[2] = _mm256_cvtepu8_epi32(hi);
  out[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

// Q4_0-style nibbles of qs[16] as int32 lanes (weights 0-7, 8-15, 16-23, 24-31) plus 16 times
// bit i of qh for weight i (Q5_0/Q5_1).
inline void nibbles_with_high_bit(const uint8_t* qs, uint32_t qh, __m256i out[4]) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
  for (int c = 0; c < 4; ++c) {
    const __m256i bit = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh >> (8 * c))), lanes), one);
    out[c] = _mm256_or_si256(_mm256_cvtepu8_epi32(parts[c]), _mm256_slli_epi32(bit, 4));
  }
}
#endif

#ifdef PAGEDLLM_AVX2
// Prefetch one block's bytes (every cache line of it) into L1. The block kernels call it for
// the weight rows they will read next: a GEMV on blocks read from DRAM otherwise waits on
// memory latency (the hardware prefetcher follows these short interleaved row streams poorly:
// without it a GEMV streamed from DRAM far below its rate from cache; docs/benchmarks.md,
// "Measurements behind choices in the code").
template <int kBytes>
inline void prefetch_block(const uint8_t* p) {
  for (int off = 0; off < kBytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}
#endif

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 5-bit quant i of a Q5_0/Q5_1 block: nibble plus bit i of qh as the 5th bit.
inline int q5_quant(const uint8_t* qs, uint32_t qh, int i) {
  const int nibble = i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4);
  return nibble | static_cast<int>(((qh >> i) & 1u) << 4);
}

struct Q5_0 {
  static constexpr int kWeights = 32, kBytes = 22;
  static void unpack(const uint8_t* b, int /*sub*/, float* out) {
    const float d = half_to_float(b);
    const uint32_t qh = load_u32(b + 2);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q5_quant(b + 6, qh, i) - 16);
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int /*sub*/, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    __m256i q[4];
    nibbles_with_high_bit(b + 6, load_u32(b + 2), q);
    const __m256i sixteen = _mm256_set1_epi32(16);
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[c], sixteen)), d);
  }
#endif
};

struct Q5_1 {
  static constexpr int kWeights = 32, kBytes = 24;
  static void unpack(const uint8_t* b, int /*sub*/, float* out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const uint32_t qh = load_u32(b + 4);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(q5_quant(b + 8, qh, i)) + m;
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int /*sub*/, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b)), m = _mm256_set1_ps(half_to_float(b + 2));
    __m256i q[4];
    nibbles_with_high_bit(b + 8, load_u32(b + 4), q);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[c]), d, m);
  }
#endif
};

// The 6-bit scale and min of sub-block s of a Q4_K/Q5_K block (ggml's get_scale_min_k4):
// scales[0..3] low 6 bits: sc[0..3]; scales[4..7] low 6 bits: m[0..3]; sc[4..7] and m[4..7]
// are the nibbles of scales[8..11] with their top 2 bits in the top bits of scales[0..7].
inline void k4_scale_min(const uint8_t* scales, int s, float* sc, float* m) {
  if (s < 4) {
    *sc = static_cast<float>(scales[s] & 63);
    *m = static_cast<float>(scales[s + 4] & 63);
  } else {
    *sc = static_cast<float>((scales[s + 4] & 0x0f) | ((scales[s - 4] >> 6) << 4));
    *m = static_cast<float>((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
  }
}

struct Q4_K {
  static constexpr int kWeights = 256, kBytes = 144;
  static void unpack(const uint8_t* b, int s, float* out) {
    float sc, m;
    k4_scale_min(b + 4, s, &sc, &m);
    const float d = half_to_float(b) * sc, dm = half_to_float(b + 2) * m;
    const uint8_t* q = b + 16 + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < kBlock; ++l) out[l] = d * static_cast<float>((q[l] >> shift) & 0x0f) - dm;
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int s, __m256 w[4]) {
    float sc, m;
    k4_scale_min(b + 4, s, &sc, &m);
    const __m256 d = _mm256_set1_ps(half_to_float(b) * sc);
    const __m256 neg_dm = _mm256_set1_ps(-half_to_float(b + 2) * m);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (s / 2)));
    const __m256i nib = _mm256_and_si256(
        _mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (s & 1))), _mm256_set1_epi8(0x0f));
    __m256i q[4];
    widen_u8(nib, q);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[c]), d, neg_dm);
  }
#endif
};

struct Q5_K {
  static constexpr int kWeights = 256, kBytes = 176;
  static void unpack(const uint8_t* b, int s, float* out) {
    float sc, m;
    k4_scale_min(b + 4, s, &sc, &m);
    const float d = half_to_float(b) * sc, dm = half_to_float(b + 2) * m;
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48 + 32 * (s / 2);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < kBlock; ++l) {
      const int v = ((q[l] >> shift) & 0x0f) | (((qh[l] >> s) & 1) << 4);
      out[l] = d * static_cast<float>(v) - dm;
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int s, __m256 w[4]) {
    float sc, m;
    k4_scale_min(b + 4, s, &sc, &m);
    const __m256 d = _mm256_set1_ps(half_to_float(b) * sc);
    const __m256 neg_dm = _mm256_set1_ps(-half_to_float(b + 2) * m);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (s / 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    // 16-bit shifts move bits across the bytes of a pair, but the masks keep only the wanted
    // bits of each byte (s <= 7).
    const __m256i nib = _mm256_and_si256(
        _mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (s & 1))), _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(1)), 4);
    __m256i q[4];
    widen_u8(_mm256_or_si256(nib, high), q);
    for (int c = 0; c < 4; ++c) w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[c]), d, neg_dm);
  }
#endif
};

// Q6_K: weight 128 n + 32 j + l (half n, quarter j, l < 32) has q = (4 bits of ql[64 n + l +
// 32 (j & 1)], low nibble for j < 2, high for j >= 2) | (bits 2j, 2j+1 of qh[32 n + l]) << 4,
// and scale index 8 n + 2 j + l / 16. Sub-block s is n = s / 4, j = s % 4.
struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210;
  static void unpack(const uint8_t* b, int s, float* out) {
    const int n = s / 4, j = s % 4;
    const uint8_t* ql = b + 64 * n + 32 * (j & 1);
    const uint8_t* qh = b + 128 + 32 * n;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * j;
    const float d = half_to_float(b + 208);
    const int shift = 4 * (j >> 1);
    for (int l = 0; l < kBlock; ++l) {
      const int v = ((ql[l] >> shift) & 0x0f) | (((qh[l] >> (2 * j)) & 3) << 4);
      out[l] = d * static_cast<float>(scales[l / 16]) * static_cast<float>(v - 32);
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, int s, __m256 w[4]) {
    const int n = s / 4, j = s % 4;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192) + 8 * n + 2 * j;
    const float d = half_to_float(b + 208);
    const __m256 d0 = _mm256_set1_ps(d * scales[0]), d1 = _mm256_set1_ps(d * scales[1]);
    const __m256i ql =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32 * (j & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    const __m256i nib = _mm256_and_si256(
        _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (j >> 1))), _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3)), 4);
    __m256i q[4];
    widen_u8(_mm256_or_si256(nib, high), q);
    const __m256i bias = _mm256_set1_epi32(32);
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q[c], bias)), c < 2 ? d0 : d1);
  }
#endif
};

// Calls fn(Q{}) with the block type of a GGML type code; false (fn not called) for a code
// without kernels. The one place that maps codes to the types here.
template <typename Fn>
inline bool visit_block_type(int64_t ggml_type, Fn&& fn) {
  switch (ggml_type) {
    case kGGMLTypeQ4_0: fn(Q4_0{}); return true;
    case kGGMLTypeQ4_1: fn(Q4_1{}); return true;
    case kGGMLTypeQ5_0: fn(Q5_0{}); return true;
    case kGGMLTypeQ5_1: fn(Q5_1{}); return true;
    case kGGMLTypeQ8_0: fn(Q8_0{}); return true;
    case kGGMLTypeQ4_K: fn(Q4_K{}); return true;
    case kGGMLTypeQ5_K: fn(Q5_K{}); return true;
    case kGGMLTypeQ6_K: fn(Q6_K{}); return true;
    default: return false;
  }
}

// Lane groups: the group's block b is one record of kGroupRows * kBytes bytes at
// b * kGroupRows * kBytes from the group's start. A block's first kScaleBytes bytes are its
// scales, the kQuantBytes after them its quants. The record holds the rows' scales in 2-byte
// units, unit u of row r at 2 kGroupRows u + 2 r (the rows' fp16 d first, for Q4_1 then their
// fp16 m), then their quant bytes as 4-byte chunks, chunk k of row r at 32 (k / 2) + 16 (k % 2) + 4 r. A 32-byte load of the quants then
// holds 4 bytes of each row in lanes r and r + 4 (`regroup_rows` in cpu_gguf_linear.cpp writes
// it, `lane_group_row` reads it back).
template <typename Q>
struct LaneGroup {
  static constexpr bool kLanes = false;
};
template <int kScales, int kQuants>
struct LaneBytes {
  static constexpr bool kLanes = true;
  static constexpr int kScaleBytes = kScales, kQuantBytes = kQuants;
  // The record offset of row r's block byte o.
  static constexpr int64_t record_offset(int o, int r) {
    if (o < kScaleBytes) return 2 * kGroupRows * (o / 2) + 2 * r + o % 2;
    const int q = o - kScaleBytes, k = q / 4;
    return kGroupRows * kScaleBytes + 32 * (k / 2) + 16 * (k % 2) + 4 * r + q % 4;
  }
};
template <>
struct LaneGroup<Q8_0> : LaneBytes<2, 32> {};    // d, q
template <>
struct LaneGroup<Q4_0> : LaneBytes<2, 16> {};    // d, nibble pairs
template <>
struct LaneGroup<Q4_1> : LaneBytes<4, 16> {};    // d, m, nibble pairs
// Q4_K: fp16 d, fp16 dmin, the 12 packed 6-bit scales and mins, then 128 nibble-pair bytes
// (byte l of 32 p: weight l of sub-blocks 2 p (low nibble) and 2 p + 1 (high)).
template <>
struct LaneGroup<Q4_K> : LaneBytes<16, 128> {};
// Q5_K: as Q4_K with the 32 bytes of 5th bits (bit s of byte l: weight l of sub-block s)
// before the nibbles, as quants.
template <>
struct LaneGroup<Q5_K> : LaneBytes<16, 160> {};

// Row n of a lane-grouped segment (row_bytes per row) in the plain format, into `out`.
template <typename Q>
inline void lane_group_row(const Segment& seg, int64_t row_bytes, int64_t n, uint8_t* out) {
  using L = LaneGroup<Q>;
  const int64_t r = n % kGroupRows, num_blocks = row_bytes / Q::kBytes;
  const uint8_t* group = seg.data + (n / kGroupRows) * kGroupRows * row_bytes;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* rec = group + b * kGroupRows * Q::kBytes;
    for (int o = 0; o < Q::kBytes; ++o)
      out[b * Q::kBytes + o] = rec[L::record_offset(o, r)];
  }
}

// Rows [n0, n1) of `seg` for the kernels that read whole blocks (RowLayout): `seg` itself, or,
// for rows in lane groups, a plain copy of those rows made in `buf`. Returns the segment and
// the index that row n0 has in it.
template <typename Q>
inline Segment readable_rows(const Segment& seg, int64_t row_bytes, int64_t n0, int64_t n1,
                             std::vector<uint8_t>& buf, int64_t* first) {
  *first = n0;
  if constexpr (LaneGroup<Q>::kLanes) {
    if (seg.grouped != 0 && n0 < seg.rows / kGroupRows * kGroupRows) {
      buf.resize(static_cast<size_t>((n1 - n0) * row_bytes));
      for (int64_t n = n0; n < n1; ++n) {
        uint8_t* out = buf.data() + (n - n0) * row_bytes;
        if (n < seg.rows / kGroupRows * kGroupRows)
          lane_group_row<Q>(seg, row_bytes, n, out);
        else
          std::memcpy(out, seg.data + n * row_bytes, static_cast<size_t>(row_bytes));
      }
      *first = 0;
      return Segment{buf.data(), seg.row_start + n0, n1 - n0, seg.ggml_type, 0};
    }
  }
  return seg;
}

}  // namespace gguf
}  // namespace pagedllm
