"""`ferrum bench throughput`: offline output throughput of continuous batching against the same
prompts run one at a time, in the same run and engine.

Workload: --num-prompts random token-id prompts, input lengths uniform in --input-len MIN MAX
and output lengths uniform in --output-len MIN MAX (seeded), greedy, EOS ignored so every
request generates exactly its output length.

  batched      all prompts through one `LLM.generate` call (continuous batching)
  sequential   the same prompts, one `LLM.generate` call each
  output tok/s = generated tokens / wall seconds; the ratio is batched / sequential.
The prefix cache is cleared before each phase (the prompts are random, so it only matters for
the repeat). The JSON keeps a timeline of each phase, (seconds, generated tokens, running
sequences) at up to 100 steps (`--plot FILE.png` draws it, needs matplotlib), and the batched
phase's wall time split into steps that ran a prefill chunk and decode-only steps, and the
decode-only steps' MBU (`decode_mbu`: weights each step plus the KV their rows attend to, over
their wall time and the spec bandwidth, `ferrum.benchmarks.mbu`).

`--workload nanovllm` is nano-vllm's bench.py workload, exactly as the vLLM peer driver builds
it: 256 prompts of ids uniform in [0, 10000] with lengths uniform in [100, 1024], output lengths
uniform in [100, 1024], temperature 0.6, EOS ignored (no sequential phase). With `--peers vllm`
the driver (`vllm_bench.py throughput` or `nanovllm`) runs after ferrum; its throughput
section is 1000 prompts x (1000 in, 1000 out), so the ratio `output_tok_s_vs_vllm` is only
written when ferrum ran that same shape (or the nanovllm workload).

`--json-schema SCHEMA` (a file or inline JSON) measures instead what structured outputs cost:
the batch with every request constrained to the schema against the same batch unconstrained,
with each request's output length set to what its constrained run produced (the grammar may
end an output early: both runs then do the same work, batch shape included). The two run
interleaved --repeats times, alternating which goes first (the machine may be shared); the
result is the ratio of the median tok/s, constrained / unconstrained (and the same per second
of the process's CPU time, which other jobs on a shared machine disturb less).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

from tqdm import tqdm

from ferrum.benchmarks.common import (MinMax, add_common_args, cuda_memory, llm_from_config, positive_float,
                                      positive_int, random_prompts)
from ferrum.benchmarks.mbu import decode_phase_bytes, mbu_columns, spec_bandwidth_gbs
from ferrum.benchmarks.run_record import record, setup_threads, write_json
from ferrum.benchmarks.peers import add_peer_args, ratio, run_vllm
from ferrum.benchmarks.step_log import StepLog, profile_kernels, profile_markdown


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench throughput` and its flags."""
    p = subparsers.add_parser("throughput", help="offline batch output tok/s vs the same prompts one at a time")
    add_engine_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=32, help="prompts in the batch")
    p.add_argument("--input-len", type=positive_int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   action=MinMax,
                   help="prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=positive_int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   action=MinMax,
                   help="output lengths, uniform in [MIN, MAX]")
    p.add_argument("--no-sequential", dest="sequential", action="store_false",
                   help="skip the one-at-a-time baseline")
    p.add_argument("--plot", default=None, help="PNG: generated tokens over time, batched vs sequential (default: no plot)")
    p.add_argument("--workload", default="random", choices=["random", "nanovllm"],
                   help="random: the length flags above; nanovllm: nano-vllm's bench workload (see above)")
    add_peer_args(p)
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="compare the batch constrained to this JSON schema (a file or inline JSON) "
                        "with the same batch unconstrained (default: no comparison)")
    p.add_argument("--repeats", type=positive_int, default=3, help="--json-schema: interleaved runs of each")
    p.add_argument("--step-log", default=None, metavar="DIR",
                   help="write where the batched phase's time goes to DIR: step_log.json (every step: "
                        "kind, batch, graph bucket, overlapped or not, host split, device time and idle "
                        "gaps on CUDA), kernel_profile.json (torch.profiler split of one prefill step and "
                        "a few decode steps at --profile-batch / --profile-context) and step_log.md "
                        "(ferrum/benchmarks/step_log.py) (default: none, no step log)")
    p.add_argument("--profile-batch", type=positive_int, default=None,
                   help="--step-log: decode rows for the kernel profile (default: 90%% of the batch)")
    p.add_argument("--profile-context", type=positive_int, default=600,
                   help="--step-log: mean context (tokens) of the decode steps profiled")
    p.add_argument("--spec-bandwidth-gbs", type=positive_float, default=None,
                   help="the decode phase's MBU denominator (default: the device's spec sheet, "
                        "ferrum.benchmarks.mbu; none on CPU)")
    add_common_args(p)
    p.set_defaults(func=main)


