"""Paged attention in Triton (CUDA): the backend the model runner picks on CUDA. Same
functions, shapes and KV layout as the torch backend (`ferrum.ops.attention_torch`): one tensor
per layer `kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V), read only
through the block table. Every kernel addresses the cache through its strides (block, slot,
head), so pages held [Hkv, block_size, D] and viewed transposed take the same code (timed
against the engine's layout on an H100: no faster, benchmarks/results/h100-2026-12-07). Under
`TRITON_INTERPRET=1` the kernels also run on CPU tensors (tests).
An FP8 (e4m3) cache holds K / V divided by the layer's k_scale / v_scale ([1] float32 device
tensors, so CUDA graphs stay valid): the store divides and saturates at +-448, the attention
kernels fold k_scale into the logits' scale and v_scale into V's tiles (or the output). With
a 16-bit query the FP8 tiles' dots run in float16 (`_fp8_query`): e4m3 -> fp16 is one
conversion per two values and exact, where e4m3 -> bf16 goes through float32, which made the
FP8 decode loop issue-bound (benchmarks/sass_loop.py counts its sm_90 instructions).

- `rope_write_kv`: the layer's q/k norm, RoPE and K/V store in one kernel (`ferrum.ops.rope_kv`).
- `write_kv`: one kernel for K and V of all tokens; slot < 0 is skipped (padded CUDA-graph rows).
- `decode_attention`: split-K "flash-decoding" (Dao, Haziza, Massa, Sizov 2023): grid
  (num_kv_heads, B, num_splits) (`DECODE_HEADS_FIRST`); each program takes the query heads that share one KV head
  (GQA, Ainslie et al. 2023) as the rows of one `tl.dot`, walks its share of the sequence
  through the block table with an online softmax (Milakov & Gimelshein 2018; FlashAttention,
  Dao et al. 2022) and writes a partial output and its log-sum-exp; a second kernel merges the
  splits. The split count depends only on static shapes (B, num_kv_heads, M), and each
  sequence's split boundaries are computed on the device from `seq_lens`, so a captured CUDA
  graph stays valid when the lengths change. Structure follows the grouped decode kernel of
  LightLLM / SGLang / vLLM (`triton_decode_attention.py`), written anew here.
- `prefill_attention`: a varlen FlashAttention-2 style kernel, one launch for all sequences,
  grid (query blocks, sequences, heads), K/V read through the block table with the causal offset
  of cached context (query j of a chunk sits at position context_len + j). Each long prompt
  with no cached context (`KERNELS.sdpa_prefill_min_tokens`) goes to torch's
  scaled_dot_product_attention on this step's K/V instead, one call per sequence (its cuDNN /
  FlashAttention kernels are faster there than ours, which gathers pages); the kernel's grid
  then covers the other sequences only.

Sliding window (`sliding_window` W, Mistral / Gemma 3 local layers): a query at position p sees
keys p - W < k <= p. Decode walks only the last W positions (the splits share them out);
prefill starts each query block's walk at its first row's window start and masks per row. No
position before a window is read, so table entries of released blocks (-1) are never touched.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ferrum.config import KERNELS
from ferrum.forward_context import AttentionMetadata
from ferrum.ops import act_quant
from ferrum.ops.rope_kv import RopeInputs, norm_rope_write_kv
from ferrum.ops.triton_utils import HAS_TRITON, last_dim_contiguous, next_pow2, pdl_ok, pdl_start

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ferrum.ops.act_quant import store_rounded

# ---- tuning knobs (module-level so a benchmark can sweep them; all static => graph safe) ----
# None = the defaults of _decode_config / _prefill_config, picked from offline sm_90 compiles
# (no register spills, cp.async-pipelined loads; tests/test_triton_kernels.py checks this);
# the decode ones were timed on H200 with benchmarks/tune_attention.py.
DECODE_NUM_SPLITS: int | None = None   # None: heuristic `num_decode_splits`
DECODE_MAX_SPLITS = 32
# Don't split the capacity M*block_size finer than this. A split walks its tokens serially, so
# at small batch the kernel is latency-bound: one 32-token tile per split is a few us
# (benchmarks/results/README.attn_metadata).
DECODE_MIN_TOKENS_PER_SPLIT = 32
DECODE_BLOCK_N: int | None = None      # KV tokens per inner iteration
DECODE_NUM_WARPS: int | None = None
DECODE_NUM_STAGES: int | None = None
PREFILL_BLOCK_M: int | None = None
PREFILL_BLOCK_N: int | None = None
PREFILL_NUM_WARPS: int | None = None
PREFILL_NUM_STAGES: int | None = None
# Launch the causal prefill's query blocks heaviest first (the last block of a chunk attends to
# the whole chunk, the first to one tile), all heads of a block together: the light blocks then
# fill the last wave instead of a few heavy ones running alone (FlashAttention's scheduling).
PREFILL_HEAVY_FIRST: bool = True
# Decode grid (KV heads, sequences, splits) instead of (sequences, KV heads, splits): CUDA starts
# blocks x-fastest, so a sequence's KV heads run side by side and read the same pages together
# (a page interleaves the heads' rows, [block_size, Hkv, D]) instead of each head's 256-byte rows
# being fetched at another time (vLLM's paged attention orders its grid heads-first too).
DECODE_HEADS_FIRST: bool = True

_LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 tensor cores (10-bit mantissa) on GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # H200; only used by the interpreter / tests on CPU
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# =============================================================================================
# write_kv
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cblk, stride_cslot, stride_ch,
                         PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                         USE_PDL: tl.constexpr):
        # One program per token: all KV heads of K and V, cast to the cache dtype (FP8: divided
        # by the layer's scale, saturated at +-448 like the torch backend).
        if USE_PDL:  # see triton_utils.py, PDL
            pdl_start()
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # slot < 0: padded row of a CUDA graph, nothing to write
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
            src_k = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
            src_v = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            dst = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :]
            k = tl.load(src_k, mask=mask)
            v = tl.load(src_v, mask=mask)
            if FP8:
                k = tl.clamp(k.to(tl.float32) / tl.load(ks_ptr), -448.0, 448.0)
                v = tl.clamp(v.to(tl.float32) / tl.load(vs_ptr), -448.0, 448.0)
            tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def rope_write_kv(kv_cache: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor, rope: RopeInputs, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k / v [T, Hkv, D]: q and k normed and rotated (`RopeInputs`), then K/V
    written as `write_kv` does; returns the rotated (q, k). One kernel (`rope_kv`) when
    KERNELS.fused_rope_kv and it takes these inputs, else the unfused ops."""
    if KERNELS.fused_rope_kv:
        out = norm_rope_write_kv(kv_cache, q, k, v, slot_mapping, rope, k_scale, v_scale)
        if out is not None:
            return out
    return rope.apply_and_store(write_kv, kv_cache, q, k, v, slot_mapping, k_scale, v_scale)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write this step's K/V into the paged cache, in place.

    kv_cache: [2, num_blocks, block_size, Hkv, D] (bf16/fp16/fp32, or float8_e4m3fn with
    k_scale / v_scale [1] float32: K/V stored divided by them; last dim contiguous, written
    through its strides);
    k, v: [T, Hkv, D] (any dtype, views allowed: only the last dim must be contiguous);
    slot_mapping: [T] int64 (or int32), flat slot = block_id * block_size + offset; a slot < 0
    is skipped (padded rows of a CUDA graph). One kernel launch writes both K and V.
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    assert kv_cache.stride(-1) == 1, "kv_cache's last dim must be contiguous"
    _, nb, bs, hkv, d = kv_cache.shape
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    kc, vc = kv_cache[0], kv_cache[1]
    pdl = pdl_ok(kv_cache)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    _write_kv_kernel[(T,)](
        k, v, kc, vc, slot_mapping, k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        PAGE=bs, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), FP8=fp8,
        USE_PDL=pdl, num_warps=4 if hkv * d >= 1024 else 1, launch_pdl=pdl)


