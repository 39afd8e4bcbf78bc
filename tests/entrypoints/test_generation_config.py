"""The model's recommended sampling defaults (its generation_config.json) offline and on the CLI.

A tiny Llama whose generation config says top_k=1 (with temperature 0.8 and max_new_tokens 7): a
`generate` call without SamplingParams must sample from the top token only, so it equals greedy
whatever the seed, and stop after 7 tokens; a SamplingParams that is passed is the user's and
is used as it is; `generation_config="vllm"` ignores the file. The reading and validation of the
defaults (`generation_config.get_diff_sampling_param`) are checked on engine configs, without a
model.
The GGUF counterpart (`general.sampling.*`) is in tests/model_loader/test_gguf.py, the server's
in tests/entrypoints/openai/test_generation_config_server.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import create_engine_config
from pagedllm.entrypoints.cli import build_parser, main as cli_main
from pagedllm.engine.arg_utils import engine_kwargs_from_args
from tests.fixtures.checkpoints import with_generation_config

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
MODEL_DEFAULTS = dict(top_k=1, temperature=0.8, max_new_tokens=7)
PROMPTS = ["Hello world", "The old man reads a long letter.", "12345 + 678 = ?"]


@pytest.fixture(scope="module")
def top_k1_checkpoint(tiny_llama: Path, tmp_path_factory) -> Path:
    return with_generation_config(tiny_llama, tmp_path_factory.mktemp("top_k1"),
                                  **MODEL_DEFAULTS)


@pytest.fixture(scope="module")
def llm(top_k1_checkpoint: Path) -> LLM:
    return LLM(str(top_k1_checkpoint), **ENGINE_ARGS)


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return _token_ids(llm.generate(prompts, params, use_tqdm=False))


def _config_folder(tiny_llama: Path, folder: Path, generation_config: dict | None) -> Path:
    """A folder with the checkpoint's config.json and `generation_config` (None: no file)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_default_generate_follows_the_model_generation_config(llm: LLM) -> None:
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.8, 7)
    assert defaults.top_p == 1.0 and defaults.min_p == 0.0  # not in the file: built-in
    prompts = PROMPTS * 3  # every request samples with its own random stream
    outputs = llm.generate(prompts, use_tqdm=False)
    assert _token_ids(outputs) == _greedy(llm, prompts, 7)
    assert all(len(o.outputs[0].token_ids) <= 7 for o in outputs)
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) <= 7


@pytest.mark.parametrize("seed", [1, 12345])
def test_default_generate_is_greedy_whatever_the_engine_seed(top_k1_checkpoint: Path,
                                                             seed: int) -> None:
    llm = LLM(str(top_k1_checkpoint), seed=seed, **ENGINE_ARGS)
    assert _token_ids(llm.generate(PROMPTS, use_tqdm=False)) == _greedy(llm, PROMPTS, 7)


def test_sampling_params_passed_are_used_as_they_are(llm: LLM) -> None:
    prompts = PROMPTS * 4
    sampled = llm.generate(prompts, [SamplingParams(temperature=1.0, top_k=-1, max_tokens=7,
                                                    seed=i) for i in range(len(prompts))],
                           use_tqdm=False)
    assert _token_ids(sampled) != _greedy(llm, prompts, 7)  # the whole vocabulary again
    # SamplingParams() is the user's too: its max_tokens (16), not the model's 7.
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16


def test_generation_config_vllm_ignores_the_file(top_k1_checkpoint: Path) -> None:
    llm = LLM(str(top_k1_checkpoint), generation_config="vllm", **ENGINE_ARGS)
    assert llm.llm_engine.config.default_sampling_params == {}
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (0, 1.0, 16)


