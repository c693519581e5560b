"""Triton availability and the helpers every ferrum Triton kernel shares.

- `HAS_TRITON`: triton imports (CPU-only installs run every op's torch code instead).
- `use_triton(t)`: the dispatch rule of the elementwise ops: Triton for CUDA tensors, and for
  CPU tensors too when `KERNELS.force_triton` (FERRUM_FORCE_TRITON=1; tests, with
  `TRITON_INTERPRET=1`, which runs the kernels in Triton's numpy interpreter).
- Programmatic dependent launch (PDL, sm_90+, CUDA programming guide "Programmatic Dependent
  Launch and Synchronization"): a kernel launched with `launch_pdl=True` may start while the
  kernel before it still runs. The batch-1 GEMV uses that to read its first weight tile early
  (weights never change) and only then waits for its input; every other decode-path kernel
  calls `pdl_start` first, which waits for its inputs and then lets the next kernel launch, so
  the next GEMV's weight stream starts during this kernel's tail. `pdl_ok(t)` says whether
  kernels on t's device use it; `KERNELS.pdl` (--no-pdl, FERRUM_PDL=0) turns it off. It
  survives CUDA-graph capture.
- `reduce_splits`: the sum over a split-K GEMV's float32 partials (the 4-bit and Gluon GEMVs).
"""
from __future__ import annotations

import torch

from ferrum.config import KERNELS

try:
    import triton
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

_SM90: dict[int, bool] = {}


def use_triton(t: torch.Tensor) -> bool:
    """True when an op on tensor t runs its Triton kernel: triton is installed and t is on
    CUDA (or KERNELS.force_triton, for the interpreter tests on CPU)."""
    return HAS_TRITON and (t.is_cuda or KERNELS.force_triton)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes must be powers of two."""
    return 1 << max(0, (n - 1).bit_length())


def fit_block(block: int, n: int, floor: int) -> int:
    """`block` halved until it divides n (a tile that divides the dimension keeps a kernel's
    unmasked path) or reaches `floor`. block, floor: powers of two."""
    while block > floor and n % block:
        block //= 2
    return block


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has unit stride (the kernels' requirement), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit stride on the last dim (a view when possible)."""
    return last_dim_contiguous(x).reshape(-1, x.shape[-1])


def is_sm90(t: torch.Tensor) -> bool:
    """True when t is on a CUDA device of compute capability 9.0 or newer (cached per device
    index)."""
    if not t.is_cuda:
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _SM90:
        _SM90[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _SM90[idx]


def pdl_ok(t: torch.Tensor) -> bool:
    """True when kernels on t's device may use programmatic dependent launch: KERNELS.pdl,
    triton is installed, t is on CUDA and the device is sm_90 or newer."""
    return KERNELS.pdl and HAS_TRITON and is_sm90(t)


if HAS_TRITON:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start():
        """Start of a kernel launched with PDL: wait until the kernel before it has finished
        (its outputs are visible), then let the kernel after it launch."""
        gdc_wait()
        gdc_launch_dependents()

    @triton.jit
    def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        """y [M, N] (contiguous) = sum over the SPLIT_K float32 partials p [SPLIT_K, M, N] + bias."""
        if USE_PDL:
            pdl_start()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(SPLIT_K):
            acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    pdl_start = _splitk_reduce_kernel = None


def reduce_splits(part: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    """The last step of a split-K GEMV: y [M, N] (contiguous, its dtype) = the sum over the
    float32 partials part [SPLIT_K, M, N] (or [SPLIT_K, N] for M = 1) + bias [N]; returns y."""
    split, n = part.shape[0], y.shape[-1]
    mn = y.numel()
    _splitk_reduce_kernel[(triton.cdiv(mn, 1024),)](
        part, bias if bias is not None else part, y, mn, n, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK=1024, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y
