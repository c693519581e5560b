"""Tensor parallelism on CPU (gloo): TP=N equals TP=1 (logits, greedy batches, prompt logprobs,
structured outputs), faults become named errors, and a torchrun (SPMD) launch gives the same
tokens as the spawned launch."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
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
    # MoE: each expert's FFN split column/row over the ranks (one all-reduce per block)
    "qwen3_moe": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
    "qwen2_moe_shared": dict(family="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48),
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
    print(f"{os.path.basename(tiny)} TP=2 vs TP=1: max abs logit diff {diff:.2e}")


@pytest.mark.parametrize("family,kw", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48))])
def test_expert_parallel_tp2_equals_tp1(tmp_path_factory, family, kw):
    """--enable-expert-parallel: each rank holds half the experts whole (and half of each
    dense / shared-expert matrix); logits and greedy tokens equal TP=1."""
    d = make_tiny_model(str(tmp_path_factory.mktemp(f"ep-{family}")), family, **kw)
    src = load_hf_folder(d)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    ref = _run_executor(SingleDeviceExecutor(src, EngineConfig(model=d), progress=False), prompts, 8)
    par = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    ex = TensorParallelExecutor(src, EngineConfig(model=d, parallel=par), progress=False)
    try:
        got = _run_executor(ex, prompts, 8)
        from ferrum.layers.moe import FusedMoE
        experts = [m for m in ex.runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(m.w13_weight.shape[0] == 2 and m.expert_start == 0 for m in experts)
    finally:
        ex.shutdown()
    diff = (got - ref).abs().max().item()
    assert diff < 1e-5, f"EP=2 vs TP=1 max abs logit diff {diff:.2e}"
    print(f"{family} EP=2 vs TP=1: max abs logit diff {diff:.2e}")
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with one KV head and SmolLM2's tokenizer (vocab 49152), so structured
    outputs have a vocabulary to walk."""
    d = make_tiny_model(str(tmp_path_factory.mktemp("batch")), "llama", num_kv_heads=1, vocab=49152)
    smollm2_tokenizer.hf.save_pretrained(d)
    return d


def _prompt_logprobs_equal(tp1, tp2) -> None:
    """Prompt logprobs over chunked prefill (rank 0 gathers each chunk's logits; prompts of 70,
    1, 2 and 33 tokens): TP=2 equals TP=1 within 1e-5, with the same top-5 ids."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(20, 49152, (n,), generator=g).tolist() for n in (70, 1, 2, 33)]
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5)
    ref, got = (llm.generate(prompts, sp, use_tqdm=False) for llm in (tp1, tp2))
    worst = 0.0
    for a, b in zip(ref, got):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y)
            worst = max(worst, max(abs(x[k] - y[k]) for k in x))
    assert worst < 1e-5, f"TP=2 vs TP=1 max abs prompt logprob diff {worst:.2e}"


def _structured_outputs_equal(tp1, tp2) -> None:
    """JSON-schema constrained requests, greedy and seeded sampling (the grammar masks rank 0's
    logits): TP=2 gives TP=1's texts, and they validate."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "s": {"type": "string", "maxLength": 6}},
              "required": ["n", "s"], "additionalProperties": False}
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs={"json": schema}),
              SamplingParams(temperature=0.8, seed=9, max_tokens=100, structured_outputs={"json": schema})]
    ref, got = ([o.outputs[0].text for o in llm.generate(["Hi", "Ho"], params, use_tqdm=False)]
                for llm in (tp1, tp2))
    assert got == ref
    for text in got:
        jsonschema.validate(json.loads(text), schema)


def test_tp2_greedy_batch_prompt_logprobs_and_structured_outputs_equal_tp1(chat_tiny):
    """One TP=2 engine (a start costs seconds) and its TP=1 reference, token budget 24 so that
    prefills run in chunks: a greedy batch, prompt logprobs and structured outputs equal."""
    kw = dict(progress=False, dtype="float32", max_model_len=256, max_num_batched_tokens=24)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (8,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    with LLM(chat_tiny, **kw) as tp1, LLM(chat_tiny, tensor_parallel_size=2, **kw) as tp2:
        ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, sp, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, sp, use_tqdm=False)]
        assert tp2.engine.executor.status().running_sequences == 0
        assert all(len(t) == 64 for t in got)
        assert got == ref
        _prompt_logprobs_equal(tp1, tp2)
        _structured_outputs_equal(tp1, tp2)
    # async scheduling: decode inputs come from the previous step's samples, which rank 0
    # broadcasts to rank 1 on the TP group
    with LLM(chat_tiny, tensor_parallel_size=2, async_scheduling=True, **kw) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.engine.stats["overlapped_steps"] >= 60
    assert got == ref


