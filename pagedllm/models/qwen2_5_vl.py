"""Qwen2.5-VL and Qwen2-VL: a ViT, a patch merger and our Qwen2 decoder with M-RoPE.

    image patches [P, C*Tp*ps*ps] (P = t*h*w, rows in 2x2 merge-block order)
        -> linear patch embed -> [P, Dv]  (HF's Conv3d with kernel = stride = patch)
        -> reorder by window (`vision_window_index`)
        -> [ RMSNorm -> MHA with 2-D RoPE (h, w) inside each window, or the whole image in
             `fullatt_block_indexes` -> +res -> RMSNorm -> SwiGLU -> +res ] x depth
        -> merger: RMSNorm -> each 2x2 block concatenated [P/4, 4 Dv] -> Linear -> GELU -> Linear
        -> back to raster order -> [P/4, D]   (one row per <|image_pad|> token)

Qwen2-VL's tower (`QwenVisionLayout.qwen2_vl`) is the same without windows (every block over
the whole image), with LayerNorm (with bias) for RMSNorm and an fc1 -> quick-GELU -> fc2 MLP
for the SwiGLU. The decoder is `Qwen2ForCausalLM` with each layer's RoPE swapped for
`MRotaryEmbedding` (three position rows, `mrope_section`). A prompt's positions come from
`get_mrope_input_positions` (computed once when a request reaches the worker: see
worker/encoder_runner.py). References: HF transformers' Qwen2_5_VLForConditionalGeneration,
Qwen2VLForConditionalGeneration and `transformers.vision_utils` (window index, vision position
ids); the Qwen2-VL (2024) and Qwen2.5-VL (2025) technical reports; vLLM's qwen2_5_vl.py,
qwen2_vl.py and MRotaryEmbedding.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.activation import get_act_fn
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (ColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.layers.mrotary_embedding import MRotaryEmbedding
from pagedllm.layers.rotary_embedding import default_inv_freq, rope_parameters_from_hf
from pagedllm.models.llama import LlamaMLP, Qwen2ForCausalLM
from pagedllm.models.utils import load_fused_qkv_weight, load_named_weight
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.qwen_vl import mrope_input_positions


def vision_position_ids(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """int64 [P, 2] (h, w) of every patch of the images, in merge-block order."""
    out = []
    for t, h, w in grids:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hw = np.stack([hh.reshape(shape).transpose(0, 2, 1, 3).ravel(),
                       ww.reshape(shape).transpose(0, 2, 1, 3).ravel()], axis=-1)
        out.append(np.tile(hw, (t, 1)))
    return np.concatenate(out)


def vision_window_index(grids: list[tuple[int, int, int]], merge: int, window: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """The merge blocks reordered window by window, and the windows' boundaries in patches.

    Each image's grid of merge blocks (h/merge x w/merge) is cut into `window` x `window`
    tiles from the top left (the last row/column of tiles may be smaller); blocks are listed
    tile by tile, row-major inside a tile.

    Returns:
        (window_index int64 [P / merge^2]: the block at each new place, cu_window_seqlens
        int64 [num_windows + 1]: cumulative patches per window, empty windows dropped).
    """
    index, cu, base = [], [0], 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        blocks = np.arange(t * lh * lw).reshape(t, lh, lw)
        for ti in range(t):
            for r in range(0, lh, window):
                for c in range(0, lw, window):
                    tile = blocks[ti, r:r + window, c:c + window].ravel()
                    index.append(tile + base)
                    cu.append(cu[-1] + len(tile) * merge * merge)
        base += t * lh * lw
    return np.concatenate(index), np.asarray(cu, dtype=np.int64)


def image_cu_seqlens(grids: list[tuple[int, int, int]]) -> np.ndarray:
    """int64 [sum(t) + 1]: cumulative patches per frame (h * w each) of the images, the
    segments of full (per-image) attention."""
    return np.concatenate([[0], np.cumsum([h * w for t, h, w in grids
                                           for _ in range(t)])]).astype(np.int64)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: np.ndarray) -> torch.Tensor:
    """Bidirectional attention inside each segment [cu[i], cu[i+1]) of q, k, v [P, H, D]
    (any strides with a unit last one; q, k, v may be views into one fused qkv row).

    Segments of equal length go through one batched SDPA. When all segments have one length
    (the windows of images whose sides are whole windows, or images of one size in the
    full-attention blocks) they are read as one strided view, with no copy in or out;
    otherwise each length's segments are gathered and their outputs scattered back.
    Returns [P, H * D], contiguous.
    """
    n, h, d = q.shape
    lengths = np.diff(cu_seqlens)
    groups = np.unique(lengths)
    if len(groups) == 1 and cu_seqlens[-1] == n:
        length = int(groups[0])
        qs, ks, vs = (x.unflatten(0, (n // length, length)).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        return o.transpose(1, 2).reshape(n, h * d)
    out = q.new_empty(n, h, d)
    for length in groups:
        starts = torch.from_numpy(cu_seqlens[:-1][lengths == length]).to(q.device)
        idx = (starts[:, None] + torch.arange(int(length), device=q.device)).reshape(-1)
        s = len(starts)
        qs, ks, vs = (x[idx].view(s, int(length), h, d).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out[idx] = o.transpose(1, 2).reshape(-1, h, d)
    return out.view(n, h * d)


class VisionRope:
    """2-D RoPE of a tower call, built once and applied in every block: HF's
    `apply_rotary_pos_emb_vision` (rotate-half over the whole head, float32 math), as
    x * [cos, cos] + [-x2, x1] * [sin, sin] with the second product taken in two in-place
    halves (three passes over q and k instead of ~10).

    Args:
        freqs: float32 [P, head_size / 2], each patch's angles (radians).
    """

    def __init__(self, freqs: torch.Tensor) -> None:
        self.cos = torch.cat([freqs.cos()] * 2, dim=-1)[:, None, :]      # [P, 1, head_size]
        self.sin = freqs.sin()[:, None, :]                                # [P, 1, head_size/2]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, heads, head_size] (q and k heads together) -> rotated, contiguous, x's
        dtype. A bfloat16 x is read as it is (each product promotes it to float32 exactly),
        not first copied to float32."""
        half = x.shape[-1] // 2
        out = x * self.cos
        out[..., :half].addcmul_(x[..., half:], self.sin, value=-1.0)
        out[..., half:].addcmul_(x[..., :half], self.sin)
        return out.to(x.dtype)