def workload(args, vocab: int):
    """Random prompts and greedy SamplingParams (ignore_eos, max_tokens drawn from
    args.output_len) from args.seed, or nano-vllm's workload: (prompts, params, input lengths,
    output lengths)."""
    from ferrum.sampling_params import SamplingParams
    if args.workload == "nanovllm":
        return nanovllm_workload()
    rng = random.Random(args.seed)
    in_lens = [rng.randint(*args.input_len) for _ in range(args.num_prompts)]
    out_lens = [rng.randint(*args.output_len) for _ in range(args.num_prompts)]
    prompts = random_prompts(args.num_prompts, in_lens, vocab, args.seed + 1)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    return prompts, params, in_lens, out_lens


def nanovllm_workload():
    """nano-vllm's bench.py workload as `vllm_bench.py nanovllm` draws it (random.Random(0)):
    (prompts, params, input lengths, output lengths)."""
    from ferrum.sampling_params import SamplingParams
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    out_lens = [rng.randint(100, 1024) for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in out_lens]
    return prompts, params, [len(p) for p in prompts], out_lens


def step_time_split(log) -> dict:
    """The batched phase's wall time split into steps that ran a prefill chunk ("prefill",
    possibly with decodes) and decode-only steps ("decode"), with the prefill tokens, decode
    rows and the KV tokens cached for those rows (`decode_ctx`) they ran, from a `StepLog`'s
    rows."""
    split = {kind: {"steps": 0, "s": 0.0, "prefill_tokens": 0, "decode_rows": 0, "decode_ctx": 0}
             for kind in ("prefill", "decode")}
    for r in log.rows:
        row = split["prefill" if r["prefill_tokens"] else "decode"]
        row["steps"] += 1
        row["s"] += r["wall_ms"] / 1e3
        for key in ("prefill_tokens", "decode_rows", "decode_ctx"):
            row[key] += r[key]
    return split


def decode_phase_mbu(engine, decode: dict, spec_gbs: float | None, spec_source: str) -> dict:
    """MBU of the batched phase's decode-only steps (`step_time_split(...)["decode"]`): the bytes
    they read (`ferrum.benchmarks.mbu.decode_phase_bytes`: weights each step, plus the KV
    tokens their rows attend to: the cached ones and each row's own) over their wall time, in GB/s and over the spec bandwidth;
    `floor_s`: the time those bytes take at the spec bandwidth (None without one). Under async
    scheduling a step's wall time is one step of the host-device pipeline, so the sum is the
    decode phase's share of the elapsed time."""
    nbytes = decode_phase_bytes(engine, decode["steps"], decode["decode_ctx"] + decode["decode_rows"])
    cols = mbu_columns(nbytes, decode["s"], spec_gbs, None)
    cols.pop("mbu_vs_roofline")
    return {"bytes": nbytes, "s": decode["s"], **cols, "spec_gbs": spec_gbs, "spec_source": spec_source,
            "floor_s": nbytes / (spec_gbs * 1e9) if spec_gbs else None}


class _Timeline:
    """Wraps engine.step: (seconds since start, generated tokens so far, running sequences)."""

    def __init__(self, engine):
        self.engine, self.points, self.t0, self.tokens, self.tokens0 = engine, [], 0.0, 0, 0
        self.max_running = 0
        orig = engine.step

        def step(**kw):
            outs = orig(**kw)
            self.tokens = engine.stats["generation_tokens"] - self.tokens0
            running = len(engine.scheduler.running)
            self.max_running = max(self.max_running, running)
            self.points.append((time.perf_counter() - self.t0, self.tokens, running))
            return outs

        engine.step = step

    def start(self):
        self.points, self.tokens, self.max_running = [], 0, 0
        self.tokens0 = self.engine.stats["generation_tokens"]
        self.t0 = time.perf_counter()


