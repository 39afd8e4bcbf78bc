// Packed-B GEMM: y = x @ w^T (+ bias) with w pre-packed once (at load) into column panels, and an
// outer-product register-blocked micro-kernel (the GotoBLAS / BLIS scheme: Goto & van de Geijn,
// "Anatomy of High-Performance Matrix Multiplication", TOMS 2008; Van Zee & van de Geijn, BLIS,
// TOMS 2015). Used by cpu_linear.cpp (module path) and cpu_decoder.cpp (fused decoder layer).
//
// Why: linear_kernel.h computes each output as a K-long dot product (a horizontal sum per
// output, two loads per FMA); for 32+ rows that runs far below the FMA peak. Here each step of k
// loads one 16-wide row of a weight panel, broadcasts x values and FMAs an MR x 16*NP tile of
// accumulators held in registers: one load per MR FMAs.
//
// Packed layout of a weight w [N, K] (the same element count, so it replaces the tensor's
// storage; K a multiple of 8):
//
//   panels p = 0 .. N/16 - 1 (columns n = 16p .. 16p+15), each K * 16 elements at p * 16 * K:
//     plain:  [K][16]        element (n, k) at p*16*K + k*16 + (n - 16p)
//     pairs:  [K/2][16][2]   element (n, k) at p*16*K + (k/2)*32 + (n - 16p)*2 + k%2
//   a tail panel of nt = N % 16 columns at (N/16)*16*K, [K][nt] or [K/2][nt][2] likewise.
//
// "pairs" is used for bfloat16 weights when the library is built with AVX512_BF16: a panel row
// pair is one zmm of bf16 pairs. Its x operand is bfloat16 too, so float32 activations are
// rounded to bfloat16 (nearest even) first: on that path the products are those of bf16-rounded
// x (the module path of a bf16 model rounds its activations to bf16 anyway; the fused decoder's
// float32 intermediates lose their extra precision here). Two micro-kernels read pair panels
// and give the same bits (see `Kernel`): `vdpbf16ps`, and a widening form (each zmm split into
// its even-k and odd-k float32 vectors by a shift and an AND, two FMAs per x pair in the
// instruction's order). Which one runs is measured once per process (`pairs_form`: the widening
// form where float32 FMAs multiply-add at least 1.3x as many values per second as vdpbf16ps;
// on the Xeon this was written on, vdpbf16ps has half the FMAs' rate). The widening form's
// shift and AND share the FMAs' ports, so where a row block passes over a panel pair several
// times (12 + 12 + 8 rows at 32) only the first pass widens, storing the float32 panels for the
// later passes (`micro_split`; 32-row bf16 GEMMs 66-69 -> 74-77 GMAC/s, docs/benchmarks.md,
// "Qwen3-Next in bfloat16 at batch 32"). Every other case
// computes in float32 with x as given (bf16 weights widened by a 16-bit shift), so fp32 results
// match a float32 GEMM up to summation order.
//
// Register tiles: AVX-512 12x32 (24 zmm accumulators), AVX2 6x16 (12 ymm), portable 4x16.
// While an item's x rows hold at most kMaxWholeK values, each panel is read over the whole of
// K in one pass (one contiguous stream per panel, the accumulators in registers throughout);
// larger row blocks cut K into blocks of kKC so that a block of x rows and of a panel stay in
// L1/L2, with partial sums in a per-item float32 tile. (Cutting K at every size slowed both a
// bf16 GEMV chain's weight stream from DRAM and 32-row GEMMs: docs/benchmarks.md,
// "Measurements behind choices in the code".) Each output sums its k in the same order
// whatever the row count (k ascending; pairs odd then even), so a row's result does not depend
// on the rows beside it.
//
// Prefetch (AVX-512): the register tiles of a row block pass over the same two panels several
// times (12 + 12 + 8 rows at 32), the first pass reading them from L3 / DRAM; the micro-kernel
// calls prefetch the next two panels into L2 meanwhile, each call its own share of their lines,
// so the weight arrives as one steady stream instead of a burst per first pass (32 x 32000 x
// 512 float32: 38.9 -> 55.6 GMAC/s on a loaded host; docs/benchmarks.md, "Packed GEMM at 32
// rows and in prefill"). Single-row items do not prefetch. After a weight's last panels
// there is nothing of it left to fetch: there the calls prefetch the first two panels of the
// weight the caller reads next (`NextWeight`, e.g. GDN in_proj -> out_proj, attention q -> k
// -> v -> o, MoE router -> shared gate_up -> down), or nothing, where they used to prefetch the
// bytes past the weight's end (docs/benchmarks.md, "The decode step's dense GEMMs in place").
// A per-call tally of these GEMMs inside whole runs is compiled in with -DPAGEDLLM_GEMM_TALLY
// (gemm_tally.h).
//
// Threads share (row block, panel group) items through an orphaned `omp for` (as
// linear_kernel.h), so the fused decoder can call it inside its parallel region.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_vec.h"
#include "gemm_tally.h"
#include "linear_kernel.h"

