"""CUDA graphs for decode (one graph per batch size), captured with the TP collectives inside.

A decode step of a small batch is a few hundred tiny kernels; replaying a captured graph
removes their launch overhead. Graphs need fixed addresses, so inputs live in static buffers:
the batch is padded up to the next captured size, padded rows write their K/V to slot -1
(skipped by the Triton store kernel) and have seq_len 0. The Triton decode kernel reads
seq_lens and block tables from device memory, so one graph serves every context length up to
max_model_len.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from ferrum.executor.model_inputs import PinnedStaging, take_prev_sampled
from ferrum.forward_context import AttentionMetadata, forward_context
from ferrum.interfaces import KvCacheHandle

log = logging.getLogger("ferrum")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to max_num_seqs (as vLLM)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeCudaGraphs:
    """One captured decode step per batch size in `batch_sizes` (each with its forward, its
    TP collectives and the logits), over static input buffers sized for the largest batch and
    `max_blocks_per_seq` blocks per sequence. Captured at construction, largest first, sharing
    one memory pool; `run` replays the smallest graph that fits the batch."""

    def __init__(self, runner, batch_sizes: list[int], max_blocks_per_seq: int):
        self.runner = runner
        self.sizes = sorted(batch_sizes)
        max_bs, dev = self.sizes[-1], runner.device
        M = max_blocks_per_seq
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(max_bs, M, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        # host staging (pinned, two in turn: the host fills step n+1's while step n's copy
        # may still be queued)
        self.staging = PinnedStaging((max_bs, 5 + M), torch.device(dev))
        # token, position, slot -1 (skipped), seq_len 0, no previous-step row
        self.pad_row = torch.tensor([0, 0, -1, 0, -1])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.pool = None
        self.max_blocks = M
        free0 = torch.cuda.mem_get_info(dev)[0]
        for bs in reversed(self.sizes):  # largest first so smaller graphs reuse its pool
            self._capture(bs)
        used = free0 - torch.cuda.mem_get_info(dev)[0]
        log.info("captured %d decode CUDA graphs (batch %d..%d), %.0f MiB",
                 len(self.sizes), self.sizes[0], max_bs, used / 2**20)

    def _attn_metadata(self, bs: int) -> AttentionMetadata:
        """Metadata over the first bs rows of the static buffers (no host lengths)."""
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
                                 max_seq_len=self.max_blocks * self.runner.block_size)

    def _forward(self, bs: int):
        with forward_context(self._attn_metadata(bs), self.runner.attn_backend):
            hidden = self.runner.model(self.input_ids[:bs], self.positions[:bs])
        # logits stay in the model's dtype inside the graph: run() widens them to float32 in
        # the copy it returns anyway (one pass instead of a cast here plus a clone there)
        return self.runner.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up: Triton autotune / cuBLAS handles before capture
                self._forward(bs)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._forward(bs)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[bs] = (g, out)

    @torch.inference_mode()
    def replay_stats(self, bs: int, iters: int = 50, profile_steps: int = 0) -> dict:
        """GPU time of the batch-`bs` graph replayed back to back on the inputs of the last
        step (ms per replay, CUDA events), and with profile_steps > 0 the kernel time per step
        by kernel name (torch.profiler, us). Benchmarks only; under TP every rank must call it."""
        g, _ = self.graphs[bs]
        g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        res = {"replay_ms": a.elapsed_time(b) / iters}
        if profile_steps:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(profile_steps):
                    g.replay()
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t and not e.key.startswith("cudaGraph"):
                    kernels[e.key] = {"us_per_step": t / profile_steps, "calls_per_step": e.count / profile_steps}
            res["kernels"] = kernels
        return res

    def can_run(self, batch: int) -> bool:
        """True when a graph of at least `batch` rows was captured."""
        return batch <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, token_ids: list[int], kv: list[KvCacheHandle], prev: torch.Tensor | None = None,
            prev_rows: list[int] | None = None) -> torch.Tensor | None:
        """Replay the decode step for these sequences (token_ids[i] at position
        kv[i].num_tokens): fill one pinned host row per sequence, copy it to the static
        buffers, replay. Returns logits [B, vocab] float32 (a copy; None on TP ranks > 0).
        prev / prev_rows: see ModelRunner.decode (input ids from the previous step's sampled
        ids, on the device)."""
        B = len(token_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, B)]
        M = max(len(h.block_table) for h in kv)
        h, h_np = self.staging.next()
        h = h[:bs]
        # one host tensor per step: [token, position, slot, seq_len, prev row, block table...],
        # filled from one flat list through numpy (3x faster than torch.tensor on nested lists:
        # at batch 256 this is on the host's critical path every step)
        W = 5 + M
        flat: list[int] = []
        rows = prev_rows or [-1] * B
        for t, hd, r in zip(token_ids, kv, rows):
            n, bt = hd.num_tokens, hd.block_table
            flat += (t, n, hd.slot(n), n + 1, r)
            flat += bt
            if len(bt) < M:
                flat += [0] * (M - len(bt))
        h_np[:B, :W] = np.fromiter(flat, dtype=np.int64, count=B * W).reshape(B, W)
        h[B:, :5] = self.pad_row
        dev = self.staging.to_device(h)
        if prev is None:
            self.input_ids[:bs].copy_(dev[:, 0])
        else:
            self.input_ids[:bs].copy_(take_prev_sampled(dev[:, 0], prev, dev[:, 4]))
        self.positions[:bs].copy_(dev[:, 1])
        self.slot_mapping[:bs].copy_(dev[:, 2])
        self.seq_lens[:bs].copy_(dev[:, 3])
        self.block_tables[:bs, :M].copy_(dev[:, 5:5 + M])
        g, out = self.graphs[bs]
        g.replay()
        # a copy: the graph's output buffer is overwritten by the next replay
        return None if out is None else out[:B].to(torch.float32, copy=True)
