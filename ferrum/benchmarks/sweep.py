"""`ferrum bench sweep`: decode speed over batch sizes, with the host's share of each step.

For each batch size B (`--batch-sizes`, default 1, 2, 4, ... 256), B random prompts of
`--input-len` tokens each generate `--output-len` tokens (EOS ignored; greedy, or
`--temperature` to time the sampler's sampling path) through `LLMEngine.step`, as
`LLM.generate` runs it. Over the steps that ran no prefill, without the first two and the last
two (the batch filling and draining):

  step_ms        median wall time of an engine step (schedule, launch, sample, outputs)
  batch_ran      median rows a step decoded: B, or fewer when the KV pool holds only some of
                 the B sequences at once (the rest wait or are preempted)
  decode tok/s   median over the steps of the rows it decoded / its time (B / step time when
                 every step decodes B rows)
  replay_ms      GPU time of the same batch's decode CUDA graph replayed back to back on the
                 last step's inputs (CUDA graphs only; every TP rank replays)
  host_share     1 - replay_ms / step_ms: what the GPU waits for the host per step (async
                 scheduling hides the host work it overlaps, so this is the part it does not)
  sampler_ms     the sampler alone on random [B, vocab] float32 logits with this run's
                 sampling parameters (CUDA events; CPU: wall time)
  MBU            `ferrum.benchmarks.mbu` (spec and measured roofline) with the KV cache read at
                 each sequence's mean context input_len + output_len / 2
"""
from __future__ import annotations

import statistics
import sys
import time

from ferrum.benchmarks.common import (add_common_args, decode_len, llm_from_config, positive_float, positive_int,
                                      random_prompts)
