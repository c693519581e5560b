"""`ferrum bench latency` and `ferrum bench throughput` end to end on a tiny random model: they
run, write their JSON, and the throughput run counts every generated token."""
from __future__ import annotations

import json

from ferrum.entrypoints.cli import main
from tiny_models import make_tiny_model


def test_bench_latency_and_throughput_cli(tmp_path, capsys):
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "lat.json"
    capsys.readouterr()
    assert main(["bench", "latency", folder, "--input-len", "16", "--output-len", "8", "--num-iters", "2",
                 "--no-hf", "--threads", "1", "--out", str(out)]) == 0
    lat = json.loads(out.read_text())
    assert lat["ferrum"]["decode_tok_s"] > 0 and lat["ferrum"]["ttft_s"] > 0
    assert lat["ratios"] == {}   # no peer, no HF: no ratio row (it held an empty "tp1": {})
    # stdout: each figure once: the bandwidths on one line, with the final measured value the
    # JSON holds (it was printed twice, at two values), no empty ratio row ("tp1: {}"), no None
    lines = capsys.readouterr().out.splitlines()
    bandwidth = [line for line in lines if "GB/s" in line]
    assert len(bandwidth) == 1, lines
    assert bandwidth[0].startswith("bandwidth: spec n/a (CPU: ")
    assert f"measured {lat['bandwidth']['roofline_gbs']:.1f} GB/s" in bandwidth[0]
    assert not any(line.rstrip().endswith("{}") or "None" in line for line in lines), lines
    assert [line.split(":")[0] for line in lines if line.startswith("iter ")] == ["iter 1", "iter 2"]
    assert sum(line.startswith("ferrum tp1 ") for line in lines) == 1
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", folder, "--num-prompts", "4", "--threads", "1",
                 "--out", str(out)]) == 0
    thr = json.loads(out.read_text())
    for mode in ("batched", "sequential"):
        r = thr[mode]
        assert r["output_tokens"] == thr["total_output_tokens"]
        assert r["timeline"][-1][1] == thr["total_output_tokens"]  # every token counted
    assert thr["batched"]["max_running_sequences"] == 4 and thr["sequential"]["max_running_sequences"] == 1


# ---- the one harness: MBU, records, peers side by side, TTFT, sweep ----------------------------
import os  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402


def test_spec_bandwidth_table_matches_device_names():
    from ferrum.benchmarks.mbu import spec_for_name
    assert spec_for_name("NVIDIA H200") == 4800.0
    assert spec_for_name("NVIDIA H200 NVL") == 4800.0
    assert spec_for_name("NVIDIA GH200 480GB") is None          # not the H200: no guess
    assert spec_for_name("NVIDIA H100 80GB HBM3") == 3350.0
    assert spec_for_name("NVIDIA H100 PCIe") == 2000.0
    assert spec_for_name("NVIDIA A100-SXM4-80GB") == 2039.0
    assert spec_for_name("NVIDIA A100 80GB PCIe") == 1935.0
    assert spec_for_name("NVIDIA A100-SXM4-40GB") == 1555.0
    assert spec_for_name("NVIDIA L40S") == 864.0
    assert spec_for_name("Some Future GPU") is None


