// The 8-bit-activation GGUF linears of gguf_q8_dot.h (see there for the scheme): the rounding
// of x, the per-type weight decoders of the integer path, the register-blocked micro-kernels
// (MB rows of x times NB rows of w, as cpu_gguf_linear.cpp's float path) and their work sharing,
// plus the module path's entry points `linear_gguf_segments_q8` and `quantize_rows_gguf_q8`.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "gguf_q8_dot.h"

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

// --- activations

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
#ifdef PAGEDLLM_AVX2
    __m256 v[4];
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 vmax = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      v[c] = _mm256_loadu_ps(xb + 8 * c);
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(v[c], abs_mask));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    int32_t sum = 0;
#ifdef PAGEDLLM_AVX2
    // cvtps rounds to nearest even (the default MXCSR mode), as nearbyint below.
    __m256i i32[4];
    for (int c = 0; c < 4; ++c) i32[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], _mm256_set1_ps(id)));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                           _mm256_add_epi32(i32[2], i32[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    sum = _mm_cvtsi128_si32(s4);
    // The packs interleave 128-bit lanes: dword groups come out as a0 b0 c0 d0 a1 b1 c1 d1 (x
    // of vector x, 4 values each); the permutation restores a0 a1 b0 b1 ...
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                              _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                        _mm256_permutevar8x32_epi32(packed,
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      qb[i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d[b] = db;
    ds[b] = db * static_cast<float>(sum);
  }
}

// --- weights: per type, the float scales of a block and the quants of sub-block s.
//
// `Scales::d[s]` multiplies the integer dot of sub-block s (Q6_K: d[2s] for its first 16
// weights, d[2s + 1] for the last 16); `Scales::m[s]` (types with kMin) multiplies ds of the
// activation block under sub-block s, the whole min / offset term. kSigned (Q8_0 without
// VNNI): the quants are int8 (dot with the sign trick); else uint8 (u8 x s8 dots directly),
// the true quant being u - kBias.

template <typename Q>
struct Q8Weights;

// The scales of the 32-weight types, fp16 at the block's start. The signed ones (Q4_0 n - 8,
// Q5_0 n - 16, and Q8_0 q with VNNI) are taken as unsigned quants u = q + B (kBias = B): the
// integer dot starts from -B sum(qx) (the dot's accumulator input) and needs no sign trick,
// sum(u qx) - B sum(qx) = sum(q qx). AVX2's maddubs would saturate Q8_0's u <= 255 (its int16
// pair sums), so without VNNI Q8_0 keeps the sign trick (`SignedScale`).
struct SignedScale {
  static constexpr bool kSigned = true, kMin = false, kHalves = false;
  static constexpr int kBias = 0;
  struct Scales { float d[1]; };
  static void scales(const uint8_t* b, Scales* s) { s->d[0] = half_to_float(b); }
};

template <int B>
struct BiasedScale : SignedScale {
  static constexpr bool kSigned = false;
  static constexpr int kBias = B;
};

// The unsigned ones (Q4_1, Q5_1): d, then the offset m.
struct OffsetScales {
  static constexpr bool kSigned = false, kMin = true, kHalves = false;
  static constexpr int kBias = 0;
  struct Scales { float d[1], m[1]; };
  static void scales(const uint8_t* b, Scales* s) {
    s->d[0] = half_to_float(b);
    s->m[0] = half_to_float(b + 2);
  }
};

#ifdef PAGEDLLM_VNNI
template <>
struct Q8Weights<Q8_0> : BiasedScale<128> {
  static __m256i quants(const uint8_t* b, int /*sub*/) {   // q + 128 = q with its top bit flipped
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};
#else
template <>
struct Q8Weights<Q8_0> : SignedScale {
  static void quants(const uint8_t* b, int /*sub*/, int32_t* q) {
    for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int /*sub*/) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
#endif
};
#endif

#ifdef PAGEDLLM_AVX2
// Weights 0-15 of a 32-weight block from the low nibbles of qs[16], 16-31 from the high ones.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// 16 in byte i where bit i of qh is set, else 0 (the 5th bit of Q5_0/Q5_1 quants).
inline __m256i high_bits16(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}
#endif

// The quants of the 32-weight nibble types: the nibbles of qs at byte kQs (Q4_0, Q4_1), and
// with the 5th bits of the uint32 qh at byte kQh (Q5_0, Q5_1).
template <int kQs>
struct NibbleQuants {
  static void quants(const uint8_t* b, int /*sub*/, int32_t* q) {
    for (int i = 0; i < 16; ++i) {
      q[i] = b[kQs + i] & 0x0f;
      q[i + 16] = b[kQs + i] >> 4;
    }
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int /*sub*/) { return nibbles32(b + kQs); }
#endif
};

template <int kQh, int kQs>
struct Nibble5Quants {
  static void quants(const uint8_t* b, int /*sub*/, int32_t* q) {
    const uint32_t qh = load_u32(b + kQh);
    for (int i = 0; i < kBlock; ++i) q[i] = q5_quant(b + kQs, qh, i);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int /*sub*/) {
    return _mm256_or_si256(nibbles32(b + kQs), high_bits16(load_u32(b + kQh)));
  }
#endif
};

template <>
struct Q8Weights<Q4_0> : BiasedScale<8>, NibbleQuants<2> {};
template <>
struct Q8Weights<Q4_1> : OffsetScales, NibbleQuants<4> {};
template <>
struct Q8Weights<Q5_0> : BiasedScale<16>, Nibble5Quants<2, 6> {};
template <>
struct Q8Weights<Q5_1> : OffsetScales, Nibble5Quants<4, 8> {};

// Q4_K / Q5_K share scales (6-bit sc and m per sub-block, gguf_blocks.h's k4_scale_min).
struct K4Scales {
  float d[8], m[8];
};

// All 16 six-bit values at once with 32-bit masks (llama.cpp's ggml_vec_dot_q4_K_q8_K does
// likewise): bytes 0-7 of u become sc[0..7], bytes 8-15 m[0..7] (k4_scale_min's rules).
inline void k4_scales(const uint8_t* b, K4Scales* s) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);   // m[4..7]
  const uint32_t m03 = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);          // sc[4..7]
  u[2] = m03;
  u[0] &= kLow6;                                                 // sc[0..3]
#ifdef PAGEDLLM_AVX2
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  _mm256_storeu_ps(s->d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
                                       _mm256_set1_ps(d)));
  _mm256_storeu_ps(s->m, _mm256_mul_ps(
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                             _mm256_set1_ps(-dmin)));
#else
  uint8_t v[16];
  std::memcpy(v, u, 16);
  for (int sub = 0; sub < 8; ++sub) {
    s->d[sub] = d * static_cast<float>(v[sub]);
    s->m[sub] = -dmin * static_cast<float>(v[8 + sub]);
  }
