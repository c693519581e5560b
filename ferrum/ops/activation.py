"""SwiGLU's activation (Shazeer 2020, "GLU Variants Improve Transformer"):
[..., 2d] = [gate | up] -> silu(gate) * up. One Triton kernel on CUDA, the torch code beside it
elsewhere; silu(gate) is rounded to the storage dtype before the product in both. With
`act_quant.wants` the kernel also writes its output rounded to int8 / int16 per 32 values for the
Q4_K / 4-bit down_proj GEMV after it (`ferrum.ops.act_quant`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.ops import act_quant
from ferrum.ops.triton_utils import HAS_TRITON, as_rows, next_pow2, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ferrum.ops.act_quant import store_rounded

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, d_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr,
                             QBITS: tl.constexpr, USE_PDL: tl.constexpr):
        # QBITS 8 / 16: also the output as integers q [rows, D] and float32 d [rows, D / 32] (act_quant.store_rounded;
        # D % 32 == 0, so BLOCK-column tiles hold whole 32-value blocks)
        if USE_PDL:  # see triton_utils.py, PDL
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        g_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        g = g_raw.to(tl.float32)
        # Round silu(gate) to the storage dtype before the product, as F.silu(gate) * up does.
        a = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
        o = (a * u).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, o, mask=mask)
        if QBITS:
            store_rounded(tl.reshape(o.to(tl.float32), (1, BLOCK)), tl.reshape(row * D + cols, (1, BLOCK)),
                          tl.reshape(mask, (1, BLOCK)), q_ptr, d_ptr, 1, BLOCK, QBITS)


_BLOCK = 1024


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch SiLU*mul: x [..., 2*d] = [gate | up] -> new [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = [gate | up] (bf16/fp16/fp32) -> new [..., d] silu(gate) * up, same dtype.
    Triton on CUDA, else `silu_and_mul_torch`; with `act_quant.wants` the output carries its
    integer copy (`act_quant.attach`)."""
    if not use_triton(x):
        return silu_and_mul_torch(x)
    d = x.shape[-1] // 2
    x2 = as_rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    bits = act_quant.wants(out)
    qx = act_quant.buffers(x2.shape[0], d, x.device, bits) if bits else None
    if x2.shape[0] > 0 and d > 0:
        block = min(_BLOCK, next_pow2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, *(qx or (out, out)), x2.stride(0), out.stride(0), d, BLOCK=block, QBITS=bits,
            USE_PDL=pdl_ok(x), num_warps=4 if block >= 512 else 2, launch_pdl=pdl_ok(x))
    y = out.view(*x.shape[:-1], d)
    return act_quant.attach(y, *qx) if qx is not None else y


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (HF `gelu_pytorch_tanh`, Gemma 3):
    x [..., 2*d] = [gate | up] -> new [..., d] gelu_tanh(gate) * up, same dtype. Torch only
    (Gemma 3 runs on CPU and GPU without a fused kernel for it yet)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
