"""`ferrum bench latency`: prefill and decode speed at a fixed batch (default 1), against HF
transformers `generate` on the same weights, prompt and device, and (`--peers`) vLLM and
gpt-fast through their drivers, in the same run.

Per iteration, `batch_size` random token-id prompts of `input_len` tokens (new ones each
iteration, so no prefix-cache hit) generate exactly `output_len` tokens greedily (EOS ignored).

  TTFT   time from submitting the batch to its first token (includes the prefill)
  TPOT   (time of the last token - time of the first token) / (output_len - 1), per step
  prefill tok/s = batch * input_len / TTFT; decode tok/s = batch / TPOT
  MBU    `ferrum.benchmarks.mbu`: bytes one rank reads per decode step (weights without the
         untied input embedding, plus the KV cache at the mean context input_len +
         output_len / 2) / median TPOT, over the device's spec bandwidth (`mbu`, the headline;
         none on CPU unless --spec-bandwidth-gbs) and over the read rate measured here
         (`mbu_vs_roofline`: CUDA, the batch-1 GEMV; CPU, a read benchmark repeated before
         every iteration, or the fastest iteration's own read rate if higher, so <= 100%).
HF (`--hf-mode`, `ferrum.benchmarks.hf_baseline`): TTFT = generate(max_new_tokens=1); TPOT =
(generate(output_len) - TTFT) / (output_len - 1). On CPU ferrum and HF iterations alternate so
that changes in machine load hit both; on CUDA HF runs after ferrum's engine is shut down (its
KV pool holds the memory HF needs). `--tp-sizes 1 2` runs ferrum at each TP size in turn
(`tp2_speedup`). Peers: vLLM's driver (`vllm_bench.py latency`: 128-token prompt by default,
512 tokens, best of 3) and gpt-fast's (`peer_bench.py`, top-k 200 sampling, best of 3), at each
TP size (or those of `--peer-tp-sizes`); ratios `decode_tok_s_vs_<peer>` are ferrum's median over the peer's best (> 1: ferrum
ahead). Reported: median, min and max over --num-iters after one warm-up iteration of each.
"""
from __future__ import annotations

import statistics
import sys
import time

from ferrum.benchmarks.common import (add_common_args, decode_len, llm_from_config, positive_float, positive_int,
                                      random_prompts, sync_device)
