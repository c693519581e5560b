"""GEMVs in Gluon, Triton's explicit-layout dialect: y = x W^T (+ b) for 1-4 rows of x (bf16:
one) with bf16 / fp16, FP8 e4m3 (per-channel scale), 4-bit (GPTQ / AWQ, per-group scale and zero
point; ferrum's packed layout, ferrum/ops/int4.py) or GGUF Q4_K (llama.cpp's blocks,
ferrum/ops/gguf.py) weights, on CUDA sm_90.

Why Gluon. A GEMV's speed is the rate at which its weights stream; every instruction a thread
spends per weight byte beyond the multiply lowers that rate once the SM's issue slots run out
(4-bit weights: ~3.5 instructions per nibble at 4.8 TB/s on an H200). In plain Triton the
compiler picks each load's register layout: x's 1-D load gets a layout of its own, and every
tile's x is moved through shared memory to broadcast it over the weight rows (2 barriers per
loop iteration in the bf16 GEMV's sm_90 SASS, 8 in the FP8 one, 14 in the 4-bit one, whose
loop spends 6.5 instructions per nibble). Here the layout is set once:

    L4 = BlockedLayout([BLOCK_M, 1, 1, E], [1, 1, 32, 1], [1, 1, num_warps, 1], [3, 2, 1, 0])

over a [BLOCK_M, BLOCK_N, BLOCK_C, E] tile: BLOCK_C chunks of E consecutive K elements (16
bytes of weights: E = 8 bf16, 16 fp8 or 4 int32 words of 8 nibbles; Q4_K: 8 words, the 32
quant bytes of a 64-element group), one chunk per thread, every thread holding its chunk for
all BLOCK_N weight rows and all BLOCK_M rows of x. The weights live in SliceLayout(0, L4), x in
SliceLayout(1, L4): a thread loads the x values of its own chunk, so x never moves between
threads, the loop has no barrier and no shared memory, and each weight is dequantized once for
all rows of x.

4-bit (`_w4_gemv_kernel`) works in integers: x comes rounded to int16 per 32 values (d = max
|x| / 32767: `q16`, or the kernel that wrote x, ferrum/ops/act_quant.py, in an order that pairs
the x values each weight byte meets), and per word two LOP3 (low nibbles; high nibbles left at
bits 4..7, 16 q) feed four dp2a, two 16 x 8-bit products each, accumulated exactly in int32;
the zero point comes off per chunk with sum(xq) (dp2a against ones, once per row of x for all
weight rows) and one float FFMA applies s d. ~1.65 instructions per nibble in sm_90 SASS
(`benchmarks/sass_loop.py --gemv`) where float32 FMAs on bf16 x took 3.6, more than the SMs
issue at 4.8 TB/s (that kernel, gone since, streamed 1.6-2.2 TB/s at one row and 0.4 at four
on the H200; this one 2.3-3.4 and 1.0-1.3: benchmarks/results/h200-2026-12-04). x's 15-bit
rounding adds at most M / 65534 to each value, M the largest |x| of its 32-value block: ~2^-7
of the bf16 rounding that M itself carries, so the dot product's error stays that of 16-bit
activations (W4A16), also in a block with an outlier, where the small values round more
coarsely than bf16 would but by that same absolute bound (tests: outlier blocks).

Q4_K (`_q4k_gemv_kernel`) works in integers, as llama.cpp's MMVQ (vec_dot_q4_K_q8_1): x comes
rounded to int8 per 32-value sub-block (d = max |x| / 127, llama.cpp's quantize_q8_1: `q8_1`,
or the kernel that wrote x, ferrum/ops/act_quant.py), so a chunk's x is two
32-byte loads; the kernel masks each word's low and high nibbles (one LOP3 each; the high ones
stay at bits 4..7, 16 q, undone in the scale) and sums q xq by dp4a, four products per
instruction. Per sub-block y += d sc dx sum(q xq) - dmin m dx sum(xq), the 16-byte block header
(d, dmin, eight 6-bit scale / min pairs) decoded per row and chunk. In sm_90 SASS that is ~1.5
instructions per weight value instead of ~3.9 for a float32 dequantization of the blocks
(`benchmarks/sass_loop.py --gemv`); rounding x in every program instead took a third more and ~240 registers per thread,
and ran slower on every matrix on the H200 (benchmarks/results/README.md). x's int8 rounding adds ~0.5%
of the largest output on random Q4_K weights (tests: vs the exact product within 2e-2; vs the
same int8 x within bf16's bound); llama.cpp and vLLM's GGUF kernels round x the same way.

SiLU-mul folded in (`silu_mul_gemv`, `KERNELS.silu_gemv`): down_proj's bf16 / FP8 GEMV can read
gate_up_proj's [gate | up] output and compute silu(gate) * up per x tile with the SiLU-mul
kernel's ops and roundings (`_silu_mul_tile`), so its output is bit for bit that of the two
kernels while a decode step launches one kernel fewer per layer. The x work is per thread and
tile, shared by the BLOCK_N weight rows: ~17 instructions per x value in sm_90 SASS, a loop 2.2x
(bf16) / 1.7x (FP8) as long (`benchmarks/sass_loop.py --gemv`), hence off by default until timed.

Constraints (else the Triton GEMVs run): N % BLOCK_N == 0, K a multiple of one tile (E * 32 *
num_warps elements; 1024 * num_warps features for 4-bit, 2048 * num_warps for Q4_K), 4-bit
groups a multiple of 32 and no act-order g_idx, at most 4 rows of x (`ROWS_BLOCK_N`; bf16: one).
Split-K (`SPLIT_K` > 1): float32 partials per split, summed by `triton_utils.reduce_splits`. PDL as the Triton GEMVs (`triton_utils`): the first weight tile
is loaded before waiting for x.

The arithmetic and indexing run on CPU in the tests through `tests/gluon_shim.py` (each gl op
mapped onto its tl twin under Triton's interpreter); the layouts are checked by compiling for
sm_90 (no spills, no barrier in the loop).
"""
from __future__ import annotations

