"""The record of where and how a benchmark ran, written with every `ferrum bench` JSON: exact
command, UTC date, git commit, hardware with the load average at start and end and the other
busy processes, software versions, and the environment variables that matter."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time

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
    """/proc/<pid>/<name> as one line (NULs and any newlines inside arguments, as a `python -c`
    script has, as single spaces), at most 100 characters; "" if gone."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:100]
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
