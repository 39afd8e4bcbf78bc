"""Mamba-2 (`Mamba2ForCausalLM`): a decoder of SSD mixers, no attention.

    embed -> [ RMSNorm -> Mamba2Mixer -> +res ] x L -> RMSNorm -> LM head

    Mamba2Mixer:  in_proj -> [ z | xBC | dt ]
                  xBC -> causal depthwise conv1d (window state) -> silu -> [ x | B | C ]
                  y = SSD(x, softplus(dt + dt_bias), A = -exp(A_log), B, C) + D x   (SSM state)
                  out_proj(gated_rms_norm(y, z))

Each mixer keeps a conv window [conv_dim, K - 1] and an SSM state [H, P, N] (float32) per
request in the state cache (layers/state_cache.py); the ops are layers/state_ops.py. Reference:
Dao & Gu, "Transformers are SSMs" (2024); HF transformers' Mamba2 torch path is the oracle.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ColumnParallelLinear, default_weight_loader
from pagedllm.layers.state_cache import StateCache
from pagedllm.layers.state_kernels import causal_conv1d_varlen, ssd_varlen
from pagedllm.layers.state_ops import gated_rms_norm
from pagedllm.models.hybrid import HybridForCausalLM
from pagedllm.models.hybrid_gguf import mamba2_checkpoint_weights, mamba2_hf_config


def _weight(*shape: int) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


def mamba_mixer_config(config, **extra) -> SimpleNamespace:
    """The Mamba-2 mixer's config fields from a hybrid config's `mamba_*` ones (Granite 4
    hybrid, Falcon-H1), plus a family's `extra` fields (see `Mamba2Mixer`)."""
    return SimpleNamespace(
        hidden_size=config.hidden_size, expand=config.mamba_expand,
        num_heads=config.mamba_n_heads, head_dim=config.mamba_d_head,
        n_groups=config.mamba_n_groups, state_size=config.mamba_d_state,
        chunk_size=config.mamba_chunk_size, hidden_act=config.hidden_act,
        time_step_limit=config.time_step_limit, conv_kernel=config.mamba_d_conv,
        use_bias=config.mamba_proj_bias, use_conv_bias=config.mamba_conv_bias,
        layer_norm_epsilon=config.rms_norm_eps, **extra)


class Mamba2Mixer(nn.Module):
    """hidden [n, hidden_size] -> [n, hidden_size] over the state cache."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        # (Falcon-H1's view sets `ssm_intermediate_size`, its mamba_d_ssm; also `rms_norm`,
        # `norm_before_gate` and `out_proj_bias`, which Mamba-2 configs do not have.)
        self.intermediate_size = (getattr(config, "ssm_intermediate_size", None)
                                  or int(config.expand * hidden))
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.n_groups = config.n_groups
        self.state_size = config.state_size
        self.chunk_size = config.chunk_size
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(f"Mamba2: num_heads * head_dim = {self.num_heads * self.head_dim} "
                             f"!= expand * hidden_size = {self.intermediate_size}")
        if config.hidden_act != "silu":
            raise ValueError(f"Mamba2: hidden_act {config.hidden_act!r} is not implemented "
                             "(only 'silu')")
        limit = tuple(config.time_step_limit)
        self.dt_limit = None if limit == (0.0, float("inf")) else limit
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.state_size
        k = config.conv_kernel
        self.in_proj = ColumnParallelLinear(
            hidden, self.intermediate_size + self.conv_dim + self.num_heads, config.use_bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = _weight(self.conv_dim, 1, k)
        self.conv1d.bias = _weight(self.conv_dim) if config.use_conv_bias else None
        self.dt_bias = _weight(self.num_heads)
        self.A_log = _weight(self.num_heads)
        self.D = _weight(self.num_heads)
        self.rms_norm = getattr(config, "rms_norm", True)
        self.norm_before_gate = getattr(config, "norm_before_gate", False)
        if self.rms_norm:
            self.norm = nn.Module()
            self.norm.weight = _weight(self.intermediate_size)
        self.norm_eps = config.layer_norm_epsilon
        self.out_proj = ColumnParallelLinear(self.intermediate_size, hidden,
                                             getattr(config, "out_proj_bias", config.use_bias))
        self.state = StateCache(((self.conv_dim, k - 1),
                                 (self.num_heads, self.head_dim, self.state_size)),
                                (torch.get_default_dtype(), torch.float32),
                                f"backbone.layers.{layer_idx}.mixer")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.state.metadata()
        conv_state, ssm_state = self.state.states
        n = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xbc = causal_conv1d_varlen(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state,
                                   meta, activation="silu")
        x, b, c = xbc.split([self.intermediate_size, self.n_groups * self.state_size,
                             self.n_groups * self.state_size], dim=-1)
        dt = nn.functional.softplus(dt.float() + self.dt_bias.float())
        y = ssd_varlen(x.reshape(n, self.num_heads, self.head_dim), dt,
                       -torch.exp(self.A_log.float()),
                       b.reshape(n, self.n_groups, self.state_size),
                       c.reshape(n, self.n_groups, self.state_size), self.D, ssm_state, meta,
                       self.chunk_size, self.dt_limit)
        y = y.reshape(n, -1)
        group_size = self.intermediate_size // self.n_groups
        if not self.rms_norm:
            y = y * nn.functional.silu(z.float())
        elif self.norm_before_gate:     # weight * RMSNorm(y) * silu(z), Falcon-H1's option
            g = y.float().reshape(n, -1, group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            y = self.norm.weight * g.reshape(n, -1) * nn.functional.silu(z.float())
        else:
            y = gated_rms_norm(y, z, self.norm.weight, self.norm_eps, group_size)
        return self.out_proj(y.to(hidden.dtype))


class Mamba2Block(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.residual_in_fp32 = bool(config.residual_in_fp32)
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(config, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        residual = hidden.float() if self.residual_in_fp32 else hidden
        out = self.mixer(self.norm(hidden.to(dtype)))
        return residual + out


class Mamba2ForCausalLM(HybridForCausalLM):
    """Mamba-2's stack (`backbone.{embeddings,layers,norm_f}`) on `HybridForCausalLM`; its API.
    HF's old name of the embeddings, "backbone.embedding.", loads too."""

    gguf_architecture = "mamba2"

    @classmethod
    def gguf_hf_config(cls, metadata: dict, tensors: dict):
        """The HF config of a `mamba2` GGUF file (`hybrid_gguf.mamba2_hf_config`)."""
        return mamba2_hf_config(metadata, tensors)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights):
        """HF-named tensors of a `mamba2` GGUF file (`hybrid_gguf.mamba2_checkpoint_weights`)."""
        return mamba2_checkpoint_weights(config, weights, cls.__name__)

    def __init__(self, config) -> None:
        super().__init__(config, None, (), lambda i, _: Mamba2Block(config, i),
                         RMSNorm(config.hidden_size, config.layer_norm_epsilon),
                         stack="backbone", embedding="embeddings", norm="norm_f")

    def checkpoint_tensors(self, name: str, tensor):
        return ((name.replace("backbone.embedding.", "backbone.embeddings."), tensor),)
