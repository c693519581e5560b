"""StructuredOutputsParams -> a compiled llguidance grammar, cached by the grammar's text.

The grammar engine is llguidance (PyPI `llguidance`, the engine behind vLLM's `guidance`
backend). It was chosen over xgrammar after `benchmarks/grammar_engines.py` (result in
`benchmarks/results/grammar-engines-smollm2-cpu-*.json`): both compute a 49k-vocabulary mask in
well under a millisecond per sequence (xgrammar faster, neither close to a decode step), but
llguidance refuses the JSON-schema keywords it cannot enforce (`uniqueItems`, `not`,
`if/then/else`) with an error that we pass on as a 400, where xgrammar silently accepted
documents that violate `allOf`, `uniqueItems`, `not` and `if/then/else`; it has no
dependencies (xgrammar pulls triton and apache-tvm-ffi); and it reads Lark grammars and regexes
natively (vLLM's `grammar` and `regex` options).

Grammar texts (llguidance's JSON grammar format, built by `LLMatcher.grammar_from_*`):
json -> `grammar_from_json_schema` (whitespace per `StructuredOutputsParams`), json_object ->
the schema {"type": "object"}, regex -> `grammar_from_regex`, choice -> the Lark rule
`start: "a" | "b"` (JSON string literals), grammar -> Lark (GBNF converted by llguidance's
`gbnf_to_lark`). llguidance writes object properties in the order the schema lists them.

llguidance builds a grammar's lexer lazily, under a per-step budget ("fuel"): a regex too large
for it (`b{999999}`, also inside a schema `pattern` or a Lark terminal) passes validation and
compiles, and only fails on the first token it has to lex ("lexer error: too many expressions
constructed"). `GrammarCompiler.compile` therefore walks a copy of each new grammar's matcher
over its first token (`first_steps_error`), so such a constraint is a 400 when the request
arrives; a grammar that exhausts the budget only later fails its request in the engine
(`StructuredOutputManager.accept`), never passing off a cut output as complete.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from ferrum.errors import InvalidRequestError
from ferrum.structured_output.json_schema import (SUBSCHEMA_KEYS, SUBSCHEMA_LIST_KEYS, SUBSCHEMA_MAP_KEYS,
                                                  closed_objects)
from ferrum.structured_output.params import StructuredOutputsParams

# JSON written on one line with Python's default separators: the model may not add whitespace.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (JSON text) for `params`. Raises InvalidRequestError (param
    `params.param_name()`) for a grammar llguidance's front-ends cannot read (bad GBNF,
    non-JSON schema)."""
    kind, p = params.kind(), params.param_name()
    lark = None
    if kind == "grammar":
        try:
            lark = any_to_lark(params.grammar)
        except Exception as e:   # the GBNF converter raises a plain Exception for a missing rule
            raise InvalidRequestError(f"{p}: invalid grammar: {e}", param=p) from e
    try:
        if kind in ("json", "json_object"):
            # a schema's objects closed as vLLM's default backend closes them (xgrammar's
            # strict_mode): a small model otherwise adds properties no client expects
            schema = (closed_objects(without_noops(params.json), every_object=False) if kind == "json"
                      else {"type": "object"})
            if params.whitespace_pattern is not None:
                options = {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
            elif params.disable_any_whitespace:
                options = _COMPACT_JSON
            else:
                options = {"whitespace_flexible": True}
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(_lark_literal(c) for c in params.choice))
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{p}: invalid {kind}: {e}", param=p) from e


