"""Every parallel mode declared once (:mod:`mpidp.parallel.modes`): settings that check
themselves, the command line's options derived from them, strategies made from them, and
no MPI to read them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from mpidp.cli import flags
from mpidp.cli.main import build_parser
from mpidp.cli.options import TABLE
from mpidp.errors import MpidpError, spelled
from mpidp.parallel.modes import MODES, PARALLEL, PIPELINED, SYNCS, SettingError, make_sync

#: settings field -> values its check refuses
BAD = {"bucket_bytes": [0, -1, 0.5, 2.0**62, "1", True, None],
       "chunk_bytes": [0, 1.5, "x"],
       "progress": ["fast", None], "finish": ["later"], "codec": ["int4", ""],
       "kernels": ["fast"], "error_feedback": [1, "yes", None],
       "node_aware": ["off", 0, 1.0], "dedicated": [0, None], "shared_memory": ["no"],
       "k": [0, -2, 1.5, True], "max_staleness": [-1, 0.5], "micro_batches": [0, 2.5],
       "schedule": ["zigzag"]}


def _fields() -> list[tuple[str, str]]:
    return [(mode, f.name) for mode, m in MODES.items()
            for f in dataclasses.fields(m.settings)]


def test_every_field_has_bad_values_to_try():
    assert {name for _, name in _fields()} == set(BAD)


@pytest.mark.parametrize("mode,name", _fields())
def test_a_bad_value_is_refused_naming_its_field(mode, name):
    settings = MODES[mode].settings
    for bad in BAD[name]:
        with pytest.raises(SettingError, match=name) as caught:
            settings(**{name: bad})
        assert isinstance(caught.value, MpidpError)
    settings()  # the defaults are good


def test_settings_keep_values_in_their_kind():
    s = MODES["overlapped"].settings(bucket_bytes=1e6)
    assert s.bucket_bytes == 1000000 and type(s.bucket_bytes) is int
    assert MODES["allreduce"].settings(node_aware=np.True_).node_aware is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.bucket_bytes = 5  # type: ignore[misc]


def test_settings_that_contradict_each_other_are_refused_naming_both():
    with pytest.raises(SettingError, match="finish='forward'.*progress='thread'.*progress="
                                           "'test'"):
        MODES["overlapped"].settings(progress="thread", finish="forward")
    with pytest.raises(SettingError, match="kernels='numba'.*codec='float16'"):
        MODES["compressed"].settings(codec="float16", kernels="numba")


def test_the_command_line_tells_a_refused_setting_by_its_flag():
    args = build_parser().parse_args(["train", "--sync", "overlapped", "--overlap-finish",
                                      "forward", "--overlap-progress", "thread"])
    with spelled(flags.spelling(build_parser())), pytest.raises(MpidpError) as caught:
        flags.settings_of("overlapped", args)
    message = str(caught.value)
    assert message.startswith("--overlap-finish forward applies each sum")
    assert "thread of --overlap-progress thread does not report: use --overlap-progress test" \
        in message
    assert "finish='forward'" in str(pytest.raises(MpidpError, flags.settings_of, "overlapped",
                                                   args).value)  # outside: the keywords


@pytest.mark.parametrize("flag", flags.FLAGS, ids=lambda f: f.flag)
def test_the_option_table_is_derived_from_the_settings(flag):
    carrying = {mode for mode, m in MODES.items() if flag.field in m.fields}
    whys = {f.metadata["why"] for mode in carrying
            for f in dataclasses.fields(MODES[mode].settings) if f.name == flag.field}
    assert len(whys) == 1 and TABLE[flag.dest] == (carrying, flag.why)
    assert flag.why in whys or whys == {None}  # declared, else derived from the modes


def test_error_feedback_is_a_flag_of_the_compressed_exchange():
    args = build_parser().parse_args(["train", "--sync", "compressed", "--error-feedback",
                                      "off"])
    assert flags.settings_of("compressed", args) == MODES["compressed"].settings(
        error_feedback=False)
    assert MODES["compressed"].settings().error_feedback is True


def test_every_setting_with_a_flag_has_one_flag_and_the_parser_has_it():
    assert len({f.field for f in flags.FLAGS}) == len(flags.FLAGS)
    actions = {a.dest: a for a in _train()._actions}  # noqa: SLF001
    for f in flags.FLAGS:
        assert actions[f.dest].option_strings == [f.flag]


def _train() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices["train"]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_parsed_defaults_are_each_modes_defaults(mode):
    args = build_parser().parse_args(["train"])
    assert flags.settings_of(mode, args) == MODES[mode].settings()


def test_mode_choices_come_from_the_table():
    actions = {a.dest: a for a in _train()._actions}  # noqa: SLF001
    assert tuple(actions["sync"].choices) == (*SYNCS, "async-ps")
    assert tuple(actions["parallel"].choices) == PARALLEL == ("data", *PIPELINED)
    for name in actions["sync"].choices:
        assert f"{name}: {MODES[name].note}" in actions["sync"].help


@pytest.mark.parametrize("mode", SYNCS)
def test_make_sync_builds_each_mode_from_its_fields(mode):
    m = MODES[mode]
    values = {name: getattr(m.settings(), name) for name in m.fields}
    sync = make_sync(mode, optimizer_factory=lambda: None, **values)
    assert sync.name == mode and type(sync).__name__ == m.runner.split(":")[1]
    for name, value in values.items():
        assert getattr(sync, name) == value
    assert type(make_sync(mode, m.settings(), optimizer_factory=lambda: None)) is type(sync)


def test_make_sync_refuses_a_field_its_mode_lacks_naming_both():
    with pytest.raises(MpidpError, match=r"codec 'int8' applies to --sync compressed or "
                                         r"auto, not overlapped \(--sync overlapped takes "
                                         r"bucket_bytes, progress, finish\)"):
        make_sync("overlapped", codec="int8")
    with pytest.raises(MpidpError, match="colour 'red' is no setting of any mode, not "
                                         "per-layer"):
        make_sync("per-layer", colour="red")
    with pytest.raises(MpidpError, match="unknown sync mode 'gossip'"):
        make_sync("gossip")
    with pytest.raises(MpidpError, match="takes OverlappedSettings"):
        make_sync("overlapped", MODES["compressed"].settings())
    with pytest.raises(MpidpError, match="needs an optimizer factory"):
        make_sync("sharded-ps")


def test_strategy_constructors_take_their_settings_fields():
    from mpidp.parallel.compress import Compressed
    from mpidp.parallel.overlap import Overlapped
    assert Overlapped(4096, finish="forward").finish == "forward"
    assert Compressed("int8", False, 100).bucket_bytes == 100
    with pytest.raises(SettingError, match="bucket_bytes"):
        Overlapped(bucket_bytes=0)
    from mpidp.parallel.sync import Sync

    class Mine(Sync):  # a strategy of one's own: no declared mode, no settings
        name = "mine"
    assert Mine().node_aware is None


def test_modes_import_without_mpi():
    code = ("import sys, mpidp.parallel.modes, mpidp.cli.flags\n"
            "assert 'mpi4py' not in sys.modules, sorted(m for m in sys.modules if 'mpi' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
