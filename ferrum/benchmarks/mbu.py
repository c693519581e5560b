"""Model bandwidth utilisation (MBU), defined once for every `ferrum bench` section.

    MBU = bytes one rank reads per decode step / step time / memory bandwidth

Bytes per step (`decode_bytes_per_step`): the weights one rank holds (`MemoryRequirements.
param_bytes`) minus the input-embedding table when it is not tied to the LM head (a lookup
reads only the batch's rows), plus the KV cache the step's attention reads (context tokens of
every sequence x `kv_bytes_per_token`); a throughput run's decode phase reads the sum of its
steps' bytes (`decode_phase_bytes`) in the decode steps' wall time. Two bandwidth denominators,
two columns:

- `mbu` (the headline): over the device's **spec** bandwidth (`SPEC_BANDWIDTH_GBS`, matched on
  the CUDA device name; `--spec-bandwidth-gbs` overrides it). CPUs have no entry: their
  bandwidth depends on the memory channels populated, so on CPU the headline is omitted (None)
  unless the flag gives it.
- `mbu_vs_roofline`: over the read rate measured on this machine in the same run
  (`measure_roofline_gbs`): on CUDA ferrum's batch-1 GEMV on a 28672 x 8192 bf16 matrix (the
  rate a batch-1 decode step can reach; GUIDE section 7: ~4.35 TB/s on H200), on CPU a
  reduction over a buffer the size of the weights.

(MBU as in Databricks' "LLM Inference Performance Engineering: Best Practices", 2023.)
"""
from __future__ import annotations

import re
import time

# (regex on torch.cuda.get_device_name, GB/s = 1e9 bytes/s): vendor datasheet HBM/GDDR
# bandwidth. First match wins, so the specific variants come before the generic name.
SPEC_BANDWIDTH_GBS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 8000.0),
    (r"\bH200\b", 4800.0),            # H200 SXM and NVL, HBM3e
    (r"\bH100\b.*\bPCIe\b", 2000.0),
    (r"\bH100\b.*\bNVL\b", 3900.0),
    (r"\bH100\b", 3350.0),            # H100 SXM5 80GB HBM3
    (r"\bA100\b.*80GB.*PCIe", 1935.0),
    (r"\bA100\b.*80GB", 2039.0),      # A100-SXM4-80GB
    (r"\bA100\b", 1555.0),            # 40GB, SXM4 and PCIe
    (r"\bL40S\b", 864.0),
    (r"\bL4\b", 300.0),
    (r"\bA10G?\b", 600.0),
    (r"RTX 4090", 1008.0),
    (r"RTX 3090\b", 936.0),
    (r"\bT4\b", 320.0),
)

# Shape of the roofline GEMV: Llama-3-8B's gate_up projection [2 x 14336, 4096] is the
# largest decode matrix; GUIDE section 7 quotes the H200 figure for 28672 x 8192.
ROOFLINE_SHAPE = (28672, 8192)


def spec_bandwidth_gbs(device: str, override: float | None = None) -> tuple[float | None, str]:
    """(GB/s, where it came from) for the headline MBU on `device` ("cuda", "cuda:1", "cpu"):
    `override` when given, else the spec-table entry of the CUDA device's name
    (`spec_for_name`), else (None, why)."""
    if override:
        return float(override), "--spec-bandwidth-gbs"
    if not device.startswith("cuda"):
        return None, "CPU: no spec bandwidth (depends on memory channels); pass --spec-bandwidth-gbs"
    import torch
    name = torch.cuda.get_device_name(torch.device(device))
    gbs = spec_for_name(name)
    if gbs is None:
        return None, f"{name} is not in the spec table; pass --spec-bandwidth-gbs"
    return gbs, f"spec sheet of {name} (ferrum.benchmarks.mbu)"


def spec_for_name(device_name: str) -> float | None:
    """The `SPEC_BANDWIDTH_GBS` entry (GB/s) matching a CUDA device name, None if none does."""
    for pattern, gbs in SPEC_BANDWIDTH_GBS:
        if re.search(pattern, device_name):
            return gbs
    return None


