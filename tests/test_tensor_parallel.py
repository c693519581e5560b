"""Tensor parallelism on CPU (gloo): TP=N equals TP=1, faults become named errors, and a
torchrun (SPMD) launch gives the same tokens as the spawned launch."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.config import EngineConfig, ParallelConfig
from ferrum.errors import TensorParallelError
from ferrum.executor.memory import compute_memory_requirements
from ferrum.executor.single import SingleDeviceExecutor
from ferrum.executor.tensor_parallel import TensorParallelExecutor
from ferrum.interfaces import DecodeInput, KvCacheHandle, PrefillInput
from ferrum.loader.safetensors import load_hf_folder
from tiny_models import make_tiny_model

CASES = {
    "llama": dict(family="llama"),
    "llama_kv1_tied": dict(family="llama", num_kv_heads=1, tie=True),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3", head_dim=32),
}


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    fam = kw.pop("family")
    return make_tiny_model(str(tmp_path_factory.mktemp(request.param)), fam, **kw)


def _run_executor(ex, prompts, steps):
    """Prefill two sequences then greedy-decode `steps` tokens; returns all logits."""
    hs = [KvCacheHandle(str(i), [4 * i + j for j in range(4)], 0, 16) for i in range(len(prompts))]
    out = [ex.prefill(PrefillInput(prompts, hs)).logits]
    for _ in range(steps):
        toks = out[-1].argmax(-1).tolist()
        out.append(ex.decode(DecodeInput(toks, hs)).logits)
    return torch.cat(out)


def test_tp2_logits_equal_tp1(tiny):
    src = load_hf_folder(tiny)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    ref = _run_executor(SingleDeviceExecutor(src, EngineConfig(model=tiny), progress=False), prompts, 8)
    ex = TensorParallelExecutor(src, EngineConfig(model=tiny, parallel=ParallelConfig(tensor_parallel_size=2)),
                                progress=False)
    try:
        got = _run_executor(ex, prompts, 8)
        # per-rank figures: each rank holds less than the whole model
        assert ex.capabilities().memory.param_bytes < compute_memory_requirements(src.config, torch.float32, 1).param_bytes
    finally:
        ex.shutdown()
    diff = (got - ref).abs().max().item()
    assert diff < 1e-5, f"TP=2 vs TP=1 max abs logit diff {diff:.2e}"


def test_tp2_greedy_batch_identical(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("batch")), "llama", num_kv_heads=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (8,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(d, progress=False, max_model_len=256) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.engine.executor.status().running_sequences == 0
    assert all(len(t) == 64 for t in got)
    assert got == ref
    # async scheduling: decode inputs come from the previous step's samples, which rank 0
    # broadcasts to rank 1 on the TP group
    with LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2, async_scheduling=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.engine.stats["overlapped_steps"] >= 60
    assert got == ref


def test_bad_tp_size_named_error(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("bad")), "llama")  # 4 heads, 2 KV heads
    with pytest.raises(TensorParallelError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        LLM(d, progress=False, tensor_parallel_size=3)


def test_smollm2_tp3_equals_tp1(smollm2_gguf_path):
    """SmolLM2: 9 heads, 3 KV heads -> 3 ranks of 3 heads and 1 KV head each."""
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with LLM(smollm2_gguf_path, progress=False, max_model_len=512) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(smollm2_gguf_path, progress=False, max_model_len=512, tensor_parallel_size=3) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref


def test_killed_worker_is_named_error(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("kill")), "llama")
    llm = LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2)
    ex = llm.engine.executor
    procs = list(ex.procs)
    eng = llm.engine
    eng.add_request(None, None, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                    prompt_token_ids=[5, 6, 7, 8])
    for _ in range(3):
        eng.step()
    procs[0].kill()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    for p in procs:
        p.join(timeout=10)
        assert not p.is_alive()


def test_raising_worker_is_named_error(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("raise")), "llama")
    llm = LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2)
    ex = llm.engine.executor
    ex.inject_fault("boom from the test")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: boom from the test"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    assert not any(p.is_alive() for p in ex.procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_matches_spawn(tmp_path_factory, smollm2_tokenizer):
    """Every rank runs the same `ferrum run` command under torchrun; rank 0 prints."""
    d = make_tiny_model(str(tmp_path_factory.mktemp("trun")), "llama", vocab=len(smollm2_tokenizer.hf),
                        hidden=64, num_heads=4, num_kv_heads=2)
    smollm2_tokenizer.hf.save_pretrained(d)
    args = ["run", d, "-tp", "2", "--prompt", "Hello there", "--raw", "--temperature", "0",
            "--max-tokens", "12", "--max-model-len", "128"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    spawned = subprocess.run([sys.executable, "-m", "ferrum.entrypoints.cli", *args],
                             capture_output=True, text=True, timeout=300, env=env)
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    trun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), "-m", "ferrum.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=300, env=env)
    assert trun.returncode == 0, trun.stderr[-2000:]
    assert spawned.stdout.strip() != ""
    assert trun.stdout.strip() == spawned.stdout.strip()


def test_all_reduce_fast_path_is_bound_to_its_group(tmp_path_factory):
    """A fast all-reduce installed for one TP engine must not serve a later engine's group
    (on the H200 a bf16 engine's symmetric-memory path outlived it and broke the next engine)."""
    from ferrum.distributed import communication as comm
    from ferrum.distributed.parallel_state import _TPState

    class Stale:
        group = object()  # a group no engine uses any more

        def __call__(self, x):
            raise AssertionError("stale all-reduce path used")

    d = make_tiny_model(str(tmp_path_factory.mktemp("stale")), "llama")
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(d, progress=False, max_model_len=256) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    comm.set_all_reduce_impl(Stale())
    try:
        with LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref
        assert comm._all_reduce_impl is None  # shutdown clears it
        fake = Stale()
        comm.set_all_reduce_impl(lambda x: x * 0 + 7.0)
        comm._all_reduce_impl.group = fake.group
        tp = _TPState(0, 2, fake.group)
        assert comm.tensor_model_parallel_all_reduce(torch.ones(3), tp).tolist() == [7.0] * 3
    finally:
        comm.set_all_reduce_impl(None)