import torch

from ferrum.config import KERNELS
from ferrum.ops import act_quant
from ferrum.ops.triton_utils import HAS_TRITON, is_sm90, next_pow2, pdl_ok, reduce_splits

try:
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from ferrum.ops.act_quant import store_rounded
    from ferrum.ops.triton_utils import pdl_start
    HAS_GLUON = HAS_TRITON
except ImportError:  # pragma: no cover - triton < 3.5
    HAS_GLUON = False


if HAS_GLUON:
    @gluon.jit
    def _pdl_start():
        """`triton_utils.pdl_start` for Gluon kernels: wait for the previous kernel's outputs,
        then let the next kernel launch."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.constexpr_function
    def _tile_layout(BLOCK_M, E, num_warps):
        """L4 of the module docstring: [BLOCK_M, BLOCK_N, BLOCK_C, E] with the rows of x and of
        W and the E elements of a chunk in each thread's registers, chunks over the lanes and
        warps."""
        return gl.BlockedLayout([BLOCK_M, 1, 1, E], [1, 1, 32, 1], [1, 1, num_warps, 1], [3, 2, 1, 0])

    @gluon.jit
    def _chunk_offsets(BLOCK_C: gl.constexpr, E: gl.constexpr, L3: gl.constexpr):
        """[BLOCK_C, E] int32 element offsets c * E + e of a tile, in SliceLayout(0, L3)."""
        LCE: gl.constexpr = gl.SliceLayout(0, L3)
        c = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, LCE))
        e = gl.arange(0, E, layout=gl.SliceLayout(0, LCE))
        return gl.expand_dims(c, 1) * E + gl.expand_dims(e, 0)

    @gluon.jit
    def _lead(n0, BLOCK: gl.constexpr, L3: gl.constexpr):
        """[BLOCK, 1, 1] int32 n0 + 0..BLOCK-1 along the leading dim of a 3-D layout L3."""
        return gl.expand_dims(gl.expand_dims(n0 + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))),
                                             1), 2)

    @gluon.jit
    def _x_tile(x_ptrs, offs_m, M, BLOCK_M: gl.constexpr):
        """x at x_ptrs [BLOCK_M, BLOCK_C, E] (rows >= M: 0), in its own dtype; unmasked for one row."""
        if BLOCK_M == 1:
            x = gl.load(x_ptrs)
        else:
            x = gl.load(x_ptrs, mask=offs_m < M, other=0)
        return x

    @gluon.jit
    def _silu_mul_tile(x_ptrs, offs_m, M, K, BLOCK_M: gl.constexpr):
        """silu(gate) * up for x_ptrs into [gate | up] rows ([M, 2K]; the tile at x_ptrs, its up
        K elements on), in x's dtype: the ops and roundings of `ops.activation`'s SiLU-mul kernel
        (silu rounded to x's dtype before the product), so the GEMV reads the same values."""
        g_raw = _x_tile(x_ptrs, offs_m, M, BLOCK_M)
        g = g_raw.to(gl.float32)
        a = (g * (1 / (1 + gl.exp(-g)))).to(g_raw.dtype).to(gl.float32)
        return (a * _x_tile(x_ptrs + K, offs_m, M, BLOCK_M).to(gl.float32)).to(g_raw.dtype)

    @gluon.jit
    def _store_tile(y_ptr, b_ptr, y, n0, pid_k, M, N, stride_ym, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    LY: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr):
        """y [BLOCK_M, BLOCK_N] float32 (layout LY) -> rows < M of y_ptr [M, N] at columns n0.. (+
        bias) in y's dtype, or the float32 partial of split pid_k (y_ptr [SPLIT_K, M, N])."""
        offs_m = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LY)), 1)
        offs_n = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LY)), 0)
        if SPLIT_K == 1:
            if HAS_BIAS:
                y += gl.load(b_ptr + offs_n).to(gl.float32)
            gl.store(y_ptr + offs_m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_m < M)
        else:
            gl.store(y_ptr + pid_k * M * N + offs_m * N + offs_n, y, mask=offs_m < M)

    @gluon.jit
    def _widen16(w):
        """FP8 e4m3 -> float16 (exact); 16-bit weights as they are."""
        if w.dtype == gl.float8e4nv:
            out = w.to(gl.float16)
        else:
            out = w
        return out

    @gluon.jit
    def _dense_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                           E: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr,
                           HAS_SCALE: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr,
                           USE_PDL: gl.constexpr, SILU_MUL: gl.constexpr = False):
        """Program (pid_n, pid_k): rows pid_n * BLOCK_N .. of a bf16 / fp16 (E = 8) or FP8
        (E = 16, HAS_SCALE: one float32 scale per row, applied once at the end) weight against
        the M (<= BLOCK_M) rows of x, K elements pid_k * K_SPLIT .. (a multiple of the tile,
        BLOCK_C * E). SILU_MUL: x_ptr holds [gate | up] rows ([M, 2K]) and the product runs on
        silu(gate) * up (`_silu_mul_tile`), the SiLU-mul kernel before down_proj folded in."""
        L4: gl.constexpr = _tile_layout(BLOCK_M, E, gl.num_warps())
        LW: gl.constexpr = gl.SliceLayout(0, L4)                      # [BLOCK_N, BLOCK_C, E] weights
        LX: gl.constexpr = gl.SliceLayout(1, L4)                      # [BLOCK_M, BLOCK_C, E] x
        LY: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))   # [BLOCK_M, BLOCK_N] y
        BLOCK_K: gl.constexpr = BLOCK_C * E
        pid_k = gl.program_id(1)
        n0 = gl.program_id(0) * BLOCK_N
        w_ptrs = (w_ptr + _lead(n0, BLOCK_N, LW).to(gl.int64) * stride_wn
                  + gl.expand_dims(_chunk_offsets(BLOCK_C, E, LW), 0))
        offs_m = _lead(0, BLOCK_M, LX)
        x_ptrs = x_ptr + offs_m * stride_xm + gl.expand_dims(_chunk_offsets(BLOCK_C, E, LX), 0)
        k_start = pid_k * K_SPLIT
        k_end = gl.minimum(k_start + K_SPLIT, K)
        # per-chunk sums: the E products of a chunk fold into one float32 per row pair each tile
        # (an FFMA chain), so the accumulator takes BLOCK_M * BLOCK_N registers, not E times that
        acc = gl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], gl.float32, layout=gl.SliceLayout(3, L4))
        # the next tile is loaded during this one's products; FP8 widens to fp16 at the load (the
        # cvt takes byte pairs: a loop-carried fp8 tile would be carried byte by byte)
        w = _widen16(gl.load(w_ptrs + k_start, eviction_policy="evict_first"))  # weights only: before the wait
        if USE_PDL:
            _pdl_start()
        for k0 in range(k_start, k_end, BLOCK_K):
            if SILU_MUL:
                x = _silu_mul_tile(x_ptrs + k0, offs_m, M, K, BLOCK_M).to(gl.float32)
            else:
                x = _x_tile(x_ptrs + k0, offs_m, M, BLOCK_M).to(gl.float32)
            acc += gl.sum(gl.expand_dims(w.to(gl.float32), 0) * gl.expand_dims(x, 1), axis=3)
            if k0 + BLOCK_K < k_end:
                w = _widen16(gl.load(w_ptrs + (k0 + BLOCK_K), eviction_policy="evict_first"))
        y = gl.sum(acc, axis=2)
        if HAS_SCALE:
            y = y * gl.expand_dims(gl.load(s_ptr + n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LY))), 0)
        _store_tile(y_ptr, b_ptr, y, n0, pid_k, M, N, stride_ym, BLOCK_M, BLOCK_N, LY, HAS_BIAS, SPLIT_K)

    @gluon.constexpr_function
    def _dp2a_asm(hi):
        return f"dp2a.{'hi' if hi else 'lo'}.s32.u32 $0, $1, $2, $3;"

    @gluon.jit
    def _dp2a(a, b, c, HI: gl.constexpr):
        """c + a_0 b_(2 HI) + a_1 b_(2 HI + 1): the two signed 16-bit halves of int32 words a
        times bytes 0, 1 (HI: 2, 3) of b (unsigned), PTX dp2a; int32."""
        return gl.inline_asm_elementwise(_dp2a_asm(HI), "=r,r,r,r", [a, b, c], dtype=gl.int32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _w4_gemv_kernel(x_ptr, d_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, W_SPLIT, stride_xm,
                        stride_dm, stride_qn, stride_sn, stride_ym, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr, HAS_BIAS: gl.constexpr,
                        SPLIT_K: gl.constexpr, USE_PDL: gl.constexpr):
        """4-bit weight (ferrum's packed layout) times x in int16 (`q16`: x_ptr its int32 pairs
        [M, K / 2] in `act_quant.q16_offsets` order, d_ptr its float32 scales [M, K / 32]; strides
        in those elements) for M (<= BLOCK_M) rows, in integers. A thread's chunk is 4 words (32
        nibbles, one x block): per word the low nibbles (word & 0x0F0F0F0F: q0 q2 q4 q6 as bytes)
        and the high ones in place (word & 0xF0F0F0F0: 16 q1 ...) meet x's pairs by four dp2a,
        2 MACs each, accumulated in int32 as 16 sum(q xq) (lo << 4 + hi). Per chunk then
        y += s d (16 sum(q xq) - 16 z sum(xq)) / 16 with sum(xq) from dp2a against ones (per row
        of x, shared by the BLOCK_N weight rows); the integer part is exact (|.| < 2^28).
        Program (pid_n, pid_k): rows pid_n * BLOCK_N .., words pid_k * W_SPLIT .. (a multiple
        of the tile, BLOCK_C * 4 words)."""
        L4: gl.constexpr = _tile_layout(BLOCK_M, 4, gl.num_warps())
        LW: gl.constexpr = gl.SliceLayout(0, L4)                      # [BLOCK_N, BLOCK_C, 4] words
        LX: gl.constexpr = gl.SliceLayout(1, L4)                      # [BLOCK_M, BLOCK_C, 4] x pairs
        LMNC: gl.constexpr = gl.SliceLayout(3, L4)                    # [BLOCK_M, BLOCK_N, BLOCK_C]
        LNC: gl.constexpr = gl.SliceLayout(0, LMNC)
        LMC: gl.constexpr = gl.SliceLayout(1, LMNC)
        BLOCK_W: gl.constexpr = BLOCK_C * 4
        pid_k = gl.program_id(1)
        n0 = gl.program_id(0) * BLOCK_N
        q_ptrs = (qw_ptr + _lead(n0, BLOCK_N, LW).to(gl.int64) * stride_qn
                  + gl.expand_dims(_chunk_offsets(BLOCK_C, 4, LW), 0))
        offs_m = _lead(0, BLOCK_M, LX)
        cw = gl.expand_dims(_chunk_offsets(BLOCK_C, 4, LX), 0)           # c * 4 + w
        x_ptrs = x_ptr + offs_m * stride_xm + cw + 12 * (cw // 4)        # pair c * 16 + w (+ 4 p)
        offs_nc_n = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LNC)), 1)
        offs_nc_c = gl.expand_dims(gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LNC)), 0)
        sz_off = offs_nc_n.to(gl.int64) * stride_sn + offs_nc_c * 32 // GROUP        # [BLOCK_N, BLOCK_C]
        d_rows = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LMC)), 1)
        d_ptrs = d_ptr + d_rows * stride_dm + gl.expand_dims(gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LMC)), 0)
        d_mask = d_rows < M
        ones = gl.full([BLOCK_M, BLOCK_C, 4], 0x0101, gl.int32, layout=LX)
        zero = gl.full([BLOCK_M, BLOCK_N, BLOCK_C, 4], 0, gl.int32, layout=L4)
        w_start = pid_k * W_SPLIT
        w_end = gl.minimum(w_start + W_SPLIT, K // 8)
        acc = gl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], gl.float32, layout=LMNC)
        # weights, scales and zero points only (x comes after the wait): each loaded a tile ahead,
        # so their DRAM latency overlaps this tile's products (scales and zero points used in the
        # tile they were loaded in stalled the loop on their 2-byte loads)
        words = gl.load(q_ptrs + w_start, eviction_policy="evict_first")
        s_raw = gl.load(s_ptr + sz_off + w_start * 8 // GROUP)
        z_raw = gl.load(z_ptr + sz_off + w_start * 8 // GROUP)
        if USE_PDL:
            _pdl_start()
        for w0 in range(w_start, w_end, BLOCK_W):
            x0 = _x_tile(x_ptrs + 4 * w0, offs_m, M, BLOCK_M)           # (x0, x2) of each word's run
            x1 = _x_tile(x_ptrs + (4 * w0 + 4), offs_m, M, BLOCK_M)     # (x4, x6)
            x2 = _x_tile(x_ptrs + (4 * w0 + 8), offs_m, M, BLOCK_M)     # (x1, x3)
            x3 = _x_tile(x_ptrs + (4 * w0 + 12), offs_m, M, BLOCK_M)    # (x5, x7)
            xs = _dp2a(x3, ones, _dp2a(x2, ones, _dp2a(x1, ones, _dp2a(x0, ones, 0 * ones, False), False), False),
                       False)
            xsum = gl.expand_dims(gl.convert_layout(gl.sum(xs, axis=2), LMC, assert_trivial=True), 1)
            lo, b0 = gl.broadcast(gl.expand_dims(words & 0x0F0F0F0F, 0), gl.expand_dims(x0, 1))
            hi, b2 = gl.broadcast(gl.expand_dims(words & -252645136, 0), gl.expand_dims(x2, 1))  # 0xF0F0F0F0
            _, b1 = gl.broadcast(lo, gl.expand_dims(x1, 1))
            _, b3 = gl.broadcast(hi, gl.expand_dims(x3, 1))
            t = _dp2a(b1, lo, _dp2a(b0, lo, zero, False), True) << 4
            t = _dp2a(b3, hi, _dp2a(b2, hi, t, False), True)
            z16 = gl.expand_dims((z_raw.to(gl.float32) * 16.0).to(gl.int32), 0)
            s = gl.expand_dims(s_raw.to(gl.float32), 0)
            d = gl.expand_dims(gl.load(d_ptrs + w0 // 4, mask=d_mask, other=0.0), 1)
            acc += (gl.sum(t, axis=3) - z16 * xsum).to(gl.float32) * (s * d)
            if w0 + BLOCK_W < w_end:
                words = gl.load(q_ptrs + (w0 + BLOCK_W), eviction_policy="evict_first")
                s_raw = gl.load(s_ptr + sz_off + (w0 + BLOCK_W) * 8 // GROUP)
                z_raw = gl.load(z_ptr + sz_off + (w0 + BLOCK_W) * 8 // GROUP)
        _store_tile(y_ptr, b_ptr, gl.sum(acc, axis=2) * 0.0625, n0, pid_k, M, N, stride_ym, BLOCK_M, BLOCK_N,
                    gl.SliceLayout(2, LMNC), HAS_BIAS, SPLIT_K)

    @gluon.jit
    def _dp4a(a, b):
        """sum_i a_i b_i over the four bytes of int32 words a (unsigned) and b (signed), PTX
        dp4a; int32."""
        return gl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _q4k_scale_min(h1, h2, h3, k):
        """llama.cpp get_scale_min_k4 for the two sub-blocks 2k, 2k + 1 of group k (a tensor of
        0..3) from the scale bytes q[0..11] of a Q4_K header held as int32 words h1 = q[0..3],
        h2 = q[4..7], h3 = q[8..11]: (sc_2k, m_2k, sc_2k+1, m_2k+1), 6-bit integers as float32.
        Both sub-blocks' bytes sit in 16-bit half k % 2 of each word, so one shift per word
        serves both (k is fixed per thread: the shifts do not vary in the loop)."""
        hw = 16 * (k % 2)
        a = h1 >> hw
        b = h2 >> hw
        c = h3 >> hw
        sc = gl.where(k < 2, a & 0x3F3F, (c & 0x0F0F) | ((a >> 2) & 0x3030))
        m = gl.where(k < 2, b & 0x3F3F, ((c >> 4) & 0x0F0F) | ((b >> 2) & 0x3030))
        return ((sc & 0xFF).to(gl.float32), (m & 0xFF).to(gl.float32),
                ((sc >> 8) & 0xFF).to(gl.float32), ((m >> 8) & 0xFF).to(gl.float32))

    @triton.jit
    def _round_x_kernel(x_ptr, q_ptr, d_ptr, K, stride_xm, BITS: tl.constexpr, BLOCKS: tl.constexpr,
                        USE_PDL: tl.constexpr):
        """Row pid 0, 32-value blocks pid 1 * BLOCKS .. of x [M, K] (K % 32 == 0) -> q [M, K] int8 /
        int16 (BITS 8 / 16) and d [M, K / 32] float32 (`act_quant.store_rounded`)."""
        if USE_PDL:
            pdl_start()
        row = tl.program_id(0)
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        offs = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
        ok = tl.broadcast_to((blocks < K // 32)[:, None], (BLOCKS, 32))
        x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        store_rounded(tl.reshape(x, (1, BLOCKS * 32)), tl.reshape(row * K + offs, (1, BLOCKS * 32)),
                      tl.reshape(ok, (1, BLOCKS * 32)), q_ptr, d_ptr, 1, BLOCKS * 32, BITS)

    @gluon.jit
    def _q4k_header(hp):
        """The four int32 words d | dmin, q[0..3], q[4..7], q[8..11] of Q4_K headers at hp."""
        return (gl.load(hp, eviction_policy="evict_first"), gl.load(hp + 1, eviction_policy="evict_first"),
                gl.load(hp + 2, eviction_policy="evict_first"), gl.load(hp + 3, eviction_policy="evict_first"))

    @gluon.jit
    def _q4k_gemv_kernel(x_ptr, d_ptr, w_ptr, b_ptr, y_ptr, M, N, K, C_SPLIT, stride_xm, stride_dm, stride_wn,
                         stride_ym, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr,
                         HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, USE_PDL: gl.constexpr):
        """GGUF Q4_K (ferrum/ops/gguf.py has the block layout) GEMV for M (<= BLOCK_M) rows of x.
        w_ptr: the raw rows viewed as int32 (a 144-byte super-block is 36 words: d | dmin, 3
        words of 6-bit scales, 32 words of quants). A thread's chunk t is the 32 quant bytes of
        group c = t % 4 of super-block t // 4: byte l holds element 64 c + l (low nibble,
        sub-block 2c) and 64 c + 32 + l (high nibble, sub-block 2c + 1). x is int8 per sub-block
        (`q8_1`: x_ptr its bytes as int32 words [M, K / 4], word w of a sub-block holding its
        elements 4w..4w+3 as the weight's bytes; d_ptr its float32 scales dx [M, K / 32];
        strides in those elements), and per sub-block y += d sc dx sum(q xq) - dmin m dx sum(xq),
        the integer sums by dp4a (llama.cpp's vec_dot_q4_K_q8_1). Program (pid_n, pid_k): rows
        pid_n * BLOCK_N .., chunks pid_k * C_SPLIT .. (a multiple of BLOCK_C)."""
        L4: gl.constexpr = _tile_layout(BLOCK_M, 8, gl.num_warps())
        LW: gl.constexpr = gl.SliceLayout(0, L4)                      # [BLOCK_N, BLOCK_C, 8] words
        LX: gl.constexpr = gl.SliceLayout(1, L4)                      # [BLOCK_M, BLOCK_C, 8] x
        LMNC: gl.constexpr = gl.SliceLayout(3, L4)                    # [BLOCK_M, BLOCK_N, BLOCK_C]
        LNC: gl.constexpr = gl.SliceLayout(0, LMNC)
        LMC: gl.constexpr = gl.SliceLayout(1, LMNC)
        pid_k = gl.program_id(1)
        n0 = gl.program_id(0) * BLOCK_N
        cw = _chunk_offsets(BLOCK_C, 8, LW)                   # c * 8 + w over the tile, [BLOCK_C, 8]
        # int32 offset of quant word w of chunk t: 36 (t // 4) + 4 + 8 (t % 4) + w; BLOCK_C % 4 == 0,
        # so a tile's first chunk starts a super-block and the offsets are the tile's plus 9 t0
        q_ptrs = (w_ptr + _lead(n0, BLOCK_N, LW).to(gl.int64) * stride_wn
                  + gl.expand_dims(36 * (cw // 32) + 4 + 8 * (cw // 8 % 4) + cw % 8, 0))
        offs_nc_n = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LNC)), 1)
        offs_c = gl.expand_dims(gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LNC)), 0)   # [1, BLOCK_C]
        h_ptrs = w_ptr + offs_nc_n.to(gl.int64) * stride_wn + 36 * (offs_c // 4)          # headers, [BN, BC]
        grp = offs_c % 4                                     # group in its super-block: sub-blocks 2 grp, 2 grp + 1
        # x word w of sub-block 2t (int32 index 16 t + w) and 2t + 1 (16 t + 8 + w); their scales 2t, 2t + 1
        offs_m = _lead(0, BLOCK_M, LX)
        cwx = gl.expand_dims(_chunk_offsets(BLOCK_C, 8, LX), 0)
        x_lo = x_ptr + offs_m * stride_xm + cwx + 8 * (cwx // 8)
        d_rows = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LMC)), 1)
        d_ptrs = d_ptr + d_rows * stride_dm + 2 * gl.expand_dims(gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LMC)), 0)
        d_mask = d_rows < M
        t_start = pid_k * C_SPLIT
        t_end = gl.minimum(t_start + C_SPLIT, K // 64)
        acc = gl.zeros([BLOCK_M, BLOCK_N, BLOCK_C], gl.float32, layout=LMNC)
        ones = gl.full([BLOCK_M, BLOCK_C, 8], 0x01010101, gl.int32, layout=LX)
        # weights only before the wait; the headers are weight bytes too, loaded a tile ahead as
        # the quants (a header load at the top of each tile would stall it for a DRAM latency)
        words = gl.load(q_ptrs + 9 * t_start, eviction_policy="evict_first")
        h0, h1, h2, h3 = _q4k_header(h_ptrs + 9 * t_start)
        if USE_PDL:
            _pdl_start()
        for t0 in range(t_start, t_end, BLOCK_C):
            xq_lo = _x_tile(x_lo + 16 * t0, offs_m, M, BLOCK_M)                # [BLOCK_M, BLOCK_C, 8]
            xq_hi = _x_tile(x_lo + (16 * t0 + 8), offs_m, M, BLOCK_M)
            dx_lo = gl.expand_dims(gl.load(d_ptrs + 2 * t0, mask=d_mask, other=0.0), 1)   # [BLOCK_M, 1, BLOCK_C]
            dx_hi = gl.expand_dims(gl.load(d_ptrs + (2 * t0 + 1), mask=d_mask, other=0.0), 1)
            # sum(x) of the min term from the int8 values too: dp4a with bytes of 1
            s_lo = dx_lo * gl.expand_dims(gl.convert_layout(gl.sum(_dp4a(ones, xq_lo), axis=2), LMC,
                                                            assert_trivial=True), 1).to(gl.float32)
            s_hi = dx_hi * gl.expand_dims(gl.convert_layout(gl.sum(_dp4a(ones, xq_hi), axis=2), LMC,
                                                            assert_trivial=True), 1).to(gl.float32)
            q_lo, xq_lo = gl.broadcast(gl.expand_dims(words & 0x0F0F0F0F, 0), gl.expand_dims(xq_lo, 1))
            # the high nibbles stay in place (16 q as unsigned bytes): no shift, 1/16 in the scale
            q_hi, xq_hi = gl.broadcast(gl.expand_dims(words & -252645136, 0), gl.expand_dims(xq_hi, 1))  # 0xF0F0F0F0
            i_lo = gl.sum(_dp4a(q_lo, xq_lo), axis=3).to(gl.float32)         # [BLOCK_M, BLOCK_N, BLOCK_C]
            i_hi = gl.sum(_dp4a(q_hi, xq_hi), axis=3).to(gl.float32)
            d = gl.expand_dims((h0 & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32), 0)
            dmin = gl.expand_dims((h0 >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32), 0)
            sc_lo, m_lo, sc_hi, m_hi = _q4k_scale_min(h1, h2, h3, grp)
            acc += (d * (gl.expand_dims(sc_lo, 0) * dx_lo * i_lo + gl.expand_dims(sc_hi * 0.0625, 0) * dx_hi * i_hi)
                    - dmin * (gl.expand_dims(m_lo, 0) * s_lo + gl.expand_dims(m_hi, 0) * s_hi))
            if t0 + BLOCK_C < t_end:
                words = gl.load(q_ptrs + 9 * (t0 + BLOCK_C), eviction_policy="evict_first")
                h0, h1, h2, h3 = _q4k_header(h_ptrs + 9 * (t0 + BLOCK_C))
        _store_tile(y_ptr, b_ptr, gl.sum(acc, axis=2), n0, pid_k, M, N, stride_ym, BLOCK_M, BLOCK_N,
                    gl.SliceLayout(2, LMNC), HAS_BIAS, SPLIT_K)


# Tuned (BLOCK_N, num_warps, SPLIT_K) per (kind, N, K, rows), kind "bf16" / "fp8" / "w4" (group
# 128) / "q4_k", rows 1 or 4 (2-8 rows of x), or None where the Triton GEMV was faster; timed on
# an H200 by `benchmarks/quant_bench.py kernels` and written here by
# `benchmarks/paste_gemv_configs.py`. Shapes not listed take `default_config` (fp8, w4, q4_k)
# or the Triton GEMV (bf16: it already streams near the roofline). q4_k: timed on x from `q8_1`
# (since 558bbed); its 4-row (4, 1, 1) keeps 16 bytes of stack at
# `Q8_MAXNREG` and was still the fastest (h200-2026-12-02d). One-row bf16 / fp8 / w4 entries of
# Llama-3-8B's qkv (w4), o, gate_up and down re-timed after 36e37bf (h200-2026-12-05b: FP8 moved
# to BLOCK_N 8; the likely reason, not measured apart: 8 independent per-tile sums per thread
# hide the latency of each row's FFMA chain).
GLUON_GEMV_CONFIGS: dict[tuple[str, int, int, int], tuple[int, int, int] | None] = {
    ('bf16', 4096, 4096, 1): None,
    ('bf16', 4096, 14336, 1): (2, 8, 1),
    ('bf16', 6144, 4096, 1): (4, 4, 1),
    ('bf16', 28672, 4096, 1): (2, 8, 1),
    ('bf16', 128256, 4096, 1): (4, 2, 2),
    ('fp8', 4096, 4096, 1): (8, 4, 1),
    ('fp8', 4096, 4096, 4): (2, 1, 1),
    ('fp8', 4096, 14336, 1): (8, 2, 2),
    ('fp8', 4096, 14336, 4): (2, 1, 1),
    ('fp8', 6144, 4096, 1): (2, 2, 1),
    ('fp8', 6144, 4096, 4): (2, 1, 1),
    ('fp8', 28672, 4096, 1): (8, 4, 1),
    ('fp8', 28672, 4096, 4): (2, 1, 1),
    ('q4_k', 4096, 4096, 1): (2, 2, 1),
    ('q4_k', 4096, 4096, 4): (4, 1, 1),
    ('q4_k', 4096, 14336, 1): (2, 1, 1),
    ('q4_k', 4096, 14336, 4): (4, 1, 1),
    ('q4_k', 6144, 4096, 1): (4, 1, 1),
    ('q4_k', 6144, 4096, 4): (4, 1, 1),
    ('q4_k', 28672, 4096, 1): (4, 1, 1),
    ('q4_k', 28672, 4096, 4): (4, 1, 1),
    ('w4', 4096, 4096, 1): (8, 4, 1),
    ('w4', 4096, 4096, 4): (4, 1, 1),
    ('w4', 4096, 14336, 1): (8, 2, 1),
    ('w4', 4096, 14336, 4): (4, 1, 1),
    ('w4', 6144, 4096, 1): (8, 2, 1),
    ('w4', 6144, 4096, 4): (4, 2, 1),
    ('w4', 28672, 4096, 1): (8, 1, 1),
    ('w4', 28672, 4096, 4): (4, 1, 1),
}

ELEMENTS = {"bf16": 8, "fp8": 16, "w4": 32, "q4_k": 64}  # K elements per thread chunk (16 bytes; Q4_K 32)
MAX_ROWS = 8  # rows of x a launch takes (ferrum.ops.fp8.MAX_GEMV_ROWS)
# BLOCK_N per BLOCK_M (2 or 4 rows of x) of `default_config`: the largest that compiles for sm_90
# without spills at 2 warps (x's registers grow with the rows: 8-row tiles are not tuned, and
# 5-8 rows keep the Triton GEMVs; Q4_K at its `Q8_MAXNREG` cap); bf16 has no entry (cuBLAS
# takes 2+ rows). Q4_K 4 rows: (2, 2, 1) beat (1, 2, 1) on every matrix of the H200 sweep
# (benchmarks/results/README.md); 4-bit 4 rows: BLOCK_N 4 won on every Llama-3-8B matrix
# (h200-2026-12-04) and compiles without spills (~236 registers)
ROWS_BLOCK_N = {"fp8": {2: 2, 4: 1}, "w4": {2: 4, 4: 4}, "q4_k": {2: 4, 4: 2}}
TUNED_ROWS = 4  # most rows `gemv_config` gives a config for (the table's row keys are 1 and 4)


def default_config(kind: str, N: int, K: int, M: int = 1) -> tuple[int, int, int] | None:
    """(BLOCK_N, num_warps, SPLIT_K) for an [N, K] weight and M rows of x, for what the table
    lacks (Llama-3-70B, TP shards, 2-4 rows). One row: BLOCK_N 8 (4 for bf16); the first of 4,
    2, 1 warps (4-bit: 2, 4, 1) whose tile divides K: in the H200 sweep of
    benchmarks/results/h200-2026-12-05b (per-tile chunk sums, 36e37bf), FP8 (8, 4, 1) came within
    15% of the best on every Llama-3-8B matrix and (4, 2, 1), the default before, up to 25%
    below it; 4-bit (8, 2, 1) within 11%. 2-4 rows: `ROWS_BLOCK_N`, 2 warps first. Split-K until
    the grid has >= 2 programs per SM (264, H200's 132 SMs). None when no tile fits, or for
    more rows than `ROWS_BLOCK_N` lists."""
    e = ELEMENTS[kind]
    bn = 4 if kind == "bf16" else 8
    if M > 1:
        bn = ROWS_BLOCK_N.get(kind, {}).get(next_pow2(M))
        if bn is None:
            return None
    order = (2, 4, 1) if kind == "w4" or M > 1 else (4, 2, 1)
    warps = next((w for w in order if K % (32 * w * e) == 0), None)
    if warps is None or N % bn:
        return None
    split, tiles = 1, K // (32 * warps * e)
    while N // bn * split < 264 and tiles % (split * 2) == 0:
        split *= 2
    return bn, warps, split


def gemv_config(kind: str, N: int, K: int, M: int = 1) -> tuple[int, int, int] | None:
    """`GLUON_GEMV_CONFIGS[(kind, N, K, 1 or 4)]` if listed (2-4 rows: the 4-row entry), else
    `default_config` (None for bf16, whose Triton GEMV serves one row and cuBLAS more). None
    for more than `TUNED_ROWS` rows: a 4-row tile at 8 rows spills (see `ROWS_BLOCK_N`)."""
    if M > TUNED_ROWS:
        return None
    key = (kind, N, K, 1 if M == 1 else 4)
    if key in GLUON_GEMV_CONFIGS:
        return GLUON_GEMV_CONFIGS[key]
    return None if kind == "bf16" else default_config(kind, N, K, M)


def fits(kind: str, N: int, K: int, config: tuple[int, int, int]) -> bool:
    """True when config (BLOCK_N, num_warps, SPLIT_K) tiles an [N, K] weight exactly (BLOCK_N
    a power of two dividing N, K a multiple of SPLIT_K tiles)."""
    bn, warps, split = config
    tile = 32 * warps * ELEMENTS[kind]
    return bn & (bn - 1) == 0 and N % bn == 0 and K % (tile * split) == 0


def config_for(kind: str, x: torch.Tensor, N: int, K: int) -> tuple[int, int, int] | None:
    """The config a linear of kind over an [N, K] weight runs the Gluon GEMV with for x's rows,
    or None when the Triton GEMV runs instead (`can_use`, `gemv_config`, `fits`)."""
    if not can_use(x):
        return None
    cfg = gemv_config(kind, N, K, x.shape[0])
    return cfg if cfg is not None and fits(kind, N, K, cfg) else None


def request_x_copies(bits: int, weight: torch.Tensor) -> None:
    """A layer whose GEMV reads x rounded to `bits` bits (8: Q4_K, 16: 4-bit) with its weight on
    `weight`'s device: ask the producer kernels for that copy (`act_quant.wanted`) when the
    Gluon GEMVs can run there and `KERNELS.q8_from_producers` is on."""
    if (KERNELS.q8_from_producers and KERNELS.gluon_gemv and HAS_GLUON and weight.is_cuda
            and is_sm90(weight)):
        act_quant.wanted = bits


def can_use(x: torch.Tensor) -> bool:
    """True when the Gluon GEMVs may run on x: `KERNELS.gluon_gemv`, Gluon importable, x 1 to
    `MAX_ROWS` contiguous 16-bit rows on an sm_90+ CUDA device."""
    return (KERNELS.gluon_gemv and HAS_GLUON and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous() and is_sm90(x))


def _prepare(kind: str, x: torch.Tensor, N: int, K: int, config: tuple[int, int, int] | None, ok: bool):
    """(BLOCK_M, BLOCK_N, num_warps, SPLIT_K, y [M, N] in x's dtype, the kernel's output: y,
    or [SPLIT_K, M, N] float32 partials, PDL on or off) for a launch over x [M, K]; raises
    ValueError when the config (`gemv_config` when None) does not tile an [N, K] weight of
    kind, x has more than `MAX_ROWS` rows, or not `ok` (the launcher's own layout checks)."""
    M = x.shape[0]
    cfg = config or gemv_config(kind, N, K, M)
    if cfg is None or not ok or not 1 <= M <= MAX_ROWS or not fits(kind, N, K, cfg):
        raise ValueError(f"Gluon GEMV: config {cfg} does not tile a [{N}, {K}] {kind} weight for {M} rows "
                         "(or its layout)")
    bn, warps, split = cfg
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    return next_pow2(M), bn, warps, split, y, out, pdl_ok(x)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None,
               silu_mul: bool = False) -> torch.Tensor:
    """y = x (scale * W)^T + bias. x: [M, K] bf16/fp16 contiguous, M <= `MAX_ROWS` (see
    `can_use`); weight [N, K] in x's dtype or float8_e4m3fn (then scale [N] float32), unit
    stride along K; bias [N] or None. silu_mul: x is [M, 2K] = [gate | up] and y =
    silu_and_mul(x) (scale * W)^T + bias, the same values as `ops.activation.silu_and_mul`
    then this GEMV, without that kernel's launch and its output's round trip. Returns [M, N]
    in x's dtype (float32 accumulation). config (BLOCK_N, num_warps, SPLIT_K) overrides
    `gemv_config`; raises ValueError when it does not tile the weight."""
    N, K = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    kind = "fp8" if fp8 else "bf16"
    ok = weight.stride(1) == 1 and x.shape[1] == (2 * K if silu_mul else K)
    bm, bn, warps, split, y, out, pdl = _prepare(kind, x, N, K, config, ok)
    _dense_gemv_kernel[(N // bn, split)](
        x, weight, scale if fp8 else weight, bias if bias is not None else weight, out, x.shape[0], N, K, K // split,
        x.stride(0), weight.stride(0), y.stride(0), E=ELEMENTS[kind], BLOCK_M=bm, BLOCK_N=bn, BLOCK_C=32 * warps,
        HAS_SCALE=fp8, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split, USE_PDL=pdl, SILU_MUL=silu_mul,
        num_warps=warps, launch_pdl=pdl)
    return y if split == 1 else reduce_splits(out, y, bias, pdl)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu_and_mul(gate_up) (scale * W)^T + bias in one kernel (`dense_gemv(silu_mul=True)`):
    gate_up [M, 2K] = [gate | up], weight [N, K] in gate_up's dtype or float8_e4m3fn (scale [N]
    float32). None where that kernel does not run (then the caller launches the SiLU-mul kernel
    and the linear): `KERNELS.silu_gemv` off, or no Gluon config for these rows and this weight
    (`config_for`; bf16: the shapes its table lists)."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if (not KERNELS.silu_gemv or gate_up.dim() != 2 or gate_up.shape[1] != 2 * weight.shape[1]
            or weight.stride(1) != 1 or not (fp8 or weight.dtype == gate_up.dtype)):
        return None
    cfg = config_for("fp8" if fp8 else "bf16", gate_up, *weight.shape)
    return None if cfg is None else dense_gemv(gate_up, weight, scale, bias, cfg, silu_mul=True)


def w4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            bias: torch.Tensor | None = None, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T + bias with W in ferrum's packed 4-bit layout (ferrum/ops/int4.py; no
    g_idx), in integers: x rounded to int16 per 32 values (the copy the kernel that wrote x
    attached, `act_quant`, else `q16`), products by dp2a (`_w4_gemv_kernel`). x: [M, K]
    bf16/fp16 contiguous, M <= `MAX_ROWS`; group_size a multiple of 32; scales / zeros [N, G]
    with unit stride along G. Returns [M, N] in x's dtype. config as `dense_gemv`'s; raises
    ValueError when it does not tile the weight or the group size is not a multiple of 32."""
    N, W = qweight.shape
    K = W * 8
    bm, bn, warps, split, y, out, pdl = _prepare("w4", x, N, K, config,
                                                 group_size % 32 == 0 and scales.stride(1) == 1)
    q, d = act_quant.attached(x, 16) or q16(x)
    _w4_gemv_kernel[(N // bn, split)](
        q.view(torch.int32), d, qweight, scales, zeros, bias if bias is not None else scales, out, x.shape[0], N, K,
        W // split, q.stride(0) // 2, d.stride(0), qweight.stride(0), scales.stride(0), y.stride(0), GROUP=group_size,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_C=32 * warps, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split,
        USE_PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return y if split == 1 else reduce_splits(out, y, bias, pdl)


Q8_BLOCKS = 32  # 32-value blocks per program of `q8_1` / `q16` (1,024 values)
# Register cap of the Q4_K GEMV: ptxas takes ~250 per thread (2 warps per scheduler) where 168
# (3) hold the loop without spills at the default configs (tests' sm_90 compile)
Q8_MAXNREG = 168


def _round_x(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16 (K % 32 == 0, rows contiguous) -> `act_quant.buffers` (q, d) written
    by `_round_x_kernel`, on x's device (CUDA, or the interpreter)."""
    M, K = x.shape
    q, d = act_quant.buffers(M, K, x.device, bits)
    pdl = pdl_ok(x)
    _round_x_kernel[(M, triton.cdiv(K // 32, Q8_BLOCKS))](x, q, d, K, x.stride(0), BITS=bits, BLOCKS=Q8_BLOCKS,
                                                          USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return q, d


def q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16 (K % 32 == 0, rows contiguous) -> (q [M, K] int8, d [M, K / 32]
    float32): per 32 values d = max |x| / 127 and q = round(x / d) (llama.cpp's
    quantize_q8_1, without its sums), on x's device (CUDA, or the interpreter)."""
    return _round_x(x, 8)


def q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16/fp16 (K % 32 == 0, rows contiguous) -> (q [M, K] int16 in
    `act_quant.q16_offsets` order, d [M, K / 32] float32 = max |x| / 32767 per 32 values), on
    x's device (CUDA, or the interpreter)."""
    return _round_x(x, 16)


def q4k_gemv(x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y = x W^T + bias with W in GGUF Q4_K blocks: raw [N, K // 256 * 144] uint8, rows
    contiguous. x: [M, K] bf16/fp16 contiguous, M <= `MAX_ROWS`. Returns [M, N] in x's dtype.
    config as `dense_gemv`'s; raises ValueError when it does not tile the weight."""
    N = raw.shape[0]
    K = raw.shape[1] // 144 * 256
    bm, bn, warps, split, y, out, pdl = _prepare("q4_k", x, N, K, config,
                                                 raw.stride(1) == 1 and raw.stride(0) % 4 == 0)
    q, d = act_quant.attached(x, 8) or q8_1(x)   # x's int8 copy from the kernel that wrote it, else q8_1's
    _q4k_gemv_kernel[(N // bn, split)](
        q.view(torch.int32), d, raw.view(torch.int32), bias if bias is not None else x, out, x.shape[0], N, K,
        K // 64 // split, K // 4, K // 32, raw.stride(0) // 4, y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_C=32 * warps, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split, USE_PDL=pdl, num_warps=warps,
        launch_pdl=pdl, **({"maxnreg": Q8_MAXNREG} if x.is_cuda else {}))
    return y if split == 1 else reduce_splits(out, y, bias, pdl)
