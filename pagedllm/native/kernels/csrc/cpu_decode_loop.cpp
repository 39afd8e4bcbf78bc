// Greedy decode steps of a Llama-family or DeepSeek model in one native call: the later steps
// of a multi-step round (pagedllm/native/decode_loop.py) when every request is plain greedy.
//
// Why: the per-step work around the fused decoder (input advance, embedding lookup, attention
// metadata, final norm, LM head call, argmax, token bookkeeping) is ~25 Python and torch calls.
// On a small model at batch 1 they run after the weight stream has evicted their code and data
// from the caches, and cost a noticeable share of the step (docs/benchmarks.md, "Measurements
// behind choices in the code"). Here each step is the same kernels, called from one loop:
//
//   positions += 1; seq_lens += 1; slot = block_table[pos / block_size] * block_size + pos % bs
//   residual = embedding rows of the last tokens (model dtype)
//   delta = decoder_layers(residual)                        (cpu_decoder.cpp; a DeepSeek
//           stack: hybrid_decoder_layers, cpu_hybrid_stack.cpp, its last MLP output; with
//           auxiliary layers, EAGLE-3 verification, split at them and the stream entering
//           each copied to aux_out)
//   x = add_rms_norm(residual, delta) * norm                 (cpu_decoder.cpp)
//     (a Qwen3-Next stack: x = hybrid_decoder_layers(residual) with its final GemmaRMSNorm)
//   logits = x @ W_head^T (float32)                          (GGUF segments or packed panels)
//   token = argmax(logits) per row (first maximum; a NaN counts as the largest, as numpy)
//
// which is what the module path computes with the same kernels and the same roundings, so the
// tokens equal those of single steps (the caller sends plain greedy rows only: no min_tokens,
// nothing that edits the logits). The loop ends after the step where some row samples one of
// its stop tokens: that request is over, and the others go on in the next round without it
// (the scheduler gives back the round's unused slots), so no step computes a finished row.
//
// Qwen3-Next's Gated DeltaNet layers read and write each row's state slot (StateBatch). Without
// prefix caching a request keeps one slot, which stays. In prefix caching's "align" mode the
// state group's block table is position-aligned (pagedllm/layers/state_cache.py): the step at
// position p writes entry p / block_size; where that differs from the entry of p - 1 (the step
// crosses into a new block), that entry's slot is first copied into the new one in every
// recurrent layer, so the old entry keeps the state at its block's end as a checkpoint. That
// is what the runner does before each step (`StateCacheMetadata.from_common`,
// `copy_state_slots`), with the same byte copies, so the loop never has to end at a block
// boundary; the scheduler registers the checkpoints afterwards, as for single steps.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_vec.h"
#include "gguf_blocks.h"
#include "pagedllm_abi.h"

// The library's other entry points it calls are declared by pagedllm_abi.h.

namespace {

using pagedllm::to_float;
using pagedllm::store;

// How a weight [rows, cols] (the embedding table or the LM head) is stored: `VocabWeight.kind`
// (abi.py; the Python side names them in native/decode_loop.py). DecodeLoopArgs' buffers are
// sized for num_reqs rows (one token each).
enum VocabKind : int64_t {
  kDense = 0,       // rows [rows, cols] in `dtype` (embedding only)
  kPacked = 1,      // packed_gemm.h panels in `dtype` (pack_linear_weight)
  kGguf = 2,        // GGUF row segments, float32 activations
  kGgufQ8 = 3,      // GGUF row segments, activations rounded to 8 bits per block
};

int64_t row_argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  float best_v = x[0];
  if (std::isnan(best_v)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = x[i];
    if (std::isnan(v)) return i;
    if (v > best_v) {
      best_v = v;
      best = i;
    }
  }
  return best;
}

// The first maximum of x[0, n) (a NaN, the first one, counts as the largest), as
// `row_argmax_scalar`. AVX-512: 16 lanes each keep their first maximum (strict >), the lanes'
// maxima then give the smallest index among the equal ones; a NaN anywhere sends the row to
// the scalar scan. The scalar scan's compare-and-select chain ran at a few cycles an element,
// ~1% of a batch-32 step over a 32000-entry vocabulary.
int64_t row_argmax(const float* x, int64_t n) {
#ifdef PAGEDLLM_AVX512
  if (n >= 16 && n < (int64_t{1} << 31)) {   // (int32 lane indices)
    __m512 best_v = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = best_i;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best_v, best_v, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      idx = _mm512_add_epi32(idx, sixteen);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best_v, _CMP_GT_OQ);
      best_v = _mm512_mask_mov_ps(best_v, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    if (nan != 0) return row_argmax_scalar(x, n);
    alignas(64) float lane_v[16];
    alignas(64) int32_t lane_i[16];
    _mm512_store_ps(lane_v, best_v);
    _mm512_store_si512(lane_i, best_i);
    float m = lane_v[0];
    for (int l = 1; l < 16; ++l) m = lane_v[l] > m ? lane_v[l] : m;
    int64_t best = n;
    for (int l = 0; l < 16; ++l)
      if (lane_v[l] == m && lane_i[l] < best) best = lane_i[l];
    for (; i < n; ++i) {   // the tail, after every lane's earlier elements
      const float v = x[i];
      if (std::isnan(v)) return i;
      if (v > m) {
        m = v;
        best = i;
      }
    }
    return best;
  }
#endif
  return row_argmax_scalar(x, n);
}

