"""GPU benchmark suite for the H200 machines (issues: TP executor, GPU speed).

    python benchmarks/h200_suite.py latency sweep throughput nanovllm --out $OUT

Every section writes `<out>/<section>.json` (command, date, GPU, figures) and, where it makes
sense, a PNG. All models are dummy (random) weights of the real configs in benchmarks/configs,
bf16. Peers run in the same process: HF transformers `generate` for latency; ferrum
one-at-a-time for throughput. MBU is per rank: bytes read per decode step (weights excluding the
input-embedding table, which is gathered not read, plus the KV cache read) x steps/s, over the
measured 4.35 TB/s bf16 GEMV roofline of GUIDE section 7 (also given against the 4.8 TB/s spec).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
ROOFLINE = 4.35e12
SPEC_BW = 4.8e12


def cfg_path(name):
    return os.path.join(HERE, "configs", f"{name}.json")


def meta(args):
    return {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "env": {k: os.environ.get(k) for k in
                                                ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                 "FERRUM_DISABLE_SYMM_MEM")}}


def save(args, name, data):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({**meta(args), **data}, f, indent=1)
    print(f"== {name}: {json.dumps(data)[:3000]}", flush=True)


def make_llm(model, tp, **kw):
    from ferrum import LLM
    print(f"  [{time.strftime('%H:%M:%S')}] building {model} tp={tp} {kw}", flush=True)
    return LLM(f"dummy:{cfg_path(model)}", progress=False, tensor_parallel_size=tp, dtype="bfloat16",
               device="cuda", **kw)


def free(llm):
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def bytes_per_step(llm, ctx_len):
    ex = llm.engine.executor
    cfg = ex.cfg
    mem = ex.memory
    e = 2
    emb = -(-cfg.vocab_size // ex.tp) * cfg.hidden_size * e
    return mem.param_bytes - emb + ctx_len * mem.kv_bytes_per_token


def timed_generate(llm, prompts, max_tokens):
    """Run prompts (token-id lists) through the engine; returns per-request (ttft, tpot), the
    wall time, and the decode throughput after the last first token."""
    from ferrum import SamplingParams
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [eng.add_request(None, None, sp, prompt_token_ids=p) for p in prompts]
    first, last, ntok = {}, {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            now = time.perf_counter()
            if o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = now
            ntok[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                last[o.request_id] = now
    t1 = time.perf_counter()
    tpots = [(last[r] - first[r]) / max(1, ntok[r] - 1) for r in ids]
    ttfts = [first[r] - t0 for r in ids]
    return {"wall_s": t1 - t0, "ttft_s": ttfts, "tpot_s": tpots,
            "output_tokens": sum(ntok.values()),
            "decode_tokens_per_s_after_prefill": sum(ntok[r] - 1 for r in ids) / max(1e-9, t1 - min(first.values()))}


def rand_prompts(n, lo, hi, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_generate_tps(model, prompt_len, new_tokens):
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(cfg_path(model))
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(10, cfg.vocab_size - 10, (1, prompt_len), device="cuda")
    with torch.no_grad():
        m.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    del m
    gc.collect()
    torch.cuda.empty_cache()
    ttft = t1 - t0
    return {"ttft_s": ttft, "tokens_per_s": (new_tokens - 1) / ((t2 - t1) - ttft), "new_tokens": new_tokens}


def replay_ms(llm):
    """GPU time of one batch-1 decode graph replay (no host work): TPOT minus this is host overhead."""
    g, _ = llm.engine.executor.runner.graphs.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(50):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def sec_latency(args):
    model, P, G = args.model, args.input_len, args.output_len
    res = {"model": model, "input_len": P, "output_len": G, "batch": 1, "runs": {}}
    for tp in args.tp:
        if tp > torch.cuda.device_count():
            continue
        for eager in ([False, True] if args.with_eager else [False]):
            llm = make_llm(model, tp, max_num_seqs=8, max_model_len=P + G + 16, enforce_eager=eager)
            vocab = llm.engine.vocab_size
            timed_generate(llm, rand_prompts(1, P, P, vocab, 1), 16)  # warm-up
            r = timed_generate(llm, rand_prompts(1, P, P, vocab, 2), G)
            tps = 1.0 / r["tpot_s"][0]
            gpu_ms = replay_ms(llm) if tp == 1 and not eager else None
            b = bytes_per_step(llm, P + G // 2)
            key = f"tp{tp}" + ("_eager" if eager else "")
            res["runs"][key] = {"decode_tokens_per_s": tps, "tpot_ms": 1000 * r["tpot_s"][0],
                                "ttft_ms": 1000 * r["ttft_s"][0], "bytes_per_step_per_rank": b,
                                "mbu_vs_4.35TBs": b * tps / ROOFLINE, "mbu_vs_4.8TBs_spec": b * tps / SPEC_BW,
                                "symm_mem": getattr(llm.engine.executor, "symm_mem", None),
                                "graph_replay_ms_batch1": gpu_ms,
                                "cuda_graphs": llm.engine.executor.capabilities().cuda_graphs}
            print(key, res["runs"][key], flush=True)
            free(llm)
    if "tp1" in res["runs"] and "tp2" in res["runs"]:
        res["tp2_speedup"] = res["runs"]["tp2"]["decode_tokens_per_s"] / res["runs"]["tp1"]["decode_tokens_per_s"]
    if args.hf:
        res["hf_transformers"] = hf_generate_tps(model, P, args.hf_tokens)
        res["ratio_vs_hf"] = res["runs"]["tp1"]["decode_tokens_per_s"] / res["hf_transformers"]["tokens_per_s"]
    res["gpt_fast_reference_tok_s"] = {"tp1": 192.9, "tp2": 194.5, "source": "GUIDE section 7, same machines"}
    if "tp1" in res["runs"]:
        res["ratio_vs_gpt_fast_tp1"] = res["runs"]["tp1"]["decode_tokens_per_s"] / 192.9
    save(args, f"latency_{model}", res)


def sec_sweep(args):
    model = args.model
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= args.max_batch]
    res = {"model": model, "input_len": 128, "output_len": args.sweep_tokens, "points": {}}
    for tp in args.tp:
        if tp > torch.cuda.device_count():
            continue
        llm = make_llm(model, tp, max_num_seqs=max(sizes), max_model_len=128 + args.sweep_tokens + 16,
                       max_num_batched_tokens=8192)
        vocab = llm.engine.vocab_size
        timed_generate(llm, rand_prompts(4, 128, 128, vocab, 9), 8)
        pts = []
        for B in sizes:
            r = timed_generate(llm, rand_prompts(B, 128, 128, vocab, B), args.sweep_tokens)
            tpot = sorted(r["tpot_s"])[len(r["tpot_s"]) // 2]
            tps = B / tpot
            b = bytes_per_step(llm, B * (128 + args.sweep_tokens // 2))
            pts.append({"batch": B, "decode_tokens_per_s": tps, "tpot_ms": 1000 * tpot,
                        "mbu_vs_4.35TBs": b / tpot / ROOFLINE})
            print(f"tp{tp}", pts[-1], flush=True)
        res["points"][f"tp{tp}"] = pts
        free(llm)
    save(args, f"sweep_{model}", res)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for k, pts in res["points"].items():
            ax[0].plot([p["batch"] for p in pts], [p["decode_tokens_per_s"] for p in pts], "o-", label=k)
            ax[1].plot([p["batch"] for p in pts], [100 * p["mbu_vs_4.35TBs"] for p in pts], "o-", label=k)
        for a, t in zip(ax, ("decode tokens/s", "MBU % (per rank, vs 4.35 TB/s)")):
            a.set_xscale("log", base=2); a.set_xlabel("batch"); a.set_title(t); a.legend(); a.grid(alpha=.3)
        fig.suptitle(f"ferrum {model} bf16 on {torch.cuda.get_device_name(0)}")
        fig.savefig(os.path.join(args.out, f"sweep_{model}.png"), dpi=110, bbox_inches="tight")
    except ImportError:
        pass


def _time_steps_by_kind(eng) -> dict:
    """Wrap eng.step to add up wall time per kind of step: 'prefill' (the step ran a prefill
    chunk, possibly with decodes) or 'decode' (decodes only), with the prefill tokens and
    decode rows they ran. Returns the dict it fills in."""
    split = {kind: {"steps": 0, "s": 0.0, "prefill_tokens": 0, "decode_rows": 0} for kind in ("prefill", "decode")}
    ex, step, prefill, decode = eng.executor, eng.step, eng.executor.prefill, eng.executor.decode
    now = {"prefill": 0, "decode": 0}

    def counted_prefill(inp):
        now["prefill"] += sum(map(len, inp.token_ids))
        return prefill(inp)

    def counted_decode(inp):
        now["decode"] += len(inp.token_ids)
        return decode(inp)

    def timed(*a, **k):
        now["prefill"] = now["decode"] = 0
        t = time.perf_counter()
        out = step(*a, **k)
        dt = time.perf_counter() - t
        row = split["prefill" if now["prefill"] else "decode"]
        row["steps"] += 1
        row["s"] += dt
        row["prefill_tokens"] += now["prefill"]
        row["decode_rows"] += now["decode"]
        return out
    ex.prefill, ex.decode, eng.step = counted_prefill, counted_decode, timed
    return split


def sec_throughput(args):
    model = args.model
    n, P, G = args.num_requests, args.tp_input, args.tp_output
    llm = make_llm(model, 1, max_num_seqs=256, max_model_len=P + G + 16, max_num_batched_tokens=8192)
    vocab = llm.engine.vocab_size
    prompts = rand_prompts(n, P, P, vocab, 3)
    from ferrum import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=G, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    split = _time_steps_by_kind(llm.engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)  # the bar's tok/s is in the log if time runs out
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    st = llm.engine.status()
    res = {"model": model, "requests": n, "input_len": P, "output_len": G, "wall_s": dt,
           "output_tokens_per_s": toks / dt, "total_tokens_per_s": (toks + n * P) / dt,
           "preemptions": st["num_preemptions"], "kv_blocks": st["kv_blocks_total"],
           "overlapped_steps": st["overlapped_steps"], "step_time_split": split}
    free(llm)
    save(args, f"throughput_{model}_{n}x{P}x{G}", res)


def sec_nanovllm(args):
    """nano-vllm's bench.py workload: 256 requests, input and output lengths uniform in 100..1024."""
    model = "qwen3-0.6b"
    llm = make_llm(model, 1, max_num_seqs=256, max_model_len=4096, max_num_batched_tokens=16384)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outs_len = [rng.randint(100, 1024) for _ in range(256)]
    from ferrum import SamplingParams
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in outs_len]
    llm.generate(["Benchmark: "] if llm.tokenizer else [[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sps, use_tqdm=True)
    dt = time.perf_counter() - t0
    res = {"model": model, "requests": 256, "output_tokens": sum(outs_len), "wall_s": dt,
           "output_tokens_per_s": sum(outs_len) / dt}
    free(llm)
    save(args, "nanovllm_qwen3-0.6b", res)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sections", nargs="+", choices=["latency", "sweep", "throughput", "nanovllm"])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--hf", action="store_true")
    p.add_argument("--hf-tokens", type=int, default=64)
    p.add_argument("--with-eager", action="store_true")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--sweep-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--tp-input", type=int, default=1000)
    p.add_argument("--tp-output", type=int, default=1000)
    args = p.parse_args()
    run_sections(args, globals(), lambda s, e: save(args, f"failed_{s}", {"error": f"{type(e).__name__}: {e}"}))


def run_sections(args, namespace: dict, on_error=None) -> None:
    """Run `namespace["sec_<name>"](args)` for each of args.sections, timing each; a section
    that raises is reported (and passed to on_error) and the others still run, so a long GPU
    call returns every figure it could make."""
    for s in args.sections:
        t = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {s} ...", flush=True)
        try:
            namespace[f"sec_{s}"](args)
        except Exception as e:
            import traceback
            traceback.print_exc()
            if on_error is not None:
                on_error(s, e)
        print(f"[{s} took {time.perf_counter() - t:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
