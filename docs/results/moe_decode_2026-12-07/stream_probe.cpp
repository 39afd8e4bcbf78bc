// The routed experts of a 32-row decode step (fused_moe_kernel.h: plan, expert_phases, combine)
// against a read-only streaming probe over the same experts' bytes in the same order (16-lane
// loads, software prefetch `PF` bytes ahead on top of the hardware prefetchers), one thread.
// L layers of distinct weights are cycled so that the working set (616 / 456 MB) exceeds the
// last-level cache, as in a whole decode step. Routing: T tokens, top-k distinct random experts.
// Build (from the repository root):
//   g++ -O3 -march=native -fopenmp -std=c++17 -Ipagedllm/native/kernels/csrc \
//       docs/results/moe_decode_2026-12-07/stream_probe.cpp -o /tmp/stream_probe
// Run: OMP_NUM_THREADS=1 /tmp/stream_probe deepseek|qwen [rounds]
#include "fused_moe_kernel.h"
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
using namespace pagedllm;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <int PF>
float read_probe(const std::vector<const float*>& spans, const std::vector<int64_t>& lens) {
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t b = 0; b < spans.size(); ++b) {
    const float* p = spans[b];
    const int64_t n = lens[b];
    const char* next = b + 1 < spans.size() ? reinterpret_cast<const char*>(spans[b + 1]) : nullptr;
    for (int64_t i = 0; i < n; i += 64) {
      if (PF > 0) {
        const int64_t off = i * 4 + PF;
        if (off < n * 4) _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
        else if (next) _mm_prefetch(next + (off - n * 4), _MM_HINT_T0);
      }
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
    }
  }
  return hsum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

int main(int argc, char** argv) {
  const bool ds = argc < 2 || std::strcmp(argv[1], "qwen") != 0;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 5;
  const int64_t E = ds ? 64 : 16, H = ds ? 512 : 768, I = ds ? 224 : 256, K = ds ? 6 : 2;
  const int L = ds ? 7 : 12, T = 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  std::vector<std::vector<float>> w13(L), w2(L);
  for (int l = 0; l < L; ++l) {
    w13[l].resize(E * 2 * I * H);
    w2[l].resize(E * H * I);
    for (auto& v : w13[l]) v = nd(rng);
    for (auto& v : w2[l]) v = nd(rng);
  }
  std::vector<float> x(T * H), out(T * H);
  for (auto& v : x) v = nd(rng) * 20;
  std::vector<std::vector<int64_t>> ids(L, std::vector<int64_t>(T * K));
  std::vector<float> wts(T * K, 1.f / K);
  for (int l = 0; l < L; ++l)
    for (int t = 0; t < T; ++t) {
      std::vector<int64_t> perm(E);
      for (int64_t e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < K; ++j) ids[l][t * K + j] = perm[j];
    }
  // The active experts of each layer, in expert order (the plan's order).
  std::vector<const float*> spans;
  std::vector<int64_t> lens;
  double bytes = 0;
  for (int l = 0; l < L; ++l) {
    std::vector<char> on(E, 0);
    for (int64_t e : ids[l]) on[e] = 1;
    for (int64_t e = 0; e < E; ++e)
      if (on[e]) {
        spans.push_back(w13[l].data() + e * 2 * I * H);
        lens.push_back(2 * I * H);
        spans.push_back(w2[l].data() + e * H * I);
        lens.push_back(H * I);
        bytes += 3.0 * I * H * 4;
      }
  }
  const int64_t chunks = (H + moe::kCombineChunk - 1) / moe::kCombineChunk;
  auto run_moe = [&]() {
    for (int l = 0; l < L; ++l) {
      moe::Plan<float> p;
      moe::plan<float, float>(ids[l].data(), T, K, E, H, I, 1, p);
#pragma omp parallel num_threads(1)
      {
        moe::expert_phases<float, float>(x.data(), w13[l].data(), w2[l].data(), p);
#pragma omp for
        for (int64_t item = 0; item < T * chunks; ++item) {
          const int64_t t = item / chunks, c0 = (item % chunks) * moe::kCombineChunk;
          const int64_t c1 = std::min(H, c0 + moe::kCombineChunk);
          float acc[moe::kCombineChunk];
          moe::routed_sum(p, wts.data(), K, t, c0, c1, acc);
          for (int64_t c = c0; c < c1; ++c) out[t * H + c] = acc[c - c0];
        }
      }
    }
  };
  float sink = 0;
  std::printf("%s: %d layers, %.1f MB of active experts per step (%.1f per layer)\n",
              ds ? "deepseek" : "qwen3-next", L, bytes / 1e6, bytes / 1e6 / L);
  if (argc > 3 && std::strcmp(argv[3], "moe") == 0) {   // the kernel alone (for perf)
    for (int r = 0; r < rounds; ++r) run_moe();
    std::printf("checksum %g\n", out[5]);
    return 0;
  }
  for (int r = 0; r < rounds; ++r) {
    double t0 = now(); run_moe(); double t1 = now();
    sink += read_probe<0>(spans, lens); double t2 = now();
    sink += read_probe<1024>(spans, lens); double t3 = now();
    sink += read_probe<4096>(spans, lens); double t4 = now();
    std::printf("moe %.3f ms/layer (%.1f GB/s)  read hw %.3f (%.1f)  read+pf1K %.3f (%.1f)  "
                "read+pf4K %.3f (%.1f)\n",
                (t1 - t0) * 1e3 / L, bytes / (t1 - t0) / 1e9, (t2 - t1) * 1e3 / L,
                bytes / (t2 - t1) / 1e9, (t3 - t2) * 1e3 / L, bytes / (t3 - t2) / 1e9,
                (t4 - t3) * 1e3 / L, bytes / (t4 - t3) / 1e9);
  }
  std::printf("checksum %g %g\n", sink, out[5]);
}
