"""The model executor contract (GUIDE section 1).

The engine talks to a model only through `ModelExecutor`. `SingleDeviceExecutor` and
`TensorParallelExecutor` both implement it and the engine cannot tell them apart.

Token flow for one step: the scheduler chooses sequences; the block manager gives each a
`KvCacheHandle` (its block table); the executor writes the new tokens' K/V into the slots
named by the table and returns logits for the last position of each sequence.

Slot of token position p of a sequence: `block_table[p // block_size] * block_size +
p % block_size` (the vLLM "slot mapping").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class KvCacheHandle:
    """A sequence's paged KV cache: physical block ids, in order, of `block_size` tokens each.

    `num_tokens` is how many positions already hold valid K/V *before* this step (the
    context length). The block table must already cover every position this step writes.
    """

    cache_id: str
    block_table: list[int]
    num_tokens: int
    block_size: int

    def slot(self, pos: int) -> int:
        """The cache slot of token position `pos` (slot mapping above). IndexError when the
        table does not cover pos."""
        return self.block_table[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class PrefillInput:
    """New tokens for `len(token_ids)` sequences: a whole prompt or a chunk of one.

    token_ids[i]: the chunk of sequence i (>= 1 tokens), at positions
    `kv[i].num_tokens .. kv[i].num_tokens + len(token_ids[i]) - 1`; positions before the
    chunk (prefix-cache hit or earlier chunks) are read from the cache, never recomputed.

    Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` + `logprobs`), when a request
    asks for them:
    prompt_logprob_targets: None, or per sequence the ids of the tokens that follow rows
        0 .. len - 1 of its chunk (`targets[i][j]` = the prompt token at position
        `kv[i].num_tokens + j + 1`; len <= len(token_ids[i]); [] for a sequence that wants none).
        The executor returns, for each such row, the log-softmax of that row's logits at the
        target id and the top `num_top_logprobs` entries, computed on the device.
    num_top_logprobs: K, the top-K width over every row that asks (0: only the target's).
    """

    token_ids: list[list[int]]
    kv: list[KvCacheHandle]
    prompt_logprob_targets: list[list[int]] | None = None
    num_top_logprobs: int = 0


@dataclass
class PromptLogprobs:
    """Logprobs of the rows named by `PrefillInput.prompt_logprob_targets`, on TP rank 0's
    device; R = total targets, rows in sequence order then chunk order.

    token_logprobs: [R] float32, log_softmax(logits[row])[target].
    top_ids: [R, K] int64 and top_logprobs: [R, K] float32, the K largest logprobs of each row,
        descending (K = `num_top_logprobs`; K = 0 gives [R, 0]).
    token_ranks: [R] int64, the target's vocabulary rank: how many of the row's logprobs are
        >= its own (1 = the most likely token; vLLM's `Logprob.rank`).
    Logprobs are of the raw model logits (no penalties, bias or temperature), as vLLM's.
    """

    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    token_ranks: torch.Tensor


@dataclass
class PrefillOutput:
    """logits: [num_seqs, vocab_size] float32, for the last token of each chunk.
    prompt_logprobs: when the input named targets, else None."""

    logits: torch.Tensor
    kv: list[KvCacheHandle]
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class DecodeInput:
    """One new token per running sequence, batched in one forward pass.

    token_ids[i] sits at position `kv[i].num_tokens` of sequence i.

    Async scheduling (the engine prepares step n+1 while the device runs step n) adds:
    prev_sampled: [P] int64 on the executor's (rank 0) device, the ids the sampler drew in the
        previous step, which the host has not read yet; None when no row needs it.
    prev_rows: per row, the index into prev_sampled of that row's input token (its
        token_ids[i] is then ignored), or -1 to use token_ids[i]. Under TP the ids reach the
        other ranks by one broadcast on the TP group.
    """

    token_ids: list[int]
    kv: list[KvCacheHandle]
    prev_sampled: torch.Tensor | None = None
    prev_rows: list[int] | None = None


@dataclass
class DecodeOutput:
    """logits: [num_seqs, vocab_size] float32."""

    logits: torch.Tensor
    kv: list[KvCacheHandle]


@dataclass
class ModelInfo:
    """What is loaded: HF architecture name, vocabulary / hidden sizes, layers, attention heads
    (full model, not per rank), head_dim, max_model_len (tokens), dtype and device names, TP
    size, parameter count."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype: str
    device: str
    tensor_parallel_size: int
    num_params: int


@dataclass
class MemoryRequirements:
    """Bytes, per TP rank. From ModelConfig, dtype and TP size (see `compute`).

    param_bytes: weights one rank holds (sharded matrices + replicated norms).
    kv_bytes_per_token: K and V of every layer for one token on one rank
        = 2 * num_layers * kv_heads_per_rank * head_dim * dtype_bytes.
    activation_bytes_per_token: rough peak activations of one token in flight
        (hidden, qkv, mlp intermediate), used to reserve headroom.
    logits_bytes_per_row: one float32 row of logits over the whole vocabulary (what rank 0
        holds after gathering the vocab-parallel shards), per row sampled or scored.
    graph_logits_bytes_per_row: one row of logits in the model's dtype, as each decode CUDA
        graph keeps its output rows.
    """

    param_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    tensor_parallel_size: int
    logits_bytes_per_row: int
    graph_logits_bytes_per_row: int

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one KV block of `block_size` tokens on one rank."""
        return self.kv_bytes_per_token * block_size


@dataclass
class ExecutorCapabilities:
    """Static limits: max sequences per step, max sequence length (tokens), KV block size
    (tokens) and count (per rank, the pool the engine's block manager hands out), supported
    dtypes and devices, TP / PP sizes, whether decode runs in CUDA graphs, memory needs."""

    max_batch_size: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int
    dtypes: list[str]
    devices: list[str]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    cuda_graphs: bool
    memory: MemoryRequirements


@dataclass
class ExecutorStatus:
    """Live numbers. `running_sequences` are the sequences whose caches the executor touched
    and that were not yet released. KV block counts are not here: the block manager owns the
    pool and the engine's status reports it (`LLMEngine.status()`: kv_blocks_total / free,
    kv_cache_usage)."""

    running_sequences: int
    prefill_steps: int
    decode_steps: int
    prefill_tokens: int
    decode_tokens: int


@runtime_checkable
class ModelExecutor(Protocol):
    """The engine's only view of a model (GUIDE section 1); every call runs on all TP ranks."""

    def info(self) -> ModelInfo:
        """The loaded model's shape, dtype and placement."""

    def prefill(self, inp: PrefillInput) -> PrefillOutput:
        """Compute the chunks' K/V into the slots their handles name and return the logits of
        each chunk's last token, [num_seqs, vocab_size] float32; advances each handle's
        num_tokens by its chunk length."""

    def decode(self, inp: DecodeInput) -> DecodeOutput:
        """One token per sequence: write its K/V, return logits [num_seqs, vocab_size]
        float32; advances each handle's num_tokens by 1."""

    def release_cache(self, cache_id: str) -> None:
        """The sequence is finished or preempted: forget its handle on every rank."""

    def capabilities(self) -> ExecutorCapabilities:
        """Static limits and memory requirements (valid after construction)."""

    def status(self) -> ExecutorStatus:
        """Live numbers (live sequences, step and token counters)."""

    def health(self) -> str | None:
        """None while steps can run; else why not (a dead or out-of-step TP rank, a device
        fault). Cheap and thread-safe: the server's /health asks it between steps."""

    def warmup(self) -> None:
        """Prepare for serving (CUDA graph capture, collectives); called once by the engine."""

    def shutdown(self) -> None:
        """Release devices, memory and worker ranks; idempotent."""
