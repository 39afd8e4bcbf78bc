// One library per source tree: the routed experts (plan + expert_phases) only, one thread.
#include "fused_moe_kernel.h"
using namespace pagedllm;
extern "C" double run_experts(int bf16, const void* x, const void* w13, const void* w2,
                              const int64_t* ids, int64_t T, int64_t E, int64_t I, int64_t H,
                              int64_t k, void* ys_out) {
  timespec a, b; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  auto go = [&](auto tag) {
    using T_ = decltype(tag);
    moe::Plan<T_> p; moe::plan<T_, T_>(ids, T, k, E, H, I, 1, p);
#pragma omp parallel num_threads(1)
    { moe::expert_phases((const T_*)x, (const T_*)w13, (const T_*)w2, p); }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    if (ys_out) std::copy(p.ys, p.ys + p.m * H, (T_*)ys_out);
  };
  if (bf16) go(uint16_t{}); else go(float{});
  return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}
