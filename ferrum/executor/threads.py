"""CPU threads of one rank: one setting (`EngineConfig.threads`, the `--threads` flag) for
torch's intra-op pool and the BLAS behind numpy (OpenBLAS / MKL, through threadpoolctl).

Why a default below the core count: torch and OpenBLAS split each matrix product over their
threads and wait at a barrier for the slowest one. When another process is busy on one of the
cores, the thread that shares it gets a fraction of a scheduler slice and every barrier waits
for it, so a 2-thread decode on a 2-core box drops from ~13 to 1-2 tokens/s beside a busy
process, while 1 thread keeps most of its speed (figures in the README). Leaving one core to
everything else costs little on an idle box and avoids that collapse on a shared one.
"""
from __future__ import annotations

import logging
import os

from ferrum.config import parse_threads, set_kernels

log = logging.getLogger("ferrum")


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask on Linux, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(ranks: int = 1, cores: int | None = None) -> int:
    """Threads per rank when `--threads` is not given: the usable cores less one, shared
    between the `ranks` processes of this machine, at least 1."""
    cores = usable_cores() if cores is None else cores
    return max(1, (cores - 1) // ranks)


def oversubscription_warning(threads: int, ranks: int, cores: int | None = None) -> str | None:
    """A sentence when `ranks` processes x `threads` threads exceed the usable cores, else
    None. (Ranks wait for each other at every all-reduce, so one starved rank slows all.)"""
    cores = usable_cores() if cores is None else cores
    if ranks * threads <= cores:
        return None
    return (f"{ranks} TP rank(s) x {threads} thread(s) = {ranks * threads} threads on {cores} "
            f"cores: the ranks will wait for each other's cores and every step gets several "
            f"times slower; use at most {cores} ranks x threads (--threads, -tp)")


def set_threads(threads: int | None, ranks: int = 1, warn: bool = True) -> int:
    """Use `threads` (None: `default_threads(ranks)`) for torch's intra-op pool (of the
    calling thread: torch keeps the count per thread) and every BLAS library loaded in this
    process; returns the count. With `warn`, logs
    `oversubscription_warning` when there is one. Raises InvalidRequestError for threads < 1
    (`parse_threads`)."""
    import torch
    n = default_threads(ranks) if threads is None else parse_threads(threads)
    message = oversubscription_warning(n, ranks) if warn else None
    if message:
        log.warning(message)
    torch.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=n, user_api="blas")
    except ImportError:  # the BLAS keeps its default; torch still uses n
        pass
    return n


def apply_engine_settings(config, warn: bool = False) -> int:
    """Put the engine config's process settings in force for the calling thread: its CPU
    threads (`set_threads`, with the ranks of this machine: LOCAL_WORLD_SIZE under torchrun,
    else the TP size) and its kernel switches (`ferrum.config.set_kernels`). torch's thread
    count is per thread, so every thread that runs model code calls this. Returns the
    threads."""
    set_kernels(config.kernels)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", config.parallel.tensor_parallel_size))
    return set_threads(config.threads, ranks, warn=warn)
