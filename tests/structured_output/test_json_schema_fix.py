"""JSON schema grammars are inside their schema (issue #17): xgrammar's quirks pinned, the string
rewrite checked character by character, unsupported keywords refused at admission."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.structured_output.json_schema_fix import json_schema_grammar
from pagedllm.structured_output.manager import build_grammar
from pagedllm.structured_output.params import StructuredOutputsParams

BOUNDED = {"type": "string", "minLength": 1, "maxLength": 3}


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    """Whether `grammar` accepts exactly `text` (a matcher over an empty vocabulary)."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def _valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _accepts_bytes(grammar: xgr.Grammar, data: bytes) -> bool:
    """Whether `grammar` accepts exactly the bytes `data` (one token per byte)."""
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + ["</s>"], stop_token_ids=[256])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in data) and matcher.accept_token(256)


def test_xgrammar_length_bounded_string_still_loose():
    """Pins the bug the rewrite works around. When this fails, xgrammar builds length-bounded
    strings correctly: drop the class rewrite in json_schema_fix.py (keep the refusals that still
    hold) and this test."""
    raw = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "maxLength": 8}),
                                       any_whitespace=False)
    assert r'[^\"\\\r\n]' in str(raw) and _accepts(raw, '"\x1bF"'), (
        "xgrammar now excludes control characters from length-bounded strings: the workaround "
        "in pagedllm/structured_output/json_schema_fix.py (fix_string_char_classes) can be dropped")
    assert not _valid({"type": "string", "maxLength": 8}, '"\x1bF"')


SURROGATE = b"\xed\xa0\x80"      # UTF-8 form of U+D800: not valid UTF-8


def test_xgrammar_string_class_still_admits_surrogates():
    """Pins the second string bug: the surrogate exclusion in fix_string_char_classes can go
    when this fails."""
    raw = xgr.Grammar.from_json_schema('{"type": "string"}', any_whitespace=False)
    assert _accepts_bytes(raw, b'"' + SURROGATE + b'"'), (
        "xgrammar now refuses UTF-8-encoded surrogates in strings: the surrogate exclusion in "
        "pagedllm/structured_output/json_schema_fix.py (fix_string_char_classes) can be dropped")


def test_xgrammar_pattern_regex_still_admits_overlong_utf8():
    """Pins the known gap (module docstring): patterns are compiled to a byte automaton that
    admits overlong UTF-8. When this fails, add patterns with "." or negated classes back to the
    property test's generator and drop the TODO."""
    grammar = json_schema_grammar('{"type": "string", "pattern": "^.$"}')
    assert _accepts_bytes(grammar, b'"\xe0\x80\x80"'), (
        "xgrammar's pattern automaton now refuses overlong UTF-8: update json_schema_fix.py's "
        "docstring and the pattern list of test_json_schema_property.py")


@pytest.mark.parametrize("schema", [{"type": "string"}, BOUNDED,
                                    {"type": "object", "additionalProperties": {"type": "null"}}])
def test_strings_refuse_invalid_utf8(schema):
    grammar = json_schema_grammar(json.dumps(schema))
    key = b'{"' if "additionalProperties" in schema else b'"'
    tail = b'": null}' if "additionalProperties" in schema else b'"'
    assert _accepts_bytes(grammar, key + "日".encode() + tail)
    for bad in (SURROGATE, b"\xe0\x80\x80", b"\xf0\x89\x92\x92", b"\xc0\x80"):
        assert not _accepts_bytes(grammar, key + bad + tail), bad


@pytest.mark.parametrize("text", [
    '"a"', '"abc"', '"\\n"', '"\\"\\\\/"', '"\\u00e9x"', '"😀😀"', '"\\ud83d\\ude00"',
    '"é\\t"', '""', '"abcd"', '"\x1b"', '"a\tb"', '"\\x"', '"\\ud83d"', '"\\ude00"', '"\\u12"',
    '"a"b"', '"\\"', '"\x7f"',
])
def test_bounded_string_grammar_matches_schema(text):
    # Lone surrogates are valid JSON but refused by the grammar (stricter is allowed).
    strict_only = text in ('"\\ud83d"', '"\\ude00"')
    assert _accepts(json_schema_grammar(json.dumps(BOUNDED)), text) == (
        _valid(BOUNDED, text) and not strict_only)


@settings(max_examples=150, deadline=None)
@given(value=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=6),
       ensure_ascii=st.booleans(), min_length=st.integers(0, 3), extra=st.integers(0, 3))
