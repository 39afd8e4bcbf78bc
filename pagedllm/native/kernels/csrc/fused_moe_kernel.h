// The routed experts of one mixture-of-experts layer as phases of an OpenMP parallel region, shared
// by cpu_fused_moe.cpp (the experts alone, `fused_experts`) and cpu_moe_block.cpp (the whole MoE
// block: router, routing, experts, shared expert):
//
//   out[t] = sum over j < k with a local expert e = topk_ids[t, j]:
//            topk_weights[t, j] * (silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T)) @ W2[e]^T
//
//   0. `plan` (serial)  counting sort of the T*k (token, slot) pairs by local expert, stable (an
//                expert's rows keep token order); ids < 0 or >= num_experts (another rank's
//                expert under expert parallelism) are dropped:
//                  sorted rows [ expert 0 | expert 1 | ... ],  pos[t*k + j] = row or -1
//   1. gather    xs[row] = x[token of row] (dot-product blocks)            [m, H]
//   2. gate/up   per work item (expert, block of its rows, tile of intermediate columns):
//                gate and up tiles by the dot-product micro-kernels (moe_few_rows.h;
//                experts with < 32 rows: one block) or the panel form's outer-product tiles
//                (more rows: blocks of up to 256, every dtype, x gathered per thread: see
//                "Panel form" below), then act[row, i] = silu(gate) * up     [m, I]
//   3. down      per work item (expert, row block, tile of hidden columns):
//                ys[rows] = act[rows] @ W2[e]^T                              [m, H]
//   4. combine   per token and column: sum_j w[t, j] * ys[pos[t*k + j]], in slot order
//                j = 0..k-1 (`routed_sum`): deterministic, no atomics.
//
// Phases 1-3 (`expert_phases`) are orphaned work-sharing loops: every thread of the enclosing
// region calls them, and each ends with the loop's implicit barrier. Each weight tile is read
// once per block of up to 256 rows of its expert (not once per token), and the work items of all
// experts share one loop, so a batch-1 decode with two active experts still spreads over every
// thread.
//
// Rounding: activations are in the model dtype TA (float32 or bfloat16), weights TW (float32 or
// bfloat16), math in float32. With bfloat16 activations every intermediate is rounded where the
// module path's torch ops round it: gate and up (GEMM outputs), silu(gate), silu(gate) * up, the
// down GEMM's output, each weighted row; the k weighted rows of a token are summed in float32
// and rounded once by the caller (torch's bf16 sum accumulates in float32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "linear_kernel.h"
#include "moe_few_rows.h"

