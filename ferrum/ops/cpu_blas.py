"""y = x W^T + b on CPU through numpy's bundled OpenBLAS, and the thread settings it needs.

For float32 weights larger than the caches, numpy's OpenBLAS streams one row (sgemv) faster
than torch's MKL path, but its sgemm from 2 rows on is 1.6-7x slower than MKL's on the AVX-512
dev box (figures in benchmarks/results/README.md). So only forwards of at most `MAX_ROWS`
tokens (batch-1 decode) run their linears here; larger ones stay on torch with all of torch's
threads. Single process only: OpenBLAS sizes its own thread
pool from the core count, which CPU TP ranks sharing the cores would oversubscribe.
`KERNELS.cpu_blas_gemv` (FERRUM_CPU_BLAS_GEMV=0) turns it off.
"""
from __future__ import annotations

import contextlib

import torch

from ferrum.config import KERNELS


# Largest forward (tokens) whose linears go to OpenBLAS; see the module docstring.
MAX_ROWS = 1

# True inside an active `cpu_blas_forward`: the linears of that forward (and only those) use
# OpenBLAS, so torch's threads (parked at 1 meanwhile) and OpenBLAS's never run together.
_in_forward = False


def can_use(x: torch.Tensor, weight: torch.Tensor, single_process: bool) -> bool:
    """True when `blas_linear(x, weight)` applies: inside an active `cpu_blas_forward`, one
    process, x a float32 [T, K] CPU tensor and weight float32."""
    return (_in_forward and single_process and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32)


def use_for(num_tokens: int) -> bool:
    """Whether a CPU float32 forward of `num_tokens` tokens should run its linears on OpenBLAS
    (enabled and at most MAX_ROWS tokens)."""
    return KERNELS.cpu_blas_gemv and num_tokens <= MAX_ROWS


def blas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32 (CPU) @ weight [N, K]^T (+ bias [N]) -> new [T, N] float32, through
    numpy (sgemv when T == 1, else sgemm); weight may have any strides. Run it inside
    `cpu_blas_forward` so torch's and OpenBLAS's threads do not fight for the cores."""
    w = weight.numpy()
    if x.shape[0] == 1:
        y = torch.from_numpy(w.dot(x.numpy()[0]))[None]   # sgemv
    else:
        y = torch.from_numpy(x.numpy() @ w.T)              # sgemm
    return y if bias is None else y.add_(bias)


@contextlib.contextmanager
def cpu_blas_forward(active: bool):
    """Around a CPU forward whose linears go to numpy's BLAS (no-op unless `active` and
    enabled; `can_use` is True only inside): torch's own ops run on one thread meanwhile, and
    OpenBLAS gets torch's thread count. Both libraries keep their worker threads spinning for a while after each call,
    and on a small box torch's spinning workers and OpenBLAS's fight for the same cores
    (batch-1 decode became ~8x slower); the matrix work, nearly all of a step, still uses
    every core through OpenBLAS."""
    if not (active and KERNELS.cpu_blas_gemv):
        yield
        return
    global _in_forward
    n = torch.get_num_threads()
    _limit_openblas(n)  # so --threads / torch.set_num_threads bound the BLAS too
    torch.set_num_threads(1)
    _in_forward = True
    try:
        yield
    finally:
        _in_forward = False
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
        # only on a change: setting the count it already had made batch-32 decode steps
        # ~20% slower on the dev box, for reasons not looked into
        if lib.get_num_threads() != n:
            lib.set_num_threads(n)
    _openblas_threads = n
