"""Activations rounded to int8 by the kernel that writes them, for the Q4_K GEMV.

The Q4_K Gluon GEMV reads x as int8 per 32 values (llama.cpp's q8_1 without its sums,
`gemv_gluon.q8_1`). A decode step would launch `q8_1` before each such GEMV (4 per layer);
instead the RMSNorm before qkv / gate_up (`ferrum.ops.rms_norm`), the decode attention's merge
kernel before o_proj (`ferrum.ops.attention_triton`) and the SiLU-mul before down_proj
(`ferrum.ops.activation`) also write that int8 copy of their output when `wanted`, and attach
it to the output tensor; `q4k_gemv` takes it from there (`attached`) and launches `q8_1` only
for inputs without one (a prefill's, or decode attention in one split). The bytes are q8_1's:
the same rounding.

`wanted` is set by the GGUF linear method once a Q4_K layer runs on CUDA with
`KERNELS.q8_from_producers`, and cleared when the next model
loads (`ferrum.loader.model_loader.process_weights_after_loading`): a model without one pays
nothing. The attached copy is keyed to the tensor object (a reshaped view falls back to `q8_1`)
and, where torch keeps one, its version counter (an in-place change drops it). Inference-mode
tensors, which the model runner's forwards make, keep no version counter: there the copy holds
as long as the tensor, which ferrum's models never change in place.
"""
from __future__ import annotations

import torch

from ferrum.ops.triton_utils import HAS_TRITON

MAX_ROWS = 4   # rows of x the Gluon Q4_K GEMV takes (gemv_gluon.TUNED_ROWS): more run other kernels
wanted = False  # a Q4_K linear on CUDA reads int8 x (set by ferrum.layers.quantization.gguf)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def q8_round(x):
        """x float32 [A, B, 32] -> (q int8 [A, B, 32] = round(x / d), d float32 [A, B] =
        max |x| / 127 per 32 values; d = 0 and q = 0 for all zeros): llama.cpp's quantize_q8_1,
        the one rounding of `gemv_gluon.q8_1` and the producers (x / d + 1.5 * 2^23: round to
        nearest even, the integer in the low byte)."""
        amax = tl.max(tl.abs(x), axis=2)
        d = amax * (1.0 / 127.0)
        # 1 / d correctly rounded (div_rn; `/` may take the approximate reciprocal on the GPU), as
        # llama.cpp's and the tests' float32 reference
        inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(amax > 0, d, 1.0)), 0.0)
        q = ((x * inv[:, :, None] + 12582912.0).to(tl.int32, bitcast=True) & 0xFF).to(tl.int8)
        return q, d


def wants(x: torch.Tensor) -> bool:
    """True when a Triton kernel writing activation x [rows, n] (16-bit) should also write its
    int8 copy: `wanted`, 1 to `MAX_ROWS` rows, n a multiple of 32."""
    return (wanted and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] % 32 == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def buffers(rows: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (q int8 [rows, n], d float32 [rows, n / 32]), `gemv_gluon.q8_1`'s layout."""
    return (torch.empty(rows, n, dtype=torch.int8, device=device),
            torch.empty(rows, n // 32, dtype=torch.float32, device=device))


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:    # an inference tensor: no version counter
        return None


def attach(t: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Record (q, d) as t's int8 copy (valid while t is not modified in place); returns t."""
    t._ferrum_q8 = (q, d, _version(t))
    return t


def attached(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, d) written with x by `attach`, or None (none, or x changed in place since where
    torch tracks it)."""
    rec = getattr(x, "_ferrum_q8", None)
    if rec is None or rec[2] != _version(x):
        return None
    return rec[0], rec[1]
