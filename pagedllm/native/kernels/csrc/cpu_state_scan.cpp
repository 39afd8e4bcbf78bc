// The recurrent (state-space / linear-attention) layers' ops over a varlen token batch
// (pagedllm/native/kernels/state_ops.py; the torch references are layers/state_ops.py and
// layers/gated_delta_ops.py):
//
//   causal_conv1d_varlen_cpu     depthwise causal conv1d with a per-request window state
//                                (Mamba-2's conv1d, LFM2's short conv, Gated DeltaNet's conv)
//   ssd_scan_varlen_cpu          Mamba-2's selective state update h_t = exp(dt A) h_{t-1} +
//                                dt x_t B_t^T, y_t = h_t C_t + D x_t  (Dao & Gu 2024, eq. 1/2)
//   gated_delta_rule_varlen_cpu  the gated delta rule S_t = exp(g_t) S_{t-1} (I - beta k k^T) +
//                                beta k v^T, o_t = S_t^T q_t (Yang et al., ICLR 2025, eq. 10)
//
// All three are the recurrent form run token by token inside each request: prefill chunks and
// decode tokens take the same code, so a chunk split anywhere gives the same numbers, and the
// work per token is O(state size), the chunked algorithms' O(chunk * state) matrix form is not
// used (on a CPU the sequential scan with the state in L1/L2 is faster; see
// docs/hybrid_models.md). Work items are (request, head) pairs (conv: (request, 64-channel
// block)), run in parallel with OpenMP; the state of one item stays in the thread's cache for
// the whole request. The state is float32 (the conv window in the activation dtype, as the
// engine stores it); activations are float32 or bfloat16 (dtype 0 / 1), the arithmetic float32.
// Each entry point returns 0, or -1 when a request's slot (or one of its emit slots) is out of
// range (that request is skipped, the others still run); the conv returns -2 for a window
// wider than kConvMaxWidth (nothing runs).
//
// Emits (StateBatch.emit_*, prefix-caching mode "align"): a request may list tokens of its
// query after which its state is also copied, as it stands, into another slot; the runner asks
// for the block boundaries a step passes, so each becomes a checkpoint. Slot 0 (the null slot:
// a boundary the scheduler gave no slot) is skipped.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "attention_primitives.h"
#include "cpu_vec.h"
#include "pagedllm_abi.h"
#include "state_scan.h"

namespace {

using pagedllm::store;
using pagedllm::to_float;
#ifdef PAGEDLLM_AVX512
using pagedllm::load16;
using pagedllm::round_bf16;
using pagedllm::hsum;
#endif

constexpr int64_t kConvBlock = 64;
// The widest conv window the kernel takes (Mamba-2, Gated DeltaNet and LFM2 use 3-4).
constexpr int64_t kConvMaxWidth = 16;
// Below this many multiply-adds a call runs on one thread: a parallel region's fork and barrier
// cost more than the work (a batch-1 decode step), and much more on a loaded machine, where a
// descheduled thread holds the barrier up.
constexpr int64_t kParallelWork = int64_t{1} << 20;

bool slot_ok(const StateBatch* b, int64_t r) {
  const int64_t s = b->state_indices[r];
  if (s < 0 || s >= b->num_slots) return false;
  if (b->emit_start)
    for (int64_t e = b->emit_start[r]; e < b->emit_start[r + 1]; ++e)
      if (b->emit_slot[e] < 0 || b->emit_slot[e] >= b->num_slots) return false;
  return true;
}

// Walks one request's emits along its tokens: `due(t)` is the slot to copy the state into
// after the token at flat index t (0: none, the null slot), or -1.
class Emits {
 public:
  Emits(const StateBatch* b, int64_t r)
      : offset_(b->emit_offset), slot_(b->emit_slot), start_(b->query_start_loc[r]),
        e_(b->emit_start ? b->emit_start[r] : 0), end_(b->emit_start ? b->emit_start[r + 1] : 0) {}
  int64_t due(int64_t t) {
    if (e_ < end_ && t - start_ == offset_[e_]) return slot_[e_++];
    return -1;
  }

