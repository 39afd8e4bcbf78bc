"""`pagedllm bench perplexity`: a model's perplexity over a text, from the engine's prompt logprobs.

The text is tokenized once (no special tokens added) and cut into consecutive, non-overlapping
windows of `window` tokens (the last one shorter; the engine's max_model_len by default). Each
window is one request with `prompt_logprobs=0` and `max_tokens=1`; every token of a window but its
first is scored by the log-probability of the model given the window's tokens before it (raw
logprobs: no temperature or penalties). Then

    mean NLL = -(1 / N) sum of those log-probabilities,   perplexity = exp(mean NLL)

over the N scored tokens of all windows: the non-overlapping-window evaluation of the Hugging Face
perplexity guide (stride = window). Comparing runs with other `dtype`, `kv_cache_dtype` or
`quantization` over the same text and window shows what each costs in model quality.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

# A built-in English passage for runs without --input-file (written for this benchmark).
BUILTIN_TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody but the
keeper and the gulls went out to it. In winter the waves came over the path, and the keeper would
wait for the tide to turn before he carried the oil and the bread along the wet stones. He kept a
journal, as every keeper before him had done, and he wrote in it each evening: the direction of the
wind, the height of the sea, the ships that had passed, and anything else he thought worth saving.

Most days there was little to say. A fishing boat went out before dawn and came back after noon. A
cargo ship passed far off, low in the water, on its way to the port in the south. The light turned
through the night as it always did, and in the morning he cleaned the great lens with a soft cloth
and a little alcohol, working from the centre outwards so that no streak was left on the glass.

Once a year an inspector came from the city. He walked through the tower with a notebook, counted
the spare wicks and the barrels of oil, looked at the journal and asked a few questions about the
weather. Then he drank a cup of tea, said that everything was in order, and went back along the
spit before the tide came in. The keeper liked these visits more than he would admit. For a few
hours there was another voice in the tower, and news of the town, and someone to hear how the
storm in March had broken a pane in the lantern room and how he had mended it in the dark.

When the light was finally replaced by an automatic lamp, the keeper was given a small house in
the village and a pension that was enough for his needs. He took the journals with him. In the
evenings he would sometimes read one of them from the beginning, and it seemed to him that the
years had passed more slowly out on the rock than they did now, among people, where every day was
full of small things that nobody thought to write down.
"""


@dataclass(frozen=True)
class PerplexityResult:
    """Attributes: num_tokens (scored), num_windows, window (tokens), mean_nll (nats per token),
    perplexity (exp(mean_nll)), seconds (wall time of the engine calls)."""

    num_tokens: int
    num_windows: int
    window: int
    mean_nll: float
    perplexity: float
    seconds: float


def split_windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of `window` tokens (the last may be shorter); a last
    window of one token (nothing to score) is dropped.

    Raises:
        ValueError: if window < 2 or fewer than 2 tokens are given.
    """
    if window < 2:
        raise ValueError(f"the perplexity window must be >= 2 tokens, got {window}")
    if len(token_ids) < 2:
        raise ValueError(f"the text has {len(token_ids)} tokens; at least 2 are needed")
    windows = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    return [w for w in windows if len(w) >= 2]


def compute_perplexity(llm, token_ids: list[int], window: int,
                       max_windows: int | None = None, lora_request=None,
                       bos_token_id: int | None = None) -> PerplexityResult:
    """Perplexity of `llm`'s model over `token_ids` (module docstring).

    Args:
        llm: a generating `pagedllm.LLM`.
        token_ids: the text's tokens.
        window: tokens per window (at most the engine's max_model_len).
        max_windows: score only the first this many windows (None = all).
        lora_request: a `LoRARequest` to score the text under (None: the base model).
        bos_token_id: when given, every window is prefixed with this token and all of the
            window's own tokens are scored (windows of `window - 1` text tokens), as a model
            trained on BOS-prefixed windows was; None scores every token but a window's first.

    Raises:
        ValueError: a window < 2, too few tokens, or a prompt logprob that is not finite.
    """
    from pagedllm import SamplingParams

    if bos_token_id is None:
        windows = split_windows(token_ids, window)[:max_windows]
    else:
        windows = [[bos_token_id] + w for w in split_windows(token_ids, window - 1)[:max_windows]]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate(windows, params, use_tqdm=False, lora_request=lora_request)
    seconds = time.perf_counter() - start
    total, count = 0.0, 0
    for ids, out in zip(windows, outputs):
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            logprob = entry[ids[pos]].logprob
            if not math.isfinite(logprob):
                raise ValueError(f"prompt logprob {logprob} at window position {pos}")
            total -= logprob
            count += 1
    mean_nll = total / count
    return PerplexityResult(num_tokens=count, num_windows=len(windows), window=window,
                            mean_nll=mean_nll, perplexity=math.exp(mean_nll), seconds=seconds)


def read_text(path: str | None) -> str:
    """The text of `path`, or BUILTIN_TEXT for None.

    Raises:
        ValueError: naming `--input-file` and the path: no such file (or a folder), a file
            that is not UTF-8 text, or an empty one.
    """
    if path is None:
        return BUILTIN_TEXT
    from pagedllm.engine.arg_utils import read_text_file

    text = read_text_file(path, "--input-file")
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def run_perplexity(kwargs: dict[str, Any], input_file: str | None, window: int | None,
                   max_windows: int | None) -> tuple[dict[str, Any], list[list[int]]]:
    """Build an LLM from engine kwargs, score the text, and return the figures as a dict (the
    settings that matter for comparisons included) and the scored windows' token ids."""
    from pagedllm import LLM

    text = read_text(input_file)    # a bad file is refused before the model loads
    llm = LLM(**kwargs)
    config = llm.llm_engine.config
    max_model_len = config.max_model_len
    window = window or max_model_len
    if window > max_model_len:
        raise ValueError(f"--window {window} exceeds max_model_len ({max_model_len})")
    token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    result = compute_perplexity(llm, token_ids, window, max_windows)
    return ({"model": kwargs["model"], "text": input_file or "built-in",
             "dtype": config.model_config.dtype,
             "kv_cache_dtype": config.cache_config.cache_dtype,
             "quantization": config.model_config.quantization or "default",
             **asdict(result)}, split_windows(token_ids, window)[:max_windows])
