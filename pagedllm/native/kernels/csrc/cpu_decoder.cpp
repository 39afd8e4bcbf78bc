// One Llama-family decoder layer in one call, for steps of few tokens (decode).
//
// Why: at batch 1 a decoder layer is ~25 small operations (two RMSNorms, four linears, RoPE, the
// KV write, attention, SiLU*mul, residual adds). Issued one by one from Python each costs a few
// microseconds of dispatch plus an OpenMP fork/join, which together took longer than streaming
// the weights. Here the whole layer is one OpenMP parallel region whose phases are separated by
// the implicit barriers of their work-sharing loops, as llama.cpp's graph executor separates its
// nodes (ggml's thread pool). The math is the module path's (pagedllm/models/llama.py):
//
//   residual += delta (the previous layer's output);  x = rms_norm(residual) * input_norm
//   q, k, v = x @ Wqkv^T (+ b);  [q, k = per-head rms_norm (Qwen3)];  q, k = rope(q, k)
//   key_cache[slot], value_cache[slot] = k, v;  a = paged_attention(q)
//   residual += a @ Wo^T (+ b);  x = rms_norm(residual) * post_attention_norm
//   delta = (silu(x @ Wgate^T) * (x @ Wup^T)) @ Wdown^T (+ b)
//
// The residual stream, weights and KV cache are in the model dtype T (float32 or bfloat16); the
// intermediate activations stay in float32 (one rounding fewer than the module path per step).
// A linear weight may instead be GGUF blocks (row segments of one or more GGML types), run by
// the block kernels of cpu_gguf_linear.cpp (or, with 8-bit activations, those of
// cpu_gguf_q8_linear.cpp) inside this layer's parallel region, or int8 rows
// with per-row scales (layers/quantization/int8.py; weight-only or W8A8), run by the kernels of
// int8_blocks.h likewise.
// With LoRA adapters (DecoderLayerWeights.lora, DecoderStep.lora), each of the four linears'
// outputs gets the step's adapter tokens' x A^T B^T, grouped by adapter slot (lora_kernel.h),
// as loops of the same parallel region.
// RMSNorm: Zhang & Sennrich (2019); RoPE: Su et al. (2021), GPT-NeoX layout (the halves of a head
// are rotated together), as HF Llama.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "attention_kernel.h"
#include "gguf_blocks.h"
#include "gguf_q8_dot.h"
#include "int8_blocks.h"
#include "linear_kernel.h"
#include "lora_kernel.h"
#include "packed_gemm.h"

