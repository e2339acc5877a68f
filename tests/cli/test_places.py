"""Every path-valued option of every command (found from its declaration, a Place type) is
refused at once, before MPI, when it names a FIFO, a device, a link to a device, or a
folder where a file is expected: one line naming the option, the path and what it is, exit
2. Outputs never replace what is not theirs; text inputs are read to a bound."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from mpidp.atomic import TEXT_LIMIT, read_text, write_atomic
from mpidp.cli import build_parser
from mpidp.cli.main import main
from mpidp.cli.parser import subcommand
from mpidp.cli.places import places

#: What each command needs besides the option tried (its path in {}).
NEEDS = {"train": [], "predict": ["--model", "{m}", "--dataset", "digits", "--out", "{o}.npy"],
         "plot": ["{r}", "--out", "{o}.png"], "export": ["{m}", "--out", "{o}.onnx"],
         "model": [], "info": [], "sweep": ["--grid", "seed=0"], "check-layer": ["Dense"]}


def _cases():
    parser = build_parser()
    for name in NEEDS:
        for action, place in places(subcommand(parser, name)):
            for hostile in ("fifo", "device", "link", "folder"):
                if hostile == "folder" and (place.folder or place.writes) \
                        or place.parse and hostile == "device":
                    continue  # a folder taken, or refused by the output's check (below);
                    # a model file ends in .toml
                want = ("a regular file or a folder" if place.file and place.folder else
                        "a folder" if place.folder else "the path of a regular file")
                yield pytest.param(name, action.option_strings, action.dest, hostile, want,
                                   id=f"{name}-{action.dest}-{hostile}")


def test_every_command_has_its_paths_declared():
    parser = build_parser()
    assert set(NEEDS) == set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001
    declared = {(n, a.dest) for n in NEEDS for a, _ in places(subcommand(parser, n))}
    assert {("train", d) for d in ("dataset", "model", "import", "out", "config",
                                   "tensorboard", "checkpoint_dir", "costs", "trace")} <= declared
    assert {("predict", d) for d in ("model", "import", "dataset", "out", "metrics")} <= declared
    assert {("plot", "runs"), ("plot", "out"), ("export", "model"), ("export", "out"),
            ("model", "out")} <= declared


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("places")
    os.mkfifo(root / "fifo")
    os.symlink("/dev/zero", root / "link")
    (root / "folder").mkdir()
    (root / "run").mkdir()
    return root


def _alarm(signum, frame):
    raise TimeoutError("blocked: the path was opened")


@pytest.mark.parametrize("command,flags,dest,hostile,want", list(_cases()))
def test_a_path_that_is_no_regular_file_is_refused_at_once(tree, capsys, command, flags,
                                                           dest, hostile, want):
    path = {"fifo": str(tree / "fifo"), "device": "/dev/zero", "link": str(tree / "link"),
            "folder": str(tree / "folder")}[hostile]
    value = path + ".toml" if hostile != "device" and dest == "model" and command == "train" \
        else path
    if hostile == "fifo" and value.endswith(".toml") and not os.path.exists(value):
        os.mkfifo(value)
    elif hostile == "link" and value.endswith(".toml") and not os.path.lexists(value):
        os.symlink("/dev/zero", value)
    elif hostile == "folder" and value.endswith(".toml"):
        os.makedirs(value, exist_ok=True)
    needs = [a.format(m=tree / "run", o=tree / "out", r=tree / "run") for a in NEEDS[command]]
    if flags:  # an option: replace the one it needs, or add it
        if flags[0] in needs:
            needs[needs.index(flags[0]) + 1] = value
        else:
            needs += [flags[0], value]
        what = flags[0]
    else:  # the positional argument
        needs[needs.index(str(tree / "run"))] = value
        what = None
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        with pytest.raises(SystemExit) as exc:
            main([command, *needs])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    err = capsys.readouterr().err
    kind = {"fifo": "is a FIFO", "device": "is a character device",
            "link": "is a character device (a symbolic link to /dev/zero)",
            "folder": "is a folder"}[hostile]
    assert exc.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{what or ''} {value} {kind}".strip() in lines[0], err
    assert f": give {want}" in lines[0], err


def test_a_text_file_above_the_limit_is_refused_not_read(tmp_path):
    big = tmp_path / "model.toml"
    with open(big, "wb") as f:
        f.truncate(TEXT_LIMIT + 1)
    with pytest.raises(ValueError, match="model.toml is over 16 MiB"):
        read_text(str(big), "--model")


@pytest.mark.parametrize("argv", [["train", "--model"], ["train", "--config"],
                                  ["sweep", "--grid", "seed=0", "--trials"]])
def test_a_text_file_above_the_limit_is_refused_in_one_line_naming_its_option(tmp_path, capsys,
                                                                             argv):
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(TEXT_LIMIT + 1)
    with pytest.raises(SystemExit) as exc:
        main([*argv, str(big)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and lines == [
        f"mpidp: error: {argv[-1]} {big} is over 16 MiB, too large for a text file of "
        f"settings: give the right file"], lines


@pytest.mark.parametrize("text", [None, b"\xff", b"epochs = "])
def test_a_config_file_that_cannot_be_read_is_refused_in_one_line(tmp_path, capsys, text):
    path = tmp_path / "c.toml"
    if text is not None:
        path.write_bytes(text)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"mpidp: error: --config {path}: "), lines


def test_a_write_follows_a_link_and_never_replaces_a_device(tmp_path):
    target = tmp_path / "t.json"
    target.write_text("old")
    os.symlink(target, tmp_path / "link.json")
    write_atomic(str(tmp_path / "link.json"), lambda f: f.write(b"new"))
    assert os.path.islink(tmp_path / "link.json") and target.read_text() == "new"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError, match="is a FIFO"):
        write_atomic(str(tmp_path / "fifo"), lambda f: f.write(b"x"))
    assert not os.path.isfile(tmp_path / "fifo")


def test_predict_out_through_a_link_writes_the_target(tmp_path, capsys):
    """A predict of one rank in this process, with a model made for the digits (untrained:
    where the predictions go is what counts)."""
    from helpers import run_here

    from mpidp import nn
    layers, _ = nn.model_layers("mlp", (1, 8, 8), 10, (8,), True, False)
    nn.save(nn.Sequential(layers, (1, 8, 8)).init_(0), str(tmp_path / "model.npz"))
    target = tmp_path / "p.npy"
    np.save(target, np.zeros(1))
    os.symlink(target, tmp_path / "link.npy")
    r = run_here(capsys, "predict", "--model", str(tmp_path / "model.npz"), "--dataset", "digits",
                 "--out", str(tmp_path / "link.npy"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.islink(tmp_path / "link.npy") and np.load(target).shape[0] == 1797
