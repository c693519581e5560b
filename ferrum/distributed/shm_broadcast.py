"""Rank 0 -> worker ranks message channel over shared memory, for ranks on one host.

Each step rank 0 sends the step's inputs (token ids, block tables: a few KB) to every other
rank. Through gloo's broadcast that costs two collectives and ~0.7 ms per step on a small
CPU box; here it is one pickle into a shared buffer and one wake-up per reader. Readers copy
the message out and acknowledge it, so the writer never overwrites a message that is still
being read. On GPUs a reader first busy-polls a sequence number in the header for a short
window (a decode step arrives every few ms; a wake-up adds its latency to every TP step, since
rank 0's first all-reduce waits for the last rank to launch), then blocks, so an idle server
does not spin. (Under torchrun, where ranks may be on other machines, the executor uses the
gloo broadcast instead.)

The buffer is an unnamed file (memfd on Linux, else an unlinked temporary file) and the
wake-ups and acknowledgements are pipes; the workers inherit their descriptors (`pass_fds`).
So the channel works for workers started as plain subprocesses, nothing has a name that could
leak (no resource tracker, no "leaked shared_memory objects" warning, even after SIGKILL), and
a rank that exits closes its pipe ends: the writer gets BrokenPipeError and a reader EOF at
once instead of waiting for a timeout.

Layout: header (payload length, sequence number: two int64), one int64 per reader (steps it
has finished, for diagnosing a hung rank), then the pickled payload.
"""
from __future__ import annotations

import mmap
import os
import pickle
import select
import struct
import tempfile
import time

_HEADER = struct.Struct("<qq")  # payload length in bytes, message sequence number
_COUNTER = struct.Struct("<q")


class StepMessageError(ValueError):
    """A step message that cannot be sent (not picklable, or larger than the channel); raised
    before anything reaches the other ranks, so they stay in step."""


def _unnamed_file(size: int) -> int:
    """A descriptor of a `size`-byte file with no name in any file system."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ferrum-tp-channel", os.MFD_CLOEXEC)
    else:
        fd, path = tempfile.mkstemp(prefix="ferrum-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class ShmBroadcast:
    """The writer (rank 0). num_readers: worker ranks; size: payload bytes at most.

    `reader_spec(i)` / `reader_fds(i)`: what worker i needs (a string for its command line and
    the descriptors to pass it); call `close_reader_ends()` once every worker is started."""

    def __init__(self, num_readers: int, size: int = 16 << 20):
        self.num_readers, self.size = num_readers, size
        self._payload_at = _HEADER.size + _COUNTER.size * num_readers
        self.total = self._payload_at + size
        self.fd = _unnamed_file(self.total)
        self.buf = mmap.mmap(self.fd, self.total)
        self.ready = [os.pipe() for _ in range(num_readers)]   # (read end: reader, write end: us)
        self.done = os.pipe()                                  # (read end: us, write end: readers)
        self._outstanding = 0
        self._seq = 0

    def reader_fds(self, index: int) -> tuple[int, int, int]:
        """Descriptors reader `index` (0-based) inherits: the buffer, its wake-up pipe's read
        end, the acknowledgement pipe's write end."""
        return self.fd, self.ready[index][0], self.done[1]

    def reader_spec(self, index: int) -> str:
        """`ShmReader(spec)` in the worker rebuilds reader `index` from this string."""
        return ",".join(map(str, (*self.reader_fds(index), index, self.num_readers, self.size)))

    def close_reader_ends(self) -> None:
        """Drop our copies of the readers' pipe ends, so that a reader's exit closes them."""
        for r, _ in self.ready:
            _close(r)
        _close(self.done[1])

    def send(self, msg, timeout: float | None = None) -> None:
        """Publish `msg` to every reader. Raises StepMessageError (before anything is sent, so
        the ranks stay in step) for a message that cannot be pickled or is too large;
        TimeoutError if the previous message was not taken within `timeout` seconds (a reader
        is hung); BrokenPipeError if a reader has exited."""
        try:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickling raises many kinds
            raise StepMessageError(f"step message cannot be pickled: {type(e).__name__}: {e}") from e
        if len(data) > self.size:
            raise StepMessageError(f"step message of {len(data)} bytes exceeds the "
                                   f"{self.size}-byte channel")
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._outstanding:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.done[0]], [], [], left)[0]:
                raise TimeoutError("a worker rank did not take the previous step's inputs")
            got = os.read(self.done[0], self._outstanding)
            if not got:
                raise BrokenPipeError("every worker rank has exited")
            self._outstanding -= len(got)
        at = self._payload_at
        self.buf[at:at + len(data)] = data
        self._seq += 1
        _HEADER.pack_into(self.buf, 0, len(data), self._seq)  # after the payload: pollers see it whole
        for _, w in self.ready:
            os.write(w, b"\x01")
        self._outstanding = self.num_readers

    def steps_done(self, index: int) -> int:
        """Steps reader `index` has finished (its `mark_step_done`)."""
        return _COUNTER.unpack_from(self.buf, _HEADER.size + _COUNTER.size * index)[0]

    def close(self) -> None:
        """Close our descriptors and unmap the buffer (the memory goes with the last user)."""
        for fd in [w for _, w in self.ready] + [self.done[0], self.fd]:
            _close(fd)
        try:
            self.buf.close()
        except (BufferError, ValueError):
            pass
        self.ready = []


class ShmReader:
    """The worker side, rebuilt from `ShmBroadcast.reader_spec` in the worker process."""

    def __init__(self, spec: str, spin_s: float = 0.0):
        fd, self.ready, self.done, self.index, num_readers, size = map(int, spec.split(","))
        self._payload_at = _HEADER.size + _COUNTER.size * num_readers
        self.buf = mmap.mmap(fd, self._payload_at + size)
        os.close(fd)
        self.spin_s = spin_s  # busy-poll window before blocking (0: block at once)
        self._seq = 0
        self._steps = 0

    def recv(self):
        """The next message. Raises EOFError when rank 0 has exited."""
        if self.spin_s > 0:
            deadline = time.perf_counter() + self.spin_s
            buf = self.buf
            while _HEADER.unpack_from(buf, 0)[1] == self._seq and time.perf_counter() < deadline:
                pass
        if not os.read(self.ready, 1):  # at once if the poll saw it: the writer posts after it
            raise EOFError("rank 0 closed the step channel")
        n, self._seq = _HEADER.unpack_from(self.buf, 0)
        msg = pickle.loads(self.buf[self._payload_at:self._payload_at + n])
        os.write(self.done, b"\x01")
        return msg

    def mark_step_done(self) -> None:
        """Count one more finished step in this reader's slot (ShmBroadcast.steps_done)."""
        self._steps += 1
        _COUNTER.pack_into(self.buf, _HEADER.size + _COUNTER.size * self.index, self._steps)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