#endif
}

// The traits Q4_K and Q5_K share: unsigned quants, k4_scales' d and min per sub-block.
struct K4Traits {
  static constexpr bool kSigned = false, kMin = true, kHalves = false;
  static constexpr int kBias = 0;
  using Scales = K4Scales;
  static void scales(const uint8_t* b, Scales* s) { k4_scales(b, s); }
};

template <>
struct Q8Weights<Q4_K> : K4Traits {
  static void quants(const uint8_t* b, int sub, int32_t* q) {
    const uint8_t* qs = b + 16 + 32 * (sub / 2);
    for (int l = 0; l < kBlock; ++l) q[l] = (qs[l] >> (4 * (sub & 1))) & 0x0f;
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (sub / 2)));
    return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (sub & 1))),
                            _mm256_set1_epi8(0x0f));
  }
#endif
};

template <>
struct Q8Weights<Q5_K> : K4Traits {
  static void quants(const uint8_t* b, int sub, int32_t* q) {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (sub / 2);
    for (int l = 0; l < kBlock; ++l)
      q[l] = ((qs[l] >> (4 * (sub & 1))) & 0x0f) | (((qh[l] >> sub) & 1) << 4);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    const __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (sub / 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i nib = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(4 * (sub & 1))),
                                         _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sub)), _mm256_set1_epi8(1)), 4);
    return _mm256_or_si256(nib, high);
  }
