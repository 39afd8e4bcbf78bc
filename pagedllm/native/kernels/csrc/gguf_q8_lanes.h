// The lane-group micro-kernels of the 8-bit-activation GGUF linears (AVX2 only; gguf_q8_dot.h
// describes the scheme): Q8_0, Q4_0 and Q4_1 groups (`micro_q8_lanes`), Q4_K and Q5_K groups
// (`micro_q8k_lanes`), the x layouts they read (`expand_lanes`, `expand_mins`) and the tile
// loop over a segment's groups (`lanes_block_q8`).
//
// Private to cpu_gguf_q8_linear.cpp, like gguf_q8_blocks.h (an anonymous namespace: include it
// from that one source only).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "gguf_q8_blocks.h"

#ifdef PAGEDLLM_AVX2
namespace pagedllm {
namespace gguf {
namespace {

// --- lane groups (gguf_blocks.h LaneGroup: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K; row-group layout):
// one integer dot per group of 4 rows, lanes r and r + 4 holding row r, so the conversion, the
// scaling and the FMA serve 4 rows at once and nothing is summed horizontally per block.

// Four fp16 at p as floats.
inline __m128 halves4(const uint8_t* p) {
#ifdef __F16C__
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm_setr_ps(half_to_float(p), half_to_float(p + 2), half_to_float(p + 4),
                     half_to_float(p + 6));
#endif
}

// A record's quants as 4 vectors w[c], c = 0..3, each to be dotted with the x bytes of dwords
// 2c (lanes 0-3) and 2c + 1 (lanes 4-7): weights 8c..8c+7 of the 4 rows. kSigned: int8 quants
// (the sign trick); else unsigned, the true quant being u - kBias.
template <typename Q>
struct LaneQuants;

template <>
struct LaneQuants<Q8_0> {
  static constexpr bool kSmall = false;   // |w| up to 128: int32 sums per vector
#ifdef PAGEDLLM_VNNI
  static constexpr bool kSigned = false;
  static constexpr int kBias = 128;
#else
  static constexpr bool kSigned = true;
  static constexpr int kBias = 0;
#endif
  static void load(const uint8_t* q, __m256i w[4]) {
    for (int c = 0; c < 4; ++c) {
      w[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      if constexpr (kBias != 0) w[c] = _mm256_xor_si256(w[c], _mm256_set1_epi8(
                                                                 static_cast<char>(0x80)));
    }
  }
};

// Q4_0 / Q4_1: the first 32 bytes hold chunks 0-1 of each row's nibble pairs (weights 0-7 low,
// 16-23 high), the next 32 chunks 2-3 (weights 8-15, 24-31).
struct LaneNibbles {
  static constexpr bool kSigned = false, kSmall = true;   // u <= 15: dot4_small_u8s8
  static void load(const uint8_t* q, __m256i w[4]) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
    w[0] = _mm256_and_si256(a, mask);
    w[1] = _mm256_and_si256(b, mask);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), mask);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  }
};
template <>
struct LaneQuants<Q4_0> : LaneNibbles {
  static constexpr int kBias = 8;
};
template <>
struct LaneQuants<Q4_1> : LaneNibbles {
  static constexpr int kBias = 0;
};

// x rows [m, m + MB) of xq's 32-value blocks as the lane kernel reads them: per block b and
// row i the 4 vectors at xl + ((b MB + i) 4 + c) 32, vector c holding dwords 2c (lanes 0-3)
// and 2c + 1 (lanes 4-7) of the block. Made once per x tile and read for every group of the
// work item's weight rows (permuting x per group and block bound the lane kernel on a Zen 4's
// one shuffle port). Block-major, so that a kernel reads all MB rows of a block at fixed
// offsets from one pointer (row-major, 8 rows took 8 pointers, more than the general
// registers left, and the kernel reloaded them from the stack per row).
template <int MB>
void expand_lanes(const Q8View& x, int64_t num_blocks, int8_t* xl) {
  __m256i perm[4];
  for (int c = 0; c < 4; ++c)
    perm[c] = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                2 * c + 1);
  for (int i = 0; i < MB; ++i)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.q + i * x.ldq + b * kBlock));
      for (int c = 0; c < 4; ++c)
        _mm256_store_si256(reinterpret_cast<__m256i*>(xl + ((b * MB + i) * 4 + c) * 32),
                           _mm256_permutevar8x32_epi32(xv, perm[c]));
    }
}

// x rows [m, m + MB)'s per-block scales side by side: xd[b MB + i] = d of row i's block b and,
// where `xds` is not null (the 32-value blocks), xds[b MB + i] = its ds (block-major, as
// expand_lanes).
template <int MB>
void expand_scales(const Q8View& x, int64_t num_blocks, float* xd, float* xds) {
  for (int i = 0; i < MB; ++i)
    for (int64_t b = 0; b < num_blocks; ++b) {
      xd[b * MB + i] = x.d[i * x.ldb + b];
      if (xds != nullptr) xds[b * MB + i] = x.ds[i * x.ldb + b];
    }
}