namespace pagedllm {
namespace moe {

constexpr int64_t kMaxTile = 64;     // weight rows per work item (a tile stays in L2)
constexpr int64_t kCombineChunk = 256;
constexpr int64_t kPanel = 16;            // rows of x per panel of the transposed layout
constexpr int64_t kPanelMinRows = 32;     // an expert with this many rows takes the panel form
// Most rows of one panel block: an expert's rows are cut into as few blocks as this allows, of
// nearly equal size. Each block streams the expert's weight tiles from memory once (later panel
// steps of the block find them in L2), so longer blocks read the weights fewer times: a
// 2048-token DeepSeek-V2-Lite step (192 rows per expert) had two 96-row blocks per expert, and
// the first panel step of each waited on the weights.
constexpr int64_t kPanelRowBlock = 256;
#ifdef PAGEDLLM_AVX512
// Adjacent panels sharing each weight broadcast: two per step; an odd count's last three in one
// step (8 weight rows x 3 panels), so no panel runs alone (one broadcast per two FMAs).
constexpr int64_t kPanelsPerStep = 2;
constexpr int64_t kMaxPanelsPerStep = 3;
#else
constexpr int64_t kPanelsPerStep = 1;
constexpr int64_t kMaxPanelsPerStep = 1;
#endif

// The bfloat16 value nearest to v (round to nearest even), as a float.
inline float round_to(float v, const uint16_t*) {
  uint16_t b;
  store(v, &b);
  return to_float(b);
}

inline float round_to(float v, const float*) { return v; }

// v rounded to T's precision (float32: unchanged).
template <typename T>
inline float rounded(float v) {
  return round_to(v, static_cast<const T*>(nullptr));
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// One expert's contiguous block of sorted rows [r0, r1); its x and act rows lie from row s0 of
// xs / act (dot-product blocks, float32 holding TA values) or its act panels from row s0 of ap
// (`panel` blocks, float32 panels; their x panels are gathered per thread), its outputs at rows
// [r0, r1) of ys.
struct RowBlock {
  int64_t expert, r0, r1, s0;
  bool panel;
};

// Panel form (blocks of kPanelMinRows rows or more, every dtype): the block's x rows are
// gathered transposed in float32 (bfloat16 widened, which is exact) into a buffer of each
// thread that takes one of the block's work items (the items of a block follow each other in
// the loop, so a thread mostly gathers a block once, and the panels stay in its L2; a shared
// buffer of all blocks' panels, 17 MB at a 1365-token DeepSeek-V2-Lite step, went to memory
// and back), in panels of kPanel rows,
// [K][kPanel] each (row r, value k at k * kPanel + r % kPanel of panel r / kPanel; a last panel
// padded with zero rows), and the products are computed as y^T = W x^T by outer-product
// register tiles (as packed_gemm.h's) with the weight rows in the broadcast operand and the x
// panels in the other (`panel_micro`): one panel load per MR multiply-adds and no horizontal
// sums, where the dot-product kernels (`tile_gemm`) load x and w once each per multiply-add
// group and sum 8 lanes per output. While a work item runs its tiles, the micro-kernels
// prefetch the next work item's weight tile into L2 (`TileStream`), so the first panel step of
// each item no longer waits on the weights from memory.
//
// bfloat16 weights are widened to float32 one work item's tile at a time (`widen`, into a
// per-thread buffer that stays in L2) and then run the float32 tiles: on CPUs whose bf16 dot
// instruction (`vdpbf16ps`) has half the float32 FMA rate, this is the faster bf16 GEMM. A
// product of two bfloat16 values is exact in float32, so each multiply-add rounds once, as in
// `vdpbf16ps` and oneDNN's bf16 GEMMs; only the summation order differs from the module path.
//
// The gate / up outputs come out transposed, so silu(gate) * up (rounded to TA where the module
// path rounds: gate, up, silu(gate), the product) is written as act panels directly
// ([I][kPanel], `silu_mul`), the down GEMM's input; its outputs are transposed back into ys
// rows, rounded to TA.

// k values per pass over the panels (`panel_gemm`): two panels' rows [k0, k0 + kPanelDepth)
// are 16 KiB and stay in L1 while each weight row group of the tile passes over them. Without
// the blocking the two panels (64 KiB at K = 512) streamed from L2 once per weight row group
// and the FMAs waited on them. Each output is still one k-ordered chain of multiply-adds (the
// accumulators are stored and reloaded between passes), so the blocking changes no bits.
constexpr int64_t kPanelDepth = 128;

// Columns per tile so that the work items number about 8 per thread (at least 8 columns, at
// most `max_tile`).
inline int64_t tile_width(int64_t columns, int64_t num_blocks, int num_threads,
                          int64_t max_tile) {
  const int64_t want = (columns * num_blocks + 8 * num_threads - 1) / (8 * num_threads);
  return std::max<int64_t>(8, std::min<int64_t>(max_tile, want));
}

// Buffers of one call that the calling thread keeps for its next calls (slots below): a
// prefill-sized call's intermediates are tens of MB, and fresh allocations of that size are
// mmap'ed and page-faulted in again at every call (~15K faults, ~10% of a 2048-token DeepSeek
// MoE block). Slot s of this thread holds at least n elements of T (grown, never shrunk;
// contents unspecified); a pointer stays valid until the same slot is asked for again on this
// thread.
// kSlotXp held the panel form's x panels of all blocks until 2026-12-07 (now per thread, in
// kSlotScratch); the slot stays so that kNumSlots does not change: g++ makes the slots' arrays
// one process-wide object (a unique symbol), shared by two builds of this file loaded side by
// side in one process for an A/B, and a build with fewer slots corrupted the other's memory.
enum BufferSlot { kSlotXs, kSlotAct, kSlotXp, kSlotAp, kSlotYs, kSlotScratch, kSlotShared0,
                  kSlotShared1, kSlotShared2, kNumSlots };

template <typename T>
T* reused_buffer(BufferSlot slot, int64_t n) {
  thread_local std::unique_ptr<char[]> data[kNumSlots];
  thread_local size_t capacity[kNumSlots] = {};
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, n)) * sizeof(T);
  if (bytes > capacity[slot]) {
    data[slot].reset();   // freed before the larger allocation: the peak stays one buffer
    data[slot].reset(new char[bytes]);
    capacity[slot] = bytes;
  }
  return reinterpret_cast<T*>(data[slot].get());
}

// The sorted pairs of one step and the buffers of phases 1-3 (built by `plan`, serially).
template <typename TA>
struct Plan {
  int64_t num_pairs = 0, m = 0, H = 0, I = 0, stored = 0, stored_panels = 0, x_size = 0;
  std::vector<int64_t> pos, token_of_row;   // [T*k] row or -1; [m] token
  std::vector<RowBlock> blocks;
  int64_t tile_i = 8, tile_h = 8, tiles_i = 0, tiles_h = 0, scratch_size = 0, wide_size = 0;
  // xs [stored, H], act [stored, I] (dot-product blocks; float32 holding TA values, see
  // `stage_row`), ap [stored_panels, I] (panel blocks, rows padded to whole panels), ys [m, H],
  // per thread scratch_size floats (the x panels of one panel block, x_size floats, then the
  // output tiles and a widened weight tile): buffers of the thread that ran `plan`
  // (`reused_buffer`), valid until it plans again
  TA* ys = nullptr;
  float *xs = nullptr, *act = nullptr, *ap = nullptr, *scratch = nullptr;
};

// Blocks of kPanelMinRows rows or more take the panel form; weights TW in bfloat16 get a
// per-thread buffer for one widened tile.
template <typename TA, typename TW>
void plan(const int64_t* topk_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
          int64_t H, int64_t I, int num_threads, Plan<TA>& p) {
  p.num_pairs = num_tokens * top_k;
  p.H = H;
  p.I = I;
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t q = 0; q < p.num_pairs; ++q) {
    const int64_t e = topk_ids[q];
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  p.m = offsets[num_experts];
  p.pos.assign(p.num_pairs, -1);
  p.token_of_row.resize(p.m);
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t q = 0; q < p.num_pairs; ++q) {
      const int64_t e = topk_ids[q];
      if (e < 0 || e >= num_experts) continue;
      p.pos[q] = next[e]++;
      p.token_of_row[p.pos[q]] = q / top_k;
    }
  }
  p.blocks.clear();
  p.stored = p.stored_panels = p.x_size = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows >= kPanelMinRows) {
      // ceil(rows / kPanelRowBlock) blocks of whole panels, the last one the shortest
      const int64_t count = (rows + kPanelRowBlock - 1) / kPanelRowBlock;
      const int64_t per = ((rows + count - 1) / count + kPanel - 1) / kPanel * kPanel;
      for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += per) {
        const int64_t r1 = std::min(offsets[e + 1], r0 + per);
        const int64_t padded = (r1 - r0 + kPanel - 1) / kPanel * kPanel;
        p.blocks.push_back({e, r0, r1, p.stored_panels, true});
        p.stored_panels += padded;
        p.x_size = std::max(p.x_size, padded * H);
      }
      continue;
    }
    if (rows > 0) {
      p.blocks.push_back({e, offsets[e], offsets[e + 1], p.stored, false});
      p.stored += rows;
    }
  }
  const int64_t num_blocks = static_cast<int64_t>(p.blocks.size());
  // Blocks of up to 8 rows (a decode step's) read each weight tile once whatever its width, so
  // the tiles need not stay in L2 and may span a whole matrix when the threads are few: fewer,
  // longer streams (one expert's gate and up rows are adjacent, so gate then up is one stream),
  // each paying its restart of the prefetchers once. A single-thread batch-1 decode's routed
  // experts run ~5% faster (docs/benchmarks.md, "Batch 1 against llama.cpp"); the sums are
  // unchanged (each output is the same dot product).
  int64_t max_rows = 0;
  for (const RowBlock& b : p.blocks) max_rows = std::max(max_rows, b.r1 - b.r0);
  const bool few_rows = max_rows <= 8;
  p.tile_i = tile_width(I, num_blocks, num_threads, few_rows ? I : kMaxTile);
  p.tile_h = tile_width(H, num_blocks, num_threads, few_rows ? H : kMaxTile);
  p.tiles_i = (I + p.tile_i - 1) / p.tile_i;
  p.tiles_h = (H + p.tile_h - 1) / p.tile_h;
  p.xs = reused_buffer<float>(kSlotXs, p.stored * H);
  p.act = reused_buffer<float>(kSlotAct, p.stored * I);
  p.ap = reused_buffer<float>(kSlotAp, p.stored_panels * I);
  p.ys = reused_buffer<TA>(kSlotYs, p.m * H);
  // Per thread: the x panels of one panel block, the gate and up tiles of one work item (panel
  // form: [np][tile][kPanel] each; dot-product form: [rows][tile] in TA), then (bfloat16
  // weights with panel blocks) one widened gate + up tile or down tile (panel blocks have
  // tiles of at most kMaxTile rows: few_rows is false).
  p.wide_size = std::is_same_v<TW, float> || p.stored_panels == 0
                    ? 0 : std::max(2 * p.tile_i * H, p.tile_h * I);
  p.scratch_size = p.x_size +
                   2 * std::max(kPanelMinRows * p.tile_i, kMaxPanelsPerStep * kMaxTile * kPanel) +
                   p.wide_size;
  p.scratch = reused_buffer<float>(kSlotScratch, p.scratch_size * num_threads);
}

