"""AsyncLLMEngine (step thread, streams, aborts, engine death) and the server app in-process
(httpx ASGITransport): engine failure -> 500 + /health 503, queue full -> 503 + Retry-After,
a model without a chat template -> 400. A tiny random Llama carries the SmolLM2 tokenizer."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from ferrum.config import EngineConfig
from ferrum.engine.async_engine import AsyncLLMEngine
from ferrum.engine.llm_engine import LLMEngine
from ferrum.entrypoints.openai.server import build_app
from ferrum.errors import EngineDeadError, InvalidRequestError, ServerShuttingDownError
from ferrum.sampling_params import SamplingParams
from tiny_models import make_tiny_model

PROMPT = [5, 17, 300, 4000, 21, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    folder = str(tmp_path_factory.mktemp("tiny_chat"))
    make_tiny_model(folder, "llama", vocab=49152, hidden=64, layers=2, max_pos=512)
    smollm2_tokenizer.hf.save_pretrained(folder)
    return folder


@pytest.fixture
def engine(model_dir):
    """A fresh AsyncLLMEngine per test (tests kill or block it)."""
    eng = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=model_dir, device="cpu", max_model_len=256,
                                                 num_kv_blocks=64, max_waiting=2), progress=False))
    yield eng
    eng.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _collect(stream):
    return [o async for o in stream]


def _hold_steps(engine) -> tuple[threading.Event, threading.Event]:
    """Make each engine step wait for `gate` (set it to let steps run); `in_step` is set once a
    step is waiting."""
    gate, in_step = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def step():
        in_step.set()
        gate.wait()
        return real_step()
    engine.engine.step = step
    return gate, in_step


def test_stream_outputs_match_offline_engine(engine, model_dir):
    async def go():
        return await _collect(await engine.add_request("a", None, greedy(8), prompt_token_ids=PROMPT))
    outs = asyncio.run(go())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == 8 and final.finish_reason == "length"
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert sum(o.outputs[0].num_delta_tokens for o in outs) == 8
    # Same greedy ids as driving an LLMEngine directly.
    ref = LLMEngine(EngineConfig.from_kwargs(model=model_dir, device="cpu", max_model_len=256, num_kv_blocks=64),
                    progress=False)
    ref.add_request("r", None, greedy(8), prompt_token_ids=PROMPT)
    last = None
    while ref.has_unfinished_requests():
        last = ref.step() or last
    assert last[0].outputs[0].token_ids == final.token_ids


def test_bad_words_tokenize_off_the_engine_thread(engine, monkeypatch):
    """A long bad_words list (20,000 words: ~0.7 s) tokenized on the engine thread stalled every
    open stream meanwhile: add_request tokenizes it in a worker thread first, and the engine
    thread finds it in the tokenizer's cache."""
    hf = engine.engine.tokenizer.hf
    batch_encode, threads = type(hf).__call__, []

    def recorded(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return batch_encode(self, *args, **kwargs)
    monkeypatch.setattr(type(hf), "__call__", recorded)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, bad_words=["tokenize me", "elsewhere"])

    async def go():
        return await _collect(await engine.add_request("bw", None, params, prompt_token_ids=PROMPT))
    assert asyncio.run(go())[-1].finished
    assert threads and "ferrum-engine" not in threads


def test_add_request_errors_propagate(engine):
    async def go(**kw):
        return await engine.add_request("bad", None, greedy(4), **kw)
    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(go(prompt_token_ids=[]))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        asyncio.run(go(prompt_token_ids=[10**6]))
    assert engine.status()["healthy"]


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine):
    start = engine.status()["kv_blocks_free"]

    async def go():
        stream = await engine.add_request("x", None, greedy(200), prompt_token_ids=PROMPT * 10)
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        for _ in range(200):  # the engine thread frees the blocks before its next step
            await asyncio.sleep(0.02)
            s = engine.status()
            if s["num_running"] == 0 and s["kv_blocks_free"] == start:
                return s
        return engine.status()
    s = asyncio.run(go())
    assert s["kv_blocks_free"] == start and s["requests_aborted"] == 1


def test_abort_ends_the_stream(engine):
    async def go():
        stream = await engine.add_request("y", None, greedy(200), prompt_token_ids=PROMPT)
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                engine.abort("y")
        return outs
    outs = asyncio.run(go())
    assert 2 <= len(outs) < 200 and not outs[-1].finished


def _fail_after(eng: AsyncLLMEngine, n_ok: int) -> None:
    real_step, calls = eng.engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] > n_ok:
            raise RuntimeError("boom: executor failed")
        return real_step()
    eng.engine.step = step


def test_engine_failure_kills_streams_and_new_requests(engine):
    _fail_after(engine, 2)

    async def go():
        stream = await engine.add_request("z", None, greedy(50), prompt_token_ids=PROMPT)
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(stream)
        with pytest.raises(EngineDeadError):
            await engine.add_request("w", None, greedy(5), prompt_token_ids=PROMPT)
    asyncio.run(go())
    s = engine.status()
    assert s["healthy"] is False and "boom" in s["error"]


