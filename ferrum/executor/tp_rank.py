"""What every tensor-parallel rank does, rank 0 (the driver in the engine process) and the
worker ranks alike: join the process group, build its shard of the model, size its KV pool;
and the wire format of the step messages rank 0 sends.

Control messages go over a CPU (gloo) group with a long timeout, so an idle server never
times out; model collectives use the TP group (NCCL on CUDA, gloo on CPU) whose timeout is
`ParallelConfig.step_timeout_s`, so a dead or hung rank fails a step instead of hanging it.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrum.config import EngineConfig, resolve_dtype, resolve_max_model_len
from ferrum.distributed.parallel_state import init_tensor_parallel
from ferrum.executor.memory import num_kv_blocks
from ferrum.interfaces import KvCacheHandle

CONTROL_TIMEOUT = timedelta(days=7)


def launched_by_torchrun() -> bool:
    """True in a process that torchrun started as one of several ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                    and int(os.environ["WORLD_SIZE"]) > 1)


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: `cuda:<local_rank>` on CUDA, else cpu."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def init_distributed(rank: int, world: int, device: str, init_method: str | None,
                     step_timeout_s: float, store=None, expert_parallel: bool = False):
    """Creates the default process group (from `store`, else `init_method`, else the env://
    variables torchrun sets) and returns (tp_group, control_group). `expert_parallel`: MoE
    layers built afterwards hold whole experts (ferrum/layers/moe.py)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        kw = {"store": store} if store is not None else {"init_method": init_method or "env://"}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=step_timeout_s), **kw)
    ranks = list(range(world))
    tp_group = dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=step_timeout_s))
    control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
    init_tensor_parallel(rank, world, tp_group, expert_parallel)
    return tp_group, control


def build_runner(config: EngineConfig, device: str, progress: bool):
    """This rank's ModelRunner: its shard of the model (under the TP state in force) on
    `device`, after putting the config's CPU threads and kernel switches in force for the
    calling thread (a worker's main thread; rank 0 loads in a helper thread, its step thread
    is set up by ExecutorBase). Raises what the loader raises."""
    from ferrum.executor.model_runner import ModelRunner
    from ferrum.executor.threads import apply_engine_settings
    from ferrum.loader.resolve import resolve_model
    apply_engine_settings(config)
    source = resolve_model(config.model)
    dtype = resolve_dtype(config.dtype, device)
    return ModelRunner(source, device, dtype, config.load_format, config.seed, progress,
                       config.quantization, config.cache.kv_cache_dtype, config.scheduler.max_model_len)


def local_num_blocks(runner, config: EngineConfig, device: str) -> int:
    """KV blocks this rank's memory holds (every rank then takes the minimum over ranks)."""
    tp = config.parallel.tensor_parallel_size
    mem = runner.memory_requirements(tp)
    s = config.scheduler
    max_len = resolve_max_model_len(runner.cfg, s.max_model_len)
    return num_kv_blocks(mem, config.cache, device, max_len, s.max_num_seqs, s.max_num_batched_tokens)


def agree_num_blocks(n: int, control_group) -> int:
    """Every rank must have the same pool: take the minimum over ranks (torchrun launches;
    spawned workers agree through the start-up store instead)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group)
    return int(t.item())


def broadcast_message(msg, control_group):
    """Rank 0 sends `msg` (any picklable object); other ranks pass None and get it."""
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=control_group)
    return box[0]


def handles_to_wire(kv: list[KvCacheHandle]) -> list[tuple]:
    """KV handles as (block table, num_tokens) pairs for a step message."""
    return [(h.block_table, h.num_tokens) for h in kv]


def handles_from_wire(wire: list[tuple], block_size: int) -> list[KvCacheHandle]:
    """The inverse of handles_to_wire (cache ids are not sent: workers need none)."""
    return [KvCacheHandle("", bt, n, block_size) for bt, n in wire]
