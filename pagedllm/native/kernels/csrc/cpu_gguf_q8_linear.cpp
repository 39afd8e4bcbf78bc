// The 8-bit-activation GGUF linears of gguf_q8_dot.h (see there for the scheme): the rounding
// of x, the per-type weight decoders of the integer path, the register-blocked micro-kernels
// (MB rows of x times NB rows of w, as cpu_gguf_linear.cpp's float path) and their work sharing,
// plus the module path's entry points `linear_gguf_segments_q8` and `quantize_rows_gguf_q8`.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// --- micro-kernels: y[i][j] = dot(x_q row i, w row j) (+ bias[j]) for i < MB, j < NB.
// `x` holds the MB rows' rounded activations from the block under the row's first weight
// (row strides ldq bytes of q, ldb scales, ldg bsums).

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

// x rows [m, m + MB) of xq's 32-value blocks as the lane kernel reads them: per row i and
// block b the 4 vectors at xl + ((i num_blocks + b) 4 + c) 32, vector c holding dwords 2c
// (lanes 0-3) and 2c + 1 (lanes 4-7) of the block. Made once per x tile and read for every
// group of the work item's weight rows (permuting x per group and block bound the lane
// kernel on a Zen 4's one shuffle port).
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
        _mm256_store_si256(reinterpret_cast<__m256i*>(xl + ((i * num_blocks + b) * 4 + c) * 32),
                           _mm256_permutevar8x32_epi32(xv, perm[c]));
    }
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
inline void micro_q8_lanes(const Q8View& x, const int8_t* xl, const uint8_t* w,
                           int64_t num_blocks, const float* bias, float* y, int64_t ldy) {
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
      const int8_t* xb = xl + (i * num_blocks + b) * 4 * 32;
      __m256i dot = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i xs = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + 32 * c));
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

// x rows [m, m + MB)'s sub-block sums per 256-value block as the mins' dots read them: per row
// i and block b two vectors at xm + (i num_blocks + b) 2 of int16 pairs, [0] (bsum0, bsum1) in
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
      xm[(i * num_blocks + b) * 2] = _mm256_permutevar8x32_epi32(packed, lo);
      xm[(i * num_blocks + b) * 2 + 1] = _mm256_permutevar8x32_epi32(packed, hi);
    }
}

// `micro_q8_lanes` for a Q4_K or Q5_K group: x's quants from its lanes `xl` (expand_lanes over
// the 32-value sub-blocks) and sub-block sums `xm` (expand_mins).
template <int MB, typename Q>
inline void micro_q8k_lanes(const Q8View& x, const int8_t* xl, const __m256i* xm,
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
      const __m256i* m = xm + (i * num_blocks + b) * 2;
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
          const int8_t* xs = xl + ((i * num_blocks + b) * kSubs + 2 * p + h) * 4 * 32;
          __m256i dot = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c)
            dot = dot_u8s8(dot, wq[h][c],
                           _mm256_load_si256(reinterpret_cast<const __m256i*>(xs + 32 * c)));
          block[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc.dsc[2 * p + h], block[i][h]);
        }
    }
    for (int i = 0; i < MB; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_add_ps(block[i][0], block[i][1]),
                               _mm256_set1_ps(x.d[i * x.ldb + b]), acc[i]);
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
  // 2 vectors per row and block.
  thread_local std::vector<__m256i> lanes;
  const int64_t lane_vectors = MB * num_subs * 4;
  lanes.resize(static_cast<size_t>(lane_vectors + (kSuperBlocks ? MB * num_blocks * 2 : 0)));
  int8_t* xl = reinterpret_cast<int8_t*>(lanes.data());
  __m256i* xm = lanes.data() + lane_vectors;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    const Q8View x = q8_view<Q>(xq, K, m);
    expand_lanes<MB>(x, num_subs, xl);
    if constexpr (kSuperBlocks) expand_mins<MB>(x, num_blocks, xm);
    for (int64_t n = n0; n < n1; n += kGroupRows) {
      const float* b = bias != nullptr ? bias + n : nullptr;
      const uint8_t* group = data + n * row_bytes;
      if constexpr (kSuperBlocks)
        micro_q8k_lanes<MB, Q>(x, xl, xm, group, num_blocks, b, y + m * ldy + n, ldy);
      else
        micro_q8_lanes<MB, Q>(x, xl, group, num_blocks, b, y + m * ldy + n, ldy);
    }
  }
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