 private:
  const int64_t* offset_;
  const int64_t* slot_;
  int64_t start_, e_, end_;
};

// One request's channels [c0, c1) over its tokens. The window (the K - 1 inputs before the
// request's first token, from its state slot) is read once into `win`; token t's taps are the
// window's last rows while t is within K - 1 tokens of the start, then rows of x itself, so the
// steady state reads x directly (no shifting window), with the channels innermost.
template <typename T, typename S>
void conv_block(const StateBatch* b, int64_t r, int64_t c0, int64_t c1, const T* x, int64_t ldx,
                int64_t width, const float* weight_t, const float* bias, S* conv_states,
                int64_t channels, bool silu, T* out, int64_t ldo) {
  const int64_t k1 = width - 1, nc = c1 - c0;
  const int64_t slot = b->state_indices[r];
  const int64_t start = b->query_start_loc[r], end = b->query_start_loc[r + 1];
  S* state = conv_states + slot * channels * k1;
  float win[kConvMaxWidth * kConvBlock];   // win[j * nc + i]: input j of the old window
  float acc[kConvBlock];
  for (int64_t i = 0; i < nc; ++i) {
    for (int64_t j = 0; j < k1; ++j)
      win[j * nc + i] = b->has_initial_state[r] ? to_float(state[(c0 + i) * k1 + j]) : 0.0f;
  }
  // Input j of the window that ends at token t (j = K - 1: token t itself).
  auto tap = [&](int64_t t, int64_t j, int64_t i) -> float {
    const int64_t src = t - k1 + j;
    return src >= start ? to_float(x[src * ldx + c0 + i]) : win[(src - start + k1) * nc + i];
  };
  // The window after token t (its last K - 1 inputs) into `dst` ([channels, K - 1] rows).
  auto save = [&](int64_t t, S* dst) {
    for (int64_t i = 0; i < nc; ++i)
      for (int64_t j = 0; j < k1; ++j) store(tap(t, j + 1, i), dst + (c0 + i) * k1 + j);
  };
  Emits emits(b, r);
  for (int64_t t = start; t < end; ++t) {
    for (int64_t i = 0; i < nc; ++i) acc[i] = bias ? bias[c0 + i] : 0.0f;
    if (t - start >= k1) {
      for (int64_t j = 0; j < width; ++j) {
        const T* row = x + (t - k1 + j) * ldx + c0;
        const float* w = weight_t + j * channels + c0;
#pragma omp simd
        for (int64_t i = 0; i < nc; ++i) acc[i] += w[i] * to_float(row[i]);
      }
    } else {
      for (int64_t j = 0; j < width; ++j)
        for (int64_t i = 0; i < nc; ++i) acc[i] += weight_t[j * channels + c0 + i] * tap(t, j, i);
    }
    T* dst = out + t * ldo + c0;
    if (silu) pagedllm::silu_inplace(acc, nc);
    for (int64_t i = 0; i < nc; ++i) store(acc[i], dst + i);
    const int64_t emit = emits.due(t);
    if (emit > 0) save(t, conv_states + emit * channels * k1);
  }
  save(end - 1, state);   // (an empty request writes its window back unchanged)
}

#ifdef PAGEDLLM_AVX512
// The three-tap window (Gated DeltaNet's and Mamba-2's 4-tap conv) of a decode row in 16-channel
// groups: a group's window is 48 consecutive values of the slot ([channel][tap]), read as three
// vectors; tap j of the 16 channels (values 3i + j) is picked out by two permutes and a blend,
// and the shifted window (value q <- q + 1, the token's input at q = 3i + 2) is put back by the
// same means, so the slot is read and written once, in whole vectors. The sums are
// conv_decode_token's, in its order (bit for bit).
inline __m512 load_any16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_any16(const uint16_t* p) { return load16(p); }
inline void store_any16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }
inline void store_any16(__m512 v, uint16_t* p) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

