"""Vectorised torch reference ops of the recurrent layers over the flat, varlen token batch.

    causal_conv1d_varlen   depthwise causal convolution with a per-request window state
                           (Mamba-2's conv1d, LFM2's short convolution)
    ssd_varlen             Mamba-2's state-space duality scan: chunked form for requests with
                           several query tokens (prefill chunks), recurrent form for one token
                           (decode); both read and write the request's SSM state slot
    gated_rms_norm         RMSNorm(y * silu(z)) in groups (Mamba-2's MambaRMSNormGated)

No loop runs per token or per request: requests are gathered into padded tensors by index. The
chunked scan is the SSD algorithm of Dao & Gu, "Transformers are SSMs" (2024), section 6
("ssd_minimal"), with an initial state per request; a chunked prefill that resumes a request
starts a new chunk grid at its first token, which changes only the rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.layers.state_cache import StateCacheMetadata, emitted_slots


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, meta: StateCacheMetadata) -> torch.Tensor:
    """out[t] = bias + sum_k weight[:, k] * u[t - (K - 1) + k], u = the request's inputs after its
    conv state (its last K - 1 inputs before this step, zeros for a fresh request).

    Args:
        x: [num_tokens, C] the step's inputs, requests contiguous (meta.query_start_loc).
        weight: [C, K] depthwise kernel; bias: [C] or None.
        conv_states: [num_slots, C, K - 1], read at and written to each request's slot (the last
            K - 1 inputs after this step); the window after each of `meta`'s emit tokens is
            written to its emit slot.
        meta: the step's state metadata.

    Returns:
        [num_tokens, C] in x's dtype (no activation).
    """
    n, c = x.shape
    k = weight.shape[1]
    k1 = k - 1
    r = meta.num_reqs
    device = x.device
    init = conv_states[meta.state_indices].to(x.dtype)               # [R, C, K-1]
    init = init * meta.has_initial_state[:, None, None].to(x.dtype)
    # ext: each request's K-1 state columns, then its tokens:  [s s s | t t t t][s s s | t] ...
    ext = x.new_empty(n + r * k1, c)
    req_base = meta.query_start_loc[:r] + torch.arange(r, device=device) * k1   # [R]
    state_pos = req_base[:, None] + torch.arange(k1, device=device)           # [R, K-1]
    ext[state_pos.reshape(-1)] = init.transpose(1, 2).reshape(-1, c)
    token_pos = torch.arange(n, device=device) + (meta.token_req_index + 1) * k1   # [n]
    ext[token_pos] = x
    window = token_pos[:, None] - k1 + torch.arange(k, device=device)          # [n, K]
    out = (ext[window] * weight.t().to(x.dtype)[None]).sum(1)
    if bias is not None:
        out = out + bias.to(x.dtype)
    end = meta.query_start_loc[1:r + 1] + (torch.arange(r, device=device) + 1) * k1   # [R]
    last = end[:, None] - k1 + torch.arange(k1, device=device)                 # [R, K-1]
    conv_states.index_copy_(0, meta.state_indices,
                            ext[last].transpose(1, 2).to(conv_states.dtype))
    if meta.num_emits:
        keep, emit_slots = emitted_slots(meta)
        at = token_pos[meta.emit_token[keep]][:, None] - k1 + 1 + torch.arange(k1, device=device)
        conv_states.index_copy_(0, emit_slots, ext[at].transpose(1, 2).to(conv_states.dtype))
    return out


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = x[j+1] + ... + x[i] for i >= j, -inf above the
    diagonal (masked cumulative sums, stabler than differences of one cumsum)."""
    t = x.shape[-1]
    x = x[..., None].expand(*x.shape, t)                # [..., i, j] = x[i]
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), -1)
    out = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    return out.masked_fill(~keep, -torch.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, chunk_size: int, initial_states: torch.Tensor,
                   emit_at: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """The chunked SSD scan of a padded batch (float32 throughout).

    h_t = exp(dt_t * A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t   (per head; h [P, N])

    Args:
        x: [R, L, H, P]; dt: [R, L, H] (after softplus; 0 at padded positions, which then
            leave the state unchanged); a: [H] (A, negative); b, c: [R, L, H, N] (groups
            expanded to heads); initial_states: [R, H, P, N].
        emit_at: optional (rows [E], positions [E]) int64: also return the state after each
            of these (row, position) pairs, h_t = exp(A_cum(s..t]) h_s + sum over the chunk's
            tokens up to t, from its chunk's start state.

    Returns:
        (y [R, L, H, P] without the D skip, final states [R, H, P, N]), and with `emit_at`
        the emitted states [E, H, P, N] third.
    """
    rr, length, h, p = x.shape
    pad = (-length) % chunk_size
    if pad:
        x, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, b, c))
        dt = F.pad(dt, (0, 0, 0, pad))
    nc = (length + pad) // chunk_size
    xdt = (x * dt[..., None]).reshape(rr, nc, chunk_size, h, p)
    b = b.reshape(rr, nc, chunk_size, h, -1)
    c = c.reshape(rr, nc, chunk_size, h, -1)
    da = (dt * a).reshape(rr, nc, chunk_size, h).permute(0, 3, 1, 2)   # [R, H, nc, l]
    da_cum = torch.cumsum(da, dim=-1)
    # 1. inside each chunk: attention-like, masked by the decay between positions l >= s
    decay = torch.exp(segment_sum(da))                                   # [R, H, nc, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", c, b) * decay
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, xdt)
    # 2. each chunk's contribution to the state at its end
    decay_to_end = torch.exp(da_cum[..., -1:] - da_cum)                  # [R, H, nc, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", b, decay_to_end, xdt)
    # 3. states at chunk starts: recurrence over chunks, from the initial state
    states = torch.cat([initial_states[:, None].float(), chunk_states], dim=1)   # [R, nc+1, ...]
    chunk_decay = torch.exp(segment_sum(F.pad(da_cum[..., -1], (1, 0))))        # [R, H, z, z]
    states = torch.einsum("bhzy,byhpn->bzhpn", chunk_decay, states)
    start_states, final = states[:, :-1], states[:, -1]
    # 4. the start state's contribution inside each chunk
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", c, start_states, torch.exp(da_cum))
    y = (y_diag + y_off).reshape(rr, nc * chunk_size, h, p)[:, :length]
    if emit_at is None:
        return y, final
    rows, pos = emit_at
    ci, li = pos // chunk_size, pos % chunk_size
    weights = decay[rows, :, ci, li]                                     # [E, H, s]
    emitted = (torch.exp(da_cum[rows, :, ci, li])[..., None, None] * start_states[rows, ci]
               + torch.einsum("ehs,eshn,eshp->ehpn", weights, b[rows, ci], xdt[rows, ci]))
    return y, final, emitted


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, d: torch.Tensor, ssm_states: torch.Tensor,
               meta: StateCacheMetadata, chunk_size: int,
               dt_limit: tuple[float, float] | None = None) -> torch.Tensor:
    """Mamba-2's SSM over the flat batch: each request continues from its state slot (zeros
    when fresh) and leaves its final state there.

    Args:
        x: [num_tokens, H, P]; dt: [num_tokens, H] after softplus; a: [H] = -exp(A_log);
        b, c: [num_tokens, G, N]; d: [H] skip; ssm_states: [num_slots, H, P, N] float32.
        chunk_size: the scan's chunk length (the checkpoint's, as HF uses it).
        dt_limit: clamp of dt in the chunked form (HF clamps there only; None = no clamp).
        The state after each of `meta`'s emit tokens (prefill requests only have them) is
        written to its emit slot.

    Returns:
        y [num_tokens, H, P] float32 (y_t = h_t C_t + D x_t).
    """
    n, h, p = x.shape
    g = b.shape[1]
    x32, dt32 = x.float(), dt.float()
    b32 = b.float().repeat_interleave(h // g, dim=1)                     # [n, H, N]
    c32 = c.float().repeat_interleave(h // g, dim=1)
    y = torch.empty(n, h, p, dtype=torch.float32, device=x.device)
    if len(meta.decode_reqs):
        # Recurrent form: one token per request.
        reqs = torch.from_numpy(meta.decode_reqs).to(x.device)
        tok = meta.query_start_loc[reqs]
        slots = meta.state_indices[reqs]
        state = ssm_states[slots].float() * meta.has_initial_state[reqs, None, None, None]
        dtt = dt32[tok]                                                   # [Rd, H]
        state = (state * torch.exp(dtt * a)[..., None, None]
                 + (dtt[..., None] * x32[tok])[..., None] * b32[tok][:, :, None, :])
        ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
        y[tok] = torch.einsum("rhpn,rhn->rhp", state, c32[tok])
    if len(meta.prefill_reqs):
        # Chunked form over the prefill requests, padded to the longest query.
        reqs = torch.from_numpy(meta.prefill_reqs).to(x.device)
        row_of_req = torch.full((meta.num_reqs,), -1, dtype=torch.int64, device=x.device)
        row_of_req[reqs] = torch.arange(len(reqs), device=x.device)
        rows = row_of_req[meta.token_req_index]
        tok = torch.nonzero(rows >= 0).squeeze(1)
        rows, offs = rows[tok], meta.token_offset[tok]
        qsl = meta.query_start_loc_cpu
        length = int((qsl[meta.prefill_reqs + 1] - qsl[meta.prefill_reqs]).max())
        shape = (len(reqs), length)
        xp = x32.new_zeros(*shape, h, p)
        dtp = x32.new_zeros(*shape, h)
        bp = x32.new_zeros(*shape, h, b32.shape[-1])
        cp = x32.new_zeros(*shape, h, c32.shape[-1])
        dts = dt32[tok] if dt_limit is None else dt32[tok].clamp(*dt_limit)
        xp[rows, offs], dtp[rows, offs], bp[rows, offs], cp[rows, offs] = (
            x32[tok], dts, b32[tok], c32[tok])
        slots = meta.state_indices[reqs]
        init = ssm_states[slots].float() * meta.has_initial_state[reqs, None, None, None]
        keep, emit_slots = emitted_slots(meta)
        emit_tok = meta.emit_token[keep]
        emit_at = (rows_of_token(row_of_req, meta, emit_tok), meta.token_offset[emit_tok])
        yp, final, emitted = ssd_chunk_scan(xp, dtp, a.float(), bp, cp, chunk_size, init,
                                            emit_at)
        ssm_states.index_copy_(0, slots, final.to(ssm_states.dtype))
        ssm_states.index_copy_(0, emit_slots, emitted.to(ssm_states.dtype))
        y[tok] = yp[rows, offs]
    return y + d.float()[:, None] * x32


def rows_of_token(row_of_req: torch.Tensor, meta: StateCacheMetadata,
                  tokens: torch.Tensor) -> torch.Tensor:
    """The padded-batch rows of flat token indices `tokens` ([E] int64; `row_of_req`: [num_reqs]
    row of each request, -1 for those not in the padded batch).

    Raises:
        ValueError: a token of a request not in the padded batch (an emit of a decode).
    """
    rows = row_of_req[meta.token_req_index[tokens]]
    if bool((rows < 0).any()):
        raise ValueError("a state emit at a token of a one-token (decode) request")
    return rows


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int) -> torch.Tensor:
    """weight * RMSNorm(y * silu(z)) over groups of `group_size` channels, in float32 (HF's
    MambaRMSNormGated, norm_before_gate=False). y, z: [n, D] -> [n, D] in z's dtype."""
    dtype = z.dtype
    v = y.float() * F.silu(z.float())
    shape = v.shape
    v = v.reshape(*shape[:-1], -1, group_size)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return weight * v.reshape(shape).to(dtype)