namespace {

using namespace pagedllm;

// DecoderLayerWeights (one layer's weights and KV cache) and DecoderStep (one step's
// buffers) are the ABI's (pagedllm/native/kernels/abi.py).

// Quantized activations, shared by the layers of one call (null when no layer needs them):
// per token for W8A8 linears, xq [num_tokens, largest K] int8 and xs [num_tokens] float32; per
// block for GGUF linears with 8-bit activations, `gguf_q8` sized likewise; for packed bf16
// weights on the bf16-pair kernels, the float32 activations rounded to bf16 once per linear
// (`packed_x` [num_tokens, largest K], see packed::linear_tiles; null for single-token steps,
// whose one row is cheap to round per work item).
struct ActivationScratch {
  int8_t* xq;
  float* xs;
  gguf::Q8Rows gguf_q8;
  packed::XStage<uint16_t>* packed_x;
  float* lora_shrunk;   // [adapter tokens, widest LoRA width] (null: no adapter token)
};

enum WeightIndex { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3 };

// The step's adapters on linear `index`'s output (lora_kernel.h), if the step has adapter
// tokens and the layer adapter slots: y[tokens] += (x[tokens] A^T) B^T, grouped by slot.
inline void layer_lora(const DecoderLayerWeights& lw, const DecoderStep& s, int index,
                       const float* x, int64_t ldx, float* y, int64_t ldy,
                       const ActivationScratch& scratch) {
  if (s.lora != nullptr && lw.lora != nullptr)
    lora::apply_tiles(lw.lora[index], *s.lora, x, ldx, y, ldy, scratch.lora_shrunk);
}

// One linear phase of the layer (an orphaned work-sharing loop, see linear_kernel.h): on the
// GGUF segments of weight `index` if it has any (x rounded to 8 bits first if so marked), on
// the int8 weight `w` [N, K] if it has
// scales, else on the float weight `w` ([N, K], or packed panels if flagged `packed`).
template <typename T>
inline void layer_linear(const DecoderLayerWeights& lw, int index, const float* x, int64_t ldx,
                         int64_t M, int64_t K, const void* w, int64_t N, const float* bias,
                         float* y, int64_t ldy, const ActivationScratch& scratch) {
  if (lw.int8_scales[index] != nullptr) {
    const bool w8a8 = lw.int8_activations[index] != 0;
    int8::linear_tiles(x, ldx, M, K, static_cast<const int8_t*>(w), N, lw.int8_scales[index],
                       bias, y, ldy, w8a8 ? scratch.xq : nullptr, w8a8 ? scratch.xs : nullptr);
  } else if (lw.num_segments[index] > 0 && lw.gguf_q8_activations[index] != 0) {
    gguf::linear_segments_tiles_q8(x, ldx, M, K, lw.segments[index], lw.num_segments[index],
                                   bias, y, ldy, scratch.gguf_q8);
  } else if (lw.num_segments[index] > 0) {
    gguf::linear_segments_tiles(x, ldx, M, K, lw.segments[index], lw.num_segments[index], bias,
                                y, ldy);
  } else if (lw.packed[index] != 0) {
    packed::XStage<T>* staged = nullptr;
    if constexpr (std::is_same_v<packed::XStage<T>, uint16_t>) staged = scratch.packed_x;
    packed::linear_tiles(x, ldx, M, K, static_cast<const T*>(w), N, bias, y, ldy, staged);
  } else {
    linear_tiles(x, ldx, M, K, static_cast<const T*>(w), N, bias, y, ldy);
  }
}


// residual[m] (+= delta[m] if add) then normed[m] = rms_norm(residual[m]) * w, for one row
// (8 lanes at a time: the sum of squares is summed in 8 partial sums, then across them).
template <typename T>
inline void add_rms_norm_row(T* residual, const float* delta, bool add, const T* w, float eps,
                             int64_t n, float* normed) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 r = load8(residual + i);
    if (add) {
      store8(_mm256_add_ps(r, _mm256_loadu_ps(delta + i)), residual + i);
      r = load8(residual + i);  // the stream keeps the model dtype, as the module path does
    }
    _mm256_storeu_ps(normed + i, r);
    sum = _mm256_fmadd_ps(r, r, sum);
  }
  ss = hsum(sum);
#endif
  for (; i < n; ++i) {
    float r = to_float(residual[i]);
    if (add) {
      store(r + delta[i], residual + i);
      r = to_float(residual[i]);
    }
    normed[i] = r;
    ss += r * r;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(normed + i,
                     _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(normed + i), inv8), load8(w + i)));
#endif
  for (; i < n; ++i) normed[i] = normed[i] * inv * to_float(w[i]);
}

// x[0..d) = rms_norm(x) * w (in place), float32.
template <typename T>
inline void rms_norm_inplace(float* x, const T* w, float eps, int64_t d) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) x[i] = x[i] * inv * to_float(w[i]);
}

