"""CUDA graphs for a single sequence's prefill: the time to first token of a short prompt.

An eager prefill launches a few hundred kernels from Python, one per op per layer; for a short
prompt each finishes on the GPU before the host has issued the next, so the forward takes as
long as the host needs to launch it (issue 16: ~20 ms for 128 tokens of Llama-3-8B, whose
weights read in ~4 ms). Replaying a captured graph issues them all at once.

One graph per token bucket (powers of two from 16 to `PREFILL_GRAPH_MAX_TOKENS`, capped by the
step's token budget); a chunk of T tokens of one sequence runs in the smallest bucket >= T over
static buffers: padded rows get token 0, position 0 and slot -1 (the K/V store skips them). The
Triton prefill kernel takes the real query length from `cu_seqlens_q` and the cached context
from `seq_lens` (both on the device), so no real row attends to a padded one, and only the last
real row's hidden state reaches the LM head (its index is a device buffer too). Rows are
independent in every other op (linears, norms, RoPE), so padding changes no real row's
values. Needs the Triton attention backend (its grid depends only on the bucket); several
sequences in one step, or a longer chunk, run eagerly.
"""
from __future__ import annotations

import bisect
import logging

import numpy as np
import torch

from ferrum.executor.model_inputs import PinnedStaging
from ferrum.forward_context import AttentionMetadata, forward_context
from ferrum.interfaces import KvCacheHandle

log = logging.getLogger("ferrum")

PREFILL_GRAPH_MAX_TOKENS = 2048


def prefill_graph_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... up to min(max_tokens, PREFILL_GRAPH_MAX_TOKENS); [] below 16."""
    cap = min(max_tokens, PREFILL_GRAPH_MAX_TOKENS)
    sizes, t = [], 16
    while t <= cap:
        sizes.append(t)
        t *= 2
    return sizes


class PrefillGraphInputs:
    """The static buffers of a single-sequence prefill of up to `max_tokens` tokens with up to
    `max_blocks` blocks in its table, on the runner's device, and the forward over their first
    T rows (what a graph captures; also run directly by the tests, without capture)."""

    def __init__(self, runner, max_tokens: int, max_blocks: int):
        self.runner, self.max_tokens, self.max_blocks = runner, max_tokens, max_blocks
        dev = runner.device
        T, M = max_tokens, max_blocks
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(1, M, dtype=torch.int64, device=dev)
        # int32 as the eager path's (prepare_prefill): the same compiled attention kernel
        self.seq_lens = torch.zeros(1, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.zeros(2, dtype=torch.int64, device=dev)
        self.last = torch.zeros(1, dtype=torch.int64, device=dev)
        # host staging, pinned on CUDA, two used in turn (the copy of the previous fill may
        # still be queued): [ids | positions | slots] (T each), block table (M), seq_len, q_len
        self.staging = PinnedStaging((3 * T + M + 2,), torch.device(dev))

    def fill(self, token_ids: list[int], kv: KvCacheHandle, bucket: int) -> None:
        """Load a chunk (token_ids continue kv's sequence after its kv.num_tokens cached
        tokens; len(token_ids) <= bucket <= max_tokens) into the static buffers, rows >=
        len(token_ids) padded: one host-to-device copy, no host sync."""
        T, M = self.max_tokens, self.max_blocks
        q, ctx, bs = len(token_ids), kv.num_tokens, kv.block_size
        buf, h = self.staging.next()
        h[:3 * T] = 0
        h[2 * T:3 * T] = -1                          # padded rows: slot -1, nothing written
        pos = np.arange(ctx, ctx + q, dtype=np.int64)
        table = np.asarray(kv.block_table, dtype=np.int64)
        h[:q] = token_ids
        h[T:T + q] = pos
        h[2 * T:2 * T + q] = table[pos // bs] * bs + pos % bs
        h[3 * T:3 * T + M] = 0
        h[3 * T:3 * T + len(table)] = table
        h[3 * T + M:] = (ctx + q, q)
        dev = self.staging.to_device(buf)
        self.input_ids.copy_(dev[:T])
        self.positions.copy_(dev[T:2 * T])
        self.slot_mapping.copy_(dev[2 * T:3 * T])
        self.block_tables[0].copy_(dev[3 * T:3 * T + M])
        self.seq_lens.copy_(dev[3 * T + M:3 * T + M + 1])
        self.cu_seqlens_q[1:].copy_(dev[3 * T + M + 1:])
        self.last.copy_(dev[3 * T + M + 1:] - 1)

    def forward(self, bucket: int) -> torch.Tensor | None:
        """The model over the first `bucket` rows; logits [1, vocab] float32 of the chunk's
        last real token (None on TP ranks > 0)."""
        metadata = AttentionMetadata(is_prefill=True, slot_mapping=self.slot_mapping[:bucket],
                               block_tables=self.block_tables, seq_lens=self.seq_lens,
                               max_seq_len=self.max_blocks * self.runner.block_size,
                               query_lens=[bucket], cu_seqlens_q=self.cu_seqlens_q)
        model = self.runner.model
        with forward_context(metadata, self.runner.attn_backend):
            hidden = model(self.input_ids[:bucket], self.positions[:bucket], self.last)
            logits = model.compute_logits(hidden)
        return None if logits is None else logits.float()


class PrefillCudaGraphs:
    """One captured prefill per bucket in `buckets` over one `PrefillGraphInputs`, sharing the
    memory pool `pool` (the decode graphs'); `run` replays the smallest bucket that fits."""

    def __init__(self, runner, buckets: list[int], max_blocks: int, pool=None):
        self.buckets = sorted(buckets)
        self.inputs = PrefillGraphInputs(runner, self.buckets[-1], max_blocks)
        self.pool = pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        dev = runner.device
        free0 = torch.cuda.mem_get_info(dev)[0]
        for bucket in reversed(self.buckets):   # largest first: the smaller ones reuse its pool
            self._capture(bucket)
        log.info("captured %d prefill CUDA graphs (%d..%d tokens), %.0f MiB", len(self.buckets),
                 self.buckets[0], self.buckets[-1], (free0 - torch.cuda.mem_get_info(dev)[0]) / 2**20)

    @torch.inference_mode()
    def _capture(self, bucket: int) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):   # warm up: Triton compiles, cuBLAS picks its kernels
                self.inputs.forward(bucket)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.inputs.forward(bucket)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[bucket] = (g, out)

    def can_run(self, token_ids: list[list[int]]) -> bool:
        """True for one sequence's chunk of at most the largest bucket's tokens."""
        return len(token_ids) == 1 and len(token_ids[0]) <= self.buckets[-1]

    @torch.inference_mode()
    def run(self, token_ids: list[int], kv: KvCacheHandle) -> torch.Tensor | None:
        """Replay the prefill of this chunk; logits [1, vocab] float32 (a copy; None on TP
        ranks > 0)."""
        bucket = self.buckets[bisect.bisect_left(self.buckets, len(token_ids))]
        self.inputs.fill(token_ids, kv, bucket)
        g, out = self.graphs[bucket]
        g.replay()
        return None if out is None else out.clone()
