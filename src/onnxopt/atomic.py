"""Atomic file writes: every file onnxopt writes goes through ``replacing``.

The bytes go to a temporary file ``.<name>.<random>.tmp`` in the target's folder, which is flushed,
fsynced and renamed over the target (``os.replace``), then the folder is fsynced: a crash or a full disk
leaves the old file or the new one, never a torn mix. A failed write removes its temporary file. A writer
holds an ``flock`` on its temporary file, so the temporary files of killed writers (their lock died with
them) are removed by the next write to the same target, and by ``remove_stale`` on a whole folder (a resumed
run's checkpoint folder: its next write may never come).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
from collections.abc import Iterator
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # NOTE: no flock (Windows): writes stay atomic, stale temporary files stay
    fcntl = None

__all__ = ["replacing", "write", "save_figure", "check_writable", "remove_stale"]


def _temp_pattern(path: str) -> str:
    return os.path.join(os.path.dirname(path), f".{glob.escape(os.path.basename(path))}.*.tmp")


def _locked(fd: int) -> bool:
    """Takes the writer's lock on ``fd``; False when another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _remove_stale(path: str) -> None:
    """Removes the temporary files of writes to ``path`` whose writer died (nobody holds their lock)."""
    _remove_unlocked(glob.glob(_temp_pattern(path)))


def remove_stale(folder: str | os.PathLike) -> list[str]:
    """Removes the temporary files that killed writes left in ``folder`` (``.<name>.<8 hex digits>.tmp`` whose
    lock nobody holds); returns their names."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    temps = [n for n in os.listdir(folder) if re.fullmatch(r"\..+\.[0-9a-f]{8}\.tmp", n)]
    return [os.path.basename(t) for t in _remove_unlocked([os.path.join(folder, n) for n in temps])]


def _remove_unlocked(temps: list[str]) -> list[str]:
    if fcntl is None:
        return []
    removed = []
    for tmp in temps:
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _locked(fd):
                os.remove(tmp)
                removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _open_temp(path: str) -> tuple[int, str]:
    while True:
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # NOTE: the umask applies, as for open()
        # NOTE: another write's cleanup may remove the file between its creation and the lock: then take another
        if _locked(fd) and os.fstat(fd).st_nlink:
            return fd, tmp
        os.close(fd)


def _fsync_dir(folder: str) -> None:
    """Makes the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; it replaces ``path`` when the block ends without an
    exception, and is removed otherwise (``path`` then keeps its old content)."""
    path = os.path.abspath(os.fspath(path))
    _remove_stale(path)
    fd, tmp = _open_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if os.path.exists(path):  # NOTE: the new file keeps the old one's permissions, as open("w") would
                os.chmod(tmp, os.stat(path).st_mode & 0o7777)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def write(path: str | os.PathLike, data: bytes | str) -> None:
    """Writes ``data`` (text as UTF-8) to ``path`` atomically."""
    with replacing(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def save_figure(fig, path: str | os.PathLike, **kwargs) -> None:
    """``fig.savefig(path, **kwargs)`` (matplotlib), atomically; the format comes from ``path``'s extension."""
    with replacing(path) as f:
        fig.savefig(f, format=os.path.splitext(os.fspath(path))[1][1:] or None, **kwargs)


def check_writable(path: str | os.PathLike, what: str, folder: bool = False, error: type = OSError) -> None:
    """Raises ``error`` naming ``what`` and ``path`` unless a file (``folder=True``: files in the folder)
    can be written there, by creating and removing a temporary file where the writes will go."""
    path = os.path.abspath(os.fspath(path))
    if folder and os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{what}: expected a folder (or a path to create one), got {path!r}, an existing file")
    if not folder and os.path.isdir(path):
        raise error(f"{what}: expected a file path, got {path!r}, an existing folder")
    where = path if folder else os.path.dirname(path)
    if not folder and not os.path.exists(where):
        raise error(f"{what}: expected a path in an existing folder, got {path!r} ({where!r} does not exist)")
    while not os.path.exists(where):  # NOTE: a folder (checkpoints, demo) is created with its parents
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise error(f"{what}: expected a path inside a folder, got {path!r} ({where!r} is a file)")
    try:
        fd, tmp = _open_temp(os.path.join(where, "onnxopt-probe"))
    except OSError as exc:
        raise error(f"{what}: cannot write to {path!r} ({exc.strerror or exc}: {where!r})") from exc
    os.close(fd)
    os.remove(tmp)
