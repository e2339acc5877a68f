"""Rank 0 shows progress the way a person expects: a live bar when the launcher's terminal
is watched, a plain line every few seconds when the output goes to a pipe or a file."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import termios

import pytest
from helpers import ROOT

from mpidp.errors import MpidpError
from mpidp.observe import progress as P

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
TRAIN = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpidp", "train", "--dataset", "digits",
         "--epochs", "1", "--batch-size", "8", "--hidden", "256,256"]


def test_lines_come_every_few_seconds_not_every_step(capsys, monkeypatch):
    now = [0.0]
    monkeypatch.setenv("MPIDP_PROGRESS_SECONDS", "5")
    bar = P.Progress(100, "epoch 1", "lines", clock=lambda: now[0])
    for _ in range(100):
        now[0] += 0.25  # 25 s in all: a line at 5, 10, 15 and 20 s, none at the last step
        bar.update(0.5)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(":")[1].split(",")[0].strip() for ln in lines] == \
        ["20/100 steps", "40/100 steps", "60/100 steps", "80/100 steps"], lines
    assert all("loss 0.5000" in ln and "4.0 steps/s" in ln for ln in lines), lines


def test_none_writes_nothing_and_modes_resolve(capsys):
    bar = P.Progress(3, "epoch 1", "none", clock=lambda: 1e9)
    for _ in range(3):
        bar.update(1.0)
    assert capsys.readouterr().err == ""
    assert (P.resolve(False), P.resolve("bar"), P.resolve("lines")) == ("none", "bar", "lines")
    with pytest.raises(ValueError, match="unknown progress 'fancy'"):
        P.resolve("fancy")


@pytest.mark.parametrize("text", ["abc", "", "0", "-1", "nan", "inf"])
def test_a_bad_seconds_variable_is_one_error_naming_it(monkeypatch, text):
    monkeypatch.setenv("MPIDP_PROGRESS_SECONDS", text)
    for mode in ("lines", "none"):  # every rank checks it, whatever it draws
        with pytest.raises(MpidpError, match=re.escape(f"MPIDP_PROGRESS_SECONDS={text!r}: ")):
            P.Progress(10, "epoch 1", mode)
    monkeypatch.setenv("MPIDP_PROGRESS_SECONDS", "0.5")
    assert P.Progress(10, "epoch 1", "none").every == 0.5
    monkeypatch.delenv("MPIDP_PROGRESS_SECONDS")
    assert P.Progress(10, "epoch 1", "none").every == P.LINE_SECONDS


def _terminal() -> tuple[int, int]:
    """A pseudo-terminal (main, child) that passes output as written (no \n -> \r\n), so a
    carriage return read from it is a bar's frame."""
    main, child = pty.openpty()
    attrs = termios.tcgetattr(child)
    attrs[1] &= ~termios.ONLCR
    termios.tcsetattr(child, termios.TCSANOW, attrs)
    return main, child


def _read_all(fd: int, proc: subprocess.Popen) -> str:
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode(errors="replace")


def _in_a_terminal(script: str, *args: str, env: dict | None = None, timeout: float = 120):
    """Run the bash ``script`` (``args`` as ``$@``) with a terminal as its stdin, stdout and
    stderr, as a person's shell would; (exit status, what reached the terminal)."""
    main, child = _terminal()
    try:
        proc = subprocess.Popen(["bash", "-c", script, "bash", *args], stdin=child,
                                stdout=child, stderr=child, cwd=ROOT, env=env)
        os.close(child)
        out = _read_all(main, proc)
        return proc.wait(timeout=timeout), out
    finally:
        os.close(main)


WATCHED = [sys.executable, "-c", "from mpidp.observe.progress import watched; "
           "print('watched', watched(), flush=True)"]


def _says(out: str) -> bool:
    assert re.search(r"watched (True|False)", out), out
    return "watched True" in out


def test_a_terminal_is_watched_a_pipe_or_a_file_is_not(tmp_path):
    """The shell's terminal is no matter when the process's own stderr is a pipe or a file."""
    log = str(tmp_path / "log")
    assert _says(_in_a_terminal('"$@"', *WATCHED)[1])
    assert not _says(_in_a_terminal('"$@" 2>&1 | cat', *WATCHED)[1])
    assert not _says(_in_a_terminal('"$@" 2>"$LOG"', *WATCHED, env={**os.environ, "LOG": log})[1])


def test_under_mpiexec_the_launchers_stderr_decides(tmp_path):
    """A rank's stderr is always a pipe to the launcher: a terminal on the launcher's stderr
    is watched, a pipe or a file there is not, even with a terminal further up (``| tee``
    there: test_under_mpiexec_into_a_pipe_rank_0_writes_plain_lines, whose log has no bar)."""
    launch = [MPIEXEC, "-n", "1", *WATCHED]
    env = {**os.environ, "LOG": str(tmp_path / "log")}
    assert _says(_in_a_terminal('"$@"', *launch)[1])
    assert not _says(_in_a_terminal('"$@" 2>&1 | cat', *launch)[1])
    assert not _says(_in_a_terminal('"$@" 2>"$LOG"', *launch, env=env)[1])


@pytest.mark.slow
def test_under_mpiexec_in_a_terminal_rank_0_draws_a_bar(tmp_path):
    main, child = _terminal()
    proc = subprocess.Popen([*TRAIN, "--out", str(tmp_path / "o")], stdin=subprocess.DEVNULL,
                            stdout=child, stderr=child, cwd=ROOT)
    os.close(child)
    try:
        out = _read_all(main, proc)
        assert proc.wait(timeout=120) == 0, out
    finally:
        os.close(main)
    assert "epoch 1: 100%" in out and "step/s" in out and "\r" in out, out[-2000:]
    assert out.count("epoch   1/1") == 1  # rank 0 only


@pytest.mark.slow
def test_under_mpiexec_into_a_pipe_rank_0_writes_plain_lines(tmp_path):
    """``mpiexec ... 2>&1 | tee run.log`` typed in a terminal: lines, no bar in the log."""
    env = {**os.environ, "MPIDP_PROGRESS_SECONDS": "0.05", "LOG": str(tmp_path / "log")}
    rc, out = _in_a_terminal('"$@" 2>&1 | tee "$LOG"', *TRAIN, "--out", str(tmp_path / "o"),
                             env=env)
    assert rc == 0, out[-2000:]
    log = (tmp_path / "log").read_text()
    lines = [ln for ln in log.splitlines() if ln.startswith("epoch 1: ")]
    assert lines and all(" steps, loss " in ln for ln in lines), log[-2000:]
    assert "\r" not in out and "\r" not in log and "step/s]" not in log, log[-2000:]
    rc, out = _in_a_terminal('"$@" 2>&1 | cat', *TRAIN, "--out", str(tmp_path / "n"),
                             "--progress", "none", env=env)
    assert rc == 0 and "epoch   1/1" in out and "steps, loss" not in out, out[-2000:]