template <typename T, typename S>
int64_t conv_decode3_vec(const T* __restrict xr, const float* __restrict weight_t,
                         const float* bias, S* __restrict st, bool initial, int64_t c0,
                         int64_t nc, int64_t channels, float* __restrict acc) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i three = _mm512_set1_epi32(3);
  __m512i tap_idx[3];
  __mmask16 tap_in_c[3];
  for (int j = 0; j < 3; ++j) {
    tap_idx[j] = _mm512_add_epi32(_mm512_mullo_epi32(lane, three), _mm512_set1_epi32(j));
    tap_in_c[j] = _mm512_cmpge_epi32_mask(tap_idx[j], _mm512_set1_epi32(32));
  }
  __m512i next_idx[3], x_idx[3];
  __mmask16 is_x[3];
  for (int o = 0; o < 3; ++o) {
    const __m512i q = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * o));
    next_idx[o] = _mm512_add_epi32(lane, _mm512_set1_epi32(1));   // q + 1 - 16 o
    // q / 3 and q % 3 for q < 48: (q * 43) >> 7 is q / 3 there.
    x_idx[o] = _mm512_srli_epi32(_mm512_mullo_epi32(q, _mm512_set1_epi32(43)), 7);
    is_x[o] = _mm512_cmpeq_epi32_mask(
        _mm512_sub_epi32(q, _mm512_mullo_epi32(x_idx[o], three)), _mm512_set1_epi32(2));
  }
  int64_t i = 0;
  for (; i + 16 <= nc; i += 16) {
    S* p = st + (c0 + i) * 3;
    __m512 v[4];
    for (int o = 0; o < 3; ++o) v[o] = initial ? load_any16(p + 16 * o) : _mm512_setzero_ps();
    v[3] = _mm512_setzero_ps();
    __m512 a = bias ? _mm512_loadu_ps(bias + c0 + i) : _mm512_setzero_ps();
    for (int j = 0; j < 3; ++j) {
      const __m512 ab = _mm512_permutex2var_ps(v[0], tap_idx[j], v[1]);
      const __m512 c = _mm512_permutexvar_ps(tap_idx[j], v[2]);
      const __m512 tap = _mm512_mask_blend_ps(tap_in_c[j], ab, c);
      a = _mm512_fmadd_ps(_mm512_loadu_ps(weight_t + j * channels + c0 + i), tap, a);
    }
    const __m512 x = load_any16(xr + i);
    a = _mm512_fmadd_ps(_mm512_loadu_ps(weight_t + 3 * channels + c0 + i), x, a);
    _mm512_storeu_ps(acc + i, a);
    for (int o = 0; o < 3; ++o) {
      const __m512 shifted = _mm512_permutex2var_ps(v[o], next_idx[o], v[o + 1]);
      store_any16(_mm512_mask_blend_ps(is_x[o], shifted, _mm512_permutexvar_ps(x_idx[o], x)),
                  p + 16 * o);
    }
  }
  return i;
}
#endif

// A one-token query (a decode row) of one request's channels [c0, c1) for a window of K1 + 1
// taps known at compile time: each channel's K1 window inputs are read from the slot in
// place, the output is the same sum in the same order as conv_block's (bias, then the taps
// oldest first), and the window is shifted in the slot (the token's input appended) without
// a float copy of the block's window. `state` is the slot's [channels, K1] window.
template <int K1, typename T, typename S>
void conv_decode_token(const T* __restrict xr, const float* __restrict weight_t,
                       const float* bias, S* __restrict state, bool initial, int64_t c0,
                       int64_t c1, int64_t channels, bool silu, T* __restrict dst) {
  const int64_t nc = c1 - c0;
  float acc[kConvBlock];
  int64_t i0 = 0;
#ifdef PAGEDLLM_AVX512
  if constexpr (K1 == 3)
    i0 = conv_decode3_vec(xr, weight_t, bias, state, initial, c0, nc, channels, acc);
#endif
  S* __restrict st = state + c0 * K1;
  const float* __restrict wx = weight_t + K1 * channels + c0;   // the token's own tap
  for (int64_t i = i0; i < nc; ++i) {
    float a = bias ? bias[c0 + i] : 0.0f;
    float old[K1];
    for (int j = 0; j < K1; ++j) old[j] = initial ? to_float(st[i * K1 + j]) : 0.0f;
    for (int j = 0; j < K1; ++j) a += weight_t[j * channels + c0 + i] * old[j];
    const float xi = to_float(xr[i]);
    a += wx[i] * xi;
    acc[i] = a;
    for (int j = 0; j + 1 < K1; ++j) store(old[j + 1], st + i * K1 + j);
    store(xi, st + i * K1 + K1 - 1);
  }
  if (silu) pagedllm::silu_inplace(acc, nc);
  for (int64_t i = 0; i < nc; ++i) store(acc[i], dst + i);
}