// The integer dot of a lane group's 4 quant vectors u[c] (unsigned, u <= 31) with x's lanes
// xs + 32 c, c = 0..3, in int32 lanes. AVX2 sums the 4 maddubs results in int16 before one
// madd (each int16 element holds 8 products, at most 8 * 31 * 127 = 31496 < 32767: exact),
// where dot_u8s8 per vector spends a madd and an add per vector; VNNI chains dpbusd.
inline __m256i dot4_small_u8s8(const __m256i (&u)[4], const int8_t* xs) {
  auto x = [&](int c) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + 32 * c)); };
#ifdef PAGEDLLM_VNNI
  __m256i dot = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) dot = _mm256_dpbusd_epi32(dot, u[c], x(c));
  return dot;
#else
  const __m256i pairs = _mm256_add_epi16(
      _mm256_add_epi16(_mm256_maddubs_epi16(u[0], x(0)), _mm256_maddubs_epi16(u[1], x(1))),
      _mm256_add_epi16(_mm256_maddubs_epi16(u[2], x(2)), _mm256_maddubs_epi16(u[3], x(3))));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// y[i * ldy + r] = lanes r and r + 4 of acc[i] summed (+ bias[r]), r < 4: a lane group's rows.
template <int MB>
inline void store_lanes(const __m256 (&acc)[MB], const float* bias, float* y, int64_t ldy) {
  for (int i = 0; i < MB; ++i) {
    __m128 rows4 = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    if (bias != nullptr) rows4 = _mm_add_ps(rows4, _mm_loadu_ps(bias));
    _mm_storeu_ps(y + i * ldy, rows4);
  }
}

// y[i][r] = dot(x_q row i, row r of the group at w) (+ bias[r]) for i < MB, r < 4, the group's
// rows `num_blocks` 32-weight blocks long, x's quants read from its lanes `xl`
// (expand_lanes). One group at a time: two groups side by side halved the batch-1 speed on a
// Zen 4 (two streams a group apart) and slowed batched tiles too.
template <int MB, typename Q>
inline void micro_q8_lanes(const int8_t* xl, const float* xd, const float* xds,
                           const uint8_t* w, int64_t num_blocks, const float* bias, float* y,
                           int64_t ldy) {
  using L = LaneGroup<Q>;
  using WQ = LaneQuants<Q>;
  constexpr int64_t kRecord = kGroupRows * Q::kBytes;
  // The offset term of a row, m ds, goes half into each of its two lanes.
  constexpr bool kOffset = WQ::kBias != 0 || L::kScaleBytes == 4;
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* rec = w + b * kRecord;
    const __m128 d4 = halves4(rec);
    const __m256 dw = _mm256_set_m128(d4, d4);
    __m256 mw = _mm256_setzero_ps();
    if constexpr (L::kScaleBytes == 4) {   // Q4_1: the rows' m
      const __m128 m4 = _mm_mul_ps(halves4(rec + 2 * kGroupRows), _mm_set1_ps(0.5f));
      mw = _mm256_set_m128(m4, m4);
    } else if constexpr (WQ::kBias != 0) {   // m = -kBias d
      mw = _mm256_mul_ps(dw, _mm256_set1_ps(-0.5f * WQ::kBias));
    }
    __m256i wq[4];
    WQ::load(rec + kGroupRows * L::kScaleBytes, wq);
    for (int i = 0; i < MB; ++i) {
      const int8_t* xb = xl + (b * MB + i) * 4 * 32;
      __m256i dot = _mm256_setzero_si256();
      if constexpr (WQ::kSmall) {
        dot = dot4_small_u8s8(wq, xb);
      } else {
        for (int c = 0; c < 4; ++c) {
          const __m256i xs = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + 32 * c));
          if constexpr (WQ::kSigned)
            dot = dot_u8s8(dot, _mm256_sign_epi8(wq[c], wq[c]), _mm256_sign_epi8(xs, wq[c]));
          else
            dot = dot_u8s8(dot, wq[c], xs);
        }
      }
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(dw, _mm256_set1_ps(xd[b * MB + i])), acc[i]);
      if constexpr (kOffset)
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xds[b * MB + i]), acc[i]);
    }
  }
  store_lanes<MB>(acc, bias, y, ldy);
}

