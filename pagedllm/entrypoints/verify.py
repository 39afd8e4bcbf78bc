"""`pagedllm verify MODEL`: does this engine run a checkpoint faithfully?

Runs a handful of prompts greedily through pagedllm (logprobs of the chosen tokens) and feeds
the same prompt + generated tokens through `transformers` (fp32, one forward pass per prompt,
i.e. teacher-forced along pagedllm's sequence), so every position compares both engines on the
same prefix:

    position i:  ours[i] (pagedllm's greedy token, its logprob)  vs  HF argmax, log_softmax(HF)

Per prompt it reports the first divergence (HF's greedy token differs from ours), the max
absolute difference of the chosen tokens' logprobs and the top-1 agreement. A prompt passes when
every divergence is a near-tie (HF's logprob of its own top token exceeds its logprob of ours by
less than `--tolerance`); the run passes when every prompt does. Exit status: 0 PASS, 1 FAIL,
2 usage errors (missing files, bad flags, no oracle). `transformers` is only the oracle here.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_TOLERANCE = 1e-2
# Varied on purpose: facts, code, a story, counting, translation, odd whitespace and Unicode.
BUILTIN_PROMPTS = (
    "The capital of France is",
    "chat: What is the capital of France?",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "chat: Write a haiku about the sea.",
    "The three primary colors are",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "Water boils at a temperature of",
    "The most important idea in machine learning is",
    "  Indented text\nwith a second line and café, naïve, 日本語:",
    "Q: Why is the sky blue?\nA:",
)
CHAT_PREFIX = "chat:"


@dataclass(frozen=True)
class VerifyPrompt:
    """One prompt: raw text, or (chat=True) a user message rendered with the chat template."""

    text: str
    chat: bool = False


@dataclass(frozen=True)
class Divergence:
    """The first output position where transformers' greedy token differs from pagedllm's.

    Attributes:
        position: index into the generated tokens (0 = first generated token).
        ours_token_id / ours_token: pagedllm's token there (id, text).
        reference_token_id / reference_token: transformers' argmax there (id, text).
        reference_gap: transformers' logprob of its top token minus its logprob of ours
            (nats, >= 0; the top-2 gap when ours is its second choice).
        near_tie: reference_gap < tolerance.
        ours_text / reference_text: the continuations from `position` on (transformers' is its
            own greedy continuation, as long as ours).
    """

    position: int
    ours_token_id: int
    ours_token: str
    reference_token_id: int
    reference_token: str
    reference_gap: float
    near_tie: bool
    ours_text: str
    reference_text: str


@dataclass(frozen=True)
class PromptReport:
    """The comparison on one prompt.

    Attributes:
        prompt / chat: the prompt as given.
        num_prompt_tokens / num_output_tokens: token counts (output: pagedllm's greedy tokens,
            stopping at an end-of-generation token or --max-tokens).
        output_text: pagedllm's output text.
        max_logprob_diff: max over positions of |pagedllm logprob - transformers logprob| of the
            chosen token (nats), along pagedllm's sequence.
        top1_agreement: fraction of positions where transformers' argmax is pagedllm's token.
        divergence: the first position where they differ, or None.
        passed: no divergence, or only near-ties (see Divergence.near_tie) at every one.
    """

    prompt: str
    chat: bool
    num_prompt_tokens: int
    num_output_tokens: int
    output_text: str
    max_logprob_diff: float
    top1_agreement: float
    divergence: Divergence | None
    passed: bool


@dataclass(frozen=True)
class SequenceComparison:
    """`compare_sequence`'s result; positions index the generated tokens."""

    max_logprob_diff: float
    top1_agreement: float
    mismatches: list[int]  # positions where transformers' argmax != ours
    gaps: list[float]  # per mismatch: transformers' top logprob - its logprob of ours (nats)


