"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint tensors and LongRoPE.

The layers are Llama's (RMSNorm, GQA attention, SwiGLU MLP, no biases). What differs:
  - the checkpoint stores `qkv_proj` and `gate_up_proj` fused; `load_weights` splits them into
    their q/k/v and gate/up parts, which go through the fused layers' weight loaders with shard
    ids, so each tensor-parallel rank gets its own heads and intermediate rows:

        checkpoint qkv_proj rows:     [ q: H*D | k: KVH*D | v: KVH*D ]
        checkpoint gate_up_proj rows: [ gate: I | up: I ]

  - RoPE may be "longrope" (alias "su") and partial (`partial_rotary_factor`); see
    `layers/rotary_embedding.py` for the tables and `Phi3ForCausalLM._rope_positions` for which
    table a token uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.layers.rotary_embedding import rope_parameters_from_hf
from pagedllm.models.llama import GGUF_TENSOR_NAMES, LlamaForCausalLM, gguf_to_hf_name

# llama.cpp's Phi-3 files keep the fused tensors: `attn_qkv` and `ffn_up` (gate and up rows).
PHI3_GGUF_TENSOR_NAMES = {**GGUF_TENSOR_NAMES,
                          "blk.{}.attn_qkv": "model.layers.{}.self_attn.qkv_proj",
                          "blk.{}.ffn_up": "model.layers.{}.mlp.gate_up_proj"}
# LongRoPE factor tensors; the checkpoint view turns them into the config's rope parameters.
PHI3_GGUF_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Causal LM over the flat token batch (see `LlamaForCausalLM` for shapes).

    NOTE(longrope): HF picks one factor set per forward call: the long factors for every token
    of the call when its longest sequence exceeds original_max_position_embeddings, the short
    ones otherwise (`dynamic_rope_update`); and Phi-3's `generate` drops its KV cache at the
    step where a sequence first exceeds that length, recomputing every key with the long
    factors. The engine applies the per-call rule per request and step: a token uses the long
    table when its request's `seq_lens` entry in this step exceeds
    original_max_position_embeddings. That equals HF for sequences that stay within the
    original length and for prompts longer than it (long factors from the first token), and
    keeps a token's rotation independent of the other requests in the batch. It differs from
    HF for a sequence that crosses the length while decoding: its cached keys keep the short
    rotation (as in vLLM) instead of being recomputed. A prompt longer than the limit that is
    prefilled in several chunks also rotates its first chunks with the short factors.
    """

    gguf_architecture = "phi3"

    def __init__(self, config) -> None:
        super().__init__(config)
        rope = rope_parameters_from_hf(config.to_dict())
        self._original_max_position: int | None = None
        if rope["rope_type"] == "longrope":
            self._original_max_position = int(rope["original_max_position_embeddings"])
            self._long_position_offset = int(config.max_position_embeddings)

    def rope_positions(self, positions: torch.Tensor,
                       token_seq_lens: np.ndarray | None) -> torch.Tensor:
        """The runner's hook for models whose RoPE depends on step facts: positions [n] int64 ->
        the rows of the RoPE table the forward reads [n] int64: + the long table's offset for the
        tokens of requests whose sequence in this step is longer than the original context.
        `token_seq_lens` [<= n] int: each token's request's sequence length this step
        (`CommonAttentionMetadata.token_seq_lens`; padded tokens beyond it count as short);
        None (no step metadata, e.g. a dummy run): per token by position."""
        original = self._original_max_position
        if original is None:
            return positions
        if token_seq_lens is None:
            long = positions >= original
        else:
            flags = np.zeros(positions.shape[0], dtype=bool)
            flags[:token_seq_lens.shape[0]] = token_seq_lens > original
            long = torch.from_numpy(flags).to(positions.device)
        return positions + long.to(positions.dtype) * self._long_position_offset

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Phi-3 checkpoint tensors by HF name (fused `qkv_proj`/`gate_up_proj` included);
        returns the names of the parameters that were set.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch
                (a fused tensor whose rows do not add up to the config's sizes included).
        """
        return super().load_weights(self._split_fused(weights))

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights: Iterable[tuple[str, Any]]
                                ) -> Iterator[tuple[str, Any]]:
        """Turn a Phi-3 GGUF file's tensors into HF-named checkpoint tensors (fused ones kept
        fused for `load_weights`; Q/K rows are in HF's order in these files). The LongRoPE
        factor tensors are skipped: the checkpoint view wrote them into the config
        (`model_loader/gguf.py`).

        Raises:
            ValueError: naming a tensor this family has no parameter for.
        """
        for name, tensor in weights:
            if name in PHI3_GGUF_ROPE_FACTORS:
                continue
            hf_name = gguf_to_hf_name(name, PHI3_GGUF_TENSOR_NAMES)
            if hf_name is None:
                raise ValueError(f"GGUF tensor {name} has no counterpart in {cls.__name__}")
            yield hf_name, tensor

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Split fused checkpoint tensors (lazily, by `narrow`) into Llama's per-projection
        names, which `stacked_params_mapping` routes to the fused layers with shard ids."""
        config = self.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
        q_size, kv_size = heads * head_size, kv_heads * head_size
        inter = config.intermediate_size
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                parts = (("q_proj", 0, q_size), ("k_proj", q_size, kv_size),
                         ("v_proj", q_size + kv_size, kv_size))
                total, fused = q_size + 2 * kv_size, "qkv_proj"
            elif ".mlp.gate_up_proj." in name:
                parts = (("gate_proj", 0, inter), ("up_proj", inter, inter))
                total, fused = 2 * inter, "gate_up_proj"
            else:
                yield name, tensor
                continue
            if tensor.shape[0] != total:
                raise ValueError(f"checkpoint tensor {name} has {tensor.shape[0]} rows, expected "
                                 f"{total} from the config")
            for part, start, size in parts:
                yield name.replace(f".{fused}.", f".{part}."), tensor.narrow(0, start, size)