#endif
};

template <>
struct Q8Weights<Q6_K> {   // (quants taken unsigned, q + 32, kBias = 32 as Q4_0's)
  static constexpr bool kSigned = false, kMin = false, kHalves = true;
  static constexpr int kBias = 32;
#ifdef PAGEDLLM_AVX2
  // Per sub-block s, the scales of its two 16-weight groups as lanes 0-3 and 4-7 (those of
  // the integer dot's lanes).
  struct Scales { __m256 halves[8]; };
  static void scales(const uint8_t* b, Scales* s) {
    const __m256 d = _mm256_set1_ps(half_to_float(b + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 g[2] = {
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
    for (int sub = 0; sub < 8; ++sub) {
      const int lo = 2 * (sub % 4);
      s->halves[sub] = _mm256_permutevar8x32_ps(
          g[sub / 4], _mm256_setr_epi32(lo, lo, lo, lo, lo + 1, lo + 1, lo + 1, lo + 1));
    }
  }
#else
  struct Scales { float d[16]; };
  static void scales(const uint8_t* b, Scales* s) {
    const float d = half_to_float(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) s->d[g] = d * static_cast<float>(sc[g]);
  }
#endif
  static void quants(const uint8_t* b, int sub, int32_t* q) {
    const int n = sub / 4, j = sub % 4;
    const uint8_t* ql = b + 64 * n + 32 * (j & 1);
    const uint8_t* qh = b + 128 + 32 * n;
    for (int l = 0; l < kBlock; ++l)
      q[l] = ((ql[l] >> (4 * (j >> 1))) & 0x0f) | (((qh[l] >> (2 * j)) & 3) << 4);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b, int sub) {
    const int n = sub / 4, j = sub % 4;
    const __m256i ql =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32 * (j & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    const __m256i nib = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (j >> 1))),
                                         _mm256_set1_epi8(0x0f));
    const __m256i high = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3)), 4);
    return _mm256_or_si256(nib, high);
  }
#endif
};

// --- micro-kernels: y[i][j] = dot(x_q row i, w row j) (+ bias[j]) for i < MB, j < NB.
// `x` holds the MB rows' rounded activations from the block under the row's first weight
// (row strides ldq bytes of q, ldb floats of d / ds).

struct Q8View {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t ldq, ldb;
};