def test_defaults_read_from_the_file_and_overrides(tiny_llama: Path, tmp_path: Path) -> None:
    folder = _config_folder(tiny_llama, tmp_path / "model", {
        "top_k": 1, "temperature": 0.6, "top_p": 0.9, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 7, "eos_token_id": 1, "num_beams": 1})
    config = create_engine_config(str(folder))
    assert config.default_sampling_params == {"temperature": 0.6, "top_p": 0.9, "top_k": 1,
                                              "min_p": 0.05, "repetition_penalty": 1.1,
                                              "max_tokens": 7}
    override = create_engine_config(str(folder), override_generation_config={
        "temperature": 0.2, "max_new_tokens": 3})
    assert override.default_sampling_params["temperature"] == 0.2
    assert override.default_sampling_params["max_tokens"] == 3
    assert override.default_sampling_params["top_k"] == 1
    # "vllm" drops the file; the overrides still apply (as vLLM's).
    assert create_engine_config(str(folder), generation_config="vllm",
                                override_generation_config={"top_k": 1}
                                ).default_sampling_params == {"top_k": 1}
    # A folder of its own: its generation_config.json instead of the checkpoint's.
    other = _config_folder(tiny_llama, tmp_path / "other", {"temperature": 0.0})
    assert create_engine_config(str(folder), generation_config=str(other)
                                ).default_sampling_params == {"temperature": 0.0}
    # No generation_config.json at all: no defaults.
    assert create_engine_config(str(_config_folder(tiny_llama, tmp_path / "bare", None))
                                ).default_sampling_params == {}


def test_do_sample_false_is_ignored_as_vllm_does(tiny_llama: Path, tmp_path: Path) -> None:
    folder = _config_folder(tiny_llama, tmp_path / "m", {"do_sample": False,
                                                        "temperature": 0.6, "top_p": 0.95})
    assert create_engine_config(str(folder)).default_sampling_params == {"temperature": 0.6,
                                                                        "top_p": 0.95}


@pytest.mark.parametrize("values, key", [
    ({"top_p": 2.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": -5}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
])
def test_invalid_values_are_refused_naming_the_file_and_key(tiny_llama: Path, tmp_path: Path,
                                                            values: dict, key: str) -> None:
    folder = _config_folder(tiny_llama, tmp_path / "m", values)
    path = re.escape(str(folder / "generation_config.json"))
    with pytest.raises(ValueError, match=f"{path}.*{key}"):
        create_engine_config(str(folder))
    with pytest.raises(ValueError, match=f"override_generation_config: {key} = "):
        create_engine_config(str(tiny_llama), override_generation_config=values)


def test_bad_generation_config_arguments(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        create_engine_config(str(tiny_llama), generation_config=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="generation_config.json not found"):
        create_engine_config(str(tiny_llama), generation_config=str(tmp_path))
    with pytest.raises(ValueError, match=r"override_generation_config: unknown keys \['top_n'\]"):
        create_engine_config(str(tiny_llama), override_generation_config={"top_n": 1})
    corrupt = _config_folder(tiny_llama, tmp_path / "corrupt", None)
    (corrupt / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt generation config .*generation_config.json"):
        create_engine_config(str(corrupt))


def _cli_generate(capsys, model: Path, *flags: str) -> tuple[str, int]:
    code = cli_main(["generate", "--model", str(model), "--prompt", PROMPTS[0], "--dtype",
                     "float32", "--kv-cache-memory", str(4 << 20), "--ignore-eos", *flags])
    assert code == 0
    out = capsys.readouterr().out
    return out.split("-" * 40)[0].strip(), int(re.search(r"generated tokens: (\d+)",
                                                          out).group(1))


def test_cli_generate_flags_left_out_take_the_model_defaults(capsys, llm: LLM,
                                                             top_k1_checkpoint: Path) -> None:
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=7,
                                                      ignore_eos=True), use_tqdm=False)
    text, n = _cli_generate(capsys, top_k1_checkpoint, "--request-seed", "3")
    assert n == 7 and text == PROMPTS[0] + greedy[0].outputs[0].text
    assert _cli_generate(capsys, top_k1_checkpoint, "--max-tokens", "3")[1] == 3  # flag wins
    assert _cli_generate(capsys, top_k1_checkpoint, "--generation-config", "vllm")[1] == 64
    overridden = ["--override-generation-config", '{"max_new_tokens": 5}']
    assert _cli_generate(capsys, top_k1_checkpoint, *overridden)[1] == 5


def test_serve_flags_reach_the_engine_arguments(tiny_llama: Path) -> None:
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama),
                                      "--generation-config", "vllm",
                                      "--override-generation-config", '{"top_k": 1}'])
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["generation_config"] == "vllm"
    assert kwargs["override_generation_config"] == {"top_k": 1}
    assert engine_kwargs_from_args(build_parser().parse_args(
        ["serve", "--model", str(tiny_llama)]))["generation_config"] == "auto"
