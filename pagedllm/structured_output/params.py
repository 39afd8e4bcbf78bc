"""StructuredOutputsParams: which constraint a request's output must satisfy (vLLM's names)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (dict or JSON string); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is one of these strings;
    grammar: an EBNF (GBNF-style) grammar as xgrammar accepts, with a `root` rule.

    Raises:
        ValueError: if none or several are set, or a value has the wrong type.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, name) is not None] + (["json_object"]
                                                             if self.json_object else [])
        if len(set_fields) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {set_fields or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or string)")
        if self.json is not None and not isinstance(self.json, str):
            try:
                json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must be JSON: {e}") from e
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): the cache key of the compiled grammar."""
        if self.json is not None:
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json,
                                                                            sort_keys=True)
            return "json", spec
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar
