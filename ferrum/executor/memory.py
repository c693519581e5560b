"""Memory requirements per TP rank, from the model config, dtype and TP size, and KV pool
sizing from the memory actually available."""
from __future__ import annotations

import logging

import torch

from ferrum.config import CacheConfig, ModelConfig
from ferrum.executor.cuda_graph import graph_batch_sizes
from ferrum.executor.prefill_graph import PREFILL_GRAPH_MAX_TOKENS
from ferrum.executor.prompt_logprobs import ROWS_PER_SLICE
from ferrum.interfaces import MemoryRequirements
from ferrum.layers.sampler import SAMPLE_CHUNK_ROWS

log = logging.getLogger("ferrum")

# [rows, vocab] float32-sized tensors alive at once in the sampler's widest path
# (ferrum/layers/sampler.py: the logits and their processed copy, logit_bias, penalty counts and
# the penalised copy, temperature-scaled, sorted values + int64 order, the top-p mask, softmax,
# cumsum, the scattered result, probabilities): with every option on, 12.8 of them are alive at
# the peak (measured in tests/test_memory_plan.py); 16 leaves room for the allocator's rounding.
# They are SAMPLE_CHUNK_ROWS rows wide at most (the sampler takes larger batches in slices);
# batch-wide stay the logits and the metadata's logit_bias, output counts and seen mask
# (3.25 copies measured): SAMPLER_BATCH_COPIES.
SAMPLER_ROW_COPIES = 16
SAMPLER_BATCH_COPIES = 4
# the forward's intermediates per token of a step, over `activation_bytes_per_token` (tensors
# alive across a layer boundary, the caching allocator's rounding)
ACTIVATION_FACTOR = 4


