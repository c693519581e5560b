"""Sliding-window attention: the paged attention paths (torch on CPU; Triton in the interpreter
and on CUDA) against full attention with the window applied as a mask (float64), for sequences
longer than the window; the block manager's release of blocks outside the window; and the
engine end to end (Mistral-style tiny model vs HF, blocks actually released, prefix caching and
chunked prefill on and off).
Gemma 3's mix of local and global layers is covered against HF in test_models.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_triton_kernels import (HAS_CUDA, HAS_TRITON, _assert_close, _md, _paged_cache,
                                 _ref_attention, _run_interpreted)

from ferrum.engine.block_manager import NULL_BLOCK, BlockManager

HERE = os.path.abspath(__file__)


def _release_before(bt: torch.Tensor, firsts: list[int], page: int) -> torch.Tensor:
    """A copy of block tables with every block wholly before position firsts[b] set to
    NULL_BLOCK, as the engine leaves them: any read of such an entry hits the poisoned
    (NaN) last block of the cache."""
    bt = bt.clone()
    for b, lo in enumerate(firsts):
        bt[b, :max(0, lo) // page] = NULL_BLOCK
    return bt


def check_window_attention(device: str, backend: str = "attention_torch") -> None:
    """`backend`'s decode and prefill with sliding windows 5, 16, 40 against full attention with
    the window as a mask (float64), sequences up to 70 tokens, on a poisoned cache (NaN outside
    the sequences' tokens) whose tables have the blocks before each window released (-1)."""
    import importlib
    tb = importlib.import_module(f"ferrum.ops.{backend}")
    for window in (5, 16, 40):
        gen = torch.Generator().manual_seed(window)
        H, Hkv, D, page = 4, 2, 16, 8
        scale = D ** -0.5
        # decode: one new token at position L - 1 of each sequence
        lens = [1, 7, 33, 70, 41]
        cache, bt, clean = _paged_cache(lens, Hkv, D, page, torch.float32, device, gen)
        q = torch.randn(len(lens), H, D, generator=gen).to(device)
        ref = torch.stack([o[0] for o in _ref_attention(list(q[:, None]), clean, bt, lens,
                                                         [[L - 1] for L in lens], scale, window)])
        full = torch.stack([o[0] for o in _ref_attention(list(q[:, None]), clean, bt, lens,
                                                          [[L - 1] for L in lens], scale)])
        assert (ref - full).abs().max() > 1e-3, "the window must change the result for L > window"
        rel = _release_before(bt, [L - window for L in lens], page)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        # all 5 sequences (the torch backend's batched CSR path on CPU) and the first 3 (one
        # SDPA per sequence over gathered blocks)
        for table in (bt, rel):
            for n in (len(lens), 3):
                md = _md(False, torch.zeros(n, dtype=torch.int64, device=device), table[:n], seq_lens[:n],
                         context_lens=[L - 1 for L in lens[:n]])
                _assert_close(tb.decode_attention(q[:n], cache, md, scale, sliding_window=window), ref[:n],
                              torch.float32, f"{backend} decode window={window} batch={n}")
        # prefill chunks (context, new tokens): from scratch, after cached context, across W
        chunks = [(0, 30), (20, 25), (50, 3), (0, 4)]
        lens = [c + n for c, n in chunks]
        cache, bt, clean = _paged_cache(lens, Hkv, D, page, torch.float32, device, gen)
        qs = [torch.randn(n, H, D, generator=gen) for _, n in chunks]
        pos = [list(range(c, c + n)) for c, n in chunks]
        ref = torch.cat(_ref_attention(qs, clean, bt, lens, pos, scale, window))
        blk = [bt[b].cpu()[torch.tensor(p) // page] for b, p in enumerate(pos)]
        kv = [clean[:, blk[b], torch.tensor(p) % page].float() for b, p in enumerate(pos)]
        k = torch.cat([x[0] for x in kv]).to(device)
        v = torch.cat([x[1] for x in kv]).to(device)
        rel = _release_before(bt, [c - window + 1 for c, _ in chunks], page)
        md = _md(True, torch.zeros(sum(n for _, n in chunks), dtype=torch.int64, device=device), rel,
                 torch.tensor(lens, dtype=torch.int32, device=device), query_lens=[n for _, n in chunks],
                 context_lens=[c for c, _ in chunks])
        _assert_close(tb.prefill_attention(torch.cat(qs).to(device), cache, md, scale, k, v,
                                           sliding_window=window), ref, torch.float32,
                      f"{backend} prefill window={window}")


def check_window_attention_triton(device: str) -> None:
    check_window_attention(device, "attention_triton")


def test_torch_window_attention_equals_masked_full_attention():
    check_window_attention("cpu")


def test_torch_decode_window_paths():
    """The torch decode's other paths: the padded form (no Python lengths, as under CUDA
    graphs) and blocks read in place when consecutive."""
    from ferrum.ops import attention_torch as tb
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, page, window = 4, 2, 16, 8, 16
    scale = D ** -0.5
    lens = [1, 7, 33, 70]
    cache, bt, clean = _paged_cache(lens, Hkv, D, page, torch.float32, "cpu", gen)
    q = torch.randn(len(lens), H, D, generator=gen)
    ref = torch.stack([o[0] for o in _ref_attention(list(q[:, None]), clean, bt, lens,
                                                     [[L - 1] for L in lens], scale, window)])
    # reads whole (clamped) tables and masks, so the cache must be finite (as a real one is)
    padded = _md(False, torch.zeros(len(lens), dtype=torch.int64),
                 _release_before(bt, [L - window for L in lens], page), torch.tensor(lens))
    _assert_close(tb.decode_attention(q, torch.nan_to_num(cache), padded, scale, sliding_window=window), ref,
                  torch.float32, "padded decode")
    one = torch.arange(3, 12)[None]    # one sequence in blocks 3..11
    L = 70
    c1 = torch.randn(2, 12, page, Hkv, D, generator=gen)
    ref1 = _ref_attention([q[:1]], c1.double(), one, [L], [[L - 1]], scale, window)[0]
    md = _md(False, torch.zeros(1, dtype=torch.int64), _release_before(one, [L - window], page),
             torch.tensor([L], dtype=torch.int32), context_lens=[L - 1])
    _assert_close(tb.decode_attention(q[:1], c1, md, scale, sliding_window=window), ref1, torch.float32, "in place")
    assert md.decode_plan[window][0] is None  # read in place, not gathered


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_window_attention_in_interpreter():
    _run_interpreted("check_window_attention_triton", path=HERE)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_triton_window_attention_on_gpu():
    check_window_attention_triton("cuda")


def test_block_manager_releases_blocks_outside_the_window():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 130))                     # 30 tokens: 8 blocks
    bm.allocate("a", prompt, 30)
    bm.commit_full_blocks("a", prompt, 30)
    free0 = bm.num_free_blocks
    assert bm.free_blocks_before("a", 9) == 2          # positions 0..7 (blocks 0, 1)
    table = bm.block_table("a")
    assert table[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in table[2:]
    assert bm.num_free_blocks == free0 + 2             # cached blocks: evictable, so allocatable
    assert bm.free_blocks_before("a", 9) == 0          # idempotent; O(new blocks)
    assert bm.free_blocks_before("a", -5) == 0
    bm.check_invariants()
    # a fork after the release shares the NULL entries without references
    assert bm.fork("a", "b", 30) == 28
    assert bm.block_table("b")[:2] == [NULL_BLOCK, NULL_BLOCK]
    bm.check_invariants()
    bm.free_blocks_before("b", 16)
    bm.check_invariants()
    # a block released before its commit is skipped by the commit (not cached)
    bm.append_slots("a", 40)
    bm.free_blocks_before("a", 37)                     # blocks 0..8, block 8 never committed
    bm.commit_full_blocks("a", prompt + list(range(10)), 40)
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 12
    # the released prefix is still a prefix-cache hit for a new sequence (blocks 0..6 cached)
    assert bm.lookup_prefix(prompt) == 28


def test_engine_releases_blocks_and_matches_hf(tmp_path):
    """A Mistral-style model with a 16-token window: a 90-token prompt and 60 decode steps
    hold about window / block_size + 2 blocks at the end instead of 10; greedy tokens equal HF
    with prefix caching / chunked prefill on and off."""
    from tiny_models import hf_model, make_tiny_model
    from ferrum import LLM, SamplingParams
    folder = make_tiny_model(str(tmp_path / "m"), "mistral", sliding_window=16, seed=21)
    hf = hf_model(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (90, 23)]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=60, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for kw in (dict(), dict(enable_prefix_caching=False, max_num_batched_tokens=32)):
        with LLM(folder, progress=False, dtype="float32", device="cpu", max_model_len=256,
                 block_size=8, **kw) as llm:
            eng = llm.engine
            rid = eng.add_request(None, None, sp, prompt_token_ids=prompts[0])
            peak = 0
            while eng.has_unfinished_requests():
                eng.step()
                seq = eng.requests[rid].seqs[0] if rid in eng.requests else None
                if seq is not None and seq.seq_id in eng.block_manager:
                    live = [b for b in eng.block_manager.block_table(seq.seq_id) if b != NULL_BLOCK]
                    peak = max(peak, len(live)) if seq.num_computed_tokens > 100 else peak
                    eng.block_manager.check_invariants()
            assert 0 < peak <= 16 // 8 + 2, f"live blocks {peak} after the window filled ({kw})"
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want, kw
