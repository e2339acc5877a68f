"""Checkpoint folders that belong to one run at a time, and the temporary files that killed
writers leave there (no MPI: the root rank calls these). A checkpoint folder holds
``run.json`` (the run it belongs to: ``run_id``, when and where it started), ``.lock``
(``flock``-ed by the job writing there and naming it; without locks, its contents decide:
:func:`lock_folder`), ``ckpt-*.npz`` (:mod:`mpidp.run.checkpoint`) and briefly ``.tmp-*``."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

from ..atomic import TMP_PREFIX, host_tag, write_atomic, write_error
from ..errors import setting

RUN_FILE = "run.json"
LOCK_FILE = ".lock"


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists on this host (owned by anyone)."""
    try:
        return pid > 0 and os.kill(pid, 0) is None
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _proc_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot), to tell it from a later reuse of its
    number; None where ``/proc`` does not say."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])
    return None


def clean_stale_tmp(directory: str, max_age_s: float = 3600.0) -> list[str]:
    """Remove the ``.tmp-*`` files in ``directory`` that no live writer will finish (returns their
    paths): this host's whose process is gone, others older than ``max_age_s`` seconds."""
    removed, mine, now = [], host_tag(), time.time()
    try:
        names = [n for n in os.listdir(directory) if n.startswith(TMP_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        parts = name[len(TMP_PREFIX):].split("-")
        try:
            if len(parts) >= 3 and parts[0] == mine and parts[1].isdigit():
                stale = not pid_alive(int(parts[1]))
            else:
                stale = now - os.stat(path).st_mtime > max_age_s
            if stale:
                os.unlink(path)
                removed.append(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def _read_record(fd: int) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else None
    return None


def _in_use(directory: str, record: dict | None, note: str = "", wait: str = "for it to finish"
            ) -> ValueError:
    """The refusal of a folder whose lock another job (``record``) holds."""
    who = (f"host {record.get('host')}, pid {record.get('pid')}, since {record.get('since')}"
           if record else "holder unknown")
    return ValueError(f"checkpoint folder {directory} is in use by another mpidp job ({who}"
                      f"{note}): wait {wait}, or give this run another "
                      f"{setting('checkpoint_dir')}")


def _record_alive(record: dict | None) -> bool:
    """Whether the job a lock record names may still run (always True for another host)."""
    if not record or "pid" not in record:
        return False
    if record.get("host") != socket.gethostname():
        return True  # cannot look at another host's processes
    pid = int(record["pid"])
    started = record.get("proc_start")
    return pid_alive(pid) and (started is None or _proc_start(pid) in (None, started))


def lock_folder(directory: str) -> int:
    """Take ``directory``'s lock for this process; returns the lock file's descriptor. Raises
    ValueError naming the holder (host, pid, since when) if another job holds it. Without
    locks, the lock file's record decides: a holder on this host no longer running does not
    keep it; one on another host is trusted (the message says to delete the file)."""
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _read_record(fd)
        os.close(fd)
        raise _in_use(directory, record) from None
    except (ImportError, OSError) as exc:  # no flock here (ENOLCK, EOPNOTSUPP ...)
        if isinstance(exc, OSError) and exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP,
                                                         errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        record = _read_record(fd)
        if _record_alive(record) and record.get("pid") != os.getpid():
            os.close(fd)
            raise _in_use(directory, record, f"; this filesystem has no locks, so if that job "
                          f"has ended, delete {path}", "for it") from None
    try:
        _write_record(fd, {"host": socket.gethostname(), "pid": os.getpid(),
                           "proc_start": _proc_start(os.getpid()),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S %z")})
    except OSError as exc:  # a full disk
        os.close(fd)
        raise write_error(exc, path, setting("checkpoint_dir")) from None
    return fd


def hold_folder(directory: str, name: str) -> int | None:
    """Take this host's lock on the folder path ``directory`` (an ``flock`` on a file named
    after it in the system's temporary folder: ``directory`` need not exist); returns its
    descriptor (close it to let go), or None where no lock can be taken. Raises ValueError
    naming the setting ``name`` if another job on this host holds it."""
    import fcntl
    key = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:32]
    folder = os.path.join(tempfile.gettempdir(), "mpidp-folder-locks")
    try:
        os.makedirs(folder, mode=0o1777, exist_ok=True)
        fd = os.open(os.path.join(folder, f"{key}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{setting(name)} {directory} is in use by another mpidp job: wait "
                         f"for it to finish, or give this run another {setting(name)}") from None
    except OSError:  # no locks there
        os.close(fd)
        return None
    return fd


def _write_record(fd: int, record: dict | None) -> None:
    os.ftruncate(fd, 0)
    if record is not None:
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    with contextlib.suppress(OSError):
        os.fsync(fd)


def unlock_folder(fd: int) -> None:
    """Release a lock from :func:`lock_folder`: clear its record, then close (which drops
    the ``flock``). The file stays: removing it would let two jobs lock different files."""
    with contextlib.suppress(OSError):
        _write_record(fd, None)
    os.close(fd)


def read_run(directory: str) -> dict | None:
    """The ``run.json`` record of ``directory`` (``run_id``, ``created``, ``host``), None if there is
    none; an unreadable one reads as ``{"run_id": None, ...}`` (a used folder, run unknown)."""
    path = os.path.join(directory, RUN_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"run_id": None, "problem": f"{path} is unreadable: {exc}"}
    return record if isinstance(record, dict) else {"run_id": None, "problem": f"{path} is odd"}


def write_run(directory: str, run_id: str) -> dict:
    """Record that ``directory`` belongs to run ``run_id`` (atomically). Returns the record."""
    record = {"run_id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "host": socket.gethostname(), "pid": os.getpid()}
    write_atomic(os.path.join(directory, RUN_FILE),
                 lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()),
                 what=setting("checkpoint_dir"))
    return record


@dataclass
class Claim:
    """A checkpoint folder held by this process for run ``run_id`` until :meth:`release`.
    ``continued``: the folder held the run being resumed; ``cleaned``: stale temporary files
    removed; ``wiped``: files removed by ``restart``."""

    directory: str
    run_id: str
    continued: bool = False
    cleaned: list[str] = field(default_factory=list)
    wiped: list[str] = field(default_factory=list)
    _fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        """Give the folder's lock back (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            unlock_folder(fd)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
