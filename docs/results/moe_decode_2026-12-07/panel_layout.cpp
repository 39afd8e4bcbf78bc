// Panel tile rate (fused_moe_kernel.h panel_micro16<12, 2>) on an L2-resident 64-row weight tile, 6 x panels:
// weight rows at stride K (as now), x panels at a padded stride (argv[2] extra floats), and the
// weights pre-packed in k order per 12-row group ([K][12]: the layout a load-time packing would
// make). g++ -O3 -march=native -fopenmp -std=c++17 -Ipagedllm/native/kernels/csrc panel_layout.cpp
// usage: ./a.out K [PAD]
#include "fused_moe_kernel.h"
#include <chrono>
#include <cstdio>
#include <vector>
using namespace pagedllm; using namespace pagedllm::moe;
static double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
template <int NP>
void pg_ld(const float* w, int64_t ldw, int64_t K, const float* panel, int64_t n, float* c, int64_t ldp) {
  const int64_t cq = n * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
    const int64_t kc = std::min(kPanelDepth, K - k0);
    const float* wk = w + k0; const float* pk = panel + k0 * kPanel; const bool acc = k0 > 0;
    int64_t j = 0;
    for (; j + 12 <= n; j += 12) panel_micro16<12, NP>(wk + j * ldw, ldw, kc, pk, ldp, c + j * kPanel, cq, acc);
    if (n - j >= 4) { panel_micro16<4, NP>(wk + j * ldw, ldw, kc, pk, ldp, c + j * kPanel, cq, acc); j += 4; }
  }
}
// k-ordered packed weights: group g of 12 rows: [K][12]
template <int MR, int NP>
__attribute__((always_inline)) inline void pm_packed(const float* w, int64_t kc, const float* panel, int64_t ldp, float* c, int64_t cq, bool accumulate) {
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i) for (int q = 0; q < NP; ++q) acc[i][q] = accumulate ? _mm512_loadu_ps(c + q * cq + i * kPanel) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m512 pv[NP]; for (int q = 0; q < NP; ++q) pv[q] = _mm512_loadu_ps(panel + q * ldp + k * kPanel);
    for (int i = 0; i < MR; ++i) { const __m512 wv = _mm512_set1_ps(w[k * MR + i]); for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_fmadd_ps(wv, pv[q], acc[i][q]); }
  }
  for (int i = 0; i < MR; ++i) for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + q * cq + i * kPanel, acc[i][q]);
}
template <int NP>
void pg_packed(const float* wp, int64_t K, const float* panel, int64_t n, float* c) {
  const int64_t cq = n * kPanel, ldp = kPanel * K;
  for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
    const int64_t kc = std::min(kPanelDepth, K - k0);
    const float* pk = panel + k0 * kPanel; const bool acc = k0 > 0;
    int64_t j = 0;
    for (; j + 12 <= n; j += 12) pm_packed<12, NP>(wp + j * K + k0 * 12, kc, pk, ldp, c + j * kPanel, cq, acc);
    if (n - j >= 4) { pm_packed<4, NP>(wp + j * K + k0 * 4, kc, pk, ldp, c + j * kPanel, cq, acc); j += 4; }
  }
}
int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? atoi(argv[1]) : 512, n = 64, P = 6;
  const int64_t PS = 16 * K + (argc > 2 ? atoi(argv[2]) : 0);
  std::vector<float> w(n * (K + 16)), wp(n * K), pan(P * PS), c(P * n * 16);
  for (size_t i = 0; i < w.size(); ++i) w[i] = (i % 17) * 0.01f;
  for (size_t i = 0; i < pan.size(); ++i) pan[i] = (i % 5) * 0.1f;
  // pack rows of stride K: groups of 12 (then 4)
  int64_t j = 0; for (; j + 12 <= n; j += 12) for (int64_t k = 0; k < K; ++k) for (int i = 0; i < 12; ++i) wp[j * K + k * 12 + i] = w[(j + i) * K + k];
  for (; j + 4 <= n; j += 4) for (int64_t k = 0; k < K; ++k) for (int i = 0; i < 4; ++i) wp[j * K + k * 4 + i] = w[(j + i) * K + k];
  const double macs = double(n) * K * P * 16;
  for (int rep = 0; rep < 3; ++rep) {
    double t[3];
    for (int v = 0; v < 3; ++v) {
      double a = now();
      for (int it = 0; it < 400; ++it)
        for (int64_t q = 0; q < P; q += 2) {
          if (v == 0) pg_ld<2>(w.data(), K, K, pan.data() + q * 16 * K, n, c.data(), 16 * K);
          else if (v == 1) pg_ld<2>(w.data(), K, K, pan.data() + q * PS, n, c.data(), PS);
          else pg_packed<2>(wp.data(), K, pan.data() + q * 16 * K, n, c.data());
        }
      t[v] = (now() - a);
    }
    printf("K %ld: ld=K %.1f GMAC/s  panel stride padded %.1f  packed k-order %.1f\n", (long)K, 400 * macs / t[0] / 1e9, 400 * macs / t[1] / 1e9, 400 * macs / t[2] / 1e9);
  }
}