#if defined(PAGEDLLM_AVX512) && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512_BF16 1
#endif

namespace pagedllm {
namespace packed {

constexpr int64_t kNR = 16;         // columns per panel
constexpr int64_t kKC = 256;        // k per block when K is cut (even)
constexpr int64_t kMaxWholeK = 48 * 1024;   // x values of a row block read over the whole K
constexpr int64_t kRowBlock = 48;   // rows per work item: a multiple of 12, 6 and 4
constexpr int64_t kMaxGroup = 8;    // panels per work item

// Software prefetch of the next panels (into L2) during a micro-kernel call: from `line` on,
// one 64-byte line per panel every `every` steps of k (a panel row of 16 floats or 16 bf16
// pairs is one line), the NP panels `panel_bytes` apart; null `line`: none.
struct Prefetch {
  const char* line;
  int64_t every;
  int64_t panel_bytes;
  int64_t countdown = 1;

  // One step of k: every `every` steps, the current line of the NP panels (prefetcht1), then
  // the next line.
  template <int NP>
  void step() {
    if (line == nullptr || --countdown != 0) return;
    countdown = every;
    for (int p = 0; p < NP; ++p) __builtin_prefetch(line + p * panel_bytes, 0, 2);
    line += 64;
  }
};

// The packed weight a caller will read next (its panels, and its K), so that a GEMM's last
// panels prefetch that weight's first two panels instead of the bytes past their own end.
// Null `w`: none (nothing is prefetched past the weight).
template <typename T>
struct NextWeight {
  const T* w = nullptr;
  int64_t K = 0;
};

// Whether weights of type T are packed as k pairs (see the header).
template <typename T>
constexpr bool pairs() {
#ifdef PAGEDLLM_AVX512_BF16
  return std::is_same_v<T, uint16_t>;
#else
  return false;
#endif
}

// The element index of w[n][k] in the packed buffer of a [N, K] weight.
template <typename T>
inline int64_t packed_index(int64_t n, int64_t k, int64_t N, int64_t K) {
  const int64_t p = n / kNR, full = N / kNR;
  const int64_t width = p < full ? kNR : N - full * kNR;
  const int64_t j = n - p * kNR, base = p * kNR * K;
  if constexpr (pairs<T>())
    return base + (k / 2) * width * 2 + j * 2 + (k & 1);
  else
    return base + k * width + j;
}

// out (packed) <- w [N, K] row-major (pack) or the reverse (unpack); out and w do not overlap.
template <typename T>
void pack(const T* w, int64_t N, int64_t K, T* out) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) out[packed_index<T>(n, k, N, K)] = w[n * K + k];
}

template <typename T>
void unpack(const T* packed, int64_t N, int64_t K, T* w) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w[n * K + k] = packed[packed_index<T>(n, k, N, K)];
}

// out[i] = row ids[i] of the [N, K] weight that `packed` holds, for i < n (ids in [0, N)): the
// embedding lookup of a tied LM head's packed weight. A row's values lie one panel row apart
// (64 bytes for float32), so a lookup reads a whole panel's cache lines: cheap for the few
// tokens of a step.
template <typename T>
void gather_rows(const T* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n, T* out) {
#pragma omp parallel for if (n >= 64)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < K; ++k) out[i * K + k] = packed[packed_index<T>(ids[i], k, N, K)];
}

// The micro-kernel that reads a weight's panels: float32 FMAs on plain panels (`kFloat`, x in
// float32), and on bf16 pair panels either `vdpbf16ps` (`kDot`, x as bf16 pairs) or the
// widening form (`kWiden`: each zmm of 16 pairs split into its even-k and odd-k float32
// vectors, two FMAs per x pair, x as float32 holding bf16-rounded values). kWiden computes
// exactly what vdpbf16ps computes, acc' = (acc + x_odd*w_odd) + x_even*w_even per pair with
// exact products (a bf16 x bf16 product fits float32's 24-bit significand) and one rounding
// per add (Intel SDM, VDPBF16PS pseudo-code), so the two give the same bits except where
// vdpbf16ps flushes a denormal input, product or sum to zero (it also rounds to nearest even
// whatever MXCSR says, the FMAs as MXCSR says: nearest even by default); which one runs is a
// speed choice (`pairs_form`).
enum class Kernel { kFloat, kDot, kWiden };