from ferrum.benchmarks.hf_baseline import load_hf_model
from ferrum.benchmarks.run_record import busy_processes, load_note, record, setup_threads, write_json
from ferrum.benchmarks.mbu import decode_bytes_per_step, mbu_columns, measure_roofline_gbs, spec_bandwidth_gbs
from ferrum.benchmarks.peers import add_peer_args, ratio, run_gpt_fast, run_vllm


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench latency` and its flags."""
    p = subparsers.add_parser("latency", help="batch-1 prefill/decode speed (TTFT, TPOT, MBU) vs HF, vLLM, gpt-fast")
    add_engine_args(p)
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=decode_len, default=64,
                   help="generated tokens per sequence (>= 2: the first comes from the prefill)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per iteration")
    p.add_argument("--num-iters", type=positive_int, default=3, help="timed iterations (after one warm-up)")
    p.add_argument("--tp-sizes", type=positive_int, nargs="+", default=None,
                   help="run ferrum at each of these TP sizes in turn (default: the -tp size)")
    p.add_argument("--peer-tp-sizes", type=positive_int, nargs="+", default=None,
                   help="TP sizes (of --tp-sizes) the peers run at, each a peer start (default: all of --tp-sizes)")
    p.add_argument("--spec-bandwidth-gbs", type=positive_float, default=None,
                   help="memory bandwidth for the headline MBU (default: the device's spec sheet, "
                        "ferrum.benchmarks.mbu; none on CPU)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers baseline")
    p.add_argument("--hf-mode", default="auto", choices=["auto", "compile", "static", "eager"],
                   help="HF baseline: static cache + torch.compile, static cache, or eager (auto: compile on CUDA)")
    p.add_argument("--profile", action="store_true", help="print the top torch.profiler ops of one ferrum decode run")
    add_peer_args(p)
    add_common_args(p)
    p.set_defaults(func=main)


def summarize(ttfts: list[float], tpots: list[float], batch: int, input_len: int, output_len: int) -> dict:
    """Medians, min and max of per-iteration TTFT / TPOT (seconds) and the rates they give."""
    ttft, tpot = statistics.median(ttfts), statistics.median(tpots)
    return {"ttft_s": ttft, "tpot_s": tpot, "prefill_tok_s": batch * input_len / ttft,
            "decode_tok_s": batch / tpot, "decode_tok_s_best": batch / min(tpots),
            "e2e_s": ttft + tpot * (output_len - 1),
            "ttft_s_min_max": [min(ttfts), max(ttfts)], "tpot_s_min_max": [min(tpots), max(tpots)],
            "ttft_s_all": ttfts, "tpot_s_all": tpots}


def ferrum_iter(llm, args, vocab: int, device: str, it: int) -> tuple[float, float]:
    """One batch through LLM.generate -> (TTFT, TPOT) in seconds, from the request metrics."""
    from ferrum.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 * it)
    sync_device(device)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync_device(device)
    assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
    start = min(o.metrics.arrival_time for o in outs)
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    return first - start, (last - first) / max(1, args.output_len - 1)


def _profile(llm, args, vocab: int) -> None:
    from torch.profiler import profile
    from ferrum.sampling_params import SamplingParams
    prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + 7)
    with profile() as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=min(16, args.output_len), ignore_eos=True),
                     use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _fmt(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
    """median (min-max) of seconds, in ms."""
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


class _Run:
    """One ferrum engine at one TP size, with an HF baseline interleaved on CPU."""

    def __init__(self, args, tp: int):
        from ferrum.entrypoints.args import config_from_args
        args.tensor_parallel_size = tp
        self.config = config_from_args(args)
        self.llm = llm_from_config(self.config)
        eng = self.llm.engine
        ex = eng.executor
        self.info, caps = ex.info(), ex.capabilities()
        self.device, self.dtype, self.cfg = str(self.info.device), ex.dtype, eng.model_config
        context = args.batch_size * (args.input_len + args.output_len // 2)
        self.bytes_per_step = decode_bytes_per_step(caps.memory, self.cfg, self.dtype, context)
        self.cuda_graphs = caps.cuda_graphs


def main(args) -> int:
    """ferrum at each TP size (HF interleaved on CPU), then HF on CUDA, then the peers; print
    and optionally write the record; returns the exit status (2: lengths exceed max_model_len)."""
    from ferrum.loader.resolve import resolve_model
    threads = setup_threads(args.threads)
    tp_sizes = args.tp_sizes or [args.tensor_parallel_size]
    runs, hf_times, hf = {}, ([], []), None
    res: dict = {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                 "num_iters": args.num_iters}
    roofline = None
    for tp in tp_sizes:
        run = _Run(args, tp)
        llm, device = run.llm, run.device
        vocab = run.cfg.vocab_size
        if args.input_len + args.output_len > llm.engine.max_model_len:
            print(f"ferrum bench latency: error: --input-len + --output-len exceeds max_model_len "
                  f"{llm.engine.max_model_len}; lower them or raise --max-model-len", file=sys.stderr)
            llm.engine.shutdown()
            return 2
        if roofline is None:
            spec, spec_src = spec_bandwidth_gbs(device, args.spec_bandwidth_gbs)
            roofline = list(measure_roofline_gbs(device, run.bytes_per_step))
            res.update(model=llm.engine.model_name, dtype=run.info.dtype, num_params=run.info.num_params,
                       bandwidth={"spec_gbs": spec, "spec_source": spec_src, "roofline_gbs": roofline[0],
                                  "roofline_source": roofline[1]})
            # the bandwidths are printed once, with the table: on CPU the measured one can still rise
            print(f"model {llm.engine.model_name} ({run.info.num_params / 1e6:.1f}M params, {run.info.dtype}) "
                  f"on {device}, {threads} threads; bytes read per decode step {run.bytes_per_step / 1e6:.1f} MB")
        print(f"TP={tp}: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
              f"iters {args.num_iters}", flush=True)
        # HF next to ferrum on CPU only (first TP size), and only where both fit in memory
        interleave = args.hf and hf is None and not device.startswith("cuda") and tp == 1
        if interleave:
            hf = _hf(args, run, resolve_model)
        f_ttft, f_tpot = [], []
        for it in range(args.num_iters + 1):
            if not device.startswith("cuda") and it:   # CPU: the read rate can change with the load
                roofline[0] = max(roofline[0], measure_roofline_gbs(device, run.bytes_per_step)[0])
            a, b = ferrum_iter(llm, args, vocab, device, it)
            if it:
                f_ttft.append(a)
                f_tpot.append(b)
            if interleave:
                # ferrum's CPU linears run on numpy's OpenBLAS, whose workers may still be
                # spinning after its last call; let them park before HF is timed.
                time.sleep(0.5)
                a, b = hf.run(random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 * it),
                              args.output_len)
                if it:
                    hf_times[0].append(a)
                    hf_times[1].append(b)
            if it:
                print(f"iter {it}: ferrum TTFT {1e3 * f_ttft[-1]:.1f} ms TPOT {1e3 * f_tpot[-1]:.2f} ms"
                      + (f" | HF TTFT {1e3 * hf_times[0][-1]:.1f} ms TPOT {1e3 * hf_times[1][-1]:.2f} ms"
                         if interleave else ""), flush=True)
        if not device.startswith("cuda"):
            # an iteration whose decode read faster than the read benchmark proves the machine
            # can, so that rate becomes the reference (CPU MBU never exceeds 100%)
            fastest = max(run.bytes_per_step / t / 1e9 for t in f_tpot + hf_times[1])
            if fastest > roofline[0]:
                roofline[:] = [fastest, "fastest iteration's decode read rate (above the read benchmark's)"]
        summary = summarize(f_ttft, f_tpot, args.batch_size, args.input_len, args.output_len)
        summary.update(tp=tp, bytes_per_step_per_rank=run.bytes_per_step, cuda_graphs=run.cuda_graphs,
                       symm_mem=getattr(llm.engine.executor, "symm_mem", None))
        runs[tp] = (summary, _fmt(f_ttft), _fmt(f_tpot, digits=2))
        if args.profile:
            _profile(llm, args, vocab)
        llm.engine.shutdown()
        if args.hf and hf is None and tp == tp_sizes[0]:
            run.llm = None
            del llm
            hf = _hf(args, run, resolve_model)   # CUDA: after the engine freed the GPU
            for it in range(args.num_iters + 1):
                a, b = hf.run(random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 * it),
                              args.output_len)
                if it:
                    hf_times[0].append(a)
                    hf_times[1].append(b)
            hf.model = None
    spec, roof = res["bandwidth"]["spec_gbs"], roofline[0]
    res["bandwidth"].update(roofline_gbs=roof, roofline_source=roofline[1])
    for tp, (summary, *_rest) in runs.items():
        summary.update(mbu_columns(summary["bytes_per_step_per_rank"], summary["tpot_s"], spec, roof))
    first = runs[tp_sizes[0]][0]
    hf_summary = None
    if hf is not None:
        hf_summary = summarize(*hf_times, args.batch_size, args.input_len, args.output_len)
        hf_summary.update(mode=hf.label, **mbu_columns(first["bytes_per_step_per_rank"], hf_summary["tpot_s"], spec, roof))
    res["ferrum"] = first
    res.update({f"ferrum_tp{tp}": s for tp, (s, *_r) in runs.items() if tp != tp_sizes[0]})
    res["hf_transformers"] = hf_summary
    ratios: dict = {}
    if hf_summary:
        ratios[f"tp{tp_sizes[0]}"] = {"decode_tok_s_vs_hf": ratio(first["decode_tok_s"], hf_summary["decode_tok_s"]),
                                      "ttft_vs_hf": ratio(first["ttft_s"], hf_summary["ttft_s"], higher_is_better=False)}
    if 1 in runs and 2 in runs:
        ratios["tp2_speedup"] = runs[2][0]["decode_tok_s"] / runs[1][0]["decode_tok_s"]
    res["peers"] = {}

    def save_partial():   # before and after each peer: a run cut short at a time limit keeps the rest
        write_json(args.out, record("latency", args, device, {**res, "ratios": ratios,
                                                              "partial": "peers still to run"}))
    for tp in [tp for tp in tp_sizes if tp in (args.peer_tp_sizes or tp_sizes)]:
        row = ratios.setdefault(f"tp{tp}", {})
        ours = runs[tp][0]["decode_tok_s"]
        if "vllm" in (args.peers or ()):
            save_partial()
            if args.output_len != 512 or args.batch_size != 1:
                print("note: vLLM's driver times batch 1 and 512 output tokens whatever --output-len says")
            peer = res["peers"][f"vllm_tp{tp}"] = run_vllm(args, "latency", tp, args.input_len)
            row["decode_tok_s_vs_vllm"] = ratio(ours, peer.get("decode_tok_s"))
        if "gpt-fast" in (args.peers or ()):
            save_partial()
            peer = res["peers"][f"gpt_fast_tp{tp}"] = run_gpt_fast(args, tp, args.input_len, args.output_len)
            row["decode_tok_s_vs_gpt_fast"] = ratio(ours, peer.get("best_decode_tok_s"))
    res["ratios"] = {k: v for k, v in ratios.items() if v != {}}   # a TP size with no peer: no row
    res["load_note"] = load_note(device, busy_processes())
    _print_table(runs, hf_summary, hf_times, res)
    write_json(args.out, record("latency", args, device, res))
    return 0


def _hf(args, run: "_Run", resolve_model):
    """The HF baseline over the same weights as `run`'s engine."""
    from ferrum.benchmarks.hf_baseline import HFBaseline
    model = load_hf_model(resolve_model(run.config.model), run.dtype, run.device)
    return HFBaseline(model, args.hf_mode, run.device, args.input_len + args.output_len)


def _print_table(runs: dict, hf_summary: dict | None, hf_times, res: dict) -> None:
    """The summary on stdout: the two bandwidths, the table, then one line per ratio."""
    bw = res["bandwidth"]
    spec = f"{bw['spec_gbs']:.1f} GB/s" if bw["spec_gbs"] is not None else "n/a"
    print(f"bandwidth: spec {spec} ({bw['spec_source']}); measured {bw['roofline_gbs']:.1f} GB/s "
          f"({bw['roofline_source']})")
    print("medians (min-max) over the iterations; MBU spec / MBU roof: the decode read rate over "
          "each bandwidth")
    print(f"{'':10} {'TTFT ms':>22} {'TPOT ms':>22} {'decode tok/s':>13} {'MBU spec':>9} {'MBU roof':>9}")

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "n/a"
    rows = [(f"ferrum tp{tp}", s, a, b) for tp, (s, a, b) in runs.items()]
    if hf_summary:
        rows.append(("hf", hf_summary, _fmt(hf_times[0]), _fmt(hf_times[1], digits=2)))
    for name, s, a, b in rows:
        print(f"{name:10} {a:>22} {b:>22} {s['decode_tok_s']:13.2f} {pct(s['mbu']):>9} {pct(s['mbu_vs_roofline']):>9}")
    if hf_summary:
        print(f"HF mode: {hf_summary['mode']}")
    # ratios: {"tp1": {"decode_tok_s_vs_hf": 1.2, ...}, "tp2_speedup": 1.4}; a TP size with
    # nothing to compare against has no row
    for key, value in res["ratios"].items():
        for name, x in (value.items() if isinstance(value, dict) else [(None, value)]):
            label = f"{key} {name}" if name else key
            print(f"ratio {label}: {f'{x:.3f}' if x is not None else 'n/a'}"
                  + (" (> 1: ferrum ahead)" if name else ""))
    if res["load_note"]:
        print(f"note: {res['load_note']}")
