"""Which source of a ``mpidp train`` setting wins (:mod:`mpidp.cli.settings`), without MPI:
default < checkpoint < config file < command line; a file setting a typed flag makes moot is
left out; a resume keeps the stored settings, allows the listed changes and refuses a change
of one that must match."""

from __future__ import annotations

import pytest

from mpidp.cli import build_parser, settings
from mpidp.cli.parser import subcommand


def _file(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def _with_file(tmp_path, text: str, *typed: str):
    """The settled arguments of ``train --config FILE typed...`` and the options given."""
    parser = build_parser()
    argv = ["train", "--config", _file(tmp_path, text), *typed]
    args, _, from_file = settings.with_config_file(parser, argv, argv[2])
    given = settings.settle(args, subcommand(parser, "train"), argv[1:], from_file)
    return args, given


def test_the_command_line_wins_over_the_file_which_wins_over_the_defaults(tmp_path):
    args, given = _with_file(tmp_path, "lr = 0.5\nepochs = 3\n", "--lr", "0.2")
    assert (args.lr, args.epochs, args.batch_size) == (0.2, 3, 64)
    assert {"lr", "epochs", "config"} <= given and "batch_size" not in given


def test_a_file_setting_a_typed_flag_makes_moot_is_left_out(tmp_path):
    args, given = _with_file(tmp_path, 'optimizer = "momentum"\nmomentum = 0.5\n',
                             "--optimizer", "adam")
    assert args.optimizer == "adam" and args.momentum == 0.9  # back at its default
    assert "momentum" not in given


@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_a_file_setting_the_file_itself_contradicts_counts_as_given(tmp_path, momentum):
    """Refused later as its flag would be, even at its default value: written, it says
    something."""
    _, given = _with_file(tmp_path, f'optimizer = "sgd"\nmomentum = {momentum}\n')
    assert "momentum" in given


def test_a_resume_keeps_the_stored_settings_under_the_file_and_the_command_line(tmp_path):
    parser = build_parser()
    argv = ["train", "--config", _file(tmp_path, "lr = 0.3\n"), "--epochs", "8"]
    _, argv, _ = settings.with_config_file(parser, argv, argv[2])
    stored = {"lr": 0.1, "epochs": 5, "batch_size": 32, "quiet": True, "world_size": 4}
    args, _ = settings.with_stored(parser, argv, stored)
    assert (args.lr, args.epochs, args.batch_size) == (0.3, 8, 32)
    assert args.quiet is False  # how to show a run is not stored


CONFIG = {"dataset": "digits", "batch_size": 64, "lr": 0.1, "sync": "allreduce",
          "sync_every": 4, "epochs": 5}


def test_a_resume_may_change_the_listed_settings():
    changed, refusal = settings.compare_resume(CONFIG, {**CONFIG, "lr": 0.05, "sync": "ps"})
    assert refusal is None
    assert changed == {"lr": {"checkpoint": 0.1, "now": 0.05},
                       "sync": {"checkpoint": "allreduce", "now": "ps"}}
    assert settings.format_changes(changed) == (
        "resuming with changed hyperparameters: --lr 0.05 (the checkpoint used 0.1); with "
        "another gradient exchange: --sync ps (the checkpoint used allreduce)")


def test_a_setting_of_another_sync_is_no_change_of_its_own():
    changed, _ = settings.compare_resume(CONFIG, {**CONFIG, "sync": "ps", "sync_every": 8})
    assert set(changed) == {"sync"}


def test_a_resume_announces_every_flag_of_the_mode_it_keeps():
    """Each flag of the table is an exchange setting: changed under the same ``--sync`` it is
    announced with the exchange (bucket size, error feedback ... not only ``--sync-every``)."""
    from mpidp.cli.flags import FLAGS
    saved = {**CONFIG, "sync": "compressed", "bucket_mb": 1.0, "error_feedback": "on"}
    changed, refusal = settings.compare_resume(saved, {**saved, "bucket_mb": 2.0,
                                                       "error_feedback": "off"})
    assert refusal is None and set(changed) == {"bucket_mb", "error_feedback"}
    assert settings.format_changes(changed).startswith("resuming with another gradient "
                                                       "exchange: --bucket-mb 2.0")
    assert {f.dest for f in FLAGS} <= set(settings.RESUME_EXCHANGE)


def test_a_resume_must_match_the_settings_that_shape_the_run():
    changed, refusal = settings.compare_resume(CONFIG, {**CONFIG, "batch_size": 16}, path="P")
    assert changed == {}
    assert refusal == "checkpoint P was written with different settings: --batch-size 64 (now 16)"
    assert set(settings.RESUME_MUST_MATCH).isdisjoint(settings.RESUME_MAY_CHANGE)