// The type x is read in by kernel F.
template <Kernel F>
using XOf = std::conditional_t<F == Kernel::kDot, uint16_t, float>;

// The element type of the staging buffer `linear_tiles` accepts for weights T: bf16 for pair
// panels (x rounded to bf16 once, whichever form then reads it), else float (unused).
template <typename T>
using XStage = std::conditional_t<pairs<T>(), uint16_t, float>;

// ---------------------------------------------------------------- micro-kernels
// Each accumulates rows [0, MR) of x (row stride ldx, kc values) times NP full panels (panel p
// at w + p * ps, already offset to the block's first k) into the float32 tile c (row stride
// ldc): c = (accumulate ? c : 0) + x w^T.

#if defined(PAGEDLLM_AVX512)
constexpr int kMaxMR = 12;
constexpr int kNP = 2;

// The MR x NP tile's accumulators: c's values (accumulate) or zeros; and their store to c.
template <int MR, int NP>
inline void load_tile(__m512 (&acc)[MR][NP], const float* c, int64_t ldc, bool accumulate) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p)
      acc[i][p] = accumulate ? _mm512_loadu_ps(c + i * ldc + p * kNR) : _mm512_setzero_ps();
}

template <int MR, int NP>
inline void store_tile(__m512 (&acc)[MR][NP], float* c, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(c + i * ldc + p * kNR, acc[i][p]);
}

template <int MR, int NP, typename T>
inline void micro(const float* x, int64_t ldx, const T* w, int64_t ps, int64_t kc, float* c,
                  int64_t ldc, bool accumulate, Prefetch pf) {
  __m512 acc[MR][NP];
  load_tile(acc, c, ldc, accumulate);
  for (int64_t k = 0; k < kc; ++k) {
    __m512 wv[NP];
    pf.step<NP>();
    for (int p = 0; p < NP; ++p) wv[p] = load16(w + p * ps + k * kNR);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xv, wv[p], acc[i][p]);
    }
  }
  store_tile(acc, c, ldc);
}

// bf16 pair panels widened to float32 (see `Kernel`): x float32 holding bf16 values; kc even.
// With `save` (not null) the widened panels are also written there, [NP][kc / 2][odd 16 |
// even 16] floats (panel p at save + p * kc * 16), for `micro_split` to read in the later
// passes of the same rows block over these panels.
template <int MR, int NP, bool kSave>
inline void micro_widen(const float* x, int64_t ldx, const uint16_t* w, int64_t ps,
                        int64_t kc, float* c, int64_t ldc, bool accumulate, Prefetch pf,
                        float* save) {
  __m512 acc[MR][NP];
  load_tile(acc, c, ldc, accumulate);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < kc; k += 2) {
    __m512 even[NP], odd[NP];
    pf.step<NP>();
    for (int p = 0; p < NP; ++p) {
      const __m512i v = _mm512_loadu_si512(w + p * ps + k * kNR);
      even[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[p] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      if constexpr (kSave) {
        _mm512_store_ps(save + p * kc * kNR + k * kNR, odd[p]);
        _mm512_store_ps(save + p * kc * kNR + k * kNR + kNR, even[p]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xo = _mm512_set1_ps(x[i * ldx + k + 1]);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xo, odd[p], acc[i][p]);
      const __m512 xe = _mm512_set1_ps(x[i * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xe, even[p], acc[i][p]);
    }
  }
  store_tile(acc, c, ldc);
}

// micro_widen on panels it already widened (`wf`: its `save` layout): the same FMAs in the
// same order, so the same bits, without the shift and AND per panel row pair. Those two
// vector operations share the FMAs' two ports; at 32 rows (three passes over each panel pair)
// widening once instead of three times leaves 2 of them per 64 FMAs instead of 6.
template <int MR, int NP>
inline void micro_split(const float* x, int64_t ldx, const float* wf, int64_t kc, float* c,
                        int64_t ldc, bool accumulate, Prefetch pf, int64_t ps) {
  __m512 acc[MR][NP];
  load_tile(acc, c, ldc, accumulate);
  for (int64_t k = 0; k < kc; k += 2) {
    __m512 even[NP], odd[NP];
    pf.step<NP>();
    for (int p = 0; p < NP; ++p) {
      odd[p] = _mm512_load_ps(wf + p * kc * kNR + k * kNR);
      even[p] = _mm512_load_ps(wf + p * kc * kNR + k * kNR + kNR);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 xo = _mm512_set1_ps(x[i * ldx + k + 1]);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xo, odd[p], acc[i][p]);
      const __m512 xe = _mm512_set1_ps(x[i * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_fmadd_ps(xe, even[p], acc[i][p]);
    }
  }
  store_tile(acc, c, ldc);
}

#if defined(PAGEDLLM_AVX512_BF16)
// bf16 x (pairs read as one 32-bit value) times bf16 pair panels, vdpbf16ps; kc even.
template <int MR, int NP>
inline void micro_dot(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ps,
                      int64_t kc, float* c, int64_t ldc, bool accumulate, Prefetch pf) {
  __m512 acc[MR][NP];
  load_tile(acc, c, ldc, accumulate);
  for (int64_t k = 0; k < kc; k += 2) {
    __m512bh wv[NP];
    pf.step<NP>();
    for (int p = 0; p < NP; ++p)
      wv[p] = (__m512bh)_mm512_loadu_si512(w + p * ps + k * kNR);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], xv, wv[p]);
    }
  }
  store_tile(acc, c, ldc);
}
#endif

