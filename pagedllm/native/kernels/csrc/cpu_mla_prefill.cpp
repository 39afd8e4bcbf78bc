// MLA prefill in the expanded form on the CPU (attention/backends/mla_cpu.py,
// `_expanded_in_kernel`): causal multi-head attention whose keys and values are read straight
// from the expansion GEMM's output, with no padded per-head K/V copy.
//
// MLA (DeepSeek-V2, arXiv:2405.04434, sec. 2.1) expands a context position's latent [c_kv |
// k_pe] per head into k_h = [W_UK_h c_kv | k_pe] (dn + dr values) and v_h = W_UV_h c_kv (dv).
// The caller computes kv_nope = c_kv kv_b_proj^T ([num_ctx, H, dn + dv]: per head W_UK_h c_kv
// then W_UV_h c_kv) with one GEMM; k_pe stays where the gather left it (shared by the heads).
// Each work item is (request, tile of up to `query_tile` consecutive query tokens, head): the
// tile's query rows sit in vector lanes (attention_row_lanes.h: S^T = K Q^T and O^T += V^T
// P^T as outer products, the online softmax 16 rows per instruction; FlashAttention-2's loop,
// Dao 2023) and meet the context kGemmKeys positions at a time, each chunk's K rows assembled
// from kv_nope and k_pe (k_size = dn + dr values) and V rows from kv_nope (v_size = dv) in
// float32. Keys and values keep their own sizes: nothing is padded to a common head size.
//
//   q_nope [num_tokens, H, dn], q_pe [num_tokens, H, dr]      float32 or bfloat16 (dtype), any
//                                                             token / head strides
//   kv_nope [num_ctx, H, dn + dv]                             same dtype
//   k_pe rows k_pe_stride apart, dr values each               same dtype
//   out [num_tokens, H, dv]                                   float32 (rows of `rows` only)
//
// Query token i of request r sits at position p = seq_lens[r] - q_len + i and attends to the
// context positions [0, p], position c being row ctx_start[r] + c of kv_nope and k_pe.
// AVX-512 builds only (the lane kernels); elsewhere `mla_expanded_prefill_supported` is 0 and
// the caller runs the torch form.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <omp.h>

#include "attention_kernel.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

#ifdef PAGEDLLM_ATTENTION_ROW_LANES

// The tiles of the requests `rows`: (request, first token, tokens) per tile.
struct PrefillTiles {
  std::vector<int32_t> row, tok, len;
  int max_tile = 0;
};

PrefillTiles plan_tiles(const MLAExpandedPrefillArgs& a) {
  PrefillTiles p;
  const int tile = std::max(1, a.query_tile);
  for (int i = 0; i < a.num_rows; ++i) {
    const int r = a.rows[i];
    for (int t = a.query_start_loc[r]; t < a.query_start_loc[r + 1]; t += tile) {
      p.row.push_back(r);
      p.tok.push_back(t);
      p.len.push_back(std::min(tile, a.query_start_loc[r + 1] - t));
      p.max_tile = std::max(p.max_tile, p.len.back());
    }
  }
  return p;
}

