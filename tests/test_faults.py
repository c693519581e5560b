"""No request can take the engine down (issue 13 item 1).

A fault is injected into one request's forward pass (a pre-hook on the model raises, after
layer 0 already wrote its K/V, in any step whose input ids hold a poison token), into the
sampler, the scheduler or one request's stop checks. Only the requests of the failing step
fail (finish_reason "error", `RequestOutput.error`, blocks freed); the others finish with the
tokens they give alone, later requests are served, and every KV block comes back. A device
fault or a broken TP executor is the one kind that stops the engine, and /health says why.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.engine.async_engine import AsyncLLMEngine
from ferrum.entrypoints.openai.server import build_app
from ferrum.errors import ConfigError, TensorParallelError
from tiny_models import make_tiny_model

VOCAB = 128
POISON = 99          # a prompt holding this id makes the forward raise
MAX_POS = 512


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("faults")), "llama", vocab=VOCAB,
                           max_pos=MAX_POS, seed=5)


def greedy(n: int) -> SamplingParams:
    # the poison id is never generated, so only a prompt can carry it into a step
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias={POISON: -100})


def poison(model, token_id: int = POISON, error=RuntimeError) -> list:
    """Make `model`'s forward raise `error` in layer 1 (layer 0 has written its K/V by then)
    whenever the step's input ids hold `token_id`. Returns the hook handles."""
    seen = [False]

    def on_embed(module, args):
        seen[0] = bool((args[0] == token_id).any())

    def on_layer1(module, args):
        if seen[0]:
            raise error(f"injected fault: token {token_id} in the step")
    return [model.model.embed_tokens.register_forward_pre_hook(on_embed),
            model.model.layers[1].register_forward_pre_hook(on_layer1)]


def drained(eng) -> None:
    """Nothing left behind: no request, no sequence, every KV block free."""
    bm = eng.block_manager
    bm.check_invariants()
    assert not eng.requests and not eng.scheduler.running and not eng.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks
    st = eng.executor.status()
    assert st.running_sequences == 0


def run_all(eng) -> dict:
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [20, 21, 22], "d": [30, 31, 32, 33, 34],
           "e": [40, 41, 42, 43]}


@pytest.fixture(scope="module")
def reference(folder):
    with LLM(folder, progress=False, max_model_len=256) as llm:
        outs = llm.generate(list(PROMPTS.values()), greedy(12), use_tqdm=False)
    return {k: o.outputs[0].token_ids for k, o in zip(PROMPTS, outs)}


# ---- (a) max_model_len beyond the model's positions -----------------------------------------