def test_mbu_definition():
    """Bytes per step = weights - untied input embedding + context x KV bytes per token; MBU
    over the spec and over the roofline are the same read rate over two denominators."""
    from ferrum.benchmarks.mbu import decode_bytes_per_step, mbu_columns, spec_bandwidth_gbs
    from ferrum.config import ModelConfig
    from ferrum.executor.memory import compute_memory_requirements
    import torch
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                      "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                                      "num_hidden_layers": 32, "num_attention_heads": 32,
                                      "num_key_value_heads": 8, "max_position_embeddings": 8192})
    mem = compute_memory_requirements(cfg, torch.bfloat16, 1)
    w = decode_bytes_per_step(mem, cfg, torch.bfloat16)
    assert w == mem.param_bytes - 128256 * 4096 * 2
    assert 14.9e9 < w < 15.1e9                      # GUIDE section 7: ~15.0 GB per step
    assert decode_bytes_per_step(mem, cfg, torch.bfloat16, 1000) - w == 1000 * 32 * 2 * 8 * 128 * 2
    cols = mbu_columns(w, w / 4.0e12, 4800.0, 4350.0)   # a step reading at 4.0 TB/s
    assert cols["read_gbs"] == pytest.approx(4000.0)
    assert cols["mbu"] == pytest.approx(4000 / 4800) and cols["mbu_vs_roofline"] == pytest.approx(4000 / 4350)
    assert mbu_columns(w, 1.0, None, None)["mbu"] is None
    # a throughput run's decode phase: the per-step bytes summed over its steps
    from types import SimpleNamespace
    from ferrum.benchmarks.mbu import decode_phase_bytes
    engine = SimpleNamespace(model_config=cfg, executor=SimpleNamespace(
        dtype=torch.bfloat16, capabilities=lambda: SimpleNamespace(memory=mem)))
    assert decode_phase_bytes(engine, 3, 1000) == 3 * w + 1000 * 32 * 2 * 8 * 128 * 2
    assert spec_bandwidth_gbs("cpu")[0] is None and spec_bandwidth_gbs("cpu", 100.0)[0] == 100.0


def _fake_peers(folder) -> str:
    """A peers folder whose drivers print what vLLM's and gpt-fast's print, leave a child
    process behind (as vLLM leaves its workers), and echo the environment they were given."""
    os.makedirs(os.path.join(folder, "gptfast"), exist_ok=True)
    leave_child = 'import subprocess, sys; subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])\n'
    with open(os.path.join(folder, "vllm_bench.py"), "w") as f:
        f.write(leave_child + textwrap.dedent("""
            import json, os, sys
            if os.environ.get("FAIL_PEER"):
                raise SystemExit("peer failed on purpose")
            print("VLLMPEER", json.dumps({"section": sys.argv[1], "tp": int(sys.argv[2]), "ttft_ms": 4.0,
                  "decode_tok_s": 10.0, "output_tok_s": 20.0, "vb_p": os.environ.get("VB_P"),
                  "marker": os.environ.get("PEER_MARKER"), "configs": os.environ.get("PEER_CONFIGS")}))
            """))
    with open(os.path.join(folder, "gptfast", "peer_bench.py"), "w") as f:
        f.write(textwrap.dedent("""
            import json, os
            print("GPTFAST", json.dumps({"best_decode_tok_s": 5.0, "P": os.environ["GF_P"], "N": os.environ["GF_N"]}))
            """))
    return folder


def _children_left() -> int:
    """Processes still running the fake peers' stray child."""
    import subprocess
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum("time.sleep(300)" in line and "-c" in line for line in out.splitlines())


def test_latency_with_peers_ratios_record_and_cleanup(tmp_path):
    """Peers run as subprocesses with their own environment (--peer-env reaches them, not
    ferrum), their process group is killed, ratios are ferrum over peer, and the record holds
    the command, commit, versions and environment."""
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    peers = _fake_peers(str(tmp_path / "peers"))
    before = _children_left()
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", folder, "--input-len", "16", "--output-len", "8", "--num-iters", "1",
                 "--no-hf", "--threads", "1", "--peers", "vllm", "gpt-fast", "--peers-dir", peers,
                 "--peer-env", "PEER_MARKER=hello", "--out", str(out)]) == 0
    assert _children_left() == before
    assert "PEER_MARKER" not in os.environ
    lat = json.loads(out.read_text())
    vllm = lat["peers"]["vllm_tp1"]
    assert vllm["marker"] == "hello" and vllm["vb_p"] == "16" and vllm["configs"].endswith(os.path.join("benchmarks", "configs"))
    assert lat["peers"]["gpt_fast_tp1"]["P"] == "16" and lat["peers"]["gpt_fast_tp1"]["N"] == "8"
    ours = lat["ferrum"]["decode_tok_s"]
    assert lat["ratios"]["tp1"]["decode_tok_s_vs_vllm"] == pytest.approx(ours / 10.0)
    assert lat["ratios"]["tp1"]["decode_tok_s_vs_gpt_fast"] == pytest.approx(ours / 5.0)
    assert lat["command"].startswith("ferrum bench latency") and "git_commit" in lat
    assert lat["software"]["torch"] and "python" in lat["software"]
    assert isinstance(lat["environment"], dict)
    assert lat["bandwidth"]["spec_gbs"] is None and lat["bandwidth"]["roofline_gbs"] > 0   # CPU
    assert 0 < lat["ferrum"]["mbu_vs_roofline"] <= 1.0 and lat["ferrum"]["mbu"] is None


