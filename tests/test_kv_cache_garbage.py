"""The KV pool is allocated with torch.empty (no zero-fill at start-up), so slots that were
never written may hold anything, NaN and inf included. No attention path may let them
contribute: filling the whole pool with NaN before use must give exactly the logprobs of a
zero-filled pool. (The Triton kernels are checked against a NaN-poisoned cache in
test_triton_kernels.py.)"""
from __future__ import annotations

import torch

from ferrum import LLM, SamplingParams
from ferrum.forward_context import AttentionMetadata
from ferrum.ops import attention_torch as torch_backend
from tiny_models import make_tiny_model


def _run(folder: str, fill: float) -> list:
    # small blocks, chunked prefill and a shared prefix: multi-block tables, prefill chunks
    # with cached context, prefix-cache hits and batched decode all read the pool
    with LLM(folder, progress=False, device="cpu", dtype="float32", block_size=4,
             num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=128) as llm:
        for layer in llm.engine.executor.runner.attn_layers:
            layer.kv_cache.fill_(fill)
        prefix = list(range(10, 30))
        prompts = [prefix + [40, 41, 42], prefix + [50], list(range(60, 67)), [70, 71]]
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert outs[1].num_cached_tokens > 0        # the prefix cache was used
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_nan_filled_pool_gives_the_same_logprobs(tmp_path):
    folder = make_tiny_model(str(tmp_path / "m"), "llama", vocab=128, max_pos=256)
    clean, poisoned = _run(folder, 0.0), _run(folder, float("nan"))
    assert poisoned == clean                          # token ids and top-5 logprobs, exactly
    assert all(v == v for _, lps in poisoned for step in lps for v in step.values())  # no NaN


def test_padded_decode_path_ignores_garbage_slots():
    """decode_attention's padded form (block tables padded to the longest sequence, used when
    context lengths are not known on the host, e.g. CUDA graph capture) against its
    per-sequence form, with every slot past each sequence's length set to NaN / inf."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, bs = 3, 4, 2, 8, 4
    lens = [5, 9, 1]
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]])
    cache = torch.full((2, 8, bs, Hkv, D), float("nan"))
    cache[:, 0] = float("inf")                        # block 0: where padded entries point
    for i, n in enumerate(lens):
        slots = tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        cache.view(2, -1, Hkv, D)[:, slots] = torch.randn(2, n, Hkv, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    md = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(B, dtype=torch.int64),
                           block_tables=tables, seq_lens=torch.tensor(lens), max_seq_len=max(lens),
                           query_lens=[1] * B, context_lens=[n - 1 for n in lens])
    ref = torch_backend.decode_attention(q, cache, md, D ** -0.5)
    md.context_lens = None                            # -> the padded, masked form
    got = torch_backend.decode_attention(q, cache, md, D ** -0.5)
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_allocated_pool_is_not_zero_filled(tmp_path, monkeypatch):
    """allocate_kv_cache leaves the pool as torch.empty returns it (no zero-fill): seen by
    making torch.empty hand out NaN-filled memory while it allocates."""
    folder = make_tiny_model(str(tmp_path / "m"), "llama", vocab=128, max_pos=256)
    with LLM(folder, progress=False, device="cpu", dtype="float32", num_kv_blocks=8,
             max_model_len=64) as llm:
        runner = llm.engine.executor.runner
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
        runner.allocate_kv_cache(8, 16)
        monkeypatch.undo()
        assert torch.isnan(runner.attn_layers[0].kv_cache).all()
