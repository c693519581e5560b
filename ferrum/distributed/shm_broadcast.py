"""Rank 0 -> worker ranks message channel over shared memory, for ranks spawned on one host.

Each step rank 0 sends the step's inputs (token ids, block tables: a few KB) to every other
rank. Through gloo's broadcast that costs two collectives and ~0.7 ms per step on a small
CPU box; here it is one pickle into a shared buffer and one semaphore post per reader.
Readers copy the message out and post `done`, so the writer never overwrites a message that
is still being read. On GPUs a reader first busy-polls a sequence number in the header for a
short window (a decode step arrives every few ms; a semaphore wake-up adds its latency to
every TP step, since rank 0's first all-reduce waits for the last rank to launch), then
blocks on the semaphore, so an idle server does not spin. (Under torchrun, where ranks may be
on other machines, the executor uses the gloo broadcast instead.)
"""
from __future__ import annotations

import pickle
import struct
import time
from multiprocessing import shared_memory

_HEADER = struct.Struct("<qq")  # payload length in bytes, message sequence number


class ShmBroadcast:
    """The writer (rank 0): one shared-memory segment of `size` bytes, a `ready` semaphore per
    reader and one shared `done` semaphore, from the multiprocessing context `ctx`."""

    def __init__(self, ctx, num_readers: int, size: int = 16 << 20):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.name, self.size = self.shm.name, size
        self.ready = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.done = ctx.Semaphore(0)
        self.num_readers = num_readers
        self._outstanding = 0
        self._seq = 0

    def reader(self, index: int) -> "ShmReader":
        """The picklable reader end for worker `index` (0-based among the readers)."""
        return ShmReader(self.name, self.ready[index], self.done)

    def send(self, msg, timeout: float | None = None) -> None:
        """Publish `msg` to every reader. Raises TimeoutError if the previous message was not
        picked up within `timeout` seconds (a reader is dead or hung)."""
        while self._outstanding:
            if not self.done.acquire(timeout=timeout):
                raise TimeoutError("a worker rank did not take the previous step's inputs")
            self._outstanding -= 1
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + _HEADER.size > self.size:
            raise ValueError(f"step message of {len(data)} bytes exceeds the {self.size}-byte channel")
        buf = self.shm.buf
        buf[_HEADER.size:_HEADER.size + len(data)] = data
        self._seq += 1
        _HEADER.pack_into(buf, 0, len(data), self._seq)  # after the payload: pollers see it whole
        for sem in self.ready:
            sem.release()
        self._outstanding = self.num_readers

    def close(self) -> None:
        """Unlink the segment and drop the semaphores (readers must be gone)."""
        try:
            self.shm.close()
            self.shm.unlink()
        except (FileNotFoundError, OSError):
            pass
        # Drop the semaphores now: their finalizers unregister them from the resource tracker,
        # which otherwise warns about "leaked semaphore objects" at exit.
        self.ready, self.done = [], None


class ShmReader:
    """The worker side; picklable (carries the segment name and the semaphores)."""

    def __init__(self, name: str, ready, done, spin_s: float = 0.0):
        self.name, self.ready, self.done = name, ready, done
        self.spin_s = spin_s  # busy-poll window before blocking (0: block at once)
        self.shm = None
        self._seq = 0

    def __getstate__(self):
        return {"name": self.name, "ready": self.ready, "done": self.done, "spin_s": self.spin_s}

    def __setstate__(self, state):
        self.__init__(state["name"], state["ready"], state["done"], state["spin_s"])

    def recv(self):
        """Block until the next message, return it (unpickled) and tell the writer it was
        taken."""
        if self.shm is None:
            # Spawned workers share rank 0's resource tracker, so attaching here registers the
            # same name again (a no-op); rank 0's unlink() at shutdown removes it once.
            self.shm = shared_memory.SharedMemory(name=self.name)
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            buf = self.shm.buf
            while _HEADER.unpack_from(buf, 0)[1] == self._seq and time.perf_counter() < deadline:
                pass
        self.ready.acquire()  # at once if the poll saw the message: the writer posts after it
        n, self._seq = _HEADER.unpack_from(self.shm.buf, 0)
        msg = pickle.loads(self.shm.buf[_HEADER.size:_HEADER.size + n])
        self.done.release()
        return msg