// Software prefetch of the next work item's weight tile (into L2) during this item's
// micro-kernel calls: one 64-byte line every `every` steps of k, from `line` up to `end`, the
// position carried from call to call (null `line`: none). The item sets `every` so that its
// calls reach the end of the next tile about when they finish (`item_stream`): a steady stream
// under the FMAs, where the hardware prefetchers left the first panel step of each item waiting
// on its weights (12 rows at stride K, a new stream every 128 values of k).
struct TileStream {
  const char* line = nullptr;
  const char* end = nullptr;
  int64_t every = 1, countdown = 1;

  // One step of k.
  __attribute__((always_inline)) void step() {
    if (--countdown != 0) return;
    countdown = every;
    if (line < end) {
      __builtin_prefetch(line, 0, 2);
      line += 64;
    }
  }
};

// c[j][0..kPanel) (+)= the products of weight rows w[j] (row stride ldw) over kc values of k
// with the panel's kPanel columns (x rows; panel row k at panel + k * kPanel), for j < MR: an
// outer-product register tile (one panel row load per MR broadcasts of w and 2 MR
// multiply-adds; the order of packed_gemm.h's micro-kernels, written here so that it is
// inlined into its loop: a separate copy kept the tile on the stack). `accumulate`: continue
// the sums in c (the next kPanelDepth pass), else start from 0. `stream`: see `TileStream`.
template <int MR>
__attribute__((always_inline)) inline void panel_micro(const float* w, int64_t ldw, int64_t kc,
                                                       const float* panel, float* c,
                                                       bool accumulate, TileStream& stream) {
#ifdef PAGEDLLM_AVX2
  static_assert(kPanel == 16, "two ymm per panel row");
  TileStream s = stream;
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    acc[i][0] = accumulate ? _mm256_loadu_ps(c + i * kPanel) : _mm256_setzero_ps();
    acc[i][1] = accumulate ? _mm256_loadu_ps(c + i * kPanel + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    s.step();
    const __m256 p0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 p1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 wv = _mm256_broadcast_ss(w + i * ldw + k);
      acc[i][0] = _mm256_fmadd_ps(wv, p0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(wv, p1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * kPanel, acc[i][0]);
    _mm256_storeu_ps(c + i * kPanel + 8, acc[i][1]);
  }
  stream = s;
#else
  (void)stream;
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kPanel; ++r) {
      float sum = accumulate ? c[i * kPanel + r] : 0.f;
      for (int64_t k = 0; k < kc; ++k) sum += w[i * ldw + k] * panel[k * kPanel + r];
      c[i * kPanel + r] = sum;
    }
#endif
}