// GPT-NeoX rotation of one head in place: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin].
inline void rope_inplace(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// out[i] = silu(gate[i]) * up[i] for i < n; 8 lanes at a time with exp8 (relative error ~1e-7
// against std::exp; std::exp, a scalar libm call, was half the layer's time outside its
// linears and attention in 2048-token prefill steps).
inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

template <typename T>
void decoder_layer(const DecoderLayerWeights& w, const DecoderStep& s, bool add_delta,
                   const StepAttentionPlan& plan, const ActivationScratch& act_scratch) {
  const int64_t M = s.num_tokens, H = w.hidden_size, D = w.head_size;
  const int64_t q_size = w.num_heads * D, kv_size = w.num_kv_heads * D;
  const int64_t qkv_size = q_size + 2 * kv_size, I = w.intermediate_size;
  T* residual = static_cast<T*>(s.residual);
  T* key_cache = static_cast<T*>(w.key_cache);
  T* value_cache = static_cast<T*>(w.value_cache);
  const AttentionArgs<T, float> attn{s.qkv_out, qkv_size, key_cache, value_cache, s.block_table,
                                     s.block_table_stride, s.query_start_loc, s.seq_lens,
                                     s.attn_out, static_cast<int>(w.num_heads),
                                     static_cast<int>(w.num_kv_heads), static_cast<int>(D),
                                     s.block_size, w.scale, s.causal};
  const int64_t act_chunk = 256;
  const int64_t act_chunks = (I + act_chunk - 1) / act_chunk;

#pragma omp parallel
  {
#pragma omp for
    for (int64_t m = 0; m < M; ++m)
      add_rms_norm_row(residual + m * H, s.delta + m * H, add_delta,
                       static_cast<const T*>(w.input_norm), w.eps, H, s.normed + m * H);

    layer_linear<T>(w, kQKV, s.normed, H, M, H, w.qkv, qkv_size, w.qkv_bias, s.qkv_out,
                    qkv_size, act_scratch);
    layer_lora(w, s, kQKV, s.normed, H, s.qkv_out, qkv_size, act_scratch);

    // q/k norm, RoPE, and the KV-cache write: one (token, head) per iteration.
    const int64_t heads = w.num_heads + w.num_kv_heads;
#pragma omp for
    for (int64_t item = 0; item < M * heads; ++item) {
      const int64_t m = item / heads, h = item % heads;
      float* row = s.qkv_out + m * qkv_size;
      const float* cos = w.cos_cache + s.positions[m] * (D / 2);
      const float* sin = w.sin_cache + s.positions[m] * (D / 2);
      if (h < w.num_heads) {
        float* q = row + h * D;
        if (w.q_norm != nullptr) rms_norm_inplace(q, static_cast<const T*>(w.q_norm), w.eps, D);
        rope_inplace(q, cos, sin, D / 2);
        continue;
      }
      const int64_t kh = h - w.num_heads;
      float* k = row + q_size + kh * D;
      const float* v = row + q_size + kv_size + kh * D;
      if (w.k_norm != nullptr) rms_norm_inplace(k, static_cast<const T*>(w.k_norm), w.eps, D);
      rope_inplace(k, cos, sin, D / 2);
      const int64_t slot = s.slot_mapping[m];
      if (slot < 0) continue;
      T* kc = key_cache + (slot * w.num_kv_heads + kh) * D;
      T* vc = value_cache + (slot * w.num_kv_heads + kh) * D;
      for (int64_t d = 0; d < D; ++d) {
        store(k[d], kc + d);
        store(v[d], vc + d);
      }
    }

    step_attention_items(attn, plan);

    layer_linear<T>(w, kO, s.attn_out, q_size, M, q_size, w.o, H, w.o_bias, s.delta, H,
                    act_scratch);
    layer_lora(w, s, kO, s.attn_out, q_size, s.delta, H, act_scratch);

#pragma omp for
    for (int64_t m = 0; m < M; ++m)
      add_rms_norm_row(residual + m * H, s.delta + m * H, true,
                       static_cast<const T*>(w.post_norm), w.eps, H, s.normed + m * H);

    layer_linear<T>(w, kGateUp, s.normed, H, M, H, w.gate_up, 2 * I, w.gate_up_bias,
                    s.gate_up_out, 2 * I, act_scratch);
    layer_lora(w, s, kGateUp, s.normed, H, s.gate_up_out, 2 * I, act_scratch);

#pragma omp for
    for (int64_t item = 0; item < M * act_chunks; ++item) {
      const int64_t m = item / act_chunks, i0 = (item % act_chunks) * act_chunk;
      const int64_t i1 = std::min(I, i0 + act_chunk);
      const float* gate = s.gate_up_out + m * 2 * I;
      silu_mul(gate + i0, gate + I + i0, s.act + m * I + i0, i1 - i0);
    }

    layer_linear<T>(w, kDown, s.act, I, M, I, w.down, H, w.down_bias, s.delta, H,
                    act_scratch);
    layer_lora(w, s, kDown, s.act, I, s.delta, H, act_scratch);
  }
}

template <typename T>
void add_rms_norm_rows(T* residual, const float* delta, int64_t num_tokens, int64_t hidden,
                  const T* weight, float eps, T* out) {
#pragma omp parallel
  {
    std::vector<float> normed(hidden);
#pragma omp for
    for (int64_t m = 0; m < num_tokens; ++m) {
      add_rms_norm_row(residual + m * hidden, delta + m * hidden, delta != nullptr, weight, eps,
                       hidden, normed.data());
      for (int64_t i = 0; i < hidden; ++i) store(normed[i], out + m * hidden + i);
    }
  }
}

}  // namespace

