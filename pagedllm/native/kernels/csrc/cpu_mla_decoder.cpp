// One DeepSeek MLA attention block (input norm through the post-attention norm) in one call, for
// steps of few tokens (decode).
//
// Why: at batch 1 the module path's MLA block is ~60 torch operations and four native calls per
// layer (two norms, the projections, the splits and the RoPE's small ops, the latent write, the
// absorbed products as bmm, the attention kernel), each paying Python dispatch and, for the
// native ones, an OpenMP fork/join: on the 200M DeepSeek preset that was longer than the
// block's weight streaming (docs/benchmarks.md, "Batch-1 decode of the 200M presets"). Here
// the block is one OpenMP parallel region whose phases are separated by the implicit barriers
// of their work-sharing loops, as cpu_decoder.cpp does for a Llama layer. The math is the
// module path's (pagedllm/models/deepseek_v2.py, attention/backends/mla_cpu.py), MLA as in the
// DeepSeek-V2 paper (arXiv:2405.04434, sec. 2.1) in its absorbed form:
//
//   residual += delta;  x = rms_norm(residual) * input_norm
//   q = x Wq^T  or  q_b(rms_norm(x Wq_a^T) * q_a_norm)     -> per head [q_nope (dn) | q_pe (dr)]
//   [c_kv (L) | k_pe (dr)] = x Wkv_a^T;  c_kv = rms_norm(c_kv) * kv_a_norm
//   q_pe, k_pe = rope(q_pe, k_pe)   (interleaved pairs or halves, written de-interleaved:
//                                    layers/deepseek_rope.py)
//   latent_cache[slot] = [c_kv | k_pe]
//   q_abs[h] = [W_UK_h^T q_nope[h] | q_pe[h]]            (W_UK_h = kv_b[h, :dn, :], [dn, L])
//   o_lat[h] = paged attention of q_abs[h] over the latents (one shared KV head of L + dr
//              values, keys = values = the latent rows; the output's first L channels)
//   o[h] = W_UV_h o_lat[h]                                (W_UV_h = kv_b[h, dn:, :], [dv, L])
//   residual += o Wo^T;  out = rms_norm(residual) * post_attention_norm
//
// Weights, the residual stream, `delta`, `out` and the latent cache are in the model dtype T
// (float32 or bfloat16); the intermediate activations stay in float32 (the module path rounds
// them to bf16 between its operations in a bf16 model: the two agree to bf16 rounding).
// RMSNorm: Zhang & Sennrich (2019); RoPE: Su et al. (2021).

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <omp.h>

#include "attention_kernel.h"
#include "linear_kernel.h"
#include "packed_gemm.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

enum MLALinear { kQ = 0, kQB = 1, kKVA = 2, kO = 3 };

// The float32 scratch of one token, in floats, by part.
struct MLAScratch {
  int64_t normed, q_a, q, kv, q_abs, attn, o_heads, o;
  int64_t total() const { return normed + q_a + q + kv + q_abs + attn + o_heads + o; }
};

MLAScratch scratch_sizes(const MLALayerWeights& w) {
  const int64_t H = w.num_heads, L = w.kv_lora_rank, dr = w.qk_rope_head_dim;
  return {w.hidden_size, w.q_lora_rank, H * (w.qk_nope_head_dim + dr), L + dr, H * (L + dr),
          H * (L + dr), H * w.v_head_dim, w.hidden_size};
}

// x[0..d) = rms_norm(x) * w in place (float32 sums, one pass for the squares).
template <typename T>
inline void rms_norm_inplace(float* x, const T* w, float eps, int64_t d) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * inv * to_float(w[i]);
}

// residual (+= delta) in the model dtype, then normed = rms_norm(residual) * w (float32).
template <typename T>
inline void add_rms_norm_row(T* residual, const T* delta, const float* delta_f32, const T* w,
                             float eps, int64_t n, float* normed) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float r = to_float(residual[i]);
    if (delta != nullptr || delta_f32 != nullptr) {
      store(r + (delta != nullptr ? to_float(delta[i]) : delta_f32[i]), residual + i);
      r = to_float(residual[i]);   // the stream keeps the model dtype, as the module path
    }
    normed[i] = r;
    ss += r * r;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) normed[i] = normed[i] * inv * to_float(w[i]);
}

