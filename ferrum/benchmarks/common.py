"""Shared pieces of `ferrum bench latency | throughput`: the record of where and how a
benchmark ran (command, date, hardware, load), memory bandwidth for MBU, random token-id
prompts, thread setup, and loading the same weights into HF transformers for a baseline."""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

import torch


def add_common_args(p) -> None:
    """Add --out, --threads and --seed to the benchmark parser p."""
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: torch's choice). On shared cores use 1: "
                        "an OpenMP barrier can wait a whole scheduler slice for a busy core")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


_LOAD_AT_START: list[float] | None = None


def setup_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (if given) and note the load average at the start."""
    global _LOAD_AT_START
    _LOAD_AT_START = load_average()
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


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


def hardware(device: str) -> dict:
    """CPU model / cores / threads, GPU name, versions, and the load average now."""
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


def measure_memcpy_bandwidth(device: str, nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Rough device memory bandwidth in GB/s (1e9 bytes/s): best of `reps` copies of a
    `nbytes` buffer, counting bytes read + bytes written. Uses the current torch threads."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best / 1e9


def decode_weight_bytes(mem, cfg, dtype: torch.dtype) -> int:
    """Weight bytes one rank reads per decode step: `MemoryRequirements.param_bytes` minus the
    input-embedding table when it is not tied to the LM head (a lookup reads only the batch's
    rows; a tied table is read in full by the LM head)."""
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