from ferrum.benchmarks.run_record import record, setup_threads, write_json
from ferrum.benchmarks.mbu import decode_bytes_per_step, mbu_columns, measure_roofline_gbs, spec_bandwidth_gbs


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench sweep` and its flags."""
    p = subparsers.add_parser("sweep", help="decode tok/s, MBU and host share per step over batch sizes")
    add_engine_args(p)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
                   help="batch sizes to run, one after another")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=decode_len, default=64,
                   help="generated tokens per sequence (>= 2: the first comes from the prefill)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 times the sampling path")
    p.add_argument("--spec-bandwidth-gbs", type=positive_float, default=None, help="see `ferrum bench latency` (default: the device's spec sheet; none on CPU)")
    p.add_argument("--plot", default=None, help="PNG of decode tok/s and MBU over batch size (default: no plot)")
    add_common_args(p)
    p.set_defaults(func=main)


def decode_step_times(eng, prompts: list[list[int]], params) -> list[tuple[float, int]]:
    """Add `prompts` with `params` to engine `eng`, step it until they finish (as
    LLM.generate does), and return (wall time in s, decode rows) of every step that ran no
    prefill, without the first two and last two of them. The rows are what the step decoded:
    fewer than the prompts when the KV pool holds only some of them at once."""
    ex = eng.executor
    prefills, rows = [0], [0]
    prefill, decode = ex.prefill, ex.decode

    def counted(inp):
        prefills[0] += 1
        return prefill(inp)

    def counted_decode(inp):
        rows[0] += len(inp.token_ids)
        return decode(inp)
    ex.prefill, ex.decode = counted, counted_decode
    try:
        for p in prompts:
            eng.add_request(None, None, params, prompt_token_ids=p)
        times = []
        while eng.has_unfinished_requests():
            n0, rows[0] = prefills[0], 0
            t = time.perf_counter()
            eng.step(final_only=True)
            dt = time.perf_counter() - t
            if prefills[0] == n0 and rows[0]:
                times.append((dt, rows[0]))
    finally:
        ex.prefill, ex.decode = prefill, decode
    return times[2:-2] if len(times) > 6 else times


def graph_replay_ms(executor, batch: int) -> float | None:
    """GPU ms of one replay of the batch-`batch` decode graph on every rank (None without
    CUDA graphs for that size)."""
    call = getattr(executor, "call_all", None)
    stats = call("graph_replay_stats", batch, 50, 0) if call else executor.runner.graph_replay_stats(batch, 50, 0)
    return None if stats is None else stats["replay_ms"]


def sampler_ms(eng, batch: int, params, iters: int = 20) -> float:
    """ms per call of the engine's sampler on random [batch, vocab] float32 logits, metadata
    built for `params` (as a decode step does, outside the timing)."""
    import torch
    from ferrum.layers.sampler import SamplingMetadata
    dev = eng.sample_device
    logits = torch.randn(batch, eng.vocab_size, device=dev)
    metadata = SamplingMetadata.build([params] * batch, [[1]] * batch, [()] * batch, [None] * batch,
                                eng.eos_token_ids, eng.vocab_size, dev)
    eng.sampler(logits, metadata)
    if dev.startswith("cuda"):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            eng.sampler(logits, metadata)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / iters
    t = time.perf_counter()
    for _ in range(iters):
        eng.sampler(logits, metadata)
    return (time.perf_counter() - t) / iters * 1e3


def main(args) -> int:
    """Run the sweep; print a table, write the record (and the plot)."""
    from ferrum.sampling_params import SamplingParams
    from ferrum.entrypoints.args import config_from_args
    setup_threads(args.threads)
    config = config_from_args(args)
    config.scheduler.max_num_seqs = max(config.scheduler.max_num_seqs, max(args.batch_sizes))
    llm = llm_from_config(config)
    eng = llm.engine
    ex = eng.executor
    caps, device = ex.capabilities(), str(ex.info().device)
    if args.input_len + args.output_len > eng.max_model_len:
        print(f"ferrum bench sweep: error: --input-len + --output-len exceeds max_model_len "
              f"{eng.max_model_len}; lower them or raise --max-model-len", file=sys.stderr)
        eng.shutdown()
        return 2
    weights = decode_bytes_per_step(caps.memory, eng.model_config, ex.dtype)
    spec, spec_src = spec_bandwidth_gbs(device, args.spec_bandwidth_gbs)
    roofline, roofline_src = measure_roofline_gbs(device, weights)
    vocab = eng.vocab_size
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    decode_step_times(eng, random_prompts(2, args.input_len, vocab, args.seed), params)   # warm-up
    points = []
    for B in args.batch_sizes:
        timed = decode_step_times(eng, random_prompts(B, args.input_len, vocab, args.seed + B), params)
        step = statistics.median(t for t, _ in timed)
        ran = statistics.median_low(n for _, n in timed)   # B, unless the KV pool holds fewer at once
        replay = graph_replay_ms(ex, ran) if caps.cuda_graphs else None
        nbytes = decode_bytes_per_step(caps.memory, eng.model_config, ex.dtype,
                                       ran * (args.input_len + args.output_len // 2))
        pt = {"batch": B, "batch_ran": ran, "step_ms": 1e3 * step,
              "decode_tok_s": statistics.median(n / t for t, n in timed), "steps_timed": len(timed),
              "replay_ms": replay, "host_share": None if replay is None else 1 - replay / (1e3 * step),
              "sampler_ms": sampler_ms(eng, ran, params), "bytes_per_step_per_rank": nbytes,
              **mbu_columns(nbytes, step, spec, roofline)}
        points.append(pt)
        fits = "" if ran == B else f" ({ran} of {B} ran at once: the KV pool holds no more; raise --kv-cache-memory)"
        host = "" if replay is None else f", replay {replay:.3f} ms, host share {pt['host_share']:.3f}"
        mbu = "" if pt["mbu"] is None else f"MBU {pt['mbu']:.3f}, "
        print(f"B={B:4d}: step {pt['step_ms']:.2f} ms, {pt['decode_tok_s']:.0f} tok/s{fits}{host}, sampler "
              f"{pt['sampler_ms']:.3f} ms, {mbu}{pt['mbu_vs_roofline']:.3f} of the roofline", flush=True)
    res = {"model": eng.model_name, "input_len": args.input_len, "output_len": args.output_len,
           "temperature": args.temperature, "tensor_parallel_size": caps.tensor_parallel_size,
           "async_scheduling": eng.async_scheduling, "cuda_graphs": caps.cuda_graphs,
           "bandwidth": {"spec_gbs": spec, "spec_source": spec_src, "roofline_gbs": roofline,
                         "roofline_source": roofline_src}, "points": points}
    eng.shutdown()
    if args.plot:
        _plot(args.plot, res)
    write_json(args.out, record("sweep", args, device, res))
    return 0


def _plot(path: str, res: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot")
        return
    pts = res["points"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    bs = [p["batch"] for p in pts]
    ax[0].plot(bs, [p["decode_tok_s"] for p in pts], "o-")
    ax[1].plot(bs, [100 * (p["mbu"] or 0) for p in pts], "o-", label="MBU vs spec")
    ax[1].plot(bs, [100 * (p["mbu_vs_roofline"] or 0) for p in pts], "o-", label="MBU vs measured roofline")
    for a, t in zip(ax, ("decode tokens/s", "MBU %")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch")
        a.set_title(t)
        a.grid(alpha=.3)
    ax[1].legend()
    fig.suptitle(f"ferrum {res['model']}, TP={res['tensor_parallel_size']}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")