def _reset_prefix_cache(engine) -> None:
    reset = getattr(engine.block_manager, "reset_prefix_cache", None)
    if reset:
        reset()


def _downsample(points: list, keep: int = 100) -> list:
    """At most `keep` evenly spaced points of a timeline, always with the last one."""
    if len(points) <= keep:
        return points
    step = -(-len(points) // keep)
    return points[::step] + ([points[-1]] if (len(points) - 1) % step else [])


def _phase(name: str, fn, timeline: _Timeline, expected_tokens: int | None) -> dict:
    timeline.start()
    t, cpu = time.perf_counter(), time.process_time()
    outs = fn()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert expected_tokens is None or got == expected_tokens, \
        f"{name}: generated {got} tokens, expected {expected_tokens}"
    r = {"elapsed_s": elapsed, "output_tokens": got, "output_tok_s": got / elapsed,
         "cpu_s": cpu, "output_tok_per_cpu_s": got / cpu,
         "requests_per_s": len(outs) / elapsed, "max_running_sequences": timeline.max_running,
         "timeline": _downsample([(round(a, 3), b, c) for a, b, c in timeline.points])}
    print(f"{name:>10}: {got} tokens in {elapsed:.2f} s = {r['output_tok_s']:.1f} output tok/s "
          f"(max {timeline.max_running} running)", flush=True)
    r["outputs"] = outs
    return r


def load_schema(text: str) -> dict:
    """--json-schema: a path to a JSON file, or the schema's JSON text."""
    if os.path.exists(text):
        with open(text) as fh:
            return json.load(fh)
    return json.loads(text)


def structured_comparison(llm, prompts, out_lens, schema: dict, repeats: int, timeline) -> dict:
    """Constrained vs unconstrained batches, interleaved (see the module docstring)."""
    from ferrum.sampling_params import SamplingParams
    from ferrum.structured_output import StructuredOutputsParams
    so = StructuredOutputsParams(json=schema)
    constrained = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=so)
                   for n in out_lens]
    # warm-up: the grammar compiler (llguidance's view of the vocabulary) and the grammar
    llm.generate([prompts[0][:8]], constrained[0], use_tqdm=False)
    first = _phase("json-schema", lambda: llm.generate(prompts, constrained, use_tqdm=False), timeline, None)
    outs = first.pop("outputs")
    lens = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    runs: dict[str, list[dict]] = {"constrained": [first], "unconstrained": []}
    sequence = ["unconstrained"]                 # C U, then U C, C U, ...: each goes first in turn
    for k in range(1, repeats):
        sequence += ["unconstrained", "constrained"] if k % 2 else ["constrained", "unconstrained"]
    for name in sequence:
        params = constrained if name == "constrained" else plain
        _reset_prefix_cache(llm.engine)
        r = _phase(name, lambda: llm.generate(prompts, params, use_tqdm=False), timeline, sum(lens))
        r.pop("outputs")
        runs[name].append(r)
    med = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    ratio = med["constrained"] / med["unconstrained"]
    # tokens per second of this process's CPU time (all its threads): on a shared machine it
    # moves far less than wall time with the other jobs' load
    med_cpu = {k: statistics.median(r["output_tok_per_cpu_s"] for r in v) for k, v in runs.items()}
    ratio_cpu = med_cpu["constrained"] / med_cpu["unconstrained"]
    print(f"median output tok/s: constrained {med['constrained']:.1f}, unconstrained "
          f"{med['unconstrained']:.1f}: ratio {ratio:.3f}; per CPU second ratio {ratio_cpu:.3f} "
          f"({valid}/{len(outs)} outputs parse as JSON, "
          f"{sum(o.outputs[0].finish_reason == 'stop' for o in outs)} ended by the grammar)")
    for v in runs.values():
        for r in v:
            r.pop("timeline")
    return {"json_schema": schema, "output_tokens_per_run": sum(lens),
            "outputs_valid_json": valid, "outputs_ended_by_grammar":
                sum(o.outputs[0].finish_reason == "stop" for o in outs),
            "median_output_tok_s": med, "ratio_constrained_over_unconstrained": ratio,
            "median_output_tok_per_cpu_s": med_cpu, "ratio_per_cpu_s": ratio_cpu,
            "runs": runs}


