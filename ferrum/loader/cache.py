"""ferrum's files on disk: `$FERRUM_HOME` (default `~/.cache/ferrum`) holds the model store
(`models/`, see ferrum/model_store.py) and conversion caches (`gguf/<key>/`, see
ferrum/loader/gguf.py), each keyed by `file_key` of the file it was made from.

A cache entry is built once, by one process (`exclusive` holds a lock file while it builds;
others wait, then find it ready), into a temporary folder renamed into place, so a reader
never sees a half-written entry.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile

from ferrum.errors import StorageError


def ferrum_home() -> str:
    """`$FERRUM_HOME`, else `~/.cache/ferrum` (read on every call)."""
    return os.environ.get("FERRUM_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ferrum")


def make_dirs(path: str) -> None:
    """os.makedirs(path, exist_ok=True), raising StorageError that names the folder and
    $FERRUM_HOME instead of an OSError (a FERRUM_HOME that is a file, read-only or full)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create the folder {path} ({e.strerror or e}); ferrum keeps its "
                           f"files under $FERRUM_HOME ({ferrum_home()})") from e


def file_key(path: str, sample: int = 1 << 20) -> str:
    """A cheap identity of a file's contents: sha256 of its size, mtime (ns) and first and last
    `sample` bytes, 24 hex digits. Rewriting the file changes its mtime, so the key changes;
    a copy with a new mtime gets a new key (and a new cache entry)."""
    stat = os.stat(path)
    h = hashlib.sha256(f"{stat.st_size} {stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(sample))
        f.seek(max(0, stat.st_size - sample))
        h.update(f.read(sample))
    return h.hexdigest()[:24]


@contextlib.contextmanager
def exclusive(path: str):
    """Hold an exclusive lock on `path + ".lock"` (created if missing; POSIX flock, released
    when the process dies) for the duration."""
    make_dirs(os.path.dirname(path) or ".")
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def staged_file(path: str):
    """Yields a temporary path next to `path`; when the block succeeds the file there is
    renamed to `path` (atomic on one filesystem), else it is removed."""
    folder = os.path.dirname(path) or "."
    make_dirs(folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def staged_folder(path: str):
    """Like `staged_file` for a folder: yields an empty temporary folder next to `path`,
    renamed to `path` when the block succeeds (replacing an older one), else removed."""
    parent = os.path.dirname(path) or "."
    make_dirs(parent)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
    try:
        yield tmp
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