def test_failing_peer_is_reported_not_fatal(tmp_path, monkeypatch):
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    peers = _fake_peers(str(tmp_path / "peers"))
    out = tmp_path / "thr.json"
    monkeypatch.setenv("FAIL_PEER", "1")
    assert main(["bench", "throughput", folder, "--num-prompts", "3", "--threads", "1", "--no-sequential",
                 "--peers", "vllm", "--peers-dir", peers, "--out", str(out)]) == 0
    thr = json.loads(out.read_text())
    assert "peer failed on purpose" in thr["peers"]["vllm"]["log_tail"]
    assert thr["ratios"]["output_tok_s_vs_vllm"] is None
    split = thr["batched"]["step_time_split"]
    assert split["prefill"]["prefill_tokens"] == thr["total_input_tokens"]
    assert split["decode"]["steps"] + split["prefill"]["steps"] == thr["batched"]["steps"]
    assert thr["batched"]["decode_mbu"]["mbu"] is None     # CPU: no spec bandwidth, no headline


def test_throughput_decode_phase_mbu(tmp_path):
    """The decode rows' KV context is counted row by row (a sequence of p prompt tokens and o
    outputs has p, ..., p + o - 2 tokens cached before its o - 1 decode rows, and each row
    attends to one more, its own) and the MBU is the bytes read over the decode steps' time
    and the given spec bandwidth."""
    import argparse
    from ferrum.benchmarks.throughput import workload
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "thr.json"
    assert main(["bench", "throughput", folder, "--num-prompts", "3", "--threads", "1", "--no-sequential",
                 "--input-len", "10", "20", "--output-len", "5", "9", "--spec-bandwidth-gbs", "100",
                 "--out", str(out)]) == 0
    thr = json.loads(out.read_text())
    _, _, ins, outs = workload(argparse.Namespace(workload="random", seed=0, num_prompts=3,
                                                  input_len=[10, 20], output_len=[5, 9]), 300)
    split = thr["batched"]["step_time_split"]
    ctx = split["prefill"]["decode_ctx"] + split["decode"]["decode_ctx"]
    assert ctx == sum(p * (o - 1) + (o - 1) * (o - 2) // 2 for p, o in zip(ins, outs))
    assert split["prefill"]["decode_rows"] + split["decode"]["decode_rows"] == sum(o - 1 for o in outs)
    m = thr["batched"]["decode_mbu"]
    assert m["s"] == pytest.approx(split["decode"]["s"]) and m["bytes"] > 0
    # weights (without the untied input embedding, 300 x 64 fp32) each step + the KV read
    from ferrum.benchmarks.throughput import decode_phase_mbu
    from ferrum.config import ModelConfig
    from ferrum.executor.memory import compute_memory_requirements
    from types import SimpleNamespace
    import torch
    cfg = ModelConfig.from_hf_dict(json.load(open(os.path.join(folder, "config.json"))))
    mem = compute_memory_requirements(cfg, torch.float32, 1)
    engine = SimpleNamespace(model_config=cfg, executor=SimpleNamespace(
        dtype=torch.float32, capabilities=lambda: SimpleNamespace(memory=mem)))
    d = split["decode"]
    assert m["bytes"] == decode_phase_mbu(engine, d, 100.0, "")["bytes"] == \
        d["steps"] * (mem.param_bytes - 300 * 64 * 4) + (d["decode_ctx"] + d["decode_rows"]) * mem.kv_bytes_per_token
    assert m["read_gbs"] == pytest.approx(m["bytes"] / m["s"] / 1e9)
    assert m["mbu"] == pytest.approx(m["read_gbs"] / 100) and m["floor_s"] == pytest.approx(m["bytes"] / 100e9)


def test_ttft_cached_mode_hits_the_prefix_cache(tmp_path):
    """`cached` repeats one prompt as vLLM's driver does: only the last block is computed;
    `cold` computes every prompt token."""
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", folder, "--prompt-lens", "40", "64", "--num-iters", "2", "--threads", "1",
                 "--out", str(out)]) == 0
    ttft = json.loads(out.read_text())
    for P, computed in ((40, 8), (64, 16)):           # block size 16; the last token is never cached
        row = ttft["ferrum"][str(P)]
        assert row["cached"]["computed_tokens"] == [computed] * 2
        assert row["cold"]["computed_tokens"] == [P] * 2
        assert row["cold"]["ttft_ms_best"] > 0


