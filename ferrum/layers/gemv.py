"""Fast paths for y = x W^T + b: a batch-1 Triton GEMV on CUDA; numpy's bundled BLAS on CPU.

A batch-1 decode step is a chain of matrix-vector products whose speed is the rate at which
the weights stream from HBM. cuBLAS reaches the roofline on large matrices but loses time on
the smaller ones of a step (o_proj, and every matrix at TP=2, 8-50 MB each); this kernel
streams W in [BLOCK_N, BLOCK_K] tiles with each program owning BLOCK_N output rows, so the
grid always has thousands of programs and no split-K reduction is needed.

The Triton GEMV serves LinearBase and the LM head when x has exactly one row and the dtype
is 16-bit (`FERRUM_TRITON_GEMV=0` turns it off); the block shape comes from `gemv_config`. On
H200 it took a Llama-3-8B batch-1 step's matrix time from 4.07 to 3.70 ms (94% of the
4.35 TB/s roofline); see benchmarks/results/h200-2026-11-30-r2/. `linear` dispatches.
This module also decides where programmatic dependent launch is used (`pdl_ok`, below): with
it on every decode-path kernel the batch-1 step went from 4.18 to 3.90 ms (r3/pdl/).
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
    pdl_start = None  # a Triton helper (below); other kernel modules import the name

ENABLED = os.environ.get("FERRUM_TRITON_GEMV", "1") != "0"
# CPU: numpy's bundled OpenBLAS reads fp32 weights for one row at 16-31 GB/s on the 2-core
# AMD EPYC dev box where torch's MKL path reads 11-22 GB/s (SmolLM2 shapes, weights larger
# than the caches): a batch-1 SmolLM2 step's matrix time drops from ~32 to ~21 ms; it is also
# ahead at 2-128 rows (32 rows: 78 vs 91-101 ms per step), so it takes every row count. Single
# process only: OpenBLAS sizes its own thread pool from the core count, which CPU TP ranks
# sharing the cores would oversubscribe.
CPU_BLAS = os.environ.get("FERRUM_CPU_BLAS_GEMV", "1") != "0"


# Programmatic dependent launch (PDL, sm_90+): the GEMV is launched while the kernel before it
# still runs, reads its first weight tile (weights never change), and only then waits for that
# kernel's output (`gdc_wait`). The kernels that come before GEMVs (RMSNorm, SiLU*mul,
# attention, the GEMV itself) signal early (`gdc_launch_dependents`), so the weight stream of
# the next matrix starts during their tail instead of after it. FERRUM_PDL=0 turns it off.
PDL = os.environ.get("FERRUM_PDL", "1") != "0"
_SM90: dict[int, bool] = {}


def pdl_ok(t: torch.Tensor) -> bool:
    """True when kernels on t's device may use programmatic dependent launch."""
    if not (PDL and HAS_TRITON and t.is_cuda):
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _SM90[idx]


