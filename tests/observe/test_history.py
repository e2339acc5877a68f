"""mpidp.observe.history: one JSON line per record, on disk as soon as it is written (a killed job
keeps them), strict JSON, derived figures, TensorBoard scalars and its missing-package
error, files that honour the umask."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, tensorboard_scalars

from mpidp.observe import history as H


def test_lines_are_on_disk_before_close(tmp_path):
    path = tmp_path / "run" / "history.jsonl"
    h = H.History(str(path))
    h.config({"sync": "ps", "world_size": 2})
    h.epoch({"epoch": 1, "loss": 0.5, "accuracy": 0.9})
    h.steps({"step": 10, "epoch": 1, "loss": 0.4, "samples_per_s": 1000.0})
    lines = path.read_text().splitlines()  # read by another handle while still open
    assert [json.loads(x)["kind"] for x in lines] == ["config", "epoch", "steps"]
    assert json.loads(lines[1]) == {"kind": "epoch", "epoch": 1, "loss": 0.5, "accuracy": 0.9}
    h.close()
    h.close()


def test_killed_process_keeps_every_line(tmp_path):
    path = tmp_path / "history.jsonl"
    code = textwrap.dedent(f"""
        import os, signal
        from mpidp.observe.history import History
        h = History({str(path)!r})
        for e in range(3):
            h.epoch({{"epoch": e + 1, "loss": 1.0 / (e + 1)}})
        h.steps({{"step": 99, "loss": 0.1}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60)
    assert r.returncode == -9
    recs = H.read(str(path))
    assert [r.get("epoch") for r in recs] == [1, 2, 3, None]
    assert recs[-1] == {"kind": "steps", "step": 99, "loss": 0.1}


def test_read_skips_a_line_cut_short(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"kind":"epoch","epoch":1}\n{"kind":"epoch","ep')
    assert H.read(str(path)) == [{"kind": "epoch", "epoch": 1}]
    path.write_text('{"kind":"epoch","epoch":1}\nnot json\n{"epoch":2}\n')
    with pytest.raises(json.JSONDecodeError):
        H.read(str(path))


def test_non_finite_become_null_and_numpy_values_plain(tmp_path):
    import numpy as np
    path = tmp_path / "h.jsonl"
    with H.History(str(path)) as h:
        h.epoch({"epoch": np.int64(1), "loss": float("nan"), "acc": np.float32(0.5),
                 "per": np.array([1.0, np.inf])})
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"kind": "epoch", "epoch": 1, "loss": None, "acc": 0.5,
                                "per": [1.0, None]}


def test_derived_comm_share_and_imbalance():
    rec = {"compute_s": [3.0, 1.0], "comm_s": [1.0, 1.0], "wait_s": [0.0, 2.0]}
    d = H.derived(rec)
    assert d["comm_share"] == pytest.approx(2.0 / 8.0)
    assert d["imbalance"] == pytest.approx(3.0 / 2.0)
    assert H.derived({"loss": 1.0}) == {}


def test_derived_figures_written_unless_given(tmp_path):
    path = tmp_path / "h.jsonl"
    with H.History(str(path)) as h:
        h.steps({"step": 5, "compute_s": [2.0, 2.0], "comm_s": [2.0, 2.0]})
        h.steps({"step": 6, "compute_s": [2.0, 2.0], "imbalance": 7.0})
    a, b = H.read(str(path))
    assert a["comm_share"] == 0.5 and a["imbalance"] == 1.0
    assert b["imbalance"] == 7.0 and b["comm_share"] == 0.0


def test_append_continues_a_file(tmp_path):
    path = str(tmp_path / "h.jsonl")
    with H.History(path) as h:
        h.epoch({"epoch": 1})
    with H.History(path, append=True) as h:
        h.epoch({"epoch": 2})
    assert [r["epoch"] for r in H.read(path)] == [1, 2]
    with H.History(path) as h:
        h.epoch({"epoch": 1})
    assert [r["epoch"] for r in H.read(path)] == [1]


def test_file_honours_the_umask(tmp_path):
    path = tmp_path / "h.jsonl"
    code = (f"import os; os.umask(0o077); from mpidp.observe.history import History; "
            f"h = History({str(path)!r}); h.epoch({{'epoch': 1}}); h.close()")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, check=True)
    assert path.stat().st_mode & 0o777 == 0o600


def test_missing_tensorboardx_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import raises ImportError
    with pytest.raises(ValueError, match=r"pip install 'mpidp\[tensorboard\]'"):
        H.History(str(tmp_path / "h.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    assert not (tmp_path / "h.jsonl").exists()



def test_tensorboard_scalars_per_epoch_and_step(tmp_path):
    pytest.importorskip("tensorboardX")
    tb = tmp_path / "tb"
    with H.History(str(tmp_path / "h.jsonl"), tensorboard_dir=str(tb)) as h:
        h.config({"sync": "ps"})
        for e in (1, 2):
            h.epoch({"epoch": e, "loss": 1.0 / e, "accuracy": 0.5 * e, "samples_per_s": 100.0})
        h.steps({"step": 40, "loss": 0.25, "compute_s": [3.0, 1.0], "comm_s": [1.0, 1.0],
                 "wait_s": [0.0, 2.0]})
    s = tensorboard_scalars(tb)
    assert s["epoch/loss"] == [(1, 1.0), (2, 0.5)]
    assert s["epoch/accuracy"] == [(1, 0.5), (2, 1.0)]
    assert s["epoch/samples_per_s"] == [(1, 100.0), (2, 100.0)]
    assert s["step/comm_share"] == [(40, 0.25)] and s["step/imbalance"] == [(40, 1.5)]
    assert s["step/compute_s/rank1"] == [(40, 1.0)]
    assert not any(k.startswith("config") for k in s)


def test_a_tensorboard_path_that_is_a_file_is_named_as_the_folder_it_must_be(tmp_path):
    """The check names the path given (it used to name a file inside it: PATH/x)."""
    from mpidp.observe.watch import Outputs, Watch
    taken = tmp_path / "taken"
    taken.write_text("a file")
    with pytest.raises(ValueError, match=rf"^tensorboard {taken} exists and is not a folder"):
        Watch.check(Outputs(str(tmp_path / "o"), tensorboard=str(taken)))
