"""The native library's ABI, written once: every struct shared with C, every entry point's
signature and the ABI version.

The declarations below are C. `c_header()` turns them into the header every source includes
(`pagedllm_abi.h`, written next to the build, never committed), so the compiler checks each
entry point's definition against its declaration here (a C-linkage function defined with
other parameter types does not compile) and the sources use these struct definitions, not
copies; `declare(lib)` and `struct(name)` turn the same text into the ctypes argument types
and `ctypes.Structure` mirrors. Pointers cross as addresses (`c_void_p`): callers pass
`tensor.data_ptr()`, `array.ctypes.data` or `ctypes.addressof(structure)`.

Units and layouts are in the comments of each declaration; the kernels' algorithms are in the
headers of `csrc/`.
"""

from __future__ import annotations

import ctypes
import functools
import re

# Bump when a declaration below changes (the loaded library reports the version it was
# compiled with; a stale library in the cache is refused).
ABI_VERSION = 24

STRUCTS = """
/* One weight's rows of one GGML type (layers/quantization/gguf.py `kernel_segments`). */
struct GGUFSegment {
  const uint8_t* data;   /* rows * row_bytes bytes: plain rows, or grouped (gguf_blocks.h) */
  int64_t row_start;     /* first output row of the weight */
  int64_t rows;
  int64_t ggml_type;     /* GGML type code */
  int64_t grouped;       /* 1: the first rows / 4 * 4 rows are in row groups */
};

/* One MLA prefill in the expanded form (cpu_mla_prefill.cpp): query token i of request r
   (positions seq_lens[r] - q_len + i) attends causally to context positions c, whose keys are
   [kv_nope[ctx_start[r] + c, h, :nope_size] | k_pe row ctx_start[r] + c] and values
   kv_nope[ctx_start[r] + c, h, nope_size:]. */
struct MLAExpandedPrefillArgs {
  const void* q_nope;              /* [num_tokens, num_heads, nope_size] (dtype), strided */
  const void* q_pe;                /* [num_tokens, num_heads, rope_size] (dtype), strided */
  int64_t q_nope_strides[2];       /* token and head strides of q_nope, in elements */
  int64_t q_pe_strides[2];         /* the same for q_pe */
  const void* kv_nope;             /* [num_ctx, num_heads, nope_size + v_size] (dtype) */
  const void* k_pe;                /* num_ctx rows k_pe_stride apart, rope_size each (dtype) */
  int64_t k_pe_stride;             /* in elements */
  const int64_t* ctx_start;        /* [num_reqs]: row of each request's context position 0 */
  const int32_t* query_start_loc;  /* [num_reqs + 1] */
  const int32_t* seq_lens;         /* [num_reqs] */
  const int32_t* rows;             /* [num_rows]: the requests to compute */
  int32_t num_rows;
  int32_t num_heads;
  int32_t nope_size;               /* qk_nope_head_dim */
  int32_t rope_size;               /* qk_rope_head_dim */
  int32_t v_size;                  /* v_head_dim, a multiple of 4 */
  int32_t query_tile;              /* query tokens per work item */
  int32_t dtype;                   /* 0 float32, 1 bfloat16 */
  float scale;                     /* softmax scale */
  float* out;                      /* [num_tokens, num_heads, v_size] float32 */
};

/* One paged-attention call (cpu_attention.cpp): the step's queries over the KV cache. */
struct PagedAttentionArgs {
  const float* query;              /* [num_tokens, num_heads, head_size] */
  const void* key_cache;           /* [num_blocks, block_size, num_kv_heads, head_size] */
  const void* value_cache;         /* same */
  const float* k_scales;           /* int8 caches: [num_blocks, block_size, num_kv_heads] */
  const float* v_scales;           /* same; null otherwise */
  float k_scale;                   /* fp8 caches: the per-tensor scales; 1 otherwise */
  float v_scale;
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  int64_t block_table_stride;
  const int32_t* query_start_loc;  /* [num_reqs + 1] */
  const int32_t* seq_lens;         /* [num_reqs] */
  const int64_t* attend_until;     /* [num_tokens] each query's last visible key position
                                      (causal; Gemma 3's image tokens: their image's last
                                      one), or null: its own position */
  const int32_t* rows;             /* [num_rows]: the requests to compute */
  int32_t num_rows;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int32_t causal;
  int32_t window;                  /* sliding window in tokens; 0: none */
  float scale;                     /* softmax scale */
  float soft_cap;                  /* logit soft-capping; 0: none */
  int32_t query_tile;              /* query tokens per work item; 0: the default; 1: every
                                      token on the per-token path (batch-invariant mode) */
  int32_t cache_dtype;             /* 0 float32, 1 bfloat16, 2 int8, 3 float8 e4m3fn */
  float* out;                      /* [num_tokens, num_heads, head_size] */
};

/* One decoder layer's weights and KV cache (cpu_decoder.cpp, native/fused_decoder.py). The
   arrays of 4 are per linear: qkv, o, gate_up, down. */
struct DecoderLayerWeights {
  const void* input_norm;          /* [hidden] model dtype */
  const void* post_norm;
  const void* qkv;                 /* float [N, K] or packed panels, or int8 [N, K] */
  const float* qkv_bias;           /* [N] float32 or null, likewise below */
  const void* q_norm;              /* [head_size] or null (Qwen3) */
  const void* k_norm;
  const void* o;
  const float* o_bias;
  const void* gate_up;
  const float* gate_up_bias;
  const void* down;
  const float* down_bias;
  void* key_cache;                 /* [num_blocks, block_size, num_kv_heads, head_size] */
  void* value_cache;
  const float* cos_cache;          /* [max_position, head_size / 2] */
  const float* sin_cache;
  int64_t hidden_size;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t intermediate_size;
  float eps;
  float scale;
  const GGUFSegment* segments[4];  /* GGUF row segments; num_segments 0: the float weight */
  int64_t num_segments[4];
  const float* int8_scales[4];     /* non-null: the weight is int8 [N, K] with these scales */
  int64_t int8_activations[4];     /* 1: W8A8 (x quantized per token) */
  int64_t gguf_q8_activations[4];  /* 1: x rounded to 8 bits per block (integer dots) */
  int64_t packed[4];               /* 1: float weight in packed GEMM panels */
  const struct LoRALinearWeights* lora;  /* [4] per linear as above, or null: no adapters */
};

/* One DeepSeek MLA attention block's weights and latent cache (cpu_mla_decoder.cpp,
   native/mla_decoder.py). Float weights [N, K] in the model dtype, or packed GEMM panels
   where `packed` says so (per linear: q_proj or q_a_proj, q_b_proj, kv_a_proj_with_mqa,
   o_proj). */
struct MLALayerWeights {
  const void* input_norm;          /* [hidden] model dtype */
  const void* post_norm;           /* [hidden] */
  const void* q_proj;              /* [H * (dn + dr), hidden], or q_a_proj [q_lora, hidden] */
  const void* q_a_norm;            /* [q_lora] or null: no q_lora (q_proj above) */
  const void* q_b_proj;            /* [H * (dn + dr), q_lora] or null */
  const void* kv_a_proj;           /* [L + dr, hidden] */
  const void* kv_a_norm;           /* [L] */
  const void* kv_b;                /* [H, dn + dv, L] (W_UK rows, then W_UV rows, per head) */
  const void* o_proj;              /* [hidden, H * dv] */
  void* latent_cache;              /* [num_blocks, block_size, L + dr] model dtype */
  const float* cos_cache;          /* [max_position, dr / 2] float32 (attention factor in) */
  const float* sin_cache;
  int64_t hidden_size;
  int64_t num_heads;
  int64_t q_lora_rank;             /* 0: none */
  int64_t kv_lora_rank;            /* L */
  int64_t qk_nope_head_dim;        /* dn */
  int64_t qk_rope_head_dim;        /* dr */
  int64_t v_head_dim;              /* dv */
  int64_t rope_interleaved;        /* 1: pairs (x0, x1), ...; 0: GPT-NeoX halves */
  int64_t packed[4];               /* 1: that linear's weight is packed GEMM panels */
  float eps;                       /* input / post norms */
  float latent_eps;                /* q_a / kv_a norms */
  float scale;                     /* softmax scale */
};

/* One step of the native attention blocks (cpu_mla_decoder.cpp, cpu_gdn_decoder.cpp), shared
   by a step's layers of one kind. */
struct NativeAttentionStep {
  int64_t num_tokens;
  const int64_t* positions;        /* [num_tokens] */
  const int64_t* slot_mapping;     /* [num_tokens]; negative: do not write */
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  int64_t block_table_stride;
  const int32_t* query_start_loc;  /* [num_reqs + 1] */
  const int32_t* seq_lens;         /* [num_reqs] */
  const int32_t* rows;             /* [num_rows] the requests (all of the step's) */
  int32_t num_rows;
  int32_t block_size;
  int32_t causal;
  int32_t query_tile;              /* as PagedAttentionArgs.query_tile; 0: the default */
  float* scratch;                  /* float32, num_tokens * mla_step_scratch_floats(..) */
};

/* One Qwen3-Next Gated DeltaNet layer's token mixer with its norms (cpu_gdn_decoder.cpp,
   native/gdn_decoder.py). Float weights [N, K] in the model dtype, or packed GEMM panels where
   `packed` says so (per linear: in_proj, out_proj). The four input projections are one
   weight, so that a step runs them as one GEMM. */
struct GDNLayerWeights {
  const void* input_norm;          /* [hidden] zero-centred: x * (1 + w) (GemmaRMSNorm) */
  const void* post_norm;           /* [hidden] likewise */
  const void* in_proj;             /* [2 Hk dk + 2 Hv dv + 2 Hv, hidden]: rows q | k | v | z | b | a */
  const void* out_proj;            /* [hidden, Hv * dv] */
  const float* conv_weight;        /* [conv_dim, conv_kernel] float32 */
  const float* neg_a;              /* [Hv] float32: -exp(A_log) */
  const float* dt_bias;            /* [Hv] float32 */
  const void* norm_weight;         /* [dv] model dtype (the gated RMSNorm's plain weight) */
  void* conv_states;               /* [num_slots, conv_dim, conv_kernel - 1] */
  float* recurrent_states;         /* [num_slots, Hv, dk, dv] float32 */
  int64_t hidden_size;
  int64_t num_k_heads;
  int64_t num_v_heads;
  int64_t head_k_dim;
  int64_t head_v_dim;
  int64_t conv_kernel;
  int64_t conv_state_dtype;        /* 0 float32, 1 bfloat16 */
  int64_t packed[2];
  float eps;                       /* input / post norms */
  float norm_eps;                  /* the gated RMSNorm */
};

/* One Qwen3-Next gated-attention layer's attention with its norms (cpu_gdn_decoder.cpp,
   native/gdn_decoder.py); linears as GDNLayerWeights' (packed: q, k, v, o). */
struct GatedAttentionWeights {
  const void* input_norm;          /* [hidden] zero-centred (GemmaRMSNorm) */
  const void* post_norm;
  const void* q_proj;              /* [H * 2 * D, hidden]: per head [q | gate] */
  const void* k_proj;              /* [KVH * D, hidden] */
  const void* v_proj;
  const void* o_proj;              /* [hidden, H * D] */
  const void* q_norm;              /* [D] zero-centred, per head */
  const void* k_norm;
  void* key_cache;                 /* [num_blocks, block_size, KVH, D] model dtype */
  void* value_cache;
  const float* cos_cache;          /* [max_position, rotary_dim / 2] float32 */
  const float* sin_cache;
  int64_t hidden_size;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t rotary_dim;              /* the first rotary_dim channels rotated (GPT-NeoX halves) */
  int64_t packed[4];
  float eps;
  float scale;
};

/* One mixture-of-experts block for cpu_moe_block.cpp (native/moe_block.py): router, routing,
   routed experts, shared expert. Dtype codes: 0 float32, 1 bfloat16. */
struct MoeBlockWeights {
  const void* router;              /* [num_experts, hidden] (packed or not); logits rounded to
                                      its dtype */
  int32_t router_dtype;
  int32_t router_packed;           /* 1: in the packed GEMM's panels (packed_gemm.h) */
  int32_t scoring;                 /* 0 softmax, 1 sigmoid */
  int32_t topk_method;             /* 0 top-k of all, 1 group-limited (group max),
                                      2 noaux_tc (group: sum of its top 2) */
  int32_t n_group;                 /* groups (methods 1, 2) */
  int32_t topk_group;              /* groups kept */
  int32_t renormalize;             /* 1: weights / their sum (sigmoid: sum + 1e-20) */
  float routed_scaling_factor;     /* multiplies the weights */
  const float* score_bias;         /* [num_experts] e_score_correction_bias, or null */
  const void* w13;                 /* [num_experts, 2 * intermediate, hidden] */
  const void* w2;                  /* [num_experts, hidden, intermediate] */
  int32_t expert_dtype;
  int64_t num_experts;
  int64_t top_k;
  int64_t intermediate;
  const void* shared_gate_up;      /* [2 * shared_intermediate, hidden] (packed or not), or
                                      null: no shared expert */
  const void* shared_down;         /* [hidden, shared_intermediate] */
  int32_t shared_dtype;
  int32_t shared_packed;           /* 1: both in the packed GEMM's panels (packed_gemm.h) */
  int64_t shared_intermediate;
  const void* shared_gate;         /* [hidden] the shared expert's sigmoid gate, or null */
  int32_t shared_gate_dtype;
};

/* One step of the fused decoder over its buffers (cpu_decoder.cpp). */
struct DecoderStep {
  int64_t num_tokens;
  const int64_t* positions;        /* [num_tokens] */
  const int64_t* slot_mapping;     /* [num_tokens]; negative: do not write */
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  int64_t block_table_stride;
  const int32_t* query_start_loc;  /* [num_reqs + 1] */
  const int32_t* seq_lens;         /* [num_reqs] */
  int32_t num_reqs;
  int32_t block_size;
  int32_t causal;
  int32_t query_tile;              /* as PagedAttentionArgs.query_tile */
  void* residual;                  /* [num_tokens, hidden] model dtype, updated in place */
  float* delta;                    /* [num_tokens, hidden]: the previous layer's output; out */
  float* normed;                   /* [num_tokens, hidden] scratch */
  float* qkv_out;                  /* [num_tokens, q_size + 2 * kv_size] scratch */
  float* attn_out;                 /* [num_tokens, q_size] scratch */
  float* gate_up_out;              /* [num_tokens, 2 * intermediate] scratch */
  float* act;                      /* [num_tokens, intermediate] scratch */
  const struct LoRAStepArgs* lora; /* the step's adapter tokens, or null: none */
};

/* One decoder layer of a DeepSeek-V2/V3 / GLM-4-MoE or Qwen3-Next stack (cpu_hybrid_stack.cpp,
   native/hybrid_stack.py): its first half's structure and its MLP half's. */
struct HybridLayer {
  int64_t kind;                    /* 0 MLA attention (MLALayerWeights), 1 Gated DeltaNet
                                      (GDNLayerWeights), 2 gated attention
                                      (GatedAttentionWeights) */
  const void* mixer;               /* the first half's structure, of `kind` */
  const struct MoeBlockWeights* mlp;  /* the MLP half (a dense SiLU MLP: no routed experts,
                                      the MLP as the shared expert) */
};

/* One step of a hybrid stack over n tokens; buffers [n, hidden] in the model dtype. */
struct HybridStep {
  int64_t num_tokens;
  int64_t hidden_size;
  int64_t dtype;                   /* 0 float32, 1 bfloat16 */
  const struct NativeAttentionStep* mla_step;        /* MLA layers' step, or null */
  const struct NativeAttentionStep* attention_step;  /* gated-attention layers' step, or null */
  const struct StateBatch* state_batch;              /* Gated DeltaNet layers' batch, or null */
  float* state_scratch;            /* Gated DeltaNet scratch (num_tokens * gdn_scratch_floats) */
  void* stream;                    /* kind 0: the residual stream (in: the embeddings);
                                      kinds 1, 2: the hidden stream (in and out) */
  void* hidden;                    /* kind 0: the last layer's MLP output (out; in with
                                      add_first); kinds 1, 2: scratch */
  void* normed;                    /* scratch */
  void* mlp_out;                   /* scratch (kinds 1, 2) */
  int64_t add_first;               /* kind 0: `hidden` holds a delta to add first */
  const void* final_norm;          /* kinds 1, 2: the final GemmaRMSNorm's weight [hidden]
                                      (model dtype): after the last layer, `out` =
                                      gemma_rms(stream); or null: none */
  float final_norm_eps;
  void* out;                       /* with final_norm: the final-normed rows (out) */
};

/* An embedding table or LM head for the decode loop (cpu_decode_loop.cpp); kind 0 dense rows,
   1 packed panels, 2 GGUF segments on float activations, 3 on 8-bit activations. */
struct VocabWeight {
  int64_t kind;
  int64_t dtype;                   /* 0 float32, 1 bfloat16 (dense / packed) */
  const void* data;                /* dense / packed weight */
  const GGUFSegment* segments;     /* GGUF */
  int64_t num_segments;
  int64_t rows;
  int64_t cols;
};

/* A greedy decode round (cpu_decode_loop.cpp); buffers of num_reqs rows, one token each. */
struct DecodeLoopArgs {
  const DecoderLayerWeights* layers;  /* [num_layers] */
  int64_t num_layers;
  const DecoderStep* step;         /* over the buffers below */
  int64_t dtype;                   /* model dtype: 0 float32, 1 bfloat16 */
  int64_t num_reqs;
  int64_t hidden;
  int64_t block_size;
  int64_t block_table_stride;
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  const int32_t* attention_rows;   /* [num_reqs] 0 .. num_reqs - 1 */
  int64_t* positions;              /* [num_reqs], advanced here */
  int64_t* slot_mapping;           /* [num_reqs] */
  int32_t* seq_lens;               /* [num_reqs] */
  void* residual;                  /* [num_reqs, hidden] model dtype */
  float* delta;                    /* [num_reqs, hidden] */
  void* normed;                    /* [num_reqs, hidden] model dtype */
  float* head_x;                   /* [num_reqs, hidden] */
  float* logits;                   /* [num_reqs, vocab] */
  float* embed_f32;                /* [num_reqs, hidden] */
  VocabWeight embedding;
  VocabWeight head;
  const void* norm_weight;         /* [hidden] model dtype */
  float norm_eps;
  const int64_t* stop_offsets;     /* row b's stop tokens: stop_ids[stop_offsets[b] ..
                                      stop_offsets[b + 1]) */
  const int64_t* stop_ids;
  const struct HybridLayer* hybrid_layers;  /* [num_layers] a DeepSeek (kind 0) or Qwen3-Next
                                      (kinds 1, 2) stack run by hybrid_decoder_layers instead
                                      of `layers` / `step`, or null; DeepSeek: `residual` is
                                      hybrid_step->stream and `delta` its `hidden` (float32
                                      models only) */
  const struct HybridStep* hybrid_step;  /* with a Qwen3-Next stack (kinds 1, 2) its
                                      final_norm is set: `residual` is its stream, `normed` its
                                      `out`, `delta` unused */
  const int32_t* state_table;      /* [num_reqs, state_table_stride] the state group's block
                                      table in prefix caching's "align" mode: each step's slot
                                      is column position / block_size, copied first from the
                                      previous column's where they differ; or null: the slots
                                      in `state_indices` stay */
  int64_t state_table_stride;
  int64_t* state_indices;          /* [num_reqs] the Gated DeltaNet layers' StateBatch slots
                                      (hybrid_step->state_batch->state_indices), set per step
                                      with state_table */
  const int64_t* aux_layers;       /* [num_aux] non-decreasing layer indices < num_layers
                                      (EAGLE-3's auxiliary layers; `layers` stacks only), or
                                      null: the step's stream entering each of them is copied
                                      to `aux_out` */
  int64_t num_aux;
  void* aux_out;                   /* [num_reqs, num_aux * hidden] model dtype: row b holds
                                      the streams entering aux_layers[0], [1], ... of the last
                                      step run */
};

/* One linear layer's adapter slots (lora_kernel.h, lora/layers.py): width = num_slices *
   max_rank; slice i of a merged layer (qkv, gate_up) owns A rows / B^T rows [i max_rank,
   (i + 1) max_rank) and output columns [slice_end[i - 1], slice_end[i]). */
struct LoRALinearWeights {
  const void* lora_a;              /* [max_loras, width, in_features] */
  const void* lora_b;              /* [max_loras, width, out_features] (B^T per slot) */
  int64_t dtype;                   /* 0 float32, 1 bfloat16 */
  int64_t in_features;
  int64_t out_features;
  int64_t max_rank;
  int64_t num_slices;              /* 1 to 3 */
  int64_t slice_end[3];
};

/* One step's adapter tokens by slot (lora/ops.py LoRAMapping). */
struct LoRAStepArgs {
  const int64_t* token_indices;    /* [num_lora_tokens] batch rows, sorted by slot */
  const int64_t* segments;         /* [num_segments, 4]: slot, start, end (into token_indices),
                                      the slot's adapter rank */
  int64_t num_segments;
};

/* The varlen batch of one recurrent-layer call (cpu_state_scan.cpp); requests contiguous. */
struct StateBatch {
  const int64_t* query_start_loc;  /* [num_reqs + 1] */
  const int64_t* state_indices;    /* [num_reqs] each request's state slot */
  const uint8_t* has_initial_state;  /* [num_reqs] 0: the request starts from a zero state */
  int64_t num_reqs;
  int64_t num_slots;               /* slots of the state tensors (index bound) */
  const int64_t* emit_start;       /* [num_reqs + 1] each request's run of emit_offset /
                                      emit_slot, or null: no emits */
  const int64_t* emit_offset;      /* [num_emits] ascending inside a request: a token's index
                                      in its request's query; the state after it is copied ... */
  const int64_t* emit_slot;        /* [num_emits] ... to this slot (block-boundary checkpoints;
                                      0, the null slot: none) */
};

/* One DSA indexer call (cpu_dsa.cpp): each decode row's top-k context positions. */
struct DSAIndexerArgs {
  const float* q;                  /* [num_tokens, n_heads, head_dim] indexer queries (RoPE,
                                      and in C8 the Hadamard rotation, applied) */
  const float* weights;            /* [num_tokens, n_heads] head weights (n_heads^-0.5 in) */
  const void* k_cache;             /* [num_slots] rows: head_dim float32 / bfloat16 values, or
                                      C8: head_dim int8 / fp8 e4m3 bytes + a float32 scale */
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  int64_t block_table_stride;
  const int32_t* seq_lens;         /* [num_reqs] context length including the query */
  const int32_t* rows;             /* [num_rows] the decode rows' requests */
  const int64_t* tokens;           /* [num_rows] each row's query token (index into q) */
  int32_t num_rows;
  int32_t n_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t topk;
  int32_t cache_dtype;             /* 0 float32, 1 bfloat16, 2 int8, 3 float8 e4m3fn */
  float scale;                     /* head_dim^-0.5 */
  int64_t* out;                    /* [num_rows, topk] positions, increasing, -1 padded */
};

/* One sparse MLA decode call (cpu_dsa.cpp): absorbed queries over their selected latents. */
struct SparseMLADecodeArgs {
  const float* q;                  /* [num_rows, num_heads, latent_size] [W_UK^T q_nope | q_pe] */
  const void* latent_cache;        /* [num_slots, latent_size] float32 / bfloat16 */
  const int32_t* block_table;      /* [num_reqs, block_table_stride] */
  int64_t block_table_stride;
  const int32_t* rows;             /* [num_rows] requests */
  const int64_t* positions;        /* [num_rows, topk] context positions, -1 = none */
  int32_t num_rows;
  int32_t num_heads;
  int32_t latent_size;             /* kv_lora_rank + qk_rope_head_dim */
  int32_t kv_lora_rank;
  int32_t block_size;
  int32_t topk;
  int32_t cache_dtype;             /* 0 float32, 1 bfloat16 */
  float scale;                     /* softmax scale */
  float* out;                      /* [num_rows, num_heads, kv_lora_rank] */
};
"""

