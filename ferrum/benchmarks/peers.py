"""Peer engines in the same `ferrum bench` invocation: vLLM and gpt-fast through their own
drivers (`vllm_bench.py`, `gptfast/peer_bench.py` in the folder `--peers-dir` names; their code
is not part of ferrum and is never committed here), each run as a subprocess with its own
environment, in its own session (process group), killed as a group when it ends so that
workers it left behind free the GPU before the next run.

A driver prints one line `<MARKER> {json}` (VLLMPEER / GPTFAST); `run_peer` returns that JSON,
or {"error": ..., "log_tail": ...} when the driver failed, timed out or printed no result: a
peer that cannot run never stops ferrum's own figures.

Ratios (`ratio`): every `<figure>_vs_<peer>` is ferrum's advantage, > 1 when ferrum is ahead:
ferrum / peer for rates (tok/s), peer / ferrum for times (TTFT).
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

PEERS = ("vllm", "gpt-fast")
_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", "configs")


def add_peer_args(p) -> None:
    """--peers, --peers-dir, --peer-env, --peer-timeout on the benchmark parser p."""
    g = p.add_argument_group("peers (side by side in the same invocation)")
    g.add_argument("--peers", nargs="*", default=None, choices=PEERS,
                   help="peer engines to run after ferrum, on the same shapes (default: none)")
    g.add_argument("--peers-dir", default=os.environ.get("FERRUM_PEERS_DIR", "../shared/peers"),
                   help="folder with vllm_bench.py and gptfast/peer_bench.py, $FERRUM_PEERS_DIR when set "
                        "(default: %(default)s)")
    g.add_argument("--peer-env", action="append", default=None, metavar="KEY=VALUE",
                   help="environment for the peer processes only, e.g. PYTHONPATH=/tmp/vsite (repeatable) "
                        "(default: none)")
    g.add_argument("--peer-timeout", type=float, default=600.0, help="seconds before a peer run is killed")


def parse_env(pairs: list[str]) -> dict[str, str]:
    """["K=V", ...] -> {K: V}. Raises ValueError on an item without '='."""
    env = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--peer-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def _kill_group(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGKILL the process group `proc` leads and wait (<= wait_s) until no member is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def free_cuda_cache() -> None:
    """Hand this process's cached CUDA memory back (a shut-down engine's blocks stay in torch's
    caching allocator), so that a peer starting next finds the GPU free."""
    import gc
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_peer(argv: list[str], marker: str, env: dict[str, str], timeout_s: float,
             cwd: str | None = None) -> dict:
    """Run argv (a driver) in a new session with os.environ updated by env, after
    `free_cuda_cache`; return the JSON of its `marker` line plus "wall_s" and "command", or
    {"error", "log_tail", "command", "wall_s"}. The process group is killed when the driver
    exits or after timeout_s seconds."""
    free_cuda_cache()
    full_env = {**os.environ, **env}
    command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv)
    print(f"[peer] {command}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, env=full_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f} s"
        finally:
            _kill_group(proc)
        log.seek(0)
        text = log.read()
    wall = time.perf_counter() - t0
    for line in text.splitlines():
        if line.startswith(marker + " "):
            try:
                return {**json.loads(line[len(marker) + 1:]), "wall_s": wall, "command": command}
            except json.JSONDecodeError:
                pass
    tail = "\n".join(text.splitlines()[-30:])
    print(f"[peer] failed ({error or 'no result line'}):\n{tail}", flush=True)
    return {"error": error or f"no {marker} line in the output", "log_tail": tail, "command": command,
            "wall_s": wall}


# vllm_bench.py unchanged, with engine arguments added to its vllm.LLM (a JSON dict, argv[1]):
# the driver has no switch for prefix caching or for the KV cache dtype.
_VLLM_WITH_ENGINE_ARGS = (
    "import json, runpy, sys, vllm\n"
    "extra = json.loads(sys.argv[1])\n"
    "init = vllm.LLM.__init__\n"
    "def with_engine_args(self, *a, **k):\n"
    "    init(self, *a, **{**k, **extra})\n"
    "vllm.LLM.__init__ = with_engine_args\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def run_vllm(args, section: str, tp: int = 1, prompt_len: int | None = None,
             prefix_caching: bool = True) -> dict:
    """vLLM through `<peers_dir>/vllm_bench.py section tp` (sections: latency, throughput,
    nanovllm; prompt_len sets VB_P for latency; prefix_caching=False adds
    enable_prefix_caching=False to its LLM; VB_KV=<dtype> in --peer-env adds
    kv_cache_dtype=<dtype>, which the driver itself ignores, and the result then reports it as
    `kv_cache_dtype`). Its dummy models come from ferrum's benchmarks/configs; a max_model_len
    past the config's is allowed (the 8k TTFT prompt + the driver's 600 tokens); it runs in a
    scratch folder, so its own $OUT files stay out of ours."""
    script = os.path.join(os.path.abspath(args.peers_dir), "vllm_bench.py")
    env = {"PEER_CONFIGS": _CONFIGS, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1", **parse_env(args.peer_env or [])}
    if prompt_len is not None:
        env["VB_P"] = str(prompt_len)
    extra = {} if prefix_caching else {"enable_prefix_caching": False}
    if env.get("VB_KV"):
        extra["kv_cache_dtype"] = env["VB_KV"]
    argv = [sys.executable, "-c", _VLLM_WITH_ENGINE_ARGS, json.dumps(extra), script] if extra \
        else [sys.executable, script]
    with tempfile.TemporaryDirectory() as scratch:
        env["OUT"] = scratch
        result = run_peer(argv + [section, str(tp)], "VLLMPEER", env, args.peer_timeout, cwd=scratch)
    result["prefix_caching"] = prefix_caching
    if "kv_cache_dtype" in extra and "error" not in result:
        result.setdefault("kv_cache_dtype", extra["kv_cache_dtype"])
    return result


def run_gpt_fast(args, tp: int, prompt_len: int, new_tokens: int) -> dict:
    """gpt-fast through `<peers_dir>/gptfast/peer_bench.py` (Llama-3-8B, batch 1, compiled
    decode; TP > 1 under torch.distributed.run)."""
    script = os.path.join(os.path.abspath(args.peers_dir), "gptfast", "peer_bench.py")
    env = {"GF_P": str(prompt_len), "GF_N": str(new_tokens), **parse_env(args.peer_env or [])}
    argv = [sys.executable, script] if tp == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), script]
    with tempfile.TemporaryDirectory() as scratch:
        env["OUT"] = scratch
        return run_peer(argv, "GPTFAST", env, args.peer_timeout, cwd=scratch)


def ratio(ferrum: float | None, peer: float | None, higher_is_better: bool = True) -> float | None:
    """ferrum's advantage over a peer (> 1: ferrum ahead): ferrum / peer for rates, peer /
    ferrum for times; None when either figure is missing or zero."""
    if not ferrum or not peer:
        return None
    return ferrum / peer if higher_is_better else peer / ferrum
