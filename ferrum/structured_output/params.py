"""StructuredOutputsParams: what a request's output must match (vLLM's `structured_outputs`).

Exactly one constraint per request, named as in vLLM's `StructuredOutputsParams`:

- `json`: a JSON schema (dict, or its JSON text); the output is one JSON value that validates.
- `json_object`: True; the output is any JSON object (OpenAI `response_format: json_object`).
- `regex`: the output matches the regular expression (Rust `regex` syntax, whole output).
- `choice`: a list of strings; the output is exactly one of them.
- `grammar`: a context-free grammar in Lark syntax (llguidance's dialect; `start` is the
  start rule) or GBNF (llama.cpp's, `root ::= ...`, converted to Lark).

`whitespace_pattern` (JSON only): a regex for the whitespace allowed between JSON tokens.
Without it the JSON is written on one line with ", " and ": " separators and no other
whitespace, which keeps small models from looping on newlines (vLLM's `disable_any_whitespace`
is the default here and accepted for compatibility).

This module only validates the shape of the options; `ferrum.structured_output.grammar`
compiles them (and raises for an invalid schema, regex or grammar).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ferrum.errors import InvalidRequestError

CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """One output constraint; see the module docstring. `param` is the request field the
    constraint came from (e.g. "response_format", "tool_choice"), used to name it in errors.
    Raises InvalidRequestError when no constraint or more than one is given, or one has the
    wrong type."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = True
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        p = self.param
        given = [k for k in CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{p}: give exactly one of {', '.join(CONSTRAINTS)}; got "
                f"{', '.join(given) if given else 'none'}", param=p)
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"{p}: the JSON schema is not valid JSON: {e}", param=p) from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"{p}: a JSON schema must be an object, got "
                                      f"{type(self.json).__name__}", param=p)
        if self.json_object not in (None, True, False):
            raise InvalidRequestError(f"{p}: json_object must be a boolean", param=p)
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"{p}: {name} must be a non-empty string", param=p)
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError(f"{p}: choice must be a non-empty list of non-empty "
                                          "strings", param=p)
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise InvalidRequestError(f"{p}: whitespace_pattern applies to json / json_object "
                                      "only", param=p)

    @classmethod
    def from_dict(cls, value: dict, param: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request's JSON object; unknown keys raise InvalidRequestError naming them."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{param} must be an object", param=param)
        known = {f.name for f in fields(cls)} - {"param"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{param}: unsupported key(s) {', '.join(unknown)}; "
                                      f"ferrum accepts {', '.join(sorted(known))}", param=param)
        return cls(**value, param=param)

    def kind(self) -> str:
        """The constraint given: one of CONSTRAINTS."""
        return next(k for k in CONSTRAINTS if getattr(self, k) not in (None, False))