def test_nanovllm_workload_is_the_peer_drivers():
    """The same prompts, lengths and sampling as `vllm_bench.py nanovllm` (random.Random(0))."""
    import random
    from ferrum.benchmarks.throughput import nanovllm_workload
    prompts, params, in_lens, out_lens = nanovllm_workload()
    rng = random.Random(0)
    assert prompts == [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    assert out_lens == [rng.randint(100, 1024) for _ in range(256)]
    assert all(p.temperature == 0.6 and p.ignore_eos and p.max_tokens == n for p, n in zip(params, out_lens))


def test_sweep_cli(tmp_path):
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "sweep.json"
    assert main(["bench", "sweep", folder, "--batch-sizes", "1", "3", "--input-len", "8", "--output-len", "12",
                 "--threads", "1", "--temperature", "0.5", "--out", str(out)]) == 0
    sweep = json.loads(out.read_text())
    assert [p["batch"] for p in sweep["points"]] == [1, 3]
    for p in sweep["points"]:
        assert p["decode_tok_s"] > 0 and p["sampler_ms"] > 0 and p["replay_ms"] is None   # CPU: no graphs
        assert p["steps_timed"] > 0


def test_sweep_counts_the_rows_a_step_decoded_not_the_batch_asked_for(tmp_path, capsys):
    """A batch the KV pool cannot hold at once runs in part (the rest waits or is preempted):
    decode tok/s is the rows each step decoded over its time, not B over it, and the line says
    how many ran. `ferrum bench sweep smollm2` on the 1 GiB CPU pool printed 392 tok/s at
    B=256 (about 121 ran per step) against 178 at B=128."""
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    out = tmp_path / "sweep.json"
    capsys.readouterr()
    # 17 + 12 tokens: 2 blocks of 16 per sequence from its admission; 8 blocks hold 4 of the 8
    assert main(["bench", "sweep", folder, "--batch-sizes", "2", "8", "--input-len", "17", "--output-len", "12",
                 "--threads", "1", "--num-kv-blocks", "8", "--block-size", "16", "--out", str(out)]) == 0
    full, part = json.loads(out.read_text())["points"]
    assert full["batch_ran"] == 2 and part["batch_ran"] == 4
    assert part["decode_tok_s"] < 5e3 / part["step_ms"]   # it was 8 / step
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("B=")]
    assert "(4 of 8 ran at once: the KV pool holds no more" in lines[1] and "ran" not in lines[0], lines
    assert not any("None" in line for line in lines), lines


