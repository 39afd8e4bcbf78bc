"""Idefics3 / SmolVLM: a SigLIP-style vision tower, a pixel-shuffle connector and our Llama
decoder (`LlamaForCausalLM`).

    image tiles [T, 3, S, S] -> patch conv (P x P) + learned positions -> [T, (S/P)^2, Dv]
        -> [ LayerNorm -> bidirectional MHA -> +res -> LayerNorm -> GELU MLP -> +res ] x Lv
        -> LayerNorm -> pixel shuffle (r x r patches -> one vector of r^2 Dv)
        -> Linear(r^2 Dv -> D) -> [T, (S/P)^2 / r^2, D]     (one row per <image> token)

The decoder takes token embeddings with the image rows scattered over the `<image>` positions
(`inputs_embeds`, built by the runner's EncoderRunner); everything else is the text model.
References: HF transformers' Idefics3 / SmolVLM modelling; SigLIP (Zhai et al., 2023); the
NaViT-style fractional position buckets of `Idefics3VisionEmbeddings`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.utils import load_named_weight


class VisionEmbeddings(nn.Module):
    """Patch embedding + learned positions bucketed by each patch's fractional coordinates
    (so a tile of another size than `image_size` maps onto the same position table)."""

    def __init__(self, config, bucketed_positions: bool = True) -> None:
        super().__init__()
        self.bucketed_positions = bucketed_positions
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size,
                                         config.patch_size, config.patch_size)
        self.num_patches_per_side = config.image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2,
                                               config.hidden_size)

    def position_ids(self, num_h: int, num_w: int, device: torch.device) -> torch.Tensor:
        """[num_h * num_w] int64 position of each patch of an unpadded num_h x num_w tile
        (plain SigLIP, `bucketed_positions=False`: row-major order of an image_size tile)."""
        n = self.num_patches_per_side
        if not self.bucketed_positions:
            if num_h * num_w != n * n:
                raise ValueError(f"a {num_h}x{num_w}-patch image for a {n}x{n}-patch tower")
            return torch.arange(n * n, device=device)
        boundaries = torch.arange(1 / n, 1.0, 1 / n, device=device)
        frac_h = torch.clamp(torch.arange(num_h, device=device, dtype=torch.float32)
                             * (1.0 / num_h), max=1.0 - 1e-6)
        frac_w = torch.clamp(torch.arange(num_w, device=device, dtype=torch.float32)
                             * (1.0 / num_w), max=1.0 - 1e-6)
        bucket_h = torch.bucketize(frac_h, boundaries, right=True)
        bucket_w = torch.bucketize(frac_w, boundaries, right=True)
        return (bucket_h[:, None] * n + bucket_w[None, :]).reshape(-1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [T, C, H, W] -> [T, (H/P) * (W/P), Dv]."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        num_h, num_w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(num_h, num_w, x.device))


# (our parameter, checkpoint name, shard id) of a vision encoder layer.
VISION_STACKED_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                         ("qkv_proj", "v_proj", "v"))


class VisionEncoderLayer(nn.Module):
    """Pre-norm transformer layer, bidirectional within each image tile. Its linears are the
    decoder's (tensor-parallel by heads and MLP columns; the CPU's packed GEMM after loading)."""

    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.head_size = d // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(d, self.head_size, config.num_attention_heads,
                                          config.num_attention_heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads
        self.out_proj = RowParallelLinear(d, d, bias=True)
        self.layer_norm1 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.fc1 = ColumnParallelLinear(d, config.intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(config.intermediate_size, d, bias=True)
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"unsupported vision hidden_act {config.hidden_act!r}")
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, Dv]: N patches of each of T tiles, attending to all patches of their tile."""
        t, n, d = x.shape
        h = self.layer_norm1(x).reshape(t * n, d)
        q, k, v = (y.view(t, n, self.num_heads, self.head_size).transpose(1, 2)
                   for y in self.qkv_proj(h).chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, scale=self.head_size ** -0.5)
        x = x + self.out_proj(attn.transpose(1, 2).reshape(t * n, -1)).view(t, n, d)
        h = self.fc1(self.layer_norm2(x).reshape(t * n, d))
        h = self.fc2(F.gelu(h, approximate=self.approximate))
        return x + h.view(t, n, d)


