"""TensorParallelExecutor: one model sharded over N ranks (GUIDE section 2).

Rank 0 lives in the engine process and drives; ranks 1..N-1 are processes spawned here (or,
under `torchrun`, started by torchrun and running `run_spmd_worker`). Every step rank 0
broadcasts the step's inputs (token ids + block tables, a few KB) and all ranks run the same
sharded forward: each rank writes its own KV heads into its own paged cache from the first
prefill token, so no KV ever moves between ranks and no rank holds the whole model. Logits
are gathered on rank 0, which samples.

Faults: a rank that raises reports its error through a queue and exits; a rank that dies
breaks the next collective; a rank that hangs trips the TP group's timeout
(`ParallelConfig.step_timeout_s`). Each becomes a TensorParallelError naming the rank.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing as std_mp
import os
import queue
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferrum.config import EngineConfig, resolve_max_model_len
from ferrum.distributed.communication import set_all_reduce_impl
from ferrum.distributed.parallel_state import init_tensor_parallel
from ferrum.distributed.shm_broadcast import ShmBroadcast
from ferrum.errors import FerrumError, TensorParallelError
from ferrum.executor.base import ExecutorBase
from ferrum.executor.memory import compute_memory_requirements, num_kv_blocks
from ferrum.executor.worker import (agree_num_blocks, broadcast_message, build_runner,
                                    handles_to_wire, init_distributed, rank_device,
                                    spawned_worker_main, worker_loop)
from ferrum.interfaces import DecodeInput, PrefillInput
from ferrum.loader.base import ModelSource

log = logging.getLogger("ferrum")


def validate_tp_sizes(cfg, tp: int) -> None:
    """Raise TensorParallelError naming the sizes that do not divide over `tp` ranks."""
    def need(ok: bool, msg: str):
        if not ok:
            raise TensorParallelError(msg)
    need(tp >= 1, f"tensor_parallel_size must be >= 1, got {tp}")
    need(cfg.num_attention_heads % tp == 0,
         f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by tensor_parallel_size ({tp})")
    kv = cfg.num_key_value_heads
    need(kv % tp == 0 or tp % kv == 0,
         f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another")
    need(cfg.intermediate_size % tp == 0,
         f"intermediate_size ({cfg.intermediate_size}) is not divisible by tensor_parallel_size ({tp})")


def local_num_blocks(runner, config: EngineConfig, device: str) -> int:
    tp = config.parallel.tensor_parallel_size
    mem = compute_memory_requirements(runner.cfg, runner.dtype, tp)
    s = config.scheduler
    max_len = resolve_max_model_len(runner.cfg, s.max_model_len)
    return num_kv_blocks(mem, config.cache, device, max_len, s.max_num_seqs, s.max_num_batched_tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and int(os.environ["WORLD_SIZE"]) > 1)


class TensorParallelExecutor(ExecutorBase):
    def __init__(self, source: ModelSource, config: EngineConfig, progress: bool = True):
        super().__init__(source, config)
        validate_tp_sizes(self.cfg, self.tp)
        self.procs: list = []
        self._closed = False
        self.spmd = launched_by_torchrun()
        try:
            self._start(config, progress)
        except BaseException:
            self._kill_workers()
            raise
        atexit.register(self.shutdown)

    def _start(self, config: EngineConfig, progress: bool) -> None:
        if self.spmd:
            world = int(os.environ["WORLD_SIZE"])
            if world != self.tp:
                raise TensorParallelError(f"torchrun started {world} ranks but tensor_parallel_size is {self.tp}")
            self.rank_device = rank_device(self.device, int(os.environ.get("LOCAL_RANK", 0)))
            init_method = None
            self.error_queue, self.step_counter, self.channel = None, None, None
        else:
            self.rank_device = rank_device(self.device, 0)
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            ctx = mp.get_context("spawn")
            self.error_queue = ctx.Queue()
            self.step_counter = std_mp.get_context("spawn").Array("q", self.tp, lock=False)
            self.channel = ShmBroadcast(ctx, self.tp - 1)
            for r in range(1, self.tp):
                p = ctx.Process(target=spawned_worker_main, daemon=True, name=f"ferrum-tp{r}",
                                args=(r, self.tp, init_method, config, self.channel.reader(r - 1),
                                      self.error_queue, self.step_counter))
                p.start()
                self.procs.append(p)
        _, self.control = init_distributed(0, self.tp, self.rank_device, init_method,
                                           config.parallel.step_timeout_s)
        self.runner = build_runner(config, self.rank_device, progress)
        self.num_blocks = agree_num_blocks(local_num_blocks(self.runner, config, self.rank_device), self.control)
        self.runner.allocate_kv_cache(self.num_blocks, config.cache.block_size)
        self._step_no = 0

    # ---- one step on every rank -------------------------------------------------------------
    def _run(self, msg: tuple, local):
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor is shut down")
        try:
            self._check_workers()
            self._send(msg)
            out = local()
        except FerrumError:
            raise
        except Exception as e:
            # the ranks are out of step (one may wait in a collective for the others)
            self._closed = True
            err = self._diagnose(e)
            self._broken = str(err)
            self._kill_workers()
            raise err from e
        except BaseException:
            # Ctrl-C mid-step: the other ranks may be stuck in a collective waiting for us,
            # so shutdown must not wait for them to read a message.
            self._closed = True
            raise
        self._step_no += 1
        return out

    def _send(self, msg) -> None:
        """Step inputs to ranks 1..N-1: shared memory when we spawned them, else (torchrun)
        a broadcast over the gloo control group."""
        if self.channel is not None:
            self.channel.send(msg, timeout=self.config.parallel.step_timeout_s)
        else:
            broadcast_message(msg, self.control)

    def _prefill(self, inp: PrefillInput) -> torch.Tensor:
        return self._run(("prefill", inp.token_ids, handles_to_wire(inp.kv)),
                         lambda: self.runner.prefill(inp.token_ids, inp.kv))

    def _decode(self, inp: DecodeInput) -> torch.Tensor:
        num_prev = 0 if inp.prev_rows is None else len(inp.prev_sampled)
        return self._run(("decode", inp.token_ids, handles_to_wire(inp.kv), inp.prev_rows, num_prev),
                         lambda: self.runner.decode(inp.token_ids, inp.kv, inp.prev_sampled,
                                                    inp.prev_rows, num_prev))

    def call_all(self, method: str, *args):
        """Run `runner.<method>(*args)` on every rank (warmup, CUDA graph capture)."""
        return self._run(("call", method, args), lambda: getattr(self.runner, method)(*args))

    def warmup(self) -> None:
        """On CUDA: one-shot symmetric-memory all-reduce for small messages (if it works
        here), then decode CUDA graphs captured on every rank with the collectives inside."""
        if not self.rank_device.startswith("cuda"):
            return
        from ferrum.distributed import symm_mem
        allowed = not symm_mem.allocated_in_process()
        if not allowed:
            log.info("symmetric memory was set up by an earlier engine in this process; TP "
                     "all-reduces use NCCL")
        self.symm_mem = self.call_all("enable_symm_mem_all_reduce", allowed)
        if not self.config.enforce_eager:
            self.call_all("capture_cuda_graphs", self.config.scheduler.max_num_seqs, self.max_model_len)
            self.cuda_graphs = True

    # ---- faults -------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        for r, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                self._closed = True
                err = self._diagnose(None)
                self._broken = str(err)
                raise err

    def health(self) -> str | None:
        """None while every rank is alive and in step, else why not (thread-safe)."""
        if self._broken is not None:
            return self._broken
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {r} died (exit code {p.exitcode})"
        return None

    def _diagnose(self, exc: Exception | None) -> TensorParallelError:
        reported = {}
        if self.error_queue is not None:
            try:
                while True:
                    r, m = self.error_queue.get(timeout=0.5 if not reported else 0.01)
                    reported[r] = m
            except (queue.Empty, OSError, EOFError):
                pass
        if reported:
            r = min(reported)
            return TensorParallelError(f"tensor-parallel rank {r} failed: {reported[r]}")
        for r, p in enumerate(self.procs, start=1):
            p.join(timeout=0.2)
            if not p.is_alive():
                return TensorParallelError(f"tensor-parallel rank {r} died (exit code {p.exitcode})")
        if self.step_counter is not None:
            lag = [r for r in range(1, self.tp) if self.step_counter[r] < self._step_no]
            if lag:
                return TensorParallelError(
                    f"tensor-parallel rank(s) {lag} did not finish step {self._step_no} within "
                    f"{self.config.parallel.step_timeout_s:.0f} s: {exc}")
        return TensorParallelError(f"a tensor-parallel rank failed: {exc}")

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def measure_control_overhead(self, batch: int, blocks_per_seq: int, iters: int = 200) -> float:
        """Seconds per step that rank 0 spends sending a decode step's inputs (token ids and
        block tables of `batch` sequences) to the other ranks."""
        import time
        payload = ("ping", list(range(batch)), [(list(range(blocks_per_seq)), 100)] * batch)
        t0 = time.perf_counter()
        for _ in range(iters):
            self._run(payload, lambda: None)
        return (time.perf_counter() - t0) / iters

    def inject_fault(self, message: str) -> None:
        """Test hook: make every worker rank raise `message` on its next step."""
        self._send(("raise", message))

    def shutdown(self) -> None:
        if getattr(self, "_shut", False):
            return
        self._shut = True
        if not self._closed:
            try:
                self._send(("shutdown",))
            except Exception:
                pass
            for p in self.procs:
                p.join(timeout=5)
        self._closed = True
        self._kill_workers()
        if getattr(self, "runner", None) is not None:
            self.runner.release()
            self.runner = None
        if getattr(self, "channel", None) is not None:
            self.channel.close()
            self.channel = None
        if getattr(self, "error_queue", None) is not None:
            self.error_queue.close()
            self.error_queue = None
        import gc
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        init_tensor_parallel(0, 1, None)
        set_all_reduce_impl(None)


def run_spmd_worker(config: EngineConfig) -> None:
    """Rank > 0 under torchrun: build this rank's shard and follow rank 0's steps until it
    shuts down. Every rank runs the same `ferrum` command; rank 0 runs the engine."""
    from ferrum.config import resolve_device
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device(resolve_device(config.device), int(os.environ.get("LOCAL_RANK", 0)))
    _, control = init_distributed(rank, world, device, None, config.parallel.step_timeout_s)
    runner = build_runner(config, device, progress=False)
    n = agree_num_blocks(local_num_blocks(runner, config, device), control)
    runner.allocate_kv_cache(n, config.cache.block_size)
    worker_loop(runner, lambda: broadcast_message(None, control), config.cache.block_size)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
