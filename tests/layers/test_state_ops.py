"""The recurrent layers' torch ops (layers/state_ops.py, layers/gated_delta_ops.py) against naive
per-token recurrences in float64: chunked scans equal the recurrence, a scan split in two with the
state carried equals the whole, and the varlen ops on a mixed batch (fresh and continued
requests, one-token decodes and multi-token chunks) equal running each request alone."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.layers.gated_delta_ops import chunk_gated_delta_rule, gated_delta_rule_varlen, l2norm
from pagedllm.layers.state_cache import StateCacheMetadata
from pagedllm.layers.state_ops import causal_conv1d_varlen, ssd_chunk_scan, ssd_varlen

F64 = torch.float64


def _delta_rule_reference(q, k, v, g, beta, state):
    """Per-token gated delta rule; q, k, v [H, L, d], g/beta [H, L], state [H, dk, dv]."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        kv = torch.einsum("hkv,hk->hv", state, k[:, t])
        state = state + k[:, t, :, None] * ((v[:, t] - kv) * beta[:, t, None])[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[:, t]))
    return torch.stack(outs, 1), state


def _ssd_reference(x, dt, a, b, c, state):
    """Per-token SSM; x [L, H, P], dt [L, H], b/c [L, H, N], state [H, P, N]."""
    ys = []
    for t in range(x.shape[0]):
        state = (state * torch.exp(dt[t] * a)[:, None, None]
                 + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :])
        ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(ys), state


def test_chunked_delta_rule_equals_recurrence_and_splits():
    torch.manual_seed(0)
    h, length, dk, dv = 3, 29, 8, 5
    q, k = torch.randn(1, h, length, dk, dtype=F64), l2norm(torch.randn(1, h, length, dk, dtype=F64))
    v = torch.randn(1, h, length, dv, dtype=F64)
    g, beta = -torch.rand(1, h, length, dtype=F64) * 3, torch.rand(1, h, length, dtype=F64)
    s0 = torch.randn(1, h, dk, dv, dtype=F64)
    ref, ref_state = _delta_rule_reference(q[0], k[0], v[0], g[0], beta[0], s0[0])
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk_size=8)
    torch.testing.assert_close(out[0], ref)
    torch.testing.assert_close(state[0], ref_state)
    o1, s1 = chunk_gated_delta_rule(q[:, :, :13], k[:, :, :13], v[:, :, :13], g[:, :, :13],
                                    beta[:, :, :13], s0, chunk_size=8)
    o2, s2 = chunk_gated_delta_rule(q[:, :, 13:], k[:, :, 13:], v[:, :, 13:], g[:, :, 13:],
                                    beta[:, :, 13:], s1, chunk_size=8)
    torch.testing.assert_close(torch.cat([o1, o2], 2)[0], ref)
    torch.testing.assert_close(s2[0], ref_state)


def test_chunked_ssd_equals_recurrence():
    torch.manual_seed(1)
    length, h, p, n = 21, 4, 3, 5
    x, dt = torch.randn(1, length, h, p, dtype=F64), torch.rand(1, length, h, dtype=F64)
    a = -torch.rand(h, dtype=F64) * 2
    b, c = torch.randn(1, length, h, n, dtype=F64), torch.randn(1, length, h, n, dtype=F64)
    s0 = torch.randn(1, h, p, n, dtype=F64)
    ref, ref_state = _ssd_reference(x[0], dt[0], a, b[0], c[0], s0[0])
    y, state = ssd_chunk_scan(x, dt, a, b, c, 8, s0)
    torch.testing.assert_close(y[0], ref)
    torch.testing.assert_close(state[0], ref_state)


def _metadata(query_lens, num_computed, slots) -> StateCacheMetadata:
    query_lens, num_computed = np.array(query_lens), np.array(num_computed)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq_lens = (num_computed + query_lens).astype(np.int32)
    table = torch.tensor(slots, dtype=torch.int32)[:, None]
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens), seq_lens_cpu=seq_lens, block_table=table,
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64), num_reqs=len(slots),
        num_actual_tokens=int(qsl[-1]), max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=16)
    return StateCacheMetadata.from_common(common)


