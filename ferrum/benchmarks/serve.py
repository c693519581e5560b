"""`ferrum bench serve`: HTTP load against an OpenAI-compatible server, and the same workload
offline for comparison.

Workload: `--num-prompts` prompts of `--input-len` random token ids (seeded, drawn from the
server's vocabulary), each asking for exactly `--output-len` tokens (`ignore_eos`, greedy by
default), sent as streaming /v1/completions requests at `--request-rate` requests/s (Poisson
arrivals; inf = all at once) with at most `--max-concurrency` in flight. Without `--base-url`
the benchmark starts `ferrum serve MODEL [engine flags]` itself on a free loopback port.

Per request (client side, seconds): TTFT = first streamed text chunk - send time; ITL = gaps
between later chunks; TPOT = (latency - TTFT) / (output tokens - 1); output tokens come from
the usage chunk (`stream_options.include_usage`). Reported: mean and p50/p90/p99 of each in
ms, request throughput (req/s) and output token throughput (tok/s) over the wall time from
the first send to the last answer.

`--offline` also runs the same prompts through `LLM.generate` in this process and prints
server / offline output throughput. `--repeat K` alternates K server and K offline runs (new
prompts each repeat, so no prefix-cache hits across runs) and compares medians, which keeps
drifting load on a shared machine from favouring either side. `--threads N` gives both the
same torch intra-op thread count (OMP_NUM_THREADS of the server started here,
torch.set_num_threads for the offline run); on shared cores use 1 (see benchmarks/common.py).

Example (CPU, SmolLM2):
    ferrum bench serve smollm2 --num-prompts 32 --input-len 64 --output-len 64 \
        --offline --repeat 5 --threads 1 --out bench.json --plot bench.png
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from ferrum.benchmarks.common import add_common_args, llm_from_config, positive_int, random_prompts
from ferrum.benchmarks.run_record import record, setup_threads, write_json

_PCTS = (50, 90, 99)


def add_parser(subparsers, add_engine_args) -> None:
    """Add `ferrum bench serve` and its flags."""
    p = subparsers.add_parser("serve", help="HTTP serving benchmark (TTFT, TPOT, ITL, throughput)")
    add_engine_args(p)
    g = p.add_argument_group("load")
    g.add_argument("--base-url", default=None,
                   help="running server, e.g. http://127.0.0.1:8000 (default: start one)")
    g.add_argument("--api-key", default=None, help="API key to send (default: none)")
    g.add_argument("--served-model-name", default=None, help="`model` to send (default: the "
                   "first of /v1/models)")
    g.add_argument("--num-prompts", type=positive_int, default=64, help="requests per run")
    g.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per request")
    g.add_argument("--output-len", type=positive_int, default=64, help="generated tokens per request")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals; inf: all at once")
    g.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight (default: no limit)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    g.add_argument("--plot", default=None, help="write a PNG of latency CDFs here (matplotlib) (default: no plot)")
    g.add_argument("--offline", action="store_true",
                   help="also run the workload through LLM.generate and print server/offline")
    g.add_argument("--repeat", type=positive_int, default=1,
                   help="run the load (and the offline run) this many times, alternating; report "
                   "medians")
    add_common_args(p)   # --out, --seed (--threads is an engine flag: also OMP_NUM_THREADS of a server started here)
    p.set_defaults(func=main)


# ---- workload -------------------------------------------------------------------------------------
def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process of `rate` requests/s (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class RequestResult:
    """One streamed request as the client saw it (times in seconds)."""

    ok: bool = False
    error: str = ""
    send_time: float = 0.0          # seconds since the run started
    ttft: float = 0.0               # seconds
    latency: float = 0.0            # seconds
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)   # seconds between chunks after the first

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, seconds; None with < 2 tokens."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ---- client ---------------------------------------------------------------------------------------
async def _one(client, url: str, body: dict, t_run: float, result: RequestResult) -> None:
    t0 = time.perf_counter()
    result.send_time = t0 - t_run
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    result.error = msg["error"].get("message", "error")
                    return
                now = time.perf_counter()
                if msg.get("usage"):
                    result.output_tokens = msg["usage"]["completion_tokens"]
                if any(c.get("text") for c in msg.get("choices", [])):
                    if last is None:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - t0
        result.ok = last is not None and result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                   rate: float, max_concurrency: int | None, temperature: float, seed: int,
                   api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send every prompt as a streaming completion; returns per-request results and the wall
    time in seconds from the first send to the last answer."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    url = base_url.rstrip("/") + "/v1/completions"

    def body(p):
        return {"model": model, "prompt": p, "max_tokens": output_len, "temperature": temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=None) as client:
        await _one(client, url, body(prompts[0][:8]), time.perf_counter(), RequestResult())  # warm-up
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results = [RequestResult() for _ in prompts]
        t_run = time.perf_counter()

        async def send(i, delay):
            await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t_run)))
            if sem is None:
                return await _one(client, url, body(prompts[i]), t_run, results[i])
            async with sem:
                await _one(client, url, body(prompts[i]), t_run, results[i])

        await asyncio.gather(*(send(i, d) for i, d in enumerate(arrival_times(len(prompts), rate, seed))))
        return results, time.perf_counter() - t_run


# ---- statistics -----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Counts, throughput (per second over `duration` seconds) and mean / percentile
    TTFT, TPOT, ITL and end-to-end latency in ms of the successful requests."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration if duration else 0.0,
         "output_throughput": out_tokens / duration if duration else 0.0,
         "total_output_tokens": out_tokens}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name, vals in series.items():
        s[f"mean_{name}_ms"] = 1000 * sum(vals) / len(vals) if vals else float("nan")
        for q in _PCTS:
            s[f"p{q}_{name}_ms"] = 1000 * percentile(vals, q)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        s["errors"] = errors[:5]
    return s


def print_summary(s: dict, args) -> None:
    """Print a `summarize` dict as a table."""
    print(f"\n==== ferrum bench serve: {args.num_prompts} prompts x {args.input_len} in / "
          f"{args.output_len} out, rate {args.request_rate}, concurrency {args.max_concurrency} ====")
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    print(f"request throughput  {s['request_throughput']:.3f} req/s")
    print(f"output throughput   {s['output_throughput']:.2f} tok/s")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        print(f"{label:<5} ms  mean {s[f'mean_{name}_ms']:9.1f}  " +
              "  ".join(f"p{q} {s[f'p{q}_{name}_ms']:9.1f}" for q in _PCTS))
    for e in s.get("errors", []):
        print(f"error: {e}")


def plot(results: list[RequestResult], path: str) -> bool:
    """CDFs of TTFT, TPOT and ITL in one PNG; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if r.ok]
    series = {"TTFT": [r.ttft for r in ok], "TPOT": [r.tpot for r in ok if r.tpot is not None],
              "ITL": [x for r in ok for x in r.itl]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for ax, (name, vals) in zip(axes, series.items()):
        v = sorted(1000 * x for x in vals)
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


# ---- server and offline runs ------------------------------------------------------------------------
def _engine_argv(args) -> list[str]:
    """The engine flags of `args` that differ from their defaults, as command-line words (to
    start `ferrum serve` with the same engine)."""
    from ferrum.entrypoints.args import add_engine_args
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p, model_positional=False)
    words = []
    for a in p._actions:
        value = getattr(args, a.dest, a.default)
        if value == a.default:
            continue
        if isinstance(a, argparse.BooleanOptionalAction):  # --x / --no-x
            words.append(a.option_strings[0] if value else a.option_strings[1])
        elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            words.append(a.option_strings[-1])
        else:
            words += [a.option_strings[-1], str(value)]
    return words