#ifdef PAGEDLLM_AVX512
// The AVX-512 form of `panel_micro` over NP panels (panel q at panel + q * ldp): one zmm per
// panel row, MR weight rows broadcast against NP panel rows, so one broadcast per NP
// multiply-adds (the AVX2 form: one per 2 half-rows of one panel). Outputs of panel q at
// c + q * cq, [MR][kPanel]. Each output is the same k-ordered chain of multiply-adds as the
// AVX2 form's, so both give the same bits.
template <int MR, int NP>
__attribute__((always_inline)) inline void panel_micro16(const float* w, int64_t ldw,
                                                         int64_t kc, const float* panel,
                                                         int64_t ldp, float* c, int64_t cq,
                                                         bool accumulate, TileStream& stream) {
  static_assert(kPanel == 16, "one zmm per panel row");
  TileStream s = stream;
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q)
      acc[i][q] = accumulate ? _mm512_loadu_ps(c + q * cq + i * kPanel) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    s.step();
    __m512 pv[NP];
    for (int q = 0; q < NP; ++q) pv[q] = _mm512_loadu_ps(panel + q * ldp + k * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 wv = _mm512_set1_ps(w[i * ldw + k]);
      for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_fmadd_ps(wv, pv[q], acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + q * cq + i * kPanel, acc[i][q]);
  stream = s;
}

// Weight rows per register tile of NP panels (24 accumulators: 12 x 2, 8 x 3).
template <int NP>
constexpr int kTileRows = NP == 3 ? 8 : 12;

