"""A tensor-parallel worker rank (rank > 0): builds its shard of the model and its own paged
KV cache, then runs the same forward as rank 0 for every step rank 0 sends, until shutdown.

Two ways in:
- `python -m ferrum.executor.tp_worker ...`, started by TensorParallelExecutor as a plain
  subprocess. It never imports the caller's `__main__` (multiprocessing's spawn re-imports it,
  so a script without an `if __name__ == "__main__":` guard, code piped to `python -`, or a
  notebook could not start TP). It meets rank 0 through rank 0's TCPStore: reads the engine
  config there, reports each start-up phase (`joined/<rank>`, `num_blocks/<rank>`,
  `ready/<rank>`) or its error (`error/<rank>`), and takes the agreed pool size
  (`num_blocks`). Steps arrive over the shared-memory channel (distributed/shm_broadcast.py).
- `run_spmd_worker`, under torchrun: every node runs the same `ferrum` command and ranks > 0
  end up here; steps arrive by gloo broadcast.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ferrum.config import EngineConfig, resolve_device
from ferrum.executor.tp_rank import (agree_num_blocks, broadcast_message, build_runner,
                                     handles_from_wire, init_distributed, local_num_blocks,
                                     rank_device)


def worker_loop(runner, recv, block_size: int, step_done=None) -> None:
    """Ranks > 0: execute each step rank 0 sends (`recv()` returns it) until 'shutdown';
    `step_done()` is called after each (the driver's view of a hung rank)."""
    while True:
        msg = recv()
        op = msg[0]
        if op == "shutdown":
            return
        if op == "prefill":
            runner.prefill(msg[1], handles_from_wire(msg[2], block_size), msg[3], msg[4])
        elif op == "decode":
            runner.decode(msg[1], handles_from_wire(msg[2], block_size), None, msg[3], msg[4])
        elif op == "allocate_kv_cache":
            runner.allocate_kv_cache(msg[1], msg[2])
        elif op == "call":  # generic runner method (warmup, CUDA graph capture, ...)
            getattr(runner, msg[1])(*msg[2])
        elif op == "raise":  # fault-injection hook used by tests
            raise RuntimeError(msg[1])
        if step_done is not None:
            step_done()


def _leave_stopping_to_rank0() -> None:
    """Ignore Ctrl-C and SIGTERM in a worker rank. They reach every rank at once (a terminal's
    Ctrl-C goes to its whole process group, torchrun forwards SIGTERM to each rank, systemd
    signals every process of the unit), and a worker that died of one broke the steps rank 0
    still runs while its server drains the open requests: they failed with "rank 1 exited
    with code -15" / "Connection reset by peer". Rank 0 handles the signal and sends
    'shutdown' when it is done; a worker whose rank 0 is gone stops anyway (EOF on the step
    channel, a reset gloo connection, `_die_with_parent`), and torchrun's SIGKILL after its
    grace period still ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _refuse_what_rank0_refuses(config: EngineConfig, world: int) -> None:
    """The checks rank 0 makes before it joins the process group (LLMEngine, the executor),
    made here too: a config it refuses (a TP size that does not divide the heads, a
    max_model_len past the model's) left this rank waiting for it until the rendezvous timed
    out, 30 s later, with a DistStoreError traceback. Raises what rank 0 raises."""
    from ferrum.config import resolve_max_model_len
    from ferrum.errors import TensorParallelError
    from ferrum.executor.tensor_parallel import validate_tp_sizes
    from ferrum.loader.resolve import resolve_model
    tp = config.parallel.tensor_parallel_size
    if world != tp:
        raise TensorParallelError(f"torchrun started {world} ranks but tensor_parallel_size is {tp}")
    source = resolve_model(config.model)
    resolve_max_model_len(source.config, config.scheduler.max_model_len)
    validate_tp_sizes(source.config, tp, config.parallel.enable_expert_parallel)


def run_spmd_worker(config: EngineConfig) -> None:
    """Rank > 0 under torchrun: build this rank's shard and follow rank 0's steps until it
    shuts down. Every rank runs the same `ferrum` command; rank 0 runs the engine."""
    _leave_stopping_to_rank0()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _refuse_what_rank0_refuses(config, world)
    device = rank_device(resolve_device(config.device), int(os.environ.get("LOCAL_RANK", 0)))
    _, control = init_distributed(rank, world, device, None, config.parallel.step_timeout_s,
                                  expert_parallel=config.parallel.enable_expert_parallel)
    runner = build_runner(config, device, progress=False)
    n = agree_num_blocks(local_num_blocks(runner, config, device), control)
    runner.allocate_kv_cache(n, config.cache.block_size)
    worker_loop(runner, lambda: broadcast_message(None, control), config.cache.block_size)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _die_with_parent() -> None:
    """Exit when the engine process that started this worker is gone, so no orphan is left
    holding its shard. Watched from a thread, by the parent's pid: PR_SET_PDEATHSIG, used
    before, fires when the *thread* that started the worker exits, so it killed the workers
    of an engine built in a short-lived thread (a loader thread, asyncio.to_thread) at once."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:   # the parent's exit re-parents us
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="ferrum-parent-watch").start()


def serve_rank(rank: int, world: int, store, channel_spec: str) -> None:
    """Start-up handshake with rank 0 through `store` (see the module docstring), then the
    step loop over the shared-memory channel."""
    from ferrum.distributed.shm_broadcast import ShmReader
    config: EngineConfig = pickle.loads(store.get("config"))
    store.set(f"joined/{rank}", b"1")
    device = rank_device(resolve_device(config.device), rank)
    # GPU hosts have cores to spare for polling; on CPU the ranks need them
    reader = ShmReader(channel_spec, spin_s=0.05 if device.startswith("cuda") else 0.0)
    init_distributed(rank, world, device, None, config.parallel.step_timeout_s, store=store,
                     expert_parallel=config.parallel.enable_expert_parallel)
    runner = build_runner(config, device, progress=False)
    store.set(f"num_blocks/{rank}", str(local_num_blocks(runner, config, device)).encode())
    store.wait(["num_blocks"])
    runner.allocate_kv_cache(int(store.get("num_blocks")), config.cache.block_size)
    store.set(f"ready/{rank}", b"1")
    worker_loop(runner, reader.recv, config.cache.block_size, reader.mark_step_done)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker process: `--rank R --world-size N --store HOST:PORT
    --channel SPEC --startup-timeout S`. Exits 0 after rank 0's shutdown, 1 after an error
    (reported to rank 0 under `error/<rank>` when the store is reachable, and on stderr)."""
    p = argparse.ArgumentParser(prog="python -m ferrum.executor.tp_worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    p.add_argument("--channel", required=True, help="ShmBroadcast.reader_spec of this rank")
    p.add_argument("--startup-timeout", type=float, required=True)
    args = p.parse_args(argv)
    _die_with_parent()
    _leave_stopping_to_rank0()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    store = None
    try:
        host, port = args.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), args.world_size, False,
                              timeout=timedelta(seconds=args.startup_timeout))
        serve_rank(args.rank, args.world_size, store, args.channel)
    except EOFError:      # rank 0 went away: nothing left to serve
        return 0
    except BaseException as e:  # report to rank 0, then exit non-zero
        message = f"{type(e).__name__}: {e}"
        if store is not None:
            try:
                store.set(f"error/{args.rank}", message.encode())
            except Exception:  # noqa: BLE001 - rank 0 may be gone already
                pass
        sys.stderr.write(f"ferrum TP rank {args.rank} failed: {message}\n")
        sys.stderr.flush()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