#ifdef PAGEDLLM_AVX2
// acc + eight int32 sums of 4 byte products each (lane k: bytes 4k..4k+3), unsigned u by signed s.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#ifdef PAGEDLLM_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// Per (x row, sub-block): the float scale dx, and the start of the integer dots: -kBias sum(qx)
// per 4-byte lane (zero without a bias). Per (w row, sub-block): the scale vector. Per pair:
// one integer dot, a conversion and one FMA.
template <int MB, int NB, typename Q>
inline void micro_q8(const Q8View& x, const uint8_t* w, int64_t row_stride, int64_t block_stride,
                     int64_t prefetch, int64_t num_blocks, const float* bias, float* y,
                     int64_t ldy) {
  using W = Q8Weights<Q>;
  constexpr int kSubs = Q::kWeights / kBlock;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t xb = b * kSubs;   // the activation block under the weight block's start
    if (prefetch != 0)   // see RowLayout::prefetch_offset
      for (int j = 0; j < NB; ++j)
        prefetch_block<Q::kBytes>(w + j * row_stride + b * block_stride + prefetch);
    typename W::Scales sc[NB];
    for (int j = 0; j < NB; ++j) W::scales(w + j * row_stride + b * block_stride, &sc[j]);
    if constexpr (W::kMin) {   // the min / offset terms: m ds
      for (int i = 0; i < MB; ++i) {
        if constexpr (kSubs == 8) {   // the 8 sub-blocks' terms as one vector
          const __m256 ds = _mm256_loadu_ps(x.ds + i * x.ldb + xb);
          for (int j = 0; j < NB; ++j)
            acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(sc[j].m), ds, acc[i][j]);
        } else {   // m ds / 8 in each lane (exact: a power of two), summed by the final hsum
          const __m256 ds = _mm256_set1_ps(x.ds[i * x.ldb + xb] * 0.125f);
          for (int j = 0; j < NB; ++j)
            acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(sc[j].m[0]), ds, acc[i][j]);
        }
      }
    }
    for (int s = 0; s < kSubs; ++s) {
      __m256i qx[MB], start[MB];
      __m256 dx[MB];
      for (int i = 0; i < MB; ++i) {
        qx[i] = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(x.q + i * x.ldq + (xb + s) * kBlock));
        dx[i] = _mm256_set1_ps(x.d[i * x.ldb + xb + s]);
        start[i] = _mm256_setzero_si256();
        if constexpr (W::kBias != 0)   // -kBias * (sums of qx per lane)
          start[i] = _mm256_sub_epi32(
              start[i], dot_u8s8(start[i], _mm256_set1_epi8(static_cast<char>(W::kBias)), qx[i]));
      }
      for (int j = 0; j < NB; ++j) {
        const __m256i qw = W::quants(w + j * row_stride + b * block_stride, s);
        const __m256i uw = W::kSigned ? _mm256_sign_epi8(qw, qw) : qw;
        __m256 ws;
        if constexpr (W::kHalves)
          ws = sc[j].halves[s];
        else
          ws = _mm256_set1_ps(sc[j].d[s]);
        for (int i = 0; i < MB; ++i) {
          const __m256i sx = W::kSigned ? _mm256_sign_epi8(qx[i], qw) : qx[i];
          const __m256 prod = _mm256_cvtepi32_ps(dot_u8s8(start[i], uw, sx));
          acc[i][j] = _mm256_fmadd_ps(prod, _mm256_mul_ps(ws, dx[i]), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[i * ldy + j] = hsum(acc[i][j]) + (bias != nullptr ? bias[j] : 0.f);
}

// --- lane groups (gguf_blocks.h LaneGroup: Q8_0, Q4_0, Q4_1 in the row-group layout): one
// integer dot per group of 4 rows, lanes r and r + 4 holding row r, so the conversion, the
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
  static constexpr bool kSigned = false;
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

// y[i][r] = dot(x_q row i, row r of the group at w) (+ bias[r]) for i < MB, r < 4, the group's
// rows `num_blocks` 32-weight blocks long. One group at a time: two groups side by side (two
// streams a group apart) halved the batch-1 speed on a Zen 4.
template <int MB, typename Q>
inline void micro_q8_lanes(const Q8View& x, const uint8_t* w, int64_t num_blocks,
                           const float* bias, float* y, int64_t ldy) {
  using L = LaneGroup<Q>;
  using WQ = LaneQuants<Q>;
  constexpr int64_t kRecord = kGroupRows * Q::kBytes;
  // The offset term of a row, m ds, goes half into each of its two lanes.
  constexpr bool kOffset = WQ::kBias != 0 || L::kScaleBytes == 4;
  __m256i perm[4];
  for (int c = 0; c < 4; ++c)
    perm[c] = _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                2 * c + 1);
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
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.q + i * x.ldq + b * kBlock));
      __m256i dot = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i xs = _mm256_permutevar8x32_epi32(xv, perm[c]);
        if constexpr (WQ::kSigned)
          dot = dot_u8s8(dot, _mm256_sign_epi8(wq[c], wq[c]), _mm256_sign_epi8(xs, wq[c]));
        else
          dot = dot_u8s8(dot, wq[c], xs);
      }
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(dw, _mm256_set1_ps(x.d[i * x.ldb + b])), acc[i]);
      if constexpr (kOffset)
        acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[i * x.ldb + b]), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    __m128 rows4 = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    if (bias != nullptr) rows4 = _mm_add_ps(rows4, _mm_loadu_ps(bias));
    _mm_storeu_ps(y + i * ldy, rows4);
  }
}

