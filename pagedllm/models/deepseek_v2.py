"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): MLA attention and
DeepSeek MoE, as transformers 5 defines them.

    embed -> [ RMSNorm -> MLA -> +res -> RMSNorm -> dense MLP (layers < first_k_dense_replace)
                                                    or DeepSeek MoE -> +res ] x L -> RMSNorm -> LM head

MLA (DeepSeek-V2 paper, arXiv:2405.04434 sec. 2.1), per token:

    q      = q_proj(x)  or  q_b_proj(RMSNorm(q_a_proj(x)))     (q_lora_rank None: V2-Lite)
             -> [H, qk_nope_head_dim | qk_rope_head_dim] = [q_nope | q_pe]
    c_kv, k_pe = kv_a_proj_with_mqa(x) -> [kv_lora_rank | qk_rope_head_dim]; c_kv = RMSNorm(c_kv)
    q_pe, k_pe = RoPE (interleaved pairs; YaRN with mscale: layers/deepseek_rope.py)
    cache  <- latent = [c_kv | k_pe]                           (one vector for all heads)
    o      = attention with k_h = [W_UK_h c_kv | k_pe], v_h = W_UV_h c_kv   (kv_b_proj = [W_UK; W_UV]
             per head), in the expanded or absorbed form (attention/backends/mla_torch.py)
    out    = o_proj(o)

DeepSeek MoE: routed experts on `FusedMoE` routed by `DeepseekRouting` (layers/moe_routing.py:
V2 softmax with greedy / group-limited top-k, V3 sigmoid with `e_score_correction_bias` and
group-limited noaux_tc), plus `n_shared_experts` shared experts as one SwiGLU MLP of
n_shared_experts * moe_intermediate_size, added unweighted. These models run on the module path
(the CPU fused decoder takes dense Llama layers only), except that on the CPU a DeepSeek MoE
block may run as one native call (`native/moe_block.py`, attached into `native_block`). Tensor parallelism splits the heads
(q/q_b/kv_b by rows, o_proj by columns); q_a / kv_a projections and the latent cache are
replicated on every rank, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size)
from pagedllm.layers.deepseek_rope import (DeepseekRotaryEmbedding, deepseek_rope_parameters,
                                           deepseek_softmax_scale)
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (ColumnParallelLinear, RowParallelLinear, default_weight_loader,
                                    shard_of)
from pagedllm.layers.mla_attention import MLAAttention
from pagedllm.layers.moe_routing import DeepseekRouting
from pagedllm.models.deepseek_gguf import deepseek2_checkpoint_weights, deepseek2_hf_config
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.moe import MoeForCausalLM, ReplicatedLinear

