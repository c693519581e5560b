"""vLLM as the peer of benchmarks/moe_bench.py: the same Qwen3-30B-A3B-shaped dummy model and the
same workloads and timing (latency: ../shared/peers/vllm_bench.py's method; batch256;
nanovllm), run where vLLM 0.22.1 is importable (see ../shared/peers/README.md):

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/vllm_moe_peer.py [SECTION...]

Sections latency, batch256, nanovllm (default all), on one engine configured as moe_bench.py's
(256 sequences, 4096 positions, 16384-token steps). Prints one `VLLMPEER {json}` line per
section and writes $OUT/vllm_moe_<section>.json (vLLM leaves workers behind: run it under
`setsid` and kill its group after).
"""
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sections = sys.argv[1:] or ["latency", "batch256", "nanovllm"]
MODEL, P_LAT = "qwen3-30b-a3b", 128


def model_dir():
    d = f"/tmp/models/{MODEL}-bf16"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(HERE, "configs", f"{MODEL}.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def run(llm, prompts, n, temperature=0.0):
    sp = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t


def latency(llm):
    rng = random.Random(2)
    p = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 128000) for _ in range(P_LAT)])]
    run(llm, p, 16)
    run(llm, p, 16)
    t1 = min(run(llm, p, 1) for _ in range(3))
    tn = min(run(llm, p, 512) for _ in range(3))
    return dict(prompt_len=P_LAT, ttft_ms=1e3 * t1, decode_tok_s=511 / (tn - t1), e2e_512_s=tn)


def batch256(llm):
    B, G = 256, 128
    rng = random.Random(3)
    ps = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 128000) for _ in range(P_LAT)]) for _ in range(B)]
    run(llm, ps[:16], 8)
    t1 = min(run(llm, ps, 1) for _ in range(2))
    tg = min(run(llm, ps, G) for _ in range(2))
    return dict(batch=B, prompt_len=P_LAT, new_tokens=G, prefill_s=t1, total_s=tg, decode_tok_s=B * (G - 1) / (tg - t1))


def nanovllm(llm):
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outs = [rng.randint(100, 1024) for _ in range(256)]
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, detokenize=False) for m in outs]
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sps, use_tqdm=False)
    dt = time.perf_counter() - t
    return dict(output_tokens=sum(outs), wall_s=dt, output_tok_s=sum(outs) / dt)


# one engine for every section, configured as moe_bench.py's shared engine
llm = LLM(model_dir(), load_format="dummy", dtype="bfloat16", max_model_len=4096, skip_tokenizer_init=True,
          gpu_memory_utilization=0.9, max_num_seqs=256, max_num_batched_tokens=16384)
for sec in sections:
    out = {"peer": "vllm", "section": sec, "model": MODEL, **globals()[sec](llm)}
    print("VLLMPEER", json.dumps(out), flush=True)
    d = os.environ.get("OUT")
    if d:
        with open(os.path.join(d, f"vllm_moe_{sec}.json"), "w") as f:
            f.write(json.dumps(out, indent=1))
sys.stdout.flush()
os._exit(0)