// One request's channels: the compile-time decode form for one-token queries of the common
// widths (2 to 4 taps: Mamba-2, Gated DeltaNet, LFM2), conv_block otherwise.
template <typename T, typename S>
void conv_item(const StateBatch* b, int64_t r, int64_t c0, int64_t c1, const T* x, int64_t ldx,
               int64_t width, const float* weight_t, const float* bias, S* conv_states,
               int64_t channels, bool silu, T* out, int64_t ldo) {
  const int64_t start = b->query_start_loc[r];
  const bool one = b->query_start_loc[r + 1] - start == 1;
  const bool emits = b->emit_start && b->emit_start[r + 1] > b->emit_start[r];
  if (one && !emits && width >= 2 && width <= 4) {
    S* state = conv_states + b->state_indices[r] * channels * (width - 1);
    const T* xr = x + start * ldx + c0;
    T* dst = out + start * ldo + c0;
    const bool init = b->has_initial_state[r] != 0;
    if (width == 4)
      conv_decode_token<3>(xr, weight_t, bias, state, init, c0, c1, channels, silu, dst);
    else if (width == 3)
      conv_decode_token<2>(xr, weight_t, bias, state, init, c0, c1, channels, silu, dst);
    else
      conv_decode_token<1>(xr, weight_t, bias, state, init, c0, c1, channels, silu, dst);
    return;
  }
  conv_block(b, r, c0, c1, x, ldx, width, weight_t, bias, conv_states, channels, silu, out, ldo);
}

template <typename T, typename S>
int conv_all(const StateBatch* b, const T* x, int64_t ldx, int64_t channels, int64_t width,
             const float* weight, const float* bias, S* conv_states, int silu, T* out) {
  if (width < 1 || width > kConvMaxWidth) return -2;
  // weight_t[j * channels + c]: channel c's tap j (the taps of a channel block contiguous).
  std::vector<float> weight_t(static_cast<size_t>(width * channels));
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t j = 0; j < width; ++j) weight_t[j * channels + c] = weight[c * width + j];
  const int64_t blocks = (channels + kConvBlock - 1) / kConvBlock;
  const int64_t work = b->query_start_loc[b->num_reqs] * channels * width;
  int bad = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(| : bad) \
    if (work > kParallelWork)
  for (int64_t r = 0; r < b->num_reqs; ++r)
    for (int64_t cb = 0; cb < blocks; ++cb) {
      if (!slot_ok(b, r)) {
        bad = 1;
        continue;
      }
      const int64_t c0 = cb * kConvBlock;
      const int64_t c1 = c0 + kConvBlock < channels ? c0 + kConvBlock : channels;
      conv_item(b, r, c0, c1, x, ldx, width, weight_t.data(), bias, conv_states, channels,
                silu != 0, out, channels);
    }
  return bad ? -1 : 0;
}

