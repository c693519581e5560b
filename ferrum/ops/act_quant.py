"""Activations rounded to integers by the kernel that writes them, for the integer-dot GEMVs.

Two Gluon GEMVs (ferrum/ops/gemv_gluon.py) read x as integers per 32 values with a float32
scale d per block (x ~ d q):
- GGUF Q4_K: int8, d = max |x| / 127 (llama.cpp's quantize_q8_1 without its sums, `q8_1`), in
  x's own order; products by dp4a.
- 4-bit GPTQ / AWQ (W4A16): int16, d = max |x| / 32767 (`q16`), each 8 values stored as
  x0 x2 x4 x6 x1 x3 x5 x7, so that one int32 holds the two x that the low (or high) nibbles of
  bytes 0-1 (or 2-3) of a weight word multiply (`q16_offsets`); products by dp2a. Rounding x
  to 15 bits adds at most M / 65534 to each value, M the largest |x| of its block: ~2^-7 of the
  bf16 rounding M itself carries (values far below M round more coarsely than bf16 would, by
  that absolute bound), so the products keep 16-bit activations' error.

A decode step would launch `q8_1` / `q16` before each such GEMV (4 per layer); instead the
RMSNorm before qkv / gate_up (`ferrum.ops.rms_norm`), the decode attention's merge kernel before
o_proj (`ferrum.ops.attention_triton`) and the SiLU-mul before down_proj
(`ferrum.ops.activation`) also write that integer copy of their output when `wants`, through
`store_rounded`, and attach it to the output tensor; the GEMV takes it from there (`attached`)
and launches `q8_1` / `q16` only for inputs without one (a prefill's, or decode attention in one
split). The bytes are those of `q8_1` / `q16`: the same rounding.

`wanted` (0, 8 or 16: the bits) is set at load by the GGUF (Q4_K) or 4-bit linear method whose
layers can run a Gluon GEMV on CUDA, with `KERNELS.q8_from_producers` (a layer whose shape no
Gluon tile fits then leaves its copy unread), and cleared when the next
model loads (`ferrum.loader.model_loader.process_weights_after_loading`): a model without one
pays nothing. The attached copy is keyed to the tensor object (a reshaped view falls back to
`q8_1` / `q16`) and, where torch keeps one, its version counter (an in-place change drops it).
Inference-mode tensors, which the model runner's forwards make, keep no version counter: there
the copy holds as long as the tensor, which ferrum's models never change in place.
"""
from __future__ import annotations

import torch

from ferrum.ops.triton_utils import HAS_TRITON