def compare_sequence(output_ids: list[int], output_logprobs: list[float],
                     reference_logprobs: torch.Tensor) -> SequenceComparison:
    """Compare pagedllm's greedy tokens with transformers' distribution at each position.

    Args:
        output_ids: [T] pagedllm's generated tokens.
        output_logprobs: [T] pagedllm's logprob of each (nats).
        reference_logprobs: [T, vocab] float, transformers' log_softmax at the same positions
            (position i conditioned on prompt + output_ids[:i]).

    Raises:
        ValueError: when the lengths disagree or T == 0.
    """
    import torch

    n = len(output_ids)
    if n == 0 or len(output_logprobs) != n or reference_logprobs.shape[0] != n:
        raise ValueError(f"need T > 0 tokens, logprobs and reference rows, got {n}, "
                         f"{len(output_logprobs)}, {reference_logprobs.shape[0]}")
    ids = torch.tensor(output_ids, dtype=torch.long)
    ref = reference_logprobs.float()
    chosen = ref.gather(1, ids[:, None])[:, 0]
    diff = (chosen - torch.tensor(output_logprobs, dtype=torch.float32)).abs()
    top, argmax = ref.max(dim=-1)
    mismatch = argmax != ids
    positions = mismatch.nonzero()[:, 0].tolist()
    return SequenceComparison(float(diff.max()), float((~mismatch).float().mean()), positions,
                              [float(top[i] - chosen[i]) for i in positions])


def read_prompts(path: str | None) -> list[VerifyPrompt]:
    """The built-in prompts, or those of a text file: one prompt per line, blank lines skipped,
    `\\n` for a newline inside a prompt, a `chat:` prefix for a user message to chat-template.

    Raises:
        ValueError: no such file, a file that is not UTF-8 text, or no prompt in it (the
            message names `--prompts-file` and the path).
    """
    if path is None:
        lines = list(BUILTIN_PROMPTS)
    else:
        from pagedllm.engine.arg_utils import read_text_file

        text = read_text_file(path, "--prompts-file")
        lines = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"no prompts in {path}")
    return [VerifyPrompt(line[len(CHAT_PREFIX):].strip(), True) if line.startswith(CHAT_PREFIX)
            else VerifyPrompt(line) for line in lines]


