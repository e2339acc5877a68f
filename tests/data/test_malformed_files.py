"""Data files and checkpoints that are wrong in a way that passes the first checks (a hand-edited
header, a dangling link, a checkpoint forged with a valid checksum) end in one clear line
that names the problem, the file and the fix, on every rank: never a traceback, and never a
run that silently does nothing."""

from __future__ import annotations

import io
import json
import shutil
import zipfile

import numpy as np
import pytest
from helpers import run_here, run_mpi

from mpidp.cli import settings
from mpidp.data.sources import open_source
from mpidp.run import checkpoint as ck

ARGS = ["train", "--dataset", "synthetic", "--n-samples", "600", "--n-features", "10",
        "--dtype", "float64", "--epochs", "2", "--batch-size", "32", "--optimizer", "adam",
        "--lr", "0.01", "--hidden", "16", "--no-progress"]
STEPS = 15  # steps per epoch of ARGS: 480 training samples in batches of 32


def _one_error(r, *parts: str) -> str:
    """The single error line of a failed job, after checking it says every one of ``parts``."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stderr.count("mpidp: error:") == 1, r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("mpidp: error:"))
    for part in parts:
        assert part in line, (part, line)
    return line


# --- a .npy header with a negative dimension ------------------------------------------------

def _npy_bytes(shape: str, descr: str = "<f8", n_bytes: int = 120) -> bytes:
    """A version 1.0 .npy file whose header says ``shape`` (written by hand, as an edit would)."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() \
        + b"\0" * n_bytes


def _npy_of(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _negative_dataset(tmp_path, how: str) -> tuple[str, str]:
    """``(dataset, the file named in the error)`` with X's header saying (-5, 3)."""
    bad, y = _npy_bytes("(-5, 3)"), _npy_of(np.zeros(5, np.int64))
    if how == "folder":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "X.npy").write_bytes(bad)
        (tmp_path / "d" / "y.npy").write_bytes(y)
        return str(tmp_path / "d"), str(tmp_path / "d" / "X.npy")
    path = tmp_path / "d.npz"
    kind = zipfile.ZIP_STORED if how == "npz" else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", kind) as z:
        z.writestr("X.npy", bad)
        z.writestr("y.npy", y)
    return str(path), str(path)


@pytest.mark.parametrize("how", ["folder", "npz", "compressed npz"])
def test_a_negative_shape_in_an_npy_header_is_named(tmp_path, how):
    dataset, named = _negative_dataset(tmp_path, how)
    with pytest.raises(ValueError) as got:
        open_source(dataset)
    message = str(got.value)
    assert named in message and "(-5, 3)" in message and "negative" in message, message
    assert "numpy.save" in message, message  # the fix: write the array again


@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_a_negative_shape_in_an_npy_header_is_one_line_on_every_rank(tmp_path, distribute):
    dataset, named = _negative_dataset(tmp_path, "folder")
    r = run_mpi(2, "train", "--dataset", dataset, "--distribute", distribute, "--epochs", "1",
                "--out", str(tmp_path / "o"), timeout=60)
    _one_error(r, named, "(-5, 3)", "numpy.save")
    assert "(on rank" not in r.stderr  # every rank found it


# --- an HDF5 dataset that is a dangling link -------------------------------------------------

def _dangling(tmp_path, kind: str) -> str:
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["X"] = (h5py.ExternalLink("missing.h5", "/X") if kind == "external"
                  else h5py.SoftLink("/nowhere"))
        f["y"] = np.zeros(5, np.int64)
    return str(path)


@pytest.mark.parametrize("kind", ["external", "soft"])
def test_a_dangling_hdf5_link_is_named(tmp_path, kind):
    path = _dangling(tmp_path, kind)
    with pytest.raises(ValueError) as got:
        open_source(path)
    message = str(got.value)
    assert path in message and "'X'" in message, message
    if kind == "external":
        assert "external link" in message and "missing.h5" in message, message
    else:
        assert "soft link" in message and "/nowhere" in message, message


@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_a_dangling_external_link_is_one_line_on_every_rank(tmp_path, capsys, distribute):
    """In this process (one rank): the file is opened where the negative shape's is (rank 0
    for scatter, every rank for local), whose jobs above show one line from 2 ranks."""
    path = _dangling(tmp_path, "external")
    r = run_here(capsys, "train", "--dataset", path, "--distribute", distribute, "--epochs", "1",
                 "--out", str(tmp_path / "o"))
    _one_error(r, path, "external link", "missing.h5")
    assert not (tmp_path / "o").exists()