// Rows [m0, m1) of x (m1 - m0 a multiple of MB) against the lane groups of rows [n0, n1) of a
// segment (n0, n1 multiples of kGroupRows, all grouped).
template <int MB, typename Q>
void lanes_block_q8(const Q8Rows& xq, int64_t K, int64_t m0, int64_t m1, const uint8_t* data,
                    int64_t row_bytes, int64_t n0, int64_t n1, const float* bias, float* y,
                    int64_t ldy) {
  const int64_t ldb = K / kBlock, num_blocks = K / Q::kWeights;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    const Q8View x{xq.q + m * K, xq.d + m * ldb, xq.ds + m * ldb, K, ldb};
    for (int64_t n = n0; n < n1; n += kGroupRows)
      micro_q8_lanes<MB, Q>(x, data + n * row_bytes, num_blocks,
                            bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
  }
}
#else
template <int MB, int NB, typename Q>
inline void micro_q8(const Q8View& x, const uint8_t* w, int64_t row_stride, int64_t block_stride,
                     int64_t /*prefetch*/, int64_t num_blocks, const float* bias, float* y,
                     int64_t ldy) {
  using W = Q8Weights<Q>;
  constexpr int kSubs = Q::kWeights / kBlock;
  float acc[MB][NB] = {};
  int32_t qw[kBlock];
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t xb = b * kSubs;
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = w + j * row_stride + b * block_stride;
      typename W::Scales sc;
      W::scales(blk, &sc);
      for (int s = 0; s < kSubs; ++s) {
        W::quants(blk, s, qw);
        for (int i = 0; i < MB; ++i) {
          const int8_t* qx = x.q + i * x.ldq + (xb + s) * kBlock;
          int32_t lo = 0, hi = 0;   // (biased quants: minus kBias sum(qx))
          for (int l = 0; l < 16; ++l) lo += (qw[l] - W::kBias) * qx[l];
          for (int l = 16; l < kBlock; ++l) hi += (qw[l] - W::kBias) * qx[l];
          const float dx = x.d[i * x.ldb + xb + s];
          if constexpr (W::kHalves)
            acc[i][j] += dx * (sc.d[2 * s] * static_cast<float>(lo) +
                               sc.d[2 * s + 1] * static_cast<float>(hi));
          else
            acc[i][j] += dx * sc.d[s] * static_cast<float>(lo + hi);
          if constexpr (W::kMin) acc[i][j] += sc.m[s] * x.ds[i * x.ldb + xb + s];
        }
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
  const int64_t ldb = K / kBlock;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    const Q8View x{xq.q + m * K, xq.d + m * ldb, xq.ds + m * ldb, K, ldb};
    int64_t n = n0;
    for (; n + NB <= n1; n += NB)
      micro_q8<MB, NB, Q>(x, w.row(n), w.row_stride(n), w.block_stride(n),
                          w.prefetch_offset(n, NB), num_blocks,
                          bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
    for (; n < n1; ++n)
      micro_q8<MB, 1, Q>(x, w.row(n), w.row_stride(n), w.block_stride(n),
                         w.prefetch_offset(n, 1), num_blocks,
                         bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
  }
}

// `work_item_q8` on a lane-grouped segment: the whole groups by lanes (AVX2), the plain rows
// after them by rows_block_q8; without AVX2 all of them by rows_block_q8 on plain copies.
template <typename Q>
void lane_group_item_q8(const Q8Rows& xq, int64_t r0, int64_t r1, int64_t K, const Segment& seg,
                        int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  const int64_t num_blocks = K / Q::kWeights, row_bytes = num_blocks * Q::kBytes;
  const int64_t r4 = r0 + (r1 - r0) / 4 * 4;
#ifdef PAGEDLLM_AVX2
  const int64_t end = std::min(n1, seg.rows / kGroupRows * kGroupRows);
  if (end > n0) {
    lanes_block_q8<4, Q>(xq, K, r0, r4, seg.data, row_bytes, n0, end, bias, y, ldy);
    lanes_block_q8<1, Q>(xq, K, r4, r1, seg.data, row_bytes, n0, end, bias, y, ldy);
    n0 = end;
  }
#endif
  std::vector<uint8_t> buf;
  int64_t first;
  const RowLayout w(readable_rows<Q>(seg, row_bytes, n0, n1, buf, &first), row_bytes,
                    Q::kBytes);
  const int64_t shift = n0 - first;   // the rows' row n is seg's row n + shift
  if (bias != nullptr) bias += shift;
  y += shift;
  rows_block_q8<4, Q>(xq, K, r0, r4, w, num_blocks, first, n1 - shift, bias, y, ldy);
  rows_block_q8<1, Q>(xq, K, r4, r1, w, num_blocks, first, n1 - shift, bias, y, ldy);
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
  const int64_t r4 = r0 + (r1 - r0) / 4 * 4;
  rows_block_q8<4, Q>(xq, K, r0, r4, w, num_blocks, n0, n1, bias, y, ldy);
  rows_block_q8<1, Q>(xq, K, r4, r1, w, num_blocks, n0, n1, bias, y, ldy);
}

using WorkItemQ8Fn = void (*)(const Q8Rows&, int64_t, int64_t, int64_t, const Segment&, int64_t,
                              int64_t, const float*, float*, int64_t);

WorkItemQ8Fn work_item_q8_for(int64_t ggml_type) {
  WorkItemQ8Fn fn = nullptr;
  visit_block_type(ggml_type, [&](auto q) { fn = work_item_q8<decltype(q)>; });
  return fn;
}

}  // namespace

void quantize_rows_q8(const float* x, int64_t ldx, int64_t M, int64_t K, const Q8Rows& out) {
  const int64_t ldb = K / kBlock;
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * ldx, K, out.q + m * K, out.d + m * ldb, out.ds + m * ldb);
}

