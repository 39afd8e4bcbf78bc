// A whole mixture-of-experts block in one call (CPU), for `NativeMoeBlock` in
// pagedllm/native/moe_block.py: the module path's SparseMoeBlock (Mixtral, Qwen2/3-MoE, OLMoE,
// Qwen3-Next) and DeepseekMoE (DeepSeek-V2/V3, GLM-4 MoE) at decode and small batches.
//
//   logits  = x @ Wr^T                      [T, E], rounded to Wr's dtype (as the module's linear)
//   routing per token (layers/fused_moe.py `select_experts`, layers/moe_routing.py):
//     softmax: s = softmax(logits), choice = s;  sigmoid: s = sigmoid(logits), choice = s + bias
//     group-limited (methods 1, 2): group score = max of choice in the group (1) or the sum of
//       its top 2 (2); the topk_group best groups stay, the others' experts leave the choice
//     ids = top-k of choice; w = s[ids]; renormalize: w / (sum w [+ 1e-20 for sigmoid]);
//     w *= routed_scaling_factor
//   routed  = sum_j w[t, j] * expert_{ids[t, j]}(x[t])          (fused_moe_kernel.h)
//   shared  = down(silu(x Wg^T) * (x Wu^T))                     (0 without a shared expert)
//   out     = routed + [sigmoid(x . g) *] shared                (Qwen's shared_expert_gate g)
//
// Why: the module path of one block is ~30-60 torch operations (router linear, softmax, top-k,
// the shared MLP's linears, the gate, adds), each paying Python dispatch; at batch 1 of a 200M
// MoE model they cost as much as streaming the chosen experts' weights. Here the block is one
// OpenMP parallel region whose phases are separated by the implicit barriers of their
// work-sharing loops: router logits (the packed GEMM), routing (per token), the
// counting sort (one thread), the experts' phases, the shared expert's two GEMMs (packed
// panels, packed_gemm.h, when the module's linears hold them), the gate, the combine.
//
// Rounding as the module path rounds (activations TA float32 or bfloat16, math in float32):
// the router logits to the router weight's dtype (DeepSeek's float32 router: not at all), the
// experts' intermediates as fused_moe_kernel.h says, the routed sum, the shared expert's GEMM
// outputs, silu(gate) and its product with up, the gate's logit and its sigmoid, the gated
// shared output; the final add rounds once. Ties in the top-k go to the lower expert id (torch's
// order for exact ties is unspecified).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "fused_moe_kernel.h"
#include "packed_gemm.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

// Index of the largest v[i] among i < n with !taken[i] (the lowest such index on ties).
inline int64_t arg_max(const float* v, const char* taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

// One token's routing (header): logits [E] -> ids [k], weights [k]. scores, choice: [E] scratch;
// taken: [max(E, n_group)] scratch.
void route(const MoeBlockWeights& w, const float* logits, float* scores, float* choice,
           char* taken, int64_t* ids, float* weights) {
  const int64_t E = w.num_experts, k = w.top_k;
  if (w.scoring == 0) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(logits[e] - mx));
    for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] /= sum;
  } else {
    for (int64_t e = 0; e < E; ++e) {
      scores[e] = 1.f / (1.f + std::exp(-logits[e]));
      choice[e] = scores[e] + (w.score_bias != nullptr ? w.score_bias[e] : 0.f);
    }
  }
  if (w.topk_method != 0) {
    const int64_t G = w.n_group, per = E / G;
    float group_score[256];   // n_group <= 256 (checked by the caller)
    for (int64_t g = 0; g < G; ++g) {
      const float* c = choice + g * per;
      if (w.topk_method == 1) {
        group_score[g] = *std::max_element(c, c + per);
      } else {   // the sum of the group's top 2
        float a = -std::numeric_limits<float>::infinity(), b = a;
        for (int64_t i = 0; i < per; ++i) {
          if (c[i] > a) {
            b = a;
            a = c[i];
          } else if (c[i] > b) {
            b = c[i];
          }
        }
        group_score[g] = a + b;
      }
    }
    std::fill(taken, taken + G, 0);
    for (int64_t j = 0; j < w.topk_group; ++j) taken[arg_max(group_score, taken, G)] = 1;
    // Experts of dropped groups leave the choice: masked to 0 (softmax, as HF) or -inf.
    const float fill = w.scoring == 0 ? 0.f : -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g)
      if (!taken[g]) std::fill(choice + g * per, choice + (g + 1) * per, fill);
  }
  std::fill(taken, taken + E, 0);
  float sum = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = arg_max(choice, taken, E);
    taken[e] = 1;
    ids[j] = e;
    weights[j] = w.scoring == 0 ? choice[e] : scores[e];
    sum += weights[j];
  }
  if (w.renormalize) {
    const float denom = sum + (w.scoring == 1 ? 1e-20f : 0.f);
    for (int64_t j = 0; j < k; ++j) weights[j] /= denom;
  }
  for (int64_t j = 0; j < k; ++j) weights[j] *= w.routed_scaling_factor;
}

