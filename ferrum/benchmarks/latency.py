"""`ferrum bench latency`: prefill and decode speed at a fixed batch (default 1), against HF
transformers `generate` on the same weights, prompt and device, in the same run.

Per iteration, `batch_size` random token-id prompts of `input_len` tokens (new ones each
iteration, so no prefix-cache hit) generate exactly `output_len` tokens greedily (EOS ignored).

  TTFT   time from submitting the batch to its first token (includes the prefill)
  TPOT   (time of the last token - time of the first token) / (output_len - 1), per step
  prefill tok/s = batch * input_len / TTFT; decode tok/s = batch / TPOT
  MBU    = weight bytes read per decode step / median TPOT / memory bandwidth (the
         input-embedding table is left out when untied: a lookup reads only the batch's rows).
         Bandwidth: --bandwidth-gbs, default 4800 GB/s (H200 HBM3e) on CUDA. On CPU the best
         read rate seen in the run: a read benchmark over a buffer the size of the weights
         (same cache level), repeated before every iteration so one loaded moment cannot
         deflate it, or the fastest iteration's decode read rate if that was higher; so the CPU
         MBU never exceeds 100%. (A single memcpy measured at start, counting read + write
         bytes, once gave 138% under load.)
HF: TTFT = generate(max_new_tokens=1); TPOT = (generate(output_len) - TTFT) / (output_len - 1).
Reported: median, min and max over --num-iters after one warm-up iteration of each; ferrum
and HF iterations alternate so that changes in machine load affect both alike, and the report
says when other processes were busy (load average, busy processes).
"""
from __future__ import annotations

import statistics
import time

from ferrum.benchmarks.common import (add_common_args, busy_processes, decode_weight_bytes, fmt_ratio,
                                      llm_from_config, load_hf_model, load_note, measure_read_bandwidth,
                                      random_prompts, record, setup_threads, write_json)

