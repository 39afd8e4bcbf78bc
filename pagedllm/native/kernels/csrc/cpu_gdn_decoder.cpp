// Qwen3-Next's layer halves (input norm, token mixer, residual add, post-attention norm) in one
// call each, for decode and prefill steps: the Gated DeltaNet layers' (`gdn_decoder_mixer`)
// and the gated-attention layers' (`gated_attention_mixer`, at the end of this file).
//
// Why: at batch 1 the module path's Gated DeltaNet mixer is ~25 torch operations and six
// native calls per layer (four input projections, the conv, the delta rule, the gates and the
// gated norm as torch ops, out_proj), each paying Python dispatch (docs/benchmarks.md,
// "Batch-1 decode of the 200M presets"). Here they run from C++: the projections and norms
// in OpenMP parallel regions, the conv window update and the delta rule through the state
// kernels of cpu_state_scan.cpp (the module path's own kernels, same state layout and slots,
// block-boundary checkpoints included). The math is the module path's
// (pagedllm/models/qwen3_next.py, `GatedDeltaNet`; Yang et al., "Gated Delta Networks",
// ICLR 2025):
//
//   x = gemma_rms(hidden) (x / rms(x) * (1 + w))
//   [qkv | z | b | a] = x [Wqkv; Wz; Wb; Wa]^T   (one GEMM over the stacked weight)
//   [q | k | v] = silu(causal_conv1d(qkv; window state))
//   beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
//   o = gated_delta_rule(q, k, v, g, beta; recurrent state)           [Hv, dv] per token
//   o = (rms_norm(o) * norm_w) * silu(z)  (per value head)
//   hidden_out = hidden + o Wout^T;  post_normed = gemma_rms(hidden_out) (1 + post_w)
//
// Weights, hidden, hidden_out and post_normed are in the model dtype T (float32 or bfloat16);
// the activations in between stay in float32 (the module path rounds them to bf16 between its
// operations in a bf16 model). Any step size runs here (prefill steps too): the GEMMs take
// the whole step, the conv and the delta rule walk each request's tokens.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <omp.h>

#include "attention_kernel.h"
#include "attention_primitives.h"
#include "cpu_vec.h"
#include "linear_kernel.h"
#include "packed_gemm.h"
#include "pagedllm_abi.h"
#include "state_scan.h"

namespace {

using namespace pagedllm;

enum GDNLinear { kIn = 0, kOut = 1 };

// Per-token float32 scratch: proj holds the stacked projection's row [q | k | v | z | b | a].
// (q, k and v are read in place from conv's rows [q | k | v].)
struct GDNScratch {
  int64_t x, proj, conv, g, beta, o, o_in, out;
  int64_t total() const { return x + proj + conv + g + beta + o + o_in + out; }
};

GDNScratch scratch_sizes(const GDNLayerWeights& w) {
  const int64_t key = w.num_k_heads * w.head_k_dim, value = w.num_v_heads * w.head_v_dim;
  const int64_t conv = 2 * key + value, Hv = w.num_v_heads;
  return {w.hidden_size, conv + value + 2 * Hv, conv, Hv, Hv, value, value, w.hidden_size};
}

// gemma_rms_row (x / rms(x) * (1 + w), float32 out) of a layer's hidden row. bfloat16 rows sum
// their squares in 16 lanes (on AVX-512, n % 16 == 0); gemma_rms_row's sequential sum, a
// chain of dependent adds, took ~2-3% of a bf16 batch-32 run in these blocks. float32 rows keep
// the sequential sum and its bits: float32 greedy tokens are checked against HF, and a
// reordered sum flipped a near-tie there (docs/benchmarks.md).
template <typename T>
inline void hidden_norm_row(const T* x, const T* w, float eps, int64_t n, float* out) {
#if defined(PAGEDLLM_AVX512)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (n % 16 == 0) {
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 v = load16(x + i);
        _mm512_storeu_ps(out + i, v);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(hsum(ss) / static_cast<float>(n) + eps));
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(out + i), inv),
                                                _mm512_add_ps(one, load16(w + i))));
      return;
    }
  }
