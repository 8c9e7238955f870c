"""Files the course writes and reads back: atomic writes, named errors for corrupt ones, file manifests.

Every state file (the run status, the report sidecars, progress, process records, cached models) is
written to a temporary file in the same folder and renamed over the old one, so a crash or a second
process never leaves half a file. Reading one back either returns its data or says which file is
corrupt and what happens next (rebuilt, ignored): never a bare `JSONDecodeError`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import secrets
import warnings
from pathlib import Path
from typing import Any, Callable


class CorruptStateError(ValueError):
    """A state file exists but cannot be read; the message names it."""


class StorageError(OSError):
    """A file could not be written because its disk is full, over quota or read-only; the message names it."""


_NO_ROOM = {errno.ENOSPC: "its disk is full", errno.EDQUOT: "your disk quota is used up",
            errno.EROFS: "its file system is read-only"}


@contextlib.contextmanager
def storage_errors(path: str | Path, fix: str | None = None):
    """Turn a full disk, a used-up quota or a read-only file system met while writing `path` into a StorageError
    that names it and what to do (`fix`, for a file outside the build folder such as a learner's work/; else how to
    move the build folder); any other OSError passes unchanged."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        what_to_do = fix or ("set COURSE_BUILD_DIR to a writable folder elsewhere" if exc.errno == errno.EROFS else
                             "free some space on it, or set COURSE_BUILD_DIR to a folder on another disk")
        error = StorageError(f"cannot write {path}: {_NO_ROOM[exc.errno]} ({os.strerror(exc.errno)}); "
                             f"{what_to_do}, and run again")
        error.errno = exc.errno          # the message stays as written: no filename, which would reformat it
        raise error from exc


def write_text_atomic(path: str | Path, text: str, *, fix: str | None = None) -> Path:
    """Write `text` to `path` through a temporary file and a rename (readers see old or new, never half).
    The file keeps its mode; a new one gets what `open()` gives (0644 under the usual umask: a generated lab must
    stay readable by the learners a hub copies it for; privacy is the folders' job)."""
    path = Path(path)
    with storage_errors(path, fix):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)      # the umask applies, as for open()
        try:
            with os.fdopen(fd, "w") as f:
                with contextlib.suppress(FileNotFoundError):
                    os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def write_json(path: str | Path, data: Any, *, fix: str | None = None) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n", fix=fix)


def read_json(path: str | Path, default: Any = None, *, what: str = "state file", on_corrupt: str = "warn",
              shape: type | None = None) -> Any:
    """The JSON in `path`; `default` when it does not exist. A corrupt file (not UTF-8, not JSON, or not of
    `shape`, e.g. dict) raises CorruptStateError naming it and what to do (`on_corrupt="raise"`), or warns
    naming it and returns `default` (`"warn"`)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return default
    try:
        data = json.loads(raw.decode("utf-8"))
        if shape is not None and not isinstance(data, shape):
            raise ValueError(f"expected a JSON {'object' if shape is dict else shape.__name__}, "
                             f"found {type(data).__name__}")
        return data
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        message = f"{what} {path} is corrupt ({exc.__class__.__name__}: {exc})"
        if on_corrupt == "raise":
            raise CorruptStateError(message + "; delete it or restore it from git") from None
        warnings.warn(f"{message}; ignoring it (it is rewritten on the next run)", stacklevel=2)
        return default


@contextlib.contextmanager
def locked(path: str | Path, fix: str | None = None):
    """An exclusive lock on `path`.lock for a read-modify-write shared by several processes (`fix`: as for
    storage_errors)."""
    lock = Path(f"{path}.lock")
    with storage_errors(lock, fix):
        lock.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock, "a")
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def update_json(path: str | Path, change: Callable[[Any], Any], default: Any = None, *, what: str = "state file",
                fix: str | None = None) -> Any:
    """Read `path` (a corrupt file counts as `default`, with a warning), apply `change`, write it back
    atomically, under a lock (`fix`: what to do on a full disk, as for storage_errors). Returns what was written."""
    with locked(path, fix):
        data = read_json(path, default, what=what)
        data = change(data)
        write_json(path, data, fix=fix)
        return data


# --- manifests: a folder's files with their sizes and hashes -------------------------------------

MANIFEST = "MANIFEST.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str | Path) -> Path:
    """Record the size and SHA-256 of every file in `folder` (not in subfolders) in MANIFEST.json."""
    folder = Path(folder)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    return write_json(folder / MANIFEST, files)


def verify_manifest(folder: str | Path) -> str | None:
    """None when every file of `folder`'s manifest is there with its size and hash; otherwise what is
    wrong (no manifest, a missing, truncated or changed file), in words."""
    folder = Path(folder)
    files = read_json(folder / MANIFEST, None, what="manifest")
    if not isinstance(files, dict) or not files:
        return f"{folder / MANIFEST} is missing or unreadable"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected.get("bytes"):
            return f"{path} has {size:,} bytes, its manifest says {expected.get('bytes'):,} (truncated or replaced)"
        if _sha256(path) != expected.get("sha256"):
            return f"{path} does not match the SHA-256 in its manifest"
    return None
