"""Compare the two grammar engines on PyPI that vLLM uses, xgrammar and llguidance, on what
ferrum needs from one: per-step token-mask time on SmolLM2's 49,152-token vocabulary, grammar
compile time, and which JSON-schema keywords each compiles and enforces.

    pip install xgrammar llguidance jsonschema
    python benchmarks/grammar_engines.py [--tokenizer DIR] [--out benchmarks/results/grammar-engines.json]

`--tokenizer`: a Hugging Face tokenizer folder (default: SmolLM2's, converted from the GGUF in
the ferrum model store). Mask time is measured while a matcher walks a fixed valid JSON
document token by token (the same walk for both engines), one mask per token, batch 1 and a
batch of 32 matchers filled together (llguidance: `fill_next_token_bitmask_par`; xgrammar:
`BatchGrammarMatcher`); medians over repeats, since the machine may be shared. Both engines get
the separators ferrum uses (", " and ": ", no other whitespace).

Coverage: each schema in `COVERAGE` is compiled; a keyword counts as enforced when the engine
accepts a conforming document and rejects a violating one (fed token by token, greedily
tokenized by the tokenizer), and as "not enforced" when the violating one is accepted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string"}}, "required": ["street", "city"]},
        "status": {"enum": ["active", "inactive", "banned"]},
    },
    "required": ["name", "age", "tags", "address", "status"],
}
DOC = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", '
       '"poetry", "engines"], "address": {"street": "12 St James Square", "city": "London", '
       '"zip": "SW1Y"}, "status": "active"}')

# (keyword, schema, a conforming document, a violating document)
COVERAGE = [
    ("type+required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     '{"a": 1}', '{}'),
    ("enum", {"enum": ["x", "y"]}, '"x"', '"z"'),
    ("const", {"const": "k"}, '"k"', '"j"'),
    ("minimum/maximum", {"type": "integer", "minimum": 3, "maximum": 7}, '5', '9'),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, '0.5', '0'),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    ("pattern", {"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"abd"'),
    ("format: date", {"type": "string", "format": "date"}, '"2024-01-31"', '"yesterday"'),
    ("format: email", {"type": "string", "format": "email"}, '"a@b.co"', '"nope"'),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     '[1]', '[1, 2, 3]'),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, '[1, "a"]', '["a", 1]'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '[1, 2]', '[1, 1]'),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     '{"q": 1}', '{"q": "s"}'),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"s"', 'true'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 'true', '"s"'),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     '{"a": 1, "b": 2}', '{"a": 1}'),
    ("$ref/$defs", {"$defs": {"n": {"type": "integer"}}, "type": "object",
                    "properties": {"v": {"$ref": "#/$defs/n"}}, "required": ["v"]}, '{"v": 3}', '{"v": "3"}'),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["kids"],
        "additionalProperties": False}}, "$ref": "#/$defs/node"},
     '{"kids": [{"kids": []}]}', '{"kids": [{}]}'),
    ("type list", {"type": ["integer", "null"]}, 'null', '"s"'),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                           "additionalProperties": False}, '{"x1": 1}', '{"y": 1}'),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, '10', '7'),
    ("minProperties", {"type": "object", "minProperties": 1}, '{"a": 1}', '{}'),
    ("not", {"not": {"type": "string"}}, '1', '"s"'),
    ("if/then/else", {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
     '1', '-1'),
]


def _git_head() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_tokenizer(folder: str | None):
    if folder:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(folder)
    from ferrum.model_store import pull
    from ferrum.tokenizer import Tokenizer
    return Tokenizer.from_gguf(pull("smollm2", progress=False)).hf


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.vocab = vocab
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        err = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if err and not err.startswith("WARNING"):
            raise ValueError(err)
        return grammar

    def matcher(self, grammar):
        return self.ll.LLMatcher(self.tok, grammar, log_level=0)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, mask, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, mask, row)

    def fill_batch(self, matchers, mask) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepts_eos(self, matcher) -> bool:
        return matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.vocab = vocab
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(", ", ": "))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matcher, mask, row: int) -> None:
        matcher.fill_next_token_bitmask(mask, row)

    def fill_batch(self, matchers, mask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepts_eos(self, matcher) -> bool:
        return matcher.is_completed() if hasattr(matcher, "is_completed") else matcher.is_terminated()


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 4)


def mask_times(engine, tokens: list[int], repeats: int) -> dict:
    grammar = engine.compile(SCHEMA)
    one = engine.bitmask(1)
    per_step_1, per_step_32 = [], []
    for _ in range(repeats):
        m = engine.matcher(grammar)
        for t in tokens:
            t0 = time.perf_counter()
            engine.fill(m, one, 0)
            per_step_1.append(time.perf_counter() - t0)
            assert engine.accept(m, t), f"{engine.name} rejected a token of the valid document"
        ms = [engine.matcher(grammar) for _ in range(32)]
        many = engine.bitmask(32)
        for t in tokens:
            t0 = time.perf_counter()
            engine.fill_batch(ms, many)
            per_step_32.append(time.perf_counter() - t0)
            for m in ms:
                engine.accept(m, t)
    return {"mask_ms_batch1_median": _median_ms(per_step_1),
            "mask_ms_batch1_p90": round(1000 * sorted(per_step_1)[int(0.9 * len(per_step_1))], 4),
            "mask_ms_batch32_median": _median_ms(per_step_32),
            "steps": len(tokens), "repeats": repeats}


def compile_times(engine, repeats: int) -> dict:
    samples = []
    for i in range(repeats):  # a fresh schema text each time, so no cache answers
        s = json.loads(json.dumps(SCHEMA))
        s["properties"][f"extra_{i}"] = {"type": "string"}
        t0 = time.perf_counter()
        engine.matcher(engine.compile(s))
        samples.append(time.perf_counter() - t0)
    return {"compile_ms_median": _median_ms(samples)}


def coverage(engine, hf) -> dict:
    out = {}
    for key, schema, good, bad in COVERAGE:
        try:
            grammar = engine.compile(schema)
            engine.matcher(grammar)
        except Exception as e:  # noqa: BLE001 - an engine error is the result being recorded
            out[key] = f"compile error: {str(e).splitlines()[0][:120]}"
            continue

        def accepts(doc: str) -> bool:
            m = engine.matcher(grammar)
            return all(engine.accept(m, t) for t in hf.encode(doc, add_special_tokens=False)) \
                and engine.accepts_eos(m)
        ok, rejected = accepts(good), not accepts(bad)
        out[key] = ("enforced" if ok and rejected else
                    "not enforced (violating document accepted)" if ok else
                    "rejects a conforming document")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hf = load_tokenizer(args.tokenizer)
    vocab = len(hf)
    tokens = hf.encode(DOC, add_special_tokens=False)
    results = {}
    for cls in (LLGuidance, XGrammar):
        t0 = time.perf_counter()
        engine = cls(hf, vocab)
        init_s = time.perf_counter() - t0
        r = {"tokenizer_init_s": round(init_s, 3)}
        r.update(compile_times(engine, args.repeats))
        r.update(mask_times(engine, tokens, args.repeats))
        r["coverage"] = coverage(engine, hf)
        r["enforced"] = sum(v == "enforced" for v in r["coverage"].values())
        results[cls.name] = r
        print(cls.name, json.dumps({k: v for k, v in r.items() if k != "coverage"}), flush=True)
    import importlib.metadata as im
    report = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "commit": _git_head(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared)",
        "versions": {p: im.version(p) for p in ("llguidance", "xgrammar", "torch")},
        "vocab_size": vocab, "document_tokens": len(tokens), "results": results,
        "keywords": len(COVERAGE),
    }
    for name, r in results.items():
        print(f"\n{name}: enforced {r['enforced']}/{len(COVERAGE)}")
        for k, v in r["coverage"].items():
            if v != "enforced":
                print(f"  {k}: {v}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
