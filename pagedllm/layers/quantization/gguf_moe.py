"""Mixture-of-experts weights kept in a GGUF file's block formats (llama.cpp's stacked
`ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, e.g. Q8_0 or Q4_K experts of a DeepSeek-V2
file), for `FusedMoE` on the CPU.

    GGUF [E, I, H] gate / up, [E, H, I] down ──(one expert's rows: materialize_raw)──►
        w13_weight [L, 2 * I_p, H / bw * bb] uint8   rows [ gate | up ] of each local expert
        w2_weight  [L, H, I_p / bw * bb]     uint8   (bw, bb: the type's block weights / bytes)
    apply: the fused-MoE token grouping (`fused_experts_torch`), each expert's rows through two
           `gguf_linear` calls on its blocks (csrc/cpu_gguf_linear.cpp)

Experts are most of a MoE model's bytes, so keeping them in blocks is what makes a quantized
file's memory footprint that of the file. Gate and up rows must share a type (one w13 type per
layer), and down rows another; a file that mixes types across experts of one tensor, or whose
type's blocks do not divide the input dimension, raises `GGUFLayoutUnsupported` and the loader
dequantizes the whole checkpoint instead (as for linear layers). Once loaded, each expert's
rows go to the kernels' row-group layout (`gguf_group_rows`, as `GGUFLinearMethod`'s;
`PAGEDLLM_GGUF_ROW_GROUPS=0` keeps plain rows); EPLB moves whole slots, so either layout moves.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.layers.quantization.gguf import (GGUFLayoutUnsupported, gguf_q8_activations_enabled,
                                               gguf_row_bytes, gguf_row_groups_enabled)
from pagedllm.native.kernels.quantized_ops import GGUF_KERNEL_TYPES, gguf_group_rows, gguf_linear


class GGUFMoEMethod:
    """Stores a `FusedMoE`'s experts as GGUF blocks and runs them with `gguf_linear`.

    State on the layer after loading: `w13_weight` / `w2_weight` hold uint8 blocks (module
    docstring) and `gguf_expert_types` maps "w13" / "w2" to the GGML type name of each.

    Args:
        quantize_activations: as `GGUFLinearMethod`'s (None: `gguf_q8_activations_enabled()`).
    """

    quantized = True

    def __init__(self, quantize_activations: bool | None = None) -> None:
        self.quantize_activations = (gguf_q8_activations_enabled() if quantize_activations is None
                                     else quantize_activations)
        self.group_rows = gguf_row_groups_enabled()

    def create_weights(self, layer: nn.Module) -> None:
        """Forget the float expert weights (their storage is replaced at the first load)."""
        layer.gguf_expert_types = {}
        layer.gguf_grouped = False
        for param in (layer.w13_weight, layer.w2_weight):
            param.data = torch.empty(0, dtype=torch.uint8)

    def batch_invariant(self, layer: nn.Module) -> bool:
        return False

    def load_weight(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id: str,
                    expert_id: int | None) -> None:
        """One expert's checkpoint tensor (a lazy GGUF tensor: gate/up [I, H] as "w1"/"w3",
        down [H, I] as "w2") into every local slot holding that expert, still in blocks.

        Raises:
            GGUFLayoutUnsupported: a type without a kernel, blocks that do not divide the
                input dimension, or a type other than the one already loaded for this weight.
            ValueError: a tensor of all experts at once, an unknown shard id or expert id, a
                tensor that is not a GGUF tensor, or a shape mismatch.
        """
        name = getattr(loaded, "name", "?")
        if expert_id is None or shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"GGUF experts load one expert at a time (shard w1/w2/w3), got "
                             f"shard {shard_id!r}, expert {expert_id!r} for {name}")
        if not hasattr(loaded, "materialize_raw"):
            raise ValueError(f"GGUF expert weights take GGUF checkpoint tensors, got "
                             f"{type(loaded).__name__}")
        if not 0 <= expert_id < layer.num_experts:
            raise ValueError(f"FusedMoE: expert id {expert_id} outside [0, {layer.num_experts})")
        key = "w2" if shard_id == "w2" else "w13"
        if (param is layer.w2_weight) != (key == "w2"):
            raise ValueError(f"FusedMoE: shard id {shard_id!r} does not belong to this weight")
        inter, hidden = layer.intermediate_size_per_partition, layer.hidden_size
        tensor_type = loaded.tensor_type
        input_size = inter if key == "w2" else hidden
        block = GGUF_KERNEL_TYPES.get(tensor_type)
        if block is None or input_size % block.block_weights:
            raise GGUFLayoutUnsupported(
                f"GGUF expert tensor {name} is {tensor_type}; quantized experts take "
                f"{', '.join(GGUF_KERNEL_TYPES)} with blocks dividing the {input_size} input "
                f"columns (use quantization='none')")
        if layer.gguf_expert_types.setdefault(key, tensor_type) != tensor_type:
            raise GGUFLayoutUnsupported(
                f"GGUF expert tensor {name} is {tensor_type}, other experts' {key} rows "
                f"{layer.gguf_expert_types[key]} (use quantization='none')")
        rows = hidden if key == "w2" else 2 * inter
        row_bytes = gguf_row_bytes(tensor_type, input_size)
        if param.data.dim() != 3:
            param.data = torch.zeros(layer.num_local_experts, rows, row_bytes, dtype=torch.uint8)
        if key == "w2":
            part = loaded.narrow(1, layer.moe_tp_rank * inter, inter)
            want, offset = (hidden, inter), 0
        else:
            part = loaded.narrow(0, layer.moe_tp_rank * inter, inter)
            want, offset = (inter, hidden), (0 if shard_id == "w1" else inter)
        if tuple(part.shape[-2:]) != want:
            raise ValueError(f"shape mismatch: GGUF expert tensor {name} "
                             f"{tuple(loaded.shape)} vs expert weight {want}")
        if layer.gguf_grouped:
            raise ValueError(f"GGUF expert tensor {name}: the experts are already regrouped "
                             f"(loaded once)")
        raw = part.materialize_raw()
        for slot in np.flatnonzero(layer.local_logical_ids() == expert_id).tolist():
            param.data[slot].narrow(0, offset, raw.shape[0]).copy_(raw)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Put every expert's rows in the kernels' row-group layout (in place). Idempotent."""
        if layer.gguf_grouped or not self.group_rows or layer.w13_weight.dim() != 3:
            return
        for key, param in (("w13", layer.w13_weight), ("w2", layer.w2_weight)):
            for slot in range(param.shape[0]):
                param.data[slot].copy_(gguf_group_rows(param.data[slot],
                                                       layer.gguf_expert_types[key]))
        layer.gguf_grouped = True

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts over `hidden` [n, H] (`topk_ids` [n, k] physical ids, weights
        [n, k] float32) -> [n, H] in hidden's dtype (this rank's partial sum under TP)."""
        from pagedllm.layers.fused_moe import fused_experts_torch

        w13_type, w2_type = layer.gguf_expert_types["w13"], layer.gguf_expert_types["w2"]
        w13, w2, q8 = layer.w13_weight.data, layer.w2_weight.data, self.quantize_activations
        grouped = layer.gguf_grouped

        def expert_forward(expert: int, x: torch.Tensor) -> torch.Tensor:
            gate_up = gguf_linear(x, w13[expert], w13_type, None, q8, grouped)
            return gguf_linear(layer.act_fn(gate_up), w2[expert], w2_type, None, q8, grouped)

        return fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids, layer.expert_map,
                                   layer.act_fn, expert_forward=expert_forward)
