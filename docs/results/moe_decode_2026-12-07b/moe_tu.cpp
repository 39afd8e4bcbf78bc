// One build of the routed-experts kernel (fused_moe_kernel.h) for ab.cpp: compiled once per
// source tree with -Dpagedllm=<namespace> -DVARIANT_FN=<name>, so that two trees' kernels live in
// one process. Runs plan + expert phases + combine for each of L layers (one thread); `hot`:
// every block reads expert 0's weights (L2-resident: the kernel's work without the stream).
#include "fused_moe_kernel.h"

extern "C" void VARIANT_FN(int L, const float* const* w13, const float* const* w2,
                           const int64_t* const* ids, int64_t T, int64_t K, int64_t E,
                           int64_t H, int64_t I, const float* x, const float* wts, float* out,
                           int hot) {
  using namespace pagedllm;
  const int64_t chunks = (H + moe::kCombineChunk - 1) / moe::kCombineChunk;
  for (int l = 0; l < L; ++l) {
    moe::Plan<float> p;
    moe::plan<float, float>(ids[l], T, K, E, H, I, 1, p);
    if (hot)
      for (auto& b : p.blocks) b.expert = 0;
#pragma omp parallel num_threads(1)
    {
      moe::expert_phases<float, float>(x, w13[l], w2[l], p);
#pragma omp for
      for (int64_t item = 0; item < T * chunks; ++item) {
        const int64_t t = item / chunks, c0 = (item % chunks) * moe::kCombineChunk;
        const int64_t c1 = std::min(H, c0 + moe::kCombineChunk);
        float acc[moe::kCombineChunk];
        moe::routed_sum(p, wts, K, t, c0, c1, acc);
        for (int64_t c = c0; c < c1; ++c) out[t * H + c] = acc[c - c0];
      }
    }
  }
}