def test_bad_tp_size_named_error(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("bad")), "llama")  # 4 heads, 2 KV heads
    with pytest.raises(TensorParallelError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        LLM(d, progress=False, tensor_parallel_size=3)


def test_second_tp_engine_in_a_process_is_refused_and_the_first_serves_on(tmp_path_factory):
    """A second LLM(..., tensor_parallel_size=2) while one lived joined the first one's
    process group: 30 s later a DistStoreError traceback, and its clean-up could tear down
    the first engine's group. Now it is refused at once, the first keeps serving, and once it
    is shut down a new one starts. An engine dropped without shutdown() (`del llm`) stops its
    workers and frees the process group, as a TP=1 engine frees its model (before, atexit's
    reference kept it: its workers ran on and every later TP engine of the process was
    refused, with no handle left to shut it down). An engine built in a thread that has ended
    keeps its workers."""
    d = make_tiny_model(str(tmp_path_factory.mktemp("second")), "llama")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2) as first:
        ref = first.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="another tensor-parallel engine"):
            LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2)
        assert time.monotonic() - t0 < 5
        assert first.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    # built in a thread that has ended, as by a loader thread: its workers serve on (before,
    # PR_SET_PDEATHSIG killed them when that thread exited)
    box = []
    loader = threading.Thread(target=lambda: box.append(
        LLM(d, progress=False, max_model_len=256, tensor_parallel_size=2)))
    loader.start()
    loader.join()
    again = box.pop()
    assert again.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == ref
    procs = list(again.engine.executor.procs)
    del again
    assert all(p.wait(10) is not None for p in procs)
    assert not torch.distributed.is_initialized()   # what a next engine needs


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
    procs[0].wait(10)
    assert "rank 1" in eng.health()        # known before the next step (the server's /health)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    for p in procs:
        p.wait(timeout=10)


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
    assert all(p.poll() is not None for p in ex.procs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory, smollm2_tokenizer) -> str:
    """A tiny Llama carrying the SmolLM2 tokenizer, for `ferrum run` in subprocesses."""
    d = make_tiny_model(str(tmp_path_factory.mktemp("trun")), "llama", vocab=len(smollm2_tokenizer.hf),
                        hidden=64, num_heads=4, num_kv_heads=2)
    smollm2_tokenizer.hf.save_pretrained(d)
    return d