class VisionAttention(nn.Module):
    """Multi-head attention with 2-D RoPE (HF's rotate-half over the whole head)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_size = dim // num_heads
        self.qkv = QKVParallelLinear(dim, self.head_size, num_heads, num_heads, bias=True)
        self.num_heads = self.qkv.num_heads
        self.proj = RowParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, rope: VisionRope, cu_seqlens: np.ndarray
                ) -> torch.Tensor:
        """x [P, Dv] -> [P, Dv]; `rope` holds the patches' angles."""
        n, h = x.shape[0], self.num_heads
        qkv = self.qkv(x).view(n, 3 * h, self.head_size)
        qk = rope.apply(qkv[:, :2 * h])
        return self.proj(segment_attention(qk[:, :h], qk[:, h:], qkv[:, 2 * h:], cu_seqlens))


class VisionMLP(nn.Module):
    """fc1 -> activation -> fc2 (Qwen2-VL's and Qwen3-VL's vision MLP): [P, dim] -> [P, dim]."""

    def __init__(self, dim: int, hidden_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden_size, bias=True)
        self.fc2 = RowParallelLinear(hidden_size, dim, bias=True)
        self.act = get_act_fn(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def vision_norm(rms: bool, dim: int) -> nn.Module:
    """The towers' eps-1e-6 norm: RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL,
    Qwen3-VL)."""
    return RMSNorm(dim, 1e-6) if rms else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x)); x [P, dim]."""

    def __init__(self, dim: int, num_heads: int, rms_norm: bool, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = vision_norm(rms_norm, dim)
        self.norm2 = vision_norm(rms_norm, dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: VisionRope, cu_seqlens: np.ndarray
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then each merge block's patches concatenated -> Linear -> GELU -> Linear."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, rms_norm: bool) -> None:
        super().__init__()
        self.hidden_size = context_dim * merge * merge
        self.ln_q = vision_norm(rms_norm, context_dim)
        self.fc1 = ColumnParallelLinear(self.hidden_size, self.hidden_size, bias=True)
        self.fc2 = RowParallelLinear(self.hidden_size, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.hidden_size))))


@dataclass(frozen=True)
class QwenVisionLayout:
    """What the Qwen2-VL and Qwen2.5-VL towers differ in, read from the HF vision config.

    width: the blocks' hidden size Dv; out_dim: the merger's output D (the decoder's width);
    rms_norm / gated_mlp: RMSNorm and a SwiGLU MLP (Qwen2.5-VL) or LayerNorm and
    fc1-act-fc2 (Qwen2-VL); window: a window's side in merge blocks, None where every block
    attends over the whole image (Qwen2-VL).
    """

    width: int
    out_dim: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    rms_norm: bool
    gated_mlp: bool
    window: int | None
    fullatt_block_indexes: frozenset[int]

    @classmethod
    def qwen2_5_vl(cls, config) -> QwenVisionLayout:
        return cls(config.hidden_size, config.out_hidden_size, config.num_heads,
                   config.intermediate_size, config.hidden_act, rms_norm=True, gated_mlp=True,
                   window=config.window_size // config.spatial_merge_size // config.patch_size,
                   fullatt_block_indexes=frozenset(config.fullatt_block_indexes))

    @classmethod
    def qwen2_vl(cls, config) -> QwenVisionLayout:
        return cls(config.embed_dim, config.hidden_size, config.num_heads,
                   int(config.embed_dim * config.mlp_ratio), config.hidden_act, rms_norm=False,
                   gated_mlp=False, window=None, fullatt_block_indexes=frozenset())

    def mlp(self) -> nn.Module:
        if self.gated_mlp:
            return LlamaMLP(self.width, self.intermediate_size, self.hidden_act, bias=True)
        return VisionMLP(self.width, self.intermediate_size, self.hidden_act)


class Qwen2_5_VisionTransformer(nn.Module):
    """pixel_values [P, C*Tp*ps*ps] of images with grids [(t, h, w)] -> [P / merge^2, D].

    Qwen2.5-VL's tower (`QwenVisionLayout.qwen2_5_vl`) or Qwen2-VL's (`.qwen2_vl`: no
    windows); `config` is the HF vision config (patch and merge sizes, depth, RoPE theta)."""

    def __init__(self, config, layout: QwenVisionLayout) -> None:
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = layout.window
        self.fullatt_block_indexes = layout.fullatt_block_indexes
        patch_dim = (config.in_channels * config.temporal_patch_size * config.patch_size ** 2)
        self.patch_embed = nn.Linear(patch_dim, layout.width, bias=False)
        self.blocks = nn.ModuleList(
            VisionBlock(layout.width, layout.num_heads, layout.rms_norm, layout.mlp())
            for _ in range(config.depth))
        self.merger = PatchMerger(layout.out_dim, layout.width, self.merge, layout.rms_norm)
        head_size = layout.width // layout.num_heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 1e4))
        self.register_buffer("inv_freq", default_inv_freq(head_size // 2, theta),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> torch.Tensor:
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        pos = torch.from_numpy(vision_position_ids(grids, self.merge)).to(x.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)      # [P, head/2]
        cu_full = image_cu_seqlens(grids)
        cu_window, order = cu_full, None
        if self.window is not None:
            n, unit = x.shape[0], self.merge * self.merge
            window_index, cu_window = vision_window_index(grids, self.merge, self.window)
            order = torch.from_numpy(window_index).to(x.device)
            x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
            freqs = freqs.view(n // unit, unit, -1)[order].reshape(n, -1)
        rope = VisionRope(freqs)
        for i, block in enumerate(self.blocks):
            cu = cu_full if i in self.fullatt_block_indexes else cu_window
            x = block(x, rope, cu)
        merged = self.merger(x)
        return merged if order is None else merged[torch.argsort(order)]


def embed_qwen_vl_images(model: nn.Module, items: list[dict[str, np.ndarray]]
                         ) -> list[torch.Tensor]:
    """`embed_multimodal` of the Qwen VL models: the items' patches concatenated through
    `model.encode_images` in one call, split back per image in the decoder's dtype.

    Args:
        items: per image {"pixel_values": float32 [t*h*w, C*Tp*ps*ps], "image_grid_thw":
            int [3]}.

    Returns:
        Per image a [t*h*w / merge^2, E] tensor (E: what `encode_images` gives per token).
    """
    device = model.visual.patch_embed.weight.device
    grids = [tuple(int(x) for x in item["image_grid_thw"]) for item in items]
    pixels = torch.cat([torch.from_numpy(np.asarray(item["pixel_values"], dtype=np.float32))
                        for item in items]).to(device)
    out = model.encode_images(pixels, grids)
    unit = model.visual.merge ** 2
    dtype = model.language_model.model.embed_tokens.weight.dtype
    return list(out.to(dtype).split([t * h * w // unit for t, h, w in grids]))


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    """forward(input_ids [n], positions [n] or [3, n] int64, inputs_embeds [n, D] | None) ->
    hidden [n, D]; embed_multimodal(list of {"pixel_values" float32 [t*h*w, C*Tp*ps*ps],
    "image_grid_thw" int64 [3]}) -> per image [t*h*w / merge^2, D];
    get_mrope_input_positions(num_prompt_tokens, features) -> ([3, L] int64, delta).

    Raises (construction): ValueError when the text config has no `mrope_section`, or for a
    vision `hidden_act` not implemented."""

    supports_multimodal = True
    uses_mrope = True
    vision_layout = staticmethod(QwenVisionLayout.qwen2_5_vl)
    # Checkpoint -> our names inside the tower (see `load_qwen_vl_visual_weight`).
    visual_renames = ((".merger.mlp.0.", ".merger.fc1."), (".merger.mlp.2.", ".merger.fc2."))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = copy.deepcopy(config.text_config)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                getattr(text, "tie_word_embeddings", False)))
        self.visual = Qwen2_5_VisionTransformer(config.vision_config,
                                                self.vision_layout(config.vision_config))
        self.language_model = Qwen2ForCausalLM(text)
        rope = rope_parameters_from_hf(text.to_dict())
        section = rope.get("mrope_section")
        if section is None:
            raise ValueError(f"{type(self).__name__}: the text config has no mrope_section")
        for layer in self.language_model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn.rotary_emb = MRotaryEmbedding(attn.head_size, text.max_position_embeddings,
                                                   rope, section)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def get_mrope_input_positions(self, num_tokens: int, features: list[MultiModalFeature]
                                  ) -> tuple[np.ndarray, int]:
        return mrope_input_positions(num_tokens, features,
                                     self.config.vision_config.spatial_merge_size)

    def embed_multimodal(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Encode all images in one pass of the tower (attention stays inside each image)."""
        return embed_qwen_vl_images(self, items)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> torch.Tensor:
        """The tower over the images' patches: [P, C*Tp*ps*ps] -> [P / merge^2, D]."""
        return self.visual(pixel_values, grids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names: model.visual.*, model.language_model.*, lm_head.weight (also the older
        visual.* / model.layers.* layout).

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        return load_qwen_vl_weights(self, weights)


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL: Qwen2.5-VL's model with Qwen2-VL's tower (LayerNorm, a quick-GELU fc1/fc2
    MLP, every block over the whole image, the merger's `ln_q` a LayerNorm); the same Qwen2
    decoder with contiguous M-RoPE sections, processing and positions."""

    vision_layout = staticmethod(QwenVisionLayout.qwen2_vl)


# Qwen2.5-VL's SwiGLU vision MLP: HF's gate_proj / up_proj into our gate_up_proj.
_VISION_STACKED_PARAMS = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def load_qwen_vl_visual_weight(params: dict[str, nn.Parameter], name: str, tensor,
                               renames: tuple[tuple[str, str], ...]) -> str:
    """One tensor of a Qwen VL vision tower (`name` after `visual.`) into its parameter: the
    Conv3d patch embedding reshaped to our linear's [Dv, C*Tp*ps*ps], the fused `attn.qkv`
    shard by shard, a SwiGLU's gate/up into `gate_up_proj`, other names after `renames`
    (substring pairs). A lazy `CheckpointTensor` is read whole (the tower is small).

    Returns:
        Our parameter's name.

    Raises:
        ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
    """
    if hasattr(tensor, "materialize"):
        tensor = tensor.materialize()
    if name == "patch_embed.proj.weight":
        return load_named_weight(params, "visual.patch_embed.weight",
                                 tensor.reshape(tensor.shape[0], -1))
    ours = "visual." + name.replace("patch_embed.proj.", "patch_embed.")
    for old, new in renames:
        ours = ours.replace(old, new)
    if ".attn.qkv." in ours:
        return load_fused_qkv_weight(params, ours, tensor)
    return load_named_weight(params, ours, tensor, _VISION_STACKED_PARAMS)


def load_qwen_vl_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                         ) -> set[str]:
    """A Qwen VL checkpoint's tensors into `model` (Qwen2-VL, Qwen2.5-VL or Qwen3-VL):
    `model.visual.*` (or `visual.*`) through `load_qwen_vl_visual_weight` with the model's
    `visual_renames`, `model.language_model.*` / `model.*` /
    `lm_head.*` through its decoder's `load_weights`. Returns the loaded parameter names.

    Raises:
        ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
    """
    params = dict(model.named_parameters())
    text: list[tuple[str, torch.Tensor]] = []
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith("model.language_model."):
            text.append(("model." + name[len("model.language_model."):], tensor))
        elif name.startswith(("model.visual.", "visual.")):
            loaded.add(load_qwen_vl_visual_weight(params, name.split("visual.", 1)[1], tensor,
                                                  model.visual_renames))
        elif name.startswith(("lm_head.", "model.")):
            text.append((name, tensor))
        else:
            raise ValueError(f"checkpoint tensor {name} has no matching parameter")
    return loaded | {f"language_model.{n}" for n in model.language_model.load_weights(text)}
