"""`ferrum bench latency`: prefill and decode speed at a fixed batch (default 1), against HF
transformers `generate` on the same weights, prompt and device, in the same run.

Per iteration, `batch_size` random token-id prompts of `input_len` tokens (new ones each
iteration, so no prefix-cache hit) generate exactly `output_len` tokens greedily (EOS ignored).

  TTFT   time from submitting the batch to its first token (includes the prefill)
  TPOT   (time of the last token - time of the first token) / (output_len - 1), per step
  prefill tok/s = batch * input_len / TTFT; decode tok/s = batch / TPOT
  MBU    = weight bytes read per decode step / TPOT / memory bandwidth (the input-embedding
         table is left out when untied: a lookup reads only the batch's rows). Bandwidth:
         --bandwidth-gbs, default 4800 GB/s (H200 HBM3e) on CUDA; on CPU a measured memcpy
         bandwidth (read + write bytes), which is rough.
HF: TTFT = generate(max_new_tokens=1); TPOT = (generate(output_len) - TTFT) / (output_len - 1).
Medians over --num-iters after one warm-up iteration of each; ferrum and HF iterations
alternate so that changes in machine load affect both alike.
"""
from __future__ import annotations

import statistics
import time

import torch

from ferrum.benchmarks.common import (add_common_args, decode_weight_bytes, fmt_ratio, llm_from_config, load_hf_model,
                                      measure_memcpy_bandwidth, random_prompts, record, setup_threads,
                                      write_json)