#endif
  gemma_rms_row(x, w, eps, n, out);
}

// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

template <typename T>
int gdn_mixer(const GDNLayerWeights& w, const StateBatch* batch, int64_t M, const T* hidden,
              T* hidden_out, T* post_normed, float* scratch) {
  const int64_t Hd = w.hidden_size, Hk = w.num_k_heads, Hv = w.num_v_heads;
  const int64_t dk = w.head_k_dim, dv = w.head_v_dim;
  const int64_t key = Hk * dk, value = Hv * dv, conv_dim = 2 * key + value;
  const GDNScratch sz = scratch_sizes(w);
  const int64_t P = sz.proj;   // row stride of proj
  float* x = scratch;
  float* proj = x + M * sz.x;
  float* conv = proj + M * sz.proj;
  float* g = conv + M * sz.conv;
  float* beta = g + M * sz.g;
  const float* z = proj + conv_dim;           // [M, value] at row stride P
  const float* b = z + value;                 // [M, Hv] at row stride P
  const float* a = b + Hv;
  float* o = beta + M * sz.beta;
  float* o_in = o + M * sz.o;
  float* out = o_in + M * sz.o_in;

#pragma omp parallel
  {
#pragma omp for
    for (int64_t m = 0; m < M; ++m)
      hidden_norm_row(hidden + m * Hd, static_cast<const T*>(w.input_norm), w.eps, Hd, x + m * Hd);
    // (in_proj's GEMM ends by prefetching out_proj's first panels, which would otherwise
    // start cold)
    packed_or_rows_linear<T>(w.packed[kIn], w.in_proj, x, M, Hd, P, proj,
                             packed::next_weight<T>(w.packed[kOut], w.out_proj, value));
  }

  int rc = causal_conv1d_varlen_cpu(batch, proj, P, conv_dim, w.conv_kernel,
                                    w.conv_weight, nullptr, w.conv_states,
                                    static_cast<int>(w.conv_state_dtype), 1, conv, 0);
  if (rc != 0) return rc;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < Hv; ++h) {
      beta[m * Hv + h] = 1.f / (1.f + std::exp(-b[m * P + h]));
      g[m * Hv + h] = w.neg_a[h] * softplus(a[m * P + h] + w.dt_bias[h]);
    }
  }
  // q, k and v read in place from the conv's rows [q | k | v].
  rc = gated_delta_rule_rows(batch, conv, conv + key, conv_dim, conv + 2 * key, conv_dim, g, beta,
                             w.recurrent_states, Hv, Hk, dk, dv, o);
  if (rc != 0) return rc;

#pragma omp parallel
  {
    // The gated RMSNorm per (token, value head): rms_norm(o) * norm_w * silu(z).
#pragma omp for
    for (int64_t item = 0; item < M * Hv; ++item) {
      const float* oh = o + item * dv;
      const float* zh = z + (item / Hv) * P + (item % Hv) * dv;
      float* dst = o_in + item * dv;
      float ss = 0.f;
      for (int64_t d = 0; d < dv; ++d) ss += oh[d] * oh[d];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dv) + w.norm_eps);
      const T* nw = static_cast<const T*>(w.norm_weight);
      mul_sigmoid(zh, zh, dst, dv);   // silu(z)
      for (int64_t d = 0; d < dv; ++d) dst[d] = oh[d] * inv * to_float(nw[d]) * dst[d];
    }
    packed_or_rows_linear<T>(w.packed[kOut], w.out_proj, o_in, M, value, Hd, out);
#pragma omp for
    for (int64_t m = 0; m < M; ++m) {
      T* h = hidden_out + m * Hd;
      for (int64_t i = 0; i < Hd; ++i) store(to_float(hidden[m * Hd + i]) + out[m * Hd + i], h + i);
      float* normed = x + m * Hd;   // (the input norm's rows are no longer read)
      hidden_norm_row(h, static_cast<const T*>(w.post_norm), w.eps, Hd, normed);
      for (int64_t i = 0; i < Hd; ++i) store(normed[i], post_normed + m * Hd + i);
    }
  }
  return 0;
}

