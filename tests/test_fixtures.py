"""The shared test fixtures load with `transformers` and have the properties other tests rely on."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.fixtures.checkpoints import TINY_VARIANTS, make_tiny_checkpoint

MULTI_BYTE_TEXTS = [
    "Hello world",
    "  two leading spaces,  and a double one",
    "café naïve résumé",
    "日本語のテキスト",
    "emoji 🙂🚀 and flags 🇯🇵 👍🏽",
    "mixed: Ærø → 東京 🙂 end.",
    "\nnew\tlines\n",
]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, byte_level_tokenizer_dir, sentencepiece_tokenizer_dir):
    path = {"byte_level": byte_level_tokenizer_dir, "sentencepiece": sentencepiece_tokenizer_dir}[request.param]
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_tokenizer_round_trips_multi_byte_text(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizers_split_multi_byte_characters_across_tokens(tokenizer):
    ids = tokenizer("日本語 🙂", add_special_tokens=False).input_ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces), pieces


def test_sentencepiece_tokenizer_uses_byte_fallback(sentencepiece_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentencepiece_tokenizer_dir)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("日", add_special_tokens=False).input_ids)
    assert tokens[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.unk_token_id == 0 and tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2


def test_byte_level_tokenizer_special_tokens_and_chat_template(byte_level_tokenizer_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(byte_level_tokenizer_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    config = json.loads((byte_level_tokenizer_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in config
    assert (byte_level_tokenizer_dir / "special_tokens_map.json").is_file()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert with_prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi 🙂</s>\n<|assistant|>\n"
    assert with_prompt == without_prompt + "<|assistant|>\n"


@pytest.mark.parametrize("name", list(TINY_VARIANTS))
def test_tiny_variant_loads_with_transformers(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    config = model.config
    assert config.architectures == [TINY_VARIANTS[name]["arch"]]
    assert type(model).__name__ == TINY_VARIANTS[name]["arch"]
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.max_position_embeddings >= 512
    assert next(model.parameters()).dtype == torch.float32
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == tokenizer.eos_token_id

    ids = tokenizer("The cat sees a red apple", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert torch.isfinite(logits).all()
    assert margins.median() > 1e-2, "logits too flat for stable greedy comparisons"


def test_variant_config_corners(tiny_checkpoints):
    def config(name):
        return transformers.AutoConfig.from_pretrained(tiny_checkpoints[name])

    llama = config("llama")
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.tie_word_embeddings) == (4, 2, False)
    mqa = config("llama_mqa_tied_llama3")
    assert (mqa.num_key_value_heads, mqa.tie_word_embeddings) == (1, True)
    assert mqa.rope_parameters["rope_type"] == "llama3" and mqa.rope_parameters["rope_theta"] == 500000.0
    linear = config("llama_linear_rope_sharded")
    assert linear.rope_parameters["rope_type"] == "linear" and linear.rope_parameters["factor"] == 2.0
    qwen2 = config("qwen2")
    assert qwen2.tie_word_embeddings
    qwen3 = config("qwen3")
    assert qwen3.head_dim == 32 and qwen3.hidden_size // qwen3.num_attention_heads == 16

    with safe_open(tiny_checkpoints["qwen2"] / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "lm_head.weight" not in names  # tied: only the embedding is stored
    with safe_open(tiny_checkpoints["qwen3"] / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.q_norm.weight" in set(f.keys())


def test_sharded_variant_has_index_and_shards(tiny_checkpoints):
    path = tiny_checkpoints["llama_linear_rope_sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2
    assert all((path / shard).is_file() for shard in shards)
    assert not (path / "model.safetensors").exists()
    config = json.loads((path / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and "rope_parameters" not in config


def test_make_tiny_checkpoint_is_deterministic(tmp_path, byte_level_tokenizer_dir):
    paths = [
        make_tiny_checkpoint(tmp_path / str(i), "LlamaForCausalLM", byte_level_tokenizer_dir, num_hidden_layers=1)
        for i in range(2)
    ]
    with safe_open(paths[0] / "model.safetensors", "pt") as a, safe_open(paths[1] / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
