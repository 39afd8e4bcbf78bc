// A/B of two builds of the routed-experts kernel in one process (moe_tu.cpp compiled from two
// source trees), alternated round by round, with a read-only streaming probe over the same
// experts' bytes in the same order (16-lane loads, software prefetch 4 KiB ahead on top of the
// hardware prefetchers). Decode: T = 32 rows, L layers of distinct weights cycled (616 / 456 MB:
// more than the last-level cache, as in a whole decode step); prefill: one layer, T = 2048 /
// 1365 rows. Routing: top-k distinct random experts per token. One thread. Build: ab.sh.
// usage: ab_probe deepseek|qwen decode|prefill [rounds]
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define DECL(name)                                                                        \
  extern "C" void name(int L, const float* const* w13, const float* const* w2,            \
                       const int64_t* const* ids, int64_t T, int64_t K, int64_t E, int64_t H, \
                       int64_t I, const float* x, const float* wts, float* out);
DECL(moe_old)
DECL(moe_new)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static float read_probe(const std::vector<const float*>& spans, const std::vector<int64_t>& lens) {
  constexpr int64_t PF = 4096;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t b = 0; b < spans.size(); ++b) {
    const float* p = spans[b];
    const int64_t n = lens[b];
    const char* next = b + 1 < spans.size() ? reinterpret_cast<const char*>(spans[b + 1]) : nullptr;
    for (int64_t i = 0; i < n; i += 64) {
      const int64_t off = i * 4 + PF;
      if (off < n * 4) _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
      else if (next) _mm_prefetch(next + (off - n * 4), _MM_HINT_T0);
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
    }
  }
  float o[16];
  _mm512_storeu_ps(o, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
  return o[0];
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const bool ds = argc < 2 || std::strcmp(argv[1], "qwen") != 0;
  const bool prefill = argc > 2 && std::strcmp(argv[2], "prefill") == 0;
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 11;
  const int64_t E = ds ? 64 : 16, H = ds ? 512 : 768, I = ds ? 224 : 256, K = ds ? 6 : 2;
  // LAYERS=n overrides the layer count (1: a working set the last-level cache may hold).
  const int L = std::getenv("LAYERS") ? std::atoi(std::getenv("LAYERS")) : prefill ? 1 : (ds ? 7 : 12);
  const int64_t T = prefill ? (ds ? 2048 : 1365) : 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<std::vector<float>> w13(L), w2(L);
  std::vector<const float*> p13(L), p2(L);
  for (int l = 0; l < L; ++l) {
    w13[l].resize(E * 2 * I * H);
    w2[l].resize(E * H * I);
    for (auto& v : w13[l]) v = nd(rng) * 0.04f;
    for (auto& v : w2[l]) v = nd(rng) * 0.06f;
    p13[l] = w13[l].data();
    p2[l] = w2[l].data();
  }
  std::vector<float> x(T * H), out_old(T * H), out_new(T * H), wts(T * K, 1.f / K);
  for (auto& v : x) v = nd(rng);
  std::vector<std::vector<int64_t>> ids(L, std::vector<int64_t>(T * K));
  std::vector<const int64_t*> pids(L);
  for (int l = 0; l < L; ++l) {
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> perm(E);
      for (int64_t e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < K; ++j) ids[l][t * K + j] = perm[j];
    }
    pids[l] = ids[l].data();
  }
  std::vector<const float*> spans;
  std::vector<int64_t> lens;
  double bytes = 0;
  for (int l = 0; l < L; ++l) {
    std::vector<char> on(E, 0);
    for (int64_t e : ids[l]) on[e] = 1;
    for (int64_t e = 0; e < E; ++e)
      if (on[e]) {
        spans.push_back(p13[l] + e * 2 * I * H);
        lens.push_back(2 * I * H);
        spans.push_back(p2[l] + e * H * I);
        lens.push_back(H * I);
        bytes += 3.0 * I * H * 4;
      }
  }
  const double macs = 3.0 * T * K * H * I * L;
  std::printf("%s %s: %d layer(s), T %ld, %.1f MB of active experts, %.2f GMAC per pass\n",
              ds ? "deepseek" : "qwen3-next", prefill ? "prefill" : "decode", L, (long)T,
              bytes / 1e6, macs / 1e9);
  auto args = [&](float* out) { return out; };
  (void)args;
  std::vector<double> t_old, t_new, t_read, ratio;
  float sink = 0;
  moe_old(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_old.data());
  moe_new(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_new.data());
  for (int r = 0; r < rounds; ++r) {
    const bool new_first = r % 2;
    double a, b, c, d;
    a = now();
    if (new_first) moe_new(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_new.data());
    else moe_old(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_old.data());
    b = now();
    if (new_first) moe_old(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_old.data());
    else moe_new(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(), wts.data(), out_new.data());
    c = now();
    if (!prefill) sink += read_probe(spans, lens);
    d = now();
    const double to = new_first ? c - b : b - a, tn = new_first ? b - a : c - b;
    t_old.push_back(to / L * 1e3);
    t_new.push_back(tn / L * 1e3);
    t_read.push_back((d - c) / L * 1e3);
    ratio.push_back(tn / to);
  }
  double maxdiff = 0, maxabs = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    maxdiff = std::max(maxdiff, (double)std::fabs(out_old[i] - out_new[i]));
    maxabs = std::max(maxabs, (double)std::fabs(out_old[i]));
  }
  const double mo = median(t_old), mn = median(t_new), mr = median(t_read);
  std::printf("median ms per layer: old %.3f  new %.3f  new/old %.3f (median of per-round ratios)",
              mo, mn, median(ratio));
  if (prefill)
    std::printf("  GMAC/s old %.1f new %.1f\n", macs / L / (mo * 1e-3) / 1e9, macs / L / (mn * 1e-3) / 1e9);
  else
    std::printf("  read %.3f  (GB/s: old %.1f new %.1f read %.1f; old/read %.2f new/read %.2f)\n", mr,
                bytes / L / (mo * 1e-3) / 1e9, bytes / L / (mn * 1e-3) / 1e9, bytes / L / (mr * 1e-3) / 1e9,
                mo / mr, mn / mr);
  std::printf("max |old - new| %.3g (max |old| %.3g)  checksum %g\n", maxdiff, maxabs, sink);
}
