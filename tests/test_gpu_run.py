"""benchmarks/gpu_run.sh, the issue-16 GPU run, dry-run on CPU: tiny dummy models, fake peer
drivers that check what they are handed (vLLM's site on PYTHONPATH, the NVLink-multicast
switches, vLLM's prefix cache off in TTFT's cold mode), so a typo in a flag fails here and not on
the GPU machine; a section cut at its time limit is recorded and the next one still runs."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = {"vocab_size": 12000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}


def _fake_peers(tmp) -> tuple[str, str]:
    """(peers folder, vLLM site folder): drivers printing the peers' result lines."""
    peers, site = tmp / "peers", tmp / "vsite"
    (peers / "gptfast").mkdir(parents=True)
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent("""
        calls = []
        class LLM:
            def __init__(self, *a, **k):
                calls.append(k)
        """))
    (peers / "vllm_bench.py").write_text(textwrap.dedent(f"""
        import json, os, sys, time
        sec, tp = sys.argv[1], int(sys.argv[2])
        assert os.environ["PYTHONPATH"] == {str(site)!r}
        assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and os.environ["NCCL_NVLS_ENABLE"] == "0"
        import vllm
        vllm.LLM("m", load_format="dummy")
        time.sleep(float(os.environ.get("FAKE_PEER_SLEEP", 0)))
        out = {{"section": sec, "tp": tp, "llm_kwargs": vllm.calls, "ttft_ms": 1.0, "decode_tok_s": 100.0,
               "output_tok_s": 100.0, "prompt_len": int(os.environ.get("VB_P", 128))}}
        print("VLLMPEER", json.dumps(out), flush=True)
        """))
    (peers / "gptfast" / "peer_bench.py").write_text(textwrap.dedent(f"""
        import json, os
        assert os.environ["PYTHONPATH"] == {str(site)!r}
        print("GPTFAST", json.dumps({{"best_decode_tok_s": 50.0, "P": int(os.environ["GF_P"])}}), flush=True)
        """))
    return str(peers), str(site)


def _run(tmp, sections: list[str], **env) -> tuple[subprocess.CompletedProcess, str]:
    llama = tmp / "llama.json"
    llama.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    peers, site = _fake_peers(tmp)
    out = tmp / "out"
    full_env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "DEVICE": "cpu", "LLAMA": str(llama),
                "PEERS_DIR": peers, "VLLM_SITE": site, "LAT_IN_LEN": "32", "LAT_OUT_LEN": "8",
                "TTFT_LENS": "16 40", "FORCE_TP2": "1", "FERRUM_GIT_COMMIT": "test123", **env}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_run.sh"), *sections], env=full_env,
                          capture_output=True, text=True, timeout=900)
    return proc, str(out)


OVER_LIMIT = "test_gpu_run_section_over_its_limit_keeps_ferrum_figures_and_goes_on"