H200_BANDWIDTH_GBS = 4800.0


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench latency` and its flags."""
    p = subparsers.add_parser("latency", help="batch-1 prefill/decode speed (TTFT, TPOT, MBU) vs HF transformers")
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device memory bandwidth for MBU (default: 4800 on CUDA, measured memcpy on CPU)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers baseline")
    p.add_argument("--profile", action="store_true", help="print the top torch.profiler ops of one ferrum decode run")
    add_common_args(p)
    p.set_defaults(func=main)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _summary(ttfts: list[float], tpots: list[float], batch: int, input_len: int, output_len: int,
             weight_bytes: int, bw_gbs: float | None) -> dict:
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    out = {"ttft_s": ttft, "tpot_s": tpot,
           "prefill_tok_s": batch * input_len / ttft, "decode_tok_s": batch / tpot,
           "e2e_s": ttft + tpot * (output_len - 1),
           "ttft_s_all": ttfts, "tpot_s_all": tpots}
    out["weight_read_gbs"] = weight_bytes / tpot / 1e9
    out["mbu"] = out["weight_read_gbs"] / bw_gbs if bw_gbs else None
    return out


def ferrum_iter(llm, args, vocab: int, device: str, it: int) -> tuple[float, float]:
    """One batch through LLM.generate -> (TTFT, TPOT) in seconds, from the request metrics."""
    from ferrum import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 * it)
    _sync(device)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    _sync(device)
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    start = min(o.metrics.arrival_time for o in outs)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return first - start, (last - first) / max(1, args.output_len - 1)


def hf_iter(hf, args, vocab: int, device: str, it: int) -> tuple[float, float]:
    """The same prompts through HF generate -> (TTFT, TPOT) in seconds."""
    x = torch.tensor(random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 * it),
                     device=device)
    with torch.inference_mode():
        _sync(device)
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=1, do_sample=False)
        _sync(device)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        g = hf.generate(x, max_new_tokens=args.output_len, do_sample=False)
        _sync(device)
        total = time.perf_counter() - t
    assert g.shape[1] == args.input_len + args.output_len
    return ttft, max(total - ttft, 0.0) / max(1, args.output_len - 1)


def _profile(llm, args, vocab: int) -> None:
    from torch.profiler import profile
    from ferrum import SamplingParams
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + 7)
    with profile() as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=min(16, args.output_len), ignore_eos=True),
                     use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(args) -> int:
    """Run ferrum and HF transformers iterations interleaved (HF unless --no-hf); print and
    optionally write the record; returns the exit status (2: lengths exceed max_model_len)."""
    from ferrum.entrypoints.cli import config_from_args
    from ferrum.model_store import resolve_model

    threads = setup_threads(args.threads)
    config = config_from_args(args)
    llm = llm_from_config(config)
    ex = llm.engine.executor
    info, caps = ex.info(), ex.capabilities()
    device, dtype = str(info.device), ex.dtype
    cfg = llm.engine.model_config
    vocab = cfg.vocab_size
    if args.input_len + args.output_len > llm.engine.max_model_len:
        print(f"input_len + output_len exceeds max_model_len {llm.engine.max_model_len}")
        return 2
    weight_bytes = decode_weight_bytes(caps.memory, cfg, dtype)
    if args.bandwidth_gbs:
        bw, bw_src = args.bandwidth_gbs, "--bandwidth-gbs"
    elif device.startswith("cuda"):
        bw, bw_src = H200_BANDWIDTH_GBS, "default H200 HBM3e 4800 GB/s"
    else:
        bw, bw_src = measure_memcpy_bandwidth(device), "measured memcpy (read+write), rough"
    print(f"model {llm.engine.model_name} ({info.num_params / 1e6:.1f}M params, {info.dtype}) on {device}, "
          f"{threads} threads; weights read per decode step {weight_bytes / 1e6:.1f} MB; "
          f"bandwidth {bw:.1f} GB/s ({bw_src})")
    print(f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}, iters {args.num_iters}")

    model = load_hf_model(resolve_model(config.model), dtype, device) if args.hf else None
    # Interleaved (ferrum, HF, ferrum, HF, ...) so that a change in machine load hits both;
    # iteration 0 of each is a warm-up.
    f_ttft, f_tpot, h_ttft, h_tpot = [], [], [], []
    for it in range(args.num_iters + 1):
        a, b = ferrum_iter(llm, args, vocab, device, it)
        if it:
            f_ttft.append(a)
            f_tpot.append(b)
        if model is not None:
            if device == "cpu":
                # ferrum's CPU linears run on numpy's OpenBLAS, whose workers may still be
                # spinning after its last call; let them park before HF is timed.
                time.sleep(0.5)
            a, b = hf_iter(model, args, vocab, device, it)
            if it:
                h_ttft.append(a)
                h_tpot.append(b)
        if it:
            print(f"iter {it}: ferrum TTFT {1e3 * f_ttft[-1]:.1f} ms TPOT {1e3 * f_tpot[-1]:.2f} ms"
                  + (f" | HF TTFT {1e3 * h_ttft[-1]:.1f} ms TPOT {1e3 * h_tpot[-1]:.2f} ms" if model is not None else ""),
                  flush=True)
    ferrum = _summary(f_ttft, f_tpot, args.batch_size, args.input_len, args.output_len, weight_bytes, bw)
    hf = _summary(h_ttft, h_tpot, args.batch_size, args.input_len, args.output_len, weight_bytes, bw) \
        if model is not None else None
    del model
    if args.profile:
        _profile(llm, args, vocab)

    rows = [("ferrum", ferrum)] + ([("hf", hf)] if hf else [])
    print(f"{'':8} {'TTFT ms':>9} {'TPOT ms':>9} {'prefill tok/s':>14} {'decode tok/s':>13} {'MBU':>7}")
    for name, r in rows:
        mbu = f"{100 * r['mbu']:.1f}%" if r["mbu"] is not None else "n/a"
        print(f"{name:8} {1e3 * r['ttft_s']:9.1f} {1e3 * r['tpot_s']:9.2f} {r['prefill_tok_s']:14.1f} "
              f"{r['decode_tok_s']:13.2f} {mbu:>7}")
    ratios = None
    if hf:
        ratios = {"decode_tok_s": ferrum["decode_tok_s"] / hf["decode_tok_s"],
                  "prefill_tok_s": ferrum["prefill_tok_s"] / hf["prefill_tok_s"],
                  "e2e": hf["e2e_s"] / ferrum["e2e_s"]}
        print(f"ferrum/HF: decode {fmt_ratio(ferrum['decode_tok_s'], hf['decode_tok_s'])}, "
              f"prefill {fmt_ratio(ferrum['prefill_tok_s'], hf['prefill_tok_s'])}, "
              f"end-to-end {fmt_ratio(hf['e2e_s'], ferrum['e2e_s'])}")
    rec = record("latency", args, device, {
        "model": llm.engine.model_name, "dtype": info.dtype, "num_params": info.num_params,
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "weight_bytes_per_decode_step": weight_bytes,
        "bandwidth_gbs": bw, "bandwidth_source": bw_src,
        "ferrum": ferrum, "hf_transformers": hf, "ratio_ferrum_over_hf": ratios})
    write_json(args.out, rec)
    llm.engine.shutdown()
    return 0
