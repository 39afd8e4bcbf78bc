"""The requests of `pagedllm bench soak`: a seeded mix of valid, invalid and disconnected ones.

`make_cases` is pure (no I/O): the same arguments give byte-identical bodies. Every invalid case
carries what the server must answer, checked by `soak.py`:

  category            example                         status       error.param
  out of range        temperature -1, n 2**70         400          the field
  outside the vocab   stop_token_ids [vocab+10]       400          the field ("prompt" for ids)
  wrong type          temperature "hot", stop 7       400          the field
  NaN / Infinity      temperature NaN (raw JSON)      400          the field
  unknown field       "frobnicate": 1                 400          "frobnicate"
  unsupported field   suffix, best_of 3               400          the field
  bad tools           a named function not in tools   400          "tool_choice"
  bad grammar         guided_regex "(a|b"             400          the field
  messages            [], "hi", role "wizard"         400          "messages"
  malformed JSON      truncated body, a JSON array    400          null
  oversized body      a prompt of 5 or 12 MiB         413 or 400   null or "prompt"/"messages"
  unknown model       model "no-such-model"           404          "model" or null

Each invalid case is sent streamed or not at random: a streamed one must get its 4xx as the HTTP
status, never a 200 followed by an error event.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VALID, INVALID, DISCONNECT = "valid", "invalid", "disconnect"
KIND_WEIGHTS = {VALID: 0.60, INVALID: 0.25, DISCONNECT: 0.15}
# Disconnect modes: close before the response's first byte; after k SSE events; right after
# `data: [DONE]`; raw socket closed (FIN) or reset (RST) right after sending a streamed request.
DISCONNECT_MODES = {"before_first_byte": 0.3, "mid_stream": 0.3, "after_last_chunk": 0.2,
                    "raw_close": 0.1, "raw_reset": 0.1}
# Oversized prompts: one under the server's default body cap (8 MiB: it reaches the context-length
# check) and one over it (413), sent with Content-Length and chunked.
HUGE_BODY_MIB = (5, 12)
MAX_VALID_TOKENS = 48

_TEXTS = ("To be, or not to be, that is the question:",
          "Now is the winter of our discontent",
          "Friends, Romans, countrymen, lend me your ears;",
          "All the world's a stage, and all the men and women merely players.",
          "O Romeo, Romeo, wherefore art thou Romeo?",
          "If music be the food of love, play on,",
          "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
          "The quality of mercy is not strained;",
          "HAMLET:\nAlas, poor Yorick! I knew him,",
          "Shall I compare thee to a summer's day?")
_STOPS = ("\n", ".", " the", "KING", ",")
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer"}},
           "required": ["name"]}
_CHOICES = ["yes", "no", "perchance"]
_REGEX = r"(ay|nay)( my lord)?"


@dataclass(frozen=True)
class SoakCase:
    """One request of the soak and what it must get back.

    Attributes:
        index: position in the run.
        kind: VALID, INVALID or DISCONNECT.
        category: what the case tests: the broken field or category for INVALID ("temperature",
            "malformed_json", ...), the disconnect mode, or "completions"/"chat" for VALID.
        label: the mutation or mode in words, e.g. "n=2**70" (report key).
        path: COMPLETIONS or CHAT.
        body: the exact bytes sent (raw JSON: may hold NaN or be malformed on purpose).
        stream: whether the body asks for a stream.
        num_choices: VALID/DISCONNECT: choices expected (n per prompt x prompts).
        include_usage: a streamed request asked for the usage chunk.
        expect_status: INVALID: acceptable HTTP statuses.
        expect_params: INVALID: acceptable `error.param` values (None = null).
        disconnect_after: DISCONNECT: SSE events read before closing ("mid_stream") or the
            seconds waited for a first byte ("before_first_byte").
        chunked: send the body with chunked transfer encoding (no Content-Length).
    """

    index: int
    kind: str
    category: str
    label: str
    path: str
    body: bytes
    stream: bool
    num_choices: int = 0
    include_usage: bool = False
    expect_status: tuple[int, ...] = ()
    expect_params: tuple[str | None, ...] = ()
    disconnect_after: float = 0.0
    chunked: bool = False

    def summary(self, limit: int = 300) -> str:
        """`POST path body` with the body cut to `limit` characters (its size said if cut)."""
        text = self.body[:limit].decode("utf-8", "replace")
        if len(self.body) > limit:
            text += f"... ({len(self.body)} bytes)"
        return f"POST {self.path}{' (chunked)' if self.chunked else ''} {text}"


def _dumps(body: dict[str, Any]) -> bytes:
    # NOTE(soak): allow_nan (the default) writes bare NaN / Infinity, which strict JSON forbids:
    # exactly the bodies the NaN cases need.
    return json.dumps(body).encode()


# ------------------------------------------------------------------ valid requests
def _token_prompt(rng: random.Random, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 40))]


def _completion_prompt(rng: random.Random, vocab_size: int) -> tuple[Any, int]:
    """(prompt field, number of prompts)."""
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(_TEXTS), 1
    if roll < 0.75:
        return _token_prompt(rng, vocab_size), 1
    if roll < 0.9:
        return rng.sample(_TEXTS, 2), 2
    return [_token_prompt(rng, vocab_size) for _ in range(2)], 2


def _messages(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "Speak as a player."})
    messages.append({"role": "user", "content": rng.choice(_TEXTS)})
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": rng.choice(_TEXTS)},
                     {"role": "user", "content": rng.choice(_TEXTS)}]
    return messages


def _structured(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("json_object", "json_schema", "choice", "regex"))
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": _SCHEMA}}}
    if kind == "choice":
        return {"guided_choice": _CHOICES}
    return {"guided_regex": _REGEX}


def _sampling(rng: random.Random, vocab_size: int, path: str, max_tokens: int) -> dict[str, Any]:
    """Random in-range sampling fields for `path`."""
    out: dict[str, Any] = {}
    if rng.random() < 0.85:
        out["temperature"] = 0.0 if rng.random() < 0.3 else round(rng.uniform(0.0, 1.5), 3)
    if rng.random() < 0.3:
        out["top_p"] = round(rng.uniform(0.05, 1.0), 3)
    if rng.random() < 0.3:
        out["top_k"] = rng.choice((-1, rng.randint(1, 50)))
    if rng.random() < 0.2:
        out["min_p"] = round(rng.uniform(0.0, 0.3), 3)
    for name in ("presence_penalty", "frequency_penalty"):
        if rng.random() < 0.2:
            out[name] = round(rng.uniform(-2.0, 2.0), 3)
    if rng.random() < 0.2:
        out["repetition_penalty"] = round(rng.uniform(0.8, 1.5), 3)
    if rng.random() < 0.4:
        out["seed"] = rng.randrange(2**31)
    out["n"] = 1 if rng.random() < 0.5 else rng.randint(2, 4)
    if rng.random() < 0.2:
        out["stop"] = rng.sample(_STOPS, rng.randint(1, 2))
    if rng.random() < 0.2:
        out["stop_token_ids"] = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        out["ignore_eos"] = True
    if rng.random() < 0.1:
        out["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.1:
        out["logit_bias"] = {str(rng.randrange(vocab_size)): round(rng.uniform(-5, 5), 2)}
    if rng.random() < 0.2:
        if path == COMPLETIONS:
            out["logprobs"] = rng.randint(0, 5)
        else:
            out["logprobs"] = True
            out["top_logprobs"] = rng.randint(0, 5)
    if path == COMPLETIONS and rng.random() < 0.15:
        out["echo"] = True
    if rng.random() < 0.2:
        out.update(_structured(rng))
    return out


def _valid_body(rng: random.Random, vocab_size: int, model: str, path: str,
                max_tokens: int) -> tuple[dict[str, Any], int]:
    """(body without `stream`, number of prompts)."""
    body: dict[str, Any] = {"model": model}
    if path == COMPLETIONS:
        body["prompt"], num_prompts = _completion_prompt(rng, vocab_size)
        body["max_tokens"] = max_tokens
    else:
        body["messages"], num_prompts = _messages(rng), 1
        body["max_completion_tokens" if rng.random() < 0.3 else "max_tokens"] = max_tokens
    body.update(_sampling(rng, vocab_size, path, max_tokens))
    return body, num_prompts


def _stream_fields(rng: random.Random, body: dict[str, Any], stream: bool) -> bool:
    """Set `stream` (and maybe `stream_options`) on `body`; returns include_usage."""
    body["stream"] = stream
    include_usage = stream and rng.random() < 0.5
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return include_usage


@dataclass(frozen=True)
class _Mix:
    """What a run may draw from: endpoints, invalid mutations, disconnect modes (weighted)."""

    paths: tuple[str, ...]
    mutations: tuple[Mutation, ...]
    modes: dict[str, float]


def _valid_case(index: int, rng: random.Random, vocab_size: int, model: str,
                mix: _Mix) -> SoakCase:
    path = rng.choice(mix.paths)
    body, num_prompts = _valid_body(rng, vocab_size, model, path,
                                    rng.randint(1, MAX_VALID_TOKENS))
    stream = rng.random() < 0.5
    include_usage = _stream_fields(rng, body, stream)
    name = "completions" if path == COMPLETIONS else "chat"
    return SoakCase(index, VALID, name, f"{name}{' stream' if stream else ''}", path,
                    _dumps(body), stream, num_choices=body["n"] * num_prompts,
                    include_usage=include_usage)


# ------------------------------------------------------------------ invalid requests
BOTH = (COMPLETIONS, CHAT)
_400 = (400,)


@dataclass(frozen=True)
class Mutation:
    """One way to break a request.

    Attributes:
        label: report key, e.g. "top_p=0".
        category: the broken top-level field, or a category ("malformed_json", ...).
        paths: endpoints it applies to.
        patch: fields merged into a small valid body, or a callable (body, vocab_size) -> bytes
            for bodies that are not a patched object.
        params: acceptable `error.param` values.
        status: acceptable HTTP statuses.
        chunked: send the body chunked.
    """

    label: str
    category: str
    paths: tuple[str, ...]
    patch: dict[str, Any] | Callable[[dict[str, Any], int], bytes]
    params: tuple[str | None, ...]
    status: tuple[int, ...] = _400
    chunked: bool = False


def _field(label: str, name: str, value: Any, paths: tuple[str, ...] = BOTH) -> Mutation:
    return Mutation(label, name, paths, {name: value}, (name,))


def _vocab_field(label: str, name: str, make: Callable[[int], Any],
                 paths: tuple[str, ...] = BOTH) -> Mutation:
    return Mutation(label, name, paths, lambda body, vocab: _dumps({**body, name: make(vocab)}),
                    (name,))


def _huge(mib: int) -> Callable[[dict[str, Any], int], bytes]:
    def patch(body: dict[str, Any], vocab_size: int) -> bytes:
        text = "All the world's a stage. " * (mib * 2**20 // 25)
        if "messages" in body:
            return _dumps({**body, "messages": [{"role": "user", "content": text}]})
        return _dumps({**body, "prompt": text})
    return patch


def _truncated(body: dict[str, Any], vocab_size: int) -> bytes:
    raw = _dumps(body)
    return raw[:len(raw) // 2]


MUTATIONS: tuple[Mutation, ...] = (
    _field("temperature=-1", "temperature", -1),
    _field("top_p=0", "top_p", 0),
    _field("top_p=2", "top_p", 2),
    _field("n=0", "n", 0),
    _field("n=10**9", "n", 10**9),
    _field("n=2**70", "n", 2**70),
    _field("seed=2**64", "seed", 2**64),
    _field("top_k=2**70", "top_k", 2**70),
    _field("max_tokens=0", "max_tokens", 0),
    _field("max_tokens=-5", "max_tokens", -5),
    _field("max_tokens=2**63", "max_tokens", 2**63),
    _field("max_completion_tokens=-5", "max_completion_tokens", -5, (CHAT,)),
    _field("logprobs=10**6", "logprobs", 10**6, (COMPLETIONS,)),
    Mutation("top_logprobs=10**6", "top_logprobs", (CHAT,),
             {"logprobs": True, "top_logprobs": 10**6}, ("top_logprobs",)),
    _field("presence_penalty=5", "presence_penalty", 5),
    _field("truncate_prompt_tokens=2**70", "truncate_prompt_tokens", 2**70),
    _vocab_field("stop_token_ids=[vocab+10]", "stop_token_ids", lambda v: [v + 10]),
    _vocab_field("logit_bias={vocab+10: 1}", "logit_bias", lambda v: {str(v + 10): 1}),
    _vocab_field("allowed_token_ids=[vocab+10]", "allowed_token_ids", lambda v: [1, v + 10]),
    _vocab_field("prompt=[1, 2, vocab+10]", "prompt", lambda v: [1, 2, v + 10], (COMPLETIONS,)),
    _field("prompt=[5, -1]", "prompt", [5, -1], (COMPLETIONS,)),
    _field("temperature=\"hot\"", "temperature", "hot"),
    _field("messages=\"hi\"", "messages", "hi", (CHAT,)),
    _field("n=1.5", "n", 1.5),
    _field("stop=7", "stop", 7),
    _field("temperature=NaN", "temperature", float("nan")),
    _field("top_p=Infinity", "top_p", float("inf")),
    _field("presence_penalty=-Infinity", "presence_penalty", float("-inf")),
    _field("frequency_penalty=NaN", "frequency_penalty", float("nan")),
    _field("repetition_penalty=Infinity", "repetition_penalty", float("inf")),
    _field("logit_bias={5: NaN}", "logit_bias", {"5": float("nan")}),
    _field("frobnicate=1", "frobnicate", 1),
    _field("suffix=\"...\"", "suffix", " and so farewell.", (COMPLETIONS,)),
    _field("best_of=3", "best_of", 3, (COMPLETIONS,)),
    Mutation("tool_choice names a function not in tools", "tools", (CHAT,),
             {"tools": [{"type": "function", "function": {
                 "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}],
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
             ("tool_choice",)),
    _field("guided_regex=\"(a|b\"", "guided_regex", "(a|b"),
    _field("response_format json_schema type=objekt", "response_format",
           {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
    _field("messages=[]", "messages", [], (CHAT,)),
    _field("messages role=wizard", "messages",
           [{"role": "wizard", "content": "Double, double toil and trouble"}], (CHAT,)),
    Mutation("model=no-such-model", "model", BOTH, {"model": "no-such-model"},
             ("model", None), (404,)),
    Mutation("malformed JSON (truncated)", "malformed_json", BOTH, _truncated, (None,)),
    Mutation("malformed JSON (top-level array)", "malformed_json", BOTH,
             lambda body, vocab: b"[1, 2, 3]", (None,)),
    *(Mutation(f"body of {mib} MiB{' (chunked)' if chunked else ''}", "oversized_body", BOTH,
               _huge(mib), (None, "prompt", "messages"), (413, 400), chunked)
      for mib in HUGE_BODY_MIB for chunked in (False, True)),
)


def _invalid_case(index: int, rng: random.Random, vocab_size: int, model: str,
                  mix: _Mix) -> SoakCase:
    mutation = rng.choice(mix.mutations)
    path = rng.choice([p for p in mutation.paths if p in mix.paths])
    body, _ = _valid_body(rng, vocab_size, model, path, rng.randint(1, 8))
    # The base stays small and free of fields that would hide the mutation or be blamed for it
    # (min_tokens > max_tokens=0; max_completion_tokens winning over a broken max_tokens).
    for name in ("n", "response_format", "guided_choice", "guided_regex", "echo", "min_tokens"):
        body.pop(name, None)
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    stream = rng.random() < 0.5
    _stream_fields(rng, body, stream)
    if callable(mutation.patch):
        raw = mutation.patch(body, vocab_size)
    else:
        raw = _dumps({**body, **mutation.patch})
    return SoakCase(index, INVALID, mutation.category, mutation.label, path, raw, stream,
                    expect_status=mutation.status, expect_params=mutation.params,
                    chunked=mutation.chunked)


# ------------------------------------------------------------------ disconnects
def _disconnect_case(index: int, rng: random.Random, vocab_size: int, model: str,
                     mix: _Mix) -> SoakCase:
    mode = rng.choices(list(mix.modes), weights=list(mix.modes.values()))[0]
    path = rng.choice(mix.paths)
    body, num_prompts = _valid_body(rng, vocab_size, model, path,
                                    rng.randint(16, MAX_VALID_TOKENS))
    body.pop("stop", None)
    body["ignore_eos"] = True  # long enough to still be running when the client goes away
    stream = mode != "before_first_byte" or rng.random() < 0.3
    include_usage = _stream_fields(rng, body, stream)
    after = rng.randint(1, 4) if mode == "mid_stream" else \
        round(rng.uniform(0.001, 0.05), 4) if mode == "before_first_byte" else 0.0
    return SoakCase(index, DISCONNECT, mode, mode, path, _dumps(body), stream,
                    num_choices=body["n"] * num_prompts, include_usage=include_usage,
                    disconnect_after=after)


_MAKERS = {VALID: _valid_case, INVALID: _invalid_case, DISCONNECT: _disconnect_case}


def num_warmup(num_requests: int) -> int:
    """Requests of the warm-up phase (all valid): the first 10%."""
    return min(num_requests, max(1, num_requests // 10))


def make_cases(num_requests: int, seed: int, vocab_size: int, model: str, chat: bool = True,
               skip: tuple[str, ...] = ()) -> list[SoakCase]:
    """The soak's requests: `num_warmup` valid ones, then the mix of KIND_WEIGHTS.

    Args:
        vocab_size: the served model's vocabulary (valid token ids are below it).
        model: the name sent in each request's `model`.
        chat: include /v1/chat/completions (False when the model has no chat template).
        skip: leave out the invalid mutations and disconnect modes whose label contains one of
            these strings (to get past a known server-killing request while it is being fixed);
            a kind left with nothing drops out of the mix.
    """
    rng = random.Random(seed)
    paths = BOTH if chat else (COMPLETIONS,)
    mix = _Mix(paths, tuple(m for m in MUTATIONS if set(m.paths) & set(paths)
                            and not any(s in m.label for s in skip)),
               {m: w for m, w in DISCONNECT_MODES.items() if not any(s in m for s in skip)})
    weights = {kind: w for kind, w in KIND_WEIGHTS.items()
               if (kind != INVALID or mix.mutations) and (kind != DISCONNECT or mix.modes)}
    warmup = num_warmup(num_requests)
    cases = []
    for index in range(num_requests):
        kind = VALID if index < warmup else rng.choices(list(weights),
                                                        weights=list(weights.values()))[0]
        cases.append(_MAKERS[kind](index, rng, vocab_size, model, mix))
    return cases