def test_paste_gemv_configs_replaces_only_the_table():
    """benchmarks/paste_gemv_configs.py rewrites one module-level dict literal (the tuned GEMV
    tiles), whatever it held before, and leaves the rest of the module as it was."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "paste_gemv_configs.py"
    spec = importlib.util.spec_from_file_location("paste_gemv_configs", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    src = "A = 1\nW4_GEMV_CONFIGS: dict[tuple, tuple] = {\n    (1, 2, 1): (3, 4),\n}\nB = {2: 3}\n"
    new = tool.replace_table(src, "W4_GEMV_CONFIGS", tool.literal({"(8, 16, 4)": [1, 2], "(8, 16, 1)": [5, 6]}))
    ns: dict = {}
    exec(new, ns)
    assert ns["W4_GEMV_CONFIGS"] == {(8, 16, 1): (5, 6), (8, 16, 4): (1, 2)}
    assert ns["A"] == 1 and ns["B"] == {2: 3}
    # --merge reads the table back: the entries a partial sweep has replace, the rest stay
    assert tool.current_table(new, "W4_GEMV_CONFIGS") == {"(8, 16, 1)": [5, 6], "(8, 16, 4)": [1, 2]}
    assert tool.current_table("T: dict = {\n    ('q', 1, 2): None,\n}\n", "T") == {"('q', 1, 2)": None}


def test_throughput_step_log(tmp_path):
    """--step-log: every step of the batched phase is a row; the phases add up to the run
    (steps, output tokens, prefill tokens); the kernel profile covers one prefill step and
    decode steps at the target batch; the markdown table is written."""
    folder = make_tiny_model(str(tmp_path / "m"), "qwen3", layers=2, vocab=300, head_dim=16, max_pos=512)
    out, logdir = tmp_path / "thr.json", tmp_path / "steps"
    assert main(["bench", "throughput", folder, "--num-prompts", "4", "--input-len", "20", "60",
                 "--output-len", "40", "60", "--threads", "1", "--no-sequential", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "64", "--step-log", str(logdir), "--profile-batch", "4",
                 "--profile-context", "30", "--out", str(out)]) == 0
    thr = json.loads(out.read_text())
    log = json.loads((logdir / "step_log.json").read_text())
    rows, phases, totals = log["rows"], log["summary"]["phases"], log["summary"]["totals"]
    assert len(rows) == thr["batched"]["steps"] == totals["steps"] == sum(p["steps"] for p in phases.values())
    # CPU: no async scheduling, so no wasted rows: every sampled row is an output token
    assert sum(r["sampled"] for r in rows) == thr["total_output_tokens"] == totals["output_tokens"]
    assert sum(p["sampled_rows"] for p in phases.values()) == totals["sampled_rows"] == totals["output_tokens"]
    assert sum(r["prefill_tokens"] for r in rows) == thr["total_input_tokens"]
    assert all(r["prefill_tokens"] <= 64 and r["decode_rows"] <= 4 for r in rows)
    assert {r["kind"] for r in rows} >= {"prefill", "mixed", "decode"}
    assert "prefill-containing steps" in phases and "decode, synchronous" in phases   # CPU: never overlapped
    assert sum(p["wall_s"] for p in phases.values()) == pytest.approx(totals["wall_s"])
    prof = json.loads((logdir / "kernel_profile.json").read_text())
    assert prof["prefill"]["steps"] == 1 and prof["prefill"]["launched"]["prefill_tokens"] == 64
    dec = prof["decode"]
    assert dec["steps"] == 3 and dec["launched"]["decode_rows"] == 12 and dec["target_reached"]
    assert dec["mean_decode_context"] >= 30 and dec["launched"]["prefill"] == 0
    assert dec["categories_us"]["sampler"] > 0 and dec["busy_us"] <= dec["span_us"]
    assert "| prefill-containing steps |" in (logdir / "step_log.md").read_text()


def test_kernel_profile_leaves_the_engine_as_it_was(tmp_path):
    """profile_kernels puts back the engine's own sampler and executor methods: the engine
    generates the same greedy tokens afterwards."""
    from ferrum import LLM, SamplingParams
    from ferrum.benchmarks.step_log import profile_kernels
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=2, vocab=300, max_pos=512)
    llm = LLM(folder, progress=False, max_num_seqs=4, threads=1)
    prompts = [[5 + i] * (20 + 5 * i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    sampler, decode = llm.engine.sampler, llm.engine.executor.decode
    prof = profile_kernels(llm, prompts, [sp] * 4, decode_batch=4, decode_context=25)
    assert prof["decode"]["steps"] == 3 and not llm.engine.has_unfinished_requests()
    assert llm.engine.sampler is sampler and llm.engine.executor.decode == decode
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == before
    llm.shutdown()


def test_kernel_profile_split_on_device_events():
    """The CUDA split of a profiler window: kernels go to their category by name, every kernel
    launched under the sampler's range is "sampler", annotations are not kernels, and idle
    time is the span minus the union of (possibly overlapping) kernel intervals."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType
    from ferrum.benchmarks.step_log import split_profile

    def cpu(name, id_, parent=None):
        return NS(name=name, id=id_, device_type=DeviceType.CPU, kernels=[], cpu_parent=parent)

    def gpu(name, start, end, corr):
        return NS(name=name, device_type=DeviceType.CUDA, time_range=NS(start=start, end=end),
                  linked_correlation_id=corr, is_user_annotation=False)
    decode, sampler = cpu("ferrum::decode", 1), cpu("ferrum::sampler", 2)
    argmax = cpu("aten::argmax", 3, sampler)
    events = [decode, sampler, argmax, cpu("cudaGraphLaunch", 10, decode), cpu("cudaLaunchKernel", 11, argmax),
              gpu("_decode_split_kernel", 0, 40, 10), gpu("_gemv_kernel", 30, 100, 10),   # overlapping (PDL)
              gpu("reduce_kernel", 120, 130, 11),
              NS(name="ferrum::decode", device_type=DeviceType.CUDA, time_range=NS(start=0, end=200),
                 linked_correlation_id=0, is_user_annotation=True)]
    res = split_profile(NS(events=lambda: events), 2, on_cuda=True)
    assert res["categories_us"] == {"gemm/gemv": 35.0, "decode attention": 20.0, "sampler": 5.0}
    assert res["span_us"] == 65.0 and res["busy_us"] == 55.0 and res["idle_us"] == 10.0