# --- labels reported as stored ---------------------------------------------------------------

@pytest.mark.parametrize("distribute", ["scatter", "local"])
@pytest.mark.parametrize("n_classes", [None, 3])
def test_a_uint64_label_is_reported_as_stored(tmp_path, capsys, distribute, n_classes):
    """Without --n-classes, each rank reading its own rows (local), by a job of 2 ranks; the
    others in this process (one rank)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 40).astype(np.uint64)
    y[7] = 2**63 + 5
    np.savez(tmp_path / "d.npz", X=rng.standard_normal((40, 3)), y=y)
    args = ["train", "--dataset", str(tmp_path / "d.npz"), "--distribute", distribute,
            "--epochs", "1", "--out", str(tmp_path / "o"),
            *(["--n-classes", str(n_classes)] if n_classes else [])]
    job = n_classes is None and distribute == "local"
    r = run_mpi(2, *args, timeout=60) if job else run_here(capsys, *args)
    line = _one_error(r, str(2**63 + 5))
    assert "-9223372036854775803" not in line and ">= 0" not in line, line


# --- checkpoints forged with a valid checksum ------------------------------------------------

@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint folder of a finished 1-epoch run (global step 15, epoch 1, step 0)."""
    base = tmp_path_factory.mktemp("written")
    r = run_mpi(2, *ARGS, "--epochs", "1", "--checkpoint-dir", str(base / "ck"),
                "--out", str(base / "a"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return base / "ck"


def _forge(written, tmp_path, edit) -> str:
    """A copy of ``written`` whose newest checkpoint ``edit(meta, arrays)`` changed, its
    checksum recomputed so that it passes the integrity check. Returns the file's path."""
    folder = tmp_path / "ck"
    shutil.copytree(written, folder)
    path = ck.list_checkpoints(str(folder))[-1]
    meta, arrays = ck.read(path)
    edit(meta, arrays)
    _write(path, meta, arrays)
    return path


def _write(path, meta: dict, arrays: dict) -> None:
    """Write a checkpoint file of ``meta`` and ``arrays`` with the checksum that fits them."""
    text = json.dumps(meta)
    np.savez(path, meta=text, checksum=ck._digest(text, arrays), **arrays)
    with np.load(path) as z:  # the integrity check holds
        assert str(z["checksum"]) == ck._digest(str(z["meta"]), {
            k: z[k] for k in z.files if k not in ("meta", "checksum")})


def _set(**values):
    def edit(meta, arrays):
        meta.update(values)
    return edit


def _short_params(meta, arrays):
    arrays["params"] = arrays["params"][:-10]


def _short_state(meta, arrays):
    arrays["opt.m"] = arrays["opt.m"][:-1]


def _short_state_recorded(meta, arrays):  # the array and its recorded shape both edited
    arrays["opt.m"] = arrays["opt.m"][:-1]
    meta["optimizer"]["state"]["m"] = [len(arrays["opt.m"])]


def _state_missing(meta, arrays):
    del arrays["opt.v"]


def _state_dropped(meta, arrays):  # the array and its record both gone: Adam needs v
    del arrays["opt.v"], meta["optimizer"]["state"]["v"]


def _negative_t(meta, arrays):
    meta["optimizer"]["t"] = -3


FORGED = {
    "params shorter": (_short_params, "336"),
    "state shorter": (_short_state, "(345,)"),
    "state shorter, recorded": (_short_state_recorded, "(345,)"),
    "state array missing": (_state_missing, "opt.v"),
    "state dropped": (_state_dropped, "'v'"),
    "negative epoch": (_set(epoch=-1), "-1"),
    "negative step": (_set(epoch=0, step=-3), "-3"),
    "negative global step": (_set(global_step=-3), "-3"),
    "negative update count": (_negative_t, "-3"),
    "fractional step": (_set(epoch=0, step=2.5), "2.5"),
    "totals": (_set(epoch=0, step=3, totals=[1.0]), "totals"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_a_forged_checkpoint_is_one_clear_error(written, tmp_path, capsys, case):
    """One by a job of 2 ranks (as the checkpoint's), the others resumed by one rank in this
    process."""
    edit, detail = FORGED[case]
    path = _forge(written, tmp_path, edit)
    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
            "--out", str(tmp_path / "b")]
    r = run_mpi(2, *args, timeout=120) if case == "params shorter" else run_here(capsys, *args)
    _one_error(r, path, detail, "--restart")
    assert not (tmp_path / "b").exists()


def test_a_forged_checkpoint_falls_back_to_the_previous_good_one(tmp_path, capsys):
    """Written by a job of 2 ranks; resumed by one rank in this process."""
    folder = tmp_path / "ck"
    r = run_mpi(2, *ARGS, "--epochs", "1", "--checkpoint-dir", str(folder),
                "--checkpoint-every", "5", "--keep-checkpoints", "5", "--out",
                str(tmp_path / "a"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    newest = ck.list_checkpoints(str(folder))[-1]
    meta, arrays = ck.read(newest)
    meta["epoch"] = -1
    _write(newest, meta, arrays)
    r = run_here(capsys, *ARGS, "--checkpoint-dir", str(folder), "--resume", "--out",
                 str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert newest in r.stderr and "previous good checkpoint" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_checkpoint_past_the_end_of_its_epoch_is_refused(written, tmp_path, capsys):
    """In this process, one rank (the forged checkpoints above end jobs of 2 ranks)."""
    path = _forge(written, tmp_path, _set(epoch=0, step=STEPS + 85))
    r = run_here(capsys, *ARGS, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "ck"),
              "--resume", "--out", str(tmp_path / "b"))
    _one_error(r, path, f"step {STEPS + 85}", f"{STEPS} steps")
    assert not (tmp_path / "b").exists()


def test_a_checkpoint_at_the_end_of_its_epoch_resumes(written, tmp_path, capsys):
    """(epoch, steps of the epoch) is what a periodic checkpoint after an epoch's last step
    holds: it resumes with no step left in that epoch (one rank, in this process)."""
    _forge(written, tmp_path, _set(epoch=0, step=STEPS))
    r = run_here(capsys, *ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
                 "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]


def test_check_position_names_the_checkpoint_and_the_numbers():
    state = ck.State(epoch=2, step=40, global_step=70)
    message = ck.check_position(state, 30, "P")
    assert message is not None and "P" in message and "40" in message and "30" in message
    assert "epoch 3" in message and "start over with restart" in message  # the keyword; the CLI: its flag
    assert ck.check_position(ck.State(epoch=2, step=30, global_step=90), 30, "P") is None


# --- another --sync on resume ------------------------------------------------------------------

def test_resuming_with_another_sync_is_announced(written, tmp_path):
    shutil.copytree(written, tmp_path / "ck")
    r = run_mpi(2, *ARGS, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--sync",
                "local-sgd", "--out", str(tmp_path / "b"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if "--sync local-sgd" in x]
    assert len(lines) == 1 and "allreduce" in lines[0], r.stdout
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert m["config"]["resume_changes"]["sync"] == {"checkpoint": "allreduce", "now": "local-sgd"}


def test_format_changes_says_a_new_exchange_apart_from_hyperparameters():
    changed, refusal = settings.compare_resume({"lr": 0.1, "sync": "allreduce", "sync_every": 4},
                                         {"lr": 0.05, "sync": "local-sgd", "sync_every": 4})
    assert refusal is None and set(changed) == {"lr", "sync"}
    line = settings.format_changes(changed)
    assert "\n" not in line and line.startswith(
        "resuming with changed hyperparameters: --lr 0.05 (the checkpoint used 0.1)")
    assert "--sync local-sgd (the checkpoint used allreduce)" in line
    only = settings.format_changes({"sync": changed["sync"]})
    assert only.startswith("resuming with another gradient exchange: --sync local-sgd"), only
    # a checkpoint whose configuration does not record the exchange announces nothing
    assert settings.compare_resume({"lr": 0.1}, {"lr": 0.1, "sync": "allreduce"}) == ({}, None)
    # --sync-every changes under the same --sync; under another one the --sync says it all
    was = {"sync": "local-sgd", "sync_every": 4, "compress": "bfloat16"}
    assert set(settings.compare_resume(was, {**was, "sync_every": 8})[0]) == {"sync_every"}
    assert set(settings.compare_resume({**was, "sync": "allreduce"},
                                 {**was, "sync": "accumulate", "sync_every": 2})[0]) == {"sync"}
