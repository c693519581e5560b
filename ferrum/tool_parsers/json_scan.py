"""Find JSON values in model output that may still be growing (streaming).

The tool parsers need the *raw text* of a call's `arguments` value (so that streamed fragments
join to exactly the non-streamed arguments string) and must work on a prefix of the output.
These helpers scan JSON text (RFC 8259) without decoding it: they track strings, escapes and
bracket depth, and answer None where the text ends before the value does. Text that is not
JSON raises NotJson.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"


class NotJson(ValueError):
    """The text at this position cannot be the JSON the parser expects."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] is '"': the index after the closing quote, or None if the text ends first."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None if the text ends first. A
    number / literal at the very end of the text counts as unfinished (it may go on)."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if c in "}],:":
        raise NotJson(f"unexpected {c!r} at {i}")
    j = i
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


@dataclass
class Member:
    """One member of a JSON object: its value's raw text is text[start:end] (end None: the
    value is still growing, text[start:] is a prefix of it)."""

    start: int
    end: int | None


def object_members(text: str, i: int) -> tuple[dict[str, Member], int | None]:
    """Scan the object starting at text[i] == '{'. Returns (members by decoded key, index
    after the closing brace or None if the text ends first). Raises NotJson."""
    if i >= len(text) or text[i] != "{":
        raise NotJson(f"expected an object at {i}")
    members: dict[str, Member] = {}
    j = skip_ws(text, i + 1)
    while j < len(text):
        c = text[j]
        if c == "}":
            return members, j + 1
        if c == ",":
            j = skip_ws(text, j + 1)
            continue
        if c != '"':
            raise NotJson(f"expected a key at {j}")
        key_end = string_end(text, j)
        if key_end is None:
            return members, None
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return members, None
        if text[j] != ":":
            raise NotJson(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end = value_end(text, j)
        members[key] = Member(j, end)
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None