def test_stop_ends_open_streams_and_new_requests_with_its_error(engine):
    """stop(error): what a draining server does once its --shutdown-timeout ran out."""
    async def go():
        stream = await engine.add_request("s", None, greedy(200), prompt_token_ids=PROMPT)
        outs = []
        with pytest.raises(ServerShuttingDownError, match="drain over"):
            async for out in stream:
                outs.append(out)
                if len(outs) == 2:
                    engine.stop(ServerShuttingDownError("drain over"))
        with pytest.raises(ServerShuttingDownError, match="drain over"):
            await engine.add_request("t", None, greedy(5), prompt_token_ids=PROMPT)
        return outs
    outs = asyncio.run(go())
    assert 2 <= len(outs) < 200 and not outs[-1].finished
    assert engine.status()["error"] == "drain over"


def test_stop_during_a_long_step_ends_streams_without_waiting_for_it(engine):
    """A step that outlasts the server's drain margin (a long CPU prefill): stop(error) ends
    the open streams at once, not when the step returns (uvicorn would have cut them by then)."""
    gate, in_step = _hold_steps(engine)

    async def go():
        stream = await engine.add_request("long", None, greedy(50), prompt_token_ids=PROMPT)
        await asyncio.to_thread(in_step.wait, 10)
        # a request that arrives during the step: its add waits in the command queue
        late = asyncio.create_task(engine.add_request("late", None, greedy(5), prompt_token_ids=PROMPT))
        for _ in range(500):
            if engine._cmds.qsize():
                break
            await asyncio.sleep(0.01)
        engine.stop(ServerShuttingDownError("drain over"))
        with pytest.raises(ServerShuttingDownError, match="drain over"):
            await asyncio.wait_for(_collect(stream), 5)
        with pytest.raises(ServerShuttingDownError, match="drain over"):
            await asyncio.wait_for(late, 5)
        assert not gate.is_set()          # the step is still running
        gate.set()
        with pytest.raises(ServerShuttingDownError, match="drain over"):
            await engine.add_request("t", None, greedy(5), prompt_token_ids=PROMPT)
    asyncio.run(go())


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ferrum")


def test_http_engine_failure_gives_500_and_unhealthy(engine):
    app = build_app(engine, ["tiny"])

    async def go():
        async with _client(app) as c:
            assert (await c.get("/health")).status_code == 200
            _fail_after(engine, 0)
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 500, r.text
            assert r.json()["error"]["type"] == "internal_error" and "boom" in r.json()["error"]["message"]
            h = await c.get("/health")
            assert h.status_code == 503 and "boom" in h.json()["error"]
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
            assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
            m = await c.get("/metrics")
            assert "ferrum_engine_healthy{model_name=\"tiny\"} 0.0" in m.text
    asyncio.run(go())


def test_http_queue_full_gives_503_with_retry_after(engine):
    """max_waiting=2: hold the engine inside a step, queue 3 more requests, release it. One is
    running, two wait, the third is refused."""
    app = build_app(engine, ["tiny"])
    gate, in_step = _hold_steps(engine)

    async def go():
        async with _client(app) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.to_thread(in_step.wait, 10)
            rest = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(3)]
            for _ in range(500):  # until all three adds wait in the engine's command queue
                if engine._cmds.qsize() >= 3:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            return await asyncio.gather(first, *rest)
    rs = asyncio.run(go())
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 200, 200, 503], [r.text for r in rs]
    full = next(r for r in rs if r.status_code == 503)
    assert full.headers["retry-after"] == "1"
    assert full.json()["error"]["type"] == "server_overloaded"


def test_status_counts_a_request_during_its_first_step(engine):
    """A request that wakes an idle engine is in status() while its first step runs (a long
    prefill): the snapshot is not the idle one taken before it arrived."""
    gate, in_step = _hold_steps(engine)
    assert engine.status()["num_running"] + engine.status()["num_waiting"] == 0

    async def go():
        stream = await engine.add_request("slow", None, greedy(2), prompt_token_ids=PROMPT)
        await asyncio.to_thread(in_step.wait, 10)
        seen = engine.status()
        gate.set()
        await _collect(stream)
        return seen
    seen = asyncio.run(go())
    assert seen["num_running"] + seen["num_waiting"] == 1, seen


def test_http_chat_without_template_gives_400(engine):
    app = build_app(engine, ["tiny"])
    tok = engine.tokenizer
    saved = tok.chat_template, tok.hf.chat_template
    tok.chat_template = tok.hf.chat_template = None
    try:
        async def go():
            async with _client(app) as c:
                return await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        r = asyncio.run(go())
    finally:
        tok.chat_template, tok.hf.chat_template = saved
    assert r.status_code == 400
    err = r.json()["error"]
    assert "no chat template" in err["message"] and err["param"] == "messages"
