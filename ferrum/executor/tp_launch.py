"""Starting and watching the worker processes of a tensor-parallel engine on one machine.

Each worker rank is `python -m ferrum.executor.tp_worker` started with subprocess (never
multiprocessing's spawn, which re-imports the caller's `__main__`). Rank 0 hosts a TCPStore:
it holds the pickled engine config, and the workers report each start-up phase or their
error under their rank there. While rank 0 waits for a phase it watches the processes, so a
worker that dies is reported at once with its own error (from the store, else the last lines
it wrote to stderr), and a phase that takes longer than `ParallelConfig.startup_timeout_s`
ends the start-up with an error naming the ranks it waits for.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ferrum.errors import TensorParallelError

_POLL_S = 0.05


class WorkerProcesses:
    """Worker ranks 1..world-1 of one engine.

    store: rank 0's TCPStore (already holding `config`); channel: the ShmBroadcast whose
    reader ends the workers inherit; startup_timeout_s: the budget of the whole start-up.
    A worker's stderr is forwarded to ours (prefixed with its rank), its last lines kept for
    error messages."""

    def __init__(self, world: int, store, store_address: str, channel, startup_timeout_s: float):
        self.world, self.store, self.timeout = world, store, startup_timeout_s
        self.deadline = time.monotonic() + startup_timeout_s
        env = dict(os.environ)
        # the workers import the same ferrum as we do, wherever the caller's sys.path found it
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.procs: list[subprocess.Popen] = []
        self.tails: list[collections.deque] = []
        for r in range(1, world):
            cmd = [sys.executable, "-m", "ferrum.executor.tp_worker", "--rank", str(r),
                   "--world-size", str(world), "--store", store_address,
                   "--channel", channel.reader_spec(r - 1), "--startup-timeout", str(startup_timeout_s)]
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    pass_fds=channel.reader_fds(r - 1))
            tail: collections.deque = collections.deque(maxlen=20)
            threading.Thread(target=_forward, args=(proc.stderr, r, tail), daemon=True,
                             name=f"ferrum-tp{r}-stderr").start()
            self.procs.append(proc)
            self.tails.append(tail)
        channel.close_reader_ends()

    def reported_error(self, rank: int) -> str | None:
        """The error worker `rank` reported to the store, if any."""
        key = f"error/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store is gone with its server
            return None

    def failure(self, rank: int) -> str:
        """What is known of why worker `rank` stopped: its reported error, else its exit code
        and the last lines of its stderr."""
        reported = self.reported_error(rank)
        if reported is not None:
            return reported
        time.sleep(_POLL_S)   # let the stderr forwarder catch its last lines
        code = self.procs[rank - 1].poll()
        lines = "; ".join(line.strip() for line in self.tails[rank - 1] if line.strip())
        return f"exited with code {code}" + (f": {lines}" if lines else "")

    def first_dead(self) -> int | None:
        """The lowest rank whose process has exited, or None."""
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return r
        return None

    def wait_phase(self, key: str, phase: str, busy: Future | None = None) -> list[bytes]:
        """Wait until every worker set `<key>/<rank>`; returns the values. Raises
        TensorParallelError at once when a worker reports an error or exits, when `busy` (rank
        0's own work meanwhile) fails, or when the start-up deadline passes."""
        waiting = set(range(1, self.world))
        values: dict[int, bytes] = {}
        while True:
            for r in sorted(waiting):
                if self.store.check([f"{key}/{r}"]):
                    values[r] = self.store.get(f"{key}/{r}")
                    waiting.discard(r)
                elif self.reported_error(r) is not None or self.procs[r - 1].poll() is not None:
                    raise TensorParallelError(
                        f"tensor-parallel rank {r} failed while {phase}: {self.failure(r)}")
            if busy is not None and busy.done():
                busy.result()      # re-raises rank 0's own error
                busy = None
            if not waiting and busy is None:
                return [values[r] for r in range(1, self.world)]
            if time.monotonic() > self.deadline:
                who = f"rank(s) {sorted(waiting)}" if waiting else "rank 0"
                raise TensorParallelError(
                    f"tensor-parallel {who} did not finish {phase} within the start-up timeout "
                    f"of {self.timeout:g} s (ParallelConfig.startup_timeout_s)")
            time.sleep(_POLL_S)

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for each worker to exit by itself."""
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def kill(self) -> None:
        """SIGKILL every worker still running and reap them."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _forward(stream, rank: int, tail: collections.deque) -> None:
    """Copy a worker's stderr to ours line by line, keeping its last lines."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace")
        tail.append(line)
        try:
            sys.stderr.write(f"[TP rank {rank}] {line}")
            sys.stderr.flush()
        except (OSError, ValueError):   # our stderr is closed (interpreter exit)
            pass
    stream.close()
