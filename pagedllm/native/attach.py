"""The one hook by which a loaded model gets its native CPU decoder stack.

A model stays a pure model definition: `LlamaModel.layer_stack` is a generic slot for "something
that runs this stage's decoder layers and final norm faster, for the steps it takes" (None:
the layers always run module by module). After loading, `attach_native_decoder` fills it for
every Llama-family stage the fused decoder supports (`FusedDecoder.supports`: CPU, float / GGUF
/ int8 weights the native layer reads, one tensor-parallel rank, ...). Per step the stack reads
the step's attention metadata from the forward context (as the attention layers it replaces
do) and declines the steps the fused decoder does not take (`FusedDecoder.applies`); the model
then runs its layers.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.layers.pipeline import send_intermediate
from pagedllm.models.llama import LlamaDecoderLayer, LlamaModel
from pagedllm.native.fused_decoder import FusedDecoder, add_rms_norm
from pagedllm.native.gdn_decoder import attach_native_mixers, refresh_native_mixers
from pagedllm.native.hybrid_stack import NativeHybridStack, attach_native_hybrid_stacks
from pagedllm.native.mla_decoder import attach_native_attention, refresh_native_attention
from pagedllm.native.moe_block import NativeMoeBlock


class NativeDecoderStack:
    """The decoder layers and final RMSNorm of one `LlamaModel` pipeline stage through the fused
    decoder (`native/fused_decoder.py`), for the steps it takes.

    Called as `stack(positions [n] int64, hidden [n, hidden_size], residual | None)` where the
    stage's layer loop would start (hidden: the embeddings, or a previous stage's output with
    its residual); returns what `LlamaModel.forward` returns (the normed hidden states on the
    last stage; the hidden states sent on, otherwise), or None for a step it does not take.
    """

    def __init__(self, fused: FusedDecoder, norm: nn.Module, pp) -> None:
        self.fused = fused
        self.norm = norm   # the stage's final RMSNorm (a PPMissingLayer before the last stage)
        self.pp = pp       # the pipeline group

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None, aux_layers: tuple[int, ...] = ()
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """`aux_layers` (indices within this stage, last stage only): also return the
        streams entering those layers, concatenated ([n, len * hidden_size], as
        `LlamaModel.forward` returns them for EAGLE-3)."""
        context = get_forward_context()
        metadata, hooks = context.attn_metadata, context.kv_hooks
        if not self.fused.applies(positions.shape[0], metadata) or (aux_layers and (
                not self.pp.is_last_rank
                or not all(0 <= i < len(self.fused.layers) for i in aux_layers))):
            return None
        attention = self.fused.attention
        if hooks is not None:   # one native call runs every layer: all their loads first
            for attn in attention:
                hooks.wait_for_layer_load(attn.layer_name)
        if residual is None:   # the embeddings start the residual stream
            residual, delta = hidden.contiguous(), None
        else:
            residual, delta = residual.contiguous(), hidden.float().contiguous()
        capture = dict.fromkeys(aux_layers) if aux_layers else None
        delta = self.fused(positions, residual, delta, metadata, capture)
        if hooks is not None:
            for attn in attention:
                hooks.save_kv_layer(attn.layer_name, attn.kv_cache)
        if not self.pp.is_last_rank:
            hidden = delta.to(residual.dtype)
            send_intermediate(self.pp, hidden, residual)
            return hidden
        normed = add_rms_norm(residual, delta, self.norm.weight, self.norm.eps)
        if capture is None:
            return normed
        return normed, torch.cat([capture[i] for i in aux_layers], dim=-1)


def attach_native_decoder(model: nn.Module) -> int:
    """Give every Llama-family decoder stack inside `model` whose layers the fused decoder
    supports a `NativeDecoderStack` (its `layer_stack`), the native halves to DeepSeek and
    Qwen3-Next layers, and a `NativeHybridStack` to their stacks where every layer has both
    (`native/hybrid_stack.py`; the native MoE blocks must be attached first); returns how many
    stacks got one. Stacks of other layers (Gemma's, ...) keep None."""
    attached = 0
    for module in model.modules():
        if not isinstance(module, LlamaModel):
            continue
        layers = list(module.layers[module.start_layer:module.end_layer])
        if layers and all(type(layer) is LlamaDecoderLayer for layer in layers) \
                and FusedDecoder.supports(layers):
            module.layer_stack = NativeDecoderStack(FusedDecoder(layers), module.norm, module.pp)
            attached += 1
    attach_native_attention(model)   # DeepSeek MLA layers' attention halves (one call each)
    attach_native_mixers(model)      # Qwen3-Next Gated DeltaNet layers' first halves
    # DeepSeek / Qwen3-Next stacks whose layers all have both native halves (the MoE blocks
    # are attached before this call): one call per step for all layers
    return attached + attach_native_hybrid_stacks(model)


def refresh_native_decoder(model: nn.Module) -> None:
    """After `model`'s weights changed (storage replaced or values overwritten: sleep mode and
    weight updates, worker/sleep_mode.py), make every `NativeDecoderStack`, `NativeMoeBlock` and native
    attention / mixer block inside rebuild its native structures, which hold pointers into the weights and float32
    copies of some."""
    for module in model.modules():
        stack = getattr(module, "layer_stack", None)
        if isinstance(stack, NativeDecoderStack):
            stack.fused.forget_structures()
        if isinstance(stack, NativeHybridStack):
            stack.forget_structures()
        native_moe = getattr(module, "native_block", None)
        if isinstance(native_moe, NativeMoeBlock):
            native_moe.forget_structures()
    refresh_native_attention(model)
    refresh_native_mixers(model)