def test_vllm_peer_gets_the_kv_cache_dtype_the_driver_ignores(tmp_path):
    """vllm_bench.py has no KV-dtype switch (the FP8 x FP8-KV throughput run of 2026-12-02 got a
    bf16 KV cache from it): VB_KV in --peer-env reaches vllm.LLM as kv_cache_dtype, next to
    enable_prefix_caching=False when asked, and the result says which KV dtype ran."""
    from types import SimpleNamespace
    from ferrum.benchmarks.peers import run_vllm
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("calls = []\nclass LLM:\n    def __init__(self, *a, **k):\n"
                                              "        calls.append(k)\n")
    (tmp_path / "vllm_bench.py").write_text(textwrap.dedent("""
        import json, sys, vllm
        vllm.LLM("m", load_format="dummy")
        print("VLLMPEER", json.dumps({"section": sys.argv[1], "llm_kwargs": vllm.calls, "output_tok_s": 1.0}))
        """))
    args = SimpleNamespace(peers_dir=str(tmp_path), peer_timeout=60,
                           peer_env=[f"PYTHONPATH={site}", "VB_QUANT=fp8", "VB_KV=fp8"])
    got = run_vllm(args, "throughput")
    assert got["llm_kwargs"] == [{"load_format": "dummy", "kv_cache_dtype": "fp8"}], got
    assert got["kv_cache_dtype"] == "fp8" and got["section"] == "throughput"
    got = run_vllm(args, "latency", prefix_caching=False)
    assert got["llm_kwargs"] == [{"load_format": "dummy", "kv_cache_dtype": "fp8", "enable_prefix_caching": False}]
    args.peer_env = [f"PYTHONPATH={site}"]
    got = run_vllm(args, "throughput")
    assert got["llm_kwargs"] == [{"load_format": "dummy"}] and "kv_cache_dtype" not in got