// Weight rows [0, n) (K values each) against NP panels, in passes of kPanelDepth values of k:
// kTileRows<NP>-row register tiles, then 8 / 4 / 2 / 1 rows.
template <int NP>
inline void panel_gemm16(const float* w, int64_t K, const float* panel, int64_t n, float* c,
                         TileStream& stream) {
  constexpr int MR = kTileRows<NP>;
  const int64_t cq = n * kPanel, ldp = kPanel * K;
  for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
    const int64_t kc = std::min(kPanelDepth, K - k0);
    const float* wk = w + k0;
    const float* pk = panel + k0 * kPanel;
    const bool acc = k0 > 0;
    int64_t j = 0;
    for (; j + MR <= n; j += MR)
      panel_micro16<MR, NP>(wk + j * K, K, kc, pk, ldp, c + j * kPanel, cq, acc, stream);
    if constexpr (MR > 8) {
      if (n - j >= 8) {
        panel_micro16<8, NP>(wk + j * K, K, kc, pk, ldp, c + j * kPanel, cq, acc, stream);
        j += 8;
      }
    }
    if (n - j >= 4) {
      panel_micro16<4, NP>(wk + j * K, K, kc, pk, ldp, c + j * kPanel, cq, acc, stream);
      j += 4;
    }
    if (n - j >= 2) {
      panel_micro16<2, NP>(wk + j * K, K, kc, pk, ldp, c + j * kPanel, cq, acc, stream);
      j += 2;
    }
    if (n - j >= 1)
      panel_micro16<1, NP>(wk + j * K, K, kc, pk, ldp, c + j * kPanel, cq, acc, stream);
  }
}
#endif

// c[q][j][0..kPanel) (panel q's outputs at c + q * n * kPanel) for the weight rows j < n and
// the np <= kMaxPanelsPerStep adjacent panels from `panel` (panel q at panel + q * kPanel * K):
// AVX-512 the two- or three-panel tiles (`panel_gemm16`), else 6-row tiles per panel, then one
// for the rest; in passes of kPanelDepth values of k.
inline void panel_gemm(const float* w, int64_t K, const float* panel, int64_t np, int64_t n,
                       float* c, TileStream& stream) {
#ifdef PAGEDLLM_AVX512
  if (np == 3) return panel_gemm16<3>(w, K, panel, n, c, stream);
  if (np == 2) return panel_gemm16<2>(w, K, panel, n, c, stream);
  return panel_gemm16<1>(w, K, panel, n, c, stream);
#else
  (void)np;   // kMaxPanelsPerStep == 1
  for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
    const int64_t kc = std::min(kPanelDepth, K - k0);
    const float* wk = w + k0;
    const float* pk = panel + k0 * kPanel;
    const bool acc = k0 > 0;
    int64_t j = 0;
    for (; j + 6 <= n; j += 6)
      panel_micro<6>(wk + j * K, K, kc, pk, c + j * kPanel, acc, stream);
    const float* wj = wk + j * K;
    float* cj = c + j * kPanel;
    switch (n - j) {
      case 5: panel_micro<5>(wj, K, kc, pk, cj, acc, stream); break;
      case 4: panel_micro<4>(wj, K, kc, pk, cj, acc, stream); break;
      case 3: panel_micro<3>(wj, K, kc, pk, cj, acc, stream); break;
      case 2: panel_micro<2>(wj, K, kc, pk, cj, acc, stream); break;
      case 1: panel_micro<1>(wj, K, kc, pk, cj, acc, stream); break;
      default: break;
    }
  }
#endif
}

// The panels of each step of a block of num_panels panels: kPanelsPerStep, the last step of an
// odd count (AVX-512) three.
inline int64_t step_panels(int64_t q, int64_t num_panels) {
  const int64_t left = num_panels - q;
  return left == kMaxPanelsPerStep ? left : std::min(kPanelsPerStep, left);
}

// Steps of k that `panel_gemm` runs over n weight rows of K values for a block of num_panels
// panels (all its steps): (its micro-kernel calls per pass) x K per step.
inline int64_t item_k_steps(int64_t num_panels, int64_t n, int64_t K) {
  int64_t total = 0;
  for (int64_t q = 0; q < num_panels;) {
    const int64_t np = step_panels(q, num_panels);
#ifdef PAGEDLLM_AVX512
    // panel_gemm16's row tiles: kTileRows<np> rows, then 8 (where smaller), 4, 2, 1.
    const int64_t mr = np == 3 ? kTileRows<3> : kTileRows<2>;
    int64_t calls = n / mr, rest = n % mr;
    for (int64_t t : {8, 4, 2, 1})
      if (t < mr && rest >= t) {
        ++calls;
        rest -= t;
      }
#else
    const int64_t calls = (n + 5) / 6;
#endif
    total += calls * K;
    q += np;
  }
  return total;
}

// The stream of `bytes` bytes from `start` for an item whose products make `k_steps` steps of k
// (`item_k_steps`; none where start is null).
inline TileStream item_stream(const void* start, int64_t bytes, int64_t k_steps) {
  TileStream s;
  if (start == nullptr || bytes <= 0) return s;
  s.line = static_cast<const char*>(start);
  s.end = s.line + bytes;
  s.every = std::max<int64_t>(1, k_steps / ((bytes + 63) / 64));
  return s;
}

