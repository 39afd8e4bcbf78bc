// A per-call tally of the packed GEMM (packed_gemm.h) inside whole runs, for measurement only:
// compiled in when the library is built with -DPAGEDLLM_GEMM_TALLY (e.g. CXX naming a wrapper
// that adds it; CXX is part of the build's cache key), absent otherwise.
//
// Each call made on OpenMP thread 0 is timed from entry to the end of its work-sharing loop
// (thread CPU ns), together with the time until its first work item was done (the start-up
// share: the first panels' wait on memory) and the gap since the previous call ended (the
// other work between two GEMMs). Calls are keyed by (previous call's N x K, M x N x K, weight
// bytes per element), so the same shape after different work (GA q_proj after a shared
// expert's down_proj, a shared gate_up after the router) tallies apart. At process exit the
// tally is printed to stderr, one line per key:
//   gemm_tally M N K wbytes prevN prevK calls total_ns first_ns gap_ns min_ns
#pragma once

#if defined(PAGEDLLM_GEMM_TALLY)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <ctime>
#include <tuple>

namespace pagedllm {
namespace packed {

struct TallyEntry {
  int64_t calls = 0, total_ns = 0, first_ns = 0, gap_ns = 0, min_ns = INT64_MAX;
};

struct Tally {
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
  std::mutex mu;
  std::map<Key, TallyEntry> entries;
  int64_t prev_n = 0, prev_k = 0, prev_end = 0;

  ~Tally() {
    for (const auto& [key, e] : entries) {
      const auto [m, n, k, wb, pn, pk] = key;
      std::fprintf(stderr, "gemm_tally %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld\n", (long)m,
                   (long)n, (long)k, (long)wb, (long)pn, (long)pk, (long)e.calls,
                   (long)e.total_ns, (long)e.first_ns, (long)e.gap_ns, (long)e.min_ns);
    }
  }
};

inline Tally& tally() {
  static Tally t;
  return t;
}

// The calling thread's CPU time in ns (time descheduled by other processes does not count).
inline int64_t tally_now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Whether the calls now running repeat the previous one (PAGEDLLM_GEMM_TALLY_TWICE).
inline bool& tally_repeat() {
  thread_local bool repeat = false;
  return repeat;
}

// One call: its start, first-item end and end times (ns), shape and weight element size.
inline void tally_record(int64_t start, int64_t first, int64_t end, int64_t M, int64_t N,
                         int64_t K, int64_t wbytes) {
  Tally& t = tally();
  std::lock_guard<std::mutex> lock(t.mu);
  TallyEntry& e = t.entries[{M, N, K, wbytes + (tally_repeat() ? 100 : 0), t.prev_n, t.prev_k}];
  ++e.calls;
  e.total_ns += end - start;
  e.min_ns = std::min(e.min_ns, end - start);
  e.first_ns += first - start;
  e.gap_ns += t.prev_end > 0 ? start - t.prev_end : 0;
  t.prev_n = N;
  t.prev_k = K;
  t.prev_end = end;
}

}  // namespace packed
}  // namespace pagedllm
#endif