MAX_ROWS = 4   # rows of x the integer Gluon GEMVs take (gemv_gluon.TUNED_ROWS): more run other kernels
wanted = 0     # bits (8 or 16) of the x a Gluon GEMV of the loaded model reads; 0: none
DTYPES = {8: torch.int8, 16: torch.int16}

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_to_bits(x, QMAX: tl.constexpr):
        """x float32 [A, B, 32] -> (q int32 [A, B, 32] = round(x / d) in the low bits, d float32
        [A, B] = max |x| / QMAX per 32 values; d = 0 and q = 0 for all zeros). x / d + 1.5 *
        2^23 rounds to nearest even and leaves the integer, two's complement, in the low bits
        (on the GPU one FFMA: the exact product rounded once; the interpreter rounds the float32
        product first, which differs only where that product lands on or across a .5)."""
        amax = tl.max(tl.abs(x), axis=2)
        d = amax * (1.0 / QMAX)
        # 1 / d correctly rounded (div_rn; `/` may take the approximate reciprocal on the GPU), as
        # llama.cpp's and the tests' float32 reference
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(amax > 0, d, 1.0)), 0.0)
        return (x * inv[:, :, None] + 12582912.0).to(tl.int32, bitcast=True), d

    @triton.jit
    def q8_round(x):
        """x float32 [A, B, 32] -> (q int8, d float32 [A, B] = max |x| / 127): llama.cpp's
        quantize_q8_1, the one rounding of `gemv_gluon.q8_1` and the producers."""
        q, d = _round_to_bits(x, 127.0)
        return (q & 0xFF).to(tl.int8), d

    @triton.jit
    def q16_round(x):
        """x float32 [A, B, 32] -> (q int16, d float32 [A, B] = max |x| / 32767), in x's order
        (`q16_offsets` places them)."""
        q, d = _round_to_bits(x, 32767.0)
        return (q & 0xFFFF).to(tl.int16), d

    @triton.jit
    def q16_offsets(offs):
        """Where element offset e of x goes in the int16 copy: value j = e % 8 of 8-value run w
        of its 32-value block sits at 2 (4 p + w) + h, p = 2 (j % 2) + j // 4, h = j // 2 % 2. So
        int32 pair 4 p + w of the block is (x[8w], x[8w + 2]), (x[8w + 4], x[8w + 6]), (x[8w + 1],
        x[8w + 3]), (x[8w + 5], x[8w + 7]) for p = 0..3: the values that bytes 0-1 and 2-3 of
        weight word w's low nibbles (p = 0, 1) and high nibbles (p = 2, 3) multiply."""
        f = offs % 32
        j = f % 8
        return offs - f + 2 * (4 * (2 * (j % 2) + j // 4) + f // 8) + (j // 2) % 2

    @triton.jit
    def store_rounded(o, offs, mask, q_ptr, d_ptr, A: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
        """Write o (float32 [A, BLOCK]; element offsets offs [A, BLOCK] into the [rows, n]
        activation, n % 32 == 0, each run of 32 one block) rounded to BITS (8 or 16) bits:
        q at q_ptr (int8 in place / int16 at `q16_offsets`), d at d_ptr + offset // 32; where
        mask."""
        o3 = tl.reshape(o, (A, BLOCK // 32, 32))
        if BITS == 16:
            q, d = q16_round(o3)
            tl.store(q_ptr + q16_offsets(offs), tl.reshape(q, (A, BLOCK)), mask=mask)
        else:
            q, d = q8_round(o3)
            tl.store(q_ptr + offs, tl.reshape(q, (A, BLOCK)), mask=mask)
        d_offs = tl.min(tl.reshape(offs, (A, BLOCK // 32, 32)), axis=2) // 32
        d_mask = tl.max(tl.reshape(mask.to(tl.int32), (A, BLOCK // 32, 32)), axis=2) > 0
        tl.store(d_ptr + d_offs, d, mask=d_mask)


def wants(x: torch.Tensor) -> int:
    """The bits (8 or 16) of the integer copy a Triton kernel writing activation x [rows, n]
    (16-bit) should also write, or 0: `wanted`, 1 to `MAX_ROWS` rows, n a multiple of 32."""
    ok = (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] % 32 == 0
          and x.dtype in (torch.bfloat16, torch.float16))
    return wanted if ok else 0


def buffers(rows: int, n: int, device, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q [rows, n] int8 / int16 for 8 / 16 bits, d float32 [rows, n / 32])."""
    return (torch.empty(rows, n, dtype=DTYPES[bits], device=device),
            torch.empty(rows, n // 32, dtype=torch.float32, device=device))


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:    # an inference tensor: no version counter
        return None


def attach(t: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Record (q, d) as t's integer copy (valid while t is not modified in place); returns t."""
    t._ferrum_qx = (q, d, _version(t))
    return t


def _valid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's (q, d) from `attach`, or None (none, or x changed in place since where torch tracks it)."""
    rec = getattr(x, "_ferrum_qx", None)
    return None if rec is None or rec[2] != _version(x) else (rec[0], rec[1])


def attached(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, d) of `bits` bits written with x by `attach`, or None (none, other bits, or x
    changed in place since where torch tracks it)."""
    rec = _valid(x)
    return rec if rec is not None and rec[0].dtype == DTYPES[bits] else None


def carry(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst (a view of src's values, e.g. reshaped) with src's integer copy attached, if src has
    a valid one; returns dst."""
    rec = _valid(src)
    return attach(dst, *rec) if rec is not None else dst
