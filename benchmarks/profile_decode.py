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
- prefill: where the time to first token goes at batch 1 for 128 / 1k / 8k-token prompts:
  host time in scheduling, the prefill launch and sampling, against the GPU's kernel time,
  kernel and launch counts and host syncs (`sec_prefill`).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from ferrum.benchmarks.common import config_path as cfg_path, run_sections, save_section  # noqa: E402
from ferrum.benchmarks.mbu import cuda_graph_time_ms  # noqa: E402
from ferrum.benchmarks.sweep import decode_step_times, graph_replay_ms  # noqa: E402


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
        ms = cuda_graph_time_ms(run_cublas, iters=4)
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
                ms = cuda_graph_time_ms(run_triton, iters=4)
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
    save_section(args, "profile_gemv", {"shapes": res})


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
    from ferrum.loader.resolve import resolve_model
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
    save_section(args, f"profile_replay_{args.model}", res)


# ---------------------------------------------------------------------------------------------
def sec_engine(args):
    """Host share of a decode step (issue item: host time < 10% of the step at batch 1 and 256).

    For each TP size and batch B: B prompts of 128 tokens decode `--steps` tokens through the
    full engine (`ferrum.benchmarks.sweep.decode_step_times`: schedule, send to workers, graph
    replay, sample, outputs); step_ms is the mean wall time of the decode-only steps; the
    graph replay of the same batch size on the last step's inputs, back to back on every rank,
    is the GPU time; host_ms = step_ms - replay_ms is what the GPU waits for the host. Each TP
    size runs with async scheduling off and on (`--async-modes`). At TP=1, batch 1, a
    torch.profiler kernel table of one replay is saved too. (`ferrum bench sweep` gives the
    same host share over a whole batch sweep.)"""
    from ferrum import LLM, SamplingParams
    res = {"model": args.model, "quantization": args.quantization, "prompt_len": 128, "steps": args.steps,
           "runs": {}}
    for tp, mode in [(tp, m) for tp in args.tp for m in args.async_modes]:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            continue
        B_max = max(args.engine_batches)
        llm = LLM(f"dummy:{cfg_path(args.model)}", progress=False, tensor_parallel_size=tp,
                  dtype="bfloat16", device=args.device, max_num_seqs=B_max, max_model_len=128 + args.steps + 16,
                  max_num_batched_tokens=8192, async_scheduling=mode == "on", quantization=args.quantization)
        eng, ex = llm.engine, llm.engine.executor
        runner_call = (lambda m, *a: ex.call_all(m, *a)) if tp > 1 else (lambda m, *a: getattr(ex.runner, m)(*a))
        llm.generate([[5] * 128] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for B in args.engine_batches:
            sp = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
            times = decode_step_times(eng, [[(7 + i) % 1000 + 10] * 128 for i in range(B)], sp)
            step_ms = 1000 * sum(times) / len(times)
            row = {"batch": B, "async_scheduling": mode, "decode_steps_timed": len(times), "step_ms": step_ms,
                   "tokens_per_s": B / step_ms * 1000, "symm_mem": getattr(ex, "symm_mem", None)}
            replay = graph_replay_ms(ex, B)
            if replay is not None:
                row.update(replay_ms=replay, host_ms=step_ms - replay, host_share=1 - replay / step_ms)
            if tp == 1 and B == 1 and mode == args.async_modes[-1] and replay is not None:
                st = runner_call("graph_replay_stats", B, 50, 5)
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
    quant = f"_{args.quantization}" if args.quantization else ""
    save_section(args, f"profile_engine_{os.path.basename(args.model).removesuffix('.json')}{quant}", res)


# ---------------------------------------------------------------------------------------------
_SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
             "cudaMemcpy")   # cudaMemcpy (not ...Async) blocks the host
_LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _host_split(eng):
    """Wrap the engine's scheduler, executor prefill and sampler to add up the host time each
    call takes (a launch returns before the GPU finishes unless something syncs). Returns
    (dict of seconds, unwrap)."""
    acc = {"schedule": 0.0, "prefill_call": 0.0, "sampler_call": 0.0}
    orig = {"schedule": eng.scheduler.schedule, "prefill_call": eng.executor.prefill,
            "sampler_call": eng.sampler.__call__}

    def timed(key):
        fn = orig[key]

        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t
        return call
    eng.scheduler.schedule, eng.executor.prefill = timed("schedule"), timed("prefill_call")
    sampler = eng.sampler
    eng.sampler = timed("sampler_call")

    def unwrap():
        eng.scheduler.schedule, eng.executor.prefill, eng.sampler = orig["schedule"], orig["prefill_call"], sampler
    return acc, unwrap