def compute_memory_requirements(cfg: ModelConfig, dtype: torch.dtype, tp: int,
                                kv_cache_dtype: torch.dtype | None = None,
                                weight_bits: float | None = None) -> MemoryRequirements:
    """param_bytes: sharded matrices / tp + replicated norms (embedding and LM head are
    vocab-parallel; a tied head is counted once); the decoder's linear weights at
    `weight_bits` per parameter when quantized (QuantConfig.weight_bits, scales included).
    kv_bytes_per_token: K+V of all layers for this rank's KV heads (replicated when
    num_kv_heads < tp), in `kv_cache_dtype` (default: dtype; 1 byte for fp8).
    activation_bytes_per_token: hidden + q/k/v + 2x MLP intermediate, per rank.
    logits_bytes_per_row: a float32 row over the whole vocabulary (rank 0 gathers the shards);
    graph_logits_bytes_per_row: the same row in `dtype`, as a decode CUDA graph's output keeps it."""
    e = torch.finfo(dtype).bits // 8
    kv_e = torch.finfo(kv_cache_dtype or dtype).bits // 8
    h, i, L, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim
    q = cfg.num_attention_heads * D // tp
    kv_heads = max(1, cfg.num_key_value_heads // tp)
    kv = kv_heads * D
    linear = h * (q + 2 * kv) + q * h
    # MoE: experts split (TP) or placed (EP) over the ranks; they stay in `dtype` when the
    # rest is quantized (ferrum/layers/moe.py)
    experts = sum(3 * h * cfg.moe_intermediate_size * cfg.num_experts
                  for layer in range(L) if cfg.is_moe(layer)) // tp
    mlp = sum(cfg.mlp_params(layer) for layer in range(L)) // tp - experts
    bias = q + 2 * kv if cfg.attention_bias else 0
    norms = L * 2 * h + h + (2 * D * L if cfg.qk_norm else 0)
    vocab_rows = -(-cfg.vocab_size // tp)
    emb = vocab_rows * h * (1 if cfg.tie_word_embeddings else 2)
    linear_bytes = (L * linear + mlp) * (weight_bits / 8 if weight_bits else e) + experts * e
    param_bytes = int(linear_bytes + (L * bias + emb + norms) * e)
    kv_bytes_per_token = 2 * L * kv * kv_e
    if cfg.num_experts:  # a token's k expert intermediates
        i = max(i, cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    act = (4 * h + q + 2 * kv + 2 * i // tp) * e
    return MemoryRequirements(param_bytes, kv_bytes_per_token, act, tp, 4 * cfg.vocab_size, e * cfg.vocab_size)


def activation_reserve_bytes(mem: MemoryRequirements, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Device bytes kept out of the KV pool for what a step allocates and frees, per rank:
    - the forward: ACTIVATION_FACTOR x activation_bytes_per_token x max_num_batched_tokens;
    - logits and sampling: SAMPLER_BATCH_COPIES float32 [rows, vocab] tensors for the most
      rows whose logits exist at once (max_num_seqs sampled rows, or a prompt-logprobs slice
      of ROWS_PER_SLICE), and SAMPLER_ROW_COPIES for the sampler's slice of at most
      SAMPLE_CHUNK_ROWS of them;
    - CUDA graphs (their private pool, captured after the pool is allocated): every decode
      graph keeps its own logits output, one row per captured row (`graph_batch_sizes`) in
      the model's dtype (`ferrum.executor.cuda_graph` widens them outside the graph), plus
      the intermediates of the largest capture (a prefill graph of up to
      PREFILL_GRAPH_MAX_TOKENS tokens or the largest decode batch).
    Logits rows were once counted per batched token: Llama-3-8B at 8,192 tokens and 512
    sequences reserved 20.2 GB, then 12.7 GB (a 19% larger pool on an 80 GB card,
    benchmarks/results/h100-2026-12-06c), 10.6 GB with the graphs' rows in bf16 (that run's
    peak reserved memory was 63.3 of the 71.3 GiB budget), 7.9 GB since the sampler works in
    slices of rows. Returns bytes."""
    rows = max(max_num_seqs, ROWS_PER_SLICE)
    graph_tokens = max(min(max_num_batched_tokens, PREFILL_GRAPH_MAX_TOKENS), max_num_seqs)
    return (ACTIVATION_FACTOR * mem.activation_bytes_per_token * (max_num_batched_tokens + graph_tokens)
            + mem.logits_bytes_per_row * (SAMPLER_BATCH_COPIES * rows
                                          + SAMPLER_ROW_COPIES * min(rows, SAMPLE_CHUNK_ROWS))
            + mem.graph_logits_bytes_per_row * sum(graph_batch_sizes(max_num_seqs)))


def num_kv_blocks(mem: MemoryRequirements, cache: CacheConfig, device: str, max_model_len: int,
                  max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """How many KV blocks this rank's pool gets.

    CUDA: gpu_memory_utilization * total memory, minus what is in use now (weights, the CUDA
    context), minus `activation_reserve_bytes`. CPU: `kv_cache_memory` bytes if given,
    else enough for max_num_seqs * max_model_len tokens capped at 1 GiB."""
    per_block = mem.kv_bytes_per_block(cache.block_size)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.startswith("cuda"):
        # Layers hold cycles (parameter -> bound weight_loader -> module), so a model dropped
        # by an earlier engine in this process is only freed by the cyclic GC: collect first.
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(torch.device(device))
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used \
            - activation_reserve_bytes(mem, max_num_batched_tokens, max_num_seqs)
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        budget = min(1 << 30, per_block * max_num_seqs * -(-max_model_len // cache.block_size))
    return max(0, budget // per_block)


def pool_flag(cache: CacheConfig, device: str) -> str:
    """The flag that sizes this KV pool: --num-kv-blocks when it is set, else
    --gpu-memory-utilization on CUDA, --kv-cache-memory on CPU."""
    if cache.num_kv_blocks is not None:
        return "--num-kv-blocks"
    return "--gpu-memory-utilization" if device.startswith("cuda") else "--kv-cache-memory"


def fit_max_model_len(max_model_len: int, num_blocks: int, cache: CacheConfig, device: str,
                      requested: int | None) -> int:
    """The context length (tokens) to serve with a pool of `num_blocks` blocks: max_model_len
    when one sequence of it fits, or when the user set it (`requested` not None; the engine
    then refuses to start with CacheConfigError) or the pool has no block; else the pool's
    whole capacity, num_blocks * block_size tokens (a block multiple), with one warning that
    gives both values and the flags that change them."""
    fits = num_blocks * cache.block_size
    if requested is not None or num_blocks == 0 or fits >= max_model_len:
        return max_model_len
    log.warning("max_model_len %d -> %d tokens: the KV pool (%d blocks of %d tokens) holds no "
                "longer sequence; set --max-model-len, and %s for a larger pool, to change it",
                max_model_len, fits, num_blocks, cache.block_size, pool_flag(cache, device))
    return fits
