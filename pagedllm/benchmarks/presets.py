"""Named random-weight checkpoints (Llama, Mixtral, DeepSeek-V2, Qwen3-Next) for benchmarks,
built once into a cache folder (vision-language presets: `vlm_presets.py`).

`preset_path(name, dtype)` returns `<root>/<name>-<dtype>/` (root: `$PAGEDLLM_PRESET_DIR` or
`~/.cache/pagedllm/presets`), building it on first use with the transformers config and model
classes of the preset's `architecture` (default `LlamaForCausalLM`) + `save_pretrained` and a
synthetic byte-level BPE tokenizer of exactly the model's vocabulary size. A folder is complete
once its `.complete` marker exists; builds go to a temporary sibling that is renamed into place,
so an interrupted build is never picked up.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from pagedllm import envs

PRESETS: dict[str, dict[str, Any]] = {
    "llama-134m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 32000},
    # The same model (same seed, same weights) with room for 16k-token contexts: the
    # long-context decode points of the benchmarks.
    "llama-134m-16k": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "num_key_value_heads": 12, "intermediate_size": 2048,
                       "vocab_size": 32000, "max_position_embeddings": 16640},
    # 1.10B parameters (Llama 3.2 1B's shape with a 32k vocabulary, untied LM head): the device
    # check's bandwidth-bound model, 2.08 GB of bf16 weights read per decode step.
    "llama-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 32000},
    "llama-tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024},
    # Issue #19's speed target: Mixtral's shape scaled to hidden 512 (8 experts, top-2, expert
    # intermediate 2x hidden, GQA 8/4 heads of 64), 8 layers: 140M parameters (101M in the
    # experts), 64M active per token.
    "mixtral-512": {"architecture": "MixtralForCausalLM", "hidden_size": 512,
                    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "intermediate_size": 1024, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "vocab_size": 32000},
    "mixtral-tiny": {"architecture": "MixtralForCausalLM", "hidden_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "vocab_size": 1024},
    # Issue #36: DeepSeek-V2-Lite's shape (MLA without q_lora, 64 routed + 2 shared experts,
    # top-6, a dense first layer) scaled to hidden 512 and 8 layers: 199M parameters (154M in
    # the routed experts), 2304 bytes of latent KV cache per token in bf16 (docs/mla.md).
    "deepseek-v2-lite-200m": {"architecture": "DeepseekV2ForCausalLM", "hidden_size": 512,
                              "num_hidden_layers": 8, "num_attention_heads": 8,
                              "num_key_value_heads": 8, "q_lora_rank": None,
                              "kv_lora_rank": 128, "qk_nope_head_dim": 32,
                              "qk_rope_head_dim": 16, "v_head_dim": 32,
                              "intermediate_size": 2048, "moe_intermediate_size": 224,
                              "n_routed_experts": 64, "n_shared_experts": 2,
                              "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                              "topk_method": "greedy", "vocab_size": 32000},
    "deepseek-v2-lite-tiny": {"architecture": "DeepseekV2ForCausalLM", "hidden_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4,
                              "num_key_value_heads": 4, "q_lora_rank": None,
                              "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                              "qk_rope_head_dim": 8, "v_head_dim": 16,
                              "intermediate_size": 128, "moe_intermediate_size": 32,
                              "n_routed_experts": 8, "n_shared_experts": 2,
                              "num_experts_per_tok": 3, "first_k_dense_replace": 1,
                              "topk_method": "greedy", "vocab_size": 1024},
    # Issue #37: Qwen3-Next's layout (3 Gated DeltaNet layers to 1 gated-attention layer, MoE
    # with a shared expert on every layer) scaled to hidden 768, 12 layers: ~196M parameters
    # (49M embedding + LM head, 127M in the MoE blocks, 20M in the token mixers).
    "qwen3-next-200m": {"architecture": "Qwen3NextForCausalLM", "hidden_size": 768,
                        "num_hidden_layers": 12, "num_attention_heads": 8,
                        "num_key_value_heads": 2, "head_dim": 64,
                        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
                        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                        "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                        "linear_conv_kernel_dim": 4, "num_experts": 16,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                        "shared_expert_intermediate_size": 512, "intermediate_size": 2048,
                        "vocab_size": 32000},
    "qwen3-next-tiny": {"architecture": "Qwen3NextForCausalLM", "hidden_size": 64,
                        "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                        "num_experts": 4, "num_experts_per_tok": 2,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                        "intermediate_size": 128, "vocab_size": 1024},
}
# HF `architectures` name -> its transformers config class.
ARCHITECTURE_CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "MixtralForCausalLM": "MixtralConfig",
                        "DeepseekV2ForCausalLM": "DeepseekV2Config",
                        "Qwen3NextForCausalLM": "Qwen3NextConfig"}
_COMMON_CONFIG: dict[str, Any] = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                                  "tie_word_embeddings": False, "rope_theta": 10000.0}
# Saved weight dtypes; "auto" and float16 requests save float32 (the engine casts on load).
_SAVE_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16"}
_MARKER = ".complete"

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
# Characters of the multi-character tokens: lower-case letters and the byte-level space ("Ġ"), so
# every token above the byte range decodes to printable ASCII.
_PIECE_CHARS = "abcdefghijklmnopqrstuvwxyz\u0120"


def default_preset_root() -> Path:
    root = envs.get("PAGEDLLM_PRESET_DIR")
    return root if root is not None else Path.home() / ".cache" / "pagedllm" / "presets"


def saved_dtype(dtype: str | None) -> str:
    return _SAVE_DTYPES.get(str(dtype or "auto").replace("torch.", ""), "float32")


def preset_path(name: str, dtype: str | None = "float32", root: str | Path | None = None,
                seed: int = 0) -> str:
    """Folder of preset `name` with weights saved in `dtype` (built if missing).

    Raises:
        ValueError: for an unknown preset, naming the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    save_dtype = saved_dtype(dtype)
    root = Path(root) if root is not None else default_preset_root()
    config_kwargs = dict(PRESETS[name])
    architecture = config_kwargs.pop("architecture", "LlamaForCausalLM")
    return build_once(root / f"{name}-{save_dtype}",
                      lambda tmp: build_checkpoint(tmp, config_kwargs, save_dtype, seed,
                                                   architecture),
                      {"preset": name, "dtype": save_dtype})