// DeepSeek's RoPE of one head's dr channels from `src` into `dst` (not in place):
// interleaved pairs (x0, x1), (x2, x3), ... or halves, the result de-interleaved
// ([x1 c - x2 s | x2 c + x1 s] over the pairs), as layers/deepseek_rope.py writes it.
inline void deepseek_rope(const float* src, float* dst, const float* cos, const float* sin,
                          int64_t dr, bool interleaved) {
  const int64_t half = dr / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleaved ? src[2 * i] : src[i];
    const float x2 = interleaved ? src[2 * i + 1] : src[i + half];
    dst[i] = x1 * cos[i] - x2 * sin[i];
    dst[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// out[0..L) = sum_d x[d] * W[d, 0..L) (W [n, L] rows of the model dtype), float32 sums in d
// order. The sums of 64 outputs at a time stay in registers across the rows (a load and a
// store of `out` per FMA before; the same FMAs, so the same floats).
template <typename T>
inline void rows_combination(const float* x, const T* W, int64_t n, int64_t L, float* out) {
  int64_t l0 = 0;
#ifdef PAGEDLLM_AVX2
  constexpr int kChunks = 8;   // ymm accumulators per pass: 64 outputs
  for (; l0 + 8 * kChunks <= L; l0 += 8 * kChunks) {
    __m256 acc[kChunks];
    for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; ++d) {
      const __m256 c8 = _mm256_set1_ps(x[d]);
      const T* row = W + d * L + l0;
      for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_fmadd_ps(c8, load8(row + 8 * c), acc[c]);
    }
    for (int c = 0; c < kChunks; ++c) _mm256_storeu_ps(out + l0 + 8 * c, acc[c]);
  }
#endif
  std::fill(out + l0, out + L, 0.f);
  for (int64_t d = 0; d < n; ++d) {
    const float c = x[d];
    const T* row = W + d * L;
    int64_t l = l0;
#ifdef PAGEDLLM_AVX2
    const __m256 c8 = _mm256_set1_ps(c);
    for (; l + 8 <= L; l += 8)
      _mm256_storeu_ps(out + l, _mm256_fmadd_ps(c8, load8(row + l), _mm256_loadu_ps(out + l)));
#endif
    for (; l < L; ++l) out[l] += c * to_float(row[l]);
  }
}

// x . row over L values (row in the model dtype), float32.
template <typename T>
inline float dot_row(const float* x, const T* row, int64_t L) {
  float s = 0.f;
  int64_t l = 0;
#ifdef PAGEDLLM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; l + 8 <= L; l += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + l), load8(row + l), acc);
  s = hsum(acc);
#endif
  for (; l < L; ++l) s += x[l] * to_float(row[l]);
  return s;
}

// out[v] = dot_row(x, W + v * L, L) for v < n: eight rows at a time, their eight dependent
// FMA chains interleaved (one chain waited on each FMA's latency); the same floats.
template <typename T>
inline void dot_rows(const float* x, const T* W, int64_t n, int64_t L, float* out) {
  int64_t v = 0;
#ifdef PAGEDLLM_AVX2
  if (L % 8 == 0) {
    for (; v + 8 <= n; v += 8) {
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t l = 0; l < L; l += 8) {
        const __m256 xv = _mm256_loadu_ps(x + l);
        for (int r = 0; r < 8; ++r)
          acc[r] = _mm256_fmadd_ps(xv, load8(W + (v + r) * L + l), acc[r]);
      }
      for (int r = 0; r < 8; ++r) out[v + r] = hsum(acc[r]);
    }
  }
#endif
  for (; v < n; ++v) out[v] = dot_row(x, W + v * L, L);
}

