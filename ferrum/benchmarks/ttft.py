"""`ferrum bench ttft`: time to first token at batch 1 for several prompt lengths, measured as
vLLM's peer driver measures it (`vllm_bench.py latency`, VB_P = prompt length), with vLLM side
by side (`--peers vllm`).

TTFT = wall time of `LLM.generate([prompt], max_tokens=1)` (submission to the finished
one-token request, prefill + sampling + the engine's bookkeeping); two 16-token warm-up runs
first; best and median over `--num-iters`. Two modes, because vLLM's driver repeats one prompt
and vLLM (V1) caches prefixes by default, so its figure is a prefix-cache hit:

  cached  the same prompt every time, as the driver does: all full blocks but the last come
          from the prefix cache (ferrum and vLLM both keep the last prompt token uncached), so
          the step computes only the tail (`computed_tokens` in the JSON)
  cold    a new random prompt every time: the whole prompt is computed (the TTFT a new user
          sees)

vLLM runs once per (length, mode): `cached` runs the driver as is, `cold` runs it with
`enable_prefix_caching=False` added to its `LLM(...)` (`--vllm-modes`; each run starts vLLM,
about a minute). Ratios `ttft_<mode>_vs_vllm` are vLLM's TTFT / ferrum's (> 1: ferrum faster),
best against best (the driver reports its best of 3).
"""
from __future__ import annotations

import statistics
import sys
import time

from tqdm import tqdm

from ferrum.benchmarks.common import add_common_args, llm_from_config, positive_int, random_prompts, sync_device
from ferrum.benchmarks.run_record import record, setup_threads, write_json
from ferrum.benchmarks.peers import add_peer_args, ratio, run_vllm