void linear_segments_tiles_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                              const Segment* segments, int64_t num_segments, const float* bias,
                              float* y, int64_t ldy, const Q8Rows& scratch) {
  quantize_rows_q8(x, ldx, M, K, scratch);
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

// `linear_gguf_segments` (cpu_gguf_linear.cpp) with x rounded to 8 bits per 32-value block
// first (gguf_q8_dot.h). Returns 0, or -1 if a segment's type is not taken (nothing written).
int linear_gguf_segments_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                            const pagedllm::gguf::Segment* segments, int64_t num_segments,
                            const float* bias, float* y, int64_t ldy) {
  using namespace pagedllm::gguf;
  if (!segments_supported(segments, num_segments)) return -1;
  std::vector<int8_t> q(static_cast<size_t>(M * K));
  std::vector<float> d(static_cast<size_t>(M * (K / kBlock))), ds(d.size());
  const Q8Rows scratch{q.data(), d.data(), ds.data()};
#pragma omp parallel
  linear_segments_tiles_q8(x, ldx, M, K, segments, num_segments, bias, y, ldy, scratch);
  return 0;
}

// The rounding of `linear_gguf_segments_q8` alone: q [M, K] int8, d and ds [M, K / 32] float32
// (gguf_q8_dot.h), K a multiple of 32.
void quantize_rows_gguf_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q,
                           float* d, float* ds) {
  pagedllm::gguf::quantize_rows_q8(x, ldx, M, K, pagedllm::gguf::Q8Rows{q, d, ds});
}

// 0: portable integer dots, 1: AVX2, 2: AVX512-VNNI (what this build compiled).
int gguf_q8_dot_isa() { return pagedllm::gguf::q8_dot_isa(); }

}  // extern "C"