#elif defined(PAGEDLLM_AVX2)
constexpr int kMaxMR = 6;
constexpr int kNP = 1;

template <int MR, int NP, typename T>
inline void micro(const float* x, int64_t ldx, const T* w, int64_t ps, int64_t kc, float* c,
                  int64_t ldc, bool accumulate, Prefetch pf) {
  constexpr int V = 2 * NP;  // ymm vectors per row of the tile
  __m256 acc[MR][V];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < V; ++v)
      acc[i][v] = accumulate ? _mm256_loadu_ps(c + i * ldc + v * 8) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load8(w + (v / 2) * ps + k * kNR + (v % 2) * 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_fmadd_ps(xv, wv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(c + i * ldc + v * 8, acc[i][v]);
}

#else
constexpr int kMaxMR = 4;
constexpr int kNP = 1;

template <int MR, int NP, typename T>
inline void micro(const float* x, int64_t ldx, const T* w, int64_t ps, int64_t kc, float* c,
                  int64_t ldc, bool accumulate, Prefetch pf) {
  float acc[MR][NP * kNR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP * kNR; ++j) acc[i][j] = accumulate ? c[i * ldc + j] : 0.f;
  for (int64_t k = 0; k < kc; ++k)
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < kNR; ++j) {
        const float wv = to_float(w[p * ps + k * kNR + j]);
        for (int i = 0; i < MR; ++i) acc[i][p * kNR + j] += x[i * ldx + k] * wv;
      }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP * kNR; ++j) c[i * ldc + j] = acc[i][j];
}
#endif

// Kernel F on an MR x NP tile (x in F's input type, see `Kernel`). kWiden only: `widened`
// (not null) holds this tile's panels widened by an earlier call (`micro_split` reads them),
// else `save` (not null) receives them (`micro_widen`).
template <Kernel F, int MR, int NP, typename T>
inline void micro_for(const XOf<F>* x, int64_t ldx, const T* w, int64_t ps, int64_t kc,
                      float* c, int64_t ldc, bool accumulate, Prefetch pf,
                      float* save = nullptr, const float* widened = nullptr) {
  if constexpr (F == Kernel::kFloat) {
    micro<MR, NP>(x, ldx, w, ps, kc, c, ldc, accumulate, pf);
#if defined(PAGEDLLM_AVX512_BF16)
  } else if constexpr (F == Kernel::kWiden) {
    if (widened != nullptr)
      micro_split<MR, NP>(x, ldx, widened, kc, c, ldc, accumulate, pf, ps);
    else if (save != nullptr)
      micro_widen<MR, NP, true>(x, ldx, w, ps, kc, c, ldc, accumulate, pf, save);
    else
      micro_widen<MR, NP, false>(x, ldx, w, ps, kc, c, ldc, accumulate, pf, nullptr);
  } else {
    micro_dot<MR, NP>(x, ldx, w, ps, kc, c, ldc, accumulate, pf);
#endif
  }
}

// The micro-kernel calls `panel_rows` makes for `rows` rows.
inline int64_t num_calls(int64_t rows) {
  int64_t calls = rows / kMaxMR, rest = rows % kMaxMR;
  for (int64_t tile : {8, 4, 2, 1})
    if (tile < kMaxMR && rest >= tile) {
      ++calls;
      rest -= tile;
    }
  return calls;
}