def build_once(out_dir: Path, build: Callable[[Path], Any], marker: dict[str, Any]) -> str:
    """`out_dir` as a string, first running `build(tmp_dir)` into a temporary sibling that is
    renamed into place with a `.complete` marker holding `marker` (JSON), unless a complete
    `out_dir` exists. An interrupted build leaves nothing that is picked up later."""
    if (out_dir / _MARKER).is_file():
        return str(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    os.chmod(tmp_dir, 0o755)
    try:
        build(tmp_dir)
        (tmp_dir / _MARKER).write_text(json.dumps(marker))
        if out_dir.exists():  # a stale, incomplete folder
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if (out_dir / _MARKER).is_file():  # a concurrent build won the race
            return str(out_dir)
        raise
    return str(out_dir)


def build_checkpoint(out_dir: str | Path, config_kwargs: dict[str, Any], dtype: str = "float32",
                     seed: int = 0, architecture: str = "LlamaForCausalLM") -> Path:
    """Save a seeded random-weight model of `architecture` (a key of `ARCHITECTURE_CONFIGS`,
    its config built from `config_kwargs` over the common defaults) plus a matching tokenizer
    into `out_dir`.

    Raises:
        ValueError: for an architecture outside `ARCHITECTURE_CONFIGS`, naming the known ones.
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    if architecture not in ARCHITECTURE_CONFIGS:
        raise ValueError(f"unknown preset architecture {architecture!r}; known: "
                         f"{sorted(ARCHITECTURE_CONFIGS)}")
    config_cls = getattr(transformers, ARCHITECTURE_CONFIGS[architecture])
    model_cls = getattr(transformers, architecture)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = config_kwargs["vocab_size"]
    write_synthetic_tokenizer(out_dir, vocab_size)
    bos_id, eos_id, pad_id = range(len(_SPECIAL_TOKENS))
    config = config_cls(**{**_COMMON_CONFIG, **config_kwargs}, bos_token_id=bos_id,
                        eos_token_id=eos_id, pad_token_id=pad_id)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id)
    model.save_pretrained(out_dir)
    return out_dir


def synthetic_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` entries, and its merges.

        ids 0..2     <s> </s> <pad>
        ids 3..258   the 256 byte-level characters
        ids 259..    "ab", "abc", "abcd", ...: every piece is its prefix + one character, so each
                     is reachable by one merge of two earlier tokens
    """
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(_SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be >= {len(vocab)}, got {vocab_size}")
    merges: list[tuple[str, str]] = []
    for length in itertools.count(2):
        for chars in itertools.product(_PIECE_CHARS, repeat=length):
            if len(vocab) >= vocab_size:
                return vocab, merges
            piece = "".join(chars)
            vocab[piece] = len(vocab)
            merges.append((piece[:-1], piece[-1]))
    raise AssertionError("unreachable")


def write_synthetic_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """Write tokenizer.json / tokenizer_config.json / special_tokens_map.json for `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    out_dir = Path(out_dir)
    vocab, merges = synthetic_vocab(vocab_size)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    # NOTE(bench): written by hand, as tests/fixtures/tokenizers.py does: transformers 5's
    # save_pretrained would move fields out of tokenizer_config.json.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
              "clean_up_tokenization_spaces": False, "add_bos_token": True,
              "add_eos_token": False, "unk_token": None, **special,
              "added_tokens_decoder": {
                  str(vocab[t]): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
                  for t in _SPECIAL_TOKENS}}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out_dir
