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


def _text(v) -> bool:
    return isinstance(v, str) and bool(v)


# Each option's type (vLLM's StructuredOutputsParams) as a test and as the error says it.
_TYPES = {
    "json": (lambda v: isinstance(v, (dict, str)), "a JSON schema: an object, or a string holding one"),
    "json_object": (lambda v: isinstance(v, bool), "a boolean"),
    "regex": (_text, "a non-empty string (a regular expression)"),
    "choice": (lambda v: isinstance(v, list) and bool(v) and all(map(_text, v)),
               "a non-empty list of non-empty strings"),
    "grammar": (_text, "a non-empty string (a Lark or GBNF grammar)"),
    "whitespace_pattern": (_text, "a non-empty string (a regular expression)"),
    "disable_any_whitespace": (lambda v: isinstance(v, bool), "a boolean"),
}


def json_value(v) -> str:
    """A value as the client wrote it, JSON type first: 'boolean true', 'string "a"', 'array []'
    (cut to 40 characters)."""
    kind = ("null" if v is None else "boolean" if isinstance(v, bool) else "number"
            if isinstance(v, (int, float)) else "string" if isinstance(v, str) else "array"
            if isinstance(v, (list, tuple)) else "object" if isinstance(v, dict) else type(v).__name__)
    text = json.dumps(v, ensure_ascii=False, default=repr)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


@dataclass
class StructuredOutputsParams:
    """One output constraint; see the module docstring. `param` is the request field the
    constraint came from (e.g. "response_format", "tool_choice", "guided_regex"), used to name
    it in errors; an option of vLLM's options object (`param` "structured_outputs") is named
    by its key, e.g. "structured_outputs.regex". Raises InvalidRequestError when no constraint
    or more than one is given, or an option has the wrong type (the message says which type
    was given and which is expected)."""

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
        for key, (ok, expected) in _TYPES.items():
            v = getattr(self, key)
            if v is not None and not ok(v):
                got = f"got {json_value(v)}"
                if key == "choice" and isinstance(v, list) and v:   # which item
                    i = next(i for i, c in enumerate(v) if not _text(c))
                    got = f"item {i} is {json_value(v[i])}"
                raise self._bad(key, f"must be {expected}; {got}")
        given = [k for k in CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{p}: give exactly one of {', '.join(CONSTRAINTS)}; got "
                f"{', '.join(given) if given else 'none'}", param=p)
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as e:   # RecursionError: nested too deep
                raise self._bad("json", f"the JSON schema is not valid JSON: {e}") from e
            if not isinstance(schema, dict):
                raise self._bad("json", f"must be {_TYPES['json'][1]}; the string holds "
                                        f"{json_value(schema)}")
            self.json = schema
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise InvalidRequestError(f"{p}: whitespace_pattern applies to json / json_object "
                                      "only", param=p)

    @classmethod
    def from_dict(cls, value: dict, param: str = "structured_outputs") -> "StructuredOutputsParams":
        """From a request's JSON object; unknown keys raise InvalidRequestError naming them."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{param}: must be an object with one of "
                                      f"{', '.join(CONSTRAINTS)}; got {json_value(value)}", param=param)
        known = {f.name for f in fields(cls)} - {"param"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{param}: unsupported key(s) {', '.join(unknown)}; "
                                      f"ferrum accepts {', '.join(sorted(known))}", param=param)
        return cls(**value, param=param)

    def param_name(self, key: str | None = None) -> str:
        """How errors name option `key` (default: the constraint given): structured_outputs.<key>
        in vLLM's options object, else the field the constraint came from (guided_regex is
        the regex, response_format the schema)."""
        key = key or self.kind()
        return f"{self.param}.{key}" if self.param == "structured_outputs" else self.param

    def _bad(self, key: str, msg: str) -> InvalidRequestError:
        name = self.param_name(key)
        return InvalidRequestError(f"{name}: {msg}", param=name)

    def kind(self) -> str:
        """The constraint given: one of CONSTRAINTS."""
        return next(k for k in CONSTRAINTS if getattr(self, k) not in (None, False))
