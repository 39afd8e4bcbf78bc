// The operands of the 8-bit-activation GGUF linears (gguf_q8_dot.h describes the scheme): the
// rounding of x into its 32- and 256-value-block formats (`quantize_row`, `quantize_row_k`),
// the per-type weight decoders of the integer path (`Q8Weights` for the 32-value types,
// `KWeights` and their integer scales for the K-quants), the view of the rounded rows a
// micro-kernel reads (`Q8View`) and the AVX2 / VNNI integer dots (`dot_u8s8`, `dot_s16`).
//
// Private to cpu_gguf_q8_linear.cpp and gguf_q8_lanes.h: everything sits in an anonymous
// namespace (internal linkage, as when it was part of that source), so include it from that
// one source only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gguf_q8_dot.h"

namespace pagedllm {
namespace gguf {
namespace {

// --- activations

// max |x[i]| over n values (n a multiple of 32).
inline float abs_max(const float* x, int64_t n) {
#ifdef PAGEDLLM_AVX2
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
#endif
}

// q[i] = round_half_even(x[i] * id) for 32 values; sums[0] / sums[1]: the sums of q over
// values 0-15 / 16-31.
inline void round32(const float* x, float id, int8_t* q, int32_t sums[2]) {
#ifdef PAGEDLLM_AVX2
  // cvtps rounds to nearest even (the default MXCSR mode), as nearbyint below.
  __m256i i32[4];
  for (int c = 0; c < 4; ++c)
    i32[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * c), _mm256_set1_ps(id)));
  // Two hadds of (values 0-7 + 8-15, 16-23 + 24-31): dwords 0 and 1 of each 128-bit half
  // then hold the two 16-value sums of that half's lanes; the halves added give the sums.
  __m256i h = _mm256_hadd_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  h = _mm256_hadd_epi32(h, h);
  const __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  sums[0] = _mm_cvtsi128_si32(s2);
  sums[1] = _mm_extract_epi32(s2, 1);
  // The packs interleave 128-bit lanes: dword groups come out as a0 b0 c0 d0 a1 b1 c1 d1 (x
  // of vector x, 4 values each); the permutation restores a0 a1 b0 b1 ...
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                            _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed,
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  sums[0] = sums[1] = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * id));
    q[i] = static_cast<int8_t>(v);
    sums[i / 16] += v;
  }
#endif
}

// One row in the 32-value-block format.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float db = abs_max(x + b * kBlock, kBlock) / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    int32_t sums[2];
    round32(x + b * kBlock, id, q + b * kBlock, sums);
    d[b] = db;
    ds[b] = db * static_cast<float>(sums[0] + sums[1]);
  }
}

// One row in the 256-value-block format (q8_K).
constexpr int kSuper = 256;
inline void quantize_row_k(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < K / kSuper; ++b) {
    const float db = abs_max(x + b * kSuper, kSuper) / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    for (int c = 0; c < kSuper / kBlock; ++c) {
      int32_t sums[2];
      round32(x + b * kSuper + c * kBlock, id, q + b * kSuper + c * kBlock, sums);
      bsums[b * 16 + 2 * c] = static_cast<int16_t>(sums[0]);
      bsums[b * 16 + 2 * c + 1] = static_cast<int16_t>(sums[1]);
    }
    d[b] = db;
  }
}

// --- 32-value weights: per type, the float scales of a block and its quants.
//
// `Scales::d` multiplies the integer dot; `Scales::m` (types with kMin) multiplies ds of the
// activation block, the whole offset term. kSigned (Q8_0 without VNNI): the quants are int8
// (dot with the sign trick); else uint8 (u8 x s8 dots directly), the true quant being
// u - kBias.

template <typename Q>
struct Q8Weights;

// The scales of the 32-weight types, fp16 at the block's start. The signed ones (Q4_0 n - 8,
// Q5_0 n - 16, and Q8_0 q with VNNI) are taken as unsigned quants u = q + B (kBias = B): the
// integer dot starts from -B sum(qx) (the dot's accumulator input) and needs no sign trick,
// sum(u qx) - B sum(qx) = sum(q qx). AVX2's maddubs would saturate Q8_0's u <= 255 (its int16
// pair sums), so without VNNI Q8_0 keeps the sign trick (`SignedScale`).
struct SignedScale {
  static constexpr bool kSigned = true, kMin = false;
  static constexpr int kBias = 0;
  struct Scales { float d; };
  static void scales(const uint8_t* b, Scales* s) { s->d = half_to_float(b); }
};