class VisionTransformer(nn.Module):
    """SigLIP's vision transformer: pixel_values [T, C, H, W] -> [T, patches, Dv]."""

    def __init__(self, config, bucketed_positions: bool = True) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config, bucketed_positions)
        self.layers = nn.ModuleList(VisionEncoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[T, N, D] (N = s^2 patches, row-major) -> [T, N / r^2, D r^2]: each r x r block of
    patches becomes one vector (HF Idefics3Connector.pixel_shuffle's order)."""
    t, n, d = x.shape
    side = int(round(n ** 0.5))
    if side * side != n or side % scale_factor:
        raise ValueError(f"pixel shuffle needs a square grid divisible by {scale_factor}, got "
                         f"{n} patches")
    r = scale_factor
    x = x.view(t, side, side // r, d * r).permute(0, 2, 1, 3)
    x = x.reshape(t, side // r, side // r, d * r * r).permute(0, 2, 1, 3)
    return x.reshape(t, n // (r * r), d * r * r)


class Idefics3ForConditionalGeneration(nn.Module):
    """Vision-language model over the flat token batch.

    forward(input_ids [n] int64, positions [n] int64, inputs_embeds [n, D] | None) -> hidden
    [n, D]; embed_multimodal(list of {"pixel_values": float32 [T_i, 3, S, S]}) -> per image
    float [T_i * image_seq_len, D]; embed_input_ids(input_ids [n]) -> [n, D].
    """

    supports_multimodal = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text_config = copy.deepcopy(config.text_config)
        text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.vision_model = VisionTransformer(config.vision_config)
        self.scale_factor = config.scale_factor
        vision_out = config.vision_config.hidden_size * config.scale_factor ** 2
        self.modality_projection = nn.Linear(vision_out, text_config.hidden_size, bias=False)
        self.language_model = LlamaForCausalLM(text_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def embed_multimodal(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Encode several images in one batch per tile size; returns each image's embeddings
        [num_tiles * image_seq_len, D] in the decoder's dtype."""
        device = self.modality_projection.weight.device
        tiles = [torch.from_numpy(np.asarray(item["pixel_values"], dtype=np.float32))
                 for item in items]
        counts = [len(t) for t in tiles]
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, t in enumerate(tiles):
            by_shape.setdefault(tuple(t.shape[1:]), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(items)
        for indices in by_shape.values():
            batch = torch.cat([tiles[i] for i in indices]).to(device)
            hidden = pixel_shuffle(self.vision_model(batch), self.scale_factor)
            embeds = self.modality_projection(hidden)
            for i, e in zip(indices, embeds.split([counts[i] for i in indices])):
                out[i] = e.reshape(-1, e.shape[-1])
        return out  # type: ignore[return-value]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names: model.vision_model.*, model.connector.modality_projection.proj.weight,
        model.text_model.* and lm_head.weight.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        text: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.text_model."):
                text.append(("model." + name[len("model.text_model."):], tensor))
            elif name == "lm_head.weight":
                text.append((name, tensor))
            elif name.startswith("model.connector.modality_projection.proj."):
                loaded.add(load_named_weight(
                    params, "modality_projection." + name.rsplit(".", 1)[1], tensor))
            elif name.startswith("model.vision_model."):
                ours = name[len("model."):].replace(".encoder.layers.", ".layers.")
                ours = ours.replace(".self_attn.", ".").replace(".mlp.", ".")
                loaded.add(load_named_weight(params, ours, tensor, VISION_STACKED_PARAMS))
            else:
                raise ValueError(f"checkpoint tensor {name} has no matching parameter")
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        return loaded


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM (v2): Idefics3's layout and weights names."""