// The weight a packed GEMM prefetches the first panels of as it ends (packed_gemm.h,
// `NextWeight`): packed panels in dtype code `dtype` with K columns; null `w`: none.
struct NextLinear {
  const void* w = nullptr;
  int dtype = -1;
  int64_t K = 0;
};

// y [T, N] = x [T, K] @ w^T for a weight in dtype code `dtype` (packed panels or rows): an
// orphaned work-sharing loop, as linear_tiles. A packed w's GEMM ends by prefetching `next`'s
// first panels where next is packed in the same dtype (router -> shared gate_up -> down).
template <typename TX, typename TY>
void any_linear(const TX* x, int64_t T, int64_t K, const void* w, int dtype, bool packed_w,
                int64_t N, TY* y, NextLinear next = {}) {
  const bool chained = next.w != nullptr && next.dtype == dtype;
  if (dtype == 0) {
    const float* wf = static_cast<const float*>(w);
    const packed::NextWeight<float> nw{chained ? static_cast<const float*>(next.w) : nullptr,
                                       next.K};
    if (packed_w) packed::linear_tiles(x, K, T, K, wf, N, nullptr, y, N, nullptr, nw);
    else linear_tiles(x, K, T, K, wf, N, nullptr, y, N);
  } else {
    const uint16_t* wb = static_cast<const uint16_t*>(w);
    const packed::NextWeight<uint16_t> nw{
        chained ? static_cast<const uint16_t*>(next.w) : nullptr, next.K};
    if (packed_w) packed::linear_tiles(x, K, T, K, wb, N, nullptr, y, N, nullptr, nw);
    else linear_tiles(x, K, T, K, wb, N, nullptr, y, N);
  }
}

// a[0, n) = silu(g) * u for one token's shared expert (g, u: its gate and up GEMM outputs in
// TA), rounded as the module path rounds (`moe::silu_mul`: silu(g) and the product to TA).
template <typename TA>
void shared_silu_mul(const TA* g, const TA* u, int64_t n, TA* a) {
  if constexpr (std::is_same_v<TA, float>) {
    moe::silu_mul<float>(g, u, n, a);
  } else {
    constexpr int64_t kChunk = 256;
    float gf[kChunk], uf[kChunk], af[kChunk];
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t m = std::min(kChunk, n - i0);
      for (int64_t i = 0; i < m; ++i) {
        gf[i] = to_float(g[i0 + i]);
        uf[i] = to_float(u[i0 + i]);
      }
      moe::silu_mul<TA>(gf, uf, m, af);
      for (int64_t i = 0; i < m; ++i) store(af[i], a + i0 + i);
    }
  }
}