// What one `panel_rows` call prefetches: `lines` lines of each of the NP panels that start at
// `first`, `panel_bytes` apart (null `first`: nothing).
struct PrefetchTarget {
  const char* first = nullptr;
  int64_t lines = 0;
  int64_t panel_bytes = 0;
};

// `rows` rows of x against NP panels: the largest register tiles first, then 8/4/2/1 rows.
template <Kernel F, int NP, typename T>
inline void panel_rows(const XOf<F>* x, int64_t ldx, int64_t rows, const T* w, int64_t ps,
                       int64_t kc, float* c, int64_t ldc, bool accumulate,
                       PrefetchTarget next) {
  // The next panels' lines (`next`) are shared out among the micro-kernel calls here (`calls`
  // passes over these panels), each prefetching its own part, one line per panel every
  // `every` steps of k: a steady stream rather than a burst per pass. Not for a single row: a
  // GEMV streams at the bandwidth bound, where the hardware prefetchers alone were faster
  // (docs/benchmarks.md, "Packed GEMM at 32 rows and in prefill").
  if (rows < 2 || next.lines <= 0) next.first = nullptr;
  const int64_t calls = num_calls(rows);
  const int64_t steps = F == Kernel::kFloat ? kc : kc / 2;   // micro-kernel steps per call
  const int64_t every = std::max<int64_t>(1, steps * calls / std::max<int64_t>(1, next.lines));
  int64_t call = 0;
  auto prefetch = [&]() {
    const char* start = next.first == nullptr ? nullptr
                                              : next.first + call * next.lines / calls * 64;
    ++call;
    return Prefetch{start, every, next.panel_bytes};
  };
  // kWiden with several passes: the first widens the panels into `widened` as it goes, the
  // others read them there (the same bits; see `micro_split`).
  float* save = nullptr;
  const float* widened = nullptr;
  if constexpr (F == Kernel::kWiden) {
    if (calls > 1) {
      thread_local std::vector<float> buffer;   // 64-byte aligned from `save` on
      const size_t need = static_cast<size_t>(NP * kc * kNR) + 16;
      if (buffer.size() < need) buffer.resize(need);
      const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
      save = reinterpret_cast<float*>((at + 63) & ~static_cast<uintptr_t>(63));
    }
  }
  auto tile = [&](auto mr, int64_t m) {
    micro_for<F, decltype(mr)::value, NP>(x + m * ldx, ldx, w, ps, kc, c + m * ldc, ldc,
                                          accumulate, prefetch(), widened == nullptr ? save
                                                                                     : nullptr,
                                          widened);
    widened = save;
  };
  int64_t m = 0;
  for (; m + kMaxMR <= rows; m += kMaxMR) tile(std::integral_constant<int, kMaxMR>(), m);
  if constexpr (kMaxMR > 8) {
    if (rows - m >= 8) {
      tile(std::integral_constant<int, 8>(), m);
      m += 8;
    }
  }
  if constexpr (kMaxMR > 4) {
    if (rows - m >= 4) {
      tile(std::integral_constant<int, 4>(), m);
      m += 4;
    }
  }
  if (rows - m >= 2) {
    tile(std::integral_constant<int, 2>(), m);
    m += 2;
  }
  if (rows - m >= 1) tile(std::integral_constant<int, 1>(), m);
}

// The tail panel (nt < 16 columns, layout per the header), scalar: N % 16 != 0 is rare in LLMs.
// (Products of bf16 values are exact in float32, so both pair forms give the same bits here.)
template <typename XS, typename T>
inline void tail_rows(const XS* x, int64_t ldx, int64_t rows, const T* w, int64_t nt,
                      int64_t kc, float* c, int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < nt; ++j) {
      float s = accumulate ? c[m * ldc + j] : 0.f;
      for (int64_t k = 0; k < kc; ++k) {
        const int64_t idx = pairs<T>() ? (k / 2) * nt * 2 + j * 2 + (k & 1) : k * nt + j;
        s += to_float(x[m * ldx + k]) * to_float(w[idx]);
      }
      c[m * ldc + j] = s;
    }
}

