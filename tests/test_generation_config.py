"""The model creator's sampling defaults (generation_config.json), as vLLM's `--generation-config
auto`: requests that leave temperature, top_p, top_k, min_p, repetition_penalty or max_tokens
unset take them, offline (`LLM.generate` without SamplingParams), in the server and in
`ferrum run`; `--generation-config vllm` ignores them."""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from ferrum.config import EngineConfig, generation_sampling_defaults
from ferrum.entrypoints.cli import build_parser
from ferrum.errors import ConfigError
from ferrum.sampling_params import SamplingParams

# greedy and 5 tokens: a reply without those fields that is greedy and 5 tokens long can only
# come from here (SamplingParams' defaults are temperature 1.0 and no limit in chat)
CREATOR = {"do_sample": True, "temperature": 0.0, "top_k": 7, "max_new_tokens": 5}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def folder(tiny_chat_model, tmp_path_factory):
    """tiny_chat_model's files with CREATOR's fields added to its generation_config.json."""
    out = tmp_path_factory.mktemp("gen_config")
    for name in os.listdir(tiny_chat_model):
        if name != "generation_config.json":
            os.symlink(os.path.join(tiny_chat_model, name), out / name)
    with open(os.path.join(tiny_chat_model, "generation_config.json")) as f:
        given = json.load(f)
    (out / "generation_config.json").write_text(json.dumps({**given, **CREATOR}))
    return str(out)


def test_fields_read_as_vllm_reads_them(folder, tmp_path):
    assert generation_sampling_defaults(folder) == {"temperature": 0.0, "top_k": 7, "max_tokens": 5}
    assert generation_sampling_defaults(str(tmp_path)) == {}          # no file: none
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1.0}))
    with pytest.raises(ConfigError, match="generation_config.json.*temperature") as e:
        generation_sampling_defaults(str(tmp_path))   # at start-up, not as each request's 400
    assert e.value.param == "generation_config"


def test_offline_requests_without_params_take_them(folder):
    from ferrum import LLM
    llm = LLM(folder, device="cpu", max_model_len=256, threads=1)
    try:
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_k, default.max_tokens) == (0.0, 7, 5)
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        (mine,) = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=5))
        (dflt,) = llm.generate("Once upon a time", use_tqdm=False)
        assert dflt.outputs[0].token_ids == mine.outputs[0].token_ids
        (ref,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
        assert len(ref.outputs[0].token_ids) == 5
    finally:
        llm.shutdown()
    plain = EngineConfig.from_kwargs(model=folder, generation_config="vllm")
    assert plain.generation_config == "vllm"


def test_vllm_choice_and_a_folder_without_the_file(folder, tmp_path):
    from ferrum.config import generation_eos_token_ids, resolve_sampling_defaults
    assert resolve_sampling_defaults("vllm", folder) == {}
    # a value ferrum does not take stops only what reads it: --generation-config vllm gets past
    # it (transformers' GenerationConfig refused max_new_tokens 0 in every read, EOS ids too)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0, "eos_token_id": 2}))
    assert generation_eos_token_ids(str(bad)) == [2] and resolve_sampling_defaults("vllm", str(bad)) == {}
    with pytest.raises(ConfigError, match="max_tokens"):
        resolve_sampling_defaults("auto", str(bad))
    assert resolve_sampling_defaults("auto", None) == {}               # GGUF, dummy: none
    assert resolve_sampling_defaults(folder, None)["max_tokens"] == 5    # another folder's file
    with pytest.raises(ConfigError, match="not auto, vllm or a folder"):
        resolve_sampling_defaults(str(tmp_path), folder)


def test_server_fields_left_out_take_them(folder):
    from ferrum.engine.async_engine import AsyncLLMEngine
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.entrypoints.openai.server import build_app
    engine = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=folder, device="cpu",
                                                               max_model_len=256, threads=1),
                                      progress=False))
    app = build_app(engine, ["m"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://f") as c:
            async def chat(**kw):
                r = await c.post("/v1/chat/completions",
                                 json={"messages": MESSAGES, "ignore_eos": True, **kw})
                assert r.status_code == 200, r.text
                return r.json()
            left_out = await chat()
            given = await chat(temperature=0.0, max_tokens=5)
            assert left_out["usage"]["completion_tokens"] == 5     # max_new_tokens
            assert left_out["choices"][0]["message"] == given["choices"][0]["message"]   # greedy
            assert (await chat(max_tokens=9))["usage"]["completion_tokens"] == 9   # a field given wins
            r = await c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 5, "ignore_eos": True})
            g = await c.post("/v1/completions", json={"prompt": "Once", "max_tokens": 5, "ignore_eos": True,
                                                      "temperature": 0})
            assert r.json()["choices"][0]["text"] == g.json()["choices"][0]["text"]
            # Responses: no top_k field, so the model's applies always; no max_output_tokens: 5
            r = (await c.post("/v1/responses", json={"input": "Name three colours."})).json()
            g = (await c.post("/v1/responses", json={"input": "Name three colours.", "temperature": 0,
                                                     "max_output_tokens": 5})).json()
            assert r["output"] == [dict(o, id=r["output"][0]["id"]) for o in g["output"]]
            assert r["usage"]["output_tokens"] == g["usage"]["output_tokens"] <= 5
            assert (r["temperature"], g["temperature"]) == (0.0, 0.0)   # what ran, not 1.0
    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


def test_run_flags_left_out_take_them():
    from ferrum.entrypoints.run import RUN_DEFAULTS, sampling_params
    run = next(a for a in build_parser()._actions if a.dest == "command").choices["run"]
    model = {"temperature": 0.0, "top_k": 7, "max_tokens": 5}
    p = sampling_params(run.parse_args([]), model, seed=3)
    assert (p.temperature, p.top_k, p.max_tokens, p.seed) == (0.0, 7, 5, 3)
    p = sampling_params(run.parse_args(["--temperature", "0.2", "--max-tokens", "9"]), model)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.2, 7, 9)        # a flag given wins
    p = sampling_params(run.parse_args([]))                             # no model defaults
    assert (p.temperature, p.max_tokens) == (RUN_DEFAULTS["temperature"], RUN_DEFAULTS["max_tokens"])
