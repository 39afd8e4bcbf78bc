// One 32-row DeepSeek-V2-Lite 200M decode step's routed experts (64 x 3 x 512 x 224 float32,
// 32 tokens x top-6 random distinct experts), L layers of distinct weights cycled so that the
// working set exceeds the LLC. Compares, in one process and alternated:
//   kernel  fused_moe_kernel.h's plan + expert_phases (the current decode path)
//   hot     the same calls with every block pointed at expert 0 (weights L2/L1-resident): the
//           FMA / load / hsum work alone
//   read    a read-only pass over the same experts' bytes in the same order (+4 KiB prefetch)
//   seq<NB> a variant: the experts' weight rows read in address order NB at a time, all rows of
//           the expert against each, prefetch PF bytes ahead in the linear stream
// SEQ=1 adds the seq variants (2 MiB set); ONLY=mode [SET=0|1] runs one mode (-1: read) for perf.
// Build: g++ -O3 -march=native -fopenmp -std=c++17 -Ipagedllm/native/kernels/csrc \
//          docs/results/moe_decode_2026-12-07b/replay.cpp -o /tmp/moedec-replay
#include "fused_moe_kernel.h"
#include <ctime>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
#include <sys/mman.h>
#include <cstdlib>
using namespace pagedllm;

// Thread CPU seconds: the other sessions' jobs deschedule this thread at random.
static double now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static float read_probe(const std::vector<const float*>& spans, const std::vector<int64_t>& lens) {
  constexpr int PF = 4096;
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
  return hsum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

#ifndef PF
#define PF 1024
#endif
// y[i, j] = x[i] . w[j] for i < MB, j < n: NB weight rows at a time in address order, two
// accumulators per (row, weight row) over alternate 16-value halves of each 32-value step.
template <int MB, int NB>
static void seq_rows(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n, float* y,
                     int64_t ldy, const float* pf_end) {
  int64_t j = 0;
  for (; j + NB <= n; j += NB) {
    const float* wj = w + j * K;
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < NB; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      for (int r = 0; r < NB; ++r) {
        const char* pf = reinterpret_cast<const char*>(wj + r * K + k) + PF;
        _mm_prefetch(pf, _MM_HINT_T0);
      }
      __m512 wv[NB];
      for (int r = 0; r < NB; ++r) wv[r] = _mm512_loadu_ps(wj + r * K + k);
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
        for (int r = 0; r < NB; ++r) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < NB; ++r) y[i * ldy + j + r] = hsum(acc[i][r]);
  }
  for (; j < n; ++j) seq_rows<MB, 1>(x, ldx, w + j * K, K, 1, y + j, ldy, pf_end);
}

template <int NB>
static void seq_gemm(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t K,
                     int64_t n, float* y, int64_t ldy) {
  switch (rows) {
#define C(R) case R: return seq_rows<R, (R <= 3 ? NB : (NB > 2 ? NB / 2 : 1))>(x, ldx, w, K, n, y, ldy, nullptr);
    C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8) C(9) C(10) C(11) C(12)
#undef C
    default: moe::tile_gemm(x, ldx, rows, w, K, n, y, ldy);
  }
}

// expert_phases' dot-product path with seq_gemm (one thread).
template <int NB>
static void seq_phases(const float* hidden, const float* w13, const float* w2,
                       moe::Plan<float>& p) {
  const int64_t H = p.H, I = p.I;
  for (const moe::RowBlock& b : p.blocks)
    for (int64_t r = b.r0; r < b.r1; ++r)
      moe::stage_row(hidden + p.token_of_row[r] * H, H, p.xs + (b.s0 + r - b.r0) * H);
  float* gate = p.scratch;
  float* up = p.scratch + (p.scratch_size - p.wide_size) / 2;
  for (const moe::RowBlock& b : p.blocks) {
    const int64_t rows = b.r1 - b.r0;
    const float* wg = w13 + b.expert * 2 * I * H;
    seq_gemm<NB>(p.xs + b.s0 * H, H, rows, wg, H, I, gate, I);
    seq_gemm<NB>(p.xs + b.s0 * H, H, rows, wg + I * H, H, I, up, I);
    for (int64_t r = 0; r < rows; ++r)
      moe::silu_mul<float>(gate + r * I, up + r * I, I, p.act + (b.s0 + r) * I);
  }
  for (const moe::RowBlock& b : p.blocks)
    seq_gemm<NB>(p.act + b.s0 * I, I, b.r1 - b.r0, w2 + b.expert * H * I, I, H,
                 p.ys + b.r0 * H, H);
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t E = 64, H = 512, I = 224, K = 6;
  const int L = 7, T = 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 0.05f);
  // set 0: 4 KiB pages (malloc), set 1: 2 MiB-aligned with MADV_HUGEPAGE before first touch
  struct Span { float* p; float* data() const { return p; } };
  std::vector<Span> w13s[2], w2s[2];
  const size_t n13 = E * 2 * I * H, n2 = E * H * I;
  for (int set = 0; set < 2; ++set)
    for (int l = 0; l < L; ++l) {
      float* a; float* b;
      if (set == 0) { a = (float*)std::malloc(n13 * 4); b = (float*)std::malloc(n2 * 4); }
      else {
        const size_t A = 2 << 20;
        a = (float*)std::aligned_alloc(A, (n13 * 4 + A - 1) / A * A);
        b = (float*)std::aligned_alloc(A, (n2 * 4 + A - 1) / A * A);
        madvise(a, (n13 * 4 + A - 1) / A * A, MADV_HUGEPAGE);
        madvise(b, (n2 * 4 + A - 1) / A * A, MADV_HUGEPAGE);
      }
      w13s[set].push_back({a}); w2s[set].push_back({b});
    }
  for (int l = 0; l < L; ++l) {
    for (size_t i = 0; i < n13; ++i) w13s[0][l].p[i] = w13s[1][l].p[i] = nd(rng);
    for (size_t i = 0; i < n2; ++i) w2s[0][l].p[i] = w2s[1][l].p[i] = nd(rng);
  }
  int set = 0;