MODES = ("cached", "cold")


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench ttft` and its flags."""
    p = subparsers.add_parser("ttft", help="batch-1 time to first token at several prompt lengths, vLLM side by side")
    add_engine_args(p)
    p.add_argument("--prompt-lens", type=positive_int, nargs="+", default=[128, 1024, 7500],
                   help="prompt lengths in tokens (the long one 7500, not 8192: the vLLM peer driver "
                        "also decodes 512 tokens after it, and Llama-3-8B's positions end at 8192; "
                        "at 8000 vLLM died with a device-side assert on the H200, positions past 8192 "
                        "the likely cause)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="ferrum's modes (see above)")
    p.add_argument("--vllm-modes", nargs="*", default=["cold"], choices=MODES,
                   help="modes vLLM runs in with --peers vllm (one vLLM start per length and mode)")
    p.add_argument("--num-iters", type=positive_int, default=5, help="timed runs per length and mode")
    p.add_argument("--profile-dir", default=None,
                   help="also write a torch.profiler trace (chrome JSON) of one cold prefill per length here (default: no trace)")
    add_peer_args(p)
    add_common_args(p)
    p.set_defaults(func=main)


def time_first_token(llm, prompt: list[int], device: str) -> tuple[float, int]:
    """(seconds, prompt tokens computed) of one `generate([prompt], max_tokens=1)`."""
    from ferrum.sampling_params import SamplingParams
    sync_device(device)
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    sync_device(device)
    dt = time.perf_counter() - t
    assert len(out.outputs[0].token_ids) == 1
    return dt, len(prompt) - out.num_cached_tokens


def measure(llm, prompt_len: int, mode: str, iters: int, vocab: int, device: str, seed: int) -> dict:
    """TTFT of `iters` runs in `mode` after two 16-token warm-ups: best / median / all (ms) and
    the prompt tokens each run computed."""
    from ferrum.sampling_params import SamplingParams
    fixed = random_prompts(1, prompt_len, vocab, seed)[0]
    for _ in range(2):
        llm.generate([fixed], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    times, computed = [], []
    # progress on stderr, outside the timed call: a cold 7,500-token prompt takes ~1 min on a CPU
    for it in tqdm(range(iters), desc=f"TTFT P={prompt_len} {mode}", unit="run", leave=False, dynamic_ncols=True):
        prompt = fixed if mode == "cached" else random_prompts(1, prompt_len, vocab, seed + 1 + it)[0]
        dt, n = time_first_token(llm, prompt, device)
        times.append(1e3 * dt)
        computed.append(n)
    return {"ttft_ms_best": min(times), "ttft_ms_median": statistics.median(times), "ttft_ms_all": times,
            "computed_tokens": computed, "prefill_tok_s_best": prompt_len / min(times) * 1e3 if mode == "cold" else None}


def _profile(llm, prompt_len: int, vocab: int, device: str, seed: int, folder: str) -> str:
    """One cold first token under torch.profiler (CPU + CUDA activities): chrome trace path."""
    import os
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    prompt = random_prompts(1, prompt_len, vocab, seed + 999)[0]
    with profile(activities=acts) as prof:
        time_first_token(llm, prompt, device)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"ttft_p{prompt_len}.json")
    prof.export_chrome_trace(path)
    return path


def main(args) -> int:
    """ferrum's TTFT per length and mode, then vLLM's (with --peers vllm); print and write the
    record. Returns 2 when a prompt does not fit max_model_len."""
    from ferrum.entrypoints.args import config_from_args
    setup_threads(args.threads)
    config = config_from_args(args)
    longest = max(args.prompt_lens)
    # one prefill step per prompt, as vLLM's default token budget allows
    config.scheduler.max_num_batched_tokens = max(config.scheduler.max_num_batched_tokens, longest)
    llm = llm_from_config(config)
    eng = llm.engine
    device = str(eng.executor.info().device)
    if longest + 16 > eng.max_model_len:
        print(f"ferrum bench ttft: error: prompt length {longest} + 16 exceeds max_model_len "
              f"{eng.max_model_len}; lower the lengths or raise --max-model-len", file=sys.stderr)
        eng.shutdown()
        return 2
    vocab = eng.model_config.vocab_size
    res = {"model": eng.model_name, "batch_size": 1, "prompt_lens": args.prompt_lens, "num_iters": args.num_iters,
           "max_num_batched_tokens": config.scheduler.max_num_batched_tokens, "ferrum": {}, "profiles": {}}
    for P in args.prompt_lens:
        row = {}
        for mode in args.modes:
            row[mode] = measure(llm, P, mode, args.num_iters, vocab, device, args.seed + P)
            print(f"ferrum TTFT P={P} {mode}: best {row[mode]['ttft_ms_best']:.2f} ms, median "
                  f"{row[mode]['ttft_ms_median']:.2f} ms (computed {row[mode]['computed_tokens'][-1]} tokens)",
                  flush=True)
        res["ferrum"][str(P)] = row
        if args.profile_dir:
            res["profiles"][str(P)] = _profile(llm, P, vocab, device, args.seed, args.profile_dir)
    eng.shutdown()
    del llm, eng
    if "vllm" in (args.peers or ()):
        # ferrum's figures first: a peer run cut short at a time limit keeps them
        write_json(args.out, record("ttft", args, device, {**res, "vllm": "pending"}))
        res["vllm"], res["ratios"] = {}, {}
        for P in args.prompt_lens:
            res["vllm"][str(P)] = {m: run_vllm(args, "latency", 1, P, prefix_caching=m == "cached")
                                   for m in args.vllm_modes}
            r = {}
            for m in args.vllm_modes:
                peer = res["vllm"][str(P)][m].get("ttft_ms")
                ours = res["ferrum"][str(P)].get(m, {}).get("ttft_ms_best")
                r[f"ttft_{m}_vs_vllm"] = ratio(ours, peer, higher_is_better=False)
                print(f"vLLM TTFT P={P} {m}: {peer} ms -> ferrum/vLLM advantage {r[f'ttft_{m}_vs_vllm']}", flush=True)
            res["ratios"][str(P)] = r
    write_json(args.out, record("ttft", args, device, res))
    return 0
