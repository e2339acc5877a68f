"""``mpidp train --config FILE`` (:mod:`mpidp.cli.config`), without MPI: a written
configuration reads back to the same arguments, the command line wins, and every bad file is
an error naming the file and the key or line."""

from __future__ import annotations

import argparse
import json

import pytest

from mpidp.cli import build_parser
from mpidp.cli import main as cli_main
from mpidp.cli.config import NOT_STORED, dumps, load, tokens
from mpidp.cli.options import given


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["train"]


TRAIN = _train_parser()

#: A run far from the defaults: tuples, lists, a dict, flags, None, odd characters.
RUN = ["--dataset", 'data "x"\\y\nz.npz', "--hidden", "32,16", "--epochs", "3", "--lr", "0.1",
       "--sync", "ps", "--ps-placement", "dedicated", "--partition", "weighted",
       "--capacities", "1,2.5", "--slowdown", "1:2,2:1.5", "--drop-last", "--no-shuffle",
       "--n-classes", "3", "--watchdog", "0", "--checkpoint-dir", "ck", "--optimizer", "adam",
       "--momentum", "0.5", "--test-fraction", "0.125", "--dtype", "float64",
       "--import", "my.layers", "--import", "lib/more layers.py",
       # not stored: what to do now and how to show it
       "--quiet", "--trace", "t.json", "--trace-steps", "1:3", "--log-every", "2", "--resume",
       "--restart"]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def _config(args: argparse.Namespace) -> dict:
    """What a run records (as ``mpidp train`` does)."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    return {**config, "world_size": 3}


def _stored(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in NOT_STORED}


@pytest.mark.parametrize("argv", [[], RUN], ids=["defaults", "everything"])
def test_a_written_configuration_reads_back_to_the_same_arguments(tmp_path, argv):
    args = _parse(argv)
    path = tmp_path / "config.toml"
    path.write_text(dumps(_config(args)))
    back = _parse(tokens(load(str(path)), TRAIN, source=str(path)))
    assert _stored(back) == _stored(args)
    if argv:
        assert _stored(back) != _stored(_parse([]))
        assert back.slowdown == {1: 2.0, 2: 1.5} and back.hidden == (32, 16)
        assert back.dataset == 'data "x"\\y\nz.npz'
        assert getattr(back, "import") == ["my.layers", "lib/more layers.py"]
    for dest in NOT_STORED & set(vars(args)) - {"command"}:  # left out: defaults again
        assert getattr(back, dest) == TRAIN.get_default(dest), dest


def test_a_configuration_through_json_reads_back_too():
    """As a checkpoint stores it: JSON turns the --slowdown ranks into strings."""
    args = _parse(RUN)
    table = json.loads(json.dumps(_config(args)))
    assert _stored(_parse(tokens(table, TRAIN))) == _stored(args)


def test_not_stored_keys_are_neither_written_nor_read():
    config = {**{k: 1 for k in NOT_STORED}, "epochs": 5}
    assert dumps(config).splitlines()[1:] == ["epochs = 5"]
    table = {"quiet": True, "verbose": True, "no_progress": True, "trace": "t.json",
             "trace_steps": "1:2", "tensorboard": "tb", "log_every": 2, "resume": True,
             "restart": True, "config": "other.toml", "command": "predict", "world_size": 8,
             "data_fingerprint": "abc", "resume_changes": {"lr": [0.1, 0.2]}, "progress": "bar"}
    assert set(table) == NOT_STORED
    assert tokens(table, TRAIN, literal=True) == []  # a run's stored settings
    with pytest.raises(ValueError, match="a configuration file cannot name another"):
        tokens(table, TRAIN)


def test_options_of_one_invocation_apply_from_a_hand_written_file():
    """quiet, trace, log-every ... in a --config file used to be dropped in silence; what a
    run records about itself (world size, data fingerprint) is still left out."""
    table = {"quiet": True, "trace": "t.json", "log-every": 2, "world_size": 8,
             "data_fingerprint": "abc", "command": "train"}
    args = TRAIN.parse_args(tokens(table, TRAIN))
    assert args.quiet and args.trace == "t.json" and args.log_every == 2


def test_the_command_line_wins_over_the_file():
    table = {"epochs": 5, "lr": 0.5, "drop-last": True, "hidden": [8]}
    after = ["--epochs", "10", "--lr=0.25"]  # 10 is the default: still given
    args = _parse([*tokens(table, TRAIN, skip=given(TRAIN, after)), *after])
    assert (args.epochs, args.lr, args.drop_last, args.hidden) == (10, 0.25, True, (8,))
    assert tokens(table, TRAIN, skip={"epochs", "lr", "drop_last", "hidden"}) == []


def test_a_repeatable_option_is_given_once_per_value():
    assert tokens({"import": ["a.b", "c.py"]}, TRAIN) == ["--import", "a.b", "--import", "c.py"]
    assert tokens({"import": "a.b"}, TRAIN) == ["--import", "a.b"]
    assert getattr(_parse(tokens({"import": ["a.b", "c.py"]}, TRAIN)), "import") == ["a.b",
                                                                                    "c.py"]
    with pytest.raises(ValueError, match=r'^f\.toml: import = \["a", "-b"\] looks like an '
                       r"option, not a value: give the value \(a path that starts with '-' "
                       r"as \./-b\)$"):
        tokens({"import": ["a", "-b"]}, TRAIN, source="f.toml")


def test_both_spellings_of_a_key_and_false_flags():
    assert tokens({"batch-size": 8, "no_shuffle": False}, TRAIN) == ["--batch-size", "8"]
    with pytest.raises(ValueError, match="f.toml: batch-size and batch_size are the same"):
        tokens({"batch-size": 8, "batch_size": 16}, TRAIN, source="f.toml")


@pytest.mark.parametrize("key", ["epoch", "help", "runs", "train"])
def test_an_unknown_key_is_named(key):
    with pytest.raises(ValueError, match=rf"^--config f\.toml: '{key}' is not an option of "
                       "mpidp train$"):
        tokens({"epochs": 2, key: 1}, TRAIN, source="--config f.toml")


BAD_VALUES = {
    "epochs": ("ten", 'epochs = "ten"'),
    "batch-size": (2.5, "batch-size = 2.5"),
    "lr": (True, "lr = true"),
    "dataset": (False, "dataset = false"),
    "momentum": (1.5, "momentum = 1.5"),
    "sync": ("fast", 'sync = "fast"'),
    "capacities": (["a", 1], 'capacities = ["a", 1]'),
    "hidden": ([8, 0], "hidden = [8, 0]"),
    "slowdown": ("1", 'slowdown = "1"'),
    "drop-last": ("yes", "drop-last must be true or false"),
}


@pytest.mark.parametrize("key", sorted(BAD_VALUES))
def test_a_value_of_the_wrong_type_names_the_file_and_the_key(key):
    value, shown = BAD_VALUES[key]
    with pytest.raises(ValueError) as err:
        tokens({key: value}, TRAIN, source="--config f.toml")
    assert str(err.value).startswith(f"--config f.toml: {shown}"), err.value


def test_the_command_refuses_a_bad_file_before_mpi(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('epochs = 2\nsync = "fast"\n')
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--config", str(path), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"mpidp: error: --config {path}: sync = \"fast\": choose from allreduce" in err
    assert not (tmp_path / "o").exists()


def test_malformed_toml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("epochs = 3\nlr = \nseed = 1\n")
    with pytest.raises(ValueError, match=rf"^--config {path}: not valid TOML .*line 2"):
        load(str(path))


def test_a_missing_file_is_named(tmp_path):
    path = tmp_path / "none.toml"
    with pytest.raises(ValueError, match=rf"^--config {path}: cannot read it"):
        load(str(path))
    with pytest.raises(ValueError, match="is a folder: give the path of a regular file"):
        load(str(tmp_path))


def test_strings_are_valid_toml_whatever_they_hold(tmp_path):
    text = 'tab\tquote"back\\slash\nnew\rline\x01\x7f é'
    path = tmp_path / "c.toml"
    path.write_text(dumps({"dataset": text, "out": "o"}))
    assert load(str(path)) == {"dataset": text, "out": "o"}


def test_a_file_naming_another_config_is_refused_by_the_command(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('epochs = 1\nconfig = "other.toml"\n')
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--config", str(path), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    assert "a configuration file cannot name another" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
