// The routed experts alone (plan + expert_phases of fused_moe_kernel.h) at the presets prefill shapes,
// best thread CPU time of N calls. g++ -O3 -march=native -fopenmp -std=c++17 -I<csrc> panel_rate.cpp
// Standalone timing of fused_moe (experts only) at DeepSeek prefill shapes.
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include <ctime>
#include <cstdlib>
#include "fused_moe_kernel.h"
using namespace pagedllm;
template <typename T> void run(const char* name, int64_t T_, int64_t E, int64_t I, int64_t H, int64_t k, int reps) {
  std::mt19937 g(0); std::normal_distribution<float> nd;
  std::vector<T> w13(E*2*I*H), w2(E*H*I), x(T_*H), out(T_*H);
  for (auto& v : w13) store(nd(g) * 0.04f, &v);
  for (auto& v : w2) store(nd(g) * 0.06f, &v);
  for (auto& v : x) store(nd(g), &v);
  std::vector<int64_t> ids(T_*k); std::vector<float> wt(T_*k, 0.2f);
  std::uniform_int_distribution<int> ud(0, E-1);
  for (int64_t t = 0; t < T_; ++t) for (int64_t j = 0; j < k; ++j) { int64_t e; bool dup; do { e = ud(g); dup=false; for (int64_t q=0;q<j;++q) dup |= ids[t*k+q]==e; } while(dup); ids[t*k+j]=e; }
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    timespec a, b; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    moe::Plan<T> p; moe::plan<T, T>(ids.data(), T_, k, E, H, I, 1, p);
#pragma omp parallel num_threads(1)
    { moe::expert_phases(x.data(), w13.data(), w2.data(), p); }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    double s = (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
    best = std::min(best, s);
  }
  std::printf("%s T=%ld: best %.2f ms  %.1f GMAC/s\n", name, (long)T_, best*1e3, T_*k*3.0*I*H/best/1e9);
}
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 8; run<float>("ds fp32", 2048, 64, 224, 512, 6, reps);
  run<uint16_t>("ds bf16", 2048, 64, 224, 512, 6, reps);
  run<float>("qn fp32", 1365, 16, 256, 768, 2, reps);
}
