"""Atomic writes that honour the umask: a crash at any moment leaves either the old file or
the complete new one. The bottom of the package: pure Python, used by checkpoints
(:mod:`mpidp.run`) and saved models (:mod:`mpidp.nn`) alike."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import IO

TMP_PREFIX = ".tmp-"
_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's file-mode creation mask, read without changing it.

    Linux shows it in ``/proc/self/status``; elsewhere it is read by setting and restoring
    it, which is not atomic (a file another thread creates at that instant could get the
    wrong mode), so that path is taken only when ``/proc`` has no answer.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def host_tag() -> str:
    """A short hex tag of this host's name (safe in file names)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def write_atomic(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` via a temporary file in the same folder: write, flush, fsync, rename.

    A crash at any moment leaves either the old file or the complete new one. The file gets
    the mode a plain ``open`` would give it (``0o666`` less the umask), not the ``0o600`` of
    a temporary file. The temporary name ``.tmp-<host tag>-<pid>-*`` says who wrote it, so
    :func:`clean_stale_tmp` can tell a live writer's file from one a killed process left.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TMP_PREFIX}{host_tag()}-{os.getpid()}-")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            fd = -1
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
