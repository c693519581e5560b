"""Where a decode step's time goes on the GPU (issue: GPU speed). Writes JSON + text tables.

    python benchmarks/profile_decode.py gemv replay engine --tp 1 2 --out $OUT

Sections:
- gemv: bandwidth of every weight matrix of a batch-1 Llama-3-8B step (TP=1 and TP=2 shards):
  cuBLAS (F.linear) vs ferrum's Triton GEMV over a few block shapes. Weights rotate through
  copies totalling > 4x the 50 MB L2, so each call reads from HBM.
- replay: the model's decode CUDA graph replayed back to back on every rank (no host work, no
  scheduler): GPU ms per step at TP=1 / TP=2, and a torch.profiler kernel table per rank
  (kernel time summed by name and by category, per step).
- engine: the full engine at batch 1 and 256: wall time per decode step against the GPU time
  of the same step's graph replay, i.e. the host's share of the step (incl. the TP protocol),
  plus a kernel table at TP=1 batch 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def cfg_path(name):
    return name if os.path.isfile(name) else os.path.join(HERE, "configs", f"{name}.json")


def dump(out, name, data):
    os.makedirs(out, exist_ok=True)
    data = {"command": " ".join([sys.executable] + sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "torch": torch.__version__, **data}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    print(f"== {name}: {json.dumps(data)[:2500]}", flush=True)


def _graph_time_ms(fn, iters=20, reps=5):
    """Median over reps of (one CUDA graph of `iters` calls of fn) / iters, in ms."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / iters)
    return sorted(ts)[len(ts) // 2]


# ---------------------------------------------------------------------------------------------
def sec_gemv(args):
    from ferrum.ops import gemv
    H, I, V, D, Hq, Hkv = 4096, 14336, 128256, 128, 32, 8
    shapes = {}
    for tp in (1, 2):
        shapes[f"qkv/tp{tp}"] = ((Hq + 2 * Hkv) * D // tp, H)
        shapes[f"o_proj/tp{tp}"] = (H, Hq * D // tp)
        shapes[f"gate_up/tp{tp}"] = (2 * I // tp, H)
        shapes[f"down/tp{tp}"] = (H, I // tp)
        shapes[f"lm_head/tp{tp}"] = (V // tp, H)
    configs = [(4, 512, 4, 3), (8, 512, 4, 3), (8, 1024, 4, 2), (16, 512, 8, 3), (16, 256, 4, 4),
               (4, 1024, 4, 2), (8, 256, 4, 4), (32, 256, 8, 3)]
    res = {}
    for name, (N, K) in shapes.items():
        copies = max(2, -(-200 * 2**20 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)

        def run_cublas(ws=ws, x=x):
            for w in ws:
                torch.nn.functional.linear(x, w)
        nbytes = N * K * 2 * copies
        row = {"N": N, "K": K, "MB": N * K * 2 / 2**20}
        ms = _graph_time_ms(run_cublas, iters=4)
        row["cublas_us"] = 1000 * ms / copies
        row["cublas_TBs"] = nbytes / (ms / 1000) / 1e12
        ref = torch.nn.functional.linear(x, ws[0]).float()
        best = None
        for cfg in configs:
            if K % cfg[1]:
                continue
            try:
                err = (gemv.gemv(x, ws[0], config=cfg).float() - ref).abs().max().item()

                def run_triton(cfg=cfg, ws=ws, x=x):
                    for w in ws:
                        gemv.gemv(x, w, config=cfg)
                ms = _graph_time_ms(run_triton, iters=4)
            except Exception as e:  # a config that does not compile/fit: report, go on
                row[f"triton{cfg}"] = f"{type(e).__name__}: {e}"[:200]
                continue
            tbs = nbytes / (ms / 1000) / 1e12
            row[f"triton{list(cfg)}"] = {"us": 1000 * ms / copies, "TBs": tbs, "max_err": err}
            if best is None or tbs > best[1]:
                best = (list(cfg), tbs)
        row["triton_best"] = best
        res[name] = row
        print(name, {k: v for k, v in row.items() if not k.startswith("triton[")}, flush=True)
        del ws
        torch.cuda.empty_cache()
    dump(args.out, "profile_gemv", {"shapes": res})


# ---------------------------------------------------------------------------------------------
def _category(name: str) -> str:
    n = name.lower()
    if "one_shot" in n or "all_reduce" in n or "nccl" in n or "allgather" in n or "symm" in n:
        return "communication"
    if "gemv" in n or "gemm" in n or "nvjet" in n or "cutlass" in n or "sm90_xmma" in n or "splitk" in n:
        return "gemv/gemm"
    if "decode_split" in n or "decode_merge" in n or "prefill_kernel" in n:
        return "attention"
    if "write_kv" in n:
        return "kv store"
    if "rms" in n:
        return "rmsnorm"
    if "rope" in n:
        return "rope"
    if "silu" in n:
        return "silu_and_mul"
    if "embedding" in n or "index" in n:
        return "embedding"
    return "other"


def _replay_rank(rank, world, port, args, q):
    from ferrum.executor.cuda_graph import DecodeCudaGraphs
    from ferrum.executor.model_runner import ModelRunner
    from ferrum.executor.tp_rank import init_distributed
    from ferrum.interfaces import KvCacheHandle
    from ferrum.model_store import resolve_model
    dev = f"cuda:{rank}"
    if world > 1:
        init_distributed(rank, world, dev, f"tcp://127.0.0.1:{port}", 600)
    else:
        torch.cuda.set_device(dev)
    runner = ModelRunner(resolve_model(f"dummy:{cfg_path(args.model)}"), dev, torch.bfloat16,
                         "dummy", 0, progress=False)
    ctx = args.context
    per_seq = -(-(ctx + 64) // 16)
    batches = args.batches
    runner.allocate_kv_cache(1 + max(batches) * per_seq, 16)
    symm = runner.enable_symm_mem_all_reduce() if world > 1 else None
    graphs = DecodeCudaGraphs(runner, batches, per_seq)
    runner.graphs = graphs
    out = {"rank": rank, "world": world, "symm_mem": symm,
           "triton_gemv": os.environ.get("FERRUM_TRITON_GEMV") == "1", "batches": {}}
    for B in batches:
        kv = [KvCacheHandle(str(i), list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), ctx, 16)
              for i in range(B)]
        graphs.run([1] * B, kv)  # fills the static inputs
        g, _ = graphs.graphs[B]
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 100
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b) / n
        steps = 5
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                g.replay()
            torch.cuda.synchronize()
        kern, cats = {}, {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0)
            if not t or e.key.startswith("cudaGraph"):
                continue
            kern[e.key] = {"us_per_step": t / steps, "calls_per_step": e.count / steps}
            c = _category(e.key)
            cats[c] = cats.get(c, 0.0) + t / steps
        total = sum(cats.values())
        out["batches"][B] = {"replay_ms": ms, "kernel_us_per_step": total,
                             "gap_us_per_step": 1000 * ms - total,
                             "categories_us": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                             "kernels": dict(sorted(kern.items(), key=lambda kv: -kv[1]["us_per_step"])[:40]),
                             "num_kernels_per_step": sum(v["calls_per_step"] for v in kern.values())}
        print(f"rank {rank}/{world} batch {B}: replay {ms:.3f} ms, kernels {total:.0f} us, "
              f"{dict((k, round(v)) for k, v in out['batches'][B]['categories_us'].items())}", flush=True)
    q.put(out)
    if world > 1:
        import torch.distributed as dist
        dist.barrier()
        runner.release()
        dist.destroy_process_group()


def sec_replay(args):
    import torch.multiprocessing as mp
    res = {"model": args.model, "context": args.context, "runs": {}}
    for tp in args.tp:
        if tp > torch.cuda.device_count():
            continue
        for gemv_flag in args.gemv_modes:
            os.environ["FERRUM_TRITON_GEMV"] = gemv_flag
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs = [ctx.Process(target=_replay_rank, args=(r, tp, port, args, q)) for r in range(tp)]
            for p in procs:
                p.start()
            outs = [q.get(timeout=900) for _ in range(tp)]
            for p in procs:
                p.join(timeout=60)
            res["runs"][f"tp{tp}_gemv{gemv_flag}"] = sorted(outs, key=lambda o: o["rank"])
    os.environ.pop("FERRUM_TRITON_GEMV", None)
    dump(args.out, f"profile_replay_{args.model}", res)


# ---------------------------------------------------------------------------------------------
def sec_engine(args):
    """Host share of a decode step (issue item: host time < 10% of the step at batch 1 and 256).

    For each TP size and batch B: B prompts of 128 tokens decode `--steps` tokens through the
    full engine (LLM engine.step: schedule, send to workers, graph replay, sample, outputs).
    Over the steps with no prefill, step_ms is the wall time per step; the graph replay of the
    same batch size on the last step's inputs, back to back on every rank, is the GPU time;
    host_ms = step_ms - replay_ms is what the GPU waits for the host. Each TP size runs with
    async scheduling off and on (`--async-modes`): with it on, the host prepares step n+1
    while the GPU runs step n, so host_ms is only the part the overlap does not hide. At TP=1,
    batch 1, a torch.profiler kernel table of one replay is saved too."""
    from ferrum import LLM, SamplingParams
    res = {"model": args.model, "prompt_len": 128, "steps": args.steps, "runs": {}}
    for tp, mode in [(tp, m) for tp in args.tp for m in args.async_modes]:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            continue
        B_max = max(args.engine_batches)
        llm = LLM(f"dummy:{cfg_path(args.model)}", progress=False, tensor_parallel_size=tp,
                  dtype="bfloat16", device=args.device, max_num_seqs=B_max, max_model_len=128 + args.steps + 16,
                  max_num_batched_tokens=8192, async_scheduling=mode == "on")
        eng, ex = llm.engine, llm.engine.executor
        runner_call = (lambda m, *a: ex.call_all(m, *a)) if tp > 1 else (lambda m, *a: getattr(ex.runner, m)(*a))
        prefills = [0]
        f = ex.prefill

        def counted(*a, **k):
            prefills[0] += 1
            return f(*a, **k)
        ex.prefill = counted
        llm.generate([[5] * 128] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for B in args.engine_batches:
            sp = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
            for i in range(B):
                eng.add_request(None, None, sp, prompt_token_ids=[(7 + i) % 1000 + 10] * 128)
            times = []
            while eng.has_unfinished_requests():
                n0 = prefills[0]
                t = time.perf_counter()
                eng.step(final_only=True)  # as LLM.generate runs it
                dt = time.perf_counter() - t
                if prefills[0] == n0:
                    times.append(dt)
            times = times[2:-2]  # drop the edges (first decode after prefill, last partial)
            step_ms = 1000 * sum(times) / len(times)
            prof = 5 if (tp == 1 and B == 1 and mode == args.async_modes[-1]) else 0
            st = runner_call("graph_replay_stats", B, 50, prof)
            row = {"batch": B, "async_scheduling": mode, "decode_steps_timed": len(times), "step_ms": step_ms,
                   "tokens_per_s": B / step_ms * 1000, "symm_mem": getattr(ex, "symm_mem", None)}
            if st is not None:
                row.update(replay_ms=st["replay_ms"], host_ms=step_ms - st["replay_ms"],
                           host_share=1 - st["replay_ms"] / step_ms)
                if "kernels" in st:
                    cats = {}
                    for k, v in st["kernels"].items():
                        cats[_category(k)] = cats.get(_category(k), 0.0) + v["us_per_step"]
                    row["kernel_categories_us"] = dict(sorted(cats.items(), key=lambda kv: -kv[1]))
                    row["kernels"] = dict(sorted(st["kernels"].items(), key=lambda kv: -kv[1]["us_per_step"])[:30])
            res["runs"][f"tp{tp}_b{B}_async_{mode}"] = row
            print(f"tp{tp} B={B} async {mode}", {k: v for k, v in row.items() if k != "kernels"}, flush=True)
        llm.shutdown()
        del llm
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    dump(args.out, f"profile_engine_{os.path.basename(args.model).removesuffix('.json')}", res)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sections", nargs="+", choices=["gemv", "replay", "engine"])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cuda", help="engine section only (cpu: a smoke run)")
    p.add_argument("--engine-batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--async-modes", nargs="+", default=["off", "on"], choices=["off", "on"],
                   help="engine section: async scheduling off / on")
    p.add_argument("--gemv-modes", nargs="+", default=["0", "1"], help="FERRUM_TRITON_GEMV values to compare")
    args = p.parse_args()
    from h200_suite import run_sections  # benchmarks/ is sys.path[0] when run as a script
    run_sections(args, globals())


if __name__ == "__main__":
    main()