// ---- The gated-attention layer (pagedllm/models/qwen3_next.py, `GatedAttention`):
//
//   x = gemma_rms(hidden);  [q | gate] per head = x Wq^T;  k = x Wk^T;  v = x Wv^T
//   q, k = gemma_rms per head (q_norm, k_norm);  rope on the first rotary_dim channels (halves)
//   key_cache[slot], value_cache[slot] = k, v;  a = paged attention (GQA) of q
//   hidden_out = hidden + (a * sigmoid(gate)) Wo^T;  post_normed = gemma_rms(hidden_out)

struct GAScratch {
  int64_t x, q_gate, k, v, q, attn, o_in, out;
  int64_t total() const { return x + q_gate + k + v + q + attn + o_in + out; }
};

GAScratch ga_sizes(const GatedAttentionWeights& w) {
  const int64_t q = w.num_heads * w.head_size, kv = w.num_kv_heads * w.head_size;
  return {w.hidden_size, 2 * q, kv, kv, q, q, q, w.hidden_size};
}

// GPT-NeoX rotation of the first `rotary_dim` channels of one head in place.
inline void rope_partial(float* x, const float* cos, const float* sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

template <typename T>
void gated_attention(const GatedAttentionWeights& w, const NativeAttentionStep& s,
                     const T* hidden, T* hidden_out, T* post_normed) {
  const int64_t M = s.num_tokens, Hd = w.hidden_size, H = w.num_heads, KVH = w.num_kv_heads;
  const int64_t D = w.head_size, RD = w.rotary_dim;
  const GAScratch sz = ga_sizes(w);
  float* x = s.scratch;
  float* q_gate = x + M * sz.x;
  float* k = q_gate + M * sz.q_gate;
  float* v = k + M * sz.k;
  float* q = v + M * sz.v;
  float* attn_out = q + M * sz.q;
  float* o_in = attn_out + M * sz.attn;
  float* out = o_in + M * sz.o_in;
  T* key_cache = static_cast<T*>(w.key_cache);
  T* value_cache = static_cast<T*>(w.value_cache);
  const StepAttentionPlan plan = plan_step_attention(
      s.query_start_loc, s.rows, s.num_rows, s.seq_lens, static_cast<int>(KVH),
      static_cast<int>(H), static_cast<int>(D), omp_get_max_threads(),
      s.query_tile > 0 ? s.query_tile : kDefaultQueryTile, s.causal);
  const AttentionArgs<T, float> attn{q, H * D, key_cache, value_cache, s.block_table,
                                     s.block_table_stride, s.query_start_loc, s.seq_lens,
                                     attn_out, static_cast<int>(H), static_cast<int>(KVH),
                                     static_cast<int>(D), s.block_size, w.scale, s.causal};
  const T* q_norm = static_cast<const T*>(w.q_norm);
  const T* k_norm = static_cast<const T*>(w.k_norm);

#pragma omp parallel
  {
#pragma omp for
    for (int64_t m = 0; m < M; ++m)
      hidden_norm_row(hidden + m * Hd, static_cast<const T*>(w.input_norm), w.eps, Hd, x + m * Hd);
    // (each GEMM ends by prefetching the next weight's first panels: q -> k -> v -> o)
    packed_or_rows_linear<T>(w.packed[0], w.q_proj, x, M, Hd, 2 * H * D, q_gate,
                             packed::next_weight<T>(w.packed[1], w.k_proj, Hd));
    packed_or_rows_linear<T>(w.packed[1], w.k_proj, x, M, Hd, KVH * D, k,
                             packed::next_weight<T>(w.packed[2], w.v_proj, Hd));
    packed_or_rows_linear<T>(w.packed[2], w.v_proj, x, M, Hd, KVH * D, v,
                             packed::next_weight<T>(w.packed[3], w.o_proj, H * D));

    // Per (token, head): q's norm and RoPE; per (token, KV head): k's, and the cache write.
#pragma omp for
    for (int64_t item = 0; item < M * (H + KVH); ++item) {
      const int64_t m = item / (H + KVH), h = item % (H + KVH);
      const float* cos = w.cos_cache + s.positions[m] * (RD / 2);
      const float* sin = w.sin_cache + s.positions[m] * (RD / 2);
      if (h < H) {
        float* qh = q + (m * H + h) * D;
        gemma_rms_row(q_gate + m * 2 * H * D + h * 2 * D, q_norm, w.eps, D, qh);
        rope_partial(qh, cos, sin, RD);
        continue;
      }
      const int64_t kh = h - H;
      float* kr = k + (m * KVH + kh) * D;
      gemma_rms_row(kr, k_norm, w.eps, D, kr);
      rope_partial(kr, cos, sin, RD);
      const int64_t slot = s.slot_mapping[m];
      if (slot < 0) continue;
      const float* vr = v + (m * KVH + kh) * D;
      T* kc = key_cache + (slot * KVH + kh) * D;
      T* vc = value_cache + (slot * KVH + kh) * D;
      for (int64_t d = 0; d < D; ++d) {
        store(kr[d], kc + d);
        store(vr[d], vc + d);
      }
    }

    step_attention_items(attn, plan);

#pragma omp for
    for (int64_t item = 0; item < M * H; ++item) {
      const int64_t m = item / H, h = item % H;
      const float* a = attn_out + item * D;
      const float* gate = q_gate + m * 2 * H * D + h * 2 * D + D;
      float* dst = o_in + item * D;
      mul_sigmoid(a, gate, dst, D);
    }
    packed_or_rows_linear<T>(w.packed[3], w.o_proj, o_in, M, H * D, Hd, out);
#pragma omp for
    for (int64_t m = 0; m < M; ++m) {
      T* h = hidden_out + m * Hd;
      for (int64_t i = 0; i < Hd; ++i) store(to_float(hidden[m * Hd + i]) + out[m * Hd + i], h + i);
      float* normed = x + m * Hd;
      hidden_norm_row(h, static_cast<const T*>(w.post_norm), w.eps, Hd, normed);
      for (int64_t i = 0; i < Hd; ++i) store(normed[i], post_normed + m * Hd + i);
    }
  }
}

}  // namespace