def load_reference_model(model: str):
    """transformers' model for a checkpoint folder or .gguf file, float32, eval mode.

    A .gguf file is read as transformers reads it (`from_pretrained(folder, gguf_file=name)`,
    dequantized). Raises whatever `from_pretrained` raises (OSError, ValueError, ...); for a
    .gguf architecture transformers cannot read (deepseek2, mamba2), a ValueError saying to pass
    `--reference` (the checkpoint folder the file was converted from).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_loader.gguf import is_gguf_path

    if is_gguf_path(model):
        path = Path(model).expanduser().resolve()
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32)
        except ValueError as e:
            if "not supported" not in str(e):
                raise
            raise ValueError(f"transformers cannot read {model} as a reference ({e}); pass "
                             f"--reference with the checkpoint folder it was converted "
                             f"from") from e
    else:
        try:
            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise
            # transformers lists every causal-LM config it knows (hundreds of names).
            raise ValueError(f"transformers has no causal language model (AutoModelForCausalLM) "
                             f"for the checkpoint {model} (e.g. a vision-language model): "
                             f"verify compares text-only causal language models") from None
    return hf.eval()


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at each generated position:
    [len(output_ids), vocab] float32, row i conditioned on prompt_ids + output_ids[:i]."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def _reference_continuation(hf_model, prefix: list[int], n: int) -> list[int]:
    import torch

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prefix]), max_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0, len(prefix):].tolist()


def _prompt_ids(tokenizer, prompt: VerifyPrompt) -> list[int]:
    if prompt.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}],
                                                  tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    return list(tokenizer(prompt.text).input_ids)


def _float_gguf_activations():
    """GGUF layers of an engine started inside keep float32 activations
    (`PAGEDLLM_GGUF_Q8_ACTIVATIONS=0`) unless the user set the variable: transformers computes
    on the dequantized weights, and the 8-bit activations that serving uses by default are a
    deliberate approximation, not a loading error for verify to find."""
    from pagedllm import envs

    return envs.defaults_for_unset({"PAGEDLLM_GGUF_Q8_ACTIVATIONS": "0"})


def run_verify(model: str, prompts: list[VerifyPrompt], max_tokens: int, tolerance: float,
               dtype: str = "float32", reference: str | None = None,
               engine_args: dict[str, Any] | None = None,
               num_prompts: int | None = None) -> list[PromptReport]:
    """Generate with pagedllm, then compare with transformers on `reference` (default: `model`).

    Chat prompts are dropped when the tokenizer has no chat template, then the first
    `num_prompts` (default all) are used.

    Raises:
        ValueError / FileNotFoundError / OSError: pagedllm or transformers cannot load a model.
    """
    from pagedllm import LLM, SamplingParams

    with _float_gguf_activations():
        llm = LLM(model, dtype=dtype, **(engine_args or {}))
    tokenizer = llm.get_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        prompts = [p for p in prompts if not p.chat]
    prompts = prompts[:num_prompts]
    prompt_ids = [_prompt_ids(tokenizer, p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                           use_tqdm=False)
    del llm
    hf = load_reference_model(reference or model)
    reports = []
    for prompt, ids, out in zip(prompts, prompt_ids, outputs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [step[t].logprob for t, step in zip(tokens, completion.logprobs)]
        cmp = compare_sequence(tokens, logprobs, reference_logprobs(hf, ids, tokens))
        divergence = None
        if cmp.mismatches:
            i, gap = cmp.mismatches[0], cmp.gaps[0]
            theirs = _reference_continuation(hf, ids + tokens[:i], len(tokens) - i)
            divergence = Divergence(
                i, tokens[i], tokenizer.decode([tokens[i]]), theirs[0],
                tokenizer.decode([theirs[0]]), gap, gap < tolerance,
                tokenizer.decode(tokens[i:]), tokenizer.decode(theirs))
        reports.append(PromptReport(
            prompt.text, prompt.chat, len(ids), len(tokens), completion.text,
            cmp.max_logprob_diff, cmp.top1_agreement, divergence,
            all(gap < tolerance for gap in cmp.gaps)))
    return reports


def format_report(reports: list[PromptReport], model: str, reference: str | None, dtype: str,
                  max_tokens: int, tolerance: float) -> str:
    """The human-readable report, ending with the PASS/FAIL line."""
    lines = [f"pagedllm verify {model}: pagedllm ({dtype}) vs transformers (float32) on "
             f"{reference or 'the same weights'}, greedy, up to {max_tokens} tokens"]
    if model.endswith(".gguf"):
        lines.append("(GGUF layers on float32 activations, PAGEDLLM_GGUF_Q8_ACTIVATIONS=0: "
                     "serving rounds them to 8 bits per 32 values by default, as llama.cpp "
                     "does, which transformers cannot reproduce)")
    for k, r in enumerate(reports, 1):
        kind = "chat" if r.chat else "text"
        lines.append(f"[{k}] {kind} {r.prompt!r} ({r.num_prompt_tokens} prompt tokens, "
                     f"{r.num_output_tokens} generated)")
        stats = (f"max |logprob diff| {r.max_logprob_diff:.2e}, top-1 agreement "
                 f"{r.top1_agreement:.0%}")
        d = r.divergence
        if d is None:
            lines.append(f"    match; {stats}")
        else:
            verdict = "near-tie" if d.near_tie else "REAL divergence"
            lines.append(f"    first divergence at output token {d.position}: pagedllm "
                         f"{d.ours_token_id} {d.ours_token!r} vs transformers "
                         f"{d.reference_token_id} {d.reference_token!r}; transformers' gap "
                         f"{d.reference_gap:.2e} ({verdict}, tolerance {tolerance:g}); {stats}")
            lines.append(f"      pagedllm:     {d.ours_text!r}")
            lines.append(f"      transformers: {d.reference_text!r}")
        lines.append(f"    output: {r.output_text!r}")
    matched = sum(r.divergence is None for r in reports)
    ties = sum(r.passed and r.divergence is not None for r in reports)
    worst = max(r.max_logprob_diff for r in reports)
    passed = all(r.passed for r in reports)
    tail = (f"{matched}/{len(reports)} prompts match transformers token for token"
            + (f", {ties} more diverge only at near-ties (transformers' top-2 logprob gap < "
               f"{tolerance:g})" if ties else "")
            + f"; max |logprob diff| {worst:.2e}")
    lines.append(("PASS: " if passed else "FAIL: ") + tail)
    return "\n".join(lines)


def add_verify_parser(subparsers) -> None:
    """Register `pagedllm verify` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "verify", help="check that pagedllm runs a checkpoint (folder or .gguf) as transformers "
                       "does: greedy outputs and logprobs on a few prompts, PASS/FAIL")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder, hub id or .gguf file (or give it as --model; default: the "
                        "shipped model)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (the flag every command takes)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N prompts (default: all)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line ('\\n' for a newline; prefix 'chat:' for a user "
                        "message rendered with the chat template)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="a divergence passes as a near-tie when transformers' logprob gap "
                        "between its top token and ours is below this (nats)")
    p.add_argument("--dtype", default="float32", help="pagedllm's dtype (transformers: float32)")
    p.add_argument("--reference", default=None,
                   help="checkpoint folder or .gguf file transformers loads instead of MODEL, "
                        "e.g. the original checkpoint when MODEL is a quantized file")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20,
                   help="pagedllm's KV cache budget (bytes)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=run_verify_command)


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.model is not None and args.model_option not in (None, args.model):
        return f"two models given: {args.model} and --model {args.model_option}"
    args.model = args.model or args.model_option
    if args.model is None:      # as every command that runs a model: the shipped one
        from pagedllm.assets import default_model_path
        args.model = default_model_path()
    if args.max_tokens < 1:
        return f"--max-tokens must be >= 1, got {args.max_tokens}"
    if args.num_prompts is not None and args.num_prompts < 1:
        return f"--num-prompts must be >= 1, got {args.num_prompts}"
    if not args.tolerance >= 0:
        return f"--tolerance must be >= 0, got {args.tolerance}"
    for name in (args.model, args.reference):
        if name is not None and name.lower().endswith(".gguf") and not Path(name).is_file():
            return f"no such file: {name}"
    # A path (not a hub id) that does not exist: transformers would call it a bad repo id.
    if (args.reference is not None and args.reference.startswith(("/", ".", "~"))
            and not Path(args.reference).expanduser().exists()):
        return f"--reference {args.reference}: no such file or folder"
    return None


