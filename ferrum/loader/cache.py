"""ferrum's files on disk: `$FERRUM_HOME` (default `~/.cache/ferrum`) holds the model store
(`models/`, see ferrum/model_store.py) and conversion caches (`gguf/<key>/`, see
ferrum/loader/gguf.py), each keyed by `file_key` of the file it was made from.

A cache entry is built once, by one process (`exclusive` holds a lock file while it builds;
others wait, then find it ready), in a `.tmp-*` scratch folder (ferrum/loader/scratch.py) and
renamed into place, so a reader never sees a half-written entry; the scratch folders of killed
builds are removed by the next build beside them. A process that loads an entry marks it in
use until it exits (`use`: a shared flock on the entry's folder), since it reads the entry's
files lazily.

Entries are removed only by `prune`, which a process runs after it writes a new entry: it drops
the entries its `stale` test picks (for GGUF: the file they were made from is gone or changed),
skipping any that another process builds or uses, and the lock files that no process holds
(left by a killed process, or by an older ferrum, which never removed them). A lock file is
deleted only by its holder (`exclusive` and `prune` unlink one while they hold it), and whoever
locks one checks that it is still the file at that path (`_lock`), so two processes never both
hold "the" lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil

from ferrum.errors import StorageError
from ferrum.loader.scratch import remove_unless_locked, same_file, scratch_folder


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


def _lock(path: str, how: int) -> int:
    """An fd of `path + ".lock"` (created if missing) flocked with `how` (LOCK_NB: raises
    BlockingIOError when held). A holder may unlink the file before it lets go (`_unlock`); a
    process that was waiting then holds a file no longer at that path, so it tries again."""
    while True:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, how)
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path + ".lock"):
            return fd
        os.close(fd)


def _unlock(path: str, fd: int) -> None:
    """Remove `path + ".lock"`, which `fd` holds exclusively (so it is ours to delete: nobody
    else can be holding the file at that path), then release it."""
    with contextlib.suppress(OSError):   # a read-only folder: the file stays, harmless
        os.remove(path + ".lock")
    os.close(fd)


@contextlib.contextmanager
def exclusive(path: str):
    """Hold an exclusive lock on `path + ".lock"` (POSIX flock, released when the process dies)
    for the duration; the lock file is removed when the block ends, failed or not."""
    make_dirs(os.path.dirname(path) or ".")
    fd = _lock(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        _unlock(path, fd)


_in_use: dict[str, int] = {}   # entry folder -> its fd, share-locked by `use` until exit


def use(folder: str) -> bool:
    """Mark the entry `folder` in use by this process until it exits (a shared flock on the
    folder, which `remove_if_unused` cannot take): its tokenizer and weights are read later,
    by path. False when the folder is gone, or was replaced while this waited."""
    if folder in _in_use:
        return True
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    fcntl.flock(fd, fcntl.LOCK_SH)   # waits only while a `remove_if_unused` deletes it
    if not same_file(fd, folder):
        os.close(fd)
        return False
    _in_use[folder] = fd
    return True


def remove_if_unused(folder: str) -> bool:
    """Delete the entry `folder` unless a process uses it (`use`); True when it is gone. The
    caller holds `exclusive(folder)`, so nobody is building it. Raises OSError when the folder
    cannot be opened (no permission)."""
    return remove_unless_locked(folder)


def prune(root: str, stale) -> None:
    """After writing an entry under `root`: delete the entries `stale(folder)` picks that no
    process builds or uses, and the lock files no process holds. Never raises: a cache that
    cannot be tidied (permissions, a full disk) still serves."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if name.endswith(".lock"):
                    path = path[:-len(".lock")]
                elif name.startswith(".") or not os.path.isdir(path) or not stale(path):
                    continue   # "."-names: temporary folders of builds under way
                try:
                    fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:   # being built, or a lock a live process holds
                    continue
                try:
                    if not name.endswith(".lock"):
                        remove_if_unused(path)
                finally:
                    _unlock(path, fd)


_STAGING = ".tmp-"   # prefix of the scratch folders beside an entry or file being written


@contextlib.contextmanager
def staged_file(path: str):
    """Yields the path of a new empty file (mode 0600) in a scratch folder next to `path`; when
    the block succeeds the file is renamed to `path` (atomic on one filesystem). The scratch
    folder is removed either way, and those of killed processes beside it first (see
    ferrum/loader/scratch.py). Raises StorageError when the folder of `path` cannot be made."""
    folder = os.path.dirname(path) or "."
    make_dirs(folder)
    with scratch_folder(folder, _STAGING) as scratch:
        tmp = os.path.join(scratch, os.path.basename(path))
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        yield tmp
        os.replace(tmp, path)


@contextlib.contextmanager
def staged_folder(path: str):
    """Like `staged_file` for a folder: yields an empty folder (mode 0700) in a scratch folder
    next to `path`, renamed to `path` when the block succeeds (replacing an older one)."""
    parent = os.path.dirname(path) or "."
    make_dirs(parent)
    with scratch_folder(parent, _STAGING) as scratch:
        tmp = os.path.join(scratch, os.path.basename(path))
        os.mkdir(tmp, 0o700)
        yield tmp
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
