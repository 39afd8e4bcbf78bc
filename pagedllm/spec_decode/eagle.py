"""EAGLE and EAGLE-3 drafters (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty"; Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"); vLLM's `llama_eagle.py` / `llama_eagle3.py` are the
reference for the layouts.

A head is one Llama decoder layer fed with the target's hidden states:

    EAGLE:    h = fc([embed(t_{p+1}), hidden_p])                  (fc: 2H -> H, bias optional)
              layer 0 without input norm -> h + residual -> the target's LM head
    EAGLE-3:  h = fc([aux_a, aux_b, aux_c])_p  (first step only; 3H -> H), the inputs of three
              target layers (default 2, L // 2, L - 3)
              layer(qkv over [input_norm(embed(t_{p+1})), hidden_norm(h)], 2H) -> norm
              -> its own LM head over a reduced draft vocabulary; target id = id + d2t[id]

Position p's draft row pairs the target's hidden state at p with the token at p + 1 and writes
the head's KV at p (the head has its own KV tensors over the target's block ids, as a draft
model). Each step (`EagleProposer`):
1. catch-up: the head runs over every position the target computed and kept this step (a
   prefill chunk, or the last token and the accepted drafts), with the token after each one;
2. from each sampled request's last row, k - 1 more greedy steps feed the head's own
   (pre-norm) output back as the hidden state.
The head is called with the draft step `spec_step_idx` (0 for the catch-up, i for the i-th
further step): a head of several layers (DeepSeek MTP modules) picks its layer by it.
Greedy drafts: a one-hot proposal, so outputs stay exact under the rejection sampler.

Checkpoint formats (`load_eagle_head`):
- the EAGLE authors': a Llama `config.json` and `fc.*`, `layers.0.*` (EAGLE) or `midlayer.*`
  (EAGLE-3), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally `embed_tokens.weight`;
- vLLM's `speculators`: `config.json` with `speculators_model_type` ("eagle" / "eagle3"),
  `transformer_layer_config` (the layer's Llama config), `draft_vocab_size`, and tensors named
  as above (`layers.0.*`), possibly with a `model.` prefix.
Missing `embed_tokens` / `lm_head` (EAGLE) are the target's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import QKVParallelLinear
from pagedllm.models.llama import LlamaAttention, LlamaMLP
from pagedllm.models.utils import load_named_weight
from pagedllm.sample.ops.argmax import row_argmax

EAGLE_METHODS = ("eagle", "eagle3")
_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

# (model, input_ids [n], positions [n], common metadata, hidden_states=[n, H'], spec_step_idx=i)
# -> ([n, H] for logits, [n, H] hidden for the next draft step)
RunHead = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's auxiliary layers: the inputs of layers 2, L // 2 and L - 3 (vLLM's default)."""
    return (2, num_layers // 2, num_layers - 3)


class EagleHead(nn.Module):
    """One EAGLE / EAGLE-3 decoder layer with its input projection and (EAGLE-3) its own norm
    and reduced-vocabulary LM head.

    Args:
        config: the layer's Llama config (hidden_size, heads, intermediate_size, rope, eps,
            max_position_embeddings) plus `draft_vocab_size` (EAGLE-3) and `fc_bias` (EAGLE).
        method: "eagle" or "eagle3".
        target: the target model (its embedding, and for EAGLE its LM head, are shared).
    """

    def __init__(self, config, method: str, target: nn.Module) -> None:
        super().__init__()
        if method not in EAGLE_METHODS:
            raise ValueError(f"EAGLE method must be one of {EAGLE_METHODS}, got {method!r}")
        self.method = method
        h = config.hidden_size
        self.eagle3 = method == "eagle3"
        # Shared with the target, not registered here (their weights are the target's).
        self._target = (target,)
        self.fc = nn.Linear((3 if self.eagle3 else 2) * h, h,
                            bias=bool(getattr(config, "fc_bias", False)))
        self.self_attn = LlamaAttention(config, 0, False, bool(getattr(config, "attention_bias",
                                                                       False)),
                                        bool(getattr(config, "attention_bias", False)))
        if self.eagle3:
            heads = config.num_attention_heads
            self.self_attn.qkv_proj = QKVParallelLinear(
                2 * h, self.self_attn.head_size, heads,
                getattr(config, "num_key_value_heads", None) or heads,
                bool(getattr(config, "attention_bias", False)))
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None)
                                        or config.vocab_size)
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(h, config.intermediate_size, getattr(config, "hidden_act", "silu"),
                            bool(getattr(config, "mlp_bias", False)))
        self.embed_tokens: nn.Module | None = None   # set when the checkpoint has its own
        # ((weight address, version), float32 copy) of the EAGLE-3 LM head (`_lm_head_f32`)
        self._lm_head_cache: tuple[tuple[int, int], torch.Tensor] | None = None

    def attention_layers(self) -> list:
        return [self.self_attn.attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, spec_step_idx: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [n] (the token after each position), positions [n], hidden_states [n, H]
        (or [n, 3H] target aux states for EAGLE-3's first step, [n, H] target states for
        EAGLE) -> (hidden for logits [n, H], hidden for the next step [n, H]).
        `spec_step_idx` (the draft step) is the proposer's interface; one layer serves all."""
        embed = (self.embed_tokens or self._target[0].model.embed_tokens)(input_ids)
        if not self.eagle3:
            h = self.fc(torch.cat([embed, hidden_states.to(embed.dtype)], dim=-1))
            residual = h
            h = self.self_attn(positions, h)
            h, residual = self.post_attention_layernorm(h, residual)
            out = self.mlp(h) + residual
            return out, out
        hidden = hidden_states.to(embed.dtype)
        if hidden.shape[-1] != embed.shape[-1]:
            hidden = self.fc(hidden)
        residual = hidden
        h = torch.cat([self.input_layernorm(embed), self.hidden_norm(hidden)], dim=-1)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        normed, prenorm = self.norm(h, residual)
        return normed, prenorm

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [m, H] -> [m] int64 greedy draft tokens in the target's vocabulary."""
        if not self.eagle3:
            return row_argmax(self._target[0].compute_logits(hidden))
        logits = torch.nn.functional.linear(hidden.float(), self._lm_head_f32())
        ids = row_argmax(logits)
        return ids + self.d2t[ids]

    def _lm_head_f32(self) -> torch.Tensor:
        """The draft LM head's weight [draft_vocab, H] in float32: a copy made once per
        storage and version of the weight (converting a bfloat16 head at every draft step cost
        about a third of the step's head time on a 2-core CPU), or the weight itself."""
        w = self.lm_head.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version)
        if self._lm_head_cache is None or self._lm_head_cache[0] != key:
            self._lm_head_cache = (key, w.detach().float())
        return self._lm_head_cache[1]