def ferrum_run(model: str, *flags: str, torchrun: tuple[str, ...] = (), wait: bool = True):
    """`ferrum run <model> --prompt ... <flags>` greedy, 12 tokens, in a subprocess (under
    `torchrun <torchrun args>` when given). Returns the finished CompletedProcess, or the
    Popen when not `wait`."""
    cmd = [sys.executable, "-m", *(("torch.distributed.run", *torchrun, "-m") if torchrun else ()),
           "ferrum.entrypoints.cli", "run", model, "--prompt", "Hello there", "--raw",
           "--temperature", "0", "--max-tokens", "12", "--max-model-len", "128", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_torchrun_matches_spawn(cli_model):
    """Every rank runs the same `ferrum run` command under torchrun; rank 0 prints."""
    spawned = ferrum_run(cli_model, "-tp", "2")
    trun = ferrum_run(cli_model, "-tp", "2", torchrun=("--nproc-per-node", "2", "--master-port", str(_free_port())))
    assert spawned.stdout.strip() != ""
    assert trun.stdout.strip() == spawned.stdout.strip()


def test_two_node_torchrun_matches_tp1(cli_model):
    """Issue 13 item 9: two torchrun launches, one process each, as on two machines
    (`--nnodes 2 --node-rank 0|1`, rendezvous at 127.0.0.1, gloo), form one TP=2 engine; node 0
    prints TP=1's greedy answer, node 1 only follows."""
    tp1 = ferrum_run(cli_model)
    assert tp1.stdout.strip()
    port = str(_free_port())
    nodes = [ferrum_run(cli_model, "-tp", "2", wait=False,
                        torchrun=("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                                  "--master-addr", "127.0.0.1", "--master-port", port))
             for node in (0, 1)]
    try:
        outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-3000:]
    assert outs[0][0].strip() == tp1.stdout.strip()
    assert outs[1][0].strip() == ""


def test_llm_on_a_torchrun_worker_rank_is_a_named_error(script_model, monkeypatch):
    """Under torchrun only rank 0 builds the engine; LLM() on another rank took rank 0's place
    in the process group."""
    for key, value in (("TORCHELASTIC_RUN_ID", "x"), ("RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(TensorParallelError, match="torchrun rank 1: only rank 0 builds the engine"):
        LLM(script_model, progress=False, max_model_len=128, tensor_parallel_size=2)


def test_torchrun_worker_rank_refuses_what_rank_0_refuses_at_once(script_model, monkeypatch):
    """A config rank 0 refuses before joining (here 3 ranks for 4 heads; a rank count other
    than tensor_parallel_size) left the other ranks in the rendezvous until it timed out, 30 s
    later, with a DistStoreError traceback; they now raise rank 0's error at once."""
    from ferrum.executor.tp_worker import run_spmd_worker
    monkeypatch.setenv("RANK", "1")
    for world, tp, match in ((3, 3, r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"),
                             (2, 4, "torchrun started 2 ranks but tensor_parallel_size is 4")):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        config = EngineConfig.from_kwargs(model=script_model, tensor_parallel_size=tp, step_timeout_s=60)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=match):
            run_spmd_worker(config)
        assert time.monotonic() - t0 < 5 and not torch.distributed.is_initialized()


# ---- TP from an ordinary script (issue 13 item 8) ---------------------------------------------

SCRIPT = """\
from ferrum import LLM, SamplingParams
print("MAIN RUN", flush=True)      # once: worker ranks never import this module
llm = LLM({folder!r}, progress=False, max_model_len=128, tensor_parallel_size=2)
sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
print(llm.generate([[5, 6, 7, 8], [9, 10]], sp, use_tqdm=False)[1].outputs[0].token_ids)
"""   # no `if __name__ == "__main__":` and no shutdown: the interpreter's exit cleans up


@pytest.fixture(scope="module")
def script_model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("script")), "llama")


def test_tp_from_a_script_without_main_guard_and_from_stdin(script_model, tmp_path):
    """Before: the spawned workers re-imported the caller's __main__ and the start-up failed
    after a 31 s rendezvous timeout. Now a script file and code piped to `python -` both run,
    give TP=1's tokens, and exit without a leaked-resource warning."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(script_model, progress=False, max_model_len=128) as llm:
        ref = llm.generate([[9, 10]], sp, use_tqdm=False)[0].outputs[0].token_ids
    code = SCRIPT.format(folder=script_model)
    path = tmp_path / "no_main_guard.py"
    path.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv, stdin in (([str(path)], None), (["-"], code)):
        run = subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True,
                             timeout=300, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.strip().splitlines()
        assert lines == ["MAIN RUN", str(ref)], run.stdout
        assert "leaked" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


WORKER_FAULTS = {
    # dies before it reaches rank 0's store: its exit code and stderr are the report
    "exit": 'import sys, os\nsys.stderr.write("injected: this worker cannot start\\n")\nos._exit(3)\n',
    # reaches the store, then fails to load its shard: it reports its own error
    "load": ("import ferrum.executor.tp_rank as rank\n"
             "def build_runner(*args, **kwargs):\n"
             "    raise MemoryError('injected: no memory for the weights')\n"
             "rank.build_runner = build_runner\n"),
    # hangs: the start-up timeout ends the wait
    "hang": "import os, time\nopen(os.environ['HANG_PID_FILE'], 'w').write(str(os.getpid()))\ntime.sleep(600)\n",
}


@pytest.mark.parametrize("fault", list(WORKER_FAULTS))
def test_worker_failing_at_start_up_is_reported_at_once(script_model, tmp_path, monkeypatch, fault):
    """A sitecustomize.py on the workers' PYTHONPATH (rank 0, this process, is already up)
    breaks the worker ranks only."""
    (tmp_path / "sitecustomize.py").write_text(WORKER_FAULTS[fault])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HANG_PID_FILE", str(tmp_path / "pid"))
    expected = {"exit": r"rank 1 failed while starting .*exited with code 3: .*injected: this worker cannot start",
                "load": r"rank 1 failed while loading the model: MemoryError: injected: no memory for the weights",
                "hang": r"rank\(s\) \[1\] did not finish starting .* start-up timeout of 5 s "
                        r"\(ParallelConfig.startup_timeout_s\)"}[fault]
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=expected):
        LLM(script_model, progress=False, max_model_len=128, tensor_parallel_size=2,
            startup_timeout_s=5 if fault == "hang" else 600)
    assert time.monotonic() - t0 < 60     # before: a 31 s rendezvous timeout, whatever the cause
    # nothing left for the next engine of this process: process group, TP state
    from ferrum.distributed.parallel_state import get_tp
    assert not torch.distributed.is_initialized() and get_tp().size == 1
    if fault == "hang":    # the hung worker was stopped
        pid = int((tmp_path / "pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


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
