"""Qwen3-VL: a ViT with learned (interpolated) and rotary positions, DeepStack features and our
Qwen3 decoder with interleaved M-RoPE.

    image patches [P, C*Tp*ps*ps] (merge-block order)
        -> linear patch embed (+bias) + learned positions (the side x side table resampled
           bilinearly, align_corners, to the image's h x w grid) -> [P, Dv]
        -> [ LayerNorm -> MHA with 2-D RoPE over the whole image -> +res -> LayerNorm ->
             GELU(tanh) MLP -> +res ] x depth;  after block `deepstack_visual_indexes[i]`:
             deepstack merger i (2x2 blocks concatenated -> LayerNorm -> Linear-GELU-Linear)
        -> merger (LayerNorm -> 2x2 blocks concatenated -> Linear-GELU-Linear) -> [P/4, D]

DeepStack (Meng et al., 2024): the i-th deepstack feature of an image token is added to the
decoder's hidden state at that token after decoder layer i. The features travel with the main
embedding through the encoder cache as one row [D * (1 + k)] per image token
(`embed_multimodal`); `embed_input_ids` gives text tokens zeros there, so the runner's scatter of
image rows into the step's `inputs_embeds` needs nothing new, and adding the zeros leaves text
tokens exact. References: HF transformers' Qwen3VLForConditionalGeneration and
`transformers.vision_utils`; vLLM's qwen3_vl.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.mrotary_embedding import MRotaryEmbedding
from pagedllm.layers.rotary_embedding import default_inv_freq, rope_parameters_from_hf
from pagedllm.models.llama import Qwen3ForCausalLM
from pagedllm.models.qwen2_5_vl import (VisionBlock, VisionMLP, VisionRope,
                                        embed_qwen_vl_images, image_cu_seqlens,
                                        load_qwen_vl_weights, vision_position_ids)
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.qwen_vl import mrope_input_positions


class Qwen3PatchMerger(nn.Module):
    """2x2 merge blocks -> Linear-GELU-Linear, normed before (main merger) or after (deepstack
    mergers, `postshuffle_norm`) concatenating a block's patches."""

    def __init__(self, config, postshuffle_norm: bool) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle_norm else config.hidden_size,
                                 eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.hidden_size, self.hidden_size, bias=True)
        self.linear_fc2 = RowParallelLinear(self.hidden_size, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """pixel_values [P, C*Tp*ps*ps] of images with grids [(t, h, w)] -> (merged [P/4, D],
    deepstack features: one [P/4, D] per `deepstack_visual_indexes` entry)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Linear(patch_dim, config.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(round(config.num_position_embeddings ** 0.5))
        self.blocks = nn.ModuleList(
            VisionBlock(config.hidden_size, config.num_heads, rms_norm=False,
                        mlp=VisionMLP(config.hidden_size, config.intermediate_size,
                                      config.hidden_act))
            for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, postshuffle_norm=True)
            for _ in self.deepstack_visual_indexes)
        head_size = config.hidden_size // config.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4))
        self.register_buffer("inv_freq", default_inv_freq(head_size // 2, theta),
                             persistent=False)

    def learned_positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[P, Dv] float32: the position table resampled to each image's grid (bilinear,
        align_corners, as HF's `get_vision_interpolation_indices_and_weights`), merge-block
        order, repeated over t."""
        m, d = self.merge, self.pos_embed.weight.shape[1]
        table = self.pos_embed.weight.float().view(self.side, self.side, d).permute(2, 0, 1)
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table[None], size=(h, w), mode="bilinear",
                                 align_corners=True)[0]                     # [Dv, h, w]
            grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, d)
            out.append(grid.permute(0, 2, 1, 3, 4).reshape(h * w, d).repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x + self.learned_positions(grids).to(x.dtype)
        pos = torch.from_numpy(vision_position_ids(grids, self.merge)).to(x.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)      # [P, head/2]
        rope = VisionRope(freqs)
        cu = image_cu_seqlens(grids)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cu)
            if i in self.deepstack_visual_indexes:
                j = self.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_merger_list[j](x))
        return self.merger(x), deepstack


class Qwen3VLForConditionalGeneration(nn.Module):
    """forward(input_ids [n], positions [n] or [3, n] int64, inputs_embeds [n, D * (1 + k)] |
    None) -> hidden [n, D]; embed_multimodal(list of {"pixel_values", "image_grid_thw"}) -> per
    image [t*h*w / merge^2, D * (1 + k)] (main embedding, then k deepstack features);
    embed_input_ids(input_ids [n]) -> [n, D * (1 + k)] (zeros after the first D)."""

    supports_multimodal = True
    uses_mrope = True
    # Checkpoint -> our names inside the tower (see `load_qwen_vl_visual_weight`).
    visual_renames = ((".mlp.linear_fc", ".mlp.fc"),)

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = copy.deepcopy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                getattr(text, "tie_word_embeddings", False)))
        self.visual = Qwen3VisionTransformer(config.vision_config)
        self.language_model = Qwen3ForCausalLM(text)
        self.hidden_size = text.hidden_size
        self.num_deepstack = len(self.visual.deepstack_visual_indexes)
        rope = rope_parameters_from_hf(text.to_dict())
        section = rope.get("mrope_section")
        if section is None:
            raise ValueError("Qwen3-VL text config has no mrope_section")
        for layer in self.language_model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn.rotary_emb = MRotaryEmbedding(attn.head_size, text.max_position_embeddings,
                                                   rope, section, interleaved=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        model = self.language_model.model
        if inputs_embeds is None:
            return model(input_ids, positions)
        d, n = self.hidden_size, inputs_embeds.shape[0]
        hidden, residual = inputs_embeds[:, :d], None
        deepstack = inputs_embeds[:, d:].view(n, self.num_deepstack, d)
        for i in range(model.start_layer, model.end_layer):
            hidden, residual = model.layers[i](positions, hidden, residual)
            if i < self.num_deepstack:
                hidden = hidden + deepstack[:, i]
        hidden, _ = model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.language_model.model.embed_tokens(input_ids)
        return F.pad(embeds, (0, self.hidden_size * self.num_deepstack))

    def get_mrope_input_positions(self, num_tokens: int, features: list[MultiModalFeature]
                                  ) -> tuple[np.ndarray, int]:
        return mrope_input_positions(num_tokens, features,
                                     self.config.vision_config.spatial_merge_size)

    def embed_multimodal(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Encode all images in one pass of the tower (attention stays inside each image)."""
        return embed_qwen_vl_images(self, items)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> torch.Tensor:
        """The tower over the images' patches: [P, C*Tp*ps*ps] -> [P / merge^2, D * (1 + k)]
        (the merger's output, then the k deepstack features)."""
        merged, deepstack = self.visual(pixel_values, grids)
        return torch.cat([merged, *deepstack], dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names: model.visual.*, model.language_model.*, lm_head.weight.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        return load_qwen_vl_weights(self, weights)