def _read_config(path: Path, method: str):
    raw = json.loads((path / "config.json").read_text())
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != method:
            raise ValueError(f"{path} is a speculators '{kind}' head, method is '{method}'")
        layer = dict(raw.get("transformer_layer_config") or {})
        layer.setdefault("draft_vocab_size", raw.get("draft_vocab_size"))
        raw = {**layer, **{k: raw[k] for k in ("draft_vocab_size",
                                                "eagle_aux_hidden_state_layer_ids")
                           if raw.get(k)}}
    raw.setdefault("max_position_embeddings", 4096)
    raw.setdefault("rms_norm_eps", 1e-6)
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in raw.items()
                            if k not in ("architectures", "model_type", "torch_dtype")})
    for key in ("draft_vocab_size", "fc_bias", "eagle_aux_hidden_state_layer_ids"):
        if key in raw:
            setattr(config, key, raw[key])
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or *.bin weights in {path}")
    out = {}
    for f in bins:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def _head_name(name: str) -> str | None:
    """Checkpoint name -> EagleHead parameter name (None: skip)."""
    for prefix in ("model.",):
        name = name.removeprefix(prefix)
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("layers."):
        raise ValueError(f"EAGLE heads have one decoder layer; the checkpoint has {name}")
    if name == "t2d" or "rotary_emb" in name:
        return None
    return name