if HAS_TRITON:
    @triton.jit
    def _fp8_query(q, qk_scale, vs_ptr, SCALED: tl.constexpr):
        """(q, v_scale) for `_attend_tile`. SCALED (an FP8 cache and a 16-bit q): q becomes
        float16 with the logits' scale folded in, so K / V convert to fp16 (exact) and the
        logits need no multiply, and V's tiles are multiplied by v_scale (fp16) in the tile
        (the output then is not); else q as it is (and the caller scales the output). The
        clamp to fp16's +-65504 only touches a logit no softmax could resolve; with a tiny
        k_scale q's smallest components become fp16 subnormals, off by at most 2^-25 each, far
        below e4m3's own rounding of K. The multiply on V also changes how Triton 3.6 feeds V
        to the P x V dot: without it V's e4m3 bytes were read from shared memory one at a time
        (LDS.U8 + IMAD per value; counts: benchmarks/sass_loop.py, benchmarks/results/README.md)."""
        if SCALED:
            q16 = tl.clamp(q.to(tl.float32) * qk_scale, -65504.0, 65504.0).to(tl.float16)
            v_scale = tl.load(vs_ptr).to(tl.float16)
        else:
            q16 = q
            v_scale = qk_scale  # unused
        return q16, v_scale

    @triton.jit
    def _attend_tile(q, kc_ptr, vc_ptr, off, offs_d, n, n_mask, last_pos, m_i, l_i, acc, qk_scale,
                     window, CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, WINDOWED: tl.constexpr = False,
                     SCALED: tl.constexpr = False, v_scale=1.0):
        """Fold one tile of BLOCK_N cached tokens (positions n, cache offsets `off`, present
        where n_mask) into the online-softmax state (m_i running max, l_i running sum, acc
        unnormalised output; base 2) of the query rows q. CAUSAL: row r sees positions <=
        last_pos[r]; WINDOWED as well only positions > last_pos[r] - window, so a row may see
        nothing in a tile (its running max stays -inf and the tile adds 0). SCALED: q already
        carries qk_scale and V is multiplied by v_scale (`_fp8_query`). K / V convert to q's
        dtype. Shared by the decode and prefill kernels (FlashAttention-2's inner loop)."""
        kt = tl.load(kc_ptr + off[None, :] + offs_d[:, None], mask=n_mask[None, :], other=0.0)
        s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC)
        if not SCALED:
            s = s * qk_scale
        if CAUSAL:
            seen = (n[None, :] <= last_pos[:, None]) & n_mask[None, :]
            if WINDOWED:
                seen &= n[None, :] > last_pos[:, None] - window
            s = tl.where(seen, s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:  # all -inf so far: subtract 0 (exp2(-inf) = 0) instead of -inf (NaN)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + off[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        v = v.to(q.dtype)
        if SCALED:
            v = v * v_scale
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l_i, acc


# =============================================================================================
# decode
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _decode_split_kernel(
            q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, o_ptr, lse_ptr, ks_ptr, vs_ptr,
            stride_qb, stride_qh,
            stride_cblk, stride_cslot, stride_ch,
            stride_btb,
            stride_ob, stride_oh, stride_os,
            stride_lb, stride_lh,
            qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2)
            window,    # sliding window in tokens (used when WINDOWED)
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
            DIRECT_OUT: tl.constexpr, DOT_PREC: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
            WINDOWED: tl.constexpr = False, HEADS_FIRST: tl.constexpr = True):
        if USE_PDL:  # launched early (PDL, triton_utils.py): wait for q and the cache
            pdl_start()
        if FP8:  # FP8 cache: K's scale folds into the logits' scale, V's into V's tiles or the output
            qk_scale = qk_scale * tl.load(ks_ptr)
        if HEADS_FIRST:  # grid (Hkv, B, S): see DECODE_HEADS_FIRST
            kvh = tl.program_id(0)
            b = tl.program_id(1)
        else:
            b = tl.program_id(0)
            kvh = tl.program_id(1)
        split = tl.program_id(2)

        # Split boundaries from the device-side length: tiles of BLOCK_N tokens of the positions
        # [lo, seq_len) the query sees (lo = 0, or the window start) are dealt out evenly over
        # NUM_SPLITS programs. Empty range (short or zero length) -> neutral partial.
        seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
        lo = 0
        if WINDOWED:
            lo = tl.maximum(seq_len - window, 0)
        n_tiles = tl.cdiv(seq_len - lo, BLOCK_N)
        tiles_per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        start = lo + split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        # Rows = the GROUP query heads sharing this KV head (padded to >= 16 for tl.dot).
        q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)

        SCALED: tl.constexpr = FP8 and q_ptr.dtype.element_ty != tl.float32
        q, v_scale = _fp8_query(q, qk_scale, vs_ptr, SCALED)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < end
            # Per-token page lookup: works for any page size, BLOCK_N need not divide it.
            blk = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            off = blk * stride_cblk + (n % PAGE) * stride_cslot + kvh * stride_ch
            # Every tile has >= 1 valid column, so the running max stays finite.
            m_i, l_i, acc = _attend_tile(q, kc_ptr, vc_ptr, off, offs_d, n, n_mask, n, m_i, l_i, acc,
                                         qk_scale, window, CAUSAL=False, DOT_PREC=DOT_PREC, SCALED=SCALED,
                                         v_scale=v_scale)

        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]  # zero rows where nothing was seen
        if FP8 and not SCALED:
            o = o * tl.load(vs_ptr)
        o_ptrs = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        if DIRECT_OUT:
            tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            tl.store(o_ptrs, o, mask=g_mask[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)

    @triton.jit
    def _decode_merge_kernel(o_part_ptr, lse_ptr, out_ptr, qx_ptr, dx_ptr,
                             stride_pb, stride_ph, stride_ps,
                             stride_lb, stride_lh,
                             stride_ob, stride_oh,
                             NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                             QBITS: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # see triton_utils.py, PDL
            pdl_start()
        # out = sum_s w_s * o_s / sum_s w_s, w_s = 2^(lse_s - max lse). Empty splits have
        # lse = -inf (w = 0); if all are empty (seq_len 0) the output is 0, not NaN.
        # QBITS 8 / 16: also the output as integers q [B, H * D] and float32 d [B, H * D / 32]
        # (act_quant.store_rounded of the rounded output; D % 32 == 0), o_proj's Q4_K / 4-bit
        # GEMV input.
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        s_mask = offs_s < NUM_SPLITS
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        o = tl.load(o_part_ptr + b.to(tl.int64) * stride_pb + h * stride_ph
                    + offs_s[:, None] * stride_ps + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        out = (tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out)
        if QBITS:
            row = b.to(tl.int64) * tl.num_programs(1) + h   # [B, H * D]: head h of row b is D values at row * D
            store_rounded(tl.reshape(out.to(tl.float32), (1, HEAD_DIM)), tl.reshape(row * HEAD_DIM + offs_d, (1, HEAD_DIM)),
                          tl.full((1, HEAD_DIM), 1, tl.int1), qx_ptr, dx_ptr, 1, HEAD_DIM, QBITS)


def _decode_config(head_dim: int, dtype: torch.dtype, num_splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). 16-bit: 32 tokens per iteration (sm_90: 64 registers,
    21 KB shared for D=128); with one split (large batch: every program walks a whole sequence)
    64 tokens and 3 stages, which read K/V faster on H200 (`benchmarks/tune_attention.py`;
    figures in benchmarks/results/README.md); D = 256 stays at 32 (64 needs 254 registers).
    An FP8 cache (fp8) takes twice the tokens per tile for D <= 128, the same bytes in flight.
    fp32 goes through FMA dots ("ieee"), which spill at 32 tokens with D >= 128, so 16."""
    if dtype == torch.float32:
        bn, stages = 16, 2
    else:
        bn, stages = (64, 3) if num_splits == 1 and head_dim <= 128 else (32, 2)
        if fp8 and head_dim <= 128:
            bn *= 2
    warps = 4
    if KERNELS.decode_attn_config is not None:   # --decode-attn-config: a tile to time end to end
        bn, warps, stages = KERNELS.decode_attn_config
    return DECODE_BLOCK_N or bn, DECODE_NUM_WARPS or warps, DECODE_NUM_STAGES or stages


def num_decode_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                      device: torch.device | str = "cuda", sliding_window: int | None = None) -> int:
    """Number of KV splits per (sequence, KV head) for `decode_attention`, from static shapes
    only (so it is fixed for a captured CUDA graph): enough programs for ~2 per SM, capped so a
    split covers at least DECODE_MIN_TOKENS_PER_SPLIT tokens of the table's capacity
    max_blocks * block_size (or of the sliding window, when smaller), and at most
    DECODE_MAX_SPLITS. `DECODE_NUM_SPLITS` overrides."""
    if DECODE_NUM_SPLITS is not None:
        return max(1, int(DECODE_NUM_SPLITS))
    programs = max(1, batch * num_kv_heads)
    want = -(-2 * _sm_count(torch.device(device)) // programs)
    span = max_blocks * block_size if not sliding_window else min(max_blocks * block_size, sliding_window)
    by_len = -(-span // DECODE_MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, by_len, DECODE_MAX_SPLITS))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                     scale: float, num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Paged decode attention, one query token per sequence (with `sliding_window` W: over its
    last min(seq_len, W) positions only).

    q: [B, H, D] (bf16/fp16/fp32; last dim contiguous); kv_cache: [2, num_blocks, block_size,
    Hkv, D] (any of those dtypes, or float8_e4m3fn read times k_scale / v_scale [1] float32;
    read through its strides: the last dim contiguous, any order of the others, e.g. pages held
    [Hkv, block_size, D] and viewed transposed), H % Hkv == 0, D a power of two (32..256).
    From attn_metadata: block_tables [B, M] int32/int64 (entries past a sequence's pages are
    never read); seq_lens [B] int32/int64 on the device, length including this step's token
    (0 = padded row -> output 0). Returns [B, H, D] in q's dtype. No host synchronisation: safe
    to capture in a CUDA graph with static B and M. `num_splits` overrides the heuristic.
    Raises AssertionError on shapes outside these limits.
    """
    B, H, D = q.shape
    _, _, page, hkv, d_cache = kv_cache.shape
    assert d_cache == D and H % hkv == 0, (q.shape, kv_cache.shape)
    assert D & (D - 1) == 0 and D >= 16, f"head_dim must be a power of two >= 16, got {D}"
    assert kv_cache.stride(-1) == 1, "kv_cache's last dim must be contiguous"
    out = torch.empty_like(q)
    if B == 0:
        return out
    q = last_dim_contiguous(q)
    bt = attn_metadata.block_tables
    M = bt.shape[1]
    group = H // hkv
    S = num_splits or num_decode_splits(B, hkv, M, page, q.device, sliding_window)
    kc, vc = kv_cache[0], kv_cache[1]
    bn, warps, stages = _decode_config(D, q.dtype, S, kv_cache.element_size() == 1)
    pdl = pdl_ok(q)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    scales = (k_scale, v_scale) if fp8 else (q, q)
    common = dict(GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=D, PAGE=page,
                  BLOCK_N=bn, NUM_SPLITS=S, DOT_PREC=_dot_precision(q.dtype), FP8=fp8,
                  WINDOWED=bool(sliding_window), num_warps=warps, num_stages=stages)
    heads_first = DECODE_HEADS_FIRST and B <= 65535   # CUDA's grid y is at most 65535
    common["HEADS_FIRST"] = heads_first
    grid = (hkv, B, S) if heads_first else (B, hkv, S)
    window = sliding_window or 0
    args = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0))
    if S == 1:
        # One split: normalise in place and write the final output directly (no merge launch).
        _decode_split_kernel[grid](
            q, kc, vc, bt, attn_metadata.seq_lens, out, out, *scales, *args,
            out.stride(0), out.stride(1), 0, 0, 0, scale * _LOG2E, window, DIRECT_OUT=True,
            USE_PDL=pdl, launch_pdl=pdl, **common)
        return out
    o_part = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](
        q, kc, vc, bt, attn_metadata.seq_lens, o_part, lse, *scales, *args,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        scale * _LOG2E, window, DIRECT_OUT=False, USE_PDL=pdl, launch_pdl=pdl, **common)
    # o_proj's Q4_K / 4-bit GEMV reads the output as integers (ferrum.ops.act_quant): written here with it
    bits = act_quant.wants(out.view(B, H * D)) if D % 32 == 0 and out.is_contiguous() else 0
    qx = act_quant.buffers(B, H * D, q.device, bits) if bits else None
    _decode_merge_kernel[(B, H)](
        o_part, lse, out, *(qx or (out, out)), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=S, SPLITS_PAD=next_pow2(S), HEAD_DIM=D, QBITS=bits, USE_PDL=pdl,
        num_warps=4 if D >= 128 else 2, launch_pdl=pdl)
    return act_quant.attach(out, *qx) if qx is not None else out


