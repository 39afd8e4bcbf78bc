"""Gated delta rule (Gated DeltaNet's linear attention) over the flat, varlen token batch.

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,   o_t = S_t^T q_t
    (per value head; S [d_k, d_v]; q, k L2-normalised, q scaled by d_k^-1/2)

Chunked form for requests with several query tokens: the WY / UT-transform algorithm of Yang,
Kautz & Hatamizadeh, "Gated Delta Networks" (ICLR 2025) and flash-linear-attention's
`chunk_gated_delta_rule`: inside a chunk everything is matrix products and two triangular solves,
and one loop step per chunk (not per token) carries the state. Recurrent form for one token.
Requests are padded by index into one tensor (g = beta = 0 at padded positions leave the state
alone); each continues from its state slot (zeros when fresh) and leaves its final state there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.state_cache import StateCacheMetadata, emitted_slots
from pagedllm.layers.state_ops import rows_of_token


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and HF's definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64,
                           emit_at: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, ...]:
    """The chunked gated delta rule of a padded batch (float32; q already normalised and scaled).

    Args:
        q, k: [R, H, L, d_k]; v: [R, H, L, d_v]; g (log decay <= 0), beta: [R, H, L];
        initial_state: [R, H, d_k, d_v].
        emit_at: optional (rows [E], positions [E]) int64: also return the state after each of
            these (row, position) pairs, S_t = exp(G_t) S_start + sum over the chunk's tokens
            s <= t of exp(G_t - G_s) k_s v_new_s^T, from its chunk's start state.

    Returns:
        (o [R, H, L, d_v], final state [R, H, d_k, d_v]), and with `emit_at` the emitted
        states [E, H, d_k, d_v] third.
    """
    r, h, length, _ = k.shape
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    nc = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(r, h, nc, chunk_size, *t.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g_cum = g.cumsum(-1)                                                  # [R, H, nc, c]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, -torch.inf).exp()
    # The UT system (I + tril(diag(beta) K K^T * decay, -1)) is unit lower triangular.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(chunk_size, dtype=system.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * g_cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                              # [R, H, nc, c, c]
    q_decayed = q * g_cum.exp()[..., None]
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]                   # [R, H, nc, 1, 1]
    state = initial_state.to(v.dtype)
    out = torch.empty_like(v)
    starts, v_news = [], []
    for i in range(nc):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new
        if emit_at is not None:
            starts.append(state)
            v_news.append(v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(r, h, nc * chunk_size, -1)[:, :, :length]
    if emit_at is None:
        return out, state
    rows, pos = emit_at
    ci, li = pos // chunk_size, pos % chunk_size
    start = torch.stack(starts, 2)[rows, :, ci]                           # [E, H, d_k, d_v]
    v_new = torch.stack(v_news, 2)[rows, :, ci]                           # [E, H, c, d_v]
    weights = decay[rows, :, ci, li]                                      # [E, H, c]
    emitted = (g_cum[rows, :, ci, li].exp()[..., None, None] * start
               + torch.einsum("ehs,ehsk,ehsv->ehkv", weights, k[rows, :, ci], v_new))
    return out, state, emitted


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, states: torch.Tensor, meta: StateCacheMetadata,
                            chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule over the flat batch, from and into each request's state slot.

    Args:
        q, k: [num_tokens, H, d_k] (value heads: grouped heads already repeated), raw (this
            function L2-normalises them and scales q); v: [num_tokens, H, d_v];
        g: [num_tokens, H] log decay; beta: [num_tokens, H];
        states: [num_slots, H, d_k, d_v] float32; the state after each of `meta`'s emit
            tokens is written to its emit slot.

    Returns:
        o [num_tokens, H, d_v] float32.
    """
    n, h, dk = q.shape
    q = l2norm(q.float()) * dk ** -0.5
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(n, h, v.shape[-1], dtype=torch.float32, device=q.device)
    if len(meta.decode_reqs):
        reqs = torch.from_numpy(meta.decode_reqs).to(q.device)
        tok = meta.query_start_loc[reqs]
        slots = meta.state_indices[reqs]
        state = states[slots].float() * meta.has_initial_state[reqs, None, None, None]
        state = state * g[tok].exp()[..., None, None]
        kt = k[tok]
        delta = (v[tok] - torch.einsum("rhkv,rhk->rhv", state, kt)) * beta[tok][..., None]
        state = state + kt[..., None] * delta[..., None, :]
        states.index_copy_(0, slots, state.to(states.dtype))
        out[tok] = torch.einsum("rhkv,rhk->rhv", state, q[tok])
    if len(meta.prefill_reqs):
        reqs = torch.from_numpy(meta.prefill_reqs).to(q.device)
        row_of_req = torch.full((meta.num_reqs,), -1, dtype=torch.int64, device=q.device)
        row_of_req[reqs] = torch.arange(len(reqs), device=q.device)
        rows = row_of_req[meta.token_req_index]
        tok = torch.nonzero(rows >= 0).squeeze(1)
        rows, offs = rows[tok], meta.token_offset[tok]
        qsl = meta.query_start_loc_cpu
        length = int((qsl[meta.prefill_reqs + 1] - qsl[meta.prefill_reqs]).max())

        def padded(t: torch.Tensor) -> torch.Tensor:
            p = t.new_zeros(len(reqs), length, *t.shape[1:])
            p[rows, offs] = t[tok]
            return p.transpose(1, 2)                                      # [R, H, L, ...]

        slots = meta.state_indices[reqs]
        init = states[slots].float() * meta.has_initial_state[reqs, None, None, None]
        keep, emit_slots = emitted_slots(meta)
        emit_tok = meta.emit_token[keep]
        emit_at = (rows_of_token(row_of_req, meta, emit_tok), meta.token_offset[emit_tok])
        o, final, emitted = chunk_gated_delta_rule(padded(q), padded(k), padded(v), padded(g),
                                                   padded(beta), init, chunk_size, emit_at)
        states.index_copy_(0, slots, final.to(states.dtype))
        states.index_copy_(0, emit_slots, emitted.to(states.dtype))
        out[tok] = o.transpose(1, 2)[rows, offs]
    return out