template <int B>
struct BiasedScale : SignedScale {
  static constexpr bool kSigned = false;
  static constexpr int kBias = B;
};

// The unsigned ones (Q4_1, Q5_1): d, then the offset m.
struct OffsetScales {
  static constexpr bool kSigned = false, kMin = true;
  static constexpr int kBias = 0;
  struct Scales { float d, m; };
  static void scales(const uint8_t* b, Scales* s) {
    s->d = half_to_float(b);
    s->m = half_to_float(b + 2);
  }
};

#ifdef PAGEDLLM_VNNI
template <>
struct Q8Weights<Q8_0> : BiasedScale<128> {
  static __m256i quants(const uint8_t* b) {   // q + 128 = q with its top bit flipped
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};
#else
template <>
struct Q8Weights<Q8_0> : SignedScale {
  static void quants(const uint8_t* b, int32_t* q) {
    for (int i = 0; i < kBlock; ++i) q[i] = static_cast<int8_t>(b[2 + i]);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b) {
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
  static void quants(const uint8_t* b, int32_t* q) {
    for (int i = 0; i < 16; ++i) {
      q[i] = b[kQs + i] & 0x0f;
      q[i + 16] = b[kQs + i] >> 4;
    }
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b) { return nibbles32(b + kQs); }
#endif
};

template <int kQh, int kQs>
struct Nibble5Quants {
  static void quants(const uint8_t* b, int32_t* q) {
    const uint32_t qh = load_u32(b + kQh);
    for (int i = 0; i < kBlock; ++i) q[i] = q5_quant(b + kQs, qh, i);
  }
#ifdef PAGEDLLM_AVX2
  static __m256i quants(const uint8_t* b) {
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

// --- K-quant weights (read against the 256-value activation blocks): the quants of
// sub-block s as for the 32-value types (unsigned), and the block's integer scales.

// The 8 six-bit scales and 8 mins of a Q4_K/Q5_K block at once with 32-bit masks (llama.cpp's
// ggml_vec_dot_q4_K_q8_K does likewise): v[0..7] = sc, v[8..15] = m (k4_scale_min's rules).
// (The portable path's; K4IntScales does the same on vectors.)
inline void k4_scale_bytes(const uint8_t* b, uint8_t v[16]) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);   // m[4..7]
  const uint32_t m03 = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);          // sc[4..7]
  u[2] = m03;
  u[0] &= kLow6;                                                 // sc[0..3]
  std::memcpy(v, u, 16);
}

// A K-quant block's scales as the integer path applies them: sub-block s's products times its
// int16 scale(s), then per 16-value group g the bsums term `group[g] bsum[g]`: Q4_K / Q5_K the
// min (group[g] = m[g / 2], times -dmin), Q6_K the bias (group[g] = sc[g], times -32 d).
struct KScales {
  float d, dmin;
#ifdef PAGEDLLM_AVX2
  // int16 scales, 8 per 128-bit half, which the type's `sub_scale(s)` broadcasts: Q4_K/Q5_K
  // sc[s] everywhere (both halves of src[0] sc[0..7]); Q6_K sc[2s] in the low half,
  // sc[2s + 1] in the high one (both halves of src[0] sc[0..7], of src[1] sc[8..15]).
  __m256i src[2];
  __m256i group;    // int16 group[g] in element g
#else
  int32_t sub[16];  // the scale of weights 16 h .. 16 h + 15 of sub-block s at 2 s + h
  int32_t group[16];
#endif
};

#ifdef PAGEDLLM_AVX2
// The byte shuffles that broadcast int16 element e of each 128-bit half, for the halves'
// elements of sub-block s: kBroadcast.same[s] (e = s in both halves: Q4_K / Q5_K) and
// kBroadcast.pairs[s] (e = 2s mod 8 low, 2s + 1 mod 8 high: Q6_K).
struct BroadcastMasks {
  alignas(32) int8_t same[8][32], pairs[8][32];
  BroadcastMasks() {
    for (int s = 0; s < 8; ++s)
      for (int byte = 0; byte < 32; ++byte) {
        const int half = byte / 16, low = byte % 2;
        same[s][byte] = static_cast<int8_t>(2 * s + low);
        pairs[s][byte] = static_cast<int8_t>(2 * ((2 * s + half) % 8) + low);
      }
  }
};
inline const BroadcastMasks kBroadcast;

inline __m256i broadcast_int16(__m256i src, const int8_t* mask) {
  return _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(mask)));
}
#endif

