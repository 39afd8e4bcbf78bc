// C++ entry points of cpu_state_scan.cpp for the other kernels of the library (not part of
// the C ABI of pagedllm_abi.h).
#pragma once

#include <cstdint>

#include "pagedllm_abi.h"

namespace pagedllm {

// gated_delta_rule_varlen_cpu on float32 activations whose rows are strided: token t's q and
// k heads start at q + t * ld_qk and k + t * ld_qk ([Hk, dk] contiguous), its v heads at
// v + t * ldv ([H, dv] contiguous), so that q, k and v can be read in place from one row of a
// wider buffer (the Gated DeltaNet block's conv output [q | k | v]). out [num_tokens, H, dv]
// contiguous. Returns 0, or -1 when a request's slot (or an emit slot) is out of range.
int gated_delta_rule_rows(const StateBatch* batch, const float* q, const float* k, int64_t ld_qk,
                          const float* v, int64_t ldv, const float* g, const float* beta,
                          float* states, int64_t H, int64_t Hk, int64_t dk, int64_t dv,
                          float* out);

}  // namespace pagedllm