#define w13 w13s[set]
#define w2 w2s[set]
  std::vector<float> x(T * H), out(T * H), out2(T * H);
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
  std::vector<const float*> spans[2];
  std::vector<int64_t> lens;
  double bytes = 0;
  for (set = 0; set < 2; ++set)
    for (int l = 0; l < L; ++l) {
      std::vector<char> on(E, 0);
      for (int64_t e : ids[l]) on[e] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (on[e]) {
          spans[set].push_back(w13[l].data() + e * 2 * I * H);
          if (set == 0) lens.push_back(2 * I * H), bytes += 2.0 * I * H * 4;
        }
      for (int64_t e = 0; e < E; ++e)
        if (on[e]) {
          spans[set].push_back(w2[l].data() + e * H * I);
          if (set == 0) lens.push_back(H * I), bytes += 1.0 * I * H * 4;
        }
    }
  const int64_t chunks = (H + moe::kCombineChunk - 1) / moe::kCombineChunk;
  // mode 0 kernel, 1 hot, 2.. seq variants
  auto run = [&](int mode, float* o) {
    for (int l = 0; l < L; ++l) {
      moe::Plan<float> p;
      moe::plan<float, float>(ids[l].data(), T, K, E, H, I, 1, p);
      if (mode == 1)
        for (auto& b : p.blocks) b.expert = 0;
#pragma omp parallel num_threads(1)
      {
        if (mode <= 1) moe::expert_phases<float, float>(x.data(), w13[l].data(), w2[l].data(), p);
        else if (mode == 2) seq_phases<1>(x.data(), w13[l].data(), w2[l].data(), p);
        else if (mode == 3) seq_phases<2>(x.data(), w13[l].data(), w2[l].data(), p);
        else seq_phases<4>(x.data(), w13[l].data(), w2[l].data(), p);
#pragma omp for
        for (int64_t item = 0; item < T * chunks; ++item) {
          const int64_t t = item / chunks, c0 = (item % chunks) * moe::kCombineChunk;
          const int64_t c1 = std::min(H, c0 + moe::kCombineChunk);
          float acc[moe::kCombineChunk];
          moe::routed_sum(p, wts.data(), K, t, c0, c1, acc);
          for (int64_t c = c0; c < c1; ++c) o[t * H + c] = acc[c - c0];
        }
      }
    }
  };
  std::printf("%.1f MB of active experts per layer\n", bytes / 1e6 / L);
  {
    long long kb = 0;
    FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (f && std::fgets(line, sizeof line, f))
      if (std::strncmp(line, "AnonHugePages:", 14) == 0) kb = std::atoll(line + 14);
    if (f) std::fclose(f);
    std::printf("AnonHugePages of the process: %lld MB\n", kb / 1024);
  }
  float sink = 0;
  const char* only = std::getenv("ONLY");   // perf: one mode only
  if (only) {
    const int mode = std::atoi(only);
    set = std::getenv("SET") ? std::atoi(std::getenv("SET")) : 0;
    for (int r = 0; r < rounds; ++r)
      if (mode < 0) sink += read_probe(spans[set], lens); else run(mode, out.data());
    std::printf("sink %g %g\n", sink, out[3]);
    return 0;
  }
  // Each round runs the 4 KiB set and the 2 MiB set in turn, in alternating order.
  for (int r = 0; r < rounds; ++r) {
    double k[2], rd[2], hot = 0;
    for (int q = 0; q < 2; ++q) {
      set = (r + q) % 2;
      const double t0 = now();
      run(0, set == 0 ? out.data() : out2.data());
      const double t1 = now();
      sink += read_probe(spans[set], lens);
      const double t2 = now();
      k[set] = (t1 - t0) * 1e3 / L;
      rd[set] = (t2 - t1) * 1e3 / L;
      if (set == 0) {
        run(1, out2.data());
        hot = (now() - t2) * 1e3 / L;
      }
    }
    if (std::getenv("SEQ")) {   // the row-order variants on the 2 MiB set
      set = 1;
      double ts[4];
      ts[0] = now();
      for (int mode = 2; mode <= 4; ++mode) {
        run(mode, out2.data());
        ts[mode - 1] = now();
      }
      std::printf("2M: seq1 %.3f seq2 %.3f seq4 %.3f  ", (ts[1] - ts[0]) * 1e3 / L,
                  (ts[2] - ts[1]) * 1e3 / L, (ts[3] - ts[2]) * 1e3 / L);
    }
    std::printf("%s first  4K: kernel %.3f read %.3f (%.1f GB/s) hot %.3f | 2M: kernel %.3f read %.3f"
                "  ms/layer, thread CPU\n", r % 2 ? "2M" : "4K", k[0], rd[0],
                bytes / L / rd[0] / 1e6, hot, k[1], rd[1]);
  }
  set = 0;
  run(0, out.data());
  set = 1;
  run(0, out2.data());
  double md = 0;
  for (int64_t i = 0; i < T * H; ++i) md = std::max<double>(md, std::fabs(out[i] - out2[i]));
  std::printf("max |kernel 4K - kernel 2M| %g  sink %g\n", md, sink);
}