// Q4_K / Q5_K: d, dmin, then the packed 6-bit sc and m.
struct K4IntScales {
  static constexpr bool kMin = true;
  static void scales(const uint8_t* b, KScales* s) {
    s->d = half_to_float(b);
    s->dmin = half_to_float(b + 2);
#ifdef PAGEDLLM_AVX2
    // k4_scale_bytes on one vector: from dwords u0 u1 u2 of the packed scales, sc[0..3] =
    // u0 & 0x3f, sc[4..7] = (u2 & 0x0f) | (u0 >> 6 & 3) << 4, m[0..3] = u1 & 0x3f, m[4..7] =
    // (u2 >> 4 & 0x0f) | (u1 >> 6 & 3) << 4, per byte (the 16-byte load's last dword is quants).
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i low = _mm_and_si128(
        _mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
        _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i high =
        _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i bytes = _mm_or_si128(low, high);
    const __m128i sc = _mm_cvtepu8_epi16(bytes), m = _mm_cvtepu8_epi16(_mm_srli_si128(bytes, 8));
    s->src[0] = _mm256_set_m128i(sc, sc);
    s->group = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
#else
    uint8_t v[16];
    k4_scale_bytes(b, v);
    for (int g = 0; g < 16; ++g) {
      s->sub[g] = v[g / 2];
      s->group[g] = v[8 + g / 2];
    }
#endif
  }
#ifdef PAGEDLLM_AVX2
  static __m256i sub_scale(const KScales& s, int sub) {
    return broadcast_int16(s.src[0], kBroadcast.same[sub]);
  }
#endif
};

template <typename Q>
struct KWeights;

template <>
struct KWeights<Q4_K> : K4IntScales {
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
struct KWeights<Q5_K> : K4IntScales {
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

// Q6_K: quants taken unsigned (q + 32, the bias entering through the bsums term); int8 scales
// per 16 weights at byte 192, d at 208.
template <>
struct KWeights<Q6_K> {
  static constexpr bool kMin = false;
  static void scales(const uint8_t* b, KScales* s) {
    s->d = half_to_float(b + 208);
    s->dmin = 0.f;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
#ifdef PAGEDLLM_AVX2
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m128i lo = _mm_cvtepi8_epi16(raw), hi = _mm_cvtepi8_epi16(_mm_srli_si128(raw, 8));
    s->src[0] = _mm256_set_m128i(lo, lo);
    s->src[1] = _mm256_set_m128i(hi, hi);
    s->group = _mm256_set_m128i(hi, lo);
#else
    for (int g = 0; g < 16; ++g) s->sub[g] = s->group[g] = sc[g];
#endif
  }
#ifdef PAGEDLLM_AVX2
  static __m256i sub_scale(const KScales& s, int sub) {
    return broadcast_int16(s.src[sub / 4], kBroadcast.pairs[sub]);
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

// The activations of MB x rows as a micro-kernel reads them: from the block under the row's
// first weight (row strides ldq bytes of q, ldb scales, ldg bsums).
struct Q8View {
  const int8_t* q;
  const float* d;
  const float* ds;   // (32-value blocks) or
  const int16_t* bsums;   // (256-value blocks)
  int64_t ldq, ldb, ldg;
};

// The activations of x rows [m, ...) in the format type Q reads.
template <typename Q>
inline Q8View q8_view(const Q8Rows& xq, int64_t K, int64_t m) {
  if constexpr (Q::kWeights == kSuper)
    return Q8View{xq.qk + m * K, xq.dk + m * (K / kSuper), nullptr, xq.bsums + m * (K / 16), K,
                  K / kSuper, K / 16};
  else
    return Q8View{xq.q + m * K, xq.d + m * (K / kBlock), xq.ds + m * (K / kBlock), nullptr, K,
                  K / kBlock, 0};
}

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

// acc + eight int32 sums of 2 int16 products each.
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#ifdef PAGEDLLM_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

}  // namespace
}  // namespace gguf
}  // namespace pagedllm