def sec_prefill(args):
    """Where the time to first token goes at batch 1 (issue 16 item 1), per prompt length
    (`--prompt-lens`) and TP size: one engine, cold prompts (no prefix-cache hit).

    - ttft_ms: wall time of `generate([prompt], max_tokens=1)` (median of `--repeats`), and the
      host time inside it spent in scheduling, in the executor's prefill call (a launch: it
      returns before the GPU is done unless something syncs) and in the sampler call;
    - gpu_busy_ms: kernel time of one such call under torch.profiler (TP=1), by category, with
      the number of kernels, of launch API calls and of host syncs (stream/device/event
      synchronize, `.item()` and blocking copies); when gpu_busy_ms is far below ttft_ms the GPU
      waited for the host;
    - prefill_graph: whether the prefill ran as a captured CUDA graph (`--prefill-graphs`)."""
    from ferrum import LLM, SamplingParams
    from torch.profiler import ProfilerActivity, profile
    res = {"model": args.model, "prompt_lens": args.prompt_lens, "runs": {}}
    longest = max(args.prompt_lens)
    for tp in args.tp:
        if args.device == "cuda" and tp > torch.cuda.device_count():
            continue
        llm = LLM(f"dummy:{cfg_path(args.model)}", progress=False, tensor_parallel_size=tp, dtype="bfloat16",
                  device=args.device, max_num_seqs=8, max_model_len=min(8192, longest + 64),
                  max_num_batched_tokens=max(8192, longest))
        eng = llm.engine
        vocab = eng.vocab_size
        sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([[11] * 64], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for P in args.prompt_lens:
            gen = torch.Generator().manual_seed(P)

            def prompt():
                return torch.randint(10, vocab - 10, (P,), generator=gen).tolist()
            llm.generate([prompt()], sp1, use_tqdm=False)  # warm-up (Triton compiles, cuBLAS plans)
            walls, splits = [], []
            for _ in range(args.repeats):
                acc, unwrap = _host_split(eng)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate([prompt()], sp1, use_tqdm=False)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                walls.append(1e3 * (time.perf_counter() - t))
                unwrap()
                splits.append({k: 1e3 * v for k, v in acc.items()})
            order = sorted(range(len(walls)), key=walls.__getitem__)
            mid = order[len(order) // 2]
            row = {"ttft_ms_median": walls[mid], "ttft_ms_all": walls, "host_ms_of_median_run": splits[mid]}
            if tp == 1:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
                with profile(activities=acts) as prof:
                    llm.generate([prompt()], sp1, use_tqdm=False)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                cats, n_kernels, gpu_us, launches, syncs, cpu_ops = {}, 0, 0.0, 0, {}, []
                for e in prof.key_averages():
                    dev_t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                    if e.key in _LAUNCH_OPS:
                        launches += e.count
                    if e.key in _SYNC_OPS:
                        syncs[e.key] = e.count
                    if dev_t and getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
                        n_kernels += e.count
                        gpu_us += dev_t
                        c = _category(e.key)
                        cats[c] = cats.get(c, 0.0) + dev_t
                    elif e.self_cpu_time_total:
                        cpu_ops.append((e.key, e.self_cpu_time_total, e.count))
                cpu_ops.sort(key=lambda x: -x[1])
                row.update(gpu_busy_ms=gpu_us / 1e3, kernels=n_kernels, launch_calls=launches, host_syncs=syncs,
                           kernel_categories_us=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                           top_cpu_ops_us=[{"op": k, "self_us": round(t), "calls": n} for k, t, n in cpu_ops[:20]])
            row["prefill_graph"] = getattr(getattr(eng.executor, "runner", None), "prefill_graphs", None) is not None
            res["runs"][f"tp{tp}_p{P}"] = row
            print(f"tp{tp} P={P}", {k: v for k, v in row.items() if k != "top_cpu_ops_us"}, flush=True)
        llm.shutdown()
        del llm, eng
        import gc
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save_section(args, f"profile_prefill_{os.path.basename(args.model).removesuffix('.json')}", res)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sections", nargs="+", choices=["gemv", "replay", "engine", "prefill"])
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
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 1024, 8000], help="prefill section")
    p.add_argument("--repeats", type=int, default=5, help="prefill section: timed runs per length")
    p.add_argument("--quantization", default=None,
                   help="engine section: weight format of the dummy model (fp8, awq, gptq, gguf_q4_k)")
    p.add_argument("--gemv-modes", nargs="+", default=["0", "1"], help="FERRUM_TRITON_GEMV values to compare")
    args = p.parse_args()
    run_sections(args, globals())

if __name__ == "__main__":
    main()
