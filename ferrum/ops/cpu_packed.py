"""y = x W^T + b on CPU through oneDNN with the weight reordered once, at load, into oneDNN's
blocked layout (the "prepacked" weights that torch's inductor uses for frozen CPU linears).

F.linear re-packs the whole weight into the GEMM's panel layout on every call; at the row
counts of batched decode (2-64) that repacking costs about as much as the arithmetic. With the
weight packed once, SmolLM2's matrices take 1.5x less time per step at 16-32 rows (the LM head
up to 2x; figures in benchmarks/results/README.md). The packed copy doubles the memory of the
weights it is made for, so the model runner only makes it where it runs these linears (CPU,
float32, one process: `KERNELS.cpu_packed_weights`, FERRUM_CPU_PACKED_WEIGHTS=0 turns it off)
and only when the copy takes at most half of the memory available (`fits`).
One-row forwards keep using the plain weight (`ferrum.ops.cpu_blas`: OpenBLAS's sgemv is faster
there than oneDNN's packed path).
"""
from __future__ import annotations

import torch

# Row count the packed layout is chosen for (any row count computes correctly; oneDNN picks the
# blocking from it): a typical decode batch.
PACK_ROWS = 32


def available() -> bool:
    """Whether this torch build has the oneDNN linear ops used here."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fits(extra_bytes: int) -> bool:
    """Whether a packed copy of `extra_bytes` leaves at least half of the memory available now
    (the KV cache and activations still need theirs); True where that cannot be read."""
    free = available_memory_bytes()
    return free is None or extra_bytes <= free // 2


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 CPU, any strides -> an opaque oneDNN tensor [N, K] holding the same
    values in the blocked layout for `packed_linear` (a copy: the weight is not changed)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] float32 CPU @ W^T (+ bias [N]) -> new [T, N] float32, W given as `pack(W)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