def test_max_model_len_above_the_models_positions_is_refused(folder):
    """Before: accepted, and a prompt past position 512 raised IndexError in the RoPE table
    inside the step, which killed the engine."""
    with pytest.raises(ConfigError, match=rf"max_model_len 600 exceeds the model's context of {MAX_POS}") as e:
        LLM(folder, progress=False, max_model_len=600)
    assert e.value.param == "max_model_len"
    with pytest.raises(ConfigError, match="positive"):
        LLM(folder, progress=False, max_model_len=0)
    with LLM(folder, progress=False, max_model_len=MAX_POS) as llm:   # the limit itself is fine
        out = llm.generate([[5] * (MAX_POS - 3)], greedy(2), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2


def test_smollm2_max_model_len_8300_is_refused(smollm2_gguf_path):
    with pytest.raises(ConfigError, match="8300 exceeds the model's context of 8192"):
        LLM(smollm2_gguf_path, progress=False, max_model_len=8300)


# ---- (b) a fault in a step fails that step's requests only --------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fault_in_a_forward_fails_only_the_requests_of_that_step(folder, reference, async_scheduling):
    """a and b decode while the poisoned prompt p is prefilled in the same step: the three
    fail; d waits (max_num_seqs=3) and e comes later: both give their tokens alone."""
    llm = LLM(folder, progress=False, max_model_len=256, max_num_seqs=3,
              async_scheduling=async_scheduling)
    eng = llm.engine
    poison(eng.executor.runner.model)
    eng.add_request("a", None, greedy(12), prompt_token_ids=PROMPTS["a"])
    eng.add_request("b", None, greedy(12), prompt_token_ids=PROMPTS["b"])
    eng.step()
    eng.step()                                     # a and b are decoding now
    eng.add_request("p", None, greedy(12), prompt_token_ids=[3, POISON, 4])
    eng.add_request("d", None, greedy(12), prompt_token_ids=PROMPTS["d"])
    finals = run_all(eng)
    for rid in ("a", "b", "p"):
        out = finals[rid]
        assert out.finished and out.outputs[0].finish_reason == "error", (rid, out)
        assert "injected fault" in out.error
        assert len(out.outputs[0].token_ids) < 12
    assert finals["d"].error is None and finals["d"].outputs[0].token_ids == reference["d"]
    assert eng.stats["requests_failed"] == 3
    drained(eng)
    # the engine goes on: a later request, and a again, give their tokens alone
    eng.add_request("e", None, greedy(12), prompt_token_ids=PROMPTS["e"])
    eng.add_request("a2", None, greedy(12), prompt_token_ids=PROMPTS["a"])
    finals = run_all(eng)
    assert finals["e"].outputs[0].token_ids == reference["e"]
    assert finals["a2"].outputs[0].token_ids == reference["a"]
    drained(eng)
    llm.shutdown()


def test_offline_generate_returns_error_outputs_and_goes_on(folder, reference):
    with LLM(folder, progress=False, max_model_len=256, max_num_seqs=1) as llm:
        poison(llm.engine.executor.runner.model)
        outs = llm.generate([PROMPTS["a"], [POISON, 3], PROMPTS["b"]], greedy(12), use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
        assert outs[1].error.startswith("RuntimeError: injected fault")
        assert outs[0].outputs[0].token_ids == reference["a"]
        assert outs[2].outputs[0].token_ids == reference["b"]
        drained(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fault_in_the_sampler_or_scheduler(folder, reference, async_scheduling):
    llm = LLM(folder, progress=False, max_model_len=256, async_scheduling=async_scheduling)
    eng = llm.engine
    real_sampler, real_schedule = eng.sampler, eng.scheduler.schedule
    faults = {"sampler": 0, "schedule": 0}

    def sampler(logits, md):
        if faults["sampler"]:
            faults["sampler"] -= 1
            raise ValueError("injected sampler fault")
        return real_sampler(logits, md)

    def schedule():
        if faults["schedule"]:
            faults["schedule"] -= 1
            raise KeyError("injected scheduler fault")
        return real_schedule()
    eng.sampler, eng.scheduler.schedule = sampler, schedule
    for kind in ("sampler", "schedule"):
        eng.add_request("a", None, greedy(12), prompt_token_ids=PROMPTS["a"])
        eng.add_request("b", None, greedy(12), prompt_token_ids=PROMPTS["b"])
        eng.step()
        eng.step()
        faults[kind] = 1
        finals = run_all(eng)
        assert {k: o.outputs[0].finish_reason for k, o in finals.items()} == {"a": "error", "b": "error"}
        assert f"injected {'scheduler' if kind == 'schedule' else kind} fault" in finals["a"].error
        drained(eng)
        eng.add_request("d", None, greedy(12), prompt_token_ids=PROMPTS["d"])
        assert run_all(eng)["d"].outputs[0].token_ids == reference["d"]
    llm.shutdown()


def test_fault_in_one_requests_stop_checks_fails_it_alone(folder, reference):
    """Processing a step's samples (stop checks, detokenizer) fails per request: b, in the
    same step as a, finishes normally."""
    with LLM(folder, progress=False, max_model_len=256) as llm:
        eng = llm.engine
        eng.add_request("a", None, greedy(12), prompt_token_ids=PROMPTS["a"])
        eng.add_request("b", None, greedy(12), prompt_token_ids=PROMPTS["b"])
        eng.step()
        state = eng.requests["a"].seqs[0].output_state

        def append(tok):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        state.append = append
        finals = run_all(eng)
        assert finals["a"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in finals["a"].error
        assert finals["b"].error is None and finals["b"].outputs[0].token_ids == reference["b"]
        drained(eng)


def test_device_fault_stops_the_engine_with_the_reason(folder):
    """A sticky device error (CUDA illegal memory access) leaves nothing to serve with: the
    step raises, and every later step says why without touching the device."""
    llm = LLM(folder, progress=False, max_model_len=256)
    eng = llm.engine
    poison(eng.executor.runner.model, error=torch.AcceleratorError)
    with pytest.raises(torch.AcceleratorError, match="injected fault"):
        llm.generate([[POISON, 3]], greedy(4), use_tqdm=False)
    assert "the device failed: AcceleratorError: injected fault" in eng.health()
    with pytest.raises(Exception, match="the executor is broken"):
        llm.generate([[5, 6]], greedy(4), use_tqdm=False)
    llm.shutdown()


# ---- the server -------------------------------------------------------------------------------

def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ferrum")


def _sse_events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_server_survives_a_faulting_request(folder, reference):
    """Poisoned requests (plain and streamed) get an OpenAI error body / an SSE error event;
    a request running beside them in another step is untouched; later requests are served,
    every block is free and /health stays 200."""
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.config import EngineConfig
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=folder, device="cpu", max_model_len=256),
                                      progress=False))
    poison(engine.engine.executor.runner.model)
    app = build_app(engine, ["tiny"])
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(POISON): -100}}

    async def go():
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={**body, "prompt": [3, POISON, 4]})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "internal_error" and "injected fault" in err["message"]
            r = await c.post("/v1/completions", json={**body, "prompt": [3, POISON, 4], "stream": True})
            events = _sse_events(r.text)
            assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
            # two prompts in one request: the poisoned one fails the whole request, the other
            # is aborted (its blocks come back)
            r = await c.post("/v1/completions", json={**body, "prompt": [PROMPTS["a"], [POISON]]})
            assert r.status_code == 500
            assert (await c.get("/health")).json() == {"status": "ok"}
            r = await c.post("/v1/completions", json={**body, "prompt": PROMPTS["d"], "logprobs": 0})
            assert r.status_code == 200
            assert r.json()["choices"][0]["finish_reason"] == "length"
            for _ in range(100):   # an aborted request's blocks are freed between steps
                s = (await c.get("/status")).json()
                if s["kv_blocks_free"] == s["kv_blocks_total"] and not s["num_running"]:
                    break
                await asyncio.sleep(0.02)
            assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["requests_failed"] >= 3
            return r.json()["choices"][0]["logprobs"]["tokens"]   # "token_id:N" (no tokenizer)
    try:
        tokens = asyncio.run(go())
    finally:
        engine.shutdown()
    assert tokens == [f"token_id:{t}" for t in reference["d"]]


