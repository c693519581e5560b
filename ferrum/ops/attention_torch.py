"""Paged attention in plain PyTorch: the reference backend, the one the model runner picks off
CUDA. Same functions, shapes and KV layout as `ferrum.ops.attention_triton`.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V).
K/V are always read through the block table; nothing is kept per sequence elsewhere.
Grouped-query attention (Ainslie et al. 2023) via SDPA's `enable_gqa`.
FP8 KV cache (`torch.float8_e4m3fn`): K and V are stored divided by the layer's k_scale /
v_scale ([1] float32 tensors) and multiplied back in float32 when read.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ferrum.forward_context import AttentionMetadata
from ferrum.ops.rope_kv import RopeInputs


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (saturating at +-448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def read_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached K or V in `dtype`: times `scale` (in float32) when the cache is FP8."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def rope_write_kv(kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor, rope: RopeInputs, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k / v [T, Hkv, D]: q and k normed and rotated (`RopeInputs.apply`), then
    `write_kv`; returns the rotated (q, k)."""
    return rope.apply_and_store(write_kv, kv_cache, q, k, v, slot_mapping, k_scale, v_scale)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write this step's K/V into the paged cache, in place. k, v: [T, Hkv, D] (cast to the
    cache dtype; FP8: divided by k_scale / v_scale [1] float32 and rounded to e4m3) -> flat
    slots `slot_mapping` [T] int64 (block_id * block_size + offset, all >= 0: padded
    CUDA-graph rows with slot -1 only meet the Triton backend)."""
    _, nb, bs, h, d = kv_cache.shape
    if kv_cache.dtype == FP8:  # index_copy_ has no float8 kernel: copy the bytes
        raw = kv_cache.view(torch.uint8)
        raw[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, to_fp8(k, k_scale).view(torch.uint8))
        raw[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, to_fp8(v, v_scale).view(torch.uint8))
        return
    kv_cache[0].view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """One sequence's positions [lo, hi): [hi - lo, Hkv, D]. Only the blocks holding them are
    read (blocks before a sliding window may be released: table entry -1). (`index_select`
    copies whole blocks; advanced indexing `cache[table]` is several times slower on CPU.)"""
    bs = cache.shape[1]
    first, last = lo // bs, -(-hi // bs)
    rows = cache.index_select(0, block_table[first:last]).flatten(0, 1)
    return rows[lo - first * bs:hi - first * bs]


def _window_lo(pos: int, sliding_window: int | None) -> int:
    """First key position a query at `pos` sees: pos - window + 1 (HF sliding_window_overlay:
    key k is visible when k > pos - window), or 0 without a window."""
    return 0 if not sliding_window else max(0, pos - sliding_window + 1)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                      scale: float, k: torch.Tensor, v: torch.Tensor,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      sliding_window: int | None = None) -> torch.Tensor:
    """Causal paged attention for prefill chunks: q [T, H, D] (new tokens of all sequences,
    concatenated in metadata order) -> new [T, H, D]. k, v: [T, Hkv, D] this step's K/V
    (already written to the cache; a chunk with no cached context attends to them directly, as
    stored: rounded to e4m3 first when the cache is FP8, so it sees what later steps read).
    Query j of a sequence sits at position context_len + j and sees keys 0..context_len + j
    (causal with an offset), with `sliding_window` W only keys > context_len + j - W (only the
    cached positions some query of the chunk can see are read); query_lens / context_lens /
    block_tables come from attn_metadata."""
    if kv_cache.dtype == FP8:
        k, v = read_kv(to_fp8(k, k_scale), q.dtype, k_scale), read_kv(to_fp8(v, v_scale), q.dtype, v_scale)
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(attn_metadata.query_lens, attn_metadata.context_lens)):
        qi = q[start:start + qlen].transpose(0, 1)  # [H, qlen, D]
        lo = _window_lo(ctx, sliding_window)        # first key of the chunk's first query
        if ctx == 0:
            ki, vi = k[start:start + qlen], v[start:start + qlen]
        else:
            ki = _gather(kv_cache[0], attn_metadata.block_tables[i], lo, ctx + qlen)
            vi = _gather(kv_cache[1], attn_metadata.block_tables[i], lo, ctx + qlen)
        if ctx == 0 and not sliding_window:
            mask, causal = None, True
        else:
            # row j (position ctx + j) may see key positions lo + c <= ctx + j (and inside W)
            kpos = lo + torch.arange(ki.shape[0], device=q.device)[None, :]
            qpos = (ctx + torch.arange(qlen, device=q.device))[:, None]
            mask = kpos <= qpos
            if sliding_window:
                mask &= kpos > qpos - sliding_window
            causal = False
        # 4-D [1, heads, len, D] so CPU gets the flash kernel (3-D takes the math path).
        o = F.scaled_dot_product_attention(
            qi[None], read_kv(ki.transpose(0, 1), q.dtype, k_scale)[None],
            read_kv(vi.transpose(0, 1), q.dtype, v_scale)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[start:start + qlen] = o[0].transpose(0, 1)
        start += qlen
    return out


def _decode_plan(attn_metadata: AttentionMetadata, block_size: int, sliding_window: int | None):
    """Per step and window, shared by all layers with that window (memoised in
    `attn_metadata.decode_plan`, a dict by window): sequence i reads its positions
    [lo_i, n_i) (n_i = context + 1, lo_i the window start), which lie in blocks first_i ..
    ceil(n_i / block_size) of its table. Returns (blocks, spans): `blocks` the flat list of
    those blocks to gather, or None when every sequence's blocks are consecutive ids (then K/V
    are read in place and spans index cache slots); spans[i] = (a, b) such that rows [a, b) of
    the gathered (or flattened) K/V are positions [lo_i, n_i)."""
    if attn_metadata.decode_plan is None:
        attn_metadata.decode_plan = {}
    plan = attn_metadata.decode_plan.get(sliding_window)
    if plan is None:
        lens = [c + 1 for c in attn_metadata.context_lens]
        los = [_window_lo(n - 1, sliding_window) for n in lens]
        first = [lo // block_size for lo in los]
        last = [-(-n // block_size) for n in lens]
        bt = attn_metadata.block_tables
        consecutive = True
        if max(b - a for a, b in zip(first, last)) > 1:
            # every row's blocks first_i .. last_i step by exactly 1 (one vectorised check)
            cols = torch.arange(bt.shape[1] - 1, device=bt.device)[None, :]
            in_use = ((cols >= torch.tensor(first, device=bt.device)[:, None])
                      & (cols < (torch.tensor(last, device=bt.device) - 1)[:, None]))
            consecutive = bool(((bt[:, 1:] - bt[:, :-1] == 1) | ~in_use).all())
        if consecutive:  # read in place: position p of sequence i is slot block(p) * bs + p % bs
            heads = bt[torch.arange(len(lens)), torch.tensor(first)].tolist()
            blocks = None
            spans = [(h * block_size + lo - f * block_size, h * block_size + n - f * block_size)
                     for h, lo, f, n in zip(heads, los, first, lens)]
        else:  # gathered: sequence i's blocks start where the blocks before it end
            rows = [bt[i, a:b] for i, (a, b) in enumerate(zip(first, last))]
            blocks = rows[0] if len(rows) == 1 else torch.cat(rows)
            spans, acc = [], 0
            for lo, f, n, b in zip(los, first, lens, last):
                base = (acc - f) * block_size
                spans.append((base + lo, base + n))
                acc += b - f
        plan = attn_metadata.decode_plan[sliding_window] = (blocks, spans)
    return plan


# Batched decode reads the cache in place through sparse kernels from this many sequences on:
# at 1 sequence the single in-place SDPA is faster, from 4 on the two sparse kernels beat a
# gather plus one SDPA per sequence (2-core CPU, SmolLM2 shapes: figures in
# benchmarks/results/README.md).
CSR_MIN_BATCH = 4
# torch warns once that sparse CSR is "beta"; the two kernels used here are long-standing
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def _csr_plan(attn_metadata: AttentionMetadata, block_size: int, num_heads: int, num_kv_heads: int,
              num_rows: int, sliding_window: int | None = None):
    """Per step, shared by the layers (memoised in `attn_metadata.csr_plan`, by heads, KV
    heads and window): the attention pattern of a decode batch as a CSR matrix over the cache.
    Row r = i * H + h is sequence i's query head h; its entries are the key positions
    lo_i .. n_i - 1 of sequence i (n_i = context + 1, lo_i the window start or 0), in order;
    the column of position p is the row of the cache viewed as [num_rows, D]
    (num_rows = num_blocks * block_size * Hkv) that holds K (or V) of p for h's KV head:
    (block_table[i][p // block_size] * block_size + p % block_size) * Hkv + h // (H / Hkv).
    Returns (pattern, col, starts, dense_index, width): `pattern` the float32 sparse CSR
    [B*H, num_rows] with zero values, col [nnz] and starts [B*H] (row starts: crow[:-1]) int64,
    and dense_index [nnz] int64: where entry e sits in the row-major [B*H, width] padding of
    the rows (row * width + its rank in the row), width = the longest row."""
    key = (num_heads, num_kv_heads, sliding_window)
    plans = attn_metadata.csr_plan
    if plans is None:
        plans = attn_metadata.csr_plan = {}
    if key not in plans:
        bt = attn_metadata.block_tables
        end = torch.tensor(attn_metadata.context_lens, dtype=torch.int64) + 1
        n = end.clamp(max=sliding_window) if sliding_window else end            # keys per sequence
        B = n.numel()
        # per token (sum(n) of them): its cache slot; divisions here, not per entry (x H)
        tok_start = torch.cumsum(n, 0) - n
        seq_of_tok = torch.repeat_interleave(torch.arange(B), n)
        pos = torch.arange(seq_of_tok.numel()) - tok_start[seq_of_tok] + (end - n)[seq_of_tok]
        slot = bt[seq_of_tok, pos // block_size] * block_size + pos % block_size
        # per entry: row r = i * H + h lists sequence i's tokens in order
        row_len = n.repeat_interleave(num_heads)
        crow = torch.zeros(B * num_heads + 1, dtype=torch.int64)
        torch.cumsum(row_len, 0, out=crow[1:])
        nnz = int(crow[-1])
        row_of = torch.repeat_interleave(torch.arange(B * num_heads), row_len, output_size=nnz)
        rank = torch.arange(nnz) - crow[:-1][row_of]                     # position within the row
        tok = tok_start.repeat_interleave(num_heads)[row_of] + rank
        kv_head = torch.arange(num_heads).repeat(B) // (num_heads // num_kv_heads)   # per row
        col = slot[tok] * num_kv_heads + kv_head[row_of]
        width = int(n.max())
        # zeros, not empty: sampled_addmm computes beta * values + ..., and 0 * NaN garbage is NaN
        pattern = torch.sparse_csr_tensor(crow, col, torch.zeros(nnz), size=(B * num_heads, num_rows),
                                          check_invariants=False)
        plans[key] = (pattern, col, crow[:-1], row_of * width + rank, width)
    return plans[key]


def _decode_csr(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention for a batch read in place from the paged cache (float32, CPU): scores
    = one sampled dense-dense product (q against exactly the cached K rows each head attends
    to, the CSR pattern of `_csr_plan`), the softmax of each row on its scores scattered into a
    -inf padded [B*H, longest row] matrix (one dense softmax instead of segment reductions over
    the ragged rows), and the output = one weighted embedding-bag sum of the V rows. No K/V
    copy, no Python loop over the sequences (with `sliding_window`: over each sequence's last W
    positions only). q [B, H, D] -> [B, H, D]."""
    B, H, D = q.shape
    _, _, bs, hkv, _ = kv_cache.shape
    k_rows, v_rows = kv_cache[0].view(-1, D), kv_cache[1].view(-1, D)
    pattern, col, starts, dense_index, width = _csr_plan(attn_metadata, bs, H, hkv, k_rows.shape[0],
                                                         sliding_window)
    s = torch.sparse.sampled_addmm(pattern, q.reshape(B * H, D), k_rows.t(), beta=0.0, alpha=scale).values()
    dense = torch.full((B * H * width,), float("-inf"), dtype=s.dtype).index_copy_(0, dense_index, s)
    p = torch.gather(dense.view(B * H, width).softmax(-1).view(-1), 0, dense_index)
    return F.embedding_bag(col, v_rows, starts, mode="sum", per_sample_weights=p).view(B, H, D)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                     scale: float, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Paged decode attention: q [B, H, D], one token per sequence -> new [B, H, D] in q's
    dtype (K/V cast to it; an FP8 cache times k_scale / v_scale). With `sliding_window` W a
    sequence of n tokens attends to its last min(n, W) positions.

    With Python context lengths in `attn_metadata` (the model runner's eager decode): a float32
    batch of >= CSR_MIN_BATCH sequences on CPU reads K/V in place through two sparse kernels
    (`_decode_csr`); smaller batches read K/V in place when every sequence's blocks are
    consecutive, else one `index_select` of exactly the blocks in use, then one unmasked SDPA
    per sequence over its own positions. Otherwise (no host lengths, as under CUDA-graph
    capture): one batched SDPA over the block tables padded to the longest, positions >= seq_len
    (and before the window) masked out; on CPU that padded form costs several times more
    (gathering the padding, advanced indexing)."""
    if attn_metadata.context_lens is not None:
        if (len(attn_metadata.context_lens) >= CSR_MIN_BATCH and q.dtype == kv_cache.dtype == torch.float32
                and q.device.type == "cpu"):
            return _decode_csr(q, kv_cache, attn_metadata, scale, sliding_window)
        blocks, spans = _decode_plan(attn_metadata, kv_cache.shape[2], sliding_window)
        if blocks is None:
            # Consecutive blocks (the usual case for a lone sequence): read them in place; a
            # gather cost as much as the attention itself.
            kv = kv_cache.flatten(1, 2)                        # [2, slots, Hkv, D], a view
        else:
            kv = kv_cache.index_select(1, blocks).flatten(1, 2)   # [2, tokens, Hkv, D]
        out = torch.empty_like(q)
        for i, (a, b) in enumerate(spans):
            # 4-D [1, heads, len, D]: the flash CPU kernel (3-D inputs take the math path,
            # which repeats K/V for GQA).
            k = read_kv(kv[0, a:b].transpose(0, 1).unsqueeze(0), q.dtype, k_scale)
            v = read_kv(kv[1, a:b].transpose(0, 1).unsqueeze(0), q.dtype, v_scale)
            out[i] = F.scaled_dot_product_attention(q[i, :, None][None], k, v, scale=scale,
                                                    enable_gqa=True)[0, :, 0]
        return out
    bt = attn_metadata.block_tables.clamp(min=0)   # released (-1) entries lie before the window
    B, M = bt.shape
    bs = kv_cache.shape[2]
    L = M * bs
    pos = torch.arange(L, device=q.device)[None, :]
    valid = pos < attn_metadata.seq_lens[:, None]  # [B, L]
    if sliding_window:
        valid &= pos >= attn_metadata.seq_lens[:, None] - sliding_window
    # Slots past seq_len (padding, never written) may hold NaN/inf: a masked score still
    # gives 0 * NaN in P @ V, so zero them in the gathered copies rather than rely on the mask.
    invalid = ~valid.view(B, 1, L, 1)
    k = read_kv(kv_cache[0][bt].view(B, L, *kv_cache.shape[3:]).transpose(1, 2), q.dtype, k_scale)
    v = read_kv(kv_cache[1][bt].view(B, L, *kv_cache.shape[3:]).transpose(1, 2), q.dtype, v_scale)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.masked_fill_(invalid, 0),
                                       v.masked_fill_(invalid, 0), attn_mask=valid.view(B, 1, 1, L),
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)
