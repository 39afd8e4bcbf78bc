r"""JSON schema -> xgrammar Grammar whose language lies inside the schema (JSON that validates).

xgrammar 0.2.9's converter is looser than the schema in places, so a sampled output could fail
`json.loads` or `jsonschema.validate` although the grammar accepted it. Fixes, in order:

- Refusal (`check_json_schema`, at admission): keywords xgrammar silently drops (not,
  if/then/else, dependent*, contains, uniqueItems, multipleOf on numbers, allOf with several parts,
  overlapping oneOf, siblings of $ref / anyOf / oneOf / enum / const, pattern or format beside a
  length, type-specific keywords without a type, remote $ref, patterns it matches against the raw
  JSON text, minProperties needing distinct additional names) raise `UnsupportedJSONSchemaError`
  naming the keyword and its JSON pointer.
- Schema rewrite (`rewrite_formats`): formats "date" and "ipv4", whose grammars admit 2024-02-31
  and 01.2.3.4, become exact patterns.
- Grammar rewrite (`fix_string_char_classes`): a string bounded by minLength/maxLength becomes
  `"\"" X{m,n} "\""` with `X = [^\"\\\r\n]`, which lets raw control characters (0x00-0x1f) in and
  forbids every escape. X becomes an exact JSON string character (RFC 8259 section 7): unescaped
  `[^"\\\x00-\x1f]`, a short escape, `\uXXXX` outside the surrogates, or a surrogate pair; each
  counts as one character, as JSON Schema counts code points. Every negated class also excludes
  D800-DFFF, whose UTF-8 form xgrammar admits (invalid UTF-8, decoded as U+FFFD).

Not corrected (TODO(#17)): xgrammar compiles a pattern to `Regex(..., json_string=true)`, whose
byte automaton admits overlong UTF-8 (E0 80 80) and surrogates where the pattern allows characters
from U+0800 up (".", "[^a]", "\W"); only a model that emits invalid UTF-8 reaches it, and the
text then holds U+FFFD. Where xgrammar is stricter than the schema (fewer number spellings, no
escapes in patterns, no extra properties unless allowed) outputs stay valid; that is left alone.
Pure functions, no state.
"""

from __future__ import annotations

import json
from typing import Any

# Keywords xgrammar 0.2.9 ignores (the grammar then accepts instances the schema rejects).
_UNSUPPORTED = {
    "not": "'not' is not supported",
    "if": "'if'/'then'/'else' are not supported",
    "then": "'if'/'then'/'else' are not supported",
    "else": "'if'/'then'/'else' are not supported",
    "dependentRequired": "'dependentRequired' is not supported",
    "dependentSchemas": "'dependentSchemas' is not supported",
    "dependencies": "'dependencies' is not supported",
    "contains": "'contains' is not supported",
    "minContains": "'minContains' is not supported",
    "maxContains": "'maxContains' is not supported",
    "unevaluatedProperties": "'unevaluatedProperties' is not supported (use additionalProperties)",
    "unevaluatedItems": "'unevaluatedItems' is not supported (use items)",
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
    "contentSchema": "'contentSchema' is not supported",
}
# Keywords that only constrain instances of one JSON type.
_TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "uniqueItems"),
    "object": ("properties", "patternProperties", "additionalProperties", "required",
               "propertyNames", "minProperties", "maxProperties"),
}
# Keywords after which xgrammar ignores every sibling validation keyword.
_EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# Validation keywords (unknown keywords are annotations in JSON Schema 2020-12, so ignoring them
# is correct).
_VALIDATION = frozenset({"type", *_EXCLUSIVE, *_UNSUPPORTED,
                         *(k for keys in _TYPE_KEYWORDS.values() for k in keys)})
# Sub-schema containers, walked so every nested schema is checked.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("additionalProperties", "items", "propertyNames")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")


class UnsupportedJSONSchemaError(ValueError):
    """A JSON schema uses a feature the grammar backend cannot enforce exactly."""

    def __init__(self, pointer: str, reason: str) -> None:
        super().__init__(f"at '{pointer}': {reason}")
        self.pointer = pointer
        self.reason = reason


