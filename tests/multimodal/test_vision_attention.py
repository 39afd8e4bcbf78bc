"""The Qwen VL towers' attention pieces against plain references: `segment_attention` (the
strided one-SDPA path for equal segments in a row, the gathered path for ragged ones) against
dense attention per segment, and `VisionRope` against HF's rotate-half formula
(`apply_rotary_pos_emb_vision`) in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.models.qwen2_5_vl import VisionRope, segment_attention


def _reference(q, k, v, cu):
    """Each segment's q/k/v [L, H, D] through SDPA on its own -> [P, H * D]."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(b - a, -1))
    return torch.cat(out)


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16],        # equal, one strided SDPA
                                     [64],                    # one segment
                                     [16, 16, 8, 16, 4, 8],   # ragged windows, gathered
                                     [12, 12, 20]])
def test_segment_attention_equals_per_segment_sdpa(lengths):
    torch.manual_seed(0)
    heads, head_size = 3, 8
    n = sum(lengths)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # q, k, v as views into one fused row, as the tower passes them.
    qkv = torch.randn(n, 3 * heads, head_size)
    q, k, v = qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    out = segment_attention(q, k, v, cu)
    assert out.shape == (n, heads * head_size) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(q, k, v, cu), rtol=1e-5, atol=1e-6)
    # Attention must stay inside the segments: changing one segment's keys moves only it.
    k2 = k.clone()
    k2[cu[-2]:] += 1.0
    moved = (segment_attention(q, k2, v, cu) - out).abs().amax(dim=1) > 0
    assert not moved[:cu[-2]].any() and moved[cu[-2]:].any()


def _hf_rotary(x, freqs):
    """HF transformers' `apply_rotary_pos_emb_vision` for one tensor [P, H, D]."""
    cos = torch.cat([freqs.cos()] * 2, dim=-1)[:, None, :].float()
    sin = torch.cat([freqs.sin()] * 2, dim=-1)[:, None, :].float()
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vision_rope_equals_hf_rotate_half(dtype):
    torch.manual_seed(0)
    p, heads, head_size = 20, 4, 16
    freqs = torch.rand(p, head_size // 2) * 30.0
    qkv = torch.randn(p, 3 * heads, head_size).to(dtype)
    qk = qkv[:, :2 * heads]                       # a strided view, as in the tower
    got = VisionRope(freqs).apply(qk)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, _hf_rotary(qk, freqs), rtol=1e-6 if dtype == torch.float32
                               else 1e-2, atol=1e-6 if dtype == torch.float32 else 1e-2)