// --- K-quant lane groups (LaneGroup<Q4_K / Q5_K>): per record (4 rows' 256-weight blocks) the
// 8 sub-block scales become float lane vectors d sc[s] and the mins int16 pairs; per x row and
// sub-block then 4 integer dots (u8 x s8), one conversion and one FMA, where the row-per-pair
// kernel (micro_q8k) spends 8 int16 products per 4 rows and sub-block and applies the integer
// scales per pair. The mins' term, -dmin sum_s m[s] bsum[s], takes two int16 dots per x row
// and record against the x block's sub-block sums (`expand_mins`); dk multiplies once per
// block. (Q6_K, with a scale per 16 weights, ran slower this way and keeps micro_q8k:
// docs/benchmarks.md, "Measurements behind choices in the code".)

// A Q4_K record's scales in lanes (lanes r and r + 4: row r).
struct K4LaneScales {
  __m256 dsc[8];      // d sc[s] per sub-block s
  __m256 neg_dmin;    // -dmin
  __m256i mins[2];    // int16 pairs: [0] (m0, m1) in lanes r, (m2, m3) in r + 4; [1] m4 .. m7
};

inline void k4_lane_scales(const uint8_t* rec, K4LaneScales* s) {
  const __m128 d4 = halves4(rec), dmin4 = halves4(rec + 2 * kGroupRows);
  // Dwords u0, u1, u2 of each row's 12 packed bytes (row r in dword r), from the units 2-3,
  // 4-5 and 6-7 of the record's scale bytes.
  auto row_dwords = [&](int unit) {
    const __m128i v =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * kGroupRows * unit));
    return _mm_unpacklo_epi16(v, _mm_srli_si128(v, 8));
  };
  const __m128i u0 = row_dwords(2), u1 = row_dwords(4), u2 = row_dwords(6);
  const __m128i low6 = _mm_set1_epi8(0x3f), low4 = _mm_set1_epi8(0x0f), low2 = _mm_set1_epi8(3);
  // k4_scale_bytes per row, bytes k of dword r: sc[k], sc[4 + k], m[k], m[4 + k].
  const __m128i sc[2] = {
      _mm_and_si128(u0, low6),
      _mm_or_si128(_mm_and_si128(u2, low4),
                   _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u0, 6), low2), 4))};
  const __m128i m03 = _mm_and_si128(u1, low6);
  const __m128i m47 = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(u2, 4), low4),
                                   _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u1, 6), low2), 4));
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      const __m128i byte_k = _mm_and_si128(_mm_srl_epi32(sc[h], _mm_cvtsi32_si128(8 * k)),
                                           _mm_set1_epi32(0xff));
      const __m128 v = _mm_mul_ps(_mm_cvtepi32_ps(byte_k), d4);
      s->dsc[4 * h + k] = _mm256_set_m128(v, v);
    }
  const __m128 neg = _mm_sub_ps(_mm_setzero_ps(), dmin4);
  s->neg_dmin = _mm256_set_m128(neg, neg);
  // cvtepu8_epi16 leaves row r's (m0, m1), (m2, m3) in dwords 2 r, 2 r + 1.
  const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  s->mins[0] = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi16(m03), perm);
  s->mins[1] = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi16(m47), perm);
}

// x rows [m, m + MB)'s sub-block sums per 256-value block as the mins' dots read them: per
// block b and row i two vectors at xm + (b MB + i) 2 of int16 pairs, [0] (bsum0, bsum1) in
// lanes 0-3 and (bsum2, bsum3) in 4-7, [1] the same for sub-blocks 4-7 (bsum_s <= 32 * 127).
template <int MB>
void expand_mins(const Q8View& x, int64_t num_blocks, __m256i* xm) {
  const __m256i lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i hi = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5);
  for (int i = 0; i < MB; ++i)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const __m256i bs = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.bsums + i * x.ldg + b * 16));
      const __m256i sums = _mm256_madd_epi16(bs, _mm256_set1_epi16(1));   // bsum_s in dword s
      // int16 per 128-bit half: (s0 s1 s2 s3) twice, (s4 s5 s6 s7) twice.
      const __m256i packed = _mm256_packs_epi32(sums, sums);
      xm[(b * MB + i) * 2] = _mm256_permutevar8x32_epi32(packed, lo);
      xm[(b * MB + i) * 2 + 1] = _mm256_permutevar8x32_epi32(packed, hi);
    }
}