// residual [n, cols] (model dtype) = rows `ids` of the embedding. Returns 0, or -1.
int embed_rows(const DecodeLoopArgs& a, const int64_t* ids) {
  const VocabWeight& w = a.embedding;
  const int64_t n = a.num_reqs, cols = w.cols;
  if (w.kind == kGguf || w.kind == kGgufQ8) {
    if (dequantize_rows_gguf(w.segments, cols, ids, n, a.embed_f32) != 0) return -1;
    for (int64_t i = 0; i < n * cols; ++i) {
      if (a.dtype == 0)
        static_cast<float*>(a.residual)[i] = a.embed_f32[i];
      else
        store(a.embed_f32[i], static_cast<uint16_t*>(a.residual) + i);
    }
    return 0;
  }
  if (w.dtype != a.dtype) return -1;
  if (w.kind == kPacked)
    return packed_weight_rows(w.data, w.rows, cols, static_cast<int>(w.dtype), ids, n,
                              a.residual) == 0 ? 0 : -1;
  const size_t row_bytes = static_cast<size_t>(cols) * (w.dtype == 0 ? 4 : 2);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= w.rows) return -1;
    std::memcpy(static_cast<char*>(a.residual) + i * row_bytes,
                static_cast<const char*>(w.data) + ids[i] * row_bytes, row_bytes);
  }
  return 0;
}

// logits [n, rows] = head_x @ W^T. Returns 0, or -1.
int head_logits(const DecodeLoopArgs& a) {
  const VocabWeight& w = a.head;
  const int64_t n = a.num_reqs, k = w.cols;
  switch (w.kind) {
    case kGguf:
      return linear_gguf_segments(a.head_x, k, n, k, w.segments, w.num_segments, nullptr,
                                  a.logits, w.rows);
    case kGgufQ8:
      return linear_gguf_segments_q8(a.head_x, k, n, k, w.segments, w.num_segments, nullptr,
                                     a.logits, w.rows);
    case kPacked:
      if (w.dtype == 0)
        packed_linear_f32(a.head_x, k, n, k, static_cast<const float*>(w.data), w.rows, nullptr,
                          a.logits, w.rows);
      else
        packed_linear_bf16(a.head_x, k, n, k, static_cast<const uint16_t*>(w.data), w.rows,
                           nullptr, a.logits, w.rows);
      return 0;
    default:
      return -1;
  }
}

// Copies state slot `src` into `dst` in every Gated DeltaNet layer of the stack (conv window
// [conv_dim, K - 1] in its dtype, recurrent state [Hv, dk, dv] float32: the layouts of
// cpu_state_scan.cpp). Returns 0, or -1 for a slot outside [0, num_slots).
int copy_state_slot(const DecodeLoopArgs& a, int64_t src, int64_t dst, int64_t num_slots) {
  if (src < 0 || src >= num_slots || dst < 0 || dst >= num_slots) return -1;
  for (int64_t l = 0; l < a.num_layers; ++l) {
    if (a.hybrid_layers[l].kind != 1) continue;
    const auto& w = *static_cast<const GDNLayerWeights*>(a.hybrid_layers[l].mixer);
    const int64_t conv_dim = 2 * w.num_k_heads * w.head_k_dim + w.num_v_heads * w.head_v_dim;
    const size_t conv_bytes = static_cast<size_t>(conv_dim * (w.conv_kernel - 1)) *
                              (w.conv_state_dtype == 0 ? 4 : 2);
    const size_t state_bytes =
        static_cast<size_t>(w.num_v_heads * w.head_k_dim * w.head_v_dim) * sizeof(float);
    char* conv = static_cast<char*>(w.conv_states);
    char* state = reinterpret_cast<char*>(w.recurrent_states);
    std::memcpy(conv + dst * conv_bytes, conv + src * conv_bytes, conv_bytes);
    std::memcpy(state + dst * state_bytes, state + src * state_bytes, state_bytes);
  }
  return 0;
}

// Each row's state slot for the step at a.positions (mode "align", a.state_table set): the
// entry of the position's block, after copying the previous block's entry into it where the
// step starts a block. Returns 0, or -1 for a slot out of range.
int advance_state_slots(const DecodeLoopArgs& a) {
  const int64_t num_slots = a.hybrid_step->state_batch->num_slots;
  for (int64_t b = 0; b < a.num_reqs; ++b) {
    const int64_t pos = a.positions[b];
    const int32_t* row = a.state_table + b * a.state_table_stride;
    const int64_t col = pos / a.block_size, prev = (pos - 1) / a.block_size;
    if (pos > 0 && prev != col && copy_state_slot(a, row[prev], row[col], num_slots) != 0)
      return -1;
    a.state_indices[b] = row[col];
  }
  return 0;
}

