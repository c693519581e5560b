"""Start `ferrum serve` in a subprocess on a free loopback port (a module's or the session's), and
the settings of the tiny server that test_server and test_responses share (conftest.py)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

KEY = "sk-test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 768   # room for a tool prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(args: list[str], log_path, timeout_s: float = 120.0):
    """Run `ferrum serve <args> --port <free>`; yields its base URL once /health answers 200
    (pytest.fail with the server's log if it exits or takes longer than timeout_s); stops it
    on exit."""
    with server_process(args, log_path, timeout_s) as (_, url):
        yield url


@contextlib.contextmanager
def server_process(args: list[str], log_path, timeout_s: float = 120.0):
    """`live_server`, yielding (the server's Popen, its base URL): for tests that signal it."""
    port = free_port()
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ferrum.entrypoints.cli", "serve", *args,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"server did not become healthy in {timeout_s:.0f} s")
            time.sleep(0.3)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