// dst[r][0..kc) = x[r][0..kc) in kernel F's input type, for `rows` rows: float32 as given for
// kFloat, bf16 (nearest even) for kDot, and for kWiden float32 holding those same bf16 values
// (the same rounding code, so both pair forms read the same x).
template <Kernel F, typename TX>
inline void stage_rows(const TX* x, int64_t ldx, int64_t rows, int64_t kc, XOf<F>* dst) {
  constexpr bool round = F != Kernel::kFloat && std::is_same_v<TX, float>;
  for (int64_t r = 0; r < rows; ++r) {
    const TX* src = x + r * ldx;
    XOf<F>* out = dst + r * kc;
    int64_t k = 0;
#if defined(PAGEDLLM_AVX512_BF16)
    if constexpr (round)
      for (; k + 16 <= kc; k += 16) {
        const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k));
        if constexpr (F == Kernel::kDot)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), b);
        else
          _mm512_storeu_ps(out + k, _mm512_castsi512_ps(
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
#endif
    for (; k < kc; ++k) {
      if constexpr (F == Kernel::kDot) {
        store(to_float(src[k]), out + k);
      } else if constexpr (round) {
        uint16_t b;
        store(src[k], &b);
        out[k] = to_float(b);
      } else {
        out[k] = to_float(src[k]);
      }
    }
  }
}

// ---------------------------------------------------------------- the pair-form choice
// Which kernel reads bf16 pair panels in this process (kDot or kWiden; kFloat in builds
// without pair panels): measured once, on first use, unless set first (`set_pairs_form`).
inline std::atomic<int>& pairs_form_slot() {
  static std::atomic<int> form{-1};
  return form;
}

#if defined(PAGEDLLM_AVX512_BF16)
// Seconds of `iterations` steps of 12 independent register chains of vdpbf16ps (kDot) or
// float32 FMAs (kFloat) on the calling thread.
template <bool kDot>
inline double probe_seconds(int64_t iterations) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(1e-3f * (i + 1));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-6f);
  const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iterations; ++it)
    for (int i = 0; i < 12; ++i)
      acc[i] = kDot ? _mm512_dpbf16_ps(acc[i], ab, bb) : _mm512_fmadd_ps(acc[i], a, b);
  const auto t1 = std::chrono::steady_clock::now();
  __m512 sum = acc[0];
  for (int i = 1; i < 12; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(sum);   // keeps the loops
  (void)sink;
  return std::chrono::duration<double>(t1 - t0).count();
}

// The rule: kWiden where float32 FMAs multiply-add at least 1.3x as many values per second as
// vdpbf16ps does (each vdpbf16ps does two per lane, an FMA one; the widening form issues
// about 8% more vector instructions than its FMAs: a shift and an AND per panel row pair).
// Best of 5 alternated timings of about 0.2-1 ms each; a few ms once per process.
inline Kernel probe_pairs_form() {
  constexpr int64_t kIterations = 50000;
  double dot = 1e30, fma = 1e30;
  for (int r = 0; r < 5; ++r) {
    fma = std::min(fma, probe_seconds<false>(kIterations));
    dot = std::min(dot, probe_seconds<true>(kIterations));
  }
  const double fma_rate = 16.0 / fma, dot_rate = 32.0 / dot;   // values per second, relative
  return fma_rate >= 1.3 * dot_rate ? Kernel::kWiden : Kernel::kDot;
}
#endif

inline Kernel pairs_form() {
#if defined(PAGEDLLM_AVX512_BF16)
  static std::once_flag once;
  std::call_once(once, [] {
    if (pairs_form_slot().load() < 0) {
      int unset = -1;
      pairs_form_slot().compare_exchange_strong(unset, static_cast<int>(probe_pairs_form()));
    }
  });
  return static_cast<Kernel>(pairs_form_slot().load(std::memory_order_relaxed));
#else
  return Kernel::kFloat;
#endif
}

// Sets the kernel for bf16 pair panels (kDot or kWiden; outside a parallel region). Returns
// false, changing nothing, in builds without pair panels or for kFloat.
inline bool set_pairs_form(Kernel form) {
  if (!pairs<uint16_t>() || form == Kernel::kFloat) return false;
  pairs_form_slot().store(static_cast<int>(form));
  return true;
}

