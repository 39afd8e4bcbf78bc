// The decoder layers of a DeepSeek-V2/V3 / GLM-4-MoE or Qwen3-Next stack in one native call per
// step (pagedllm/native/hybrid_stack.py), for decode and small steps.
//
// Why: with both layer halves native (cpu_mla_decoder.cpp / cpu_gdn_decoder.cpp for the first,
// cpu_moe_block.cpp for the MLP half) a layer is still two calls from Python with the checks,
// tensor allocations and ctypes conversions of each between them; at batch 1 of the 200M
// presets they cost a noticeable share of a step (docs/benchmarks.md). Here one loop calls the
// same two entry points per layer over buffers of the step, so the math and the roundings are
// the per-half path's exactly:
//
//   DeepSeek (kind 0), as MoeDecoderLayer.forward with its native halves:
//     normed = mla_decoder_attention(stream += hidden [not for the first layer of a first
//              stage]);  hidden = moe_block(normed)
//   Qwen3-Next (kinds 1, 2), as Qwen3NextDecoderLayer.forward with its native halves:
//     (hidden, normed) = mixer(stream);  mlp_out = moe_block(normed)
//     stream = hidden + mlp_out   (rounded once to the model dtype, as torch's add)
//   and after the last layer, where the step names it, the final norm:
//     out = gemma_rms(stream) (x / rms(x) * (1 + w), float32, rounded once to the model dtype)
//   which the native decode loop (cpu_decode_loop.cpp) reads as well, so a step through the
//   stack and a step of the loop give the same bits.
//
// A dense MLP layer is a MoeBlockWeights without routed experts whose shared expert is the
// MLP (the MoE block's shared-expert phases are the dense SiLU MLP, with the same roundings).

#include <cstdint>
#include <vector>

#include "cpu_vec.h"
#include "pagedllm_abi.h"

namespace {

using pagedllm::gemma_rms_row;
using pagedllm::store;
using pagedllm::to_float;

// stream[i] = hidden[i] + mlp_out[i] for i < n, in the model dtype.
template <typename T>
void add_rows(T* stream, const T* hidden, const T* mlp_out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(to_float(hidden[i]) + to_float(mlp_out[i]), stream + i);
}

// out[m] = gemma_rms(stream[m]) * (1 + w) for the n rows, in the model dtype.
template <typename T>
void final_norm_rows(const HybridStep& s, int64_t n, int64_t h) {
  const T* stream = static_cast<const T*>(s.stream);
  const T* w = static_cast<const T*>(s.final_norm);
  T* out = static_cast<T*>(s.out);
  std::vector<float> row(static_cast<size_t>(h));
  for (int64_t m = 0; m < n; ++m) {
    gemma_rms_row(stream + m * h, w, s.final_norm_eps, h, row.data());
    for (int64_t i = 0; i < h; ++i) store(row[i], out + m * h + i);
  }
}

}  // namespace

extern "C" {

int hybrid_decoder_layers(const HybridLayer* layers, int num_layers, const HybridStep* step) {
  const HybridStep& s = *step;
  const int64_t n = s.num_tokens, h = s.hidden_size;
  const int dtype = static_cast<int>(s.dtype);
  if (dtype != 0 && dtype != 1) return -1;
  for (int l = 0; l < num_layers; ++l) {
    const HybridLayer& layer = layers[l];
    int rc = 0;
    if (layer.kind == 0) {
      const bool add = l > 0 || s.add_first != 0;
      rc = mla_decoder_attention(static_cast<const MLALayerWeights*>(layer.mixer), s.mla_step,
                                 s.stream, add ? s.hidden : nullptr, s.normed, dtype);
      if (rc == 0) rc = moe_block(layer.mlp, s.normed, dtype, n, h, s.hidden);
    } else if (layer.kind == 1 || layer.kind == 2) {
      rc = layer.kind == 1
               ? gdn_decoder_mixer(static_cast<const GDNLayerWeights*>(layer.mixer),
                                   s.state_batch, n, s.stream, s.hidden, s.normed,
                                   s.state_scratch, dtype)
               : gated_attention_mixer(static_cast<const GatedAttentionWeights*>(layer.mixer),
                                       s.attention_step, s.stream, s.hidden, s.normed, dtype);
      if (rc == 0) rc = moe_block(layer.mlp, s.normed, dtype, n, h, s.mlp_out);
      if (rc == 0) {
        if (dtype == 0)
          add_rows(static_cast<float*>(s.stream), static_cast<const float*>(s.hidden),
                   static_cast<const float*>(s.mlp_out), n * h);
        else
          add_rows(static_cast<uint16_t*>(s.stream), static_cast<const uint16_t*>(s.hidden),
                   static_cast<const uint16_t*>(s.mlp_out), n * h);
      }
    } else {
      rc = -3;
    }
    if (rc != 0) return rc;
  }
  if (s.final_norm != nullptr) {
    if (dtype == 0)
      final_norm_rows<float>(s, n, h);
    else
      final_norm_rows<uint16_t>(s, n, h);
  }
  return 0;
}

}  // extern "C"
