"""Atomic writes that honour the umask: a crash leaves the old file or the complete new one.
A failed write raises :class:`WriteError`: one line naming the file asked for, why, and
the fix; :func:`check_file` and :func:`check_folder` try a place first. The one rule for
every path mpidp opens, read or written: a regular file or a folder where one is expected,
never a FIFO, a device or a socket (:func:`check_place`, :func:`read_text`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import IO

TMP_PREFIX = ".tmp-"
_UMASK_LOCK = threading.Lock()
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)  # not on every system
#: The errors of a disk that has no room left (for anyone, or under this user's quota).
DISK_FULL = frozenset({errno.ENOSPC, _EDQUOT})
#: The most bytes of a text file mpidp reads whole (a model file, a configuration).
TEXT_LIMIT = 16 * 2**20
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def shown(path: str) -> str:
    """``path`` as a message shows it: quoted when a character in it would break the line."""
    return path if path.isprintable() else repr(path)


def special(path: str) -> str | None:
    """What ``path`` is, in words, when it exists but is neither a regular file nor a folder
    (a FIFO or a device is read without end, or blocks); None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    if os.path.islink(path):
        kind += f" (a symbolic link to {shown(os.path.realpath(path))})"
    return kind


def check_place(path: str, what: str, file: bool = True, folder: bool = False,
                fix: str = "", folder_later: bool = False, limit: int | None = None) -> None:
    """ValueError naming ``what`` (the option), ``path`` and what it is, before anything opens
    it, when it is a FIFO, a device or a socket (symbolic links followed), or a folder where a
    file (``file`` and not ``folder``) is expected, unless ``folder_later`` (an output whose own
    check names a file to give), or a file of over ``limit`` bytes (a text read whole). A missing
    path, or a file where only a folder is expected, is left to the code that opens it."""
    kind = special(path) or (
        "a folder" if not (folder or folder_later) and os.path.isdir(path) else None)
    if kind is not None:
        want = "a regular file or a folder" if file and folder else \
            "a folder" if folder else "the path of a regular file"
        raise ValueError(f"{what} {shown(path)} is {kind}: give {want}{fix}")
    if limit is not None and os.path.isfile(path) and os.path.getsize(path) > limit:
        raise _too_large(path, what, limit)


def _too_large(path: str, what: str, limit: int) -> ValueError:
    return ValueError(f"{what} {shown(path)} is over {limit / 2**20:g} MiB, too large for a "
                      f"text file of settings: give the right file")


def numpy_kind(path: str) -> str:
    """What the file ``path`` is by its first bytes: ``".npy"`` (one NumPy array), ``".npz"``
    (a zip archive, as ``np.savez`` writes) or ``""`` (neither: a text file, say), so that
    NumPy is never asked to read a foreign file (its error would suggest unpickling it)."""
    with open(path, "rb") as f:
        head = f.read(6)
    return ".npy" if head == b"\x93NUMPY" else ".npz" if head[:4] == b"PK\x03\x04" else ""


def read_text(path: str, what: str, limit: int = TEXT_LIMIT) -> bytes:
    """The bytes of the text file ``path`` (a model file, a configuration), read by
    :func:`check_place`'s rule and at most ``limit`` bytes: ValueError naming ``what`` for
    a larger one; an ``OSError`` as ``open`` raises it."""
    check_place(path, what, limit=limit)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what} {shown(path)} is not a regular file: give one")
        data = f.read(limit + 1)
    if len(data) > limit:  # grown since it was checked
        raise _too_large(path, what, limit)
    return data


def target(path: str) -> str:
    """The file a write to ``path`` lands on: the end of its symbolic links, if it is one
    (a write replaces what a link points to, never the link)."""
    return os.path.realpath(path) if os.path.islink(path) else path


class WriteError(OSError):
    """An output that could not be written: ``filename`` the file asked for, ``what`` the
    option that named its place (None: not known); ``str()`` is one line with the fix."""

    what: str | None = None

    def __str__(self) -> str:
        path = "an output file" if self.filename is None else shown(str(self.filename))
        elsewhere = f"give {self.what} a place on another disk" if self.what else \
            "write to another disk"
        if self.errno == errno.ENOSPC:
            return (f"the disk is full: cannot write {path} ({self.strerror}); free space "
                    f"on it or {elsewhere}")
        if self.errno == _EDQUOT:
            return (f"the disk quota is used up: cannot write {path} ({self.strerror}); "
                    f"free space under your quota or {elsewhere}")
        fix = f"; give {self.what} a place you can write to" if self.what else ""
        return f"cannot write {path} ({self.strerror}){fix}"