// ---------------------------------------------------------------- the GEMM
// `linear_tiles` with kernel F (x staged into F's input type per work item where TX is not).
template <Kernel F, typename T, typename TX, typename TY>
void tiles(const TX* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N,
           const float* bias, TY* y, int64_t ldy, NextWeight<T> next) {
  using XS = XOf<F>;
  // x is read in place where it is in XS already (and kWiden's x is bf16-rounded float32).
  constexpr bool kStage = !std::is_same_v<XS, TX> || F == Kernel::kWiden;
  const int64_t full = N / kNR, nt = N % kNR, num_panels = full + (nt > 0);
  // Panels per item: enough items for the threads at decode sizes, few enough that a row
  // block of x is re-read only a few times per weight.
  const int64_t group = std::clamp<int64_t>(full / (4 * omp_get_num_threads()) / kNP * kNP,
                                            kNP, kMaxGroup);
  const int64_t num_groups = (num_panels + group - 1) / group;
  const int64_t num_row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t ps = kNR * K;
  // The staged rows [rows, K] of the row block `staged_block` in this call (-1: none yet). Items
  // of one row block follow each other in the loop, so a thread mostly stages a row block once
  // per call rather than once per panel group (the LM head at 32 rows: 250 groups).
  thread_local std::vector<XS> staged;   // x rows in XS, when kStage
  int64_t staged_block = -1;
  // What the panels before panel `p_next` prefetch while they run (k block [k0, k0 + kc) of
  // row block b): the panels from p_next on while there are any; after the last full panel,
  // what is read next: this item's first panels at the next k block, the first panels of the
  // next row block, or after the last row block the first two panels of `next` (the
  // caller's next weight), else nothing (before, the bytes past the weight's end).
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T));
  const char* wc = reinterpret_cast<const char*>(w);
  auto target = [&](int64_t p_next, int64_t p0, int64_t k0, int64_t kc,
                    int64_t b) -> PrefetchTarget {
    if (p_next < full) return {wc + (p_next * ps + k0 * kNR) * kSize, kc * kNR * kSize / 64,
                               ps * kSize};
    if (k0 + kc < K) {
      const int64_t kn = std::min(kc, K - k0 - kc);
      return {wc + (p0 * ps + (k0 + kc) * kNR) * kSize, kn * kNR * kSize / 64, ps * kSize};
    }
    if (b + 1 < num_row_blocks)
      return {wc, std::min(kc, K) * kNR * kSize / 64, ps * kSize};
    if (next.w != nullptr && next.K > 0)
      return {reinterpret_cast<const char*>(next.w), next.K * kNR * kSize / 64,
              kNR * next.K * kSize};
    return {};
  };
#if defined(PAGEDLLM_GEMM_TALLY)
  const bool timed = omp_get_thread_num() == 0;
  const int64_t t_start = timed ? tally_now() : 0;
  int64_t t_first = 0;
#endif
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_row_blocks * num_groups; ++item) {
    alignas(64) float c[kRowBlock * kMaxGroup * kNR];
    const int64_t g = item % num_groups, b = item / num_groups;
    const int64_t r0 = b * kRowBlock, rows = std::min(M, r0 + kRowBlock) - r0;
    const int64_t p0 = g * group, p1 = std::min(num_panels, p0 + group);
    const int64_t p_full_end = std::min(p1, full);
    const int64_t ldc = (p1 - p0) * kNR;
    const int64_t kblock = rows * K <= kMaxWholeK ? K : kKC;
    if constexpr (kStage) {
      if (staged_block != b) {
        staged.resize(static_cast<size_t>(rows * K));
        stage_rows<F>(x + r0 * ldx, ldx, rows, K, staged.data());
        staged_block = b;
      }
    }
    for (int64_t k0 = 0; k0 < K; k0 += kblock) {
      const int64_t kc = std::min(kblock, K - k0);
      const XS* xk;
      int64_t ldxk;
      if constexpr (!kStage) {
        xk = x + r0 * ldx + k0;
        ldxk = ldx;
      } else {
        xk = staged.data() + k0;
        ldxk = K;
      }
      const bool accumulate = k0 > 0;
      int64_t p = p0;
      for (; p + kNP <= p_full_end; p += kNP)
        panel_rows<F, kNP>(xk, ldxk, rows, w + p * ps + k0 * kNR, ps, kc, c + (p - p0) * kNR,
                           ldc, accumulate, target(p + kNP, p0, k0, kc, b));
      for (; p < p_full_end; ++p)
        panel_rows<F, 1>(xk, ldxk, rows, w + p * ps + k0 * kNR, ps, kc, c + (p - p0) * kNR,
                         ldc, accumulate, target(p + 1, p0, k0, kc, b));
      if (p1 > full)
        tail_rows(xk, ldxk, rows, w + full * ps + k0 * nt, nt, kc, c + (full - p0) * kNR, ldc,
                  accumulate);
    }
    const int64_t n0 = p0 * kNR, cols = std::min(N, p1 * kNR) - n0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j)
        store(c[r * ldc + j] + (bias != nullptr ? bias[n0 + j] : 0.f),
              y + (r0 + r) * ldy + n0 + j);