def check_json_schema(schema: Any) -> None:
    """Raise unless xgrammar 0.2.9 enforces every constraint of `schema` (a decoded JSON schema).

    Walks every subschema (properties, items, $defs, combinators, ...). Structural errors that
    xgrammar reports itself (bad types, empty ranges, missing $ref targets) are left to it.

    Raises:
        UnsupportedJSONSchemaError: a keyword xgrammar would ignore or loosen, with its pointer.
    """
    _check_node(schema, "#", schema)


def _check_node(node: Any, pointer: str, root: Any) -> None:
    if isinstance(node, bool) or not isinstance(node, dict):
        return
    for key in node:
        if key in _UNSUPPORTED:
            raise UnsupportedJSONSchemaError(pointer, _UNSUPPORTED[key])
    _check_exclusive_siblings(node, pointer)
    _check_type_keywords(node, pointer)
    _check_string(node, pointer)
    _check_number(node, pointer)
    if node.get("uniqueItems") is True:
        raise UnsupportedJSONSchemaError(pointer, "'uniqueItems' is not supported")
    if "allOf" in node and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
        raise UnsupportedJSONSchemaError(
            pointer, "'allOf' with more than one schema is not supported (merge them into one)")
    if "oneOf" in node and isinstance(node["oneOf"], list):
        _check_one_of_disjoint(node["oneOf"], pointer, root)
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise UnsupportedJSONSchemaError(
                pointer, f"$ref {ref!r}: only local references ('#' or '#/...') are supported")
    _check_object(node, pointer)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check_node(sub, f"{pointer}/{key}/{_escape_pointer(name)}", root)
    for key in _SCHEMA_VALUES:
        sub = node.get(key)
        if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
            sub = {"type": "string", **sub}     # property names are strings
        _check_node(sub, f"{pointer}/{key}", root)
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check_node(sub, f"{pointer}/{key}/{i}", root)


def _check_exclusive_siblings(node: dict, pointer: str) -> None:
    present = [k for k in _EXCLUSIVE if k in node]
    if not present:
        return
    # NOTE(json_schema_fix): `type` beside enum/const only narrows the listed values; checked here
    # so the grammar (which keeps only the values) stays exact.
    allowed = set()
    if present in (["enum"], ["const"]):
        allowed.add("type")
        values = node["enum"] if "enum" in node else [node["const"]]
        if "type" in node and isinstance(values, list):
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            for value in values:
                if not any(_is_instance(value, t) for t in types):
                    raise UnsupportedJSONSchemaError(
                        pointer, f"{present[0]} value {json.dumps(value)} is not of type "
                        f"{node['type']!r}; list only values the schema allows")
    others = sorted(k for k in node if k in _VALIDATION and k not in allowed and k not in present)
    if len(present) > 1 or others:
        raise UnsupportedJSONSchemaError(
            pointer, f"'{present[0]}' together with {sorted(set(present[1:]) | set(others))} is "
            f"not supported (the grammar would keep only '{present[0]}'); move the other "
            "keywords inside it")


def _check_type_keywords(node: dict, pointer: str) -> None:
    if "type" in node:
        return
    for type_name, keywords in _TYPE_KEYWORDS.items():
        for key in keywords:
            if key in node and key not in ("format",):
                raise UnsupportedJSONSchemaError(
                    pointer, f"'{key}' needs a 'type' (here {type_name!r}); without one the "
                    "grammar ignores it")


def _check_string(node: dict, pointer: str) -> None:
    has_length = "minLength" in node or "maxLength" in node
    for key in ("pattern", "format"):
        if key in node and has_length and _may_be(node, "string"):
            raise UnsupportedJSONSchemaError(
                pointer, f"'{key}' together with minLength/maxLength is not supported (the "
                "grammar would ignore the length); put the length into the pattern")
    if "pattern" in node and "format" in node and _may_be(node, "string"):
        raise UnsupportedJSONSchemaError(pointer, "'pattern' together with 'format' is not "
                                         "supported (the grammar would keep only one)")
    if isinstance(node.get("pattern"), str) and _may_be(node, "string"):
        _check_pattern(node["pattern"], pointer)


