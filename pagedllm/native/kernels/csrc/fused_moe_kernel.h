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
//   1. gather    xs[row] = x[token of row] for the dot-product blocks       [m, H]
//   2. gate/up   per work item (expert, block of its rows, tile of intermediate columns):
//                gate and up tiles by the dot-product micro-kernels (moe_few_rows.h;
//                experts with < 32 rows: one block) or the panel form's packed tiles (more
//                rows: blocks of up to 256, every dtype, x rows staged per thread: see
//                "Panel form" below), then act[row, i] = silu(gate) * up      [m, I]
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
#include "packed_gemm.h"

namespace pagedllm {
namespace moe {

constexpr int64_t kMaxTile = 64;     // weight rows per work item (a tile stays in L2)
constexpr int64_t kCombineChunk = 256;
constexpr int64_t kPanel = 16;            // weight rows per panel of a packed tile
constexpr int64_t kPanelMinRows = 32;     // an expert with this many rows takes the panel form
// Most rows of one panel block: an expert's rows are cut into as few blocks as this allows, of
// nearly equal size. Each block streams the expert's weight tiles from memory once, so longer
// blocks read the weights fewer times: a 2048-token DeepSeek-V2-Lite step (192 rows per expert)
// had two 96-row blocks per expert, and the first pass of each waited on the weights.
constexpr int64_t kPanelRowBlock = 256;

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

// One expert's contiguous block of sorted rows [r0, r1): its act rows (float32) are rows
// [r0, r1) of act, its outputs rows [r0, r1) of ys; a dot-product block's x rows lie from row s0
// of xs (float32 holding TA values), a `panel` block's are staged per thread (s0 unused).
struct RowBlock {
  int64_t expert, r0, r1, s0;
  bool panel;
};

// Panel form (blocks of kPanelMinRows rows or more, every dtype): each work item (a block and a
// tile of up to kMaxTile weight rows) first packs its weight tile into a per-thread buffer in
// the packed GEMM's layout (packed_gemm.h: panels of kPanel rows, [K][kPanel] each, bfloat16
// widened to float32, which is exact; a last panel padded with zero rows), then runs
// packed_gemm.h's register tiles on it with the block's x rows as the broadcast operand
// (`packed::panel_rows`: 12 rows x 2 panels of 16 columns on AVX-512): the weight tile is read as
// one sequential stream per panel pair, its k slices stay in L1 while the block's rows pass
// over them, and the outputs come out as rows ([rows][tile]), so gate and up go through the SiLU
// pass row by row into act rows and the down outputs are ys rows, with no transposes. The x rows
// of a block are staged in float32 once per thread (contiguous, from the scattered token rows);
// each item's micro-kernel calls prefetch the next item's raw weight tile into L2 meanwhile
// (packed_gemm.h's `Prefetch`, one line per call step), so the pack reads it from L2, not
// DRAM. Each output is one k-ordered chain of FMAs starting from zero (the accumulators are
// stored and reloaded between k blocks), the same chain as the earlier form that broadcast the
// weights against transposed x panels, so the results have the same bits.
//
// A product of two bfloat16 values is exact in float32, so with bfloat16 weights each
// multiply-add rounds once, as in `vdpbf16ps` and oneDNN's bf16 GEMMs (which has half the
// float32 FMA rate on the CPUs this was measured on); only the summation order differs from
// the module path. With bfloat16 activations every intermediate is rounded where the module path
// rounds: gate, up, silu(gate), the product (`silu_mul`), the down output (its store to ys).

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
enum BufferSlot { kSlotXs, kSlotAct, kSlotYs, kSlotScratch, kSlotShared0, kSlotShared1,
                  kSlotShared2, kNumSlots };

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
  int64_t num_pairs = 0, m = 0, H = 0, I = 0, stored = 0;
  std::vector<int64_t> pos, token_of_row;   // [T*k] row or -1; [m] token
  std::vector<RowBlock> blocks;
  int64_t tile_i = 8, tile_h = 8, tiles_i = 0, tiles_h = 0;
  // Per thread scratch_size floats: the panel form's staged x rows (x_size: the longest panel
  // block's rows, [rows][H]) and packed weight tile (w_size: gate + up or down, padded to whole
  // panels), then both forms' output tiles.
  int64_t scratch_size = 0, x_size = 0, w_size = 0;
  // xs [stored, H] (dot-product blocks; float32 holding TA values, see `stage_row`), act [m, I]
  // (float32 holding TA values), ys [m, H], per thread scratch_size floats: buffers of the
  // thread that ran `plan` (`reused_buffer`), valid until it plans again
  TA* ys = nullptr;
  float *xs = nullptr, *act = nullptr, *scratch = nullptr;
};

// Blocks of kPanelMinRows rows or more take the panel form.
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
  p.stored = 0;
  int64_t panel_rows = 0;   // the longest panel block's
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows >= kPanelMinRows) {
      // ceil(rows / kPanelRowBlock) blocks of whole panels, the last one the shortest
      const int64_t count = (rows + kPanelRowBlock - 1) / kPanelRowBlock;
      const int64_t per = ((rows + count - 1) / count + kPanel - 1) / kPanel * kPanel;
      for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += per) {
        const int64_t r1 = std::min(offsets[e + 1], r0 + per);
        p.blocks.push_back({e, r0, r1, 0, true});
        panel_rows = std::max(panel_rows, r1 - r0);
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
  p.act = reused_buffer<float>(kSlotAct, p.m * I);
  p.ys = reused_buffer<TA>(kSlotYs, p.m * H);
  // Per thread: (panel blocks) the staged x rows and one packed gate + up tile or down tile
  // (tiles of at most kMaxTile rows: few_rows is false), then the output tiles: gate and up
  // ([rows][tile]: the dot-product form's rows < kPanelMinRows at tile_i columns, the panel
  // form's up to panel_rows at whole panels) or the panel form's down tile.
  const auto padded = [](int64_t n) { return (n + kPanel - 1) / kPanel * kPanel; };
  p.x_size = panel_rows * H;
  p.w_size = panel_rows > 0 ? std::max(2 * padded(p.tile_i) * H, padded(p.tile_h) * I) : 0;
  const int64_t out_size = std::max(kPanelMinRows * p.tile_i,
                                    panel_rows * padded(std::max(p.tile_i, p.tile_h)));
  p.scratch_size = p.x_size + p.w_size + 2 * out_size;
  p.scratch = reused_buffer<float>(kSlotScratch, p.scratch_size * num_threads);
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

// A weight tile w [n, K] (row-major, TW) packed as float32 panels at out (packed_gemm.h's plain
// layout: panel q holds rows [16q, 16q + 16) as [K][kPanel], at out + q * kPanel * K; a last
// panel padded with zero rows; bfloat16 widened, which is exact): AVX-512 16 x 16 blocks
// transposed in registers, the rest value by value.
template <typename TW>
void pack_tile(const TW* w, int64_t n, int64_t K, float* out) {
  for (int64_t p0 = 0; p0 < n; p0 += kPanel) {
    const int64_t rows = std::min(kPanel, n - p0);
    float* panel = out + p0 * K;
    const TW* src = w + p0 * K;
    int64_t k = 0;
#ifdef PAGEDLLM_AVX512
    for (; k + 16 <= K; k += 16) {
      __m512 v[16], t[16];
      for (int r = 0; r < 16; ++r) v[r] = r < rows ? load16(src + r * K + k) : _mm512_setzero_ps();
      transpose16(v, t);
      for (int c = 0; c < 16; ++c) _mm512_storeu_ps(panel + (k + c) * kPanel, t[c]);
    }
#endif
    for (; k < K; ++k)
      for (int64_t r = 0; r < kPanel; ++r)
        panel[k * kPanel + r] = r < rows ? to_float(src[r * K + k]) : 0.f;
  }
}

// c [rows][ldc] = x [rows][K] (row stride ldx, float32) times the packed tile w (np panels from
// `pack_tile`) transposed: packed_gemm.h's register tiles, in blocks of k when the rows' values
// exceed its whole-K size (the same rule as its `tiles`), each output one k-ordered chain of
// FMAs from zero. `next` (raw bytes of the next work item's weight tile, next_bytes long, or
// null) is prefetched into L2 by the micro-kernel calls: the calls over panel q's k block
// [k0, k0 + kc) take the bytes [q * kPanel * K + k0 * kPanel, ... + kc * kPanel) floats' worth,
// so the calls of the whole product cover np * kPanel * K * 4 bytes from next.
inline void panel_product(const float* x, int64_t ldx, int64_t rows, int64_t K, const float* w,
                          int64_t np, float* c, int64_t ldc, const char* next,
                          int64_t next_bytes) {
  using packed::Kernel;
  const int64_t ps = kPanel * K;
  const int64_t kblock = rows * K <= packed::kMaxWholeK ? K : packed::kKC;
  // panel q's share of the next tile from its k block k0 on (null past the tile's end)
  const auto ahead = [&](int64_t q, int64_t k0) -> const float* {
    const int64_t at = (q * ps + k0 * kPanel) * static_cast<int64_t>(sizeof(float));
    return next != nullptr && at < next_bytes ? reinterpret_cast<const float*>(next + at)
                                              : nullptr;
  };
  for (int64_t k0 = 0; k0 < K; k0 += kblock) {
    const int64_t kc = std::min(kblock, K - k0);
    const bool accumulate = k0 > 0;
    int64_t q = 0;
    for (; q + packed::kNP <= np; q += packed::kNP)
      packed::panel_rows<Kernel::kFloat, packed::kNP>(x + k0, ldx, rows, w + q * ps + k0 * kPanel,
                                                      ps, kc, c + q * kPanel, ldc, accumulate,
                                                      ahead(q, k0));
    for (; q < np; ++q)
      packed::panel_rows<Kernel::kFloat, 1>(x + k0, ldx, rows, w + q * ps + k0 * kPanel, ps, kc,
                                            c + q * kPanel, ldc, accumulate, ahead(q, k0));
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

// y[0, n) = c[0, n) in TA (bfloat16: rounded to nearest even, as `store`).
template <typename TA>
inline void store_row(const float* c, int64_t n, TA* y) {
  int64_t j = 0;
#ifdef PAGEDLLM_AVX2
  for (; j + 8 <= n; j += 8) store8(_mm256_loadu_ps(c + j), y + j);
#endif
  for (; j < n; ++j) store(c[j], y + j);
}

// The raw weight tile of a work item as bytes for `panel_product`'s prefetch: rows
// [n0, min(N, n0 + tile)) of the [N, K] matrix at w.
template <typename TW>
struct RawTile {
  const char* bytes = nullptr;
  int64_t size = 0;
  RawTile() = default;
  RawTile(const TW* w, int64_t n0, int64_t tile, int64_t N, int64_t K)
      : bytes(reinterpret_cast<const char*>(w + n0 * K)),
        size((std::min(N, n0 + tile) - n0) * K * static_cast<int64_t>(sizeof(TW))) {}
};

// Phases 1-3 for every thread of the enclosing parallel region (w13 [E, 2I, H], w2 [E, H, I]).
template <typename TA, typename TW>
void expert_phases(const TA* hidden, const TW* w13, const TW* w2, Plan<TA>& p) {
  const int64_t H = p.H, I = p.I;
  const int64_t num_blocks = static_cast<int64_t>(p.blocks.size());
  // The dot-product blocks' x rows (a panel block's are staged by the thread of its work item).
#pragma omp for schedule(dynamic, 1)
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const RowBlock& b = p.blocks[bi];
    if (b.panel) continue;
    float* xs = p.xs + b.s0 * H;
    for (int64_t r = b.r0; r < b.r1; ++r)
      stage_row(hidden + p.token_of_row[r] * H, H, xs + (r - b.r0) * H);
  }

  float* xrows = p.scratch + omp_get_thread_num() * p.scratch_size;   // [rows][H]
  float* wpack = xrows + p.x_size;                                     // packed tile(s)
  float* out = wpack + p.w_size;                                       // output tiles
  const int64_t half = (p.scratch_size - p.x_size - p.w_size) / 2;
  // The panel block whose x rows are in xrows: a block's work items follow each other in the
  // loop, so a thread mostly stages a block once rather than once per tile.
  int64_t staged = -1;
  const int64_t tile_i = p.tile_i, tiles_i = p.tiles_i;
  const int64_t num_i = num_blocks * tiles_i;
  const auto gate_tile = [&](int64_t item) {
    const RowBlock& b = p.blocks[item / tiles_i];
    return RawTile<TW>(w13 + b.expert * 2 * I * H, (item % tiles_i) * tile_i, tile_i, I, H);
  };
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_i; ++item) {
    const int64_t bi = item / tiles_i;
    const RowBlock& b = p.blocks[bi];
    const int64_t n0 = (item % tiles_i) * tile_i, n = std::min(I, n0 + tile_i) - n0;
    const int64_t rows = b.r1 - b.r0;
    const TW* w_gate = w13 + (b.expert * 2 * I + n0) * H;
    const TW* w_up = w_gate + I * H;
    float* gate = out;
    float* up = out + half;
    if (b.panel) {
      if (staged != bi) {
        for (int64_t r = 0; r < rows; ++r)
          stage_row(hidden + p.token_of_row[b.r0 + r] * H, H, xrows + r * H);
        staged = bi;
      }
      const int64_t np = (n + kPanel - 1) / kPanel, ldc = np * kPanel;
      float* pg = wpack;
      float* pu = wpack + ldc * H;
      pack_tile(w_gate, n, H, pg);
      pack_tile(w_up, n, H, pu);
      // the next item's gate tile during the gate product, its up tile during the up product
      RawTile<TW> next_gate, next_up;
      if (item + 1 < num_i) {
        next_gate = gate_tile(item + 1);
        next_up = next_gate;
        next_up.bytes += I * H * static_cast<int64_t>(sizeof(TW));
      }
      panel_product(xrows, H, rows, H, pg, np, gate, ldc, next_gate.bytes, next_gate.size);
      panel_product(xrows, H, rows, H, pu, np, up, ldc, next_up.bytes, next_up.size);
      for (int64_t r = 0; r < rows; ++r)
        silu_mul<TA>(gate + r * ldc, up + r * ldc, n, p.act + (b.r0 + r) * I + n0);
      continue;
    }
    // gate / up in float32, rounded to TA by `silu_mul` (as a TA store would round them)
    const float* x = p.xs + b.s0 * H;
    tile_gemm(x, H, rows, w_gate, H, n, gate, tile_i);
    tile_gemm(x, H, rows, w_up, H, n, up, tile_i);
    for (int64_t r = 0; r < rows; ++r)
      silu_mul<TA>(gate + r * tile_i, up + r * tile_i, n, p.act + (b.r0 + r) * I + n0);
  }

  const int64_t tile_h = p.tile_h, tiles_h = p.tiles_h;
  const int64_t num_h = num_blocks * tiles_h;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_h; ++item) {
    const RowBlock& b = p.blocks[item / tiles_h];
    const int64_t n0 = (item % tiles_h) * tile_h, n = std::min(H, n0 + tile_h) - n0;
    const int64_t rows = b.r1 - b.r0;
    const TW* w = w2 + (b.expert * H + n0) * I;
    if (!b.panel) {
      tile_gemm(p.act + b.r0 * I, I, rows, w, I, n, p.ys + b.r0 * H + n0, H);
      continue;
    }
    const int64_t np = (n + kPanel - 1) / kPanel, ldc = np * kPanel;
    pack_tile(w, n, I, wpack);
    RawTile<TW> next;
    if (item + 1 < num_h) {
      const RowBlock& nb = p.blocks[(item + 1) / tiles_h];
      next = RawTile<TW>(w2 + nb.expert * H * I, ((item + 1) % tiles_h) * tile_h, tile_h, H, I);
    }
    panel_product(p.act + b.r0 * I, I, rows, I, wpack, np, out, ldc, next.bytes, next.size);
    for (int64_t r = 0; r < rows; ++r) store_row(out + r * ldc, n, p.ys + (b.r0 + r) * H + n0);
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