def write_error(exc: OSError, path: str | None = None, what: str | None = None) -> WriteError:
    """``exc`` as a :class:`WriteError` naming ``path`` and ``what`` (default: ``exc``'s own)."""
    err = WriteError(exc.errno or errno.EIO, exc.strerror or str(exc),
                     path if path is not None else exc.filename)
    err.what = what or getattr(exc, "what", None)
    return err


def current_umask() -> int:
    """The umask, from ``/proc/self/status`` where there is one (else set and restored: not atomic)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def host_tag() -> str:
    """A short hex tag of this host's name (safe in file names)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def write_atomic(path: str, write: Callable[[IO[bytes]], object], what: str | None = None) -> None:
    """Write ``path`` via a temporary file in the same folder (write, flush, fsync, rename) with
    the mode a plain ``open`` gives, named ``.tmp-<host tag>-<pid>-*`` (who wrote it). An
    ``OSError`` is raised as a :class:`WriteError` naming ``path`` and ``what``. A symbolic link is
    followed (its target replaced); anything but a regular file (a FIFO, a device) is refused."""
    path = _write_target(path, what)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{TMP_PREFIX}{host_tag()}-{os.getpid()}-")
    except OSError as exc:
        raise write_error(exc, path, what) from None
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            fd = -1
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise write_error(exc, path, what) from None
        raise
    _fsync_dir(directory)


def write_together(files: Sequence[tuple[str, Callable[[str], object]]],
                   what: str | None = None) -> None:
    """Write several files so that, short of a crash between renames, all are replaced or
    none: ``save(tmp)`` of each ``(path, save)`` writes beside ``path``, renamed once all are
    written; on a failure a :class:`WriteError` names the ``path`` that failed."""
    staged: list[tuple[str, str]] = []
    try:
        for path, save in files:
            path = _write_target(path, what)
            folder = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise write_error(exc, folder, what) from None
            tmp = os.path.join(folder, f"{TMP_PREFIX}{host_tag()}-{os.getpid()}-{os.path.basename(path)}")
            staged.append((tmp, path))
            try:
                save(tmp)
            except OSError as exc:
                raise write_error(exc, path, what) from None
        for tmp, path in staged:
            os.replace(tmp, path)
        for folder in {os.path.dirname(os.path.abspath(path)) for _, path in staged}:
            _fsync_dir(folder)
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def _write_target(path: str, what: str | None) -> str:
    """:func:`target` of ``path``; a :class:`WriteError` if it is a FIFO, a device or a socket."""
    kind = special(path)
    if kind is not None:
        raise write_error(OSError(errno.EEXIST, f"it is {kind}, not a regular file", path), what=what)
    return target(path)


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some filesystems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _probe(path: str, what: str, name: str | None = None) -> None:
    """ValueError unless a file can be created in the nearest existing folder of ``path``
    (tried for real: permission bits say nothing for root), naming ``what`` and ``name``."""
    name = path if name is None else name
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        with open(os.path.join(folder, f".mpidp-probe-{os.getpid()}"), "wb") as f:
            name = f.name
        os.unlink(name)
    except OSError as exc:
        if exc.errno in DISK_FULL:
            raise ValueError(f"{what} {shown(name)}: {write_error(exc, folder, what)}") from None
        raise ValueError(f"{what} {shown(name)}: cannot write in {shown(folder)} "
                         f"({exc.strerror}); give {what} a place you can write to") from None


def _not_dangling(path: str, what: str) -> None:
    """ValueError naming ``what`` when ``path`` or one of its folders is a symbolic link to nothing."""
    link = os.path.abspath(path)
    while not (os.path.islink(link) and not os.path.exists(link)):
        if os.path.exists(link) or os.path.dirname(link) == link:
            return
        link = os.path.dirname(link)
    raise ValueError(f"{what} {shown(path)}: {shown(link)} is a symbolic link to "
                     f"{shown(os.readlink(link))}, which does not exist: create what it "
                     f"points to, or give {what} another place")


def check_file(path: str, what: str, example: str = "out.npy") -> None:
    """ValueError naming ``what`` (the option), ``path`` and the fix unless a file can be
    written at ``path`` (not a folder, not under a dangling link, in a writable folder)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"{what} {shown(path)} is a folder: give the path of a file, e.g. "
                         f"{shown(os.path.join(path, example))}")
    check_place(path, what)
    _not_dangling(path, what)
    _probe(path, what)


def check_folder(path: str, what: str) -> None:
    """ValueError naming ``what``, ``path`` and the fix unless ``path`` is, or can be made, a
    folder to write in (not a file, not under a dangling link, where files can be created)."""
    check_place(path, what, file=False, folder=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what} {shown(path)} exists and is not a folder: give a folder, "
                         f"or a path where one can be made")
    _not_dangling(path, what)
    _probe(os.path.join(path, "x"), what, path)