def test_varlen_ops_equal_each_request_alone():
    """Requests: a fresh 7-token prompt (slot 3), a continued 5-token chunk (slot 1), a decode
    (slot 2) and a fresh 1-token prompt (slot 4, whose stale slot content must be ignored)."""
    torch.manual_seed(2)
    query_lens, computed, slots = [7, 5, 1, 1], [0, 9, 20, 0], [3, 1, 2, 4]
    meta = _metadata(query_lens, computed, slots)
    n, ch, k = sum(query_lens), 6, 4
    h, p, nst, dk, dv = 2, 3, 4, 4, 3
    x = torch.randn(n, ch, dtype=F64)
    weight, bias = torch.randn(ch, k, dtype=F64), torch.randn(ch, dtype=F64)
    conv = torch.randn(5, ch, k - 1, dtype=F64)
    ssm = torch.randn(5, h, p, nst, dtype=F64)
    xs, dts = torch.randn(n, h, p, dtype=F64), torch.rand(n, h, dtype=F64)
    a, d = -torch.rand(h, dtype=F64), torch.randn(h, dtype=F64)
    bs, cs = torch.randn(n, 1, nst, dtype=F64), torch.randn(n, 1, nst, dtype=F64)
    dstates = torch.randn(5, h, dk, dv, dtype=F64)
    q, kk, v = (torch.randn(n, h, dk, dtype=F64), torch.randn(n, h, dk, dtype=F64),
                torch.randn(n, h, dv, dtype=F64))
    g, beta = -torch.rand(n, h, dtype=F64), torch.rand(n, h, dtype=F64)
    conv0, ssm0, dstates0 = conv.clone(), ssm.clone(), dstates.clone()

    # The ops compute in float32 (as the models run them); the references in float64.
    f32 = [t.float() for t in (x, weight, bias, conv, ssm, xs, dts, a, d, bs, cs, dstates, q, kk,
                               v, g, beta)]
    conv32, ssm32, dstates32 = f32[3], f32[4], f32[11]
    out = causal_conv1d_varlen(f32[0], f32[1], f32[2], conv32, meta).double()
    y = ssd_varlen(*f32[5:7], f32[7], f32[9], f32[10], f32[8], ssm32, meta, chunk_size=4).double()
    o = gated_delta_rule_varlen(*f32[12:17], dstates32, meta, chunk_size=4).double()
    conv, ssm, dstates = conv32.double(), ssm32.double(), dstates32.double()
    tol = dict(atol=2e-5, rtol=2e-5)

    start = 0
    for length, c0, slot in zip(query_lens, computed, slots):
        span = slice(start, start + length)
        window = conv0[slot] if c0 else torch.zeros(ch, k - 1, dtype=F64)
        seq = torch.cat([window.t(), x[span]])                         # [K-1 + L, C]
        want = torch.stack([(seq[t:t + k] * weight.t()).sum(0) + bias for t in range(length)])
        torch.testing.assert_close(out[span], want, **tol)
        torch.testing.assert_close(conv[slot], seq[-(k - 1):].t(), **tol)
        s0 = ssm0[slot] if c0 else torch.zeros(h, p, nst, dtype=F64)
        ref, ref_state = _ssd_reference(xs[span], dts[span], a, bs[span].expand(-1, h, -1),
                                        cs[span].expand(-1, h, -1), s0)
        torch.testing.assert_close(y[span], ref + d[:, None] * xs[span], **tol)
        torch.testing.assert_close(ssm[slot], ref_state, **tol)
        d0 = dstates0[slot] if c0 else torch.zeros(h, dk, dv, dtype=F64)
        qn = l2norm(q[span]) * dk ** -0.5
        ref, ref_state = _delta_rule_reference(qn.transpose(0, 1), l2norm(kk[span]).transpose(0, 1),
                                               v[span].transpose(0, 1), g[span].t(),
                                               beta[span].t(), d0)
        torch.testing.assert_close(o[span], ref.transpose(0, 1), **tol)
        torch.testing.assert_close(dstates[slot], ref_state, **tol)
        start += length