def load_eagle_head(path: str, method: str, target: nn.Module, dtype: torch.dtype,
                    device: torch.device) -> tuple[EagleHead, tuple[int, ...]]:
    """Load an EAGLE (-3) head from `path` (either format, see the module docstring).

    Returns:
        (the head, the target layers whose inputs it needs: () for EAGLE).

    Raises:
        ValueError: unknown or missing tensors, a format of the other method, mismatching
            shapes; FileNotFoundError: no weights.
    """
    folder = Path(path)
    config = _read_config(folder, method)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = EagleHead(config, method, target)
        finally:
            torch.set_default_dtype(prev)
    tensors = _read_tensors(folder)
    if not any(n.removeprefix("model.") == "fc.weight" for n in tensors):
        archs = json.loads((folder / "config.json").read_text()).get("architectures")
        raise ValueError(f"{path} is not an {method.upper()} head: it has no `fc` tensor (the "
                         f"projection of the target's hidden states; its architectures: "
                         f"{archs}). A small model of the target's family is method "
                         "'draft_model'")
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        target_name = _head_name(name)
        if target_name is None:
            continue
        if target_name == "d2t":
            if not head.eagle3:
                raise ValueError("d2t is an EAGLE-3 tensor; method is 'eagle'")
            head.d2t.copy_(tensor.to(torch.int64))
            continue
        if target_name == "embed_tokens.weight":
            head.embed_tokens = nn.Embedding(*tensor.shape, device=device, dtype=dtype)
            head.embed_tokens.weight.data.copy_(tensor)
            continue
        if target_name == "lm_head.weight" and not head.eagle3:
            continue    # EAGLE uses the target's LM head
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        loaded.add(load_named_weight(params, target_name, tensor, _STACKED))
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"EAGLE head {path} lacks weights for: {sorted(missing)}")
    from pagedllm.layers.quantization.base import process_weights_after_loading

    process_weights_after_loading(head)
    num_layers = target.config.num_hidden_layers
    aux = tuple(getattr(config, "eagle_aux_hidden_state_layer_ids", None)
                or default_aux_layers(num_layers)) if head.eagle3 else ()
    if any(not 0 <= i < num_layers for i in aux):
        raise ValueError(f"EAGLE-3 auxiliary layers {aux} outside the target's {num_layers}")
    return head.eval(), aux


class EagleProposer:
    """Greedy drafts from an EAGLE (-3) head.

    Args:
        head: the loaded head.
        num_speculative_tokens: k.
        run_head: the runner's forward function (sets the attention metadata).
        block_size, device: of the shared KV layout.
    """

    def __init__(self, head: EagleHead, num_speculative_tokens: int, run_head: RunHead,
                 block_size: int, device: torch.device) -> None:
        self.model = head
        self.k = num_speculative_tokens
        self.run_head = run_head
        self.block_size = block_size
        self.device = device

    def propose(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                common: CommonAttentionMetadata, last_rows: np.ndarray,
                block_table: np.ndarray, max_drafts: np.ndarray) -> list[list[int]]:
        """Drafts for B sampled requests.

        Args:
            input_ids: [n] the token after each catch-up position.
            positions: [n] the catch-up positions (each request's computed-and-kept ones).
            hidden: [n, H'] the target's hidden (EAGLE) or aux hidden (EAGLE-3) states there.
            common: attention metadata of the catch-up batch.
            last_rows: [B] the flat row of each sampled request's last kept position.
            block_table: [B, max_blocks] int32 block ids of each sampled request.
            max_drafts: [B] most drafts allowed per request.
        """
        logits_hidden, next_hidden = self.run_head(self.model, input_ids, positions, common,
                                                   hidden_states=hidden, spec_step_idx=0)
        if not len(last_rows):
            return []
        rows = torch.from_numpy(last_rows).to(self.device)
        tokens = self.model.draft_token_ids(logits_hidden[rows]).cpu().numpy()
        hidden_b = next_hidden[rows]
        drafts: list[list[int]] = [[int(t)] if m > 0 else [] for t, m in zip(tokens, max_drafts)]
        pos = positions.cpu().numpy()[last_rows].astype(np.int64) + 1
        bs = self.block_size
        for i in range(1, self.k):
            active = np.nonzero(max_drafts > i)[0]
            if not len(active):
                break
            p = pos[active]
            slots = block_table[active, p // bs].astype(np.int64) * bs + p % bs
            seq_lens = (p + 1).astype(np.int32)
            qsl = np.arange(len(active) + 1, dtype=np.int32)
            max_blocks = int(p.max()) // bs + 1
            step_common = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(qsl).to(self.device), query_start_loc_cpu=qsl,
                seq_lens=torch.from_numpy(seq_lens).to(self.device), seq_lens_cpu=seq_lens,
                block_table=torch.from_numpy(
                    np.ascontiguousarray(block_table[active, :max_blocks])).to(self.device),
                slot_mapping=torch.from_numpy(slots).to(self.device), num_reqs=len(active),
                num_actual_tokens=len(active), max_query_len=1, max_seq_len=int(seq_lens.max()),
                block_size=bs)
            idx = torch.from_numpy(active).to(self.device)
            logits_hidden, new_hidden = self.run_head(
                self.model, torch.from_numpy(tokens[active]).to(self.device),
                torch.from_numpy(p).to(self.device), step_common,
                hidden_states=hidden_b[idx], spec_step_idx=i)
            new_tokens = self.model.draft_token_ids(logits_hidden).cpu().numpy()
            for j, b in enumerate(active):
                drafts[b].append(int(new_tokens[j]))
            tokens[active] = new_tokens
            hidden_b = hidden_b.clone()
            hidden_b[idx] = new_hidden
            pos[active] += 1
        return drafts