def run_verify_command(args: argparse.Namespace) -> int:
    """`pagedllm verify`: prints the report (or JSON); returns 0 PASS, 1 FAIL, 2 usage error."""
    error = _usage_error(args)
    prompts: list[VerifyPrompt] = []
    if error is None:
        try:
            prompts = read_prompts(args.prompts_file)
        except (OSError, ValueError) as e:
            error = str(e)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        reports = run_verify(args.model, prompts, args.max_tokens, args.tolerance, args.dtype,
                             args.reference,
                             {"kv_cache_memory_bytes": args.kv_cache_memory_bytes},
                             args.num_prompts)
    except (OSError, ValueError) as e:
        print(f"error: could not verify {args.model}: {e}", file=sys.stderr)
        return 2
    if not reports:
        print("error: no prompt left (chat prompts need a chat template)", file=sys.stderr)
        return 2
    passed = all(r.passed for r in reports)
    if args.json:
        print(json.dumps({"model": args.model, "reference": args.reference or args.model,
                          "dtype": args.dtype, "max_tokens": args.max_tokens,
                          "tolerance": args.tolerance, "passed": passed,
                          "prompts": [asdict(r) for r in reports]}, ensure_ascii=False))
    else:
        print(format_report(reports, args.model, args.reference, args.dtype, args.max_tokens,
                            args.tolerance))
    return 0 if passed else 1
