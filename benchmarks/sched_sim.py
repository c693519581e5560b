"""Replay `ferrum bench throughput`'s workload through the scheduler alone (no model, no GPU):
steps, preemptions, tokens computed, rows per step, and a step-time estimate, so an admission
or preemption policy can be weighed before a GPU run.

    python benchmarks/sched_sim.py [--requests 1000] [--input-len 1000] [--output-len 1000]
        [--kv-blocks 46825] [--block-size 16] [--max-num-seqs 512] [--max-num-batched-tokens 8192]

Every request is queued at once (greedy, ignore_eos: exactly --output-len tokens each), as the
benchmark does; each step's scheduled prefill chunks and decodes are marked computed, a
sequence whose tokens are all computed samples one, and one that reaches --output-len is
removed. The defaults are the bf16 Llama-3-8B pool of benchmarks/results/h200-2026-12-02c
(46,825 blocks at 512 sequences), whose GPU run the scheduler of then replayed step for step
(2,879 steps here, 2,883 there; 236 preemptions in both). The scheduler of 869e892-fb9b119,
whose reserve held its learned floor from the first finish, replayed h100-2026-12-06d's run
(22,432 blocks: 6,013 steps here, 6,018 there, no preemptions in either) with the benchmark's
warm-up request (--warm-finishes 1: it runs to its max_tokens, so the scheduler learns output
share 1 before the timed phase). Since then the floor waits for a first preemption.

The estimate: per step `--step-ms` (the weights' read: 15 GB at ~3.3 TB/s = 4.6 ms for
Llama-3-8B bf16) + the decodes' context tokens x `--kv-bytes-per-token` (131,072: 32 layers x
8 KV heads x 128 x K and V x 2 bytes) / `--kv-gbs` + prefill tokens / `--prefill-tok-s`. With
the defaults it gives 106.9 s for that run (measured 110.5 s) and 103.1 s at 256 sequences
(104.8 s measured on 12-02): a guide for comparing policies, not a figure to report.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ferrum import SamplingParams  # noqa: E402
from ferrum.config import SchedulerConfig  # noqa: E402
from ferrum.engine.block_manager import BlockManager  # noqa: E402
from ferrum.engine.scheduler import Scheduler  # noqa: E402
from ferrum.engine.sequence import Request, Sequence  # noqa: E402


def make_scheduler(kv_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   max_len: int) -> Scheduler:
    """The engine's Scheduler over a BlockManager of `kv_blocks` (no prefix caching)."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_len),
                     BlockManager(kv_blocks, block_size, enable_prefix_caching=False), max_len)