#if defined(PAGEDLLM_GEMM_TALLY)
    if (timed && t_first == 0) t_first = tally_now();
#endif
  }
#if defined(PAGEDLLM_GEMM_TALLY)
  if (timed)
    tally_record(t_start, t_first > 0 ? t_first : t_start, tally_now(), M, N, K,
                 static_cast<int64_t>(sizeof(T)));
#endif
}

// The work-sharing loop of a packed linear, to be called by every thread of an enclosing OpenMP
// parallel region (an orphaned `omp for`: it ends with a barrier); outside one it runs serially.
// x [M, K] (row stride ldx), w packed from [N, K] (see the header), K a multiple of 8,
// bias [N] float32 or null, y [M, N] (row stride ldy). When x is float32 and w bf16 pair panels,
// each thread rounds the rows of a row block itself when it takes the block's first item (once
// per row block and thread, not once per panel group: the LM head at 32 rows has 250 groups),
// unless `x_staged` ([M, K], shared by the threads) is given: then the rows are rounded once
// into it by a work-sharing loop of their own (the same values; one barrier more). Rounding per
// item slowed the fused decoder's GEMMs, the most at 2048 rows (docs/benchmarks.md,
// "Measurements behind choices in the code"). Pair panels are read by the kernel `pairs_form()`
// names: the same bits either way.
template <typename T, typename TX, typename TY>
void linear_tiles(const TX* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N,
                  const float* bias, TY* y, int64_t ldy, XStage<T>* x_staged = nullptr,
                  NextWeight<T> next = {}) {
  if constexpr (pairs<T>()) {
    if constexpr (std::is_same_v<TX, float>) {
      if (x_staged != nullptr) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r)
          stage_rows<Kernel::kDot>(x + r * ldx, ldx, 1, K, x_staged + r * K);
        linear_tiles<T, uint16_t, TY>(x_staged, K, M, K, w, N, bias, y, ldy, nullptr, next);
        return;
      }
    }
    if (pairs_form() == Kernel::kWiden)
      tiles<Kernel::kWiden>(x, ldx, M, K, w, N, bias, y, ldy, next);
    else
      tiles<Kernel::kDot>(x, ldx, M, K, w, N, bias, y, ldy, next);
  } else {
    tiles<Kernel::kFloat>(x, ldx, M, K, w, N, bias, y, ldy, next);
  }
#if defined(PAGEDLLM_GEMM_TALLY_TWICE)
  // Measurement only: the same call once more, its weight just read (tallied as wbytes + 100).
  tally_repeat() = true;
  if constexpr (pairs<T>())
    tiles<Kernel::kWiden>(x, ldx, M, K, w, N, bias, y, ldy, next);
  else
    tiles<Kernel::kFloat>(x, ldx, M, K, w, N, bias, y, ldy, next);
  tally_repeat() = false;
#endif
}

template <typename T, typename TX, typename TY>
void linear(const TX* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N,
            const float* bias, TY* y, int64_t ldy) {
#pragma omp parallel
  linear_tiles(x, ldx, M, K, w, N, bias, y, ldy);
}

// The packed weight `weight` (K columns) as the NextWeight of the GEMM before it, or none
// where `is_packed` is 0 (its rows are not in panels).
template <typename T>
inline NextWeight<T> next_weight(int64_t is_packed, const void* weight, int64_t K) {
  if (is_packed == 0) return {};
  return {static_cast<const T*>(weight), K};
}

}  // namespace packed

// y [M, N] = x [M, K] (float32, row stride K) W^T for a layer's weight in the model dtype T,
// stored as packed panels where `is_packed` (packed::linear_tiles, which ends by prefetching
// `next`'s first panels) or as [N, K] rows (linear_kernel.h); an orphaned work-sharing loop.
template <typename T>
inline void packed_or_rows_linear(int64_t is_packed, const void* weight, const float* x,
                                  int64_t M, int64_t K, int64_t N, float* y,
                                  packed::NextWeight<T> next = {}) {
  if (is_packed != 0)
    packed::linear_tiles(x, K, M, K, static_cast<const T*>(weight), N, nullptr, y, N, nullptr,
                         next);
  else
    linear_tiles(x, K, M, K, static_cast<const T*>(weight), N, nullptr, y, N);
}

}  // namespace pagedllm