// `micro_q8_lanes` for a Q4_K or Q5_K group: x's quants from its lanes `xl` (expand_lanes over
// the 32-value sub-blocks), sub-block sums `xm` (expand_mins) and block scales `xd`
// (expand_scales).
template <int MB, typename Q>
inline void micro_q8k_lanes(const int8_t* xl, const __m256i* xm, const float* xd,
                            const uint8_t* w, int64_t num_blocks, const float* bias, float* y,
                            int64_t ldy) {
  using L = LaneGroup<Q>;
  constexpr bool kHighBits = std::is_same_v<Q, Q5_K>;
  constexpr int64_t kRecord = kGroupRows * Q::kBytes;
  constexpr int kSubs = Q::kWeights / kBlock;
  const __m256i mask = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* rec = w + b * kRecord;
    K4LaneScales sc;
    k4_lane_scales(rec, &sc);
    // Per x row two sums, of the low- and the high-nibble sub-blocks (two chains of FMAs).
    __m256 block[MB][2];
    for (int i = 0; i < MB; ++i) {
      const __m256i* m = xm + (b * MB + i) * 2;
      const __m256i imin = dot_s16(dot_s16(_mm256_setzero_si256(), sc.mins[0], m[0]),
                                   sc.mins[1], m[1]);
      block[i][0] = _mm256_mul_ps(_mm256_cvtepi32_ps(imin), sc.neg_dmin);
      block[i][1] = _mm256_setzero_ps();
    }
    const uint8_t* quants = rec + kGroupRows * L::kScaleBytes;
    __m256i qh[4];   // Q5_K: the 5th bits, bit s of a byte for sub-block s
    if constexpr (kHighBits)
      for (int c = 0; c < 4; ++c)
        qh[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * c));
    const uint8_t* nibbles = quants + (kHighBits ? 4 * 32 : 0);
    for (int p = 0; p < kSubs / 2; ++p) {   // sub-blocks 2 p (low nibbles) and 2 p + 1
      __m256i wq[2][4];
      for (int c = 0; c < 4; ++c) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + 128 * p + 32 * c));
        wq[0][c] = _mm256_and_si256(v, mask);
        wq[1][c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        if constexpr (kHighBits)
          for (int h = 0; h < 2; ++h) {
            const __m256i bit = _mm256_and_si256(
                _mm256_srl_epi16(qh[c], _mm_cvtsi32_si128(2 * p + h)), one);
            wq[h][c] = _mm256_or_si256(wq[h][c], _mm256_slli_epi16(bit, 4));
          }
      }
      for (int i = 0; i < MB; ++i)
        for (int h = 0; h < 2; ++h) {
          const int8_t* xs = xl + (((b * kSubs + 2 * p + h) * MB) + i) * 4 * 32;
          const __m256i dot = dot4_small_u8s8(wq[h], xs);   // u <= 31
          block[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc.dsc[2 * p + h], block[i][h]);
        }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_add_ps(block[i][0], block[i][1]),
                               _mm256_set1_ps(xd[b * MB + i]), acc[i]);
  }
  store_lanes<MB>(acc, bias, y, ldy);
}

// Rows [m0, m1) of x (m1 - m0 a multiple of MB) against the lane groups of rows [n0, n1) of a
// segment (n0, n1 multiples of kGroupRows, all grouped).
template <int MB, typename Q>
void lanes_block_q8(const Q8Rows& xq, int64_t K, int64_t m0, int64_t m1, const uint8_t* data,
                    int64_t row_bytes, int64_t n0, int64_t n1, const float* bias, float* y,
                    int64_t ldy) {
  constexpr bool kSuperBlocks = Q::kWeights == kSuper;
  const int64_t num_blocks = K / Q::kWeights, num_subs = K / kBlock;
  // The x tile's lanes, 4 vectors per row and 32-value block, then (K-quants) the mins' sums,
  // 2 vectors per row and block, then the block scales d (and ds), one float per row and
  // block each.
  thread_local std::vector<__m256i> lanes;
  const int64_t lane_vectors = MB * num_subs * 4;
  const int64_t min_vectors = kSuperBlocks ? MB * num_blocks * 2 : 0;
  const int64_t scale_floats = MB * num_blocks;
  lanes.resize(static_cast<size_t>(lane_vectors + min_vectors + (2 * scale_floats + 7) / 8));
  int8_t* xl = reinterpret_cast<int8_t*>(lanes.data());
  __m256i* xm = lanes.data() + lane_vectors;
  float* xd = reinterpret_cast<float*>(lanes.data() + lane_vectors + min_vectors);
  float* xds = kSuperBlocks ? nullptr : xd + scale_floats;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    const Q8View x = q8_view<Q>(xq, K, m);
    expand_lanes<MB>(x, num_subs, xl);
    expand_scales<MB>(x, num_blocks, xd, xds);
    if constexpr (kSuperBlocks) expand_mins<MB>(x, num_blocks, xm);
    for (int64_t n = n0; n < n1; n += kGroupRows) {
      const float* b = bias != nullptr ? bias + n : nullptr;
      const uint8_t* group = data + n * row_bytes;
      if constexpr (kSuperBlocks)
        micro_q8k_lanes<MB, Q>(xl, xm, xd, group, num_blocks, b, y + m * ldy + n, ldy);
      else
        micro_q8_lanes<MB, Q>(xl, xd, xds, group, num_blocks, b, y + m * ldy + n, ldy);
    }
  }
}

}  // namespace
}  // namespace gguf
}  // namespace pagedllm
#endif  // PAGEDLLM_AVX2