def test_server_reports_a_broken_executor_on_health(folder):
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.config import EngineConfig
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=folder, device="cpu", max_model_len=256),
                                      progress=False))
    poison(engine.engine.executor.runner.model, error=torch.AcceleratorError)
    app = build_app(engine, ["tiny"])

    async def go():
        async with _client(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [POISON], "max_tokens": 2})
            assert r.status_code == 500
            h = await c.get("/health")
            assert h.status_code == 503 and "the device failed" in h.json()["error"]
    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


# ---- tensor parallelism -------------------------------------------------------------------------

def ctrl_c_in_forward(model, times: int) -> list:
    """Send this process `times` SIGINTs from inside the next forward (layer 1). Returns the
    hook handle."""
    left = [times]

    def on_layer1(module, args):
        while left[0]:
            left[0] -= 1
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)      # Python runs the handler between these ops
    return model.model.layers[1].register_forward_pre_hook(on_layer1)


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this process, as in a terminal. A shell that starts
    pytest in the background (`cmd &`, nohup) leaves SIGINT ignored, and Python then installs
    no handler: the SIGINTs sent here were lost, and the test failed with "DID NOT RAISE"."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_tp_fault_outside_the_forward_keeps_the_ranks_in_step(folder, reference, sigint_raises):
    """A fault on rank 0 after the forward (sampler, stop checks) fails the step's requests;
    the ranks never left step, so the TP engine goes on and matches TP=1. So does a Ctrl-C
    inside rank 0's forward: it is held until the step ends on every rank (before, it left
    rank 1 inside the step: every later request failed with "the tensor-parallel executor is
    shut down" while health() said all was well, and rank 1 died of a gloo timeout 30 s
    later). A SIGTERM or SIGINT sent to rank 1 leaves it serving. A second Ctrl-C within the
    step breaks the executor, and health() says so."""
    with LLM(folder, progress=False, max_model_len=256, tensor_parallel_size=2) as llm:
        eng = llm.engine
        real, left = eng.sampler, [1]

        def sampler(logits, md):
            if left[0]:
                left[0] -= 1
                raise ValueError("injected sampler fault")
            return real(logits, md)
        eng.sampler = sampler
        outs = llm.generate([PROMPTS["a"]], greedy(12), use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error"
        assert eng.health() is None
        outs = llm.generate([PROMPTS["b"], PROMPTS["e"]], greedy(12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference["b"], reference["e"]]
        drained(eng)

        hook = ctrl_c_in_forward(eng.executor.runner.model, 1)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPTS["a"]], greedy(12), use_tqdm=False)
        hook.remove()
        assert eng.health() is None
        outs = llm.generate([PROMPTS["b"], PROMPTS["e"]], greedy(12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [reference["b"], reference["e"]]
        drained(eng)

        # SIGTERM / Ctrl-C reach every rank at once (systemd's unit, a terminal's process
        # group, torchrun): rank 1 leaves stopping to rank 0 (before, it died of them and broke
        # the requests rank 0 was still draining)
        procs = list(eng.executor.procs)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(procs[0].pid, sig)
        time.sleep(0.3)
        outs = llm.generate([PROMPTS["b"]], greedy(12), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == reference["b"] and procs[0].poll() is None

        ctrl_c_in_forward(eng.executor.runner.model, 2)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([PROMPTS["a"]], greedy(12), use_tqdm=False)
        assert "interrupted (Ctrl-C)" in eng.health()
        assert all(p.poll() is not None for p in procs)   # stopped at once, not left to time out


def test_tp_fault_inside_rank0s_forward_breaks_the_executor_with_the_reason(folder):
    """The other rank waits in the step's collectives: the ranks are out of step, so the
    executor is declared broken, its workers are stopped, and health() says why."""
    llm = LLM(folder, progress=False, max_model_len=256, tensor_parallel_size=2)
    ex = llm.engine.executor
    poison(ex.runner.model)
    with pytest.raises(TensorParallelError, match="injected fault"):
        llm.generate([[POISON, 3]], greedy(4), use_tqdm=False)
    assert "injected fault" in llm.engine.health()
    assert all(p.poll() is not None for p in ex.procs)
    llm.shutdown()


def test_run_says_a_failed_reply_failed(folder, reference):
    """`ferrum run` (its stream loop) must not print a failed request's partial text as if it
    were the answer: it raises RequestFailedError (the CLI prints it and exits 1), and the
    engine answers the next prompt."""
    import io

    from ferrum.entrypoints.run import stream
    from ferrum.errors import RequestFailedError
    with LLM(folder, progress=False, max_model_len=256) as llm:
        poison(llm.engine.executor.runner.model)
        with pytest.raises(RequestFailedError, match="injected fault"):
            stream(llm.engine, [POISON, 3], greedy(4), out=io.StringIO(), stats=False)
        drained(llm.engine)
        out = llm.generate([PROMPTS["b"]], greedy(12), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference["b"]
