"""Scratch folders that a process owns while it lives, and the sweep of those whose owner died.

`scratch_folder(parent, prefix)` makes `<parent>/<prefix>XXXX/` holding a file `lock` that its
process flocks until the folder is removed; while the folder is being made, before `lock` is
held, the process flocks the folder itself. The kernel drops a dead process's flocks, so a
killed process leaves a folder whose flocks anyone can take: `remove_stale` removes those (and
ones with no `lock`: their maker died before locking it, or was a ferrum older than this
module), never one whose flock is held.
ferrum pull downloads into `.pull-*` ones (ferrum/model_store.py), the GGUF cache builds its
entries in `.tmp-*` ones (ferrum/loader/cache.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile

_LOCK = "lock"   # in each scratch folder; flocked by its owner while it lives


def same_file(fd: int, path: str) -> bool:
    """Whether `fd` is the file or folder now at `path`."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def remove_unless_locked(path: str) -> bool:
    """Delete `path` (a file, or a folder and all in it) unless a process holds a flock on it or,
    for a folder, on its `lock` file; True when it is gone. Its flocks are taken (LOCK_NB) before
    it is deleted, so whoever waits for one finds it gone. Raises OSError (not FileNotFoundError:
    a missing path is gone) when `path` cannot be opened; what cannot be deleted stays."""
    fds = []
    try:
        for lockable in (path, os.path.join(path, _LOCK)):
            try:
                fds.append(os.open(lockable, os.O_RDONLY))
            except (FileNotFoundError, NotADirectoryError):
                if lockable == path:
                    return True
                continue   # no `lock`: a file, or a folder that is not a scratch folder
            try:
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:   # a live process holds it
                return False
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)
    finally:
        for fd in fds:
            os.close(fd)
    return not os.path.lexists(path)


def remove_stale(parent: str, prefix: str) -> None:
    """Delete the files and folders in `parent` whose names start with `prefix` that no live
    process holds (`remove_unless_locked`). Never raises: what cannot be removed now stays."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    remove_unless_locked(os.path.join(parent, name))


def _make(parent: str, prefix: str) -> tuple[str, int]:
    """A new scratch folder in `parent` and the fd of its flocked `lock`. Raises
    FileNotFoundError when a sweep removed the folder before it was locked."""
    tmp = tempfile.mkdtemp(dir=parent, prefix=prefix)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # waits while a sweep that took it first deletes it
        if not same_file(fd, tmp):
            raise FileNotFoundError(f"{tmp} was removed by a sweep before it was locked")
        lock = os.open(os.path.join(tmp, _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        return tmp, lock
    except BaseException:
        if same_file(fd, tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def scratch_folder(parent: str, prefix: str):
    """Yields a new folder `<parent>/<prefix>XXXX` that this process owns (see the module
    docstring) until it is deleted after the block, failed or not; stale ones of dead processes
    in `parent` are deleted first (`remove_stale`). `parent` is created if missing (it may be
    an empty folder that another process removes). Raises OSError when `parent` is not
    writable."""
    for attempt in range(3):
        remove_stale(parent, prefix)
        try:
            os.makedirs(parent, exist_ok=True)
            tmp, lock = _make(parent, prefix)
            break
        except FileNotFoundError:   # `parent` or the new folder removed meanwhile
            if attempt == 2:
                raise
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
