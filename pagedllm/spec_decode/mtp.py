"""DeepSeek-V3 multi-token prediction (MTP) as the drafter (DeepSeek-V3 technical report,
arXiv:2412.19437 sec. 2.2; vLLM's `deepseek_mtp.py` is the reference for the layout and for
which MTP layer runs at which draft step).

The checkpoint's MTP modules j = 0 .. n - 1 (n = `num_nextn_predict_layers`) sit after the
target's layers, `model.layers.{L + j}.*` (L = num_hidden_layers); module j runs, per position p
with the token t_{p+1} after it:

    h   = eh_proj([enorm(embed(t_{p+1})), hnorm(hidden_p)])        (eh_proj: 2H -> H, no bias)
    out = decoder layer L + j (MLA + DeepSeek MoE, a normal DeepSeek layer) -> h + residual
    logits = lm_head(shared_head.norm(out))

Draft step i (0: the catch-up over the kept positions, which gives the first draft; i >= 1: the
i-th further draft) runs module i % n, vLLM's rule (`DeepSeekMultiTokenPredictor.forward`:
`spec_step_idx % num_mtp_layers`). Each module has its own latent KV cache. As in vLLM, the
catch-up runs module 0 only, so module j >= 1 writes its cache only at the positions where it
drafts; its entries at the other positions are whatever the block held (drafts only: the
rejection sampler keeps the outputs exact whatever a draft is).

`embed` and `lm_head` are the target's (`shared_head.head` and `embed_tokens`, copies of them
in released checkpoints, are not loaded). hidden_p is the target's last (final-normed) hidden
state for the first draft, then the previous step's pre-norm `out` (vLLM); the embedding row
at position 0 is zeroed, as vLLM does. The modules' latent KV caches (`attention_layers`) are
over the target's block ids, as an EAGLE head's.

`MtpHead` has the EAGLE head's interface (`forward`, `draft_token_ids`, `attention_layers`),
so `EagleProposer` and the runner's EAGLE plumbing (worker/eagle_inputs.py) drive it as is;
the proposer passes the draft step as `spec_step_idx`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.model_loader.loader import iterate_checkpoint_tensors
from pagedllm.models.moe import (MoeDecoderLayer, ReplicatedLinear, _load_expert_tensor,
                                  check_experts_complete)
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


class MtpLayer(nn.Module):
    """One MTP module (checkpoint `model.layers.{layer_idx}.*`): enorm, hnorm, eh_proj, the
    DeepSeek decoder layer `mtp_block` and `shared_head.norm`.

    forward(embed [n, H], positions [n] int64, hidden_states [n, H]) ->
    (normed hidden for the logits [n, H], pre-norm hidden for the next draft step [n, H]).
    """

    def __init__(self, config, layer_idx: int, family: type) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.mtp_block = MoeDecoderLayer(config, layer_idx, family, None)
        self.shared_head = _SharedHead(h, eps)

    def forward(self, embed: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.eh_proj(torch.cat([self.enorm(embed),
                                    self.hnorm(hidden_states.to(embed.dtype))], dim=-1))
        h, residual = self.mtp_block(positions, h, None)
        out = h + residual
        return self.shared_head.norm(out), out


class MtpHead(nn.Module):
    """The checkpoint's n DeepSeek MTP modules over the target's embedding and LM head.

    Args:
        config: the target's HF config (DeepSeek-V3 fields; n = `num_nextn_predict_layers`).
        target: the loaded target (`DeepseekV2ForCausalLM` family: its `make_attention` /
            `make_mlp` build the MTP decoder layers, indices num_hidden_layers + j).

    forward(input_ids [n] int64, positions [n] int64, hidden_states [n, H], spec_step_idx) ->
    (normed hidden for the logits [n, H], pre-norm hidden for the next draft step [n, H]),
    computed by module `spec_step_idx % n` (vLLM's rule).
    """

    def __init__(self, config, target: nn.Module) -> None:
        super().__init__()
        self._target = (target,)   # not registered: its weights are the target's
        first = config.num_hidden_layers
        self.layers = nn.ModuleList(MtpLayer(config, first + j, type(target))
                                    for j in range(num_mtp_layers(config)))

    def attention_layers(self) -> list:
        """The MTP modules' cache layers in module order (DeepSeek-V3.2's: each module's
        latent cache layer, then its indexer's)."""
        out = []
        for layer in self.layers:
            attn = layer.mtp_block.self_attn
            out += attn.cache_layers() if hasattr(attn, "cache_layers") else [attn.attn]
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, spec_step_idx: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self._target[0].model.embed_tokens(input_ids)
        embed = embed.masked_fill((positions == 0)[:, None], 0)
        return self.layers[spec_step_idx % len(self.layers)](embed, positions, hidden_states)

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [m, H] (normed) -> [m] int64 greedy draft tokens."""
        return row_argmax(self._target[0].compute_logits(hidden))


def _head_param_name(name: str, first: int, count: int) -> str | None:
    """Checkpoint name -> MtpHead parameter name; None for tensors that are not an MTP
    module's own (the target's, the copies of its embedding and head, rotary buffers)."""
    if not name.startswith("model.layers."):
        return None
    index, _, rest = name[len("model.layers."):].partition(".")
    if not index.isdigit() or not first <= int(index) < first + count:
        return None
    if rest in _SHARED_WITH_TARGET or "rotary_emb.inv_freq" in rest:
        return None
    return f"layers.{int(index) - first}.{rest if rest.startswith(_OWN) else 'mtp_block.' + rest}"


def load_mtp_head(model_path: str, target: nn.Module, dtype: torch.dtype,
                  device: torch.device) -> MtpHead:
    """Build the MTP head of the target checkpoint at `model_path` and load its
    `num_nextn_predict_layers` MTP modules (`model.layers.{num_hidden_layers + j}.*`).

    Raises:
        ValueError: a config without MTP layers (`num_nextn_predict_layers`), a target family
            without DeepSeek layers, or MTP tensors missing from the checkpoint (named, with
            the modules that lack them: a config that claims more modules than the
            checkpoint ships fails here).
    """
    config = target.config
    count = num_mtp_layers(config)
    if count < 1:
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
    first = config.num_hidden_layers
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    seen: dict[str, set] = {}
    for name, tensor in iterate_checkpoint_tensors(model_path, dtype):
        name = _head_param_name(name, first, count)
        if name is None:
            continue
        target_name = _load_expert_tensor(params, name, tensor, (), seen)
        if target_name is None:
            target_name = load_named_weight(params, name, tensor,
                                            type(target).stacked_params_mapping)
        loaded.add(target_name)
    missing = sorted(set(params) - loaded)
    if missing:
        modules = sorted({int(m.split(".")[1]) + first for m in missing})
        shown = [f"model.layers.{int(m.split('.')[1]) + first}."
                 f"{m.split('.', 2)[2].removeprefix('mtp_block.')}" for m in missing[:8]]
        raise ValueError(
            f"checkpoint {model_path} lacks MTP weights of module(s) "
            f"{', '.join(f'model.layers.{i}.*' for i in modules)} (its config says "
            f"num_nextn_predict_layers = {count}, modules model.layers.{first}.* to "
            f"model.layers.{first + count - 1}.*): {shown}"
            f"{' ...' if len(missing) > 8 else ''}")
    check_experts_complete(head, seen)
    from pagedllm.layers.quantization.base import process_weights_after_loading

    process_weights_after_loading(head)
    return head.eval()