def test_bounded_string_grammar_property(value, ensure_ascii, min_length, extra):
    """Every canonical encoding of a string is accepted iff its length fits; raw control
    characters never are."""
    schema = {"type": "string", "minLength": min_length, "maxLength": min_length + extra}
    grammar = json_schema_grammar(json.dumps(schema))
    text = json.dumps(value, ensure_ascii=ensure_ascii)
    assert _accepts(grammar, text) == (min_length <= len(value) <= min_length + extra)
    raw = '"' + value + '"'
    if any(ord(c) < 0x20 for c in value):
        assert not _accepts(grammar, raw)


def test_bounded_strings_fixed_everywhere():
    """Properties, array items, additional properties, property names, nullable types, $defs."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"], "maxLength": 2},
            "b": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 1}},
            "c": {"$ref": "#/$defs/short"},
            "d": {"type": "object", "propertyNames": {"maxLength": 2},
                  "additionalProperties": {"type": "string", "maxLength": 1}},
        },
        "required": ["a", "b", "c", "d"],
        "$defs": {"short": {"type": "string", "maxLength": 3}},
    }
    grammar = json_schema_grammar(json.dumps(schema))
    good = '{"a": "\\n", "b": ["\\t"], "c": "\\u0001", "d": {"\\r": "\\b"}}'
    assert _valid(schema, good) and _accepts(grammar, good)
    for field, raw in [("a", '"\x01"'), ("b", '["\x01"]'), ("c", '"\x01"'),
                       ("d", '{"\x01": "x"}'), ("d", '{"x": "\x01"}')]:
        text = good.replace(json.dumps(json.loads(good)[field], separators=(", ", ": ")), raw, 1)
        assert text != good and not _accepts(grammar, text), (field, raw)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "integer", "not": {"const": 1}}, "'not'"),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 3}}, "'if'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": ["integer", "null"], "multipleOf": 5}, "multipleOf"),
    ({"type": "string", "pattern": "^a+$", "format": "date"}, "'pattern' together with 'format'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": -3}]}, "'anyOf' together"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "'$ref'"),
    ({"type": "integer", "enum": [1, 2, 50], "maximum": 3}, "'enum' together"),
    ({"type": "integer", "enum": [1, "a"]}, "not of type"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "'pattern' together"),
    ({"type": "string", "format": "date", "maxLength": 20}, "'format' together"),
    ({"type": "string", "pattern": "^a\\\\b$"}, "raw JSON text"),
    ({"type": "string", "pattern": '^say "hi"$'}, "raw JSON text"),
    ({"maxLength": 3}, "needs a 'type'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
     "'b' is not in 'properties'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "propertyNames": {"pattern": "^b"}}, "propertyNames"),
    ({"$ref": "http://example.com/s.json"}, "local references"),
    ({"type": "object", "minProperties": 2, "additionalProperties": {"type": "boolean"}},
     "minProperties"),
])
def test_unsupported_features_refused(schema, keyword):
    with pytest.raises(ValueError, match="unsupported JSON schema feature") as info:
        build_grammar(StructuredOutputsParams(json=schema))
    assert keyword in str(info.value)


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"const": 1}, {"enum": [2, "x"]}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"$ref": "#/$defs/b"}],
     "$defs": {"b": {"type": "object", "required": ["k"],
                     "properties": {"k": {"const": "b"}, "x": {"type": "integer"}}}}},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "T", "default": None},
    {"type": "string", "enum": ["a", 'q"x', "c\\d"]},
    {"type": "string", "pattern": "^a\\\\?b$"},
    {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3},
    {"allOf": [{"type": "integer"}]},
])
def test_supported_features_admitted(schema):
    build_grammar(StructuredOutputsParams(json=schema))



def test_special_tokens_never_allowed(byte_level_tokenizer_dir):
    """xgrammar read "<s>" and "<pad>" as literal text, so a pattern of 1-3 printable characters
    accepted them, while the detokenizer drops them: the manager makes them special."""
    from transformers import AutoTokenizer

    from pagedllm.structured_output.manager import StructuredOutputManager
    tokenizer = AutoTokenizer.from_pretrained(str(byte_level_tokenizer_dir))
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer))
    manager.add_request("r", StructuredOutputsParams(
        json={"type": "string", "pattern": "^[ -~]{1,3}$"}))
    while not manager.is_ready("r"):
        pass
    assert not manager.accept_tokens("r", tokenizer.encode('"', add_special_tokens=False))
    row = manager.grammar_bitmask([("r", [])])[0]
    allowed = {t for t in range(len(tokenizer)) if (int(row[t // 32]) >> (t % 32)) & 1}
    assert tokenizer.convert_tokens_to_ids("!") in allowed
    special = set(tokenizer.all_special_ids) - {tokenizer.eos_token_id}
    assert special and not special & allowed
    manager.shutdown()