// The weights of a tile as float32: float32 weights as they are, bfloat16 ones widened into
// `buffer` (count values; exact).
inline const float* widen(const float* w, int64_t, float*) { return w; }

inline const float* widen(const uint16_t* w, int64_t count, float* buffer) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512
  for (; i + 16 <= count; i += 16) _mm512_storeu_ps(buffer + i, load16(w + i));
#elif defined(PAGEDLLM_AVX2)
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(buffer + i, load8(w + i));
#endif
  for (; i < count; ++i) buffer[i] = to_float(w[i]);
  return buffer;
}

// a[i] = silu(g[i]) * u[i] for i < n (float32 buffers; both forms' SiLU pass: the panel
// form's transposed tiles, the dot-product form's rows), rounded where the module path rounds
// for TA = bfloat16 (g and u as GEMM outputs, silu(g), the product): 16 (AVX-512) or 8 (AVX2)
// lanes with `exp16` / `exp8` (the same bits; the last values in masked lanes, so each value's
// bits do not depend on where it lies), portable builds by std::exp.
// NOTE(moe): the dot-product (decode) form used a scalar std::exp per value until 2026-12-07
// (~1% of a DeepSeek-V2-Lite 200M float32 run in `__expf_fma`); exp16 is within ~2 ulp of it,
// so decode outputs moved by float32 rounding only.
template <typename TA>
void silu_mul(const float* g, const float* u, int64_t n, float* a) {
  constexpr bool bf16 = !std::is_same_v<TA, float>;
#ifdef PAGEDLLM_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    // the last values in masked lanes: every value through exp16, wherever it lies in the
    // buffer (the tiles' widths change with the batch; a scalar tail gave one token other
    // bits in another batch)
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    if constexpr (bf16) {
      gv = round_bf16(gv);
      uv = round_bf16(uv);
    }
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
    __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(neg)));
    if constexpr (bf16) s = round_bf16(s);
    __m512 av = _mm512_mul_ps(s, uv);
    if constexpr (bf16) av = round_bf16(av);
    _mm512_mask_storeu_ps(a + i, m, av);
  }
#elif defined(PAGEDLLM_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t i = 0; i < n; i += 8) {
    // the last values in masked lanes, as the AVX-512 form (exp8 gives exp16's bits)
    const __m256i m = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - i, 8))), lane);
    __m256 gv = _mm256_maskload_ps(g + i, m), uv = _mm256_maskload_ps(u + i, m);
    if constexpr (bf16) {
      gv = round_bf16(gv);
      uv = round_bf16(uv);
    }
    const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), gv);
    __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(neg)));
    if constexpr (bf16) s = round_bf16(s);
    __m256 av = _mm256_mul_ps(s, uv);
    if constexpr (bf16) av = round_bf16(av);
    _mm256_maskstore_ps(a + i, m, av);
  }
#else
  for (int64_t i = 0; i < n; ++i) {
    const float s = rounded<TA>(silu(rounded<TA>(g[i])));
    a[i] = rounded<TA>(s * rounded<TA>(u[i]));
  }
#endif
}

#ifdef PAGEDLLM_AVX512
// out[c] lane r = v[r] lane c for r, c < 16: a 16 x 16 transpose in registers (x rows into
// panels).
inline void transpose16(const __m512 (&v)[16], __m512 (&out)[16]) {
  __m512 t[16];
  // 4 x 4 transposes within each 128-bit lane: t[4 i + c], lane L = column 4 L + c of rows
  // 4 i .. 4 i + 3.
  for (int i = 0; i < 4; ++i) {
    const __m512 lo0 = _mm512_unpacklo_ps(v[4 * i], v[4 * i + 1]);
    const __m512 hi0 = _mm512_unpackhi_ps(v[4 * i], v[4 * i + 1]);
    const __m512 lo1 = _mm512_unpacklo_ps(v[4 * i + 2], v[4 * i + 3]);
    const __m512 hi1 = _mm512_unpackhi_ps(v[4 * i + 2], v[4 * i + 3]);
    t[4 * i] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(lo0), _mm512_castps_pd(lo1)));
    t[4 * i + 1] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(lo0), _mm512_castps_pd(lo1)));
    t[4 * i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(hi0), _mm512_castps_pd(hi1)));
    t[4 * i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(hi0), _mm512_castps_pd(hi1)));
  }
  // Lanes L of t[c], t[4 + c], t[8 + c], t[12 + c] make column 4 L + c.
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(t[c], t[4 + c], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(t[c], t[4 + c], 0xee);
    const __m512 y0 = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0x44);
    const __m512 y1 = _mm512_shuffle_f32x4(t[8 + c], t[12 + c], 0xee);
    out[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    out[c + 4] = _mm512_shuffle_f32x4(x0, y0, 0xdd);
    out[c + 8] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    out[c + 12] = _mm512_shuffle_f32x4(x1, y1, 0xdd);
  }
}
#endif