extern "C" {

// Runs the layers [0, num_layers) of `layers` over one step. On entry `step->residual` holds the
// stream (the embeddings, add_delta_first = 0; or a previous stage's residual with its output in
// `step->delta`, add_delta_first = 1); on return the last layer's output is in `step->delta`,
// not yet added to the residual. `dtype`: 0 float32, 1 bfloat16 (weights, stream and KV cache).
void decoder_layers(const DecoderLayerWeights* layers, int num_layers, const DecoderStep* step,
                    const int32_t* attention_rows, int num_attention_rows, int add_delta_first,
                    int dtype) {
  const StepAttentionPlan plan = plan_step_attention(
      step->query_start_loc, attention_rows, num_attention_rows, step->seq_lens,
      static_cast<int>(layers[0].num_kv_heads), static_cast<int>(layers[0].num_heads),
      static_cast<int>(layers[0].head_size), omp_get_max_threads(),
      step->query_tile > 0 ? step->query_tile : kDefaultQueryTile, step->causal);
  // Quantized-activation scratch, sized for the largest input of any such linear.
  int64_t max_k = 0, max_k_q8 = 0;
  for (int l = 0; l < num_layers; ++l) {
    const DecoderLayerWeights& lw = layers[l];
    const int64_t k[4] = {lw.hidden_size, lw.num_heads * lw.head_size, lw.hidden_size,
                          lw.intermediate_size};
    for (int i = 0; i < 4; ++i) {
      if (lw.int8_scales[i] != nullptr && lw.int8_activations[i] != 0)
        max_k = std::max(max_k, k[i]);
      if (lw.num_segments[i] > 0 && lw.gguf_q8_activations[i] != 0)
        max_k_q8 = std::max(max_k_q8, k[i]);
    }
  }
  const int64_t M = step->num_tokens;
  std::vector<int8_t> xq(static_cast<size_t>(M * max_k));
  std::vector<float> xs(max_k > 0 ? static_cast<size_t>(M) : 0);
  gguf::Q8Buffers q8(M, max_k_q8);
  // Rows for the packed linears' bf16 input, when a bf16 model runs on bf16-pair panels.
  const bool stage_packed = dtype == 1 && M > 1 &&
                            std::is_same_v<packed::XStage<uint16_t>, uint16_t>;
  int64_t max_k_packed = 0;
  for (int l = 0; l < num_layers && stage_packed; ++l)
    max_k_packed = std::max({max_k_packed, layers[l].hidden_size,
                             layers[l].num_heads * layers[l].head_size,
                             layers[l].intermediate_size});
  // (Not value-initialised: every row is written before it is read.)
  const std::unique_ptr<packed::XStage<uint16_t>[]> packed_x(
      stage_packed ? new packed::XStage<uint16_t>[M * max_k_packed] : nullptr);
  // Shrunk rows of the adapter tokens, for the widest LoRA linear.
  int64_t lora_width = 0;
  for (int l = 0; l < num_layers && step->lora != nullptr; ++l)
    for (int i = 0; i < 4 && layers[l].lora != nullptr; ++i)
      lora_width = std::max(lora_width, lora::width(layers[l].lora[i]));
  std::vector<float> lora_shrunk(
      lora_width > 0 ? static_cast<size_t>(lora::num_tokens(*step->lora) * lora_width) : 0);
  const ActivationScratch act_scratch{max_k > 0 ? xq.data() : nullptr, xs.data(), q8.rows(),
                                      packed_x.get(),
                                      lora_width > 0 ? lora_shrunk.data() : nullptr};
  for (int l = 0; l < num_layers; ++l) {
    const bool add = l > 0 || add_delta_first != 0;
    if (dtype == 0)
      decoder_layer<float>(layers[l], *step, add, plan, act_scratch);
    else
      decoder_layer<uint16_t>(layers[l], *step, add, plan, act_scratch);
  }
}

// out = rms_norm(residual + delta) * weight and residual += delta (delta may be null), rows of
// `hidden` values; `dtype` as above for residual, weight and out.
void add_rms_norm(void* residual, const float* delta, int64_t num_tokens, int64_t hidden,
                  const void* weight, float eps, void* out, int dtype) {
  if (dtype == 0)
    add_rms_norm_rows(static_cast<float*>(residual), delta, num_tokens, hidden,
                 static_cast<const float*>(weight), eps, static_cast<float*>(out));
  else
    add_rms_norm_rows(static_cast<uint16_t*>(residual), delta, num_tokens, hidden,
                 static_cast<const uint16_t*>(weight), eps, static_cast<uint16_t*>(out));
}

}  // extern "C"