def start_server(args) -> tuple[subprocess.Popen, str]:
    """`ferrum serve` on a free loopback port; returns (process, base URL) once /health is OK.
    Raises RuntimeError if it exits or is not healthy within 10 minutes."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ferrum.entrypoints.cli", "serve", args.model, "--port", str(port),
           *_engine_argv(args)]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    print("starting:", " ".join(cmd), file=sys.stderr)
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ferrum serve exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("ferrum serve did not become healthy within 600 s")


class OfflineRunner:
    """The same workload through LLM.generate in this process, on the EngineConfig the server
    was started with. run(prompts) -> output tokens/s over the wall time of one generate()."""

    def __init__(self, args):
        from ferrum.entrypoints.args import config_from_args
        from ferrum.sampling_params import SamplingParams
        self.llm = llm_from_config(config_from_args(args))
        self.params = SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                     temperature=args.temperature)
        self.llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], self.params, use_tqdm=False)  # warm-up

    def run(self, prompts: list[list[int]]) -> dict:
        """Generate for all prompts in one offline batch: duration (s), output tokens and
        throughputs per second."""
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"duration_s": dt, "total_output_tokens": n, "output_throughput": n / dt,
                "request_throughput": len(prompts) / dt}

    def shutdown(self) -> None:
        """Shut the offline engine down."""
        self.llm.shutdown()


def _ferrum_status(base_url: str) -> dict | None:
    """GET /status of a ferrum server (engine steps, tokens, preemptions); None elsewhere."""
    import httpx
    try:
        r = httpx.get(base_url.rstrip("/") + "/status", timeout=10)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _device(args) -> str:
    from ferrum.config import resolve_device
    return resolve_device(args.device)


def _server_info(base_url: str, api_key: str | None) -> tuple[str, int]:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    return data["id"], int(data.get("vocab_size") or 32000)


def _jsonable(x):
    """Non-finite floats (rate inf, nan percentiles of no data) as strings: JSON has none."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(args) -> int:
    """Run the load test (against --base-url, or a server started here) and with --offline
    the offline comparison; print and optionally write the record; returns the exit status."""
    threads = setup_threads(args.threads)   # this process: the offline run (and the client)
    proc, offline, runs = None, None, []
    try:
        url = args.base_url
        if url is None:
            proc, url = start_server(args)
        name, vocab = _server_info(url, args.api_key)
        model = args.served_model_name or name
        if args.offline:
            offline = OfflineRunner(args)
        # Repeats alternate server and offline runs so that drifting load on a shared machine
        # hits both alike; each repeat has its own prompts (no prefix-cache hits across runs).
        for rep in range(args.repeat):
            prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed + 1000 * rep)
            results, duration = asyncio.run(run_load(
                url, model, prompts, args.output_len, args.request_rate, args.max_concurrency,
                args.temperature, args.seed + 1000 * rep, args.api_key))
            run = {"server": summarize(results, duration), "results": results}
            if offline is not None:
                run["offline"] = offline.run(prompts)
            runs.append(run)
            print(f"run {rep + 1}/{args.repeat}: server {run['server']['output_throughput']:.2f} tok/s"
                  + (f", offline {run['offline']['output_throughput']:.2f} tok/s" if offline else ""),
                  file=sys.stderr)
        server_status = _ferrum_status(url)
    finally:
        if offline is not None:
            offline.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    # Report the run of median server throughput in full; the throughputs of all runs too.
    order = sorted(range(len(runs)), key=lambda i: runs[i]["server"]["output_throughput"])
    med = runs[order[len(order) // 2]]
    summary, results = med["server"], med["results"]
    print_summary(summary, args)
    report = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "_argv")},
              "torch_threads": threads, "server": summary,
              "server_output_throughputs": [r["server"]["output_throughput"] for r in runs],
              "server_engine_status": server_status, "requests": [asdict(r) for r in results]}
    if offline is not None:
        srv = [r["server"]["output_throughput"] for r in runs]
        off = [r["offline"]["output_throughput"] for r in runs]
        report["offline_output_throughputs"] = off
        report["server_output_throughput_median"] = statistics.median(srv)
        report["offline_output_throughput_median"] = statistics.median(off)
        report["server_over_offline"] = statistics.median(srv) / statistics.median(off)
        report["server_over_offline_best"] = max(srv) / max(off)
        print(f"server  output throughput {statistics.median(srv):.2f} tok/s (median of {len(srv)}; "
              f"best {max(srv):.2f})")
        print(f"offline (LLM.generate) output throughput {statistics.median(off):.2f} tok/s (median "
              f"of {len(off)}; best {max(off):.2f})")
        print(f"server / offline output throughput: {report['server_over_offline']:.3f} (medians), "
              f"{report['server_over_offline_best']:.3f} (best runs)")
    if args.plot:
        print(f"plot: {args.plot}" if plot(results, args.plot) else "plot skipped: no matplotlib")
    write_json(args.out, _jsonable(record("serve", args, _device(args), report)))
    return 0 if all(r["server"]["failed"] == 0 for r in runs) else 1
