import torch, torch.nn.functional as F
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.activation import SiluAndMul
from pagedllm.models.qwen2_5_vl import VisionRope
torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(300, 768).to(dt) * 3
    n = RMSNorm(768, 1e-6).to(dt); n.weight.data = (torch.randn(768) * 0.5 + 1).to(dt)
    xf = x.float(); ref = n.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
    print(dt, "rms", torch.equal(n(x), ref), n(x).dtype)
    g = torch.randn(300, 2 * 512).to(dt)
    print(dt, "silu", torch.equal(SiluAndMul()(g), F.silu(g[..., :512]) * g[..., 512:]))
    freqs = torch.randn(300, 32)
    rope = VisionRope(freqs)
    q = torch.randn(300 * 3, 24, 64).to(dt)[::3]   # strided like the qkv view
    x32 = q.float(); half = 32
    out = x32 * rope.cos; out[..., :half].addcmul_(x32[..., half:], rope.sin, value=-1.0); out[..., half:].addcmul_(x32[..., :half], rope.sin)
    print(dt, "rope", torch.equal(rope.apply(q), out.to(dt)))