// Rows [r0, r0 + rows) of the sorted pairs as float32 panels at xp (header of the panel form):
// AVX-512 16 x 16 blocks transposed in registers, the rest value by value.
template <typename TA>
void gather_panels(const TA* hidden, const int64_t* token_of_row, int64_t rows, int64_t H,
                   float* xp) {
  for (int64_t p0 = 0; p0 < rows; p0 += kPanel) {
    const int64_t n = std::min(kPanel, rows - p0);
    float* panel = xp + p0 * H;
    const TA* src[kPanel];
    for (int64_t r = 0; r < n; ++r) src[r] = hidden + token_of_row[p0 + r] * H;
    int64_t k = 0;
#ifdef PAGEDLLM_AVX512
    for (; k + 16 <= H; k += 16) {
      __m512 v[16], out[16];
      for (int r = 0; r < 16; ++r) v[r] = r < n ? load16(src[r] + k) : _mm512_setzero_ps();
      transpose16(v, out);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(panel + (k + c) * kPanel, out[c]);
    }
#endif
    for (; k < H; ++k)
      for (int64_t r = 0; r < kPanel; ++r)
        panel[k * kPanel + r] = r < n ? to_float(src[r][k]) : 0.f;
  }
}

// dst[0, n) = src[0, n) as float32 (bfloat16 widened: exact). The dot-product blocks keep their
// x and act rows in float32 so that the few-row kernels widen only the weights: with bfloat16 x
// rows each of MB rows was widened again per k step for every weight row group (an expert's
// decode share is read once per group), and the widening shares the shuffle port with the FMAs.
// The values, hence the sums, are those of the TA rows.
inline void stage_row(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }

inline void stage_row(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#elif defined(PAGEDLLM_AVX2)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// Phases 1-3 for every thread of the enclosing parallel region (w13 [E, 2I, H], w2 [E, H, I]).
template <typename TA, typename TW>
void expert_phases(const TA* hidden, const TW* w13, const TW* w2, Plan<TA>& p) {
  const int64_t H = p.H, I = p.I;
  const int64_t num_blocks = static_cast<int64_t>(p.blocks.size());
  // The dot-product blocks' x rows (a panel block's panels are gathered by the threads of its
  // work items).
#pragma omp for schedule(dynamic, 1)
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const RowBlock& b = p.blocks[bi];
    if (b.panel) continue;
    float* xs = p.xs + b.s0 * H;
    for (int64_t r = b.r0; r < b.r1; ++r)
      stage_row(hidden + p.token_of_row[r] * H, H, xs + (r - b.r0) * H);
  }

  float* xpanels = p.scratch + omp_get_thread_num() * p.scratch_size;   // one panel block's
  float* scratch = xpanels + p.x_size;
  float* wide = xpanels + p.scratch_size - p.wide_size;   // bfloat16 weights' widened tile
  const int64_t half = (p.scratch_size - p.x_size - p.wide_size) / 2;
  int64_t gathered = -1;   // the panel block whose x panels are in xpanels
  const int64_t tile_i = p.tile_i, tiles_i = p.tiles_i, num_i = num_blocks * tiles_i;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_i; ++item) {
    const int64_t bi = item / tiles_i;
    const RowBlock& b = p.blocks[bi];
    const int64_t n0 = (item % tiles_i) * tile_i, n = std::min(I, n0 + tile_i) - n0;
    const int64_t rows = b.r1 - b.r0;
    const TW* w_gate = w13 + (b.expert * 2 * I + n0) * H;
    const TW* w_up = w_gate + I * H;
    if (b.panel) {
      if (gathered != bi) {
        gather_panels(hidden, p.token_of_row.data() + b.r0, rows, H, xpanels);
        gathered = bi;
      }
      const int64_t num_panels = (rows + kPanel - 1) / kPanel;
      // The next item's gate tile streams in during the gate products, its up tile during the
      // up products (its rows n0' .. of gate and of up, each contiguous).
      TileStream next_gate, next_up;
      if (item + 1 < num_i) {
        const RowBlock& nb = p.blocks[(item + 1) / tiles_i];
        const int64_t m0 = ((item + 1) % tiles_i) * tile_i, mn = std::min(I, m0 + tile_i) - m0;
        const TW* g = w13 + (nb.expert * 2 * I + m0) * H;
        const int64_t bytes = mn * H * static_cast<int64_t>(sizeof(TW));
        const int64_t steps = item_k_steps(num_panels, n, H);
        next_gate = item_stream(g, bytes, steps);
        next_up = item_stream(g + I * H, bytes, steps);
      }
      const float* wg = widen(w_gate, n * H, wide);
      const float* wu = widen(w_up, n * H, wide + n * H);
      float* gate = scratch;
      float* up = scratch + half;
      for (int64_t q = 0; q < num_panels;) {
        const int64_t np = step_panels(q, num_panels);
        const float* panel = xpanels + q * kPanel * H;
        panel_gemm(wg, H, panel, np, n, gate, next_gate);
        panel_gemm(wu, H, panel, np, n, up, next_up);
        for (int64_t pp = 0; pp < np; ++pp)
          silu_mul<TA>(gate + pp * n * kPanel, up + pp * n * kPanel, n * kPanel,
                       p.ap + (b.s0 + (q + pp) * kPanel) * I + n0 * kPanel);
        q += np;
      }
      continue;
    }
    // gate / up in float32, rounded to TA by `silu_mul` (as a TA store would round them)
    float* gate = scratch;
    float* up = scratch + half;
    const float* x = p.xs + b.s0 * H;
    tile_gemm(x, H, rows, w_gate, H, n, gate, tile_i);
    tile_gemm(x, H, rows, w_up, H, n, up, tile_i);
    for (int64_t r = 0; r < rows; ++r)
      silu_mul<TA>(gate + r * tile_i, up + r * tile_i, n, p.act + (b.s0 + r) * I + n0);
  }

  const int64_t tile_h = p.tile_h, tiles_h = p.tiles_h, num_h = num_blocks * tiles_h;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_h; ++item) {
    const RowBlock& b = p.blocks[item / tiles_h];
    const int64_t n0 = (item % tiles_h) * tile_h, n = std::min(H, n0 + tile_h) - n0;
    const TW* w = w2 + (b.expert * H + n0) * I;
    if (!b.panel) {
      tile_gemm(p.act + b.s0 * I, I, b.r1 - b.r0, w, I, n, p.ys + b.r0 * H + n0, H);
      continue;
    }
    const int64_t num_panels = (b.r1 - b.r0 + kPanel - 1) / kPanel;
    TileStream next;   // the next item's down tile (contiguous rows of w2)
    if (item + 1 < num_h) {
      const RowBlock& nb = p.blocks[(item + 1) / tiles_h];
      const int64_t m0 = ((item + 1) % tiles_h) * tile_h, mn = std::min(H, m0 + tile_h) - m0;
      next = item_stream(w2 + (nb.expert * H + m0) * I,
                         mn * I * static_cast<int64_t>(sizeof(TW)),
                         item_k_steps(num_panels, n, I));
    }
    const float* wd = widen(w, n * I, wide);
    for (int64_t q = 0; q < num_panels;) {
      const int64_t np = step_panels(q, num_panels);
      panel_gemm(wd, I, p.ap + (b.s0 + q * kPanel) * I, np, n, scratch, next);
      for (int64_t pp = 0; pp < np; ++pp) {
        const int64_t r0 = b.r0 + (q + pp) * kPanel, rows = std::min(kPanel, b.r1 - r0);
        // NOTE(moe): a 16 x 16 register transpose here (as `gather_panels`) measured 5-9%
        // slower per prefill block than this loop (docs/benchmarks.md, "The MoE kernel in
        // float32"): the loop writes each output row's columns in one run.
        const float* c = scratch + pp * n * kPanel;
        for (int64_t r = 0; r < rows; ++r) {
          TA* y = p.ys + (r0 + r) * H + n0;
          for (int64_t j = 0; j < n; ++j) store(c[j * kPanel + r], y + j);
        }
      }
      q += np;
    }
  }
}

// acc[c - c0] = sum_j rounded(ys[pos[t, j], c] * w[t, j]) for columns [c0, c1), float32, slot
// by slot (phase 4 of one token's column chunk).
template <typename TA>
void routed_sum(const Plan<TA>& p, const float* topk_weights, int64_t top_k, int64_t t,
                int64_t c0, int64_t c1, float* acc) {
  std::fill(acc, acc + (c1 - c0), 0.f);
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t row = p.pos[t * top_k + j];
    if (row < 0) continue;
    const float wt = topk_weights[t * top_k + j];
    const TA* y = p.ys + row * p.H;
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] += rounded<TA>(to_float(y[c]) * wt);
  }
}

}  // namespace moe
}  // namespace pagedllm
