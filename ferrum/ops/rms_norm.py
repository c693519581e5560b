"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add before it (the vLLM
`fused_add_rms_norm` pattern): one Triton kernel on CUDA, the torch code beside it elsewhere.

Rounding follows the HF Llama module: float32 math, the normalised value rounded to the
input's dtype, then multiplied by the weight; with a residual, the sum x + residual is rounded
to the activation dtype first and the norm reads that rounded sum. So bf16 results of the
kernel match the torch code to within one bf16 ulp. With `act_quant.wants` the kernel also writes
its output rounded to int8 / int16 per 32 values for a Q4_K / 4-bit GEMV after it
(`ferrum.ops.act_quant`).
"""
from __future__ import annotations

import torch

from ferrum.ops import act_quant
from ferrum.ops.triton_utils import HAS_TRITON, as_rows, next_pow2, pdl_ok, pdl_start, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ferrum.ops.act_quant import store_rounded

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, d_ptr, R, B,
                             stride_xa, stride_xb, stride_r, stride_o, stride_ro, N, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                             QBITS: tl.constexpr, USE_PDL: tl.constexpr):
        # ROWS rows per program, each whole in registers (N <= BLOCK). Row r of the R = A * B
        # rows sits at x_ptr + (r // B) * stride_xa + (r % B) * stride_xb: a [T, heads, D] view
        # of a fused qkv output is read in place, without a copy to contiguous rows. QBITS 8 / 16:
        # also the output as integers q [R, N] and float32 d [R, N / 32] (act_quant.store_rounded;
        # N % 32 == 0).
        if USE_PDL:  # launched early (PDL, triton_utils.py): wait for the inputs, let the next launch
            pdl_start()
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        x_off = ((rows // B) * stride_xa + (rows % B) * stride_xb)[:, None] + cols[None, :]
        x_raw = tl.load(x_ptr + x_off, mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            # The residual stream is stored in the activation dtype; the norm reads the
            # rounded sum, as `x = x + residual` does in RMSNorm.forward.
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + rows[:, None] * stride_ro + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, 1) / N
        y = x * tl.rsqrt(var + eps)[:, None]
        # RMSNorm._norm: round to the dtype of its input (the sum when there is a residual) ...
        if HAS_RES:
            y = y.to(res_out_ptr.dtype.element_ty)
        else:
            y = y.to(x_raw.dtype)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        o = (y.to(tl.float32) * w[None, :]).to(out_ptr.dtype.element_ty)   # ... then weight * x
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], o, mask=mask)
        if QBITS:
            store_rounded(o.to(tl.float32), rows[:, None] * N + cols[None, :], mask, q_ptr, d_ptr, ROWS, BLOCK, QBITS)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) with float32 math and the
    normalised value rounded to x's dtype. x: [..., hidden]; weight: [hidden]; returns a new
    tensor in promote(x, weight) dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


# Elements one program normalises: rows of a small last dim (q/k norm's head_dim 128) are
# batched ROWS to a program; one row of 4096 or more is a program of its own.
_ELEMS_PER_PROGRAM = 4096
# ... but rows are batched only while >= this many programs remain (a decode batch's few hundred
# rows keep one row per program: 132 SMs on an H200 want several programs each)
_MIN_PROGRAMS = 512


def _launch_rms(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """Launch the Triton kernel: (normed, new residual or None); outputs are new contiguous
    tensors shaped like x. A 3-D x with unit last-dim stride (e.g. [T, heads, D] split from a
    fused qkv output) is read in place. With `act_quant.wants(x)` the normed output carries its
    integer copy (`act_quant.attach`)."""
    shape, n = x.shape, x.shape[-1]
    if residual is None and x.dim() == 3 and x.stride(-1) == 1:
        a, b, stride_xa, stride_xb = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
        x2 = x
    else:
        x2 = as_rows(x)
        a, b, stride_xa, stride_xb = x2.shape[0], 1, x2.stride(0), 0
    rows = a * b
    if residual is not None:
        r2 = as_rows(residual)
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(rows, n, dtype=res_dtype, device=x.device)
    else:
        r2 = res_out = None
        res_dtype = x.dtype
    out = torch.empty(rows, n, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    if residual is None:
        r2 = res_out = out  # unused (HAS_RES=False)
    bits = act_quant.wants(x)
    qx = act_quant.buffers(rows, n, x.device, bits) if bits else None
    if rows > 0:
        block = next_pow2(n)
        per_program = max(1, min(64, _ELEMS_PER_PROGRAM // block, rows // _MIN_PROGRAMS))
        per_program = 1 << (per_program.bit_length() - 1)  # a power of two (tl.arange, warps)
        _add_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
            x2, r2, weight, out, res_out, *(qx or (out, out)), rows, b, stride_xa, stride_xb,
            r2.stride(0), out.stride(0), res_out.stride(0), n, eps,
            HAS_RES=residual is not None, BLOCK=block, ROWS=per_program, QBITS=bits,
            USE_PDL=pdl_ok(x), num_warps=min(max(per_program * block // 256, 1), 8), launch_pdl=pdl_ok(x))
    normed = out.view(shape)
    if qx is not None:
        act_quant.attach(normed, *qx)
    return normed, (res_out.view(shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x: [..., hidden] (any float dtype) with weight [hidden] -> new [..., hidden]
    in promote(x, weight) dtype; float32 math. Triton on CUDA, else `rms_norm_torch`."""
    if not use_triton(x):
        return rms_norm_torch(x, weight, eps)
    return _launch_rms(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) with new_residual = x + residual (rounded to the activation
    dtype) and normed = RMSNorm(new_residual); one kernel, one read of x and residual.

    x, residual: [..., hidden] (same shape, bf16/fp16/fp32); weight: [hidden]. With
    residual=None the residual stream starts here: returns (RMSNorm(x), x) (x itself, not a
    copy), matching the first decoder layer's `residual, x = x, input_layernorm(x)`. Outputs
    are new tensors (inputs are not modified). Raises AssertionError when the shapes differ
    (Triton path).
    """
    if residual is None:
        return rms_norm(x, weight, eps), x
    if not use_triton(x):
        s = x + residual
        return rms_norm_torch(s, weight, eps), s
    assert residual.shape == x.shape, (x.shape, residual.shape)
    return _launch_rms(x, residual, weight, eps)
