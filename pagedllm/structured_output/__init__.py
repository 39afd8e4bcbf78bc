"""Structured output: grammars (JSON schema, regex, choice, EBNF) enforced through token bitmasks."""
