"""Shared pieces of `ferrum bench` and the GPU scripts in benchmarks/: the --out/--seed flags,
device sync, random token-id prompts, building an LLM (from CLI flags or a dummy config) and
running a script's sections. (Where and how a run happened: `run_record`; the HF baseline:
`hf_baseline`; MBU: `mbu`; peers: `peers`. torch is imported inside the functions that use it,
so that building the CLI parser does not load it.)"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from ferrum.benchmarks.run_record import record, write_json


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a zero count or length fails at parse time, not
    with a traceback after the model has loaded)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def decode_len(text: str) -> int:
    """argparse type of the output length of benchmarks that time decode steps (latency's TPOT,
    sweep's step time): a whole number >= 2, since the first token comes out of the prefill and
    only the second one needs a decode step (1 gave latency a TPOT of the engine's bookkeeping,
    tens of thousands of tok/s and an MBU of 100%, and sweep a traceback after the model loaded)."""
    n = positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 2 (the first token comes from the "
                                         f"prefill; a decode step needs a second one), got {text!r}")
    return n


class MinMax(argparse.Action):
    """argparse action for `nargs=2` MIN MAX: an argparse error when MIN > MAX (a random
    length in [MIN, MAX] would fail with a traceback after the model has loaded)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values[0] > values[1]:
            parser.error(f"{option_string}: MIN ({values[0]}) is larger than MAX ({values[1]})")
        setattr(namespace, self.dest, list(values))


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    import math
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return x


def add_common_args(p) -> None:
    """Add --out and --seed to the benchmark parser p (--threads is an engine flag)."""
    p.add_argument("--out", default=None, help="write the results as JSON to this file (default: print only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA; nothing to wait for on CPU), before reading a
    clock."""
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def cuda_memory(device: str) -> dict | None:
    """This process's device memory on a CUDA `device` (GiB): the card's total, and the peak
    the caching allocator reserved and handed out since start-up (the KV pool, weights and
    CUDA graphs included): the evidence that the pool plan (`executor.memory`) left a step's
    transient tensors room. None elsewhere."""
    if not device.startswith("cuda"):
        return None
    import torch
    dev = torch.device(device)
    return {"total_gib": torch.cuda.mem_get_info(dev)[1] / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30,
            "peak_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30}


def random_prompts(n: int, lengths: list[int] | int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids in [vocab_size // 10, vocab_size) (away from the special
    tokens at the start of most vocabularies)."""
    rng = random.Random(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    lo = min(vocab_size // 10, vocab_size - 1)
    return [[rng.randrange(lo, vocab_size) for _ in range(k)] for k in lengths]


def llm_from_config(config):
    """An offline `LLM` over an EngineConfig built from the CLI flags."""
    from ferrum.entrypoints.llm import LLM
    return LLM.from_config(config)


# ---- helpers of the GPU scripts in benchmarks/ (profile_decode.py, quant_bench.py) ---------------
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "benchmarks", "configs")


def config_path(name: str) -> str:
    """`name` if it is a file, else the checkout's benchmarks/configs/<name>.json (the real
    configs the GPU runs load with dummy weights)."""
    return name if os.path.isfile(name) else os.path.join(CONFIGS_DIR, f"{name}.json")


def dummy_llm(name: str, tp: int = 1, **kw):
    """An offline LLM over random bf16 weights of config `name` (`config_path`), TP size tp;
    kw: more engine options (max_num_seqs, max_model_len, quantization, ...)."""
    from ferrum.entrypoints.llm import LLM
    print(f"  [{time.strftime('%H:%M:%S')}] building {name} tp={tp} {kw}", flush=True)
    return LLM(f"dummy:{config_path(name)}", progress=False, tensor_parallel_size=tp, dtype="bfloat16", **kw)


def release_llm(llm) -> None:
    """Shut an LLM down and hand its cached CUDA memory back (the next engine or a peer needs it)."""
    from ferrum.benchmarks.peers import free_cuda_cache
    llm.shutdown()
    free_cuda_cache()


def save_section(args, name: str, data: dict) -> None:
    """Write `record(name, ...)` of data to <args.out>/<name>.json and print its start."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"{name}.json"), record(name, args, device, data))
    print(f"== {name}: {json.dumps(data)[:2500]}", flush=True)


def run_sections(args, namespace: dict, on_error=None) -> None:
    """Run `namespace["sec_<name>"](args)` for each of args.sections, timing each; a section
    that raises is reported (and passed to on_error(name, exc)) and the others still run, so a
    long GPU call returns every figure it could make."""
    for name in args.sections:
        t = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        try:
            namespace[f"sec_{name}"](args)
        except Exception as e:
            import traceback
            traceback.print_exc()
            if on_error is not None:
                on_error(name, e)
        print(f"[{name} took {time.perf_counter() - t:.1f} s]", flush=True)
