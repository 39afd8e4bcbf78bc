"""`pagedllm chat`: an interactive chat in the terminal, in the manner of llama.cpp's `llama-cli`
and `ollama run`.

The model loads once; each turn renders the whole conversation with the chat template and runs it
as one streamed request (`cli_stream`), so the prefix cache serves the earlier turns' tokens and a
turn pays for its new tokens only (the summary line shows `cached_tokens`). Ctrl-C during an
answer aborts that request in the engine and keeps the partial answer in the conversation; Ctrl-C
at the prompt clears the line; Ctrl-D or /exit leaves. Line editing and history come from the
standard library's `readline` where the platform has it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pagedllm import envs
from pagedllm.engine.arg_utils import add_engine_args, engine_kwargs_from_args
from pagedllm.entrypoints.cli_sampling import add_sampling_args

PROMPT = ">>> "
HELP = ("Type a message and press Enter. Ctrl-C stops an answer (the conversation keeps it), "
        "Ctrl-D or /exit leaves; /reset clears the conversation, /system TEXT sets the system "
        "message (and clears the conversation), /help shows this.")


def add_chat_parser(subparsers) -> None:
    """Register `pagedllm chat` on the CLI's subparsers."""
    p = subparsers.add_parser("chat", help="talk to the model in the terminal (chat template, "
                                           "streamed answers, multi-turn)")
    add_engine_args(p)
    add_sampling_args(p, "the rest of the context")
    p.add_argument("--system", default=None, help="system message of the conversation")
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    """Run the chat until Ctrl-D or /exit; returns the exit status (0, or 2 for bad flags).

    Raises:
        ValueError: the model has no chat template (before it loads, where its files say so),
            or invalid engine arguments.
    """
    from pagedllm.entrypoints.chat_template_check import require_chat_template
    from pagedllm.entrypoints.cli_sampling import given_sampling_kwargs

    try:
        given = given_sampling_kwargs(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kwargs = engine_kwargs_from_args(args)
    require_chat_template(kwargs["model"], args.tokenizer, args.chat_template)
    from pagedllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    engine = llm.llm_engine
    if not envs.is_set("PAGEDLLM_LOGGING_LEVEL"):
        # NOTE(chat): the start-up lines stay; INFO lines while talking (e.g. the thread
        # governor's) would break into the answers.
        logging.getLogger("pagedllm").setLevel(logging.WARNING)
    params = SamplingParams(**{"max_tokens": None, **engine.config.default_sampling_params,
                               **given})
    try:
        import readline  # noqa: F401  (input() then edits lines and keeps a history)
    except ImportError:
        pass
    session = ChatSession(engine, params, "max_tokens" in given, args.system)
    name = args.model or os.path.basename(kwargs["model"])   # the shipped model by its name
    print(f"chatting with {name}: Enter sends, Ctrl-C stops an "
          f"answer, Ctrl-D or /exit leaves, /help lists the commands", flush=True)
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print("^C (Ctrl-D or /exit to leave)")
            continue
        if not session.handle(line):
            return 0


class ChatSession:
    """One conversation over an engine: commands and turns.

    Args:
        engine: the offline engine (`LLM(...).llm_engine`).
        params: the sampling parameters of every answer.
        max_tokens_given: params.max_tokens came from the user (refused when it does not fit,
            as the server does) rather than a default (cut to the context).
        system: the system message, or None.
    """

    def __init__(self, engine, params, max_tokens_given: bool, system: str | None) -> None:
        self.engine = engine
        self.params = params
        self.max_tokens_given = max_tokens_given
        self.system = system
        self.messages: list[dict[str, str]] = []

    def handle(self, line: str) -> bool:
        """Act on one input line; False when the user leaves."""
        text = line.strip()
        if not text:
            return True
        command, _, rest = text.partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            return False
        if command == "/reset":
            self.messages = []
            print("(conversation cleared)")
        elif command == "/system":
            self.system = rest.strip() or None
            self.messages = []
            print("(system message set, conversation cleared)" if self.system else
                  "(system message removed, conversation cleared)")
        elif command in ("/help", "/?"):
            print(HELP)
        elif command.startswith("/") and command[1:].isalpha():
            print(f"unknown command {command}. {HELP}")
        else:
            self.turn(line)
        return True

    def turn(self, text: str) -> None:
        """Answer one user message, streamed to stdout, then print the turn's summary."""
        from pagedllm.entrypoints.cli_stream import add_cli_request, run_streams
        from pagedllm.entrypoints.llm import chat_prompt_token_ids

        system = [{"role": "system", "content": self.system}] if self.system else []
        conversation = [*system, *self.messages, {"role": "user", "content": text}]
        try:
            prompt = chat_prompt_token_ids(self.engine.tokenizer, conversation)
            request_id = add_cli_request(self.engine, {"prompt_token_ids": prompt}, self.params,
                                         self.max_tokens_given)
        except ValueError as e:
            print(f"error: {e} (/reset starts a new conversation)")
            return
        result = run_streams(self.engine, [request_id],
                             lambda _, delta: print(delta, end="", flush=True))[request_id]
        print()
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": result.text}]
        if result.interrupted:
            print("^C interrupted")
        if result.error:
            print(f"error: {result.error}")
        rate = result.num_output_tokens / max(result.elapsed, 1e-9)
        print(f"[{result.num_output_tokens} tokens in {result.elapsed:.2f} s, {rate:.1f} "
              f"tokens/s (prompt included); prompt {result.num_prompt_tokens} tokens, "
              f"cached_tokens {result.num_cached_tokens}; finish: {result.finish_reason}]",
              flush=True)
