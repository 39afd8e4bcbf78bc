"""Training an EAGLE-3 head with the training-time test (Li et al. 2025, "EAGLE-3: Scaling up
Inference Acceleration of Large Language Models via Training-Time Test", sec. 3.2; the authors'
`eagle/traineagle3/cnets.py` is the reference design, every line here is our own).

`Eagle3TrainHead` is the head of `spec_decode/eagle.py` (`EagleHead`, method "eagle3") as a
plain differentiable module over whole sequences, in the EAGLE authors' parameter names
(`fc`, `midlayer.*`, `norm`, `lm_head`), and `ttt_forward` unrolls it over several draft steps
the way the engine drafts (`EagleProposer.propose`):

- step 0 at row p: hidden fc(features_p), token p + 1, position p; its keys are the context
  every later step reads (the engine's catch-up writes them into the KV cache);
- step j >= 1 at row p: hidden = step j - 1's pre-norm output at row p, token p + 1 + j,
  position p + j; its query attends to step 0's keys at rows <= p and to the keys of steps
  1 .. j at row p (its own chain of drafts), nothing else.

So the logits of step j at row p are what the engine computes for draft j + 1 after the
target's token p + 1 when the earlier drafts were the tokens p + 2 .. p + 1 + j (teacher
forcing: a wrong earlier draft is rejected anyway). `tests/spec_decode/test_eagle3_ttt.py`
checks that equality against the engine itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Eagle3TrainHead(nn.Module):
    """An EAGLE-3 head for training.

    Args:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
        rms_norm_eps, rope_theta: the decoder layer's shape (Llama conventions; the engine
            reads the same fields from the saved config.json).
        draft_vocab_size: D, rows of the head's own LM head.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_attention_heads: int,
                 num_key_value_heads: int, head_dim: int, rms_norm_eps: float,
                 rope_theta: float, draft_vocab_size: int) -> None:
        super().__init__()
        h = hidden_size
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {num_key_value_heads}")
        self.nh, self.nkv, self.hd = num_attention_heads, num_key_value_heads, head_dim
        self.eps, self.theta = rms_norm_eps, rope_theta
        self.fc = nn.Linear(3 * h, h, bias=False)
        m = self.midlayer = nn.Module()
        m.input_layernorm = nn.Parameter(torch.ones(h))
        m.hidden_norm = nn.Parameter(torch.ones(h))
        m.post_attention_layernorm = nn.Parameter(torch.ones(h))
        m.q_proj = nn.Linear(2 * h, self.nh * self.hd, bias=False)
        m.k_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        m.v_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        m.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        m.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        m.up_proj = nn.Linear(h, intermediate_size, bias=False)
        m.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, n, heads, hd], positions [n] -> rotated (neox halves, as Llama)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd))
        ang = positions[:, None].double() * inv[None]
        cos = torch.cat([ang.cos()] * 2, -1).to(x.dtype)[:, None]
        sin = torch.cat([ang.sin()] * 2, -1).to(x.dtype)[:, None]
        x1, x2 = x[..., :self.hd // 2], x[..., self.hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def ttt_forward(self, embeds: torch.Tensor, feats: torch.Tensor,
                    num_steps: int) -> list[torch.Tensor]:
        """Unrolled draft steps over whole sequences (see the module docstring).

        Args:
            embeds: [B, n + num_steps - 1, H] float, the target's embeddings of tokens
                1 .. n + num_steps - 1 of each sequence (row p of step j reads row p + j).
            feats: [B, n, 3H] float, the target's auxiliary states at rows 0 .. n - 1.
            num_steps: K >= 1 draft steps.

        Returns:
            K draft-vocabulary logits [B, n, D]; step j's row p predicts token p + 2 + j.

        Raises:
            ValueError: embeds too short for K steps.
        """
        b, n, _ = feats.shape
        if embeds.shape[1] < n + num_steps - 1:
            raise ValueError(f"{num_steps} steps over {n} rows need {n + num_steps - 1} "
                             f"embedding rows, got {embeds.shape[1]}")
        m = self.midlayer
        rows = torch.arange(n)
        causal = rows[None, :] <= rows[:, None]                   # [n, n] query p, key r
        rep = self.nh // self.nkv
        scale = self.hd ** -0.5
        hidden = self.fc(feats)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        for j in range(num_steps):
            emb = embeds[:, j:j + n]
            a = torch.cat([_rms(emb, m.input_layernorm, self.eps),
                           _rms(hidden, m.hidden_norm, self.eps)], -1)
            pos = rows + j
            q = self._rope(m.q_proj(a).view(b, n, self.nh, self.hd), pos)
            k = self._rope(m.k_proj(a).view(b, n, self.nkv, self.hd), pos)
            v = m.v_proj(a).view(b, n, self.nkv, self.hd)
            keys.append(k.repeat_interleave(rep, 2))
            values.append(v.repeat_interleave(rep, 2))
            # Step 0's keys: causal over rows; steps 1..j: the same row only (the diagonal).
            s0 = torch.einsum("bqhd,bkhd->bhqk", q, keys[0]) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            diag = [torch.einsum("bqhd,bqhd->bhq", q, kk)[..., None] * scale
                    for kk in keys[1:]]
            p = torch.cat([s0, *diag], -1).softmax(-1)
            o = torch.einsum("bhqk,bkhd->bqhd", p[..., :n], values[0])
            for i, vv in enumerate(values[1:]):
                o = o + p[..., n + i].transpose(1, 2)[..., None] * vv
            h = m.o_proj(o.reshape(b, n, -1)) + hidden
            x = _rms(h, m.post_attention_layernorm, self.eps)
            h = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)) + h
            logits.append(self.lm_head(_rms(h, self.norm, self.eps)))
            hidden = h
        return logits

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The tensors in the EAGLE authors' names (float32), without `d2t` / `t2d`."""
        m = self.midlayer
        out = {"fc.weight": self.fc.weight, "norm.weight": self.norm,
               "lm_head.weight": self.lm_head.weight,
               "midlayer.input_layernorm.weight": m.input_layernorm,
               "midlayer.hidden_norm.weight": m.hidden_norm,
               "midlayer.post_attention_layernorm.weight": m.post_attention_layernorm}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"midlayer.self_attn.{name}.weight"] = getattr(m, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"midlayer.mlp.{name}.weight"] = getattr(m, name).weight
        return {k: v.detach().float().contiguous() for k, v in out.items()}


def ttt_loss(logits: list[torch.Tensor], targets: torch.Tensor, decay: float = 0.8
             ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The training-time-test loss: sum over steps j of decay ** j x mean cross entropy.

    Args:
        logits: K tensors [B, n, D] from `ttt_forward`.
        targets: [B, n + K - 1] int64 draft-vocabulary ids of tokens 2 .. n + K of each
            sequence (step j's row p is scored against targets[:, p + j]); -100 = not scored
            (prompt tokens, padding, tokens outside the draft vocabulary).
        decay: step j's weight is decay ** j (the EAGLE-3 authors use 0.8).

    Returns:
        (the loss, per step (correct top-1 predictions, scored rows)).
    """
    n = logits[0].shape[1]
    total = logits[0].new_zeros(())
    stats = []
    for j, lg in enumerate(logits):
        y = targets[:, j:j + n]
        mask = y >= 0
        if mask.any():
            total = total + decay ** j * F.cross_entropy(lg[mask], y[mask])
        stats.append((int((lg.argmax(-1)[mask] == y[mask]).sum()), int(mask.sum())))
    return total, stats
