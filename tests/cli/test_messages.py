"""What a user reads first: usage errors, option ranges, suggestions for misspellings, the
end-of-run balance line, and the README and docs pages that describe the command line."""

from __future__ import annotations

import configparser
import json
import re

import numpy as np
import pytest
from helpers import ROOT, run_here, run_mpi

from mpidp.cli.parser import build_parser
from mpidp.cli.values import number as _number
from mpidp.data.balance import balance_figures, format_balance
from mpidp.observe.metrics import STEP_FIELDS


def _error(capsys, monkeypatch, *argv: str) -> list[str]:
    """The stderr lines of a parse that fails with status 2."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()


def test_a_bad_value_is_two_lines_without_the_usage_block(capsys, monkeypatch):
    assert _error(capsys, monkeypatch, "train", "--epochs", "-1") == [
        "mpidp train: error: argument --epochs: must be an integer >= 1, got -1",
        "See 'mpidp train --help' for the options."]


def test_a_bad_command_points_to_the_commands(capsys, monkeypatch):
    lines = _error(capsys, monkeypatch)
    assert lines == ["mpidp: error: the following arguments are required: command",
                     "See 'mpidp --help' for the commands."]


@pytest.mark.parametrize("argv,message", [
    (["--epochs", "-1"], "--epochs: must be an integer >= 1, got -1"),
    (["--epochs", "1.5"], "--epochs: expected an integer, got '1.5'"),
    (["--seed", "-2"], "--seed: must be an integer >= 0, got -2"),
    (["--n-classes", "1"], "--n-classes: must be an integer >= 2, got 1"),
    (["--lr", "0"], "--lr: must be a finite number > 0, got 0"),
    (["--lr", "inf"], "--lr: must be a finite number > 0, got inf"),
    (["--lr", "x"], "--lr: expected a number, got 'x'"),
    (["--weight-decay", "-1"], "--weight-decay: must be a finite number >= 0, got -1"),
    (["--momentum", "1"], "--momentum: must be a number >= 0 and < 1, got 1"),
    (["--test-fraction", "nan"], "--test-fraction: must be a number >= 0 and < 1, got nan"),
])
def test_ranges_are_said_in_words(capsys, monkeypatch, argv, message):
    line = _error(capsys, monkeypatch, "train", *argv)[0]
    assert line == f"mpidp train: error: argument {message}"


def test_number_parser_closes_open_integer_bounds():
    with pytest.raises(Exception, match=r"^must be an integer >= 1 and <= 4, got 9$"):
        _number(int, 0, 5, low_open=True)("9")
    with pytest.raises(Exception, match=r"^must be a number > 0 and <= 1, got 2$"):
        _number(float, 0, 1, low_open=True, high_open=False)("2")
    assert _number(int, 0, low_open=True)("1") == 1


@pytest.mark.parametrize("argv,line", [
    (["train", "--epoch", "3"],
     "mpidp train: error: unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
    (["train", "--batchsize=8"],
     "mpidp train: error: unrecognized arguments: --batchsize=8 (did you mean --batch-size?)"),
    (["train", "--batchsize", "8", "--epoch", "3"],
     "mpidp train: error: unrecognized arguments: --batchsize 8 --epoch 3; did you mean "
     "--batch-size for --batchsize, --epochs for --epoch?"),
    (["train", "--zzzz"], "mpidp train: error: unrecognized arguments: --zzzz"),
    (["predict", "--model", "m", "--dataset", "d", "--out", "o.npy", "--chunksize", "9"],
     "mpidp predict: error: unrecognized arguments: --chunksize 9 (did you mean --chunk-size?)"),
])
def test_a_misspelt_option_gets_the_closest_one(capsys, monkeypatch, argv, line):
    lines = _error(capsys, monkeypatch, *argv)
    assert lines == [line, f"See '{line.split(':')[0]} --help' for the options."]


def test_a_misspelt_command_or_choice_gets_the_closest_one(capsys, monkeypatch):
    first = _error(capsys, monkeypatch, "trian")[0]
    assert first.startswith("mpidp: error: argument command: invalid choice: 'trian'")
    assert first.endswith("(did you mean train?)")
    first = _error(capsys, monkeypatch, "train", "--optimizer", "adma")[0]
    assert first.endswith("invalid choice: 'adma' (choose from 'sgd', 'momentum', 'adam', "
                          "'adamw', 'lars', 'lamb') (did you mean adam?)")


def test_every_rank_exits_2_and_rank_0_alone_speaks():
    r = run_mpi(3, "train", "--epoch", "3", timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("did you mean --epochs?") == 1, r.stderr[-2000:]
    assert "usage:" not in r.stderr


def test_a_bad_progress_interval_is_refused_before_any_work(tmp_path):
    """By a job of 2 ranks: the ranks' own refusal (after the parser) exits 2 on every rank
    and is printed once, by rank 0; the other refusals of settings are run in this process."""
    out = tmp_path / "run"
    r = run_mpi(2, "train", "--dataset", "synthetic", "--epochs", "1", "--out", str(out),
                env={"MPIDP_PROGRESS_SECONDS": "-3"}, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("MPIDP_PROGRESS_SECONDS='-3'") == 1, r.stderr[-2000:]
    assert "data:" not in r.stdout and not out.exists()  # nothing read, nothing written


FIG = {"strategy": "block", "imbalance": 1.2, "imbalance_cpu": 1.1, "efficiency": 0.8,
       "efficiency_cpu": 0.85, "slowest_rank": 1, "rate": 55.0, "ideal_rate": 100.0,
       "attainable_rate": 61.0, "fixed_s": 0.25,
       "per_rank": [{"rank": r, "samples": 10, "cost": 10.0, "compute_s": 1.0, "wait_s": 0.1,
                     "comm_s": 0.01, "idle_fraction": 0.1} for r in range(2)]}


def test_the_balance_line_speaks_plainly():
    text = format_balance(FIG, per_rank=False)
    assert text.splitlines()[1] == (
        "  training ran at 55% of the ranks' combined compute speed (communication, the "
        "optimizer update and waiting for slower ranks took the rest); a split of the rows in "
        "proportion to the ranks' speeds would reach 61%")
    assert "attainable" not in text and "cost/s" not in text
    detail = format_balance(FIG)
    assert "throughput 55 cost/s; 0.250 s of communication + update" in detail
    assert "n/a" not in format_balance({**FIG, "ideal_rate": 0.0, "attainable_rate": 0.0},
                                       per_rank=False)


def test_one_rank_has_no_slowest_rank_only_the_compute_share():
    """On one rank ``rate / ideal_rate`` is compute / (compute + collective + update)."""
    rec = np.zeros((1, 4, len(STEP_FIELDS)))
    for name, value in (("compute_s", 0.6), ("comm_s", 0.1), ("update_s", 0.3),
                        ("samples", 8), ("cost", 8)):
        rec[0, :, STEP_FIELDS.index(name)] = value
    fig = {**balance_figures(rec), "strategy": "block"}
    text = format_balance(fig, per_rank=False)
    assert text == ("load balance (block): one rank, nothing to balance; forward and backward "
                    "took 60% of the step time, the optimizer update and the collective the rest")
    assert "slowest" not in text and "waiting" not in text


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_names_every_command():
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
    assert f"has {words[len(commands)]} commands" in _readme()
    for name in commands:
        assert f"| `mpidp {name}` |" in _readme(), name


def test_readme_extras_table_matches_setup_cfg_and_the_messages():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    rows = {line.split("|")[1]: line.split("|")[2] for line in _readme().splitlines()
            if line.startswith("| `") and line.split("|")[1].strip().startswith("`")}
    listed = {n for cell in rows for n in re.findall(r"`([a-z]+)`", cell)}
    full_row = next(v for k, v in rows.items() if k.strip() == "`full`").lower()
    for package in extras["full"].split():
        assert package.lower() in full_row, package
    named = {m for p in (ROOT / "mpidp").rglob("*.py")
             for m in re.findall(r"mpidp\[([a-z]+)\]", p.read_text())}
    assert named and named <= listed, named - listed


def test_docs_index_describes_the_compare_page():
    row = next(line for line in (ROOT / "docs" / "index.md").read_text().splitlines()
               if "(benchmarks-compare.md)" in line)
    assert "other tools" not in row and "mpidp's own modes" in row


def test_the_example_writes_nothing():
    code = (ROOT / "examples" / "train_mlp.py").read_text()
    assert "np.save" not in code and "open(" not in code


def test_a_config_file_that_names_the_out_folder_says_so(tmp_path, capsys):
    """Said once by a job of 2 ranks (rank 0 alone); not said where --out is typed (a run
    of one rank in this process)."""
    out = tmp_path / "from-file"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'dataset = "digits"\nepochs = 1\nout = "{out}"\n')
    r = run_mpi(2, "train", "--config", str(cfg), "-q")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(f"writing into --out {out} as --config {cfg} says") == 1, r.stderr
    assert (out / "model.npz").exists()
    r = run_here(capsys, "train", "--config", str(cfg), "--out", str(tmp_path / "mine"), "-q")
    assert r.returncode == 0 and "writing into --out" not in r.stderr, r.stderr


def test_a_setting_from_a_file_that_an_override_makes_moot_is_left_out(tmp_path, capsys):
    """A file's momentum under --optimizer adam typed over it: trained, not refused, and
    the new record has no momentum; typed on the command line, it is refused (runs of one
    rank in this process: the ranks' refusal printed once by a job is
    test_a_bad_progress_interval_is_refused_before_any_work)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nepochs = 1\noptimizer = "momentum"\nmomentum = 0.95\n')
    out = tmp_path / "adam"
    r = run_here(capsys, "train", "--config", str(cfg), "--optimizer", "adam", "--out", str(out),
                 "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = (out / "config.toml").read_text()
    assert 'optimizer = "adam"' in recorded and "momentum" not in recorded, recorded
    r = run_here(capsys, "train", "--config", str(cfg), "--optimizer", "adam", "--momentum",
                 "0.9", "--out", str(tmp_path / "typed"), "-q")
    assert r.returncode == 2 and "--momentum does not apply to --optimizer adam" in r.stderr


@pytest.mark.parametrize("table, typed, gone", [
    ('sync = "accumulate"\nsync-every = 3\n', "auto", "sync-every"),
    ('sync = "overlapped"\noverlap-finish = "forward"\non-nonfinite = "ignore"\n',
     "compressed", "overlap-finish"),
])
def test_a_file_setting_another_mode_typed_over_it_makes_moot_is_left_out(tmp_path, capsys,
                                                                          table, typed, gone):
    """A run's record of one mode's own settings reused with another --sync typed: trained
    under the typed mode, and the new record leaves the first mode's settings out; typed on
    the command line, the setting is refused (runs of one rank in this process: a mode's
    settings are taken or refused before any exchange)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nepochs = 1\n' + table)
    out = tmp_path / "o"
    r = run_here(capsys, "train", "--config", str(cfg), "--sync", typed, "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = (out / "config.toml").read_text()
    assert f'sync = "{typed}"' in recorded and gone not in recorded, recorded
    r = run_here(capsys, "train", "--config", str(cfg), "--sync", typed, f"--{gone}",
              table.split(f"{gone} = ")[1].split("\n")[0].strip('"'), "--out",
              str(tmp_path / "typed"), "-q")
    assert r.returncode == 2 and f"--{gone} does not apply to --sync {typed}" in r.stderr, \
        r.stderr[-2000:]


@pytest.mark.parametrize("table, message", [
    ('optimizer = "adam"\nmomentum = 0.5\n', "--momentum does not apply to --optimizer adam"),
    ('sync = "auto"\nsync-every = 3\n', "--sync-every does not apply to --sync auto"),
    ('sync = "auto"\ndtype = "float64"\ncompress = "int8"\n',
     "--compress does not apply to --sync auto with --dtype float64"),
    # at their default values: written in the file, they still say something wrong
    ('optimizer = "sgd"\nmomentum = 0.9\n', "--momentum does not apply to --optimizer sgd"),
    ('bucket-mb = 1.0\n', "--bucket-mb does not apply to --sync allreduce"),
    ('lr-gamma = 0.1\n', "--lr-gamma does not apply to --lr-schedule constant"),
])
def test_a_file_that_contradicts_itself_is_refused_not_trimmed(tmp_path, capsys, table, message):
    """Leaving out is for a file setting the command line made moot; the same setting
    moot within the file itself is the file's mistake, refused as the flag would be (the
    refusal in this process, a run of one rank: the ranks' refusal printed once by a job is
    test_a_bad_progress_interval_is_refused_before_any_work)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nepochs = 1\n' + table)
    args = ["train", "--config", str(cfg), "--out", str(tmp_path / "o"), "-q"]
    r = run_here(capsys, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_default_valued_setting_an_override_makes_moot_is_left_out(tmp_path, capsys):
    """A run's own record (bucket size at its default under overlapped) reused with --sync
    allreduce typed: trained, and the new record has no bucket size."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nepochs = 1\nsync = "overlapped"\nbucket-mb = 1.0\n')
    out = tmp_path / "o"
    r = run_here(capsys, "train", "--config", str(cfg), "--sync", "allreduce", "--out", str(out),
                 "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "bucket" not in (out / "config.toml").read_text()


def test_a_record_of_every_setting_and_flags_written_false_are_read_back(tmp_path, capsys):
    """A metrics.json's config (every setting, defaults that apply nowhere included) as a
    config file trains again, and so does a file writing flags as false: neither says
    anything that does not apply."""
    from mpidp.cli.config import dumps
    first = tmp_path / "first"
    r = run_here(capsys, "train", "--dataset", "digits", "--epochs", "1", "--out", str(first),
                 "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    record = json.loads((first / "metrics.json").read_text())["config"]
    full = tmp_path / "full.toml"
    full.write_text(dumps({**record, "out": str(tmp_path / "again")}))
    flags = tmp_path / "flags.toml"
    flags.write_text('dataset = "digits"\nepochs = 1\ncopy-data = false\nrestart = false\n')
    for cfg in (full, flags):
        r = run_here(capsys, "train", "--config", str(cfg), "--out", str(tmp_path / cfg.stem),
                     "-q")
        assert r.returncode == 0, (cfg.name, r.stderr[-2000:])


def test_a_codec_made_moot_by_a_typed_dtype_is_not_passed_on(tmp_path):
    """A file's auto with int8 codes under --dtype float64 typed over it: auto runs without
    the codec (it used to be handed the codec and refuse it) and the record has none."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "digits"\nepochs = 1\nsync = "auto"\ncompress = "int8"\n')
    out = tmp_path / "f64"
    r = run_mpi(2, "train", "--config", str(cfg), "--dtype", "float64", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = (out / "config.toml").read_text()
    assert 'dtype = "float64"' in recorded and "compress" not in recorded, recorded


def test_a_file_value_the_command_line_overrides_is_not_checked(tmp_path, capsys):
    """The command line wins: a bad batch size in the file, a generated data set's sizes
    under a typed --dataset digits, neither is refused (the sizes are left out)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text('epochs = 1\nbatch-size = 0\ndataset = "synthetic"\nn-samples = 300\n'
                   'n-features = 20\n')
    out = tmp_path / "o"
    r = run_here(capsys, "train", "--config", str(cfg), "--batch-size", "64", "--dataset",
                 "digits", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = (out / "config.toml").read_text()
    assert "n-samples" not in recorded and "n-features" not in recorded, recorded