template <typename T>
void mla_block(const MLALayerWeights& w, const NativeAttentionStep& s, T* residual,
               const T* delta, T* out) {
  const int64_t M = s.num_tokens, Hd = w.hidden_size, H = w.num_heads;
  const int64_t L = w.kv_lora_rank, dn = w.qk_nope_head_dim, dr = w.qk_rope_head_dim;
  const int64_t dv = w.v_head_dim, qk = dn + dr, D = L + dr, QL = w.q_lora_rank;
  const bool interleaved = w.rope_interleaved != 0;
  const MLAScratch sz = scratch_sizes(w);
  float* normed = s.scratch;
  float* q_a = normed + M * sz.normed;
  float* q = q_a + M * sz.q_a;
  float* kv = q + M * sz.q;
  float* q_abs = kv + M * sz.kv;
  float* attn_out = q_abs + M * sz.q_abs;
  float* o_heads = attn_out + M * sz.attn;
  float* o = o_heads + M * sz.o_heads;
  T* cache = static_cast<T*>(w.latent_cache);
  const T* kv_b = static_cast<const T*>(w.kv_b);

  const StepAttentionPlan plan = plan_step_attention(
      s.query_start_loc, s.rows, s.num_rows, s.seq_lens, 1, static_cast<int>(H),
      static_cast<int>(D), omp_get_max_threads(),
      s.query_tile > 0 ? s.query_tile : kDefaultQueryTile, s.causal);
  AttentionArgs<T, float> attn{q_abs, H * D, cache, cache, s.block_table,
                               s.block_table_stride, s.query_start_loc, s.seq_lens,
                               attn_out, static_cast<int>(H), 1, static_cast<int>(D),
                               s.block_size, w.scale, s.causal};
  // W_UV reads only the c_kv channels of o_lat: the eight-head decode skips the rest where it
  // can (a multiple of 16 channels); otherwise all are computed.
  attn.value_size = L % 16 == 0 ? static_cast<int>(L) : 0;

#pragma omp parallel
  {
#pragma omp for
    for (int64_t m = 0; m < M; ++m)
      add_rms_norm_row(residual + m * Hd, delta != nullptr ? delta + m * Hd : nullptr, nullptr,
                       static_cast<const T*>(w.input_norm), w.eps, Hd, normed + m * Hd);

    if (QL > 0) {
      packed_or_rows_linear<T>(w.packed[kQ], w.q_proj, normed, M, Hd, QL, q_a);
#pragma omp for
      for (int64_t m = 0; m < M; ++m)
        rms_norm_inplace(q_a + m * QL, static_cast<const T*>(w.q_a_norm), w.latent_eps, QL);
      packed_or_rows_linear<T>(w.packed[kQB], w.q_b_proj, q_a, M, QL, H * qk, q);
    } else {
      packed_or_rows_linear<T>(w.packed[kQ], w.q_proj, normed, M, Hd, H * qk, q,
                               packed::next_weight<T>(w.packed[kKVA], w.kv_a_proj, Hd));
    }
    // (a packed GEMM ends by prefetching the next weight's first panels: q -> kv_a -> o)
    packed_or_rows_linear<T>(w.packed[kKVA], w.kv_a_proj, normed, M, Hd, D, kv,
                             packed::next_weight<T>(w.packed[kO], w.o_proj, H * dv));

    // Per (token, head): the absorbed query; per token (item h == H): the latent's norm and
    // RoPE and its cache write.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < M * (H + 1); ++item) {
      const int64_t m = item / (H + 1), h = item % (H + 1);
      const float* cos = w.cos_cache + s.positions[m] * (dr / 2);
      const float* sin = w.sin_cache + s.positions[m] * (dr / 2);
      if (h < H) {
        const float* qh = q + m * H * qk + h * qk;
        float* dst = q_abs + (m * H + h) * D;
        rows_combination(qh, kv_b + h * (dn + dv) * L, dn, L, dst);
        deepseek_rope(qh + dn, dst + L, cos, sin, dr, interleaved);
        continue;
      }
      float* latent = kv + m * D;
      rms_norm_inplace(latent, static_cast<const T*>(w.kv_a_norm), w.latent_eps, L);
      float k_pe[256];
      deepseek_rope(latent + L, k_pe, cos, sin, dr, interleaved);
      std::copy(k_pe, k_pe + dr, latent + L);
      const int64_t slot = s.slot_mapping[m];
      if (slot < 0) continue;
      T* row = cache + slot * D;
      for (int64_t d = 0; d < D; ++d) store(latent[d], row + d);
    }

    step_attention_items(attn, plan);

    // o[h] = W_UV_h o_lat[h]: per (token, head).
#pragma omp for
    for (int64_t item = 0; item < M * H; ++item) {
      const int64_t m = item / H, h = item % H;
      const float* o_lat = attn_out + (m * H + h) * D;
      const T* w_uv = kv_b + (h * (dn + dv) + dn) * L;
      float* dst = o_heads + m * H * dv + h * dv;
      dot_rows(o_lat, w_uv, dv, L, dst);
    }

    packed_or_rows_linear<T>(w.packed[kO], w.o_proj, o_heads, M, H * dv, Hd, o);

#pragma omp for
    for (int64_t m = 0; m < M; ++m) {
      float* row = normed + m * Hd;   // (the input norm's rows are no longer read)
      add_rms_norm_row(residual + m * Hd, static_cast<const T*>(nullptr), o + m * Hd,
                       static_cast<const T*>(w.post_norm), w.eps, Hd, row);
      for (int64_t i = 0; i < Hd; ++i) store(row[i], out + m * Hd + i);
    }
  }
}

}  // namespace

extern "C" {

int64_t mla_step_scratch_floats(const MLALayerWeights* w) { return scratch_sizes(*w).total(); }

int mla_decoder_attention(const MLALayerWeights* w, const NativeAttentionStep* step,
                          void* residual, const void* delta, void* out, int dtype) {
  if (w->qk_rope_head_dim > 256 || w->qk_rope_head_dim % 2 != 0) return -1;
  if (dtype == 0) {
    mla_block<float>(*w, *step, static_cast<float*>(residual), static_cast<const float*>(delta),
                     static_cast<float*>(out));
  } else if (dtype == 1) {
    mla_block<uint16_t>(*w, *step, static_cast<uint16_t*>(residual),
                        static_cast<const uint16_t*>(delta), static_cast<uint16_t*>(out));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