def _check_pattern(pattern: str, pointer: str) -> None:
    r"""xgrammar compiles most patterns to `Regex(..., json_string=true)`, which matches the
    string's characters. Some (observed: those that must match '"', '\' or a control character)
    become plain EBNF over the raw JSON text instead, so `^\\$` emits a lone backslash (invalid
    JSON). Any pattern not compiled the first way is refused."""
    import xgrammar as xgr

    try:
        text = str(xgr.Grammar.from_json_schema(
            json.dumps({"type": "string", "pattern": pattern}), any_whitespace=False))
    except RuntimeError:
        return   # an invalid regex: the full compile reports it
    if "json_string=true" not in text:
        raise UnsupportedJSONSchemaError(
            pointer, f"pattern {pattern!r} is not supported: a pattern that must match '\"', "
            "'\\' or a control character is matched against the raw JSON text")


def _check_number(node: dict, pointer: str) -> None:
    if "multipleOf" not in node:
        return
    # NOTE(json_schema_fix): xgrammar drops multipleOf for numbers and for type lists such as
    # ["integer", "null"].
    if node.get("type") != "integer" or not isinstance(node["multipleOf"], int):
        raise UnsupportedJSONSchemaError(
            pointer, "'multipleOf' is only supported with type 'integer' (not a list) and an "
            "integer step")


def _check_object(node: dict, pointer: str) -> None:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in required:
        if name not in properties:
            raise UnsupportedJSONSchemaError(
                pointer, f"required property {name!r} is not in 'properties' (the grammar "
                "would let it be left out); declare it")
    extras = bool(node.get("patternProperties")) or node.get("additionalProperties") not in (
        None, False)
    min_properties = node.get("minProperties", 0)
    # NOTE(json_schema_fix): the grammar can repeat an additional property's name and a repeat
    # counts once, so at most one additional property may be needed to reach minProperties.
    if extras and isinstance(min_properties, int) and min_properties > len(set(required)) + 1:
        raise UnsupportedJSONSchemaError(
            pointer, f"'minProperties' {min_properties} needs several additional properties, "
            "whose names the grammar cannot keep distinct; require the properties instead")
    if "propertyNames" in node and properties:
        raise UnsupportedJSONSchemaError(
            pointer, "'propertyNames' together with 'properties' is not supported (the grammar "
            "applies it to additional properties only)")


def _check_one_of_disjoint(branches: list, pointer: str, root: Any) -> None:
    """oneOf is enforced as anyOf; exact only when no instance can match two branches. Accepted
    proofs: pairwise disjoint JSON types, disjoint enum/const values, or objects discriminated by
    a required property with distinct const values."""
    if len(branches) < 2:
        return
    resolved = [_resolve(b, root) for b in branches]
    type_sets = [_branch_types(b) for b in resolved]
    if all(t is not None for t in type_sets) and _pairwise_disjoint(type_sets):
        return
    value_sets = [_branch_values(b) for b in resolved]
    if all(v is not None for v in value_sets) and _pairwise_disjoint(value_sets):
        return
    if _discriminated(resolved):
        return
    raise UnsupportedJSONSchemaError(
        pointer, "'oneOf' whose branches may overlap is not supported (the grammar enforces "
        "anyOf); use anyOf, or make the branches disjoint by type, value or a const property")


def _discriminated(branches: list) -> bool:
    if not all(isinstance(b, dict) and isinstance(b.get("properties"), dict) for b in branches):
        return False
    common = set.intersection(*(set(b.get("required") or []) for b in branches))
    for name in sorted(common):
        values = [_branch_values(_property(b, name)) for b in branches]
        if all(v is not None for v in values) and _pairwise_disjoint(values):
            return True
    return False