template <typename T>
int ssd_all(const StateBatch* b, const T* x, const float* dt, const float* A, const T* B,
            const T* C, const float* D, float* ssm_states, int64_t H, int64_t P, int64_t G,
            int64_t N, float dt_min, float dt_max, int clamp_prefill, float* y) {
  const int64_t heads_per_group = H / G;
  const int64_t work = b->query_start_loc[b->num_reqs] * H * P * N * 2;
  int bad = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(| : bad) \
    if (work > kParallelWork)
  for (int64_t r = 0; r < b->num_reqs; ++r)
    for (int64_t h = 0; h < H; ++h) {
      if (!slot_ok(b, r)) {
        bad = 1;
        continue;
      }
      float* S = ssm_states + (b->state_indices[r] * H + h) * P * N;
      if (!b->has_initial_state[r])
        for (int64_t i = 0; i < P * N; ++i) S[i] = 0.0f;
      const int64_t start = b->query_start_loc[r], end = b->query_start_loc[r + 1];
      const bool clamp = clamp_prefill && end - start > 1;
      const int64_t g = h / heads_per_group;
      std::vector<float> bt(static_cast<size_t>(N)), ct(static_cast<size_t>(N));
      Emits emits(b, r);
      for (int64_t t = start; t < end; ++t) {
        float d = dt[t * H + h];
        if (clamp) d = d < dt_min ? dt_min : (d > dt_max ? dt_max : d);
        const float decay = std::exp(d * A[h]);
        for (int64_t n = 0; n < N; ++n) {
          bt[n] = to_float(B[(t * G + g) * N + n]);
          ct[n] = to_float(C[(t * G + g) * N + n]);
        }
        const T* xt = x + (t * H + h) * P;
        float* yt = y + (t * H + h) * P;
        for (int64_t p = 0; p < P; ++p) {
          const float xp = to_float(xt[p]);
          const float s = d * xp;
          float* row = S + p * N;
          float acc = 0.0f;
          for (int64_t n = 0; n < N; ++n) {
            row[n] = row[n] * decay + s * bt[n];
            acc += row[n] * ct[n];
          }
          yt[p] = acc + D[h] * xp;
        }
        const int64_t emit = emits.due(t);
        if (emit > 0) std::copy(S, S + P * N, ssm_states + (emit * H + h) * P * N);
      }
    }
  return bad ? -1 : 0;
}

template <typename T>
void load_l2_normalised(const T* src, int64_t n, float scale, float* dst) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = to_float(src[i]);
    ss += dst[i] * dst[i];
  }
  const float f = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) dst[i] *= f;
}

// One token of the gated delta rule on one head's state S [dk, DV] (row i: key channel i):
//   kv = S^T k after the decay;  delta = (v - kv) * beta;  S += k delta^T;  o = S^T q.
// DV (the value head size) is a compile-time constant so that kv, delta and o stay in vector
// registers across the dk rows (each pass streams S once from L1).
template <int DV, typename T>
inline void delta_token(float* __restrict S, const float* __restrict qt,
                        const float* __restrict kt, const T* vt, float decay, float bt,
                        int64_t dk, float* __restrict ot) {
  float kv[DV], delta[DV], acc[DV];
#pragma omp simd
  for (int j = 0; j < DV; ++j) kv[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict row = S + i * DV;
    const float ki = kt[i];
#pragma omp simd
    for (int j = 0; j < DV; ++j) {
      row[j] *= decay;
      kv[j] += ki * row[j];
    }
  }
  for (int j = 0; j < DV; ++j) delta[j] = (to_float(vt[j]) - kv[j]) * bt;
#pragma omp simd
  for (int j = 0; j < DV; ++j) acc[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict row = S + i * DV;
    const float ki = kt[i], qi = qt[i];
#pragma omp simd
    for (int j = 0; j < DV; ++j) {
      row[j] += ki * delta[j];
      acc[j] += qi * row[j];
    }
  }
  for (int j = 0; j < DV; ++j) ot[j] = acc[j];
}

