"""The CUDA KV pool is what is left after the weights and `activation_reserve_bytes`: the bytes
a step allocates and frees. Its two per-step terms are measured here on CPU, as the peak bytes
of the tensors the forward / the sampler create and hold at once (a dispatch-mode tracker: the
CUDA kernels allocate nothing themselves, so the tensors torch hands out are what a step's
peak is made of), against the constants the reserve uses."""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ferrum import LLM
from ferrum.config import ModelConfig
from ferrum.executor.memory import (ACTIVATION_FACTOR, SAMPLER_BATCH_COPIES, SAMPLER_ROW_COPIES,
                                    activation_reserve_bytes, compute_memory_requirements)
from ferrum.layers.sampler import SAMPLE_CHUNK_ROWS
from ferrum.interfaces import KvCacheHandle
from ferrum.layers.sampler import Sampler, SamplingMetadata
from ferrum.sampling_params import SamplingParams
from tiny_models import make_tiny_model

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192}


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode that are alive at once (a storage
    counts from the op that returns it until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self.seen:
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)


def test_tracker_counts_live_tensors_only():
    with PeakBytes() as p:
        a, b = torch.zeros(1000), torch.zeros(1000)
        del a
        c = b + 1
        for _ in range(5):
            d = torch.zeros(1000) * 2    # zeros and the new d while the old d lives: 5 at most
    assert p.peak == 5 * 4000 and p.live == 3 * 4000
    del b, c, d


@pytest.mark.parametrize("B", [32, 4 * SAMPLE_CHUNK_ROWS])
def test_sampler_widest_path_fits_its_row_copies(B):
    """Every sampling option at once (penalties, bias, min_tokens, top-k/p, min-p, logprobs):
    the logits, the metadata's [B, V] tensors and what the sampler creates stay within
    SAMPLER_BATCH_COPIES float32 [B, V] tensors plus SAMPLER_ROW_COPIES of its slice of at most
    SAMPLE_CHUNK_ROWS rows (measured: 12.8 copies of 32 rows; 3.25 of 256 + 9.5 of 64)."""
    V = 4096
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.2,
                        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={5: 2.0}, logprobs=20,
                        min_tokens=3)
    with PeakBytes() as p:
        logits = torch.randn(B, V)
        md = SamplingMetadata.build([sp] * B, [[1, 2, 3]] * B, [[4, 5]] * B, [None] * B, [2], V, "cpu")
        out = Sampler()(logits, md)
    assert out.token_ids.shape == (B,) and len(out.logprobs) == B
    rows = p.peak / (V * 4)
    chunk = min(B, SAMPLE_CHUNK_ROWS)
    assert 8 * chunk < rows <= SAMPLER_BATCH_COPIES * B + SAMPLER_ROW_COPIES * chunk, rows / B
    if B > SAMPLE_CHUNK_ROWS:   # sliced: well under the 12.8 batch-wide copies of one pass
        assert rows / B < 6, rows / B


@pytest.mark.parametrize("family,extra", [("llama", {}),
                                          ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                                             moe_intermediate_size=128))])
def test_forward_peak_fits_the_activation_factor(tmp_path, family, extra):
    """A prefill chunk's forward (the last row's logits included) holds at most
    ACTIVATION_FACTOR x activation_bytes_per_token per token at once (measured 1.0-2.6x)."""
    folder = make_tiny_model(str(tmp_path / family), family, hidden=256, inter=1024, vocab=128,
                             max_pos=1024, **extra)
    T = 256
    with LLM(folder, progress=False, device="cpu", dtype="bfloat16", num_kv_blocks=T // 16, block_size=16,
             max_model_len=T, max_num_batched_tokens=T) as llm:
        runner = llm.engine.executor.runner
        per_token = runner.memory_requirements(1).activation_bytes_per_token
        with torch.inference_mode(), PeakBytes() as p:
            logits, _ = runner.prefill([[i % 120 + 2 for i in range(T)]],
                                       [KvCacheHandle("a", list(range(T // 16)), 0, 16)])
        assert logits.shape == (1, 128)
    assert per_token < p.peak / T <= ACTIVATION_FACTOR * per_token, p.peak / T / per_token


def test_reserve_counts_logits_per_row_not_per_token():
    """Llama-3-8B bf16: the logits rows scale with max_num_seqs only. At 8,192 batched tokens
    and 512 sequences the reserve is 7.9 GB; counting a float32 logits row per batched token
    (as before) reserved 20.2 GB, a quarter of an 80 GB card taken from the KV pool, the
    decode graphs' rows in float32 (they are bf16) 12.7 GB, a batch-wide sampler 10.6 GB."""
    mem = compute_memory_requirements(ModelConfig.from_hf_dict(LLAMA3_8B), torch.bfloat16, 1)
    assert mem.logits_bytes_per_row == 4 * 128256 and mem.graph_logits_bytes_per_row == 2 * 128256
    r = activation_reserve_bytes(mem, 8192, 512)
    assert 7.8e9 < r < 8.1e9
    # the decode graphs' 8,463 output rows (graph_batch_sizes(512)) in float32 instead
    as_f32 = dataclasses.replace(mem, graph_logits_bytes_per_row=mem.logits_bytes_per_row)
    assert activation_reserve_bytes(as_f32, 8192, 512) - r == 8463 * 2 * 128256
    # tokens past the graphs' largest capture cost the forward's intermediates only
    assert activation_reserve_bytes(mem, 16384, 512) - r == ACTIVATION_FACTOR * mem.activation_bytes_per_token * 8192
    # more sequences: more sampled rows and more decode graphs, each with its logits
    assert activation_reserve_bytes(mem, 8192, 1024) - r > SAMPLER_BATCH_COPIES * 512 * mem.logits_bytes_per_row
    # TP=2: each rank's forward holds half the heads and MLP columns, rank 0 the whole logits
    mem2 = compute_memory_requirements(ModelConfig.from_hf_dict(LLAMA3_8B), torch.bfloat16, 2)
    assert mem2.logits_bytes_per_row == mem.logits_bytes_per_row
    assert mem2.activation_bytes_per_token < mem.activation_bytes_per_token