# HF's q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class HeadShardedWeight(nn.Module):
    """kv_b_proj's weight as a plain matrix [num_heads_per_rank * (dn + dv), kv_lora_rank],
    this tensor-parallel rank's heads (rows); never a linear layer.

    NOTE(mla): MLA reads W_UK / W_UV per head (absorbed into the query and the output, or to
    expand latents), so the weight must stay the [out, in] matrix; a linear layer's weight may
    be repacked for the platform's GEMM after loading (layers/quantization/base.py).
    """

    def __init__(self, output_size: int, input_size: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = tp_size = get_tensor_model_parallel_world_size()
        if output_size % tp_size:
            raise ValueError(f"kv_b_proj rows {output_size} not divisible by tp size {tp_size}")
        self.output_size_per_partition = output_size // tp_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = self.output_size_per_partition
        default_weight_loader(param, shard_of(loaded, 0, rows * self.tp_size, self.tp_rank,
                                              rows))


class DeepseekMLAAttention(nn.Module):
    """MLA projections, RoPE and the `MLAAttention` layer (`.attn`):
    forward(positions [n], hidden [n, hidden_size]) -> [n, hidden_size].

    Raises:
        ValueError: for attention_bias (no released DeepSeek checkpoint has it; not implemented).
    """

    def __init__(self, config, layer_idx: int, rope_interleave: bool) -> None:
        super().__init__()
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported for MLA attention")
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden,
                                                   self.kv_lora_rank + self.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = HeadShardedWeight(
            total_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden)
        self.num_heads = self.kv_b_proj.output_size_per_partition // (
            self.qk_nope_head_dim + self.v_head_dim)
        rope = deepseek_rope_parameters(config.to_dict())
        self.rotary_emb = DeepseekRotaryEmbedding(self.qk_rope_head_dim,
                                                  config.max_position_embeddings, rope,
                                                  rope_interleave)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim,
                                 deepseek_softmax_scale(qk_head_dim, rope),
                                 f"model.layers.{layer_idx}.self_attn")

    def project(self, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope [n, H, dn], q_pe [n, H, dr] and latent [n, L + dr] with RoPE applied,
        q_resid [n, q_lora_rank] = RMSNorm(q_a_proj(x)) or None without q_lora)."""
        n = hidden.shape[0]
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(n, self.num_heads, -1).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None, :])
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe[:, 0]), dim=-1)
        return q_nope, q_pe, latent, q_resid

    @property
    def w_kv_b(self) -> torch.Tensor:
        """[H, dn + dv, L] kv_b_proj's weight per head (this rank's heads)."""
        return self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, _ = self.project(positions, hidden)
        return self.o_proj(self.attn(q_nope, q_pe, latent, self.w_kv_b))


class DeepseekRouterGate(nn.Module):
    """The router's parameters in float32 (HF keeps them so): weight [E, hidden] and, for
    sigmoid scoring, e_score_correction_bias [E]."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.e_score_correction_bias = None
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> router logits [n, E] float32."""
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """Routed experts (`FusedMoE`, routed by `routing`) plus the shared experts:
    forward(x [n, hidden]) -> [n, hidden]."""

    def __init__(self, config, routing: DeepseekRouting, hidden_act: str) -> None:
        super().__init__()
        self.routing = routing
        self.gate = DeepseekRouterGate(config.hidden_size, routing.num_experts,
                                       routing.scoring_func == "sigmoid")
        self.experts = FusedMoE(routing.num_experts, routing.top_k, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False,
                                hidden_act=hidden_act)
        n_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (LlamaMLP(config.hidden_size,
                                        config.moe_intermediate_size * n_shared, hidden_act,
                                        bool(getattr(config, "mlp_bias", False)))
                               if n_shared else None)
        # The native MoE block (native/moe_block.py) that runs this block for the steps it
        # takes, attached after loading; None: always the modules.
        self.native_block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_block is not None:
            out = self.native_block(x)
            if out is not None:
                return out
        weights, ids = self.routing.select_experts(self.gate(x), self.gate.e_score_correction_bias)
        out = self.experts.forward_routed(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekV2ForCausalLM(MoeForCausalLM):
    """DeepSeek-V2 causal LM (see `MoeForCausalLM` for the API): softmax routing with
    `topk_method` "greedy" or "group_limited_greedy".

    Raises (construction, i.e. at load):
        ValueError: naming the config field: an unknown `topk_method` or `scoring_func`, bad
            groups (`DeepseekRouting`), attention_bias, an unsupported rope type.
    """

    scoring_func = "softmax"
    default_topk_method = "greedy"
    # NOTE(deepseek): HF's V2 rotates interleaved pairs (a complex multiply); V3 reads
    # `rope_interleave` (default True).
    stacked_params_mapping = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    # llama.cpp's GGUF architecture (V2 and V3 files alike: models/deepseek_gguf.py).
    gguf_architecture: str | None = "deepseek2"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `deepseek2` GGUF file (`deepseek_gguf.deepseek2_hf_config`)."""
        return deepseek2_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a `deepseek2` GGUF file (`deepseek2_checkpoint_weights`)."""
        return deepseek2_checkpoint_weights(config, weights, cls.__name__)

    @classmethod
    def routing(cls, config) -> DeepseekRouting:
        """The router's settings from the config (validated)."""
        scoring = getattr(config, "scoring_func", None) or cls.scoring_func
        if scoring != cls.scoring_func:
            raise ValueError(f"unsupported scoring_func {scoring!r} for {cls.__name__} "
                             f"(transformers' model uses {cls.scoring_func!r})")
        return DeepseekRouting(
            num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            scoring_func=scoring,
            topk_method=getattr(config, "topk_method", None) or cls.default_topk_method,
            n_group=getattr(config, "n_group", None), topk_group=getattr(config, "topk_group", None),
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0)))

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        return DeepseekMLAAttention(config, layer_idx,
                                    bool(getattr(config, "rope_interleave", True)))

    @classmethod
    def is_dense_layer(cls, config, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a dense MLP (layers < first_k_dense_replace)."""
        return layer_idx < (getattr(config, "first_k_dense_replace", None) or 0)

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        if cls.is_dense_layer(config, layer_idx):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bool(getattr(config, "mlp_bias", False)))
        return DeepseekMoE(config, cls.routing(config), config.hidden_act)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As `MoeForCausalLM.load_weights`, skipping the multi-token-prediction layers that
        DeepSeek-V3 / GLM-4 MoE checkpoints append (`model.layers.{i}.*`, num_hidden_layers <= i
        < num_hidden_layers + num_nextn_predict_layers; the "mtp" drafter loads them itself:
        spec_decode/mtp.py).

        Raises:
            ValueError: as `MoeForCausalLM.load_weights`, and for a layer past those (a
                `num_hidden_layers` smaller than the checkpoint's), naming the tensor.
        """
        num_layers = self.config.num_hidden_layers
        num_mtp = getattr(self.config, "num_nextn_predict_layers", None) or 0

        def target_layers(named):
            for name, tensor in named:
                if name.startswith("model.layers."):
                    layer = int(name.split(".", 3)[2])
                    if layer >= num_layers + num_mtp:
                        raise ValueError(
                            f"checkpoint tensor {name} is past the config's layers "
                            f"(num_hidden_layers {num_layers}, num_nextn_predict_layers "
                            f"{num_mtp})")
                    if layer >= num_layers:
                        continue
                yield name, tensor

        return super().load_weights(target_layers(weights))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 causal LM: sigmoid scores with `e_score_correction_bias`, group-limited
    "noaux_tc" top-k, `norm_topk_prob` (see `DeepseekV2ForCausalLM`)."""

    scoring_func = "sigmoid"
    default_topk_method = "noaux_tc"
    gguf_architecture = None   # deepseek2 files resolve to V2, whose config picks V3