// The same for any value head size (the state rows through memory buffers).
template <typename T>
inline void delta_token_any(float* S, const float* qt, const float* kt, const T* vt, float decay,
                            float bt, int64_t dk, int64_t dv, float* kv, float* delta,
                            float* ot) {
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float ki = kt[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (to_float(vt[j]) - kv[j]) * bt;
  for (int64_t j = 0; j < dv; ++j) ot[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const float ki = kt[i], qi = qt[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * delta[j];
      ot[j] += qi * row[j];
    }
  }
}

#ifdef PAGEDLLM_AVX512
// q and k of one token's key head, L2-normalised (times `scale`) in 16 lanes: the sum of
// squares in 16 partial sums, then hsum (another order than load_l2_normalised's, ~1 ulp).
// n % 16 == 0.
template <typename T>
inline void load_l2_normalised16(const T* src, int64_t n, float scale, float* dst) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 x = load_any16(src + i);
    _mm512_storeu_ps(dst + i, x);
    ss = _mm512_fmadd_ps(x, x, ss);
  }
  const __m512 f = _mm512_set1_ps(scale / std::sqrt(hsum(ss) + 1e-6f));
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(dst + i), f));
}

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

inline float dot16(const float* a, const float* b, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16)
    s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
  return hsum(s);
}

// One token of the gated delta rule on one head's state S [dk, DV] in two passes over S
// instead of delta_token's two read-write passes: with S the state before the token,
//   kv = decay (S^T k),  delta = (v - kv) beta,  o = decay (S^T q) + (q . k) delta,
//   S <- decay S + k delta^T,
// the same quantities as delta_token's (S' = decay S + k delta^T gives S'^T q = decay S^T q +
// (k . q) delta), in another rounding order. The first pass only reads S (S^T k and S^T q
// together, G groups of rows in separate accumulators so that the FMA chains overlap), the
// second reads and writes it once. DV % 16 == 0; `qk` is q . k.
template <int DV, int G, typename T>
inline void delta_token_fused(float* __restrict S, const float* __restrict qt,
                              const float* __restrict kt, const T* vt, float decay, float bt,
                              float qk, int64_t dk, float* __restrict ot,
                              const float* next = nullptr) {
  constexpr int V = DV / 16;
  __m512 kv[G][V], sq[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) kv[g][c] = sq[g][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + G <= dk; i += G)
    for (int g = 0; g < G; ++g) {
      const float* row = S + (i + g) * DV;
      const __m512 kb = _mm512_set1_ps(kt[i + g]), qb = _mm512_set1_ps(qt[i + g]);
      for (int c = 0; c < V; ++c) {
        const __m512 x = _mm512_loadu_ps(row + 16 * c);
        kv[g][c] = _mm512_fmadd_ps(kb, x, kv[g][c]);
        sq[g][c] = _mm512_fmadd_ps(qb, x, sq[g][c]);
      }
    }
  for (; i < dk; ++i) {
    const float* row = S + i * DV;
    const __m512 kb = _mm512_set1_ps(kt[i]), qb = _mm512_set1_ps(qt[i]);
    for (int c = 0; c < V; ++c) {
      const __m512 x = _mm512_loadu_ps(row + 16 * c);
      kv[0][c] = _mm512_fmadd_ps(kb, x, kv[0][c]);
      sq[0][c] = _mm512_fmadd_ps(qb, x, sq[0][c]);
    }
  }
  const __m512 dec = _mm512_set1_ps(decay), bet = _mm512_set1_ps(bt), qkv = _mm512_set1_ps(qk);
  __m512 delta[V];
  for (int c = 0; c < V; ++c) {
    __m512 k_sum = kv[0][c], q_sum = sq[0][c];
    for (int g = 1; g < G; ++g) {
      k_sum = _mm512_add_ps(k_sum, kv[g][c]);
      q_sum = _mm512_add_ps(q_sum, sq[g][c]);
    }
    delta[c] = _mm512_mul_ps(_mm512_fnmadd_ps(dec, k_sum, load_any16(vt + 16 * c)), bet);
    _mm512_storeu_ps(ot + 16 * c, _mm512_fmadd_ps(dec, q_sum, _mm512_mul_ps(qkv, delta[c])));
  }
  for (i = 0; i < dk; ++i) {
    float* row = S + i * DV;
    if (next != nullptr)
      for (int c = 0; c < V; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(next + i * DV + 16 * c), _MM_HINT_T0);
    const __m512 kb = _mm512_set1_ps(kt[i]);
    for (int c = 0; c < V; ++c)
      _mm512_storeu_ps(row + 16 * c,
                       _mm512_fmadd_ps(kb, delta[c],
                                       _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), dec)));
  }
}
#endif

