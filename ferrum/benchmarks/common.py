"""Shared pieces of `ferrum bench latency | throughput`: the record of where and how a
benchmark ran (command, date, hardware, load and the other busy processes), memory read
bandwidth for MBU, random token-id prompts, thread setup, and loading the same weights into HF
transformers for a baseline. (torch is imported inside the functions that use it, so that
building the CLI parser does not load it.)"""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def add_common_args(p) -> None:
    """Add --out and --seed to the benchmark parser p (--threads is an engine flag)."""
    p.add_argument("--out", default=None, help="write the results as JSON to this file (default: print only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


_LOAD_AT_START: list[float] | None = None
_BUSY_AT_START: list[dict] = []


def setup_threads(threads: int | None) -> int:
    """Note the load average at the start, and give this process the engine's CPU threads
    (`threads`, None: the engine default; ferrum/executor/threads.py) so a baseline run here
    uses as many as the engine. Returns the count."""
    global _LOAD_AT_START, _BUSY_AT_START
    from ferrum.executor.threads import set_threads
    _LOAD_AT_START = load_average()
    _BUSY_AT_START = busy_processes()
    return set_threads(threads, warn=False)


def cpu_model() -> str:
    """The CPU model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The 1/5/15-minute load averages, rounded; None where unavailable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def git_commit() -> str | None:
    """The short commit of ferrum's checkout, None outside git."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


def _proc_text(pid: int, name: str) -> str:
    """/proc/<pid>/<name> as one line (NULs as spaces), at most 100 characters; "" if gone."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return ""


def busy_processes(interval_s: float = 0.5, min_share: float = 0.2) -> list[dict]:
    """Other processes using at least `min_share` of a core over the next `interval_s`
    seconds (Linux /proc; [] elsewhere), busiest first: [{"pid", "cpu" (cores), "command"}]."""
    def cpu_ticks() -> dict[int, int]:
        ticks = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ticks[int(pid)] = int(fields[11]) + int(fields[12])   # utime + stime
            except (OSError, IndexError, ValueError):
                pass
        return ticks
    if not os.path.isdir("/proc"):
        return []
    hz = os.sysconf("SC_CLK_TCK")
    before = cpu_ticks()
    time.sleep(interval_s)
    after = cpu_ticks()
    busy = []
    for pid, t in after.items():
        share = (t - before.get(pid, t)) / hz / interval_s
        if share >= min_share:
            cmd = _proc_text(pid, "cmdline") or _proc_text(pid, "comm")  # comm: kernel threads
            busy.append({"pid": pid, "cpu": round(share, 2), "command": cmd or "?"})
    return sorted(busy, key=lambda b: -b["cpu"])


def load_note(device: str, busy_at_end: list[dict]) -> str | None:
    """A sentence when other work shared the CPU during a run: a 1-min load average above
    half the cores before it started (its own work is not in that figure yet), or other
    processes busy at its start (`setup_threads`) or end (`busy_at_end`); else None."""
    cores = os.cpu_count() or 1
    load = _LOAD_AT_START[0] if _LOAD_AT_START else 0.0
    busy = {b["pid"]: b for b in _BUSY_AT_START + busy_at_end}.values()
    if device != "cpu" or (not busy and load <= cores / 2):
        return None
    others = "; ".join(f"{b['command'][:60]} ({b['cpu']:.1f} cores)"
                       for b in sorted(busy, key=lambda b: -b["cpu"])[:3]) or "none seen"
    return (f"the machine was loaded: 1-min load average {load:.1f} on {cores} cores before the "
            f"run; other busy processes: {others}. CPU figures are then pessimistic and noisy")


def hardware(device: str) -> dict:
    """CPU model / cores / threads, GPU name, versions, and the load average now."""
    import torch
    hw = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
          "device": device, "load_average_1_5_15min_at_start": _LOAD_AT_START,
          "load_average_1_5_15min_at_end": load_average(),
          "python": platform.python_version(), "torch": torch.__version__}
    if device == "cpu":
        hw["load_note"] = ("load average above the core count means other jobs shared the cores "
                           "during the run (CPU numbers are then pessimistic and noisy)")
    if device.startswith("cuda") and torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(torch.device(device))
        hw["gpu_count"] = torch.cuda.device_count()
    try:
        import transformers
        hw["transformers"] = transformers.__version__
    except ImportError:
        pass
    return hw


def record(kind: str, args, device: str, results: dict) -> dict:
    """The JSON record: exact command, UTC date, git commit, hardware (with load), results."""
    argv = getattr(args, "_argv", None) or sys.argv[1:]
    return {"benchmark": kind, "command": "ferrum " + " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "hardware": hardware(device), **results}


def write_json(path: str | None, rec: dict) -> None:
    """Write rec as indented JSON to path (creating folders); nothing when path is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


def measure_read_bandwidth(device: str, nbytes: int, reps: int = 3) -> float:
    """Memory read bandwidth in GB/s (1e9 bytes/s): best of `reps` reductions (torch.sum) over
    a float32 buffer of `nbytes`, the size of the weights a decode step reads, so both see the
    same cache level. Uses the current torch threads."""
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


def decode_weight_bytes(mem, cfg, dtype: torch.dtype) -> int:
    """Weight bytes one rank reads per decode step: `MemoryRequirements.param_bytes` minus the
    input-embedding table when it is not tied to the LM head (a lookup reads only the batch's
    rows; a tied table is read in full by the LM head)."""
    import torch
    if cfg.tie_word_embeddings:
        return mem.param_bytes
    e = torch.finfo(dtype).bits // 8
    rows = -(-cfg.vocab_size // mem.tensor_parallel_size)
    return mem.param_bytes - rows * cfg.hidden_size * e


def random_prompts(n: int, lengths: list[int] | int, vocab_size: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids in [vocab_size // 10, vocab_size) (away from the special
    tokens at the start of most vocabularies)."""
    rng = random.Random(seed)
    if isinstance(lengths, int):
        lengths = [lengths] * n
    lo = min(vocab_size // 10, vocab_size - 1)
    return [[rng.randrange(lo, vocab_size) for _ in range(k)] for k in lengths]


def load_hf_model(source, dtype: torch.dtype, device: str):
    """The same weights in HF transformers: `from_pretrained` for a HF folder, `gguf_file=` for
    a GGUF (HF dequantizes it; needs `accelerate`), `from_config` + ferrum's loader for a GGUF
    when that is unavailable, and `from_config` (random weights) for dummy models."""
    import transformers
    path = source.path
    if source.fmt == "safetensors" and path:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    elif source.fmt == "gguf" and path:
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        except (ImportError, ValueError) as e:   # e.g. accelerate missing
            print(f"HF cannot load the GGUF itself ({e}); loading ferrum's dequantized tensors into it")
            m = _hf_from_ferrum_weights(source, dtype)
    else:
        m = _hf_from_config(source.config, dtype)
    m.generation_config.eos_token_id = None      # never stop early: time exactly output_len tokens
    m.generation_config.pad_token_id = 0
    return m.to(device).eval()


def _hf_config(cfg):
    import transformers
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
              num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
              max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
              rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.rope_scaling:
        kw["rope_scaling"] = dict(cfg.rope_scaling)
    name = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[cfg.family]
    return getattr(transformers, name)(**kw)


def _hf_from_config(cfg, dtype):
    import transformers
    return transformers.AutoModelForCausalLM.from_config(_hf_config(cfg), dtype=dtype)


def _hf_from_ferrum_weights(source, dtype):
    m = _hf_from_config(source.config, dtype)
    ws = source.weights()
    sd = {n: ws.get(n).load() for n in ws.names()}
    missing, _ = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and source.config.tie_word_embeddings)]
    if missing:
        raise RuntimeError(f"HF model lacks weights for {missing[:5]}")
    return m


def llm_from_config(config):
    """An offline `LLM` over an EngineConfig built from the CLI flags."""
    from ferrum.engine.llm_engine import LLMEngine
    from ferrum.entrypoints.llm import LLM
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(config, progress=False)
    llm.tokenizer = llm.engine.tokenizer
    return llm


def fmt_ratio(a: float | None, b: float | None) -> str:
    """a / b as "1.23x", "n/a" when either is missing or zero."""
    return f"{a / b:.2f}x" if a and b else "n/a"
