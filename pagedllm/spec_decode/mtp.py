"""DeepSeek-V3 multi-token prediction (MTP) as the drafter (DeepSeek-V3 technical report,
arXiv:2412.19437 sec. 2.2; vLLM's `deepseek_mtp.py` is the reference for the layout and the
reuse of one MTP layer for every draft step).

The checkpoint's MTP module k sits after the target's layers, `model.layers.{L + k}.*`
(L = num_hidden_layers), and runs, per position p with the token t_{p+1} after it:

    h   = eh_proj([enorm(embed(t_{p+1})), hnorm(hidden_p)])        (eh_proj: 2H -> H, no bias)
    out = decoder layer L (MLA attention + DeepSeek MoE, a normal DeepSeek layer) -> h + residual
    logits = lm_head(shared_head.norm(out))

`embed` and `lm_head` are the target's (`shared_head.head` and `embed_tokens`, copies of them
in released checkpoints, are not loaded). hidden_p is the target's last (final-normed) hidden
state for the first draft, then the MTP layer's own pre-norm `out` (vLLM); the embedding row at
position 0 is zeroed, as vLLM does. The layer's MLA attention has its own latent KV cache
(`attention_layers`), over the target's block ids as an EAGLE head's.

`MtpHead` has the EAGLE head's interface (`forward`, `draft_token_ids`, `attention_layers`),
so `EagleProposer` and the runner's EAGLE plumbing (worker/eagle_inputs.py) drive it as is.
NOTE(mtp): with `num_nextn_predict_layers` > 1 only the first MTP layer is loaded and reused
for every draft step (vLLM cycles through the layers).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.model_loader.loader import iterate_checkpoint_tensors
from pagedllm.models.moe import MoeDecoderLayer, ReplicatedLinear, _load_expert_tensor
from pagedllm.models.utils import load_named_weight
from pagedllm.sample.ops.argmax import row_argmax

# Checkpoint tensors of the MTP module that are the target's (not loaded).
_SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


def num_mtp_layers(config) -> int:
    """The checkpoint's MTP modules (`num_nextn_predict_layers`, 0 when absent)."""
    return int(getattr(config, "num_nextn_predict_layers", None) or 0)


class _SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MtpHead(nn.Module):
    """One DeepSeek MTP module over the target's embedding and LM head.

    Args:
        config: the target's HF config (DeepSeek-V3 fields).
        target: the loaded target (`DeepseekV2ForCausalLM` family: its `make_attention` /
            `make_mlp` build the MTP decoder layer, index num_hidden_layers).

    forward(input_ids [n] int64, positions [n] int64, hidden_states [n, H]) ->
    (normed hidden for the logits [n, H], pre-norm hidden for the next draft step [n, H]).
    """

    def __init__(self, config, target: nn.Module) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self._target = (target,)   # not registered: its weights are the target's
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.mtp_block = MoeDecoderLayer(config, config.num_hidden_layers, type(target), None)
        self.shared_head = _SharedHead(h, eps)

    def attention_layers(self) -> list:
        """The MTP layer's cache layers (DeepSeek-V3.2's: the latent's and the indexer's)."""
        attn = self.mtp_block.self_attn
        return attn.cache_layers() if hasattr(attn, "cache_layers") else [attn.attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self._target[0].model.embed_tokens(input_ids)
        embed = embed.masked_fill((positions == 0)[:, None], 0)
        h = self.eh_proj(torch.cat([self.enorm(embed),
                                    self.hnorm(hidden_states.to(embed.dtype))], dim=-1))
        h, residual = self.mtp_block(positions, h, None)
        out = h + residual
        return self.shared_head.norm(out), out

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [m, H] (normed) -> [m] int64 greedy draft tokens."""
        return row_argmax(self._target[0].compute_logits(hidden))


def load_mtp_head(model_path: str, target: nn.Module, dtype: torch.dtype,
                  device: torch.device) -> MtpHead:
    """Build the MTP head of the target checkpoint at `model_path` and load its first MTP
    module's tensors (`model.layers.{num_hidden_layers}.*`).

    Raises:
        ValueError: a config without MTP layers (`num_nextn_predict_layers`), a target family
            without DeepSeek layers, or MTP tensors missing from / unknown to the checkpoint.
    """
    config = target.config
    if num_mtp_layers(config) < 1:
        raise ValueError(f"speculative method 'mtp' needs MTP layers, but {model_path} has "
                         "num_nextn_predict_layers = 0 (no multi-token-prediction module)")
    if not hasattr(type(target), "make_attention"):
        raise ValueError(f"speculative method 'mtp' is for DeepSeek-V3-style models, not "
                         f"{type(target).__name__}")
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = MtpHead(config, target)
        finally:
            torch.set_default_dtype(prev)
    prefix = f"model.layers.{config.num_hidden_layers}."
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for name, tensor in iterate_checkpoint_tensors(model_path, dtype):
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if name in _SHARED_WITH_TARGET or "rotary_emb.inv_freq" in name:
            continue
        if not name.startswith(_OWN):
            name = f"mtp_block.{name}"
        target_name = _load_expert_tensor(params, name, tensor, ())
        if target_name is None:
            target_name = load_named_weight(params, name, tensor,
                                            type(target).stacked_params_mapping)
        loaded.add(target_name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks MTP weights ({prefix}*) for: "
                         f"{sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
    from pagedllm.layers.quantization.base import process_weights_after_loading

    process_weights_after_loading(head)
    return head.eval()