def write_step_log(args, llm, log: StepLog, prompts, params) -> None:
    """--step-log DIR: the batched phase's step log (summary and rows), then the kernel
    profile of the same workload run again (`profile_kernels`), as JSON and markdown."""
    os.makedirs(args.step_log, exist_ok=True)
    summary = log.summary()
    text = f"# Step log: {llm.engine.model_name}, {len(prompts)} prompts ({args.workload})\n\n" + log.markdown(summary)
    with open(os.path.join(args.step_log, "step_log.json"), "w") as fh:
        json.dump({"summary": summary, "rows": log.rows}, fh)
    print(text, flush=True)
    batch = args.profile_batch or max(1, int(0.9 * min(len(prompts), llm.engine.config.scheduler.max_num_seqs)))
    _reset_prefix_cache(llm.engine)
    try:
        prof = profile_kernels(llm, prompts, params, batch, args.profile_context)
    except Exception as e:  # noqa: BLE001 - the step log above is written either way
        prof = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(args.step_log, "kernel_profile.json"), "w") as fh:
        json.dump(prof, fh, indent=1)
    ptext = (f"\n## Kernel profile (target: {batch} decode rows at context >= {args.profile_context})\n"
             + (profile_markdown(prof) if "error" not in prof else f"\nfailed: {prof['error']}\n"))
    print(ptext, flush=True)
    with open(os.path.join(args.step_log, "step_log.md"), "w") as fh:
        fh.write(text + ptext)


