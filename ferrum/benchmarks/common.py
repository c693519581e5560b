"""Shared pieces of `ferrum bench`: the record of where and how a benchmark ran (command, date,
commit, hardware, load and the other busy processes, software versions, environment), random
token-id prompts, thread setup, and loading the same weights into HF transformers for a
baseline. (MBU: `mbu`; peers: `peers`. torch is imported inside the functions that use it, so
that building the CLI parser does not load it.)"""
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


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA; nothing to wait for on CPU), before reading a
    clock."""
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


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
    """$FERRUM_GIT_COMMIT when set (a copied tree, e.g. on a GPU machine, may carry a stale
    .git: on the H200 run of 2026-12-01 it named 468f3b6 for c8b4a13); else the short commit
    of ferrum's checkout; else None."""
    if os.environ.get("FERRUM_GIT_COMMIT"):
        return os.environ["FERRUM_GIT_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except Exception:
        commit = ""
    return commit or None


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
    """CPU model / cores / threads, GPU name and count, and the load average now (versions:
    `software_versions`)."""
    import torch
    hw = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
          "device": device, "load_average_1_5_15min_at_start": _LOAD_AT_START,
          "load_average_1_5_15min_at_end": load_average()}
    if device == "cpu":
        hw["load_note"] = ("load average above the core count means other jobs shared the cores "
                           "during the run (CPU numbers are then pessimistic and noisy)")
    if device.startswith("cuda") and torch.cuda.is_available():
        hw["gpu"] = torch.cuda.get_device_name(torch.device(device))
        hw["gpu_count"] = torch.cuda.device_count()
    return hw


# Environment variables that change what a run measures: ferrum's switches, NCCL / symmetric
# memory / NVSHMEM settings, the visible devices, thread counts, and the peers' switches.
_ENV_PREFIXES = ("FERRUM_", "NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "CUDA_VISIBLE_DEVICES",
                 "CUDA_LAUNCH_BLOCKING", "TRITON_", "OMP_NUM_THREADS", "VLLM_", "PYTORCH_")


def environment_vars() -> dict[str, str]:
    """The set environment variables whose names start with one of `_ENV_PREFIXES`, sorted."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def software_versions() -> dict:
    """Versions that change the figures: python, torch, CUDA (torch's build), NCCL, triton,
    transformers; a missing package is left out."""
    import torch
    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:   # a build without NCCL
            pass
    for name in ("triton", "transformers"):
        try:
            v[name] = __import__(name).__version__
        except ImportError:
            pass
    return v


def record(kind: str, args, device: str, results: dict) -> dict:
    """The JSON record: exact command, UTC date, git commit, hardware (with load), software
    versions, the environment variables that matter (`environment_vars`), results."""
    argv = getattr(args, "_argv", None)   # set by the CLI; a script's record quotes its own argv
    command = "ferrum " + " ".join(argv) if argv is not None else " ".join([sys.executable] + sys.argv)
    return {"benchmark": kind, "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": git_commit(), "hardware": hardware(device), "software": software_versions(),
            "environment": environment_vars(), **results}


def write_json(path: str | None, rec: dict) -> None:
    """Write rec as indented JSON to path (creating folders); nothing when path is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


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
    elif source.fmt == "dummy" and path:   # the config.json itself: every family transformers knows
        import json
        with open(path) as f:
            d = json.load(f)
        cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
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
    names = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
    if cfg.family not in names:
        from ferrum.errors import UnsupportedModelError
        raise UnsupportedModelError(f"no HF reference for {cfg.architecture} built from ferrum's "
                                    "config; load the model from an HF folder or GGUF instead")
    return getattr(transformers, names[cfg.family])(**kw)


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
