"""One tensor-parallel rank: joins the process group, builds its shard of the model and its
own paged KV cache, then runs the same forward as rank 0 for every step rank 0 broadcasts.

Control messages go over a CPU (gloo) group with a long timeout, so an idle server never
times out; model collectives use the TP group (NCCL on CUDA, gloo on CPU) whose timeout is
`ParallelConfig.step_timeout_s`, so a dead or hung rank fails a step instead of hanging it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrum.config import EngineConfig, resolve_device, resolve_dtype
from ferrum.distributed.parallel_state import init_tensor_parallel
from ferrum.interfaces import KvCacheHandle

log = logging.getLogger("ferrum")
CONTROL_TIMEOUT = timedelta(days=7)


def rank_device(device: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def init_distributed(rank: int, world: int, device: str, init_method: str | None,
                     step_timeout_s: float):
    """Creates the default process group and returns (tp_group, control_group)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:  # ranks share the host's cores: oversubscribed threads make every rank slow
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world, timeout=timedelta(seconds=step_timeout_s))
    ranks = list(range(world))
    tp_group = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=step_timeout_s))
    control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
    init_tensor_parallel(rank, world, tp_group)
    return tp_group, control


def broadcast_message(msg, control_group):
    """Rank 0 sends `msg` (any picklable object); other ranks pass None and get it."""
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=control_group)
    return box[0]


def handles_to_wire(kv: list[KvCacheHandle]) -> list[tuple]:
    return [(h.block_table, h.num_tokens) for h in kv]


def handles_from_wire(wire: list[tuple], block_size: int) -> list[KvCacheHandle]:
    return [KvCacheHandle("", bt, n, block_size) for bt, n in wire]


def build_runner(config: EngineConfig, device: str, progress: bool):
    from ferrum.executor.model_runner import ModelRunner
    from ferrum.model_store import resolve_model
    source = resolve_model(config.model)
    dtype = resolve_dtype(config.dtype, device)
    return ModelRunner(source, device, dtype, config.load_format, config.seed, progress)


def agree_num_blocks(n: int, control_group) -> int:
    """Every rank must have the same pool: take the minimum over ranks."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)
    return int(t.item())


def worker_loop(runner, recv, block_size: int, step_counter=None) -> None:
    """Ranks > 0: execute each step rank 0 sends (`recv()` returns it) until 'shutdown'."""
    while True:
        msg = recv()
        op = msg[0]
        if op == "shutdown":
            return
        if op == "prefill":
            runner.prefill(msg[1], handles_from_wire(msg[2], block_size))
        elif op == "decode":
            runner.decode(msg[1], handles_from_wire(msg[2], block_size), None, msg[3], msg[4])
        elif op == "allocate_kv_cache":
            runner.allocate_kv_cache(msg[1], msg[2])
        elif op == "call":  # generic runner method (warmup, CUDA graph capture, ...)
            getattr(runner, msg[1])(*msg[2])
        elif op == "ping":  # carries a payload, does nothing: measures the control channel
            pass
        elif op == "raise":  # fault-injection hook used by tests
            raise RuntimeError(msg[1])
        if step_counter is not None:
            step_counter[dist.get_rank()] += 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the engine process dies, so no orphan is left."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def spawned_worker_main(rank: int, world: int, init_method: str, config: EngineConfig,
                        reader, error_queue, step_counter) -> None:
    """Entry point of a rank spawned by TensorParallelExecutor (torch.multiprocessing)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the engine process
    logging.basicConfig(level=logging.WARNING)
    try:
        device = rank_device(resolve_device(config.device), rank)
        if device.startswith("cuda"):
            reader.spin_s = 0.05  # GPU hosts have cores to spare; on CPU the ranks need them
        _, control = init_distributed(rank, world, device, init_method, config.parallel.step_timeout_s)
        runner = build_runner(config, device, progress=False)
        from ferrum.executor.tensor_parallel import local_num_blocks
        n = agree_num_blocks(local_num_blocks(runner, config, device), control)
        runner.allocate_kv_cache(n, config.cache.block_size)
        worker_loop(runner, reader.recv, config.cache.block_size, step_counter)
    except BaseException as e:  # report to rank 0, then exit non-zero
        try:
            error_queue.put((rank, f"{type(e).__name__}: {e}"))
            error_queue.close()
            error_queue.join_thread()  # flush the queue's feeder thread before _exit
        except Exception:
            pass
        sys.stderr.write(f"ferrum TP rank {rank} failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