def without_noops(schema):
    """A copy of a JSON schema without the keywords that constrain nothing but that llguidance
    refuses as unimplemented (a 400 for a schema it can enforce exactly): `uniqueItems: false`
    (OpenAPI and Jackson generators write it) and a `propertyNames` every key satisfies ({},
    true, {"type": "string"}: zod writes the last for records). Other values of these keywords
    are left for llguidance to refuse."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if (key == "uniqueItems" and value is False) or (
                key == "propertyNames" and (value is True or value in ({}, {"type": "string"}))):
            continue
        if key in SUBSCHEMA_KEYS:
            value = without_noops(value)
        elif key in SUBSCHEMA_LIST_KEYS and isinstance(value, list):
            value = [without_noops(v) for v in value]
        elif key in SUBSCHEMA_MAP_KEYS and isinstance(value, dict):
            value = {name: without_noops(v) for name, v in value.items()}
        out[key] = value
    return out


def _lark_literal(text: str) -> str:
    """A Lark string literal that matches exactly `text`: JSON's escaping, which llguidance's
    Lark lexer reads, except that JSON leaves DEL (U+007F) raw and that lexer refuses a raw DEL
    (a choice holding one was a 400 "lexer error"); escaped, it is an ordinary character."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def check_json_schema(schema, param: str, enforced: bool = True) -> None:
    """Raise InvalidRequestError (param `param`) unless `schema` is a valid JSON schema
    (type names, `properties` an object, `required` a list, `$ref`s that resolve, ...) and,
    with `enforced`, one llguidance can enforce (no `uniqueItems`, `not`, `if`/`then`, unknown
    `format`): the check `GrammarCompiler.compile` makes, without a tokenizer (well under a
    millisecond). enforced=False (llguidance's lenient mode) passes keywords it cannot enforce,
    for a schema nothing is decoded against (a tool under tool_choice auto)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{param}: must be a JSON schema object", param=param)
    options = {**_COMPACT_JSON, "lenient": not enforced}
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(without_noops(schema)),
                                                             defaults=options)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{param}: invalid JSON schema: {e}", param=param) from e
    error = llguidance.LLMatcher.validate_grammar(text, None)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"{param}: not a JSON schema ferrum can "
                                  f"{'enforce' if enforced else 'read'}: {error.strip()}", param=param)


def first_steps_error(prototype: "llguidance.LLMatcher", eos_token_ids: list[int]) -> str | None:
    """The error a copy of `prototype` (a matcher in its start state) runs into over its first
    step: the first mask, consuming the lowest allowed token id that is not EOS, the next
    mask (a few milliseconds for a usual grammar; about a second for a 100,000-fold regex
    repetition that llguidance can lex). None when the grammar takes that step, or allows
    only EOS (or nothing) at once."""
    m = prototype.deep_copy()
    bits = m.compute_bitmask()        # bit j of byte i allows token 8 * i + j
    if m.is_error():
        return m.get_error()
    eos = set(eos_token_ids)
    token = next((8 * i + j for i, byte in enumerate(bits) if byte for j in range(8)
                  if byte >> j & 1 and 8 * i + j not in eos), None)
    if token is None:
        return None
    if not m.consume_token(token):
        return m.get_error() or f"its first allowed token {token} is rejected"
    m.compute_bitmask()
    return m.get_error() if m.is_error() else None


class _TextVocab:
    """What `llguidance.TokenizerWrapper` reads: the vocabulary of an llguidance tokenizer
    (`base`) and an encoder that takes str only (llguidance then encodes a string's valid
    UTF-8 prefix with it and the rest greedily) and encodes special-token strings as text."""

    def __init__(self, base, encoder):
        self.eos_token_id, self.bos_token_id = base.eos_token, None
        self.tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        self.special_token_ids = [i for i in range(base.vocab_size) if base.is_special_token(i)]
        self._encoder = encoder

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return self._encoder.encode(text, add_special_tokens=False).ids


def text_tokenizer(hf_tokenizer, vocab_size: int, eos_token) -> "llguidance.LLTokenizer":
    """llguidance's tokenizer for `hf_tokenizer`: `llguidance.hf.from_tokenizer`'s token bytes
    and special ids, but its encoder does not parse special tokens. llguidance encodes the text
    a grammar forces to find the tokens it allows; through the tokenizers library a forced
    "<|im_end|>" (a regex, a choice, a schema `const`) became the special token, which the mask
    allowed and the matcher then rejected (a 500 in the middle of the request)."""
    from tokenizers import Tokenizer as RustTokenizer
    base = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token)
    encoder = RustTokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    encoder.no_padding()
    encoder.no_truncation()
    encoder.encode_special_tokens = True     # special-token strings are text
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextVocab(base, encoder)),
                                  n_vocab=vocab_size, eos_token=eos_token)


class CompiledGrammar:
    """A compiled grammar: a matcher in its start state, copied for each sequence (a copy
    costs microseconds; compiling costs milliseconds to seconds)."""

    def __init__(self, prototype: "llguidance.LLMatcher"):
        self._prototype = prototype

    def matcher(self) -> "llguidance.LLMatcher":
        """A fresh matcher in the start state, owned by one sequence."""
        return self._prototype.deep_copy()


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; keeps the last `cache_size`
    compiled grammars, keyed by their grammar text. Thread-safe.

    hf_tokenizer: a transformers tokenizer; vocab_size: the logits' width V (it may exceed the
    tokenizer's length: ids past it are never allowed); eos_token_ids: ids that end a
    sequence (allowed exactly where the grammar may end).
    Building the llguidance tokenizer (`text_tokenizer`) walks the vocabulary twice (about 1.5 s
    for 49k tokens on the 2-core dev box).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self.tokenizer = text_tokenizer(hf_tokenizer, vocab_size, list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Raises InvalidRequestError naming `params.param_name()` when the schema / regex /
        grammar is invalid, uses something llguidance does not implement, or fails on its
        first token (`first_steps_error`: too large for llguidance's lexer); the message says
        what."""
        text, p = grammar_text(params), params.param_name()
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"{p}: cannot use this {params.kind()}: {error.strip()}",
                                      param=p)
        prototype = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        error = (prototype.get_error() if prototype.is_error()
                 else first_steps_error(prototype, self.eos_token_ids))
        if error:
            raise InvalidRequestError(f"{p}: cannot use this {params.kind()}: "
                                      f"{_without_state(error)}", param=p)
        compiled = CompiledGrammar(prototype)
        with self._lock:
            self._cache[text] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def _without_state(error: str) -> str:
    """llguidance's error without the matcher state it appends (<state>... lines)."""
    return error.strip().split("\n<state>")[0].strip()