ENTRY_POINTS = """
int pagedllm_abi_version(void);

/* cpu_mla_decoder.cpp: one MLA attention block over a step (residual += delta; normed =
   rms_norm(residual); attention; residual += o_proj(..); out = rms_norm(residual) *
   post_norm); dtype 0 float32 / 1 bfloat16 (weights, residual, delta, out, latent cache).
   0, or -1 for a bad dtype. */
int mla_decoder_attention(const MLALayerWeights* w, const NativeAttentionStep* step,
                          void* residual, const void* delta, void* out, int dtype);
int64_t mla_step_scratch_floats(const MLALayerWeights* w);

/* cpu_gdn_decoder.cpp: a Gated DeltaNet layer's first half over a step (normed =
   gemma_rms(hidden); the mixer; hidden_out = hidden + mixer; post_normed =
   gemma_rms(hidden_out)); dtype 0 float32 / 1 bfloat16 (weights, hidden, hidden_out,
   post_normed). 0, or -1 for a state slot out of range or a bad dtype. */
int gdn_decoder_mixer(const GDNLayerWeights* w, const StateBatch* batch, int64_t num_tokens,
                      const void* hidden, void* hidden_out, void* post_normed, float* scratch,
                      int dtype);
int64_t gdn_scratch_floats(const GDNLayerWeights* w);
/* cpu_gdn_decoder.cpp: a gated-attention layer's first half likewise (hidden_out = hidden +
   o_proj(attention * sigmoid(gate)); post_normed); the step's scratch in step->scratch. */
int gated_attention_mixer(const GatedAttentionWeights* w, const NativeAttentionStep* step,
                          const void* hidden, void* hidden_out, void* post_normed, int dtype);
int64_t gated_attention_scratch_floats(const GatedAttentionWeights* w);

/* cpu_hybrid_stack.cpp: layers [0, num_layers) of a DeepSeek / Qwen3-Next stack over one
   step (each layer's two halves through the entry points above), then Qwen3-Next's final norm
   where step->final_norm is set. 0, or the first failing half's code. */
int hybrid_decoder_layers(const HybridLayer* layers, int num_layers, const HybridStep* step);

/* cpu_attention.cpp */
void paged_attention(const PagedAttentionArgs* args);

/* cpu_mla_prefill.cpp: 1 where this build has the kernel (AVX-512), else 0; the call returns
   0, -1 for bad sizes or dtype, -2 without the kernel. */
int mla_expanded_prefill_supported(void);
int mla_expanded_prefill(const MLAExpandedPrefillArgs* args);

/* cpu_decoder.cpp: the decoder layers of one step; add_rms_norm rows (dtype 0 float32 / 1
   bfloat16 for residual, weight and out). */
void decoder_layers(const DecoderLayerWeights* layers, int num_layers, const DecoderStep* step,
                    const int32_t* attention_rows, int num_attention_rows, int add_delta_first,
                    int dtype);
void add_rms_norm(void* residual, const float* delta, int64_t num_tokens, int64_t hidden,
                  const void* weight, float eps, void* out, int dtype);

/* cpu_decode_loop.cpp: returns the steps run, or < 0 for a bad input. */
int decode_greedy_steps(const DecodeLoopArgs* args, int64_t* tokens, int num_steps,
                        int64_t* out_tokens);

/* cpu_linear.cpp: y [M, N] = x [M, K] w [N, K]^T + bias */
void linear_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
                 int64_t N, const float* bias, float* y, int64_t ldy);
void linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N,
                const float* bias, float* y, int64_t ldy);
void linear_bf16_act(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
                     int64_t N, const float* bias, uint16_t* y, int64_t ldy);

/* cpu_packed_gemm.cpp (dtype 0 float32, 1 bfloat16) */
int packed_gemm_bf16_pairs(void);
/* The kernel reading bf16 pair panels: 1 vdpbf16ps, 2 widening FMAs (the same bits), 0 none
   (no pair panels in this build); the getter measures the choice on first use, the setter
   (form 1 or 2; returns the form now in use, or -1 changing nothing) overrides it. */
int packed_gemm_pairs_form(void);
int packed_gemm_set_pairs_form(int form);
void pack_linear_weight(const void* w, int64_t N, int64_t K, int dtype, void* out);
void unpack_linear_weight(const void* packed, int64_t N, int64_t K, int dtype, void* out);
int packed_weight_rows(const void* packed, int64_t N, int64_t K, int dtype, const int64_t* ids,
                       int64_t n, void* out);
void packed_linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                       int64_t N, const float* bias, float* y, int64_t ldy);
void packed_linear_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
                        int64_t N, const float* bias, float* y, int64_t ldy);
void packed_linear_bf16_act(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                            const uint16_t* w, int64_t N, const float* bias, uint16_t* y,
                            int64_t ldy);
double fma_peak_probe(int64_t iterations, int kind);

/* cpu_gguf_linear.cpp, cpu_gguf_q8_linear.cpp: 0, or < 0 for a type without a kernel */
int gguf_regroup_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes,
                      int64_t ggml_type, int inverse);
int linear_gguf_segments(const float* x, int64_t ldx, int64_t M, int64_t K,
                         const GGUFSegment* segments, int64_t num_segments, const float* bias,
                         float* y, int64_t ldy);
int dequantize_rows_gguf(const GGUFSegment* segment, int64_t K, const int64_t* ids,
                         int64_t num_ids, float* out);
int linear_gguf_segments_q8(const float* x, int64_t ldx, int64_t M, int64_t K,
                            const GGUFSegment* segments, int64_t num_segments,
                            const float* bias, float* y, int64_t ldy);
void quantize_rows_gguf_q8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q,
                           float* d, float* ds);
void quantize_rows_gguf_q8k(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* qk,
                            float* dk, int16_t* bsums);
int gguf_q8_dot_isa(void);

/* cpu_int8_linear.cpp */
void linear_int8_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
                     int64_t N, const float* scale, const float* bias, float* y, int64_t ldy);
void linear_w8a8_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
                     int64_t N, const float* scale, const float* bias, float* y, int64_t ldy);
void quantize_rows_int8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                        float* xs);

/* cpu_fused_moe.cpp: 0, or < 0 for a bad input */
int fused_moe_experts(const void* hidden, int act_dtype, int64_t num_tokens, int64_t H,
                      const void* w13, const void* w2, int weight_dtype, int64_t num_experts,
                      int64_t I, const int64_t* topk_ids, const float* topk_weights,
                      int64_t top_k, void* out);

/* cpu_moe_block.cpp: out [num_tokens, hidden] = the MoE block of hidden [num_tokens, hidden]
   (act_dtype 0 float32 / 1 bfloat16); 0, or -1 for an unknown dtype code */
int moe_block(const MoeBlockWeights* w, const void* hidden, int act_dtype, int64_t num_tokens,
              int64_t hidden_size, void* out);

/* cpu_lora.cpp: 0, or < 0 for a bad dtype (0 float32, 1 bfloat16) */
int lora_shrink(const void* x, int64_t ldx, int x_dtype, const LoRALinearWeights* w,
                const LoRAStepArgs* step, float* shrunk);
int lora_expand(const float* shrunk, const LoRALinearWeights* w, const LoRAStepArgs* step,
                void* y, int64_t ldy, int y_dtype);
/* cpu_state_scan.cpp: dtype 0 float32 / 1 bfloat16 activations (state_dtype likewise for the
   conv window; SSM and delta-rule states float32); 0, or -1 for a slot out of range. */
int causal_conv1d_varlen_cpu(const StateBatch* batch, const void* x, int64_t ldx,
                             int64_t channels, int64_t width, const float* weight,
                             const float* bias, void* conv_states, int state_dtype, int silu,
                             void* out, int dtype);
int ssd_scan_varlen_cpu(const StateBatch* batch, const void* x, const float* dt, const float* A,
                        const void* B, const void* C, const float* D, float* ssm_states,
                        int64_t H, int64_t P, int64_t G, int64_t N, float dt_min, float dt_max,
                        int clamp_prefill, int dtype, float* y);
int gated_delta_rule_varlen_cpu(const StateBatch* batch, const void* q, const void* k,
                                const void* v, const float* g, const float* beta,
                                float* states, int64_t H, int64_t Hk, int64_t dk, int64_t dv,
                                int dtype, float* out);
/* cpu_dsa.cpp: 0, or -1 for a bad input */
int dsa_indexer_topk(const DSAIndexerArgs* args);
int dsa_sparse_mla_decode(const SparseMLADecodeArgs* args);
"""