# =============================================================================================
# prefill
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _prefill_kernel(
            q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, seqlen_ptr, cu_q_ptr, ks_ptr, vs_ptr, seq_idx_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_cblk, stride_cslot, stride_ch,
            stride_btb,
            qk_scale, window,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, FP8: tl.constexpr,
            HEAVY_FIRST: tl.constexpr, WINDOWED: tl.constexpr = False, SUBSET: tl.constexpr = False):
        if HEAVY_FIRST:  # grid (H, B, query blocks): every head of the last block first
            h = tl.program_id(0)
            b = tl.program_id(1)
            pid_m = tl.num_programs(2) - 1 - tl.program_id(2)
        else:            # grid (query blocks, B, H)
            pid_m = tl.program_id(0)
            b = tl.program_id(1)
            h = tl.program_id(2)
        if SUBSET:       # the grid covers the sequences seq_idx lists (the others took SDPA)
            b = tl.load(seq_idx_ptr + b).to(tl.int32)
        q_start = tl.load(cu_q_ptr + b).to(tl.int32)
        q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
        m0 = pid_m * BLOCK_M
        if m0 < q_len:  # the grid is sized for the longest chunk; others have spare programs
            seq_len = tl.load(seqlen_ptr + b).to(tl.int32)
            ctx = seq_len - q_len  # tokens cached before this chunk
            kvh = h // GROUP
            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, HEAD_DIM)
            offs_n = tl.arange(0, BLOCK_N)
            m_mask = offs_m < q_len
            rows = (q_start + offs_m).to(tl.int64)
            q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            # Query row i (position ctx + m0 + i) sees keys 0..ctx + m0 + i: stop after the
            # block's last row. Column 0 is in the first tile and valid for every row, so the
            # running max is finite from the first iteration on. With a window, start at the
            # first row's window start (later rows' windows start later: masked per row).
            hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
            if FP8:  # FP8 cache: K's scale folds into the logits' scale, V's into V's tiles or the output
                qk_scale = qk_scale * tl.load(ks_ptr)
            SCALED: tl.constexpr = FP8 and q_ptr.dtype.element_ty != tl.float32
            q, v_scale = _fp8_query(q, qk_scale, vs_ptr, SCALED)
            lo = 0
            if WINDOWED:
                lo = tl.maximum(ctx + m0 - window + 1, 0)
            bt_row = bt_ptr + b.to(tl.int64) * stride_btb
            # Tiles every row sees whole (keys <= ctx + m0, the first row's position) skip the
            # causal mask (FlashAttention-2's split); the diagonal tiles after them apply it.
            # With a window every tile is masked.
            full_end = lo
            if not WINDOWED:
                full_end = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
            for n0 in range(lo, full_end, BLOCK_N):
                n = n0 + offs_n
                blk = tl.load(bt_row + n // PAGE).to(tl.int64)
                off = blk * stride_cblk + (n % PAGE) * stride_cslot + kvh * stride_ch
                m_i, l_i, acc = _attend_tile(q, kc_ptr, vc_ptr, off, offs_d, n, n < hi, ctx + offs_m,
                                             m_i, l_i, acc, qk_scale, window, CAUSAL=False,
                                             DOT_PREC=DOT_PREC, SCALED=SCALED, v_scale=v_scale)
            for n0 in range(full_end, hi, BLOCK_N):
                n = n0 + offs_n
                n_mask = n < hi
                blk = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
                off = blk * stride_cblk + (n % PAGE) * stride_cslot + kvh * stride_ch
                m_i, l_i, acc = _attend_tile(q, kc_ptr, vc_ptr, off, offs_d, n, n_mask, ctx + offs_m,
                                             m_i, l_i, acc, qk_scale, window, CAUSAL=True,
                                             DOT_PREC=DOT_PREC, WINDOWED=WINDOWED, SCALED=SCALED,
                                             v_scale=v_scale)
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            if FP8 and not SCALED:
                o = o * tl.load(vs_ptr)
            tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=m_mask[:, None])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), from sm_90 compiles without spills:
    16-bit D <= 128: 128x64, 8 warps (207 registers, 96 KB shared at 2 stages, D=128);
    D = 256: 64x32, 8 warps (98 KB). fp32 (FMA dots, tests only): 16x16, 4 warps (32x16
    spills with the two key loops)."""
    if dtype == torch.float32:
        bm, bn, warps = 16, 16, 4
    else:
        bm, bn, warps = (128, 64, 8) if head_dim <= 128 else (64, 32, 8)
    return (PREFILL_BLOCK_M or bm, PREFILL_BLOCK_N or bn, PREFILL_NUM_WARPS or warps,
            PREFILL_NUM_STAGES or 2)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                      scale: float, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention for prefill chunks of several sequences, possibly with cached context
    (with `sliding_window` W: query at position p sees keys p - W < k <= p only).

    q: [T, H, D] (new tokens of all sequences, concatenated in metadata order); kv_cache as
    in `decode_attention` (FP8 with k_scale / v_scale), already holding this step's K/V
    (write_kv runs first). From
    attn_metadata: query_lens / context_lens (lists), seq_lens [B] (= context + query lens,
    device), block_tables [B, M], cu_seqlens_q [B+1] (device; built from query_lens when
    None). k, v: [T, Hkv, D] this step's K/V: what the sequences `_sdpa_sequences` picks
    attend over (scaled_dot_product_attention, `_prefill_sdpa`); the others go through the
    kernel, which reads the cache. Returns [T, H, D] in q's dtype.
    Query j of a sequence sits at position context_len + j and sees keys 0..context_len + j.
    """
    T, H, D = q.shape
    _, _, page, hkv, _ = kv_cache.shape
    assert H % hkv == 0 and D & (D - 1) == 0 and D >= 16, (q.shape, kv_cache.shape)
    assert kv_cache.stride(-1) == 1, "kv_cache's last dim must be contiguous"
    out = torch.empty_like(q)
    B = len(attn_metadata.query_lens)
    if T == 0 or B == 0:
        return out
    sdpa, seq_idx, max_rest = _prefill_plan(q, kv_cache, attn_metadata, k, sliding_window)
    for start, n in sdpa:
        _prefill_sdpa(q, k, v, out, start, n, scale)
    if len(sdpa) == B:
        return out
    q = last_dim_contiguous(q)
    cu = attn_metadata.cu_seqlens_q
    if cu is None:
        cu = torch.zeros(B + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(attn_metadata.query_lens, dtype=torch.int64), 0)
        cu = cu.to(q.device)
    bm, bn, warps, stages = _prefill_config(D, q.dtype)
    kc, vc = kv_cache[0], kv_cache[1]
    bt = attn_metadata.block_tables
    rest = B - len(sdpa)
    n_m = triton.cdiv(max_rest, bm)
    grid = (H, rest, n_m) if PREFILL_HEAVY_FIRST else (n_m, rest, H)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    _prefill_kernel[grid](
        q, kc, vc, out, bt, attn_metadata.seq_lens, cu, *((k_scale, v_scale) if fp8 else (q, q)),
        seq_idx if seq_idx is not None else cu,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0),
        scale * _LOG2E, sliding_window or 0,
        GROUP=H // hkv, HEAD_DIM=D, PAGE=page, BLOCK_M=bm, BLOCK_N=bn,
        DOT_PREC=_dot_precision(q.dtype), FP8=fp8, HEAVY_FIRST=PREFILL_HEAVY_FIRST,
        WINDOWED=bool(sliding_window), SUBSET=seq_idx is not None, num_warps=warps, num_stages=stages)
    return out


