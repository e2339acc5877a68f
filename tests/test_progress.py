"""Rank 0 shows progress the way a person expects: a live bar when the launcher's terminal
is watched, a plain line every few seconds when the output goes to a pipe or a file."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys

import pytest
from clitools import ROOT

from mpidp.observe import progress as P

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
TRAIN = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpidp", "train", "--dataset", "digits",
         "--epochs", "2", "--batch-size", "8", "--hidden", "256,256"]


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


def _watched_in(stderr) -> bool:
    code = "import sys; from mpidp.observe.progress import watched; print(watched())"
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr,
                       text=True, timeout=60, cwd=ROOT)
    return r.stdout.strip() == "True"


def test_a_terminal_is_watched_a_pipe_or_a_file_is_not(tmp_path):
    main, child = pty.openpty()
    try:
        assert _watched_in(child)
    finally:
        os.close(child)
        os.close(main)
    assert not _watched_in(subprocess.PIPE)
    with open(tmp_path / "log", "w") as f:
        assert not _watched_in(f)


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


@pytest.mark.slow
def test_under_mpiexec_in_a_terminal_rank_0_draws_a_bar(tmp_path):
    main, child = pty.openpty()
    proc = subprocess.Popen([*TRAIN, "--out", str(tmp_path / "o")], stdin=subprocess.DEVNULL,
                            stdout=child, stderr=child, cwd=ROOT)
    os.close(child)
    try:
        out = _read_all(main, proc)
        assert proc.wait(timeout=120) == 0, out
    finally:
        os.close(main)
    assert "epoch 1: 100%" in out and "step/s" in out and "\r" in out, out[-2000:]
    assert out.count("epoch   2/2") == 1  # rank 0 only


@pytest.mark.slow
def test_under_mpiexec_into_a_pipe_rank_0_writes_plain_lines(tmp_path):
    env = {**os.environ, "MPIDP_PROGRESS_SECONDS": "0.05"}
    r = subprocess.run([*TRAIN, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("epoch 1: ")]
    assert lines and all(" steps, loss " in ln for ln in lines), r.stderr[-2000:]
    assert "\r" not in r.stderr and "step/s]" not in r.stderr
    none = subprocess.run([*TRAIN, "--out", str(tmp_path / "n"), "--progress", "none"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert none.returncode == 0 and "steps, loss" not in none.stderr, none.stderr