def test_busy_process_command_lines_are_one_line():
    """The load note names other busy processes by their command line: a `python -c` script's
    newlines printed as line breaks in the middle of the bench output (12-02 fresh-user run)."""
    import subprocess
    import sys
    import time
    from ferrum.benchmarks.run_record import _proc_text
    child = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while "sleep" not in (text := _proc_text(child.pid, "cmdline")) and time.monotonic() < deadline:
            time.sleep(0.05)   # until the child has exec'd
        assert text.endswith("-c import time time.sleep(30)") and "\n" not in text, text
    finally:
        child.kill()
        child.wait()


def test_sched_sim_replays_a_pool_that_preempts():
    """benchmarks/sched_sim.py drives the real Scheduler through a fixed-length workload: every
    token computed at least once, preemptions only when the pool is short, and every block free
    at the end (a policy change shows up in its counts before a GPU run)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sched_sim.py"
    spec = importlib.util.spec_from_file_location("sched_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    # 40 x (64 in, 64 out) in 60 blocks of 8 (480 slots: ~3.75 whole sequences) at 16 sequences
    short = sim.simulate(40, 64, 64, kv_blocks=60, block_size=8, max_num_seqs=16, max_num_batched_tokens=256)
    assert short["free_blocks_at_end"] == 60
    assert short["preemptions"] > 0 and short["computed_tokens"] > short["ideal_tokens"]
    roomy = sim.simulate(40, 64, 64, kv_blocks=400, block_size=8, max_num_seqs=16, max_num_batched_tokens=256)
    assert roomy["preemptions"] == 0 and roomy["computed_tokens"] == roomy["ideal_tokens"] == 40 * 127
    assert roomy["free_blocks_at_end"] == 400 and roomy["estimated_s"] > 0


def test_decode_timing_benches_refuse_output_len_1_at_parse_time(capsys):
    """latency's TPOT and sweep's step time need a decode step, i.e. a second generated token:
    `--output-len 1` gave latency a 0.04 ms TPOT (25k tok/s, MBU 100% of a 'measured' roofline)
    and crashed sweep after the model loaded (no median of an empty list)."""
    from ferrum.entrypoints.cli import build_parser
    parser = build_parser()
    for bench in ("latency", "sweep"):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["bench", bench, "m", "--output-len", "1"])
        assert info.value.code == 2, bench
        assert "expected a whole number >= 2" in capsys.readouterr().err, bench
        assert parser.parse_args(["bench", bench, "m", "--output-len", "2"]).output_len == 2
    assert parser.parse_args(["bench", "throughput", "m", "--output-len", "1", "1"]).output_len == [1, 1]


def test_bench_counts_and_lengths_are_whole_numbers_at_parse_time(capsys):
    """Every count / length flag of `ferrum bench` refuses 0 and negatives before a model loads
    (`--batch-sizes 0` crashed sweep after loading: no median of an empty list)."""
    from ferrum.entrypoints.cli import build_parser
    parser = build_parser()
    for argv in (["sweep", "m", "--batch-sizes", "4", "0"], ["latency", "m", "--tp-sizes", "0"],
                 ["latency", "m", "--peer-tp-sizes", "-2"], ["ttft", "m", "--prompt-lens", "0"],
                 ["serve", "m", "--repeat", "0"], ["serve", "m", "--max-concurrency", "-1"],
                 ["throughput", "m", "--profile-batch", "0"], ["throughput", "m", "--profile-context", "0"]):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(["bench", *argv])
        assert info.value.code == 2, argv
        assert "expected a whole number >= 1" in capsys.readouterr().err, argv