extern "C" {

int64_t gated_attention_scratch_floats(const GatedAttentionWeights* w) {
  return ga_sizes(*w).total();
}

int gated_attention_mixer(const GatedAttentionWeights* w, const NativeAttentionStep* step,
                          const void* hidden, void* hidden_out, void* post_normed, int dtype) {
  if (dtype == 0) {
    gated_attention<float>(*w, *step, static_cast<const float*>(hidden),
                           static_cast<float*>(hidden_out), static_cast<float*>(post_normed));
  } else if (dtype == 1) {
    gated_attention<uint16_t>(*w, *step, static_cast<const uint16_t*>(hidden),
                              static_cast<uint16_t*>(hidden_out),
                              static_cast<uint16_t*>(post_normed));
  } else {
    return -1;
  }
  return 0;
}

int64_t gdn_scratch_floats(const GDNLayerWeights* w) { return scratch_sizes(*w).total(); }

int gdn_decoder_mixer(const GDNLayerWeights* w, const StateBatch* batch, int64_t num_tokens,
                      const void* hidden, void* hidden_out, void* post_normed, float* scratch,
                      int dtype) {
  if (dtype == 0)
    return gdn_mixer<float>(*w, batch, num_tokens, static_cast<const float*>(hidden),
                            static_cast<float*>(hidden_out), static_cast<float*>(post_normed),
                            scratch);
  if (dtype == 1)
    return gdn_mixer<uint16_t>(*w, batch, num_tokens, static_cast<const uint16_t*>(hidden),
                               static_cast<uint16_t*>(hidden_out),
                               static_cast<uint16_t*>(post_normed), scratch);
  return -1;
}

}  // extern "C"
