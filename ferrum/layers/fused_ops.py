"""Fused elementwise ops in Triton, with torch fallbacks of identical semantics.

- `fused_add_rms_norm`: residual add + RMSNorm (Zhang & Sennrich 2019) in one pass, the
  vLLM `fused_add_rms_norm` pattern; same rounding as `ferrum.layers.layernorm.RMSNorm`.
- `rms_norm`: RMSNorm without a residual.
- `silu_and_mul`: SwiGLU (Shazeer 2020), [..., 2d] = [gate | up] -> silu(gate) * up.
- `apply_rotary_emb_`: RoPE (Su et al. 2021) in the rotate-half ("NeoX") layout, in place on
  q and k, from the float32 cos/sin tables of `RotaryEmbedding`.

Each wrapper launches its Triton kernel only when the tensors are on CUDA, or on CPU when
`FORCE_TRITON` is set (tests: with `TRITON_INTERPRET=1`); otherwise it runs the torch code.
Math is float32 inside the kernels, rounding to the storage dtype at the same points as the
torch modules, so bf16 results match them to within one bf16 ulp.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ferrum.layers.gemv import pdl_ok, pdl_start

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

FORCE_TRITON: bool = os.environ.get("FERRUM_FORCE_TRITON", "0") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or FORCE_TRITON)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride on the last dim (a view when possible)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


# =============================================================================================
# RMSNorm (+ residual)
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
                             stride_x, stride_r, stride_o, stride_ro, N, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        # One program per row; the whole row (hidden <= BLOCK) stays in registers.
        if USE_PDL:  # launched early (gemv.py, PDL): wait for the inputs, let the next launch
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        x = x_raw.to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            # The residual stream is stored in the activation dtype; the norm reads the
            # rounded sum, as `x = x + residual` does in RMSNorm.forward.
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
            x = s.to(tl.float32)
        var = tl.sum(x * x, 0) / N
        y = x * tl.rsqrt(var + eps)
        # RMSNorm._norm: round to the dtype of its input (the sum when there is a residual) ...
        if HAS_RES:
            y = y.to(res_out_ptr.dtype.element_ty)
        else:
            y = y.to(x_raw.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (y.to(tl.float32) * w).to(out_ptr.dtype.element_ty),
                 mask=mask)  # ... then weight * x


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _launch_rms(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x)
    if residual is not None:
        r2 = _rows(residual)
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        res_out = torch.empty(x2.shape, dtype=res_dtype, device=x.device)
    else:
        r2 = res_out = x2  # unused (HAS_RES=False)
        res_dtype = x.dtype
    out = torch.empty(x2.shape, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    if x2.shape[0] > 0:
        block = _next_pow2(n)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n, eps,
            HAS_RES=residual is not None, BLOCK=block, USE_PDL=pdl_ok(x),
            num_warps=min(max(block // 256, 1), 8), launch_pdl=pdl_ok(x))
    return out.view(shape), (res_out.view(shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x: [..., hidden] (any float dtype) with weight [hidden] -> [..., hidden] in
    promote(x, weight) dtype; float32 math, as RMSNorm.forward(x)."""
    if not _use_triton(x):
        return _torch_rms_norm(x, weight, eps)
    return _launch_rms(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) with new_residual = x + residual (rounded to the activation
    dtype) and normed = RMSNorm(new_residual); one kernel, one read of x and residual.

    x, residual: [..., hidden] (same shape, bf16/fp16/fp32); weight: [hidden]. With
    residual=None the residual stream starts here: returns (RMSNorm(x), x) (x itself, not a
    copy), matching the first decoder layer's `residual, x = x, input_layernorm(x)`. Outputs
    are new tensors (inputs are not modified). Same semantics as RMSNorm.forward(x, residual).
    """
    if residual is None:
        return rms_norm(x, weight, eps), x
    if not _use_triton(x):
        s = x + residual
        return _torch_rms_norm(s, weight, eps), s
    assert residual.shape == x.shape, (x.shape, residual.shape)
    return _launch_rms(x, residual, weight, eps)


# =============================================================================================
# SiLU and mul
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr):
        if USE_PDL:  # see gemv.py, PDL
            pdl_start()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        g_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        g = g_raw.to(tl.float32)
        # Round silu(gate) to the storage dtype before the product, as F.silu(gate) * up does.
        a = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] = [gate | up] (bf16/fp16/fp32) -> silu(gate) * up: [..., d], same dtype."""
    if not _use_triton(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and d > 0:
        block = min(_SILU_BLOCK, _next_pow2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, USE_PDL=pdl_ok(x),
            num_warps=4 if block >= 512 else 2, launch_pdl=pdl_ok(x))
    return out.view(*x.shape[:-1], d)


# =============================================================================================
# RoPE (rotate-half), in place
# =============================================================================================
if HAS_TRITON:
    @triton.jit
    def _rope_heads(base, stride_h, cos, sin, offs_d, d_mask, H: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr):
        """Rotate the H heads of one token in place (q or k)."""
        offs_h = tl.arange(0, BLOCK_H)
        m = (offs_h[:, None] < H) & d_mask[None, :]
        p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p1 + HALF, mask=m, other=0.0)
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
        tl.store(p1, y1.to(x1.dtype), mask=m)
        tl.store(p1 + HALF, y2.to(x1.dtype), mask=m)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                     HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                     USE_PDL: tl.constexpr):
        if USE_PDL:  # see gemv.py, PDL
            pdl_start()
        # One program per token: all q and k heads. x = [x1 | x2] (halves of head_dim):
        # out = [x1*cos - x2*sin | x2*cos + x1*sin], in float32, rounded to x's dtype.
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HALF
        cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]

        _rope_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_d, d_mask, HQ, HALF, BLOCK_HQ)
        _rope_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_d, d_mask, HK, HALF, BLOCK_HK)


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def apply_rotary_emb_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (rotate-half / NeoX layout, as RotaryEmbedding.forward).

    positions: [T] int64 (or int32); q: [T, Hq, D], k: [T, Hk, D] (bf16/fp16/fp32; views such
    as slices of a fused qkv output are fine when the last dim is contiguous); cos, sin:
    [max_position, D/2] float32 (RotaryEmbedding.cos / .sin). Returns (q, k), the same tensors.
    """
    if not _use_triton(q) or q.stride(-1) != 1 or k.stride(-1) != 1:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q.copy_(_torch_rotate(q, c, s))
        k.copy_(_torch_rotate(k, c, s))
        return q, k
    T, hq, d = q.shape
    hk = k.shape[1]
    assert k.shape[0] == T and k.shape[2] == d and d % 2 == 0, (q.shape, k.shape)
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[-1] == d // 2
    if T > 0:
        _rope_kernel[(T,)](
            q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HQ=hq, HK=hk, HALF=d // 2, BLOCK_HQ=_next_pow2(hq), BLOCK_HK=_next_pow2(hk),
            BLOCK_D=_next_pow2(d // 2), USE_PDL=pdl_ok(q), num_warps=4 if hq * d >= 2048 else 1,
            launch_pdl=pdl_ok(q))
    return q, k
