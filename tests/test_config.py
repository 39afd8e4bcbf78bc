"""Engine config validation."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig, create_engine_config


def _with_window(tiny_checkpoints, tmp_path, variant: str, **extra) -> str:
    path = tmp_path / variant
    shutil.copytree(tiny_checkpoints[variant], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(sliding_window=64, **extra)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_sliding_window_caps_context(tiny_checkpoints, tmp_path):
    """Phi-3's layers attend over the full context, so its window caps the context."""
    path = _with_window(tiny_checkpoints, tmp_path, "phi3")
    assert create_engine_config(path).max_model_len == 64
    with pytest.raises(ValueError, match="sliding_window"):
        create_engine_config(path, max_model_len=128)


@pytest.mark.parametrize("variant, extra", [("mistral", {}),
                                            ("qwen2", {"use_sliding_window": True})])
def test_windowed_layers_do_not_cap_context(tiny_checkpoints, tmp_path, variant, extra):
    """Mistral and Qwen2 apply their windows per layer: the context is not capped."""
    path = _with_window(tiny_checkpoints, tmp_path, variant, **extra)
    assert create_engine_config(path).max_model_len == 1024
    assert create_engine_config(path, max_model_len=128).max_model_len == 128


@pytest.mark.parametrize("make", [lambda: CacheConfig(block_size=12),
                                  lambda: CacheConfig(gpu_memory_utilization=0.0),
                                  lambda: CacheConfig(mamba_cache_mode="all"),
                                  lambda: SchedulerConfig(max_num_seqs=0)])
def test_invalid_values_name_the_field(make):
    with pytest.raises(ValueError) as info:
        make()
    assert any(name in str(info.value) for name in ("block_size", "gpu_memory_utilization",
                                                     "mamba_cache_mode", "max_num_seqs"))


def test_max_model_len_beyond_model(tiny_checkpoints):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        create_engine_config(str(tiny_checkpoints["llama"]), max_model_len=10**6)


@pytest.mark.parametrize("field, value", [("max_position_embeddings", 0),
                                          ("max_position_embeddings", "4k"),
                                          ("vocab_size", -3), ("vocab_size", None)])
def test_config_json_sizes_are_checked(tiny_checkpoints, tmp_path, field, value):
    # max_position_embeddings 0 once reached the profile run as a ZeroDivisionError.
    path = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json: {field} must be an int >= 1, got "):
        create_engine_config(str(path))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"])
def test_engine_seed_out_of_range_is_refused(tiny_checkpoints, seed):
    """The engine's seed (`--seed`, `LLM(seed=...)`) is an int in [0, 2**63 - 1] (or None): a
    negative one is refused with a message naming it, not silently wrapped by torch's RNG."""
    with pytest.raises(ValueError, match=r"seed must be an int from 0 to 2\*\*63 - 1.*got "):
        create_engine_config(str(tiny_checkpoints["llama"]), seed=seed)
    assert create_engine_config(str(tiny_checkpoints["llama"]), seed=2**63 - 1) is not None


def test_seed_none_line_reaches_stderr(tiny_llama):
    """The drawn seed's line is printed where a user sees it (the package logger is set up
    before the config logs it), not only to a test's log capture."""
    code = ("from pagedllm.config import create_engine_config; "
            f"print(create_engine_config({str(tiny_llama)!r}, seed=None).model_config.seed)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    seed = int(done.stdout.strip())
    assert f"seed=None: drew the engine seed {seed} (pass seed={seed}" in done.stderr


def test_seed_none_draws_a_logged_seed_that_repeats_the_run(tiny_llama, caplog):
    """`LLM(model, seed=None)` (vLLM's: no fixed seed) draws a seed once at start-up and logs
    it; an engine given that seed samples the same tokens, another draw differs."""
    from pagedllm import LLM, SamplingParams

    log = logging.getLogger("pagedllm.config")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm.config"):
            llm = LLM(str(tiny_llama), seed=None, dtype="float32",
                      kv_cache_memory_bytes=4 << 20)
            other = create_engine_config(str(tiny_llama), seed=None).model_config.seed
    finally:
        log.removeHandler(caplog.handler)
    seed = llm.llm_engine.config.model_config.seed
    assert isinstance(seed, int) and 0 <= seed <= 2**63 - 1 and other != seed
    assert f"drew the engine seed {seed} (pass seed={seed}" in caplog.text
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
    drawn = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    again = LLM(str(tiny_llama), seed=seed, dtype="float32", kv_cache_memory_bytes=4 << 20)
    assert [o.outputs[0].token_ids
            for o in again.generate(prompts, params, use_tqdm=False)] == drawn


def test_seed_flag_takes_none():
    from pagedllm.entrypoints.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "--prompt", "x", "--seed", "None"]).seed is None
    assert parse(["generate", "--prompt", "x", "--seed", "12"]).seed == 12
    assert parse(["generate", "--prompt", "x"]).seed == 0


def test_engine_seed_flag_refuses_negative(capsys):
    from pagedllm.entrypoints.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--model", "m", "--prompt", "x", "--seed", "-3"])
    assert exc.value.code == 2
    assert "argument --seed: expected an integer from 0 to 9223372036854775807, got '-3'" \
        in capsys.readouterr().err


def test_missing_tokenizer_or_draft_folder_names_its_argument(tiny_checkpoints):
    """A missing --tokenizer or speculative draft folder is named as such, not as the model."""
    model = str(tiny_checkpoints["llama"])
    with pytest.raises(FileNotFoundError, match="^tokenizer folder not found: /no/such/tok$"):
        create_engine_config(model, tokenizer="/no/such/tok")
    with pytest.raises(FileNotFoundError,
                       match="^speculative_config.model folder not found: /no/draft$"):
        create_engine_config(model, speculative_config={
            "method": "draft_model", "model": "/no/draft", "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError, match="^model folder not found: /no/model$"):
        create_engine_config("/no/model")


def test_an_eos_token_id_outside_the_vocabulary_is_warned_about(tiny_llama, tmp_path, caplog):
    """As HF warns: such a model never ends a sequence by EOS, which a user should hear."""
    from pagedllm import LLM

    path = tmp_path / "eos"
    shutil.copytree(tiny_llama, path)
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = 5000
            (path / name).write_text(json.dumps(config))
    log = logging.getLogger("pagedllm.engine.llm_engine")
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.engine.llm_engine"):
            LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    finally:
        log.removeHandler(caplog.handler)
    assert "eos_token_id [5000] lies outside the vocabulary" in caplog.text