template <typename T>
int gated_delta_all(const StateBatch* b, const T* q, const T* k, int64_t ld_qk, const T* v,
                    int64_t ldv, const float* g, const float* beta, float* states, int64_t H,
                    int64_t Hk, int64_t dk, int64_t dv, float* out) {
  const int64_t per = H / Hk;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  const int64_t work = b->query_start_loc[b->num_reqs] * H * dk * dv * 4;
#ifdef PAGEDLLM_AVX512
  // The two-pass form for value heads of 32, 64 and 128 and key heads of whole vectors.
  const bool fused = (dv == 32 || dv == 64 || dv == 128) && dk % 16 == 0;
#endif
  int bad = 0;
#pragma omp parallel for collapse(2) schedule(dynamic) reduction(| : bad) \
    if (work > kParallelWork)
  for (int64_t r = 0; r < b->num_reqs; ++r)
    for (int64_t h = 0; h < H; ++h) {
      if (!slot_ok(b, r)) {
        bad = 1;
        continue;
      }
      float* S = states + (b->state_indices[r] * H + h) * dk * dv;   // [dk, dv]
      if (!b->has_initial_state[r])
        for (int64_t i = 0; i < dk * dv; ++i) S[i] = 0.0f;
      const int64_t hk = h / per;
      std::vector<float> qt(static_cast<size_t>(dk)), kt(static_cast<size_t>(dk));
      std::vector<float> kv(static_cast<size_t>(dv)), delta(static_cast<size_t>(dv));
      Emits emits(b, r);
      for (int64_t t = b->query_start_loc[r]; t < b->query_start_loc[r + 1]; ++t) {
        const float decay = std::exp(g[t * H + h]), bt = beta[t * H + h];
        const T* vt = v + t * ldv + h * dv;
        float* ot = out + (t * H + h) * dv;
#ifdef PAGEDLLM_AVX512
        if (fused) {
          if (t + 1 < b->query_start_loc[r + 1]) {
            // The next token's rows of this head (a prefill walks them 1-2 KB apart, each
            // line new to the cache): fetched while this token's state update runs.
            prefetch_span(q + (t + 1) * ld_qk + hk * dk, dk * sizeof(T));
            prefetch_span(k + (t + 1) * ld_qk + hk * dk, dk * sizeof(T));
            prefetch_span(v + (t + 1) * ldv + h * dv, dv * sizeof(T));
            prefetch_span(out + ((t + 1) * H + h) * dv, dv * sizeof(float));
          }
          load_l2_normalised16(q + t * ld_qk + hk * dk, dk, q_scale, qt.data());
          load_l2_normalised16(k + t * ld_qk + hk * dk, dk, 1.0f, kt.data());
          const float qk = dot16(qt.data(), kt.data(), dk);
          // A one-token query (decode) reads its state from memory: fetch the next item's
          // (the next head of the slot, or the next request's first) while this one runs.
          const float* next = nullptr;
          if (b->query_start_loc[r + 1] - b->query_start_loc[r] == 1) {
            if (h + 1 < H) next = S + dk * dv;
            else if (r + 1 < b->num_reqs) next = states + b->state_indices[r + 1] * H * dk * dv;
          }
          if (dv == 64)
            delta_token_fused<64, 2>(S, qt.data(), kt.data(), vt, decay, bt, qk, dk, ot, next);
          else if (dv == 128)
            delta_token_fused<128, 1>(S, qt.data(), kt.data(), vt, decay, bt, qk, dk, ot, next);
          else
            delta_token_fused<32, 4>(S, qt.data(), kt.data(), vt, decay, bt, qk, dk, ot, next);
          const int64_t emit = emits.due(t);
          if (emit > 0) std::copy(S, S + dk * dv, states + (emit * H + h) * dk * dv);
          continue;
        }
#endif
        load_l2_normalised(q + t * ld_qk + hk * dk, dk, q_scale, qt.data());
        load_l2_normalised(k + t * ld_qk + hk * dk, dk, 1.0f, kt.data());
        if (dv == 64)
          delta_token<64>(S, qt.data(), kt.data(), vt, decay, bt, dk, ot);
        else if (dv == 128)
          delta_token<128>(S, qt.data(), kt.data(), vt, decay, bt, dk, ot);
        else if (dv == 32)
          delta_token<32>(S, qt.data(), kt.data(), vt, decay, bt, dk, ot);
        else
          delta_token_any(S, qt.data(), kt.data(), vt, decay, bt, dk, dv, kv.data(),
                          delta.data(), ot);
        const int64_t emit = emits.due(t);
        if (emit > 0) std::copy(S, S + dk * dv, states + (emit * H + h) * dk * dv);
      }
    }
  return bad ? -1 : 0;
}

}  // namespace