H200_BANDWIDTH_GBS = 4800.0


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench latency` and its flags."""
    p = subparsers.add_parser("latency", help="batch-1 prefill/decode speed (TTFT, TPOT, MBU) vs HF transformers")
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per iteration")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations (after one warm-up)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="device memory bandwidth for MBU (default: 4800 on CUDA, the best read rate "
                        "measured in the run on CPU)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers baseline")
    p.add_argument("--profile", action="store_true", help="print the top torch.profiler ops of one ferrum decode run")
    add_common_args(p)
    p.set_defaults(func=main)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _summary(ttfts: list[float], tpots: list[float], batch: int, input_len: int, output_len: int,
             weight_bytes: int, bw_gbs: float | None) -> dict:
    """Medians (and min / max) of the iterations' TTFT and TPOT, and what follows from them:
    prefill and decode tok/s, end-to-end seconds, weight read rate (GB/s) and MBU."""
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    out = {"ttft_s": ttft, "tpot_s": tpot,
           "ttft_s_min": min(ttfts), "ttft_s_max": max(ttfts),
           "tpot_s_min": min(tpots), "tpot_s_max": max(tpots),
           "prefill_tok_s": batch * input_len / ttft, "decode_tok_s": batch / tpot,
           "decode_tok_s_min": batch / max(tpots), "decode_tok_s_max": batch / min(tpots),
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
    import torch
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


def _fmt(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
    """`median (min-max)` of values * scale."""
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def main(args) -> int:
    """Run ferrum and HF transformers iterations interleaved (HF unless --no-hf); print and
    optionally write the record; returns the exit status (2: lengths exceed max_model_len)."""
    from ferrum.entrypoints.args import config_from_args
    from ferrum.model_store import resolve_model

    setup_threads(args.threads)
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
    import torch
    threads = torch.get_num_threads()
    weight_bytes = decode_weight_bytes(caps.memory, cfg, dtype)
    measure_bw = not args.bandwidth_gbs and not device.startswith("cuda")
    bw_samples: list[float] = []
    if args.bandwidth_gbs:
        bw, bw_src = args.bandwidth_gbs, "--bandwidth-gbs"
    elif device.startswith("cuda"):
        bw, bw_src = H200_BANDWIDTH_GBS, "default H200 HBM3e 4800 GB/s"
    else:
        bw_samples.append(measure_read_bandwidth(device, weight_bytes))
        bw, bw_src = bw_samples[0], "best read rate measured in the run"
    print(f"model {llm.engine.model_name} ({info.num_params / 1e6:.1f}M params, {info.dtype}) on {device}, "
          f"{threads} threads; weights read per decode step {weight_bytes / 1e6:.1f} MB")
    print(f"batch {args.batch_size}, input {args.input_len}, output {args.output_len}, iters {args.num_iters}")

    model = load_hf_model(resolve_model(config.model), dtype, device) if args.hf else None
    # Interleaved (ferrum, HF, ferrum, HF, ...) so that a change in machine load hits both;
    # iteration 0 of each is a warm-up.
    f_ttft, f_tpot, h_ttft, h_tpot = [], [], [], []
    for it in range(args.num_iters + 1):
        if measure_bw and it:
            bw_samples.append(measure_read_bandwidth(device, weight_bytes))
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
    if measure_bw:
        # the best rate seen; an iteration whose decode read the weights faster than the read
        # benchmark proves the machine can, so that rate becomes the reference
        fastest_decode = max(weight_bytes / t / 1e9 for t in f_tpot + h_tpot)
        bw = max(bw_samples)
        if fastest_decode > bw:
            bw, bw_src = fastest_decode, "fastest iteration's decode read rate (above the read benchmark's)"
    ferrum = _summary(f_ttft, f_tpot, args.batch_size, args.input_len, args.output_len, weight_bytes, bw)
    hf = _summary(h_ttft, h_tpot, args.batch_size, args.input_len, args.output_len, weight_bytes, bw) \
        if model is not None else None
    del model
    if args.profile:
        _profile(llm, args, vocab)

    rows = [("ferrum", ferrum, f_ttft, f_tpot)] + ([("hf", hf, h_ttft, h_tpot)] if hf else [])
    print(f"medians (min-max) over {args.num_iters} iterations; bandwidth {bw:.1f} GB/s ({bw_src})")
    print(f"{'':8} {'TTFT ms':>22} {'TPOT ms':>22} {'prefill tok/s':>14} {'decode tok/s':>13} {'MBU':>7}")
    for name, r, ttfts, tpots in rows:
        mbu = f"{100 * r['mbu']:.1f}%" if r["mbu"] is not None else "n/a"
        print(f"{name:8} {_fmt(ttfts):>22} {_fmt(tpots, digits=2):>22} {r['prefill_tok_s']:14.1f} "
              f"{r['decode_tok_s']:13.2f} {mbu:>7}")
    ratios = None
    if hf:
        ratios = {"decode_tok_s": ferrum["decode_tok_s"] / hf["decode_tok_s"],
                  "prefill_tok_s": ferrum["prefill_tok_s"] / hf["prefill_tok_s"],
                  "e2e": hf["e2e_s"] / ferrum["e2e_s"]}
        print(f"ferrum/HF: decode {fmt_ratio(ferrum['decode_tok_s'], hf['decode_tok_s'])}, "
              f"prefill {fmt_ratio(ferrum['prefill_tok_s'], hf['prefill_tok_s'])}, "
              f"end-to-end {fmt_ratio(hf['e2e_s'], ferrum['e2e_s'])}")
    note = load_note(device, busy_processes())
    if note:
        print(f"note: {note}")
    rec = record("latency", args, device, {
        "model": llm.engine.model_name, "dtype": info.dtype, "num_params": info.num_params,
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "weight_bytes_per_decode_step": weight_bytes,
        "bandwidth_gbs": bw, "bandwidth_source": bw_src, "bandwidth_samples_gbs": bw_samples,
        "load_note": note, "ferrum": ferrum, "hf_transformers": hf, "ratio_ferrum_over_hf": ratios})
    write_json(args.out, rec)
    llm.engine.shutdown()
    return 0
