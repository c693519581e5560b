"""TensorParallelExecutor: one model sharded over N ranks (GUIDE section 2); this is rank 0,
the driver, living in the engine process.

Ranks 1..N-1 are `python -m ferrum.executor.tp_worker` processes started here
(executor/tp_launch.py), or, under `torchrun`, processes torchrun started that run
`tp_worker.run_spmd_worker`. Every step rank 0 sends the step's inputs (token ids + block
tables, a few KB) and all ranks run the same sharded forward: each rank writes its own KV
heads into its own paged cache from the first prefill token, so no KV ever moves between ranks
and no rank holds the whole model. Logits are gathered on rank 0, which samples.

Faults: a message that cannot be sent fails only that step (nothing reached the other ranks).
Once a step is sent the ranks must finish it together, so any failure after that breaks the
executor (`health()` says why; every later step raises): a worker that raises reports its
error to rank 0's store and exits; a worker that dies closes its end of the step channel and
breaks the next collective; a rank that hangs trips the TP group's timeout
(`ParallelConfig.step_timeout_s`); rank 0's own forward failing leaves the others inside the
step. Each becomes a TensorParallelError naming the rank. A Ctrl-C is held until the step
ends on every rank (a second one within the step breaks the executor).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrum.config import EngineConfig
from ferrum.distributed.communication import set_all_reduce_impl
from ferrum.distributed.parallel_state import init_tensor_parallel
from ferrum.distributed.shm_broadcast import ShmBroadcast, StepMessageError
from ferrum.errors import TensorParallelError
from ferrum.executor.base import ExecutorBase
from ferrum.executor.tp_launch import WorkerProcesses
from ferrum.executor.tp_rank import (agree_num_blocks, broadcast_message, build_runner,
                                     handles_to_wire, init_distributed, launched_by_torchrun,
                                     local_num_blocks, rank_device)
from ferrum.interfaces import DecodeInput, PrefillInput, PromptLogprobs
from ferrum.loader.base import ModelSource

log = logging.getLogger("ferrum")


def _tp_size_problem(cfg, tp: int, expert_parallel: bool = False) -> str | None:
    """Why `tp` ranks cannot split this model's heads and MLP, or None when they can (for MoE
    layers: the experts under expert parallelism, each expert's FFN otherwise)."""
    kv = cfg.num_key_value_heads
    if tp < 1:
        return f"tensor_parallel_size must be >= 1, got {tp}"
    if cfg.num_attention_heads % tp:
        return f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by tensor_parallel_size ({tp})"
    if kv % tp and tp % kv:
        return f"num_key_value_heads ({kv}) and tensor_parallel_size ({tp}) must divide one another"
    if cfg.intermediate_size % tp and not all(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
        return f"intermediate_size ({cfg.intermediate_size}) is not divisible by tensor_parallel_size ({tp})"
    if cfg.num_experts and expert_parallel and cfg.num_experts % tp:
        return (f"num_experts ({cfg.num_experts}) is not divisible by tensor_parallel_size ({tp}) "
                "(expert parallel)")
    if cfg.num_experts and not expert_parallel and cfg.moe_intermediate_size % tp:
        return (f"moe_intermediate_size ({cfg.moe_intermediate_size}) is not divisible by "
                f"tensor_parallel_size ({tp})")
    if cfg.shared_expert_intermediate_size % tp:
        return (f"shared_expert_intermediate_size ({cfg.shared_expert_intermediate_size}) is not "
                f"divisible by tensor_parallel_size ({tp})")
    return None


def validate_tp_sizes(cfg, tp: int, expert_parallel: bool = False) -> None:
    """Raise TensorParallelError naming the size that does not divide over `tp` ranks and
    listing the tensor_parallel_size values that work for this model (`expert_parallel`: as
    ParallelConfig.enable_expert_parallel)."""
    problem = _tp_size_problem(cfg, tp, expert_parallel)
    if problem:
        ok = [n for n in range(1, cfg.num_attention_heads + 1)
              if _tp_size_problem(cfg, n, expert_parallel) is None]
        raise TensorParallelError(f"{problem}; sizes that divide this model: "
                                  f"{', '.join(map(str, ok))}")


@contextlib.contextmanager
def _sigint_held_until_step_end():
    """Hold a Ctrl-C that comes while a step runs until it ends on every rank, then deliver it.

    A KeyboardInterrupt inside rank 0's forward (Python raises it between any two ops) leaves
    the other ranks waiting in a collective that never completes, and the executor is lost; a
    single-device engine survives it. Held until the step's end, it stops the engine between
    steps, as there. A second Ctrl-C within the step is delivered at once (a step that hangs
    can still be left). Only the main thread gets signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):   # SIG_IGN / SIG_DFL / a handler not set from Python
        yield
        return
    held = []

    def hold(signum, frame):
        if held:
            previous(signum, frame)
        held.append(frame)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(signal.SIGINT, held[0])


class TensorParallelExecutor(ExecutorBase):
    """Rank 0 of a TP group of `config.parallel.tensor_parallel_size` ranks (see the module
    docstring); the ModelExecutor contract, as SingleDeviceExecutor. Raises
    TensorParallelError for sizes that do not divide, a rank that fails to start (named, with
    its error) or a start-up longer than `ParallelConfig.startup_timeout_s`."""

    def __init__(self, source: ModelSource, config: EngineConfig, progress: bool = True):
        super().__init__(source, config)
        validate_tp_sizes(self.cfg, self.tp, config.parallel.enable_expert_parallel)
        self.workers: WorkerProcesses | None = None
        self.channel: ShmBroadcast | None = None
        self.store = None
        self.runner = None
        self._closed = False
        self._step_no = 0
        self.spmd = launched_by_torchrun()
        if not self.spmd and dist.is_initialized():
            gc.collect()   # an engine dropped without shutdown() but held in a cycle: __del__
            if dist.is_initialized():
                # torch.distributed has one default group per process: joining it would wait 30 s
                # for ranks that never come, and cleaning up would tear down the other engine's group
                self._shut = True
                raise TensorParallelError(
                    "another tensor-parallel engine is running in this process (one per process: "
                    "torch.distributed has a single process group); shut it down first (llm.shutdown())")
        try:
            if self.spmd:
                self._join_torchrun(config, progress)
            else:
                self._start_workers(config, progress)
        except BaseException:
            self._closed = True
            self.shutdown()   # no worker, process group or TP state left for the next engine
            raise
        # at exit, shut down an engine still alive; by weak reference, so that atexit does not
        # keep a dropped engine (and its workers and process group) alive until then
        ref = weakref.ref(self)
        self._atexit = lambda: (ex := ref()) is not None and ex.shutdown()
        atexit.register(self._atexit)

    def __del__(self):
        # `del llm` without shutdown(): stop the workers and free the process group (a TP=1
        # engine frees its model the same way), else no later TP engine of this process starts
        if hasattr(self, "_closed"):
            self.shutdown()

    @property
    def procs(self) -> list:
        """The worker processes (subprocess.Popen); empty under torchrun."""
        return self.workers.procs if self.workers is not None else []

    def _join_torchrun(self, config: EngineConfig, progress: bool) -> None:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        if rank != 0:   # it would take rank 0's place in the process group and hang
            raise TensorParallelError(
                f"this process is torchrun rank {rank}: only rank 0 builds the engine; the other "
                "ranks follow its steps in ferrum.executor.tp_worker.run_spmd_worker(config) "
                "(the ferrum CLI does this by itself)")
        if world != self.tp:
            raise TensorParallelError(f"torchrun started {world} ranks but tensor_parallel_size is {self.tp}")
        self.rank_device = rank_device(self.device, int(os.environ.get("LOCAL_RANK", 0)))
        _, self.control = init_distributed(0, self.tp, self.rank_device, None,
                                           config.parallel.step_timeout_s,
                                           expert_parallel=config.parallel.enable_expert_parallel)
        self.runner = build_runner(config, self.rank_device, progress)
        self.memory = self.runner.memory_requirements(self.tp)
        self._allocate_kv_cache(agree_num_blocks(local_num_blocks(self.runner, config, self.rank_device),
                                                 self.control))

    def _start_workers(self, config: EngineConfig, progress: bool) -> None:
        """Start ranks 1..N-1 (tp_launch.py) and go through the start-up phases with them:
        joined -> process group -> model loaded (rank 0 loads its own meanwhile, in a thread,
        so that a worker's failure is reported at once) -> KV pool agreed -> ready."""
        par = config.parallel
        self.rank_device = rank_device(self.device, 0)
        self.store = dist.TCPStore("127.0.0.1", 0, self.tp, True, wait_for_workers=False,
                                   timeout=timedelta(seconds=par.startup_timeout_s))
        self.store.set("config", pickle.dumps(config))
        self.channel = ShmBroadcast(self.tp - 1)
        self.workers = WorkerProcesses(self.tp, self.store, f"127.0.0.1:{self.store.port}",
                                       self.channel, par.startup_timeout_s)
        self.workers.wait_phase("joined", "starting (importing ferrum, reading the config)")
        _, self.control = init_distributed(0, self.tp, self.rank_device, None, par.step_timeout_s,
                                           store=self.store, expert_parallel=par.enable_expert_parallel)
        pool = ThreadPoolExecutor(1, thread_name_prefix="ferrum-tp0-load")
        try:
            loading = pool.submit(self._build_runner, config, progress)
            counts = self.workers.wait_phase("num_blocks", "loading the model", loading)
            self.runner = loading.result()
        finally:
            pool.shutdown(wait=False)   # after a worker's failure rank 0 stops waiting for itself
        local = local_num_blocks(self.runner, config, self.rank_device)
        num_blocks = min([local] + [int(c) for c in counts])
        self.store.set("num_blocks", str(num_blocks).encode())
        self._allocate_kv_cache(num_blocks)
        self.workers.wait_phase("ready", "allocating the KV cache")

    def _build_runner(self, config: EngineConfig, progress: bool):
        if self.rank_device.startswith("cuda"):   # the current device is per thread
            torch.cuda.set_device(torch.device(self.rank_device))
        return build_runner(config, self.rank_device, progress)

    # ---- one step on every rank -------------------------------------------------------------
    def _run(self, msg: tuple, local):
        if self._closed:
            raise TensorParallelError(self._broken or "the tensor-parallel executor is shut down")
        self._check_workers()
        with _sigint_held_until_step_end():
            try:
                self._send(msg)
            except StepMessageError:
                raise                    # nothing was sent: the ranks are still in step
            except Exception as e:
                self._break(e)
            except BaseException:
                self._interrupted("sending")  # the other ranks may wait for the rest
                raise
            try:
                out = local()
            except Exception as e:
                self._break(e)
            except BaseException:
                # a second Ctrl-C mid-step: the other ranks may be stuck in a collective
                # waiting for us, so shutdown must not wait for them to read a message
                self._interrupted("running")
                raise
            self._step_no += 1           # before a held Ctrl-C: every rank finished the step
        return out

    def _interrupted(self, doing: str) -> None:
        """Rank 0 left a step half-done (KeyboardInterrupt): the ranks are out of step for
        good, so say so in health() and stop the workers now (they would otherwise wait in a
        collective until the step timeout, then fail with a bare gloo / NCCL timeout)."""
        self._closed = True
        self._broken = (f"rank 0 was interrupted (Ctrl-C) while {doing} step {self._step_no + 1}; "
                        "the other ranks are left inside it, so the executor stops")
        self._kill_workers()

    def _break(self, exc: Exception):
        """The ranks are out of step: mark the executor broken, stop the workers, raise."""
        self._closed = True
        err = self._diagnose(exc)
        self._broken = str(err)
        self._kill_workers()
        raise err from exc

    def _send(self, msg) -> None:
        """Step inputs to ranks 1..N-1: the shared-memory channel when we started them, else
        (torchrun) a broadcast over the gloo control group. Raises StepMessageError before
        sending anything for a message that cannot go."""
        if self.channel is not None:
            self.channel.send(msg, timeout=self.config.parallel.step_timeout_s)
            return
        try:
            pickle.dumps(msg)
        except Exception as e:  # noqa: BLE001 - broadcast_object_list would fail the same way
            raise StepMessageError(f"step message cannot be pickled: {type(e).__name__}: {e}") from e
        broadcast_message(msg, self.control)

    def _prefill(self, inp: PrefillInput) -> tuple[torch.Tensor, PromptLogprobs | None]:
        args = (inp.token_ids, inp.kv, inp.prompt_logprob_targets, inp.num_top_logprobs)
        return self._run(("prefill", inp.token_ids, handles_to_wire(inp.kv),
                          inp.prompt_logprob_targets, inp.num_top_logprobs),
                         lambda: self.runner.prefill(*args))

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
        here), a full-budget prefill chunk's kernels compiled (`warmup_prefill`), then decode
        and short-prefill CUDA graphs captured on every rank with the collectives inside."""
        if not self.rank_device.startswith("cuda"):
            return
        from ferrum.distributed import symm_mem
        allowed = not symm_mem.allocated_in_process()
        if not allowed:
            log.info("symmetric memory was set up by an earlier engine in this process; TP "
                     "all-reduces use NCCL")
        self.symm_mem = self.call_all("enable_symm_mem_all_reduce", allowed)
        s = self.config.scheduler
        self.call_all("warmup_prefill", min(s.max_num_batched_tokens, self.max_model_len))
        if not self.config.enforce_eager:
            self.call_all("capture_cuda_graphs", s.max_num_seqs, self.max_model_len, s.max_num_batched_tokens)
            self.cuda_graphs = True

    # ---- faults -------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        if self.workers is not None and self.workers.first_dead() is not None:
            self._break(RuntimeError("a worker rank is not running"))

    def health(self) -> str | None:
        """None while every rank is alive and in step, else why not (thread-safe)."""
        if self._broken is not None:
            return self._broken
        dead = self.workers.first_dead() if self.workers is not None else None
        if dead is not None:
            return f"tensor-parallel rank {dead} {self.workers.failure(dead)}"
        return None

    def _diagnose(self, exc: Exception) -> TensorParallelError:
        """Name the rank behind a failed step: a worker's reported error or exit first (given
        up to 0.5 s to arrive), then a worker that did not finish the step (a timeout), else
        rank 0's own error."""
        w = self.workers
        if w is not None:
            for _ in range(10):
                failed = [r for r in range(1, self.tp)
                          if w.reported_error(r) is not None or w.procs[r - 1].poll() is not None]
                if failed:
                    r = failed[0]
                    return TensorParallelError(f"tensor-parallel rank {r} failed: {w.failure(r)}")
                time.sleep(0.05)
        text = f"{type(exc).__name__}: {exc}"
        if self.channel is not None and ("timed out" in text.lower() or isinstance(exc, TimeoutError)):
            lag = [r for r in range(1, self.tp) if self.channel.steps_done(r - 1) < self._step_no]
            if lag:
                return TensorParallelError(
                    f"tensor-parallel rank(s) {lag} did not finish step {self._step_no} within "
                    f"{self.config.parallel.step_timeout_s:g} s: {text}")
        if self.spmd:
            return TensorParallelError(f"a tensor-parallel rank failed: {text}")
        return TensorParallelError(f"tensor-parallel rank 0 failed: {text}; the other ranks "
                                   "are left inside the step, so the executor stops")

    def _kill_workers(self) -> None:
        if self.workers is not None:
            self.workers.kill()

    def inject_fault(self, message: str) -> None:
        """Test hook: make every worker rank raise `message` on its next step."""
        self._send(("raise", message))

    def shutdown(self) -> None:
        """Tell the workers to stop (unless broken), then kill what is left, free the runner,
        the channel, the store and the process group; idempotent (also run at exit)."""
        if getattr(self, "_shut", False):
            return
        self._shut = True
        if hasattr(self, "_atexit"):
            atexit.unregister(self._atexit)
        if not self._closed:
            try:
                self._send(("shutdown",))
            except Exception:  # noqa: BLE001 - a worker may be gone already
                pass
            if self.workers is not None:
                self.workers.join(5)
        self._closed = True
        self._kill_workers()
        if self.runner is not None:
            self.runner.release()
            self.runner = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.store = None      # closes rank 0's TCPStore server
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - not initialized, or already torn down
            pass
        init_tensor_parallel(0, 1, None)
        set_all_reduce_impl(None)