def _property(branch: dict, name: str) -> Any:
    return branch["properties"].get(name, True)


def _branch_types(branch: Any) -> set[str] | None:
    if not isinstance(branch, dict):
        return None
    if "type" in branch:
        types = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
        # A number may be integral: "number" covers both integer and fractional values.
        return {x for t in types for x in (("integer", "fraction") if t == "number" else (t,))}
    values = _branch_values(branch)
    if values is None:
        return None
    return {t for t, _ in values}


def _branch_values(branch: Any) -> set[tuple[str, str]] | None:
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return {_canonical(branch["const"])}
    if isinstance(branch.get("enum"), list):
        return {_canonical(v) for v in branch["enum"]}
    return None


def _canonical(value: Any) -> tuple[str, str]:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    kind = next(t for t in ("boolean", "integer", "fraction", "string", "null", "array",
                            "object") if _is_instance(value, t))
    return kind, json.dumps(value, sort_keys=True)


def _pairwise_disjoint(sets: list[set]) -> bool:
    seen: set = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True


def _is_instance(value: Any, type_name: str) -> bool:
    """JSON Schema's type test ("integer" includes 1.0; "fraction" is a non-integral number)."""
    if type_name == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if type_name == "number":
        return isinstance(value, (int, float))
    if type_name == "fraction":
        return isinstance(value, float) and not value.is_integer()
    return isinstance(value, {"string": str, "null": type(None), "array": list,
                              "object": dict}.get(type_name, ()))


def _may_be(node: dict, type_name: str) -> bool:
    types = node.get("type")
    return types == type_name or (isinstance(types, list) and type_name in types)


def _resolve(node: Any, root: Any) -> Any:
    """Follow local $refs (a chain, cycles stop) to the schema they name; None if unresolvable."""
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        ref = node["$ref"]
        if ref in seen or not (ref == "#" or ref.startswith("#/")):
            return None
        seen.add(ref)
        node = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
    return node


def _escape_pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


# ------------------------------------------------------------------------ format rewrite
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_YEAR = r"(?:000[1-9]|00[1-9]\d|0[1-9]\d\d|[1-9]\d\d\d)"
_LEAP_YEAR = r"(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
              r"|02-(?:0[1-9]|1\d|2[0-8]))")
# Formats whose xgrammar 0.2.9 grammar admits invalid values ("date": 2024-02-31; "ipv4": leading
# zeros, "01.2.3.4", which RFC 2673's dotted-quad and Python's ipaddress reject), as exact patterns.
_FORMAT_PATTERNS = {
    "date": rf"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$",
    "ipv4": rf"^(?:{_OCTET}\.){{3}}{_OCTET}$",
}