def run_workload(sched: Scheduler, requests: int, input_len: int, output_len: int, step_ms: float = 4.6,
                 kv_bytes_per_token: int = 131072, kv_gbs: float = 3300.0, prefill_tok_s: float = 40000.0,
                 sample_every: int = 200, tag: str = "") -> dict:
    """Queue `requests` x (input_len in, output_len out) at once on `sched` (seq ids prefixed by
    `tag`) and step it until all finish; the counts of `simulate`."""
    if min(requests, input_len, output_len) < 1:
        raise ValueError(f"requests, input and output lengths must be >= 1 (got {requests}, {input_len}, "
                         f"{output_len})")
    need = -(-(input_len + output_len) // sched.bm.block_size)
    if need > sched.bm.num_blocks:   # the engine refuses such a request in add_request
        raise ValueError(f"one request needs {need} blocks of {sched.bm.block_size} tokens; the pool has "
                         f"{sched.bm.num_blocks}")
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    preempted_before = sched.num_preemptions
    for i in range(requests):   # distinct prompts (no prefix sharing, as the benchmark's random ids)
        req = Request(f"{tag}{i}", None, [1 + (i * 7 + j) % 1000 for j in range(input_len)], sp)
        seq = Sequence(f"{tag}{i}", req, 0)
        req.seqs.append(seq)
        sched.add(seq)
    steps = computed = decode_rows = 0
    est_s = 0.0
    running = []
    while sched.waiting or sched.running:
        out = sched.schedule()
        steps += 1
        if out.is_empty():
            raise RuntimeError(f"step {steps} scheduled nothing with {len(sched.waiting)} waiting")
        context = sum(c.seq.num_tokens for c in out.decodes)
        prefill = sum(c.num_tokens for c in out.prefills)
        est_s += step_ms / 1e3 + context * kv_bytes_per_token / (kv_gbs * 1e9) + prefill / prefill_tok_s
        decode_rows += len(out.decodes)
        for chunk in out.decodes + out.prefills:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            computed += chunk.num_tokens
            if seq.num_computed_tokens == seq.num_tokens:   # the step samples this sequence
                seq.token_ids.append(5)
                if seq.num_tokens - seq.num_prompt_tokens >= output_len:
                    sched.remove(seq, completed=True)
        if steps % sample_every == 0:
            running.append(len(sched.running))
    return {"steps": steps, "preemptions": sched.num_preemptions - preempted_before, "computed_tokens": computed,
            "ideal_tokens": requests * (input_len + output_len - 1), "decode_rows_per_step": decode_rows / steps,
            "running_sampled": running, "estimated_s": est_s, "estimated_output_tok_s": requests * output_len / est_s,
            "free_blocks_at_end": sched.bm.num_free_blocks, "output_share": sched.output_share,
            "scheduler": sched}


def simulate(requests: int, input_len: int, output_len: int, kv_blocks: int, block_size: int = 16,
             max_num_seqs: int = 512, max_num_batched_tokens: int = 8192, step_ms: float = 4.6,
             kv_bytes_per_token: int = 131072, kv_gbs: float = 3300.0, prefill_tok_s: float = 40000.0,
             sample_every: int = 200, warm_finishes: int = 0) -> dict:
    """Run the workload to the end on a fresh scheduler, after `warm_finishes` sequences that
    ran to their max_tokens (`ferrum bench throughput`'s warm-up request is one); returns steps,
    preemptions, computed / ideal tokens, mean decode rows per step, running sequences every
    `sample_every` steps, the time estimate (s), the free blocks left (all of them: nothing
    leaks), the output share the scheduler learned (1: every sequence ran to its max_tokens) and
    the scheduler (`run_workload` can run a second workload on it). ValueError when a request
    cannot fit the pool or a count is below 1."""
    if min(kv_blocks, block_size, max_num_seqs, max_num_batched_tokens) < 1 or warm_finishes < 0:
        raise ValueError("kv_blocks, block_size, max_num_seqs and max_num_batched_tokens must be >= 1, "
                         "warm_finishes >= 0")
    sched = make_scheduler(kv_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                           input_len + output_len + block_size)
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(warm_finishes):
        warm = Sequence(f"warm{i}", Request(f"warm{i}", None, [1] * 8, sp), 0)
        warm.token_ids += [5] * output_len
        sched.remove(warm, completed=True)
    return run_workload(sched, requests, input_len, output_len, step_ms, kv_bytes_per_token, kv_gbs,
                        prefill_tok_s, sample_every)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--kv-blocks", type=int, default=46825)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--step-ms", type=float, default=4.6)
    p.add_argument("--kv-bytes-per-token", type=int, default=131072)
    p.add_argument("--kv-gbs", type=float, default=3300.0)
    p.add_argument("--prefill-tok-s", type=float, default=40000.0)
    p.add_argument("--warm-finishes", type=int, default=1,
                   help="sequences finished at max_tokens before the workload (the benchmark's warm-up: 1)")
    a = p.parse_args()
    try:
        r = simulate(a.requests, a.input_len, a.output_len, a.kv_blocks, a.block_size, a.max_num_seqs,
                     a.max_num_batched_tokens, a.step_ms, a.kv_bytes_per_token, a.kv_gbs, a.prefill_tok_s,
                     warm_finishes=a.warm_finishes)
    except ValueError as e:
        p.error(str(e))
    print(f"{r['steps']} steps, {r['preemptions']} preemptions, {r['computed_tokens']:,} tokens computed for "
          f"{r['ideal_tokens']:,}, {r['decode_rows_per_step']:.0f} decode rows per step; estimate "
          f"{r['estimated_s']:.1f} s = {r['estimated_output_tok_s']:,.0f} output tok/s; running every 200 steps "
          f"{r['running_sampled']}")


if __name__ == "__main__":
    main()
