// The delta rule's token update on one 64 x 64 state in L1: the old form (delta_token) and the
// two-pass form (delta_token_fused, 2 and 4 row groups), thread CPU per token. Build from the
// repository root with the generated ABI header in $HDR:
//   g++ -O3 -march=native -fopenmp -std=c++17 -I$HDR -Ipagedllm/native/kernels/csrc \
//       docs/results/gdn_b32_2026-12-07/micro_delta.cpp -o micro_delta
#include <time.h>

#include <cmath>
#include <cstdio>

#include "cpu_state_scan.cpp"

static double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main() {
  const int dk = 64, N = 200000;
  alignas(64) static float S[4096], q[64], k[64], v[64], o[64];
  for (int i = 0; i < 4096; ++i) S[i] = 0.01f;
  for (int i = 0; i < 64; ++i) {
    q[i] = 0.1f * std::sin(i);
    k[i] = 0.1f * std::cos(i);
    v[i] = 0.5f;
  }
  for (int rep = 0; rep < 3; ++rep) {
    double t = thread_seconds();
    for (int n = 0; n < N; ++n) delta_token<64>(S, q, k, v, 0.99f, 0.5f, dk, o);
    const double a = (thread_seconds() - t) / N * 1e9;
    t = thread_seconds();
    for (int n = 0; n < N; ++n) delta_token_fused<64, 2>(S, q, k, v, 0.99f, 0.5f, 0.1f, dk, o);
    const double b = (thread_seconds() - t) / N * 1e9;
    t = thread_seconds();
    for (int n = 0; n < N; ++n) delta_token_fused<64, 4>(S, q, k, v, 0.99f, 0.5f, 0.1f, dk, o);
    const double c = (thread_seconds() - t) / N * 1e9;
    printf("ns per token: old %.1f, two-pass G2 %.1f, G4 %.1f (o[0] %g)\n", a, b, c, o[0]);
  }
}
