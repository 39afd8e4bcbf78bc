// A/B of two builds of the routed-experts kernel in one process (moe_tu.cpp from two source
// trees), alternated round by round: a 32-row decode step of DeepSeek-V2-Lite 200M (64 x 3 x 512
// x 224 float32, top-6 random distinct experts per token) over L = 7 layers of distinct weights
// on 2 MiB pages (MADV_HUGEPAGE, as the engine places them), streamed and hot (every block on
// expert 0: the work without the stream). Thread CPU time, medians. Build and run: ab.sh.
// usage: ab [rounds]
#include <sys/mman.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

#define DECL(name)                                                                          \
  extern "C" void name(int L, const float* const* w13, const float* const* w2,              \
                       const int64_t* const* ids, int64_t T, int64_t K, int64_t E, int64_t H,   \
                       int64_t I, const float* x, const float* wts, float* out, int hot);
DECL(moe_old)
DECL(moe_new)

static double now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static float* huge_alloc(size_t n) {
  const size_t A = 2 << 20, bytes = (n * 4 + A - 1) / A * A;
  float* p = static_cast<float*>(std::aligned_alloc(A, bytes));
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 11;
  const int64_t E = 64, H = 512, I = 224, K = 6, T = 32;
  const int L = 7;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<const float*> p13(L), p2(L);
  for (int l = 0; l < L; ++l) {
    float* a = huge_alloc(E * 2 * I * H);
    float* b = huge_alloc(E * H * I);
    for (int64_t i = 0; i < E * 2 * I * H; ++i) a[i] = nd(rng) * 0.04f;
    for (int64_t i = 0; i < E * H * I; ++i) b[i] = nd(rng) * 0.06f;
    p13[l] = a;
    p2[l] = b;
  }
  std::vector<float> x(T * H), o_old(T * H), o_new(T * H), wts(T * K, 1.f / K);
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
  auto run = [&](bool fresh, int hot, float* out) {
    const double t0 = now();
    (fresh ? moe_new : moe_old)(L, p13.data(), p2.data(), pids.data(), T, K, E, H, I, x.data(),
                                wts.data(), out, hot);
    return (now() - t0) * 1e3 / L;
  };
  run(false, 0, o_old.data());
  run(true, 0, o_new.data());
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    diff = std::max<double>(diff, std::fabs(o_old[i] - o_new[i]));
    scale = std::max<double>(scale, std::fabs(o_old[i]));
  }
  std::vector<double> so, sn, ho, hn, rs, rh;
  for (int r = 0; r < rounds; ++r) {
    double a, b, c, d;
    if (r % 2) {
      b = run(true, 0, o_new.data()); a = run(false, 0, o_old.data());
      d = run(true, 1, o_new.data()); c = run(false, 1, o_old.data());
    } else {
      a = run(false, 0, o_old.data()); b = run(true, 0, o_new.data());
      c = run(false, 1, o_old.data()); d = run(true, 1, o_new.data());
    }
    so.push_back(a); sn.push_back(b); ho.push_back(c); hn.push_back(d);
    rs.push_back(b / a); rh.push_back(d / c);
  }
  std::printf("ms per layer (thread CPU), median of %d: streamed old %.3f new %.3f (new/old %.3f)"
              "  hot old %.3f new %.3f (new/old %.3f)  max |old - new| %.2e of max |out| %.2e\n",
              rounds, median(so), median(sn), median(rs), median(ho), median(hn), median(rh), diff,
              scale);
}
