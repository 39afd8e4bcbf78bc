// The MoE router's logits alone: linear_tiles on the weight rows (the starting point's path:
// 8-lane dot products, 8-expert tiles) against the packed GEMM on a packed copy
// (packed_gemm.h, this tree's router), and a panel form tried first (x transposed into 16-row
// panels as for the experts' prefill, router rows broadcast: slower than the packed GEMM, not
// kept; written inline here); alternated in one process, one thread, best of 7; DeepSeek-V2-Lite
// 200M (64 x 512) and Qwen3-Next 200M (16 x 768) routers at 1, 32 and 2048 rows; float32.
// Build: g++ -O3 -march=native -fopenmp -std=c++17 -Ipagedllm/native/kernels/csrc \
//          docs/results/moe_decode_2026-12-07/router_ab.cpp -o /tmp/router_ab
// usage: OMP_NUM_THREADS=1 /tmp/router_ab [ROWS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "fused_moe_kernel.h"
#include "packed_gemm.h"

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The panel form (tried, not kept): 2-panel steps x tiles of 32 experts.
static void panel_router(const float* x, const int64_t* id, int64_t T, int64_t H, const float* w,
                         int64_t E, float* logits) {
  using namespace pagedllm::moe;
  constexpr int64_t kTile = 32;
  std::vector<float> panel(kPanelsPerStep * kPanel * H), c(kPanelsPerStep * kTile * kPanel);
  for (int64_t r0 = 0; r0 < T; r0 += kPanelsPerStep * kPanel)
    for (int64_t e0 = 0; e0 < E; e0 += kTile) {
      const int64_t n = std::min(E - e0, kTile), rows = std::min(T - r0, kPanelsPerStep * kPanel);
      const int64_t np = (rows + kPanel - 1) / kPanel;
      gather_panels(x, id + r0, rows, H, panel.data());
      panel_gemm(w + e0 * H, H, panel.data(), np, n, c.data());
      for (int64_t q = 0; q < np; ++q)
        for (int64_t r = 0; r < std::min(kPanel, rows - q * kPanel); ++r)
          for (int64_t j = 0; j < n; ++j)
            logits[(r0 + q * kPanel + r) * E + e0 + j] = c[q * n * kPanel + j * kPanel + r];
    }
}

int main(int argc, char** argv) {
  const int64_t only = argc > 1 ? std::atoi(argv[1]) : 0;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (auto [E, H] : {std::pair<int64_t, int64_t>{64, 512}, {16, 768}})
    for (int64_t T : {1, 32, 2048}) {
      if (only && T != only) continue;
      std::vector<float> x(T * H), w(E * H), wp(E * H), a(T * E), b(T * E), c(T * E);
      std::vector<int64_t> id(T);
      for (auto& v : x) v = nd(rng);
      for (auto& v : w) v = nd(rng) / 22.f;
      for (int64_t t = 0; t < T; ++t) id[t] = t;
      pagedllm::packed::pack(w.data(), E, H, wp.data());
      const int reps = std::max<int64_t>(1, 20000 / T);
      double best[3] = {1e9, 1e9, 1e9};
      for (int r = 0; r < 7; ++r) {
        for (int v = 0; v < 3; ++v) {
          const double t0 = now();
          for (int i = 0; i < reps; ++i) {
            if (v == 0) {
#pragma omp parallel num_threads(1)
              pagedllm::linear_tiles(x.data(), H, T, H, w.data(), E, nullptr, a.data(), E);
            } else if (v == 1) {
#pragma omp parallel num_threads(1)
              pagedllm::packed::linear_tiles(x.data(), H, T, H, wp.data(), E, nullptr, b.data(), E);
            } else {
              panel_router(x.data(), id.data(), T, H, w.data(), E, c.data());
            }
          }
          best[v] = std::min(best[v], (now() - t0) / reps);
        }
      }
      double diff = 0;
      for (int64_t i = 0; i < T * E; ++i)
        diff = std::max({diff, (double)std::fabs(a[i] - b[i]), (double)std::fabs(a[i] - c[i])});
      const double macs = double(T) * E * H;
      std::printf("E %2ld H %ld T %4ld: linear_tiles %7.1f us (%4.1f GMAC/s)  packed %7.1f us "
                  "(%4.1f GMAC/s, %.2fx)  panel form %7.1f us (%4.1f GMAC/s)  max|diff| %.1e\n",
                  (long)E, (long)H, (long)T, best[0] * 1e6, macs / best[0] / 1e9, best[1] * 1e6,
                  macs / best[1] / 1e9, best[0] / best[1], best[2] * 1e6, macs / best[2] / 1e9,
                  diff);
    }
}
