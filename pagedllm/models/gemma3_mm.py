"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): SigLIP vision tower, a pooling
projector and our Gemma 3 text decoder.

    image [N, 3, S, S] -> SigLIP (patch conv + positions, Lv bidirectional layers, LayerNorm)
        -> [N, (S/P)^2, Dv] -> average pool to mm_tokens_per_image -> Gemma RMSNorm
        -> x @ W [Dv, D] -> [N, mm_tokens_per_image, D]   (one row per <image_soft_token>)

The decoder attends the soft tokens of one image to each other in both directions (HF's
blockwise OR causal mask, in global and local layers): the feature's `bidirectional` flag makes
the scheduler compute an image's tokens in one chunk and the runner set `attend_until`; only
attention backends with `supports_attend_until` (torch_sdpa, cpu_paged, triton_paged) run this
model. Token
embeddings are scaled by sqrt(hidden); the image rows are not (as HF). References: HF transformers'
Gemma3ForConditionalGeneration; Gemma 3 technical report (2025); SigLIP (Zhai et al., 2023).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.models.gemma import Gemma3ForCausalLM
from pagedllm.models.idefics3 import VISION_STACKED_PARAMS, VisionTransformer
from pagedllm.models.utils import load_named_weight


class Gemma3ForConditionalGeneration(nn.Module):
    """forward(input_ids [n], positions [n], inputs_embeds [n, D] | None) -> hidden [n, D];
    embed_multimodal(list of {"pixel_values": float32 [1, 3, S, S]}) -> per image
    [mm_tokens_per_image, D]; embed_input_ids(input_ids [n]) -> scaled [n, D]."""

    supports_multimodal = True
    mm_bidirectional = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        vision = config.vision_config
        self.vision_tower = VisionTransformer(vision, bucketed_positions=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size), requires_grad=False)
        patches = vision.image_size // vision.patch_size
        self.kernel_size = patches // int(round(config.mm_tokens_per_image ** 0.5))
        self.patches_per_side = patches
        self.language_model = Gemma3ForCausalLM(config.text_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)

    def embed_multimodal(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Encode all images in one batch; each -> [mm_tokens_per_image, D]."""
        device = self.mm_input_projection_weight.device
        pixels = torch.cat([torch.from_numpy(np.asarray(i["pixel_values"], dtype=np.float32))
                            for i in items]).to(device)
        x = self.vision_tower(pixels)                                   # [N, P*P, Dv]
        n, _, dv = x.shape
        x = x.transpose(1, 2).reshape(n, dv, self.patches_per_side, self.patches_per_side)
        x = nn.functional.avg_pool2d(x, self.kernel_size, self.kernel_size)
        x = self.mm_soft_emb_norm(x.flatten(2).transpose(1, 2))
        out = torch.matmul(x, self.mm_input_projection_weight)
        return list(out.to(self.language_model.model.embed_tokens.weight.dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names (with or without a leading "model."): language_model.model.* and
        language_model.lm_head.*, vision_tower[.vision_model].*, multi_modal_projector.*;
        SigLIP's pooling head (unused by Gemma 3) is skipped.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        text: list[tuple[str, torch.Tensor]] = []
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if name.startswith("language_model."):
                rest = name[len("language_model."):]
                text.append((rest if rest.startswith(("model.", "lm_head.")) else
                             "model." + rest, tensor))
            elif name.startswith("multi_modal_projector."):
                loaded.add(load_named_weight(params, name[len("multi_modal_projector."):],
                                             tensor))
            elif name.startswith("vision_tower."):
                ours = name[len("vision_tower."):]
                ours = ours[len("vision_model."):] if ours.startswith("vision_model.") else ours
                if ours.startswith("head."):
                    continue
                ours = ours.replace("encoder.layers.", "layers.")
                ours = ours.replace(".self_attn.", ".").replace(".mlp.", ".")
                loaded.add(load_named_weight(params, "vision_tower." + ours, tensor,
                                             VISION_STACKED_PARAMS))
            else:
                raise ValueError(f"checkpoint tensor {name} has no matching parameter")
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(text)}
        return loaded
