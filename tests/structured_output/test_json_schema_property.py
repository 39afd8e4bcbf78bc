"""Property tests (issue #17): for many random JSON schemas, every output the engine samples at
temperature 1 on a random-weight model is JSON that validates against its schema; so is every
random walk through the schema's grammar over a character vocabulary (no model, many samples).

Schemas come from a seeded generator over the features the engine admits: types and type lists,
nesting, enums and consts, strings with minLength/maxLength, pattern or format, number and integer
ranges, integer multipleOf, arrays with minItems/maxItems or prefixItems, anyOf, type-disjoint
oneOf, $ref/$defs, required and optional properties, additionalProperties. All engine requests go
in one `LLM.generate` batch. An output cut by max_tokens is no failure (the grammar had not
finished), but most must stop on their own.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from pagedllm import LLM, GenerateError, SamplingParams
from pagedllm.structured_output.json_schema_fix import json_schema_grammar

# Formats xgrammar enforces and jsonschema's FormatChecker can check without extra packages.
_FORMATS = ["date", "email", "ipv4", "ipv6", "uuid"]
# NOTE(tests): ASCII-only classes: a pattern class admitting U+0800 and up (".", "[^a]") lets
# invalid UTF-8 through (see json_schema_fix's module docstring and its pin test).
_PATTERNS = [r"^[a-z]{1,6}$", r"^\d{3}-\d{2}$", r"^(yes|no|maybe)$", r"^[A-Z][a-z]{0,4}$",
             r"^a\\?b$", r"^[ -@]{2}$", r"^[ -~]{1,3}$"]
_ENUM_VALUES = ["a", 'q"x', "c\\d", "é", "line\nbreak", 0, -3, 2.5, True, False, None]


class SchemaGenerator:
    """Random JSON schemas from `random.Random(seed)`; `depth` bounds nesting. Each schema's
    `$defs` collects the subschemas its `$ref`s name."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def schema(self) -> dict:
        self.defs: dict[str, dict] = {}
        root = self.node(depth=2)
        return {"$defs": self.defs, **root} if self.defs else root

    def node(self, depth: int) -> dict:
        kinds = ["string", "integer", "number", "enum", "const", "boolean", "null"]
        if depth > 0:
            kinds += ["object", "object", "array", "anyOf", "oneOf", "ref"]
        return getattr(self, f"_{self.rng.choice(kinds).lower()}")(depth)

    def _string(self, depth: int) -> dict:
        rng = self.rng
        kind = rng.random()
        if kind < 0.5:
            max_length = rng.randint(0, 8)
            schema = {"type": "string", "maxLength": max_length}
            if rng.random() < 0.5:
                schema["minLength"] = rng.randint(0, max_length)
        elif kind < 0.75:
            schema = {"type": "string", "pattern": rng.choice(_PATTERNS)}
        else:
            schema = {"type": "string", "format": rng.choice(_FORMATS)}
        if rng.random() < 0.15:
            schema["type"] = ["string", "null"]
        return schema

    def _integer(self, depth: int) -> dict:
        rng = self.rng
        low = rng.randint(-1000, 1000)
        high = low + rng.randint(2, 2000)
        schema = {"type": "integer"}
        schema["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = low
        if rng.random() < 0.85:
            schema["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = high
        if rng.random() < 0.2:
            schema["multipleOf"] = rng.randint(2, 7)
            schema["maximum"] = schema.pop("exclusiveMaximum", high) + 20   # room for a multiple
        elif rng.random() < 0.15:
            schema["type"] = ["integer", "null"]
        return schema

    def _number(self, depth: int) -> dict:
        rng = self.rng
        low = round(rng.uniform(-100, 100), rng.randint(0, 3))
        high = round(low + rng.uniform(0.5, 100), rng.randint(0, 3))
        schema = {"type": "number"}
        schema["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = low
        schema["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = high
        return schema

    def _enum(self, depth: int) -> dict:
        return {"enum": self.rng.sample(_ENUM_VALUES, self.rng.randint(1, 4))}

    def _const(self, depth: int) -> dict:
        return {"const": self.rng.choice(_ENUM_VALUES + [{"k": [1, "v"]}])}

    def _boolean(self, depth: int) -> dict:
        return {"type": "boolean"}

    def _null(self, depth: int) -> dict:
        return {"type": "null"}

    def _object(self, depth: int) -> dict:
        rng = self.rng
        names = rng.sample(["id", "name", "tags", "x", "é", 'q"k', "nested", "n"],
                           rng.randint(1, 3))
        schema = {"type": "object",
                  "properties": {n: self.node(depth - 1) for n in names},
                  "required": [n for n in names if rng.random() < 0.6]}
        extra = rng.random()
        if extra < 0.4:
            schema["additionalProperties"] = False
        elif extra < 0.6:
            schema["additionalProperties"] = self.node(0)
        return schema

    def _array(self, depth: int) -> dict:
        rng = self.rng
        if rng.random() < 0.25:
            prefix = [self.node(depth - 1) for _ in range(rng.randint(1, 2))]
            return {"type": "array", "prefixItems": prefix, "items": False,
                    "minItems": rng.randint(0, len(prefix))}
        min_items = rng.randint(0, 2)
        return {"type": "array", "items": self.node(depth - 1), "minItems": min_items,
                "maxItems": min_items + rng.randint(0, 2)}

    def _anyof(self, depth: int) -> dict:
        return {"anyOf": [self.node(depth - 1) for _ in range(self.rng.randint(2, 3))]}

    def _oneof(self, depth: int) -> dict:
        makers = {
            "string": lambda: {**self._string(0), "type": "string"},   # not nullable: disjoint
            "integer": lambda: {**self._integer(0), "type": "integer"},
            "boolean": lambda: {"type": "boolean"},
            "null": lambda: {"type": "null"},
            "array": lambda: {"type": "array", "maxItems": 2,
                              "items": {"type": "integer", "minimum": 0, "maximum": 9}},
        }
        return {"oneOf": [makers[t]() for t in self.rng.sample(sorted(makers), 2)]}

    def _ref(self, depth: int) -> dict:
        name = f"d{len(self.defs)}"
        self.defs[name] = {}                    # reserve the name before nested refs take one
        self.defs[name] = self.node(depth - 1)
        return {"$ref": f"#/$defs/{name}"}


def _schemas(seed: int, count: int) -> list[dict]:
    generator = SchemaGenerator(seed)
    return [generator.schema() for _ in range(count)]


@pytest.fixture(scope="module", params=["llama", "mistral"])
def llm(tiny_checkpoints, request):
    """Byte-level BPE ("llama") and SentencePiece with byte fallback ("mistral") vocabularies."""
    return LLM(str(tiny_checkpoints[request.param]), dtype="float32",
               kv_cache_memory_bytes=32 << 20, max_num_seqs=64)


def _check_outputs(llm: LLM, schemas: list[dict], seed: int, max_tokens: int) -> None:
    params = [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=max_tokens,
                             structured_outputs={"json": s}) for i, s in enumerate(schemas)]
    outputs = llm.generate(["{"] * len(schemas), params, use_tqdm=False)
    checker = jsonschema.FormatChecker()
    stopped = 0
    for schema, out in zip(schemas, outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "length":
            continue
        assert completion.finish_reason == "stop", completion.finish_reason
        stopped += 1
        # U+FFFD would mean the grammar let bytes through that are not UTF-8.
        assert "\ufffd" not in completion.text, (json.dumps(schema), completion.text)
        try:
            value = json.loads(completion.text)
            jsonschema.validate(value, schema, format_checker=checker)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            pytest.fail(f"schema {json.dumps(schema)}\noutput {completion.text!r}\n{e}")
    assert stopped >= 0.75 * len(schemas), f"only {stopped}/{len(schemas)} outputs finished"


def test_random_schemas_outputs_validate(llm):
    _check_outputs(llm, _schemas(seed=0, count=96), seed=0, max_tokens=96)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 6))
def test_random_schemas_outputs_validate_more(llm, seed):
    _check_outputs(llm, _schemas(seed=seed, count=64), seed=seed, max_tokens=128)


# Tokens of the grammar-level walk: characters, a few multi-character pieces, byte sequences that
# are not UTF-8 (a surrogate, overlong forms) and the three bytes of "日" apart; the last stops.
_WALK_VOCAB = ([chr(c).encode() for c in range(32, 127)]
               + [c.encode() for c in ["\x00", "\x01", "\x1b", "\x1f", "\n", "\t", "é", "日",
                                       "😀", "\\u00", "\\ud83d", "\\ude00", '", "']]
               + [b"\xed\xa0\x80", b"\xe0\x80\x80", b"\xf0\x89\x92\x92", b"\xc0\x80",
                  b"\xe6", b"\x97", b"\xa5", b"\x80"]
               + [b"</s>"])


def _walk(matcher, rng: random.Random, max_steps: int) -> bytes | None:
    """A uniformly random path through the grammar over `_WALK_VOCAB`; None if it did not end."""
    stop = len(_WALK_VOCAB) - 1
    bitmask = xgr.allocate_token_bitmask(1, len(_WALK_VOCAB))
    pieces = []
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        token = rng.choice(np.flatnonzero(bits[:len(_WALK_VOCAB)]).tolist())
        if token == stop:
            return b"".join(pieces)
        assert matcher.accept_token(token)
        pieces.append(_WALK_VOCAB[token])
    return None


def test_random_schemas_grammar_walk():
    """Without a model: random walks through each schema's grammar (control characters, escapes,
    surrogate halves and invalid UTF-8 on offer) are UTF-8 JSON that validates."""
    info = xgr.TokenizerInfo(_WALK_VOCAB, stop_token_ids=[len(_WALK_VOCAB) - 1])
    compiler = xgr.GrammarCompiler(info)
    rng = random.Random(0)
    checker = jsonschema.FormatChecker()
    finished = total = 0
    for schema in _schemas(seed=7, count=60):
        compiled = compiler.compile_grammar(json_schema_grammar(json.dumps(schema)))
        for _ in range(10):
            total += 1
            data = _walk(xgr.GrammarMatcher(compiled), rng, max_steps=200)
            if data is None:
                continue
            finished += 1
            text = data.decode(errors="replace")
            try:
                data.decode()
                jsonschema.validate(json.loads(text), schema, format_checker=checker)
            except (UnicodeDecodeError, json.JSONDecodeError, jsonschema.ValidationError) as e:
                pytest.fail(f"schema {json.dumps(schema)}\noutput {text!r}\n{e}")
    assert finished >= 0.75 * total, f"only {finished}/{total} walks finished"


def test_generated_schemas_are_all_admitted():
    """The generator only uses admitted features (a refusal here is an over-strict check)."""
    for schema in _schemas(seed=0, count=96) + _schemas(seed=1, count=64):
        json_schema_grammar(json.dumps(schema))


def test_unsupported_schema_refused_at_admission_alone(llm):
    bad = SamplingParams(max_tokens=5, structured_outputs={"json": {"type": "integer",
                                                                    "not": {"const": 1}}})
    with pytest.raises(GenerateError) as info:
        llm.generate(["a", "b"], [SamplingParams(temperature=0.0, max_tokens=3), bad],
                     use_tqdm=False)
    assert "unsupported JSON schema feature at '#': 'not'" in info.value.errors[1]
    assert info.value.outputs[0].finished