def _sdpa_sequences(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                    k: torch.Tensor | None, sliding_window: int | None) -> list[int]:
    """The sequences of this prefill step that take `_prefill_sdpa`: those without cached
    context (this step's K/V are all their keys) whose prompt has at least
    `KERNELS.sdpa_prefill_min_tokens` tokens (0: none), each decided on its own, so a
    sequence's numbers do not depend on what it is batched with. None at all unless q and
    the cache are 16-bit and alike (an FP8 cache's rounded K/V are what decode reads, so
    prefill reads them too; float32 would get torch's math kernel), there is no sliding
    window, the fresh K/V are given, and no CUDA graph is being captured (the prefill graphs
    replay one bucket for chunks with and without context)."""
    least = KERNELS.sdpa_prefill_min_tokens
    ctx = attn_metadata.context_lens
    if (least <= 0 or k is None or k.shape[0] != q.shape[0] or sliding_window or ctx is None
            or q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype
            or (q.is_cuda and torch.cuda.is_current_stream_capturing())):
        return []
    return [b for b, (c, n) in enumerate(zip(ctx, attn_metadata.query_lens)) if c == 0 and n >= least]


def _prefill_plan(q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
                  k: torch.Tensor | None, sliding_window: int | None
                  ) -> tuple[list[tuple[int, int]], torch.Tensor | None, int]:
    """((first row, rows) in q of each of `_sdpa_sequences`, the others' indices as an int32
    device tensor for the kernel's SUBSET grid (None when the kernel takes every sequence),
    the others' longest chunk), made by the first layer of a step and kept in
    `attn_metadata.prefill_plan` for the others, by (sliding window, threshold): a metadata
    reused after `KERNELS.sdpa_prefill_min_tokens` changed (benchmarks do) plans anew."""
    key = (sliding_window or 0, KERNELS.sdpa_prefill_min_tokens)
    plans = attn_metadata.prefill_plan
    if plans is not None and key in plans:
        return plans[key]
    lens = attn_metadata.query_lens
    sdpa = _sdpa_sequences(q, kv_cache, attn_metadata, k, sliding_window)
    taken = set(sdpa)
    rest = [b for b in range(len(lens)) if b not in taken]
    starts = [0, *itertools.accumulate(lens)]
    plan = ([(starts[b], lens[b]) for b in sdpa],
            torch.tensor(rest, dtype=torch.int32).to(q.device) if sdpa and rest else None,
            max((lens[b] for b in rest), default=0))
    if attn_metadata.context_lens is not None:   # not under a prefill graph's capture
        attn_metadata.prefill_plan = {**(plans or {}), key: plan}
    return plan