def _plot(path: str, res: dict, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("batched", "sequential"):
        if res.get(name):
            pts = res[name]["timeline"]
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    label=f"{name}: {res[name]['output_tok_s']:.1f} tok/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("generated tokens")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(args) -> int:
    """Run the batched phase and the one-at-a-time baseline (unless --no-sequential); print
    and optionally write the record; returns the exit status (2: lengths exceed
    max_model_len)."""
    from ferrum.entrypoints.args import config_from_args
    threads = setup_threads(args.threads)
    llm = llm_from_config(config_from_args(args))
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompts, params, in_lens, out_lens = workload(args, vocab)
    if max(i + o for i, o in zip(in_lens, out_lens)) > eng.max_model_len:
        print(f"ferrum bench throughput: error: the longest --input-len + --output-len exceeds "
              f"max_model_len {eng.max_model_len}; lower them or raise --max-model-len", file=sys.stderr)
        return 2
    expected = sum(out_lens)
    device = str(eng.executor.info().device)
    print(f"model {eng.model_name} on {device}, {threads} threads: {len(prompts)} prompts ({args.workload}), "
          f"input {sum(in_lens)} tokens ({min(in_lens)}-{max(in_lens)}), "
          f"output {expected} tokens ({min(out_lens)}-{max(out_lens)})")
    timeline = _Timeline(eng)
    # Warm-up: one short request, so neither phase pays for first-call setup.
    from ferrum.sampling_params import SamplingParams
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    if args.json_schema:
        res = {"model": eng.model_name, "workload": args.workload, "num_prompts": len(prompts),
               "input_len_range": [min(in_lens), max(in_lens)],
               "output_len_range": [min(out_lens), max(out_lens)], "repeats": args.repeats,
               **structured_comparison(llm, prompts, out_lens, load_schema(args.json_schema),
                                       args.repeats, timeline)}
        write_json(args.out, record("throughput-structured-output", args, device, res))
        eng.shutdown()
        return 0
    _reset_prefix_cache(eng)
    log = StepLog(eng, gpu_events=args.step_log is not None)
    before = eng.status()
    batched = _phase("batched", lambda: llm.generate(prompts, params, use_tqdm=False), timeline, expected)
    log.unwrap()
    after = eng.status()
    batched["step_time_split"] = step_time_split(log)
    batched["decode_mbu"] = decode_phase_mbu(eng, batched["step_time_split"]["decode"],
                                             *spec_bandwidth_gbs(device, args.spec_bandwidth_gbs))
    m = batched["decode_mbu"]
    print(f"    decode: {batched['step_time_split']['decode']['steps']} steps in {m['s']:.2f} s read "
          f"{m['bytes'] / 1e12:.3f} TB = {m['read_gbs']:.1f} GB/s"
          + (f", MBU {m['mbu']:.1%} of spec {m['spec_gbs']:.0f} GB/s (floor {m['floor_s']:.2f} s)"
             if m["mbu"] is not None else f" (no MBU: {m['spec_source']})"), flush=True)
    if args.step_log:
        write_step_log(args, llm, log, prompts, params)
    batched.update({k: after[key] - before[key] for k, key in (("preemptions", "num_preemptions"),
                                                               ("steps", "steps"), ("overlapped_steps", "overlapped_steps"))})
    batched.pop("outputs")
    sequential = None
    if args.sequential and args.workload == "random":
        _reset_prefix_cache(eng)
        # a bar per prompt (stderr): this phase runs for minutes on a CPU; its updates cost
        # microseconds against each prompt's whole generation
        sequential = _phase("sequential", lambda: [
            llm.generate([p], sp, use_tqdm=False)[0]
            for p, sp in tqdm(list(zip(prompts, params)), desc="sequential", unit="req", leave=False,
                              dynamic_ncols=True)], timeline, expected)
        sequential.pop("outputs")
        print(f"batched / sequential output throughput: "
              f"{batched['output_tok_s'] / sequential['output_tok_s']:.2f}x")
    memory = cuda_memory(device)
    if memory:
        print(f"KV pool {eng.num_blocks} blocks of {eng.block_size} tokens; device memory peak reserved "
              f"{memory['peak_reserved_gib']:.1f} of {memory['total_gib']:.1f} GiB "
              f"(--gpu-memory-utilization {eng.config.cache.gpu_memory_utilization})")
    res = {"model": eng.model_name, "workload": args.workload, "num_prompts": len(prompts),
           "input_len_range": [min(in_lens), max(in_lens)], "output_len_range": [min(out_lens), max(out_lens)],
           "total_input_tokens": sum(in_lens), "total_output_tokens": expected,
           "engine": {"max_num_seqs": eng.config.scheduler.max_num_seqs,
                      "max_num_batched_tokens": eng.config.scheduler.max_num_batched_tokens,
                      "kv_blocks": eng.num_blocks, "block_size": eng.block_size,
                      "dtype": eng.executor.info().dtype,
                      "gpu_memory_utilization": eng.config.cache.gpu_memory_utilization,
                      "cuda_memory": memory},
           "batched": batched, "sequential": sequential,
           "ratio_batched_over_sequential": (batched["output_tok_s"] / sequential["output_tok_s"])
           if sequential else None}
    eng.shutdown()
    if "vllm" in (args.peers or ()):
        # ferrum's figures first: a peer run cut short at a time limit keeps them
        write_json(args.out, record("throughput", args, device, {**res, "peers": "pending"}))
        # vllm_bench.py's throughput section: 1000 x (1000 in, 1000 out), greedy
        same = args.workload == "nanovllm" or (args.num_prompts == 1000 and args.input_len == [1000, 1000]
                                               and args.output_len == [1000, 1000])
        section = "nanovllm" if args.workload == "nanovllm" else "throughput"
        peer = run_vllm(args, section, eng.config.parallel.tensor_parallel_size)
        res["peers"] = {"vllm": peer}
        # the driver reports its weight format and KV dtype (VB_QUANT / VB_KV in --peer-env)
        ours = (eng.config.quantization or "bf16", eng.config.cache.kv_cache_dtype)
        theirs = (peer.get("quant", "bf16"), peer.get("kv_cache_dtype", "auto"))
        if same and "error" not in peer and ours != theirs:
            print(f"note: vLLM ran weights/KV {theirs}, ferrum {ours}: no ratio "
                  "(pass --peer-env VB_QUANT=... --peer-env VB_KV=...)")
            same = False
        res["ratios"] = {"output_tok_s_vs_vllm": ratio(batched["output_tok_s"], peer.get("output_tok_s"))
                         if same else None}
        if not same and ours == theirs:
            print("note: vLLM's driver ran 1000 x (1000 in, 1000 out), a different workload: no ratio")
        print(f"vLLM {section}: {peer.get('output_tok_s')} output tok/s; ratios {res['ratios']}")
    if args.plot:
        _plot(args.plot, res, f"{eng.model_name} {device}: {len(prompts)} prompts")
    write_json(args.out, record("throughput", args, device, res))
    return 0