@pytest.fixture(scope="module", autouse=True)
def over_limit_run(request, tmp_path_factory):
    """(its folder, Future of `_run`'s result) of the over-limit test's run, started with the
    module when that test is selected: most of that run waits out the section's limit, and the
    other tests' runs use the cores meanwhile."""
    if not any(getattr(it, "originalname", None) == OVER_LIMIT for it in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("over_limit")
    with ThreadPoolExecutor(1) as pool:
        yield tmp, pool.submit(_run, tmp, ["latency", "tests"], FAKE_PEER_SLEEP="600", LIMIT_latency="45")


def test_gpu_run_sections_dry_run_on_cpu(tmp_path):
    proc, out = _run(tmp_path, ["ttft", "tp2", "sweep"], SMALL=str(tmp_path / "llama.json"),
                     SWEEP_BATCHES="1 2", SWEEP_IN_LEN="16", SWEEP_OUT_LEN="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = open(os.path.join(out, "summary.txt")).read()
    for sec in ("ttft", "tp2", "sweep"):
        assert f"{sec}: exit 0" in summary, summary
    sweep = json.load(open(os.path.join(out, "sweep.json")))
    assert [p["batch"] for p in sweep["points"]] == [1, 2], sweep
    ttft = json.load(open(os.path.join(out, "ttft.json")))
    assert set(ttft["ferrum"]) == {"16", "40"}
    for p in ("16", "40"):
        cold = ttft["vllm"][p]["cold"]
        assert cold["prompt_len"] == int(p) and cold["llm_kwargs"] == [{"load_format": "dummy",
                                                                        "enable_prefix_caching": False}]
        assert ttft["ratios"][p]["ttft_cold_vs_vllm"] > 0
    tp2 = json.load(open(os.path.join(out, "tp2.json")))
    assert tp2["environment"]["FERRUM_GIT_COMMIT"] == "test123" and tp2["environment"]["NCCL_NVLS_ENABLE"] == "0"
    assert tp2["ratios"]["tp2_speedup"] > 0 and set(tp2["peers"]) == {"vllm_tp2"}
    assert tp2["ratios"]["tp2"]["decode_tok_s_vs_vllm"] > 0 and "tp1" not in tp2["ratios"]   # no peer at TP=1
    assert "== command:" in open(os.path.join(out, "tp2.log")).read()


def test_gpu_run_section_over_its_limit_keeps_ferrum_figures_and_goes_on(over_limit_run):
    """The latency section's vLLM run outlasts the section's limit: SIGINT ends it (no peer left),
    ferrum's own figures are on disk, the summary says so, and the next section runs."""
    tmp_path, run = over_limit_run   # (started by the fixture: LIMIT_latency 45, a peer that sleeps 600 s)
    proc, out = run.result()
    summary = open(os.path.join(out, "summary.txt")).read()
    assert "latency: TIMED OUT after 45 s" in summary, summary + proc.stdout + proc.stderr
    lat = json.load(open(os.path.join(out, "latency.json")))
    assert lat["partial"] and lat["peers"] == {} and lat["ferrum"]["decode_tok_s"] > 0
    assert "tests: exit 0" in summary    # pytest -m gpu: collected, all skipped on CPU
    found = subprocess.run(["pgrep", "-f", str(tmp_path / "peers")], capture_output=True, text=True).stdout
    assert not found.strip(), f"peer processes left: {found}"


def test_large_throughput_sections_skip_the_one_at_a_time_phase():
    """The tput / fp8 sections time 1000 prompts: `ferrum bench throughput` must not then run them
    one at a time (its default sequential phase), which outlasted the section's limit on the
    H200 (2026-12-01, the vLLM peer never ran)."""
    script = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_run.sh").read_text()
    for sec in ("tput", "fp8"):
        body = script.split(f"    {sec})\n", 1)[1].split(";;", 1)[0]
        assert "bench throughput" in body and "--no-sequential" in body, sec


def test_gpu_run_tests_section_survives_a_module_that_cannot_be_imported(tmp_path):
    """A test module whose import fails (the GPU machine lacked jsonschema on 2026-12-02, and
    pytest then ran nothing at all) is one collection error; the other modules still run."""
    broken = tmp_path / "test_needs_missing.py"
    broken.write_text("import a_module_that_is_not_installed\n")
    proc, out = _run(tmp_path, ["tests"], GPU_TESTS=f"{broken} tests/test_sampler.py")
    log = open(os.path.join(out, "tests.log")).read()
    assert "ModuleNotFoundError" in log and "a_module_that_is_not_installed" in log, log[-3000:]
    assert "Interrupted: 1 error during collection" not in log, log[-3000:]
    assert "test_sampler.py" in log and "1 error" in log, log[-3000:]


def test_gpu_run_carries_the_triton_cache(tmp_path):
    """TRITON_CACHE_OUT=1 packs TRITON_CACHE_DIR into $OUT/triton_cache.part.*; a later run with
    those parts in TRITON_CACHE_IN starts with the same files (what the GPU tests' compiles
    leave for the next lease). The section run is a one-test pytest (`tests`, GPU_TESTS)."""
    test = tmp_path / "test_one.py"
    test.write_text("import os, pytest\n\n@pytest.mark.gpu\ndef test_cache_dir():\n"
                    "    assert os.environ['TRITON_CACHE_DIR'].endswith('cache1') or "
                    "os.environ['TRITON_CACHE_DIR'].endswith('cache2')\n")
    cache1 = tmp_path / "cache1"
    (cache1 / "ab12").mkdir(parents=True)
    (cache1 / "ab12" / "k.cubin").write_bytes(os.urandom(3000))
    proc, out = _run(tmp_path, ["tests"], GPU_TESTS=str(test), TRITON_CACHE_DIR=str(cache1), TRITON_CACHE_OUT="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = open(os.path.join(out, "summary.txt")).read()
    assert "tests: exit 0" in summary and "Triton cache: 1 part(s)" in summary, summary
    parts = tmp_path / "carried"
    parts.mkdir()
    for f in pathlib.Path(out).glob("triton_cache.part.*"):
        (parts / f.name).write_bytes(f.read_bytes())
    cache2 = tmp_path / "cache2"
    again = tmp_path / "again"
    again.mkdir()
    proc, _ = _run(again, ["tests"], GPU_TESTS=str(test), TRITON_CACHE_DIR=str(cache2), TRITON_CACHE_IN=str(parts))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Triton cache: 1 files from" in proc.stdout, proc.stdout
    assert (cache2 / "ab12" / "k.cubin").read_bytes() == (cache1 / "ab12" / "k.cubin").read_bytes()


def test_sched_ab_runs_each_tree_from_its_own_folder(tmp_path):
    """benchmarks/sched_ab.sh, dry-run on CPU with a tiny dummy Llama: the old run imports the
    tree in AB_DIR (a marker printed by that tree's ferrum/__init__.py shows in its log only; run
    from the repository root, `python3 -m` would import this tree instead), every run writes its
    JSON under the commit it was given, and the third run (new again) happens."""
    old = tmp_path / "old"
    old.mkdir()
    subprocess.run(f"git -C {ROOT} archive HEAD ferrum | tar -x -C {old}", shell=True, check=True)
    init = old / "ferrum" / "__init__.py"
    init.write_text(init.read_text() + "\nprint('FERRUM OLD TREE')\n")
    cfg = tmp_path / "tiny_llama.json"
    cfg.write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "CFG": str(cfg), "AB_N": "4", "AB_LEN": "8",
           "AB_DIR": str(old), "FERRUM_GIT_COMMIT": "newsha", "AB_COMMIT": "oldsha",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "sched_ab.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    for name, commit in (("new", "newsha"), ("old", "oldsha"), ("new_b", "newsha")):
        assert json.loads((out / f"sched_{name}.json").read_text())["git_commit"] == commit
        assert ("FERRUM OLD TREE" in (out / f"sched_{name}.log").read_text()) == (name == "old"), name