bool is_stop(const DecodeLoopArgs& a, int64_t b, int64_t token) {
  for (int64_t i = a.stop_offsets[b]; i < a.stop_offsets[b + 1]; ++i)
    if (a.stop_ids[i] == token) return true;
  return false;
}

// aux_out columns [i * h, (i + 1) * h) of every row = the stream entering layer aux_layers[i]:
// the residual plus the pending delta of the layers before, added in float32 and rounded once
// to the model dtype (what native/fused_decoder.py's capture computes in torch).
template <typename T>
void copy_stream(const DecodeLoopArgs& a, int64_t i, bool pending) {
  const int64_t n = a.num_reqs, h = a.hidden, width = a.num_aux * h;
  const T* residual = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.aux_out);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < h; ++c) {
      const float v = to_float(residual[r * h + c]) + (pending ? a.delta[r * h + c] : 0.0f);
      store(v, out + r * width + i * h + c);
    }
}

// decoder_layers split at the auxiliary layers (the caller checked them: non-decreasing,
// each < num_layers), capturing the stream entering each one; `delta` ends as the last layer's
// output, as one decoder_layers call leaves it.
void run_layers_with_aux(const DecodeLoopArgs& a) {
  int64_t start = 0;
  bool pending = false;    // `delta` holds the output of layers not yet added to `residual`
  for (int64_t i = 0; i <= a.num_aux; ++i) {
    const int64_t stop = i < a.num_aux ? a.aux_layers[i] : a.num_layers;
    if (stop > start) {
      decoder_layers(a.layers + start, static_cast<int>(stop - start), a.step,
                     a.attention_rows, static_cast<int>(a.num_reqs), pending ? 1 : 0,
                     static_cast<int>(a.dtype));
      pending = true;
      start = stop;
    }
    if (i == a.num_aux) break;
    if (a.dtype == 0)
      copy_stream<float>(a, i, pending);
    else
      copy_stream<uint16_t>(a, i, pending);
  }
}

}  // namespace

extern "C" {

// Runs up to `num_steps` greedy decode steps. On entry `tokens` [num_reqs] holds each row's
// last token and `args.positions` its position (the position of the last computed token);
// step s writes its tokens to out_tokens[s * num_reqs ..]. Returns the steps run: num_steps,
// or fewer when a row sampled one of its stop tokens at the last one run; -1 if a weight kind
// is not taken, a token id is outside the embedding, a state slot is outside the state
// tensors or a layer's kernel failed (that step's tokens not written).
int decode_greedy_steps(const DecodeLoopArgs* args, int64_t* tokens, int num_steps,
                        int64_t* out_tokens) {
  const DecodeLoopArgs& a = *args;
  const int64_t n = a.num_reqs, h = a.hidden, vocab = a.head.rows;
  for (int s = 0; s < num_steps; ++s) {
    for (int64_t b = 0; b < n; ++b) {
      const int64_t pos = ++a.positions[b];
      a.seq_lens[b] = static_cast<int32_t>(pos + 1);
      a.slot_mapping[b] =
          static_cast<int64_t>(a.block_table[b * a.block_table_stride + pos / a.block_size]) *
              a.block_size + pos % a.block_size;
    }
    if (a.state_table != nullptr && advance_state_slots(a) != 0) return -1;
    if (embed_rows(a, tokens) != 0) return -1;
    const bool final_normed = a.hybrid_layers != nullptr && a.hybrid_step->final_norm != nullptr;
    if (a.hybrid_layers != nullptr) {
      if (hybrid_decoder_layers(a.hybrid_layers, static_cast<int>(a.num_layers),
                                a.hybrid_step) != 0)
        return -1;
    } else if (a.num_aux > 0) {
      run_layers_with_aux(a);
    } else {
      decoder_layers(a.layers, static_cast<int>(a.num_layers), a.step, a.attention_rows,
                     static_cast<int>(n), 0, static_cast<int>(a.dtype));
    }
    if (!final_normed)
      add_rms_norm(a.residual, a.delta, n, h, a.norm_weight, a.norm_eps, a.normed,
                   static_cast<int>(a.dtype));
    for (int64_t i = 0; i < n * h; ++i)
      a.head_x[i] = a.dtype == 0 ? static_cast<const float*>(a.normed)[i]
                                 : to_float(static_cast<const uint16_t*>(a.normed)[i]);
    if (head_logits(a) != 0) return -1;
    bool stopped = false;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t token = row_argmax(a.logits + b * vocab, vocab);
      tokens[b] = token;
      out_tokens[s * n + b] = token;
      stopped = stopped || is_stop(a, b, token);
    }
    if (stopped) return s + 1;
  }
  return num_steps;
}

}  // extern "C"