template <typename TA, typename TW>
void moe_block_impl(const MoeBlockWeights& w, const TA* x, int64_t T, int64_t H, TA* out) {
  const int64_t E = w.num_experts, k = w.top_k, I = w.intermediate;
  const int64_t Is = w.shared_gate_up != nullptr ? w.shared_intermediate : 0;
  const int num_threads = omp_get_max_threads();
  std::vector<float> logits(T * E), topk_weights(T * k);
  std::vector<int64_t> topk_ids(T * k);
  std::vector<float> route_scratch(static_cast<size_t>(num_threads) * 2 * E);
  std::vector<char> taken(static_cast<size_t>(num_threads) * std::max<int64_t>(E, w.n_group));
  // The shared expert's intermediates, in buffers this thread reuses (fused_moe_kernel.h).
  TA* shared_gu = moe::reused_buffer<TA>(moe::kSlotShared0, T * 2 * Is);
  TA* shared_act = moe::reused_buffer<TA>(moe::kSlotShared1, T * Is);
  TA* shared_out = moe::reused_buffer<TA>(moe::kSlotShared2, T * H);
  std::unique_ptr<TA[]> gate_logit(new TA[std::max<int64_t>(1, T)]);
  moe::Plan<TA> plan;
  const int64_t chunks = (H + moe::kCombineChunk - 1) / moe::kCombineChunk;

#pragma omp parallel
  {
    // Router logits, rounded to the router weight's dtype.
    // NOTE(moe): the router on its packed copy (`router_packed`, made by NativeMoeBlock) runs
    // 2-3.5x faster than linear_tiles' dot products at 32 and 2048 rows (DeepSeek-V2-Lite 200M
    // 64 x 512, Qwen3-Next 200M 16 x 768; docs/benchmarks.md "The MoE kernel in float32"); the
    // sums' order differs (float32 rounding only).
    const NextLinear shared_gu_next =
        Is > 0 && w.shared_packed != 0 ? NextLinear{w.shared_gate_up, w.shared_dtype, H}
                                       : NextLinear{};
    if (E > 0) any_linear(x, T, H, w.router, w.router_dtype, w.router_packed != 0, E,
                          logits.data(), shared_gu_next);
    if (w.router_dtype != 0) {
#pragma omp for
      for (int64_t i = 0; i < T * E; ++i) logits[i] = moe::rounded<uint16_t>(logits[i]);
    }
    {
      const int tid = omp_get_thread_num();
      float* scores = route_scratch.data() + tid * 2 * E;
      char* tk = taken.data() + tid * std::max<int64_t>(E, w.n_group);
#pragma omp for
      for (int64_t t = 0; t < T; ++t)
        route(w, logits.data() + t * E, scores, scores + E, tk, topk_ids.data() + t * k,
              topk_weights.data() + t * k);
    }
    // On the calling thread (the region's master), so that the plan's buffers are that
    // thread's (`reused_buffer`) whichever threads the runtime hands out.
#pragma omp master
    moe::plan<TA, TW>(topk_ids.data(), T, k, E, H, I, num_threads, plan);
#pragma omp barrier
    moe::expert_phases(x, static_cast<const TW*>(w.w13), static_cast<const TW*>(w.w2), plan);

    if (Is > 0) {
      const bool packed_w = w.shared_packed != 0;
      any_linear(x, T, H, w.shared_gate_up, w.shared_dtype, packed_w, 2 * Is, shared_gu,
                 packed_w ? NextLinear{w.shared_down, w.shared_dtype, Is} : NextLinear{});
#pragma omp for
      for (int64_t t = 0; t < T; ++t) {
        const TA* gu = shared_gu + t * 2 * Is;
        shared_silu_mul(gu, gu + Is, Is, shared_act + t * Is);
      }
      any_linear(shared_act, T, Is, w.shared_down, w.shared_dtype, packed_w, H,
                 shared_out);
      if (w.shared_gate != nullptr)
        any_linear(x, T, H, w.shared_gate, w.shared_gate_dtype, false, 1, gate_logit.get());
    }

#pragma omp for
    for (int64_t item = 0; item < T * chunks; ++item) {
      const int64_t t = item / chunks, c0 = (item % chunks) * moe::kCombineChunk;
      const int64_t c1 = std::min(H, c0 + moe::kCombineChunk);
      float acc[moe::kCombineChunk];
      moe::routed_sum(plan, topk_weights.data(), k, t, c0, c1, acc);
      if (Is == 0) {
        for (int64_t c = c0; c < c1; ++c) store(acc[c - c0], out + t * H + c);
        continue;
      }
      const TA* s = shared_out + t * H;
      float scale = 1.f;
      if (w.shared_gate != nullptr)
        scale = moe::rounded<TA>(1.f / (1.f + std::exp(-to_float(gate_logit[t]))));
      for (int64_t c = c0; c < c1; ++c) {
        float shared = to_float(s[c]);
        if (w.shared_gate != nullptr) shared = moe::rounded<TA>(scale * shared);
        store(moe::rounded<TA>(acc[c - c0]) + shared, out + t * H + c);
      }
    }
  }
}

}  // namespace

extern "C" {

int moe_block(const MoeBlockWeights* w, const void* hidden, int act_dtype, int64_t num_tokens,
              int64_t hidden_size, void* out) {
  if (num_tokens <= 0) return 0;
  if (w->n_group > 256 || (w->topk_method != 0 && w->n_group <= 0)) return -2;
  const auto run = [&](auto act_tag, auto weight_tag) {
    using TA = decltype(act_tag);
    using TW = decltype(weight_tag);
    moe_block_impl<TA, TW>(*w, static_cast<const TA*>(hidden), num_tokens, hidden_size,
                           static_cast<TA*>(out));
  };
  const int e = w->expert_dtype;
  if (act_dtype == 0 && e == 0) run(float{}, float{});
  else if (act_dtype == 0 && e == 1) run(float{}, uint16_t{});
  else if (act_dtype == 1 && e == 0) run(uint16_t{}, float{});
  else if (act_dtype == 1 && e == 1) run(uint16_t{}, uint16_t{});
  else return -1;
  return 0;
}

}  // extern "C"