template <typename T>
void expanded_prefill(const MLAExpandedPrefillArgs& a) {
  const PrefillTiles plan = plan_tiles(a);
  const int num_heads = a.num_heads, dn = a.nope_size, dr = a.rope_size, dv = a.v_size;
  const int k_size = dn + dr, kv_size = dn + dv;
  const int64_t num_items = static_cast<int64_t>(plan.row.size()) * num_heads;
  const T* q_nope = static_cast<const T*>(a.q_nope);
  const T* q_pe = static_cast<const T*>(a.q_pe);
  const T* kv_nope = static_cast<const T*>(a.kv_nope);
  const T* k_pe = static_cast<const T*>(a.k_pe);
  const AttentionArgs<float, float> plain{};   // lane_softmax's options: no scales, no cap
#pragma omp parallel
  {
    LaneTileScratch w(plan.max_tile, std::max(k_size, dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t tile = item / num_heads;
      const int h = static_cast<int>(item % num_heads);
      const int r = plan.row[tile], t0 = plan.tok[tile], nq = plan.len[tile];
      const int first_pos = a.seq_lens[r] - (a.query_start_loc[r + 1] - a.query_start_loc[r]) +
                            (t0 - a.query_start_loc[r]);
      const int groups = (nq + kRowLanes - 1) / kRowLanes;
      const int64_t ld = static_cast<int64_t>(groups) * kRowLanes;
      // Transpose the tile's scaled query rows in (padded rows: zero, no key).
      for (int64_t i = 0; i < ld; ++i) {
        const bool row = i < nq;
        const int64_t t = t0 + i;
        const T* qn = row ? q_nope + t * a.q_nope_strides[0] + h * a.q_nope_strides[1] : nullptr;
        const T* qp = row ? q_pe + t * a.q_pe_strides[0] + h * a.q_pe_strides[1] : nullptr;
        for (int d = 0; d < dn; ++d) w.qt[d * ld + i] = row ? to_float(qn[d]) * a.scale : 0.f;
        for (int d = 0; d < dr; ++d)
          w.qt[(dn + d) * ld + i] = row ? to_float(qp[d]) * a.scale : 0.f;
        for (int d = 0; d < dv; ++d) w.ot[d * ld + i] = 0.f;
        w.m[i] = -std::numeric_limits<float>::infinity();
        w.l[i] = 0.f;
        w.begin[i] = 0;
        w.end[i] = row ? first_pos + static_cast<int>(i) + 1 : 0;
      }
      const int hi = first_pos + nq;
      const int64_t ctx0 = a.ctx_start[r];
      for (int c0 = 0; c0 < hi; c0 += kGemmKeys) {
        const int n = std::min(kGemmKeys, hi - c0), n4 = (n + 3) / 4 * 4;
        for (int j = 0; j < n4; ++j) {   // the chunk's K and V rows of head h, in float32
          float* kd = w.k.data() + static_cast<int64_t>(j) * k_size;
          float* vd = w.v.data() + static_cast<int64_t>(j) * dv;
          if (j >= n) {
            std::fill(kd, kd + k_size, 0.f);
            std::fill(vd, vd + dv, 0.f);
            continue;
          }
          const int64_t c = ctx0 + c0 + j;
          const T* src = kv_nope + (c * num_heads + h) * kv_size;
          const T* pe = k_pe + c * a.k_pe_stride;
          for (int d = 0; d < dn; ++d) kd[d] = to_float(src[d]);
          for (int d = 0; d < dr; ++d) kd[dn + d] = to_float(pe[d]);
          for (int d = 0; d < dv; ++d) vd[d] = to_float(src[dn + d]);
        }
        for_row_groups(groups, [&](int g0, auto G) {
          for (int j = 0; j < n4; j += 4)
            lane_scores<decltype(G)::value>(w.qt.data() + g0 * kRowLanes,
                                            w.k.data() + static_cast<int64_t>(j) * k_size,
                                            k_size, w.st.data() + j * ld + g0 * kRowLanes, ld);
        });
        for (int g = 0; g < groups; ++g) lane_softmax(plain, w, ld, g * kRowLanes, c0, n4, dv);
        for_row_groups(groups, [&](int g0, auto G) {
          for (int d = 0; d < dv; d += 4)
            lane_values<decltype(G)::value>(w.ot.data() + d * ld + g0 * kRowLanes,
                                            w.st.data() + g0 * kRowLanes, w.v.data() + d, dv,
                                            n4, ld);
        });
      }
      for (int i = 0; i < nq; ++i) {   // transpose the rows out, normalised
        float* dst = a.out + (static_cast<int64_t>(t0 + i) * num_heads + h) * dv;
        const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
        for (int d = 0; d < dv; ++d) dst[d] = w.ot[d * ld + i] * inv;
      }
    }
  }
}

#endif  // PAGEDLLM_ATTENTION_ROW_LANES

}  // namespace

extern "C" {

int mla_expanded_prefill_supported(void) {
#ifdef PAGEDLLM_ATTENTION_ROW_LANES
  return 1;
#else
  return 0;
#endif
}

int mla_expanded_prefill(const MLAExpandedPrefillArgs* args) {
#ifdef PAGEDLLM_ATTENTION_ROW_LANES
  const MLAExpandedPrefillArgs& a = *args;
  if (a.v_size % 4 != 0 || a.nope_size <= 0 || a.rope_size < 0 || a.num_heads <= 0) return -1;
  switch (a.dtype) {
    case 0: expanded_prefill<float>(a); return 0;
    case 1: expanded_prefill<uint16_t>(a); return 0;
    default: return -1;
  }
#else
  (void)args;
  return -2;
#endif
}

}  // extern "C"