if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start():
        """Start of a kernel launched with PDL: wait until the kernel before it has finished
        (its outputs are visible), then let the kernel after it launch."""
        gdc_wait()
        gdc_launch_dependents()

    @triton.jit
    def _load_w_tile(rows, offs_k, n_mask, K, EVEN: tl.constexpr):
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked, fully vectorised loads
            w = tl.load(rows + offs_k[None, :], eviction_policy="evict_first")
        else:
            k_mask = offs_k < K
            w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        return w

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                     HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        offs_k = tl.arange(0, BLOCK_K)
        w = _load_w_tile(rows, offs_k, n_mask, K, EVEN)  # first tile: weights only
        if USE_PDL:
            pdl_start()             # x (written by the previous kernel) is ready after this
        if EVEN:
            x = tl.load(x_ptr + offs_k)
        else:
            x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
        acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                x = tl.load(x_ptr + offs_k)
            else:
                x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
            w = _load_w_tile(rows, offs_k, n_mask, K, EVEN)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [n, k] weight: the best of 8 block
    shapes per Llama-3-8B matrix on H200 (benchmarks/profile_decode.py gemv; bf16 TB/s):
    wide matrices (gate_up, LM head: 3.9-4.45 TB/s) like short wide tiles; matrices of <= 32 MB
    (o_proj, qkv at TP=2: 2.7-3.1 TB/s vs cuBLAS 2.2-2.5) like long thin tiles, which give
    more programs; the rest (qkv, down: 3.5-3.8 vs 3.0-3.6) sit in between.
    `FERRUM_GEMV_CONFIG="BN,BK,warps,stages"` overrides (tuning runs)."""
    env = os.environ.get("FERRUM_GEMV_CONFIG")
    if env:
        bn, bk, w, s = (int(v) for v in env.split(","))
        return bn, bk, w, s
    if n >= 14336:
        bn, bk, w, s = 16, 256, 4, 4
    elif n * k <= 4096 * 4096:
        bn, bk, w, s = 4, 1024, 4, 2
    else:
        bn, bk, w, s = 8, 512, 4, 3
    while bk > 64 and k % bk:  # a BLOCK_K dividing K keeps the unmasked (EVEN) path
        bk //= 2
    return bn, bk, w, s


def can_use(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (ENABLED and HAS_TRITON and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.stride(1) == 1 and x.is_contiguous())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x: [1, K] contiguous; weight: [N, K] with unit stride along K; bias: [N] or None.
    Returns [1, N] in x's dtype, accumulated in float32."""
    N, K = weight.shape
    assert x.shape == (1, K), (x.shape, weight.shape)
    bn, bk, warps, stages = config or gemv_config(N, K)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    even = N % bn == 0 and K % bk == 0
    pdl = pdl_ok(x)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else x, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN=even, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           single_process: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias) with fast paths: `gemv` on CUDA (one row, 16-bit), numpy's
    BLAS on CPU (float32, `single_process` only; run inside `cpu_blas_forward`). x: [T, K];
    weight: [N, K] (any strides); returns [T, N]."""
    if can_use(x, weight):
        return gemv(x, weight, bias)
    if (CPU_BLAS and single_process and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32):
        w = weight.numpy()
        if x.shape[0] == 1:
            y = torch.from_numpy(w.dot(x.numpy()[0]))[None]   # sgemv
        else:
            y = torch.from_numpy(x.numpy() @ w.T)              # sgemm
        return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def cpu_blas_forward(active: bool):
    """Around a CPU forward whose linears go to numpy's BLAS: torch's own ops run on one
    thread meanwhile. Both libraries keep their worker threads spinning for a while after
    each call, and on a small box torch's spinning workers and OpenBLAS's fight for the same
    cores (measured: SmolLM2 batch-1 decode 261 ms per token instead of 34 ms on 2 cores).
    The matrix work, nearly all of a step, still uses every core through OpenBLAS."""
    if not (active and CPU_BLAS):
        yield
        return
    n = torch.get_num_threads()
    _limit_openblas(n)  # so --threads / torch.set_num_threads bound the BLAS too
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_openblas_libs: list | None = None
_openblas_threads: int | None = None


def _limit_openblas(n: int) -> None:
    """Set numpy's OpenBLAS to n threads (through threadpoolctl; once per change)."""
    global _openblas_libs, _openblas_threads
    if n == _openblas_threads:
        return
    if _openblas_libs is None:
        try:
            from threadpoolctl import ThreadpoolController
            _openblas_libs = [lib for lib in ThreadpoolController().lib_controllers
                              if lib.internal_api == "openblas"]
        except Exception:  # no threadpoolctl: OpenBLAS keeps its default (all cores)
            _openblas_libs = []
    for lib in _openblas_libs:
        # only on a change: setting the count it already had made batch-32 SmolLM2 decode
        # steps ~20% slower on the dev box (204 -> 237-251 ms), for reasons not looked into
        if lib.get_num_threads() != n:
            lib.set_num_threads(n)
    _openblas_threads = n
