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
- `arrival_counters`: the int32 counters with which the last program of a split reduction
  finds out that it is the last, and does the reduction itself instead of a second kernel
  (the split-K GEMVs, decode attention's split-KV merge).
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
_ARRIVALS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


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


def arrival_counters(n: int, device: torch.device | str, user: str) -> torch.Tensor:
    """int32 zeros [>= n] on device for one kind of kernel (`user`), shared by all its launches:
    one counter per group of programs that reduce together; the last program of a group to
    arrive (its atomic add returns the group size - 1) reduces and resets the counter to zero.
    Launches on one stream run one after another (a PDL launch touches the counters only after
    its wait), so each finds them at zero. A larger buffer is made when n outgrows the last;
    the old ones are kept, as captured CUDA graphs still point at them."""
    bufs = _ARRIVALS.setdefault((user, torch.device(device)), [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device))
    return bufs[-1]


def pdl_ok(t: torch.Tensor) -> bool:
    """True when kernels on t's device may use programmatic dependent launch: KERNELS.pdl,
    triton is installed, t is on CUDA and the device is sm_90 or newer."""
    return KERNELS.pdl and HAS_TRITON and is_sm90(t)


if HAS_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_start():
        """Start of a kernel launched with PDL: wait until the kernel before it has finished
        (its outputs are visible), then let the kernel after it launch."""
        gdc_wait()
        gdc_launch_dependents()

else:  # pragma: no cover
    pdl_start = None

