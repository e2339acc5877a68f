"""Which ``mpidp train`` option applies to which mode (:mod:`mpidp.cli.options`), without
MPI: every option of the table in every mode, and the rules between options."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from helpers import ROOT

from mpidp.cli import build_parser
from mpidp.cli.options import MODES, TABLE, given, problems, reason

SIZE = 4  # ranks of the job the arguments are checked for

#: option (dest) -> a valid value for it, and the options it needs to be valid in a mode
#: where it applies (``{workers}``: one capacity per rank or per worker).
VALUES: dict[str, list[str]] = {
    "distribute": ["--distribute", "local"],
    "init_sync": ["--init-sync", "seed"],
    "partition": ["--partition", "weighted", "--capacities", "{workers}"],
    "costs": ["--costs", "uniform", "--partition", "cost"],
    "capacities": ["--capacities", "{workers}", "--partition", "weighted"],
    "adapt_every": ["--adapt-every", "5", "--partition", "adaptive"],
    "micro_batches": ["--micro-batches", "2"],
    "schedule": ["--schedule", "gpipe"],
    "max_staleness": ["--max-staleness", "3"],
    "ps_placement": ["--ps-placement", "dedicated"],
    "ps_transport": ["--ps-transport", "mpi"],
    "ps_chunk_mb": ["--ps-chunk-mb", "2"],
    "bucket_mb": ["--bucket-mb", "2"],
    "compress": ["--compress", "float16"],
    "error_feedback": ["--error-feedback", "off"],
    "sync": ["--sync", "overlapped"],
    "node_aware": ["--node-aware", "on"],
    "overlap_progress": ["--overlap-progress", "thread"],
    "overlap_finish": ["--overlap-finish", "forward", "--on-nonfinite", "ignore"],
    "sync_every": ["--sync-every", "2"],
    "log_every": ["--log-every", "5"],
    "progress": ["--progress", "lines"],
    "check_every": ["--check-every", "2"],
    "elastic": ["--elastic"],
    "val_fraction": ["--val-fraction", "0.1"],
    "max_skipped": ["--max-skipped", "0.2", "--on-nonfinite", "skip"],
    "early_stopping": ["--early-stopping", "2", "--val-fraction", "0.1"],
    "min_delta": ["--min-delta", "0.01", "--val-fraction", "0.1"],
    "lr_schedule": ["--lr-schedule", "cosine"],
    "lr_step_epochs": ["--lr-step-epochs", "2", "--lr-schedule", "step"],
    "lr_milestones": ["--lr-milestones", "2,4", "--lr-schedule", "multistep"],
    "lr_gamma": ["--lr-gamma", "0.5", "--lr-schedule", "exponential"],
    "lr_min": ["--lr-min", "0.001", "--lr-schedule", "cosine"],
    "warmup_epochs": ["--warmup-epochs", "1"],
    "warmup_steps": ["--warmup-steps", "5"],
    "plateau_factor": ["--plateau-factor", "0.5", "--lr-schedule", "plateau", "--val-fraction",
                       "0.1"],
    "plateau_patience": ["--plateau-patience", "1", "--lr-schedule", "plateau",
                         "--val-fraction", "0.1"],
}

#: (option, mode) pairs the table admits but no setting of the other options accepts: an
#: asynchronous server's workers read contiguous blocks, so no partition takes --costs or
#: --adapt-every there.
NEVER_VALID = {("costs", "async-ps"): "--partition cost/adaptive are refused for async-ps",
               ("adapt_every", "async-ps"): "--partition adaptive is refused for async-ps"}


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["train"]


TRAIN = _train_parser()


def _flag(dest: str) -> str:
    """The long option string of ``dest`` as the parser defines it."""
    return next(s for a in TRAIN._actions if a.dest == dest  # noqa: SLF001
                for s in a.option_strings if s.startswith("--"))


def _mode_argv(mode: str) -> list[str]:
    return ["--parallel", mode] if mode in ("pipeline", "hybrid") else ["--sync", mode]


def _mode_name(mode: str) -> str:
    return " ".join(_mode_argv(mode))


def _check(argv: list[str], size: int = SIZE) -> list[str]:
    """``problems`` of ``mpidp train ARGV`` on ``size`` ranks, parsed as the command line is."""
    args = build_parser().parse_args(["train", *argv])
    return problems(args, given(TRAIN, argv), size)


def _refusals(messages: list[str], dest: str) -> list[str]:
    return [m for m in messages if m.startswith(f"{_flag(dest)} does not apply to --")]


def test_the_table_names_real_options_and_modes():
    dests = {a.dest for a in TRAIN._actions}  # noqa: SLF001
    assert set(TABLE) <= dests
    assert set(VALUES) == set(TABLE), "every option of the table needs a value to test"
    for dest, (modes, _) in TABLE.items():  # an option of every mode needs no entry
        assert modes and modes < set(MODES), dest
        assert all(reason(dest, m).strip() for m in set(MODES) - modes), dest
    for mode in MODES:  # every mode can be asked for on the command line
        args = build_parser().parse_args(["train", *_mode_argv(mode)])
        assert (args.parallel if mode in ("pipeline", "hybrid") else args.sync) == mode


def _cases() -> list:
    return [pytest.param(dest, mode, id=f"{dest}-{mode}", marks=[
        pytest.mark.xfail(strict=True, reason=NEVER_VALID[dest, mode])]
        if (dest, mode) in NEVER_VALID else []) for dest in TABLE for mode in MODES]


@pytest.mark.parametrize("dest,mode", _cases())
def test_an_option_is_refused_exactly_where_the_table_says(dest, mode):
    modes = TABLE[dest][0]
    workers = SIZE - 1 if mode == "async-ps" else SIZE
    argv = [v.format(workers=",".join(["1"] * workers)) for v in VALUES[dest]]
    argv += _mode_argv(mode)
    out = _check(argv)
    mine = _refusals(out, dest)
    if mode in modes:
        assert out == [], out
        return
    assert mine == [f"{_flag(dest)} does not apply to {_mode_name(mode)}: "
                    f"{reason(dest, mode)}"], out
    # anything else refused is another option of the same argv that the table refuses too
    others = {d for d in given(TRAIN, argv) if d in TABLE and mode not in TABLE[d][0]}
    assert sorted(out) == sorted(m for d in others for m in _refusals(out, d)), out


@pytest.mark.parametrize("dest", sorted(d for d in TABLE if TRAIN.get_default(d) not in (None, False)))
def test_an_option_given_with_its_default_value_still_counts(dest):
    mode = next(m for m in MODES if m not in TABLE[dest][0])
    default = TRAIN.get_default(dest)
    argv = [_flag(dest), str(default), *_mode_argv(mode)]
    args = build_parser().parse_args(["train", *argv])
    assert vars(args) == vars(build_parser().parse_args(["train", *_mode_argv(mode)]))
    assert len(_refusals(problems(args, given(TRAIN, argv), SIZE), dest)) == 1


def test_given_reads_the_command_line_not_the_values():
    assert given(TRAIN, ["--micro-batches=4", "-q", "--sync", "ps", "--", "--epochs"]) == \
        {"micro_batches", "quiet", "sync"}
    assert given(TRAIN, []) == set()
    args = build_parser().parse_args(["train", "--micro-batches", "4"])
    assert problems(args, set(), SIZE) == []  # the same values, not written: nothing given


def test_resume_and_checkpoint_options_need_a_checkpoint_folder():
    assert _check(["--resume"]) == ["--resume needs --checkpoint-dir"]
    assert _check(["--resume", "--checkpoint-dir", "ck"]) == []
    for argv in (["--checkpoint-every", "100"], ["--keep-checkpoints", "3"], ["--restart"]):
        assert _check(argv) == [f"{argv[0]} needs --checkpoint-dir"]
        assert _check([*argv, "--checkpoint-dir", "ck"]) == []


def test_the_watchdog_grace_needs_the_watchdog():
    off = "--watchdog-grace needs the watchdog (--watchdog 0 turns it off)"
    assert _check(["--watchdog", "0", "--watchdog-grace", "2"]) == [off]
    assert _check(["--watchdog-grace", "2"]) == []  # the default watchdog
    assert _check(["--watchdog", "5", "--watchdog-grace", "2"]) == []
    args = build_parser().parse_args(["train", "--watchdog", "0"])
    assert problems(args, given(TRAIN, ["--watchdog", "0"]), SIZE) == []


@pytest.mark.parametrize("mode,who,want", [
    (["--sync", "allreduce"], "rank", 3),
    (["--sync", "ps"], "rank", 3),
    (["--sync", "ps", "--ps-placement", "dedicated"], "worker", 2),
    (["--sync", "async-ps"], "worker", 2)])
def test_capacities_count_ranks_or_workers_beside_a_dedicated_server(mode, who, want):
    weighted = [*mode, "--partition", "weighted"]
    assert _check([*weighted, "--capacities", ",".join(["1"] * want)], size=3) == []
    for n in (want - 1, want + 1):
        out = _check([*weighted, "--capacities", ",".join(["1"] * n)], size=3)
        assert len(out) == 1 and out[0].startswith(f"--capacities has {n} entries; give one "
                                                   f"per {who}") and out[0].endswith(f": {want}")
    assert _check(weighted, size=3) == [
        f"--partition weighted needs --capacities (one relative speed per {who})"]


def test_partition_options_need_their_strategy():
    assert _check(["--capacities", "1,1,1,1"]) == [
        "--capacities does not apply to --partition block: only weighted and adaptive use "
        "rank speeds"]
    assert _check(["--capacities", "1,1,1,1", "--partition", "adaptive"]) == []
    assert _check(["--costs", "uniform", "--partition", "weighted", "--capacities",
                   "1,1,1,1"]) == ["--costs does not apply to --partition weighted: only cost "
                                   "and adaptive balance by per-sample cost"]
    assert _check(["--costs", "uniform", "--partition", "adaptive"]) == []
    assert _check(["--adapt-every", "3", "--partition", "cost"]) == [
        "--adapt-every does not apply to --partition cost: only adaptive re-measures speeds"]


@pytest.mark.parametrize("strategy", ["cost", "adaptive"])
def test_a_dedicated_server_refuses_dynamic_partitions(strategy):
    out = _check(["--sync", "ps", "--ps-placement", "dedicated", "--partition", strategy])
    assert len(out) == 1 and out[0].startswith(
        f"--partition {strategy} does not apply to a dedicated parameter server")
    assert _check(["--sync", "ps", "--partition", strategy]) == []  # rank 0 computes too


@pytest.mark.parametrize("strategy,ok", [("block", True), ("weighted", True), ("cyclic", False),
                                         ("shuffled", False), ("cost", False),
                                         ("adaptive", False)])
def test_async_ps_workers_read_contiguous_blocks(strategy, ok):
    argv = ["--sync", "async-ps", "--partition", strategy]
    argv += ["--capacities", "1,1,1"] if strategy == "weighted" else []
    out = _check(argv)
    assert out == [] if ok else out == [
        f"--partition {strategy} does not apply to async-ps: its workers read contiguous "
        "blocks (block or weighted)"]
    if not ok:  # a dedicated server of --sync ps takes cyclic and shuffled
        assert (_check(["--sync", "ps", "--ps-placement", "dedicated", "--partition",
                        strategy]) == []) == (strategy in ("cyclic", "shuffled"))


def test_copy_data_only_with_local_reads():
    assert _check(["--copy-data"]) == [
        "--copy-data does not apply to --distribute scatter: only local reads can map rows "
        "from the file"]
    assert _check(["--copy-data", "--distribute", "local"]) == []
    for mode in ("pipeline", "hybrid"):  # every stage reads its own rows anyway
        assert _check(["--copy-data", "--parallel", mode]) == []


def test_trace_steps_need_a_trace():
    assert _check(["--trace-steps", "2:4"]) == ["--trace-steps needs --trace"]
    assert _check(["--trace-steps", "2:4", "--trace", "t.json"]) == []
    assert _check(["--trace", "t.json"]) == []


@pytest.mark.parametrize("sync", ["ps", "async-ps"])
def test_a_parameter_server_needs_two_ranks(sync):
    assert _check(["--sync", sync], size=1) == [
        f"--sync {sync} needs at least 2 ranks (a server and a worker)"]
    assert _check(["--sync", sync], size=2) == []


@pytest.mark.parametrize("mode", [m for m in MODES if m not in ("ps", "async-ps")])
def test_other_modes_run_on_one_rank(mode):
    assert _check(_mode_argv(mode), size=1) == []


def test_every_problem_is_reported_at_once():
    out = _check(["--micro-batches", "2", "--bucket-mb", "2", "--resume", "--trace-steps",
                  "1:2"])
    assert [m.split(" ", 1)[0] for m in out] == ["--bucket-mb", "--micro-batches",
                                                 "--trace-steps", "--resume"]


def test_parsing_and_checking_start_no_mpi():
    code = ("import sys\nimport mpidp.cli.options as O, mpidp.cli.config\n"
            "from mpidp.cli.main import build_parser\n"
            "p = build_parser()\nargv = ['--sync', 'ps', '--micro-batches', '2']\n"
            "train = next(a for a in p._actions if hasattr(a, 'choices') and a.choices "
            "and 'train' in a.choices).choices['train']\n"
            "assert O.problems(p.parse_args(['train', *argv]), O.given(train, argv), 2)\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI started'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_recorded_config_keeps_only_what_applied():
    from mpidp.cli.options import applying
    args = build_parser().parse_args(["train", "--dataset", "digits"])
    kept = applying(vars(args))
    assert "n_samples" not in kept and "n_features" not in kept
    assert not {"ps_placement", "ps_transport", "ps_chunk_mb", "bucket_mb", "compress",
                "sync_every", "max_staleness", "micro_batches", "schedule"} & set(kept)
    assert {"lr", "epochs", "dataset", "sync", "partition", "check_every"} <= set(kept)
    synthetic = applying(vars(build_parser().parse_args(
        ["train", "--dataset", "synthetic", "--sync", "ps", "--parallel", "data"])))
    assert {"n_samples", "n_features", "ps_placement"} <= set(synthetic)
    pipe = applying(vars(build_parser().parse_args(["train", "--parallel", "pipeline"])))
    assert {"micro_batches", "schedule"} <= set(pipe) and "partition" not in pipe


#: What ``mpidp train --dataset digits --epochs 2`` sets that its run does not use: no
#: checkpoints, a constant rate without scaling, no validation, NaN/Inf stops the run, a
#: block partition, SGD with momentum (it keeps --momentum).
UNUSED_BY_DEFAULT = {"checkpoint_every", "keep_checkpoints", "lr_gamma", "lr_min",
                     "plateau_factor", "plateau_patience", "min_delta", "base_batch",
                     "max_skipped", "costs"}


def test_a_recorded_config_leaves_out_settings_the_others_make_moot():
    from mpidp.cli.options import applying
    args = build_parser().parse_args(["train", "--dataset", "digits", "--epochs", "2"])
    kept = applying(vars(args))
    assert not UNUSED_BY_DEFAULT & set(kept), UNUSED_BY_DEFAULT & set(kept)
    assert {"momentum", "lr_schedule", "lr_scaling", "on_nonfinite", "partition",
            "warmup_epochs", "val_fraction", "epochs"} <= set(kept)
    used = applying(vars(build_parser().parse_args(
        ["train", "--checkpoint-dir", "ck", "--lr-schedule", "plateau", "--val-fraction", "0.1",
         "--lr-scaling", "sqrt", "--on-nonfinite", "skip", "--partition", "cost"])))
    assert UNUSED_BY_DEFAULT - {"lr_gamma", "lr_min"} <= set(used)
    assert "lr_gamma" in applying(vars(build_parser().parse_args(
        ["train", "--lr-schedule", "exponential"])))
    assert {"lr_min", "min_delta"} <= set(applying(vars(build_parser().parse_args(
        ["train", "--lr-schedule", "cosine", "--early-stopping", "2", "--val-fraction", "0.1"]))))


@pytest.mark.parametrize("optimizer,kept", [("adam", False), ("adamw", False), ("lamb", False),
                                            ("sgd", False), ("momentum", True), ("lars", True)])
def test_momentum_is_recorded_only_for_an_optimizer_that_uses_it(optimizer, kept):
    from mpidp.cli.options import applying
    args = build_parser().parse_args(["train", "--optimizer", optimizer])
    assert ("momentum" in applying(vars(args))) is kept
    assert _check(["--optimizer", optimizer, "--momentum", "0.5"]) == ([] if kept else [
        f"--momentum does not apply to --optimizer {optimizer}: only momentum and lars use it"])


def test_max_skipped_needs_steps_to_be_skipped():
    assert _check(["--max-skipped", "0.2"]) == [
        "--max-skipped needs --on-nonfinite skip (only skipped steps are counted)"]
    assert _check(["--max-skipped", "0.2", "--on-nonfinite", "ignore"]) == [
        "--max-skipped needs --on-nonfinite skip (only skipped steps are counted)"]
    assert _check(["--max-skipped", "0.2", "--on-nonfinite", "skip"]) == []


def test_min_delta_alone_is_let_through_but_not_recorded():
    from mpidp.cli.options import applying
    argv = ["--min-delta", "0.01", "--val-fraction", "0.1"]
    assert _check(argv) == []  # accepted, as it always was: it changes nothing
    assert "min_delta" not in applying(vars(build_parser().parse_args(["train", *argv])))


def test_the_trainer_kinds_come_from_one_list():
    from mpidp.cli import options
    from mpidp.parallel.modes import HYBRID_STAGES, PARALLEL, PIPELINED
    choices = {a.dest: a for a in TRAIN._actions}  # noqa: SLF001
    assert tuple(choices["parallel"].choices) == PARALLEL
    assert not set(choices["sync"].choices) & set(PIPELINED)
    assert options.MODEL_PARALLEL == PIPELINED and set(PIPELINED) <= set(MODES)
    assert f"pipelines of {HYBRID_STAGES} stages" in choices["parallel"].help


def test_compress_is_refused_for_auto_in_float64_where_compression_is_never_tried():
    out = _check(["--sync", "auto", "--dtype", "float64", "--compress", "int8"])
    assert out == ["--compress does not apply to --sync auto with --dtype float64: auto tries "
                   "compression for float32 models only"]
    assert _check(["--sync", "auto", "--compress", "int8"]) == []
    assert _check(["--sync", "compressed", "--dtype", "float64", "--compress", "int8"]) == []


def test_sync_is_refused_for_the_model_parallel_modes():
    for mode in ("pipeline", "hybrid"):
        out = _check(["--parallel", mode, "--sync", "auto"])
        assert any(m.startswith(f"--sync does not apply to --parallel {mode}") for m in out), out


@pytest.mark.parametrize("model,kept", [("mlp", True), ("logreg", False), ("linear", False),
                                        ("cnn", False)])
def test_hidden_is_refused_and_not_recorded_for_a_model_without_hidden_layers(model, kept):
    """--hidden under logreg used to train a plain Dense and record the sizes anyway."""
    from mpidp.cli.options import applying
    args = build_parser().parse_args(["train", "--model", model])
    assert ("hidden" in applying(vars(args))) is kept
    assert _check(["--model", model, "--hidden", "32"]) == ([] if kept else [
        f"--hidden does not apply to --model {model}: only mlp has hidden layers of those "
        "sizes (a model file sets its own)"])


@pytest.mark.parametrize("dataset,refused", [("synthetic", False), ("bow", False),
                                             ("digits", True), ("data.npz", True)])
def test_sizes_of_generated_data_are_refused_for_other_datasets(dataset, refused):
    """--n-samples 10 with a file dataset trained on the whole file, silently."""
    got = _check(["--dataset", dataset, "--n-samples", "10", "--n-features", "4"])
    assert got == ([f"--{d} does not apply to --dataset {dataset}: only the generated "
                    f"datasets (synthetic, bow) are made to a size"
                    for d in ("n-features", "n-samples")] if refused else [])


def test_a_new_flag_line_is_refused_elsewhere_with_a_reason():
    """A flag added to the table for a field whose declaration gives no reason is refused
    under the other modes with one that names the modes having it (never 'None')."""
    from mpidp.cli.flags import Flag
    flag = Flag("--error-feedback", "error_feedback", {"on": True, "off": False})
    assert flag.modes == ("compressed",)
    assert flag.why == "only --sync compressed has this setting"
    assert all(why for _, why in TABLE.values()), "an option refused without a reason"