def decode_bytes_per_step(mem, cfg, dtype, context_tokens: int = 0) -> int:
    """Bytes one rank reads in a decode step: weights (`MemoryRequirements.param_bytes` `mem`
    minus the untied input-embedding rows of this rank; `cfg`: ModelConfig; dtype: the
    weights' torch dtype) plus `context_tokens` (the sum over the batch of each sequence's
    cached tokens) x mem.kv_bytes_per_token."""
    import torch
    weights = mem.param_bytes
    if not cfg.tie_word_embeddings:
        rows = -(-cfg.vocab_size // mem.tensor_parallel_size)
        weights -= rows * cfg.hidden_size * (torch.finfo(dtype).bits // 8)
    return weights + context_tokens * mem.kv_bytes_per_token


def engine_bytes_per_step(engine, context_tokens: int = 0) -> int:
    """`decode_bytes_per_step` of an LLMEngine's model (its executor's memory needs, config and
    dtype)."""
    ex = engine.executor
    return decode_bytes_per_step(ex.capabilities().memory, engine.model_config, ex.dtype, context_tokens)


def decode_phase_bytes(engine, steps: int, context_tokens: int) -> int:
    """Bytes `steps` decode steps of an LLMEngine read in all, their rows attending to
    `context_tokens` KV tokens summed over the steps: the per-step definition above summed,
    steps x the weights + context_tokens x KV bytes per token (`ferrum bench throughput`)."""
    kv_bytes_per_token = engine.executor.capabilities().memory.kv_bytes_per_token
    return steps * engine_bytes_per_step(engine) + context_tokens * kv_bytes_per_token


def mbu_columns(bytes_per_step: int, step_s: float, spec_gbs: float | None,
                roofline_gbs: float | None) -> dict:
    """{"read_gbs": bytes_per_step / step_s in GB/s, "mbu": over spec_gbs (None without it),
    "mbu_vs_roofline": over roofline_gbs (None without it)}."""
    read = bytes_per_step / step_s / 1e9 if step_s > 0 else 0.0
    return {"read_gbs": read, "mbu": read / spec_gbs if spec_gbs else None,
            "mbu_vs_roofline": read / roofline_gbs if roofline_gbs else None}


def measure_roofline_gbs(device: str, cpu_bytes: int = 256 << 20) -> tuple[float, str]:
    """(GB/s, method): the read rate this device reaches in the run. CUDA: ferrum's batch-1
    Triton GEMV (`ferrum.ops.gemv`, F.linear where it does not apply) over `ROOFLINE_SHAPE`
    bf16 copies rotated so each call reads HBM (> 4x the L2), timed in a CUDA graph; best of 5.
    CPU: `measure_read_bandwidth` over `cpu_bytes` (pass the weight bytes)."""
    if not device.startswith("cuda"):
        return measure_read_bandwidth(device, cpu_bytes), "read benchmark (torch.sum over a buffer the size of the weights)"
    import torch
    from ferrum.ops import linear as linear_op
    n, k = ROOFLINE_SHAPE
    dev = torch.device(device)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20)
    copies = max(2, -(-4 * l2 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)

    def run():
        for w in ws:
            linear_op.linear(x, w)
    ms = cuda_graph_time_ms(run, iters=4)
    ws.clear()
    torch.cuda.empty_cache()
    return n * k * 2 * copies / (ms / 1e3) / 1e9, f"batch-1 GEMV on {n}x{k} bf16 (ferrum.ops.linear), CUDA graph"


def cuda_event_median_us(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median over `iters` calls of fn, each timed alone between two CUDA events, in us (after
    `warmup` untimed calls): a kernel's time with its launch, for probes and tuning sweeps."""
    import statistics

    import torch
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def cuda_graph_time_ms(fn, iters: int = 20, reps: int = 5) -> float:
    """Best over `reps` of (one CUDA graph holding `iters` calls of fn) / iters, in ms (two
    warm-up calls first, on a side stream as graph capture requires)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / iters)
    return best


def measure_read_bandwidth(device: str, nbytes: int, reps: int = 3) -> float:
    """Memory read bandwidth in GB/s: best of `reps` reductions (torch.sum) over a float32
    buffer of `nbytes` (the size of the weights a decode step reads, so both see the same
    cache level), with the current torch threads."""
    import torch
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    buf.sum()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        sync()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9