# scaled_dot_product_attention lengths are rounded up to a multiple of this (1: not at all).
# cuDNN builds an execution plan the first time it meets a length, then caches it; padding to
# buckets bounds the plans but made every call slower on the H200 than a plan per length costs
# once (benchmarks/results/README.md), so lengths go as they are.
SDPA_LEN_MULTIPLE = 1


def _prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, start: int, n: int,
                  scale: float) -> None:
    """Causal attention of one prompt with no cached context, rows start .. start + n of
    q [T, H, D] / k, v [T, Hkv, D] (this step's, in q's dtype), through
    F.scaled_dot_product_attention (GQA by enable_gqa: K/V are not repeated), into the same
    rows of out. Rows are padded with zeros to a multiple of `SDPA_LEN_MULTIPLE`: causal
    attention keeps them out of every real row."""
    rows = slice(start, start + n)
    padded = -(-n // SDPA_LEN_MULTIPLE) * SDPA_LEN_MULTIPLE
    qs, ks, vs = q[rows], k[rows], v[rows]
    if padded != n:
        qs, ks, vs = (torch.cat([t, t.new_zeros(padded - n, *t.shape[1:])]) for t in (qs, ks, vs))
    # [n, H, D] -> [1, H, n, D] views; the kernels take strided heads
    # (torch picks cuDNN here on the H200 itself; forcing the order per call only cost host time)
    o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out[rows] = o[0, :, :n].transpose(0, 1)