extern "C" {

int causal_conv1d_varlen_cpu(const StateBatch* batch, const void* x, int64_t ldx,
                             int64_t channels, int64_t width, const float* weight,
                             const float* bias, void* conv_states, int state_dtype, int silu,
                             void* out, int dtype) {
  if (dtype == 0 && state_dtype == 0)
    return conv_all(batch, static_cast<const float*>(x), ldx, channels, width, weight, bias,
                    static_cast<float*>(conv_states), silu, static_cast<float*>(out));
  if (dtype == 0 && state_dtype == 1)
    return conv_all(batch, static_cast<const float*>(x), ldx, channels, width, weight, bias,
                    static_cast<uint16_t*>(conv_states), silu, static_cast<float*>(out));
  if (dtype == 1 && state_dtype == 0)
    return conv_all(batch, static_cast<const uint16_t*>(x), ldx, channels, width, weight, bias,
                    static_cast<float*>(conv_states), silu, static_cast<uint16_t*>(out));
  return conv_all(batch, static_cast<const uint16_t*>(x), ldx, channels, width, weight, bias,
                  static_cast<uint16_t*>(conv_states), silu, static_cast<uint16_t*>(out));
}

int ssd_scan_varlen_cpu(const StateBatch* batch, const void* x, const float* dt, const float* A,
                        const void* B, const void* C, const float* D, float* ssm_states,
                        int64_t H, int64_t P, int64_t G, int64_t N, float dt_min, float dt_max,
                        int clamp_prefill, int dtype, float* y) {
  if (dtype == 0)
    return ssd_all(batch, static_cast<const float*>(x), dt, A, static_cast<const float*>(B),
                   static_cast<const float*>(C), D, ssm_states, H, P, G, N, dt_min, dt_max,
                   clamp_prefill, y);
  return ssd_all(batch, static_cast<const uint16_t*>(x), dt, A, static_cast<const uint16_t*>(B),
                 static_cast<const uint16_t*>(C), D, ssm_states, H, P, G, N, dt_min, dt_max,
                 clamp_prefill, y);
}

int gated_delta_rule_varlen_cpu(const StateBatch* batch, const void* q, const void* k,
                                const void* v, const float* g, const float* beta,
                                float* states, int64_t H, int64_t Hk, int64_t dk, int64_t dv,
                                int dtype, float* out) {
  if (dtype == 0)
    return gated_delta_all(batch, static_cast<const float*>(q), static_cast<const float*>(k),
                           Hk * dk, static_cast<const float*>(v), H * dv, g, beta, states, H, Hk,
                           dk, dv, out);
  return gated_delta_all(batch, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                         Hk * dk, static_cast<const uint16_t*>(v), H * dv, g, beta, states, H,
                         Hk, dk, dv, out);
}

}  // extern "C"

namespace pagedllm {

int gated_delta_rule_rows(const StateBatch* batch, const float* q, const float* k, int64_t ld_qk,
                          const float* v, int64_t ldv, const float* g, const float* beta,
                          float* states, int64_t H, int64_t Hk, int64_t dk, int64_t dv,
                          float* out) {
  return gated_delta_all(batch, q, k, ld_qk, v, ldv, g, beta, states, H, Hk, dk, dv, out);
}

}  // namespace pagedllm
