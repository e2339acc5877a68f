"""Where a run's outputs and settings go wrong, the command line says so in one line that
names the problem, the path and the fix, exits with 2 and leaves nothing half-written: a
full disk, an output path that is a folder or a dangling link or in an unwritable place, a
configuration file that is odd, a damaged ``history.jsonl``, and a timeline that cannot
record what was asked."""

from __future__ import annotations

import json
import os
import sys

import pytest
from helpers import run_here, run_mpi

from mpidp import nn
from mpidp.cli import build_parser
from mpidp.cli import main as cli_main
from mpidp.cli.config import load, tokens
from mpidp.cli.parser import subcommand
from mpidp.observe import plot as P
from mpidp.observe.history import History
from mpidp.observe.history import read as read_history

QUICK = ("--dataset", "digits", "--epochs", "1", "--no-progress")


def _one_error_line(stderr: str, *words: str) -> str:
    """The one ``error`` line of ``stderr``, which must hold every one of ``words``; no
    traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "error" in line]
    assert len(lines) == 1, stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _no_temporary_files(*folders) -> None:
    for folder in folders:
        if os.path.isdir(folder):
            left = [n for n in os.listdir(folder) if n.startswith(".tmp") or ".part" in n
                    or ".tmp" in n]
            assert not left, (folder, left)


# --- 1. a full disk -------------------------------------------------------------------

#: Runs ``mpidp`` in a process whose disk under ROOT holds at most FREE bytes per file:
#: ``fsync`` of a larger file there fails with ENOSPC, as it does on a full disk whose
#: blocks are allocated late (NFS, XFS, ext4 with delayed allocation).
FULL_DISK = """
import errno, os, sys
ROOT, FREE = os.path.abspath(sys.argv[1]), int(sys.argv[2])
_fsync = os.fsync
def fsync(fd):
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
    if where.startswith(ROOT + os.sep) and os.fstat(fd).st_size > FREE:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _fsync(fd)
os.fsync = fsync
from mpidp.cli.main import main
sys.exit(main(sys.argv[3:]))
"""


def _on_a_full_disk(tmp_path, root, free: int, *argv: str, n: int = 2):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    return run_mpi(n, str(script), str(root), str(free), *argv, module=False, timeout=120)


@pytest.mark.parametrize("free,failing", [(0, "history.jsonl"), (20_000, "model.npz")],
                         ids=["during-training", "at-the-end"])
def test_a_full_disk_under_out_is_named_and_nothing_is_half_written(tmp_path, free, failing):
    out = tmp_path / "out"
    r = _on_a_full_disk(tmp_path, out, free, "train", *QUICK, "--out", str(out))
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    _one_error_line(r.stderr, "the disk is full", str(out / failing), "--out")
    for name in ("model.npz", "metrics.json", "config.toml"):
        assert not (out / name).exists(), name
    _no_temporary_files(out)


@pytest.mark.parametrize("free,failing", [(0, "run.json"), (4096, "ckpt-")],
                         ids=["claiming-it", "a-checkpoint"])
def test_a_full_disk_under_checkpoint_dir_is_named(tmp_path, free, failing):
    ck, out = tmp_path / "ck", tmp_path / "out"
    r = _on_a_full_disk(tmp_path, ck, free, "train", *QUICK, "--out", str(out),
                        "--checkpoint-dir", str(ck))
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    _one_error_line(r.stderr, "the disk is full", str(ck / failing))
    assert not (out / "model.npz").exists()
    _no_temporary_files(ck)


def test_write_errors_are_one_line_naming_the_file_asked_for():
    import errno

    from mpidp.atomic import write_error
    quota = write_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/t/.tmp-x"), "/t/m.npz",
                        "--out")
    assert str(quota).startswith("the disk quota is used up: cannot write /t/m.npz (")
    assert "--out" in str(quota) and isinstance(quota, OSError) and quota.errno == errno.EDQUOT
    odd = str(write_error(OSError(errno.EACCES, "Permission denied", "/t/a\nb")))
    assert odd == "cannot write '/t/a\\nb' (Permission denied)" and "\n" not in odd


def test_files_written_together_are_all_replaced_or_none(tmp_path):
    from mpidp.atomic import WriteError, write_atomic, write_together
    (tmp_path / "a").write_bytes(b"old a")

    def full(path):
        raise OSError(28, os.strerror(28))

    with pytest.raises(WriteError, match=f"the disk is full: cannot write {tmp_path / 'b'} "):
        write_together([(str(tmp_path / "a"), lambda p: write_atomic(p, lambda f: f.write(b"new"))),
                        (str(tmp_path / "b"), full)], what="--out")
    assert sorted(os.listdir(tmp_path)) == ["a"] and (tmp_path / "a").read_bytes() == b"old a"
    write_together([(str(tmp_path / n), lambda p: write_atomic(p, lambda f: f.write(b"new")))
                    for n in ("a", "b")])
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and (tmp_path / "b").read_bytes() == b"new"


# --- 2, 3, 9. output paths --------------------------------------------------------------

@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.npz"
    layers, _ = nn.model_layers("mlp", (1, 8, 8), 10, (8,), True, False)
    nn.save(nn.Sequential(layers, (1, 8, 8)).init_(0), str(path))
    return str(path)


def _predict(capsys, model_file: str, out: str):
    """``mpidp predict`` of one rank, in this process."""
    return run_here(capsys, "predict", "--model", model_file, "--dataset", "digits", "--out", out)


def test_predict_into_an_existing_folder_is_refused_up_front(tmp_path, capsys, model_file):
    folder = tmp_path / "preds"
    folder.mkdir()
    r = _predict(capsys, model_file, str(folder))
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, f"--out {folder}", "is a folder", "predictions.npy")
    assert os.listdir(folder) == [] and sorted(os.listdir(tmp_path)) == ["preds"]


@pytest.mark.parametrize("command", ["train", "predict"])
def test_an_out_that_is_a_dangling_link_is_refused(tmp_path, capsys, model_file, command):
    link, target = tmp_path / "out", tmp_path / "gone" / "here"
    link.symlink_to(target)
    argv = (["train", *QUICK, "--out", str(link)] if command == "train" else
            ["predict", "--model", model_file, "--dataset", "digits", "--out", str(link)])
    r = run_here(capsys, *argv)
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, f"--out {link}", "symbolic link", str(target), "does not exist")
    assert link.is_symlink() and not os.path.lexists(target.parent)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_predict_into_an_unwritable_place_names_the_path_given(tmp_path, capsys, model_file):
    r = _predict(capsys, model_file, "/proc/p.npy")
    assert r.returncode == 2, r.stderr[-3000:]
    line = _one_error_line(r.stderr, "--out /proc/p.npy", "cannot write")
    assert ".part" not in line and ".tmp" not in line


@pytest.mark.parametrize("command", [["train", *QUICK], ["sweep", "--grid", "seed=0", *QUICK]])
def test_a_folder_out_in_an_unwritable_place_names_the_option(capsys, command):
    r = run_here(capsys, *command, "--out", "/proc/mpidp-out")
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, "--out /proc/mpidp-out", "cannot write")


# --- 4, 5, 6. configuration files ---------------------------------------------------

def _config_error(tmp_path, capsys, text: str | bytes) -> str:
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--config", str(path), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" not in captured.out + captured.err and not captured.out
    assert not (tmp_path / "o").exists()
    return _one_error_line(captured.err, f"--config {path}")


def test_help_in_a_config_file_is_refused_naming_the_file_and_the_key(tmp_path, capsys):
    assert "'help'" in _config_error(tmp_path, capsys, "epochs = 2\nhelp = true\n")


@pytest.mark.parametrize("value", ["--restart", "-h", "--help"])
def test_a_value_that_looks_like_an_option_names_the_file_key_and_value(tmp_path, capsys,
                                                                        value):
    line = _config_error(tmp_path, capsys, f'epochs = 2\ndataset = "{value}"\n')
    assert f'dataset = "{value}"' in line and "./" in line, line


def test_a_list_value_starting_with_a_minus_is_read_as_a_value():
    train = subcommand(build_parser(), "train")
    argv = tokens({"capacities": [-1, 2]}, train, source="f.toml")
    assert build_parser().parse_args(["train", *argv]).capacities == [-1.0, 2.0]


def test_a_value_stored_by_a_run_is_taken_as_written():
    train = subcommand(build_parser(), "train")
    argv = tokens({"dataset": "-x.npz"}, train, source="the checkpoint's settings",
                  literal=True)
    assert build_parser().parse_args(["train", *argv]).dataset == "-x.npz"


def test_a_config_file_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys):
    text = "epochs = 2\n# caf\xe9\nlr = 0.1\n".encode("latin-1")
    line = _config_error(tmp_path, capsys, text)
    assert "not UTF-8" in line and "line 2" in line, line
    with pytest.raises(ValueError, match=r"^--config .*c\.toml: not UTF-8 text \(byte 0xe9 "
                       r"on line 2\)"):
        load(str(tmp_path / "c.toml"))


# --- 7, 8. history.jsonl and mpidp plot --------------------------------------------

def _killed_run(folder, damage: str):
    with History(str(folder / "history.jsonl")) as h:
        h.config({"sync": "allreduce", "world_size": 2})
        h.epoch({"epoch": 1, "loss": 1.0, "accuracy": 0.5, "seconds": 0.1})
    path = folder / "history.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + damage + "\n" + lines[1])
    return path


@pytest.mark.parametrize("damage,why", [('{"kind": "epo', "not a JSON record"),
                                        ("[1, 2]", "not a JSON object")])
def test_a_broken_history_line_names_the_file_and_the_line(tmp_path, capsys, damage, why):
    path = _killed_run(tmp_path / "run", damage)
    with pytest.raises(ValueError, match=rf"^{path}, line 2: {why}"):
        read_history(str(path))
    rc = cli_main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "p.png")])
    assert rc == 2
    _one_error_line(capsys.readouterr().err, f"{path}, line 2")
    assert not (tmp_path / "p.png").exists()


def test_history_bytes_that_are_not_utf8_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_bytes(b'{"kind": "config"}\n{"kind": "epoch", "x": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"^{path}, line 2: not UTF-8"):
        read_history(str(path))


def test_a_damaged_metrics_file_is_named(tmp_path):
    (tmp_path / "metrics.json").write_text('{"history": [')
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'metrics.json'}: not valid JSON"):
        P.load_run(str(tmp_path))


@pytest.fixture
def finished_run(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    history = [{"epoch": 1, "loss": 1.0, "accuracy": 0.5, "seconds": 0.1},
               {"epoch": 2, "loss": 0.5, "accuracy": 0.7, "seconds": 0.1}]
    (folder / "metrics.json").write_text(json.dumps(
        {"history": history, "config": {"sync": "allreduce", "world_size": 1}}))
    return folder


@pytest.mark.parametrize("given,written", [("figs", "figs/plot.png"), ("figs/", "figs/plot.png"),
                                           ("loss", "loss.png"), ("loss.svg", "loss.svg")])
def test_plot_names_the_file_it_wrote(tmp_path, capsys, finished_run, given, written):
    pytest.importorskip("matplotlib")
    if given == "figs":
        (tmp_path / "figs").mkdir()
    rc = cli_main(["plot", str(finished_run), "--out", str(tmp_path) + os.sep + given])
    assert rc == 0
    target = tmp_path / written
    assert capsys.readouterr().out.startswith(f"wrote {target} ")
    assert target.is_file() and target.stat().st_size > 1000
    assert sorted(p.name for p in target.parent.iterdir() if p.name != "run") == [target.name]


def test_plot_refuses_a_format_it_cannot_write(tmp_path, capsys, finished_run):
    pytest.importorskip("matplotlib")
    rc = cli_main(["plot", str(finished_run), "--out", str(tmp_path / "p.txt")])
    assert rc == 2
    _one_error_line(capsys.readouterr().err, f"--out {tmp_path / 'p.txt'}", "png")
    assert sorted(os.listdir(tmp_path)) == ["run"]


# --- 10. paths that config.toml must record ------------------------------------------

def test_an_out_with_a_newline_reads_back_from_its_config_toml(tmp_path, capsys):
    out = tmp_path / "a\nb"
    r = run_here(capsys, "train", *QUICK, "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    table = load(str(out / "config.toml"))
    train = subcommand(build_parser(), "train")
    back = build_parser().parse_args(["train", *tokens(table, train, source="c")])
    assert back.out == str(out) and back.dataset == "digits"


@pytest.mark.skipif(sys.getfilesystemencoding() != "utf-8", reason="a UTF-8 file system")
def test_an_out_that_config_toml_cannot_record_is_refused_up_front(tmp_path, capsys):
    out = str(tmp_path) + "/bad\udcff"  # the byte 0xff: no UTF-8 text, no TOML string
    r = run_here(capsys, "train", *QUICK, "--out", out)
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, "--out", "not UTF-8", "config.toml")
    assert os.listdir(tmp_path) == []


# --- 11, 12. the timeline --------------------------------------------------------------

def test_a_trace_range_beyond_the_run_is_refused_before_training(tmp_path):
    """By a job of 2 ranks: the ranks' refusal is one line (rank 0's) and exit 2."""
    out, trace = tmp_path / "out", tmp_path / "t.json"
    r = run_mpi(2, "train", *QUICK, "--out", str(out), "--trace", str(trace),
                "--trace-steps", "1000:1010", timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, "--trace-steps 1000:1010", "23 steps")
    assert not out.exists() and not trace.exists()


def test_a_trace_range_a_resumed_run_has_passed_is_said(tmp_path, capsys):
    """Runs of one rank in this process."""
    out, ck, trace = tmp_path / "out", tmp_path / "ck", tmp_path / "t.json"
    r = run_here(capsys, "train", *QUICK, "--out", str(out), "--checkpoint-dir", str(ck))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_here(capsys, "train", *QUICK, "--epochs", "2", "--out", str(out), "--checkpoint-dir",
                 str(ck), "--resume", "--trace", str(trace), "--trace-steps", "0:5")
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in (r.stdout + r.stderr).splitlines() if "--trace-steps 0:5" in line]
    assert len(said) == 1 and "warning" in said[0] and "23 to 45" in said[0], said
    assert json.loads(trace.read_text())["otherData"]["steps"] == [0, 5]


def test_a_trace_into_a_folder_is_refused_before_training(tmp_path, capsys):
    """A run of one rank in this process (the ranks' refusal as one line from a job:
    test_a_trace_range_beyond_the_run_is_refused_before_training)."""
    out, folder = tmp_path / "out", tmp_path / "traces"
    folder.mkdir()
    r = run_here(capsys, "train", *QUICK, "--out", str(out), "--trace", str(folder))
    assert r.returncode == 2, r.stderr[-3000:]
    _one_error_line(r.stderr, f"--trace {folder}", "is a folder", "trace.json")
    assert not out.exists() and os.listdir(folder) == []
    assert sorted(os.listdir(tmp_path)) == ["traces"]


def test_the_trace_file_is_never_left_half_written(tmp_path, monkeypatch):
    import mpidp.comm
    from mpidp.observe import trace as T
    monkeypatch.setattr(mpidp.comm, "gather_obj", lambda comm, obj: [obj])
    monkeypatch.setattr(T, "clock_offsets", lambda comm: (0.0, 0.0))

    def full(fd):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"the disk is full: cannot write {tmp_path / 't.json'}"):
        T.write(type("Comm", (), {"rank": 0})(), T.Tracer(0, "h"), str(tmp_path / "t.json"))
    assert os.listdir(tmp_path) == []