_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "int16_t": ctypes.c_int16, "uint8_t": ctypes.c_uint8, "float": ctypes.c_float,
            "double": ctypes.c_double}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def _ctype(decl_type: str):
    """The ctypes type of a C type of the declarations above: every pointer an address."""
    decl_type = decl_type.replace("const ", "").strip()
    if decl_type.endswith("*"):
        return ctypes.c_void_p
    if decl_type in _SCALARS:
        return _SCALARS[decl_type]
    return struct(decl_type)   # a struct member by value


def _split_decl(decl: str) -> tuple[str, str, int | None]:
    """'const float* query' -> ('const float*', 'query', None); 'int64_t x[4]' -> (.., 4)."""
    m = re.fullmatch(r"(.+?)\s*\b(\w+)\s*(?:\[(\d+)\])?", " ".join(decl.split()))
    if m is None:
        raise ValueError(f"abi: cannot read the declaration {decl!r}")
    return m.group(1), m.group(2), None if m.group(3) is None else int(m.group(3))


@functools.cache
def _struct_fields() -> dict[str, list[tuple[str, str, int | None]]]:
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\};", _strip_comments(STRUCTS), re.S):
        structs[name] = [_split_decl(d) for d in body.split(";") if d.strip()]
    return structs


@functools.cache
def struct(name: str) -> type[ctypes.Structure]:
    """The `ctypes.Structure` mirror of the C struct `name` (same fields, order and types).

    Raises:
        KeyError: no such struct in STRUCTS.
    """
    fields = []
    for decl_type, field, count in _struct_fields()[name]:
        ctype = _ctype(decl_type)
        fields.append((field, ctype if count is None else ctype * count))
    return type(name, (ctypes.Structure,), {"_fields_": fields,
                                            "__doc__": f"Mirror of `struct {name}` (abi.py)."})