def rewrite_formats(node: Any) -> Any:
    """A copy of a schema with each string `format` listed in `_FORMAT_PATTERNS` replaced by its
    exact `pattern` (run after `check_json_schema`, which refuses pattern + format)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if node.get("format") in _FORMAT_PATTERNS and _may_be(node, "string"):
        out["pattern"] = _FORMAT_PATTERNS[out.pop("format")]
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: rewrite_formats(sub) for name, sub in node[key].items()}
    for key in _SCHEMA_VALUES:
        if key in node:
            out[key] = rewrite_formats(node[key])
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [rewrite_formats(sub) for sub in node[key]]
    return out


# ------------------------------------------------------------------------ grammar rewrite
# The character class xgrammar 0.2.9 prints for one character of a length-bounded string (also
# inlined by its optimizer, e.g. `("" | ([^\"\\\r\n]))` for maxLength 1).
_LOOSE_CHAR_CLASS = r'[^\"\\\r\n]'
_EXACT_CHAR = "pagedllm_json_string_char"
_HEX = "[0-9A-Fa-f]"
# One JSON string character (RFC 8259 section 7), counted as one code point: unescaped, a short
# escape, \uXXXX outside D800-DFFF, or a high+low surrogate pair (lone surrogates are refused:
# a lone high one followed by a low one would decode to one character, not two).
_SURROGATES = r"\ud800-\udfff"
_EXACT_CHAR_RULES = "\n".join([
    f'{_EXACT_CHAR} ::= [^"\\\\\\0-\\x1f{_SURROGATES}] | "\\\\" [\\"\\\\/bfnrt] '
    f'| "\\\\u" {_EXACT_CHAR}_bmp | "\\\\u" [Dd] [89ABab] {_HEX} {_HEX} "\\\\u" [Dd] [C-Fc-f] '
    f'{_HEX} {_HEX}',
    f'{_EXACT_CHAR}_bmp ::= [0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX} | [Dd] [0-7] {_HEX} {_HEX}',
])


def _split_ebnf(ebnf: str) -> list[tuple[str, str]]:
    """Split grammar text into ("class", "[...]"), ("string", '"..."') and ("other", ...) pieces,
    honouring backslash escapes inside classes and strings."""
    pieces: list[tuple[str, str]] = []
    i, start = 0, 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in '["':
            close = "]" if c == "[" else '"'
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            if start < i:
                pieces.append(("other", ebnf[start:i]))
            pieces.append(("class" if c == "[" else "string", ebnf[i:j + 1]))
            i = start = j + 1
        else:
            i += 1
    if start < len(ebnf):
        pieces.append(("other", ebnf[start:]))
    return pieces


def _is_loose_class(token: str) -> bool:
    """A negated class that keeps '"' and '\\' out (so it is meant as a JSON string character)
    but lets control characters in."""
    return token.startswith("[^") and '\\"' in token and "\\\\" in token and "\\0" not in token


def fix_string_char_classes(ebnf: str) -> tuple[str, int]:
    """Correct the string character classes of `ebnf` (a grammar as printed by
    `str(xgrammar.Grammar)`): the loose length-bounded class becomes a reference to the exact JSON
    string character rule, and every negated class also excludes the surrogates D800-DFFF, whose
    UTF-8 form (ED A0..BF xx) xgrammar 0.2.9 admits although it is not valid UTF-8 (the text would
    decode to U+FFFD, three per character, breaking lengths and patterns).

    Returns (new grammar text, number of classes changed); the text is unchanged when none are.

    Raises:
        UnsupportedJSONSchemaError: a loose string character class in another form remains.
    """
    pieces, count = [], 0
    for kind, token in _split_ebnf(ebnf):
        if kind == "class" and token == _LOOSE_CHAR_CLASS:
            token, count = _EXACT_CHAR, count + 1
        elif kind == "class" and _is_loose_class(token):
            raise UnsupportedJSONSchemaError(
                "#", f"xgrammar built a string character class {token} this engine cannot "
                "correct (control characters would pass); simplify the string constraints")
        elif kind == "class" and token.startswith("[^") and _SURROGATES not in token:
            token, count = token[:-1] + _SURROGATES + "]", count + 1
        pieces.append(token)
    ebnf = "".join(pieces)
    if _EXACT_CHAR in ebnf:
        ebnf = ebnf.rstrip("\n") + "\n" + _EXACT_CHAR_RULES + "\n"
    return ebnf, count


def json_schema_grammar(schema_text: str):
    """The xgrammar Grammar of a JSON schema (text), checked and corrected as described above.

    Compact separators (", " and ": "), no free whitespace, as before.

    Raises:
        UnsupportedJSONSchemaError: the schema uses a feature the grammar cannot enforce.
        ValueError: the text is not JSON.
        RuntimeError: xgrammar rejects the schema (bad types, empty ranges, unknown $ref, ...).
    """
    import xgrammar as xgr

    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from e
    check_json_schema(schema)
    rewritten = rewrite_formats(schema)
    # The original text when nothing changed (keeps number spellings such as 1e400 as written).
    grammar = xgr.Grammar.from_json_schema(
        schema_text if rewritten == schema else json.dumps(rewritten, allow_nan=False),
        any_whitespace=False)
    text, count = fix_string_char_classes(str(grammar))
    return xgr.Grammar.from_ebnf(text) if count else grammar
