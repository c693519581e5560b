"""SwiGLU's activation (Shazeer 2020, "GLU Variants Improve Transformer"):
[..., 2d] = [gate | up] -> silu(gate) * up. One Triton kernel on CUDA, the torch code beside it
elsewhere; silu(gate) is rounded to the storage dtype before the product in both. With
`q8_act.wants` the kernel also writes its output rounded to int8 per 32 values for the Q4_K
down_proj GEMV after it (`ferrum.ops.q8_act`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.ops import q8_act
from ferrum.ops.triton_utils import HAS_TRITON, as_rows, next_pow2, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ferrum.ops.q8_act import q8_round

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, d_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr,
                             Q8: tl.constexpr, USE_PDL: tl.constexpr):
        # Q8: also the output as int8 q [rows, D] and float32 d [rows, D / 32] (q8_act.q8_round;
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
        if Q8:
            q, d = q8_round(tl.reshape(o.to(tl.float32), (1, BLOCK // 32, 32)))
            tl.store(q_ptr + row * D + cols, tl.reshape(q, (BLOCK,)), mask=mask)
            blocks = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
            tl.store(d_ptr + row * (D // 32) + blocks, tl.reshape(d, (BLOCK // 32,)), mask=blocks < D // 32)


_BLOCK = 1024


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch SiLU*mul: x [..., 2*d] = [gate | up] -> new [..., d] silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = [gate | up] (bf16/fp16/fp32) -> new [..., d] silu(gate) * up, same dtype.
    Triton on CUDA, else `silu_and_mul_torch`; with `q8_act.wants` the output carries its int8
    copy (`q8_act.attach`)."""
    if not use_triton(x):
        return silu_and_mul_torch(x)
    d = x.shape[-1] // 2
    x2 = as_rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    q8 = q8_act.buffers(x2.shape[0], d, x.device) if q8_act.wants(out) else None
    if x2.shape[0] > 0 and d > 0:
        block = min(_BLOCK, next_pow2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, *(q8 or (out, out)), x2.stride(0), out.stride(0), d, BLOCK=block, Q8=q8 is not None,
            USE_PDL=pdl_ok(x), num_warps=4 if block >= 512 else 2, launch_pdl=pdl_ok(x))
    y = out.view(*x.shape[:-1], d)
    return q8_act.attach(y, *q8) if q8 is not None else y


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (HF `gelu_pytorch_tanh`, Gemma 3):
    x [..., 2*d] = [gate | up] -> new [..., d] gelu_tanh(gate) * up, same dtype. Torch only
    (Gemma 3 runs on CPU and GPU without a fused kernel for it yet)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