@functools.cache
def entry_points() -> dict[str, tuple[object, list]]:
    """name -> (restype, argtypes) of every entry point."""
    out = {}
    for ret, name, params in re.findall(r"(\w+)\s+(\w+)\(([^)]*)\);",
                                        _strip_comments(ENTRY_POINTS)):
        params = params.strip()
        args = [] if params in ("", "void") else [_ctype(_split_decl(p)[0])
                                                   for p in params.split(",")]
        out[name] = (None if ret == "void" else _SCALARS[ret], args)
    return out


def declare(lib: ctypes.CDLL) -> None:
    """Set every entry point's restype and argtypes on the loaded library.

    Raises:
        AttributeError: the library lacks an entry point (built from other sources).
    """
    for name, (restype, argtypes) in entry_points().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def c_header() -> str:
    """The C header every source includes (`pagedllm_abi.h`): the version, the structs and the
    entry points' prototypes with C linkage."""
    return ("// Generated from pagedllm/native/kernels/abi.py at build time; do not edit.\n"
            "#pragma once\n#include <stdint.h>\n\n"
            f"#define PAGEDLLM_ABI_VERSION {ABI_VERSION}\n\n"
            "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
            + STRUCTS
            + ENTRY_POINTS
            + "#ifdef __cplusplus\n}\n#endif\n")
