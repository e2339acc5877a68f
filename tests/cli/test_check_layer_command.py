"""``mpidp check-layer``: exit 0 when a layer keeps every rule, 1 with one line per broken
rule (named), 2 with one error line for bad input; no MPI needed."""

from __future__ import annotations

import pytest

from mpidp.cli.main import main

USER_LAYERS = '''
import numpy as np
from mpidp import nn


@nn.register_layer(name="CheckedCentre")
class Centre(nn.Layer):
    needs = frozenset({"replica-sums"})

    def output_shape(self, in_shape):
        self.width = in_shape[-1]
        return in_shape

    def state_shapes(self):
        return {"mean": (self.width,)}

    def forward(self, x):
        sums = self.context.reduce_sum(np.concatenate([[len(x)], x.sum(axis=0)]))
        self.n, mean = sums[0], sums[1:] / max(sums[0], 1)
        own = x.mean(axis=0) if len(x) else mean  # state from this rank's rows: wrong
        self.state["mean"][...] = 0.9 * self.state["mean"] + 0.1 * own
        return x - mean

    def backward(self, dy, accumulate=False, need_input_grad=True):
        if not len(dy):
            return dy  # no rows, no sum: the other ranks would wait
        return dy - self.context.reduce_sum(dy.sum(axis=0)) / max(self.n, 1)
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):  # one file: its class is registered once
    path = tmp_path_factory.mktemp("layers") / "userlayers_check.py"
    path.write_text(USER_LAYERS)
    return path


def test_a_built_in_layer_passes_with_exit_0(capsys):
    assert main(["check-layer", "Conv2d", "--set", "out_channels=2", "kernel=3",
                 "--n-in", "2,5,5"]) == 0
    assert "every rule holds" in capsys.readouterr().out


def test_a_broken_layer_exits_1_with_one_line_per_broken_rule(capsys, user_module):
    assert main(["check-layer", f"{user_module}:Centre", "--n-in", "4"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "breaks 1 rule(s)" in out[0] and len(out) == 2, out
    assert out[1].startswith("collectives: reduce_sum is called differently"), out


def test_a_registered_name_needs_its_module_imported(capsys, user_module):
    assert main(["check-layer", "CheckedCentre", "--import", str(user_module)]) == 1
    assert capsys.readouterr().out.splitlines()[1].startswith("collectives:")


@pytest.mark.parametrize("argv,said", [
    (["Nope"], "no layer class is registered as 'Nope'"),
    (["no_such_module_here:X"], "no_such_module_here:X: module no_such_module_here: cannot"),
    (["mpidp.nn:Nope"], "mpidp.nn has no 'Nope'"),
    (["Dense"], "Dense cannot be made from the settings {}"),
    (["Dense", "--set", "n_out"], "--set n_out: give NAME=VALUE"),
    (["ReLU", "--ranks", "4", "--rows", "3"], "--rows 3 is fewer than --ranks 4"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, said):
    assert main(["check-layer", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpidp: error: {said}") and err.count("\n") == 1, err


NOT_LAYERS = """
from mpidp import nn


class NotALayer:
    pass


def makes_an_int():
    return 3


class Built(nn.Layer):
    def __init__(self):
        super().__init__()
        raise RuntimeError("cannot build")

    def forward(self, x):
        return x

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy
"""


def test_sizes_that_follow_from_the_input_are_inferred_as_in_a_model_file(capsys):
    """``Dense --set n_out=3`` takes its n_in from --n-in, as a model file's Dense does."""
    assert main(["check-layer", "Dense", "--set", "n_out=3", "--n-in", "5"]) == 0
    assert capsys.readouterr().out.startswith("Dense(5, 3): every rule holds")


@pytest.mark.parametrize("name, said", [
    ("NotALayer", "is a class that is not an mpidp.nn.Layer: subclass it"),
    ("makes_an_int", "made a int, not an mpidp.nn.Layer"),
    ("Built", "cannot be made from the settings {} (RuntimeError: cannot build)"),
])
def test_what_is_not_a_layer_is_bad_input_not_a_broken_rule(capsys, tmp_path, name, said):
    path = tmp_path / "notlayers.py"
    path.write_text(NOT_LAYERS)
    assert main(["check-layer", f"{path}:{name}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mpidp: error: {path}:{name} {said}") and err.count("\n") == 1, err


def test_a_setting_given_twice_is_refused(capsys):
    assert main(["check-layer", "Dense", "--set", "n_out=3", "n_out=4"]) == 2
    assert capsys.readouterr().err == ("mpidp: error: --set n_out=4: n_out is already set "
                                       "(to 3): give each setting once\n")


def test_a_check_too_large_for_memory_is_bad_input_not_a_broken_rule(capsys, monkeypatch):
    from mpidp import nn

    def too_large(*args, **kwargs):
        raise MemoryError("Unable to allocate 59.6 GiB")
    monkeypatch.setattr(nn, "check_layer", too_large)
    assert main(["check-layer", "ReLU", "--ranks", "4", "--rows", "9"]) == 2
    assert capsys.readouterr().err == (
        "mpidp: error: a check of 9 rows of shape (8,) on 4 ranks does not fit in memory "
        "(Unable to allocate 59.6 GiB): give smaller --rows, --ranks or --n-in\n")


def test_an_interrupt_ends_the_check_in_one_line_with_130(capsys, tmp_path):
    path = tmp_path / "interrupted.py"
    path.write_text("from mpidp import nn\n\n\nclass Stops(nn.Layer):\n"
                    "    def forward(self, x):\n        raise KeyboardInterrupt\n\n"
                    "    def backward(self, dy, accumulate=False, need_input_grad=True):\n"
                    "        return dy\n")
    assert main(["check-layer", f"{path}:Stops"]) == 130
    assert capsys.readouterr().err == ("mpidp: interrupted (SIGINT); nothing was checked to "
                                       "the end\n")


@pytest.mark.parametrize("argv, said", [
    (["Conv2d", "--set", "out_channels=2", "kernel=3", "--n-in", "8"],
     "--n-in 8 does not suit Conv2d(2, kernel=3): Conv2d takes samples of shape (channels, "
     "height, width), got (8,)"),
    (["Dense", "--set", "n_in=5", "n_out=3"],
     "--n-in 8 does not suit Dense(5, 3): Dense expects 5 input features, got 8"),
])
def test_an_input_shape_the_layer_does_not_take_is_bad_input(capsys, argv, said):
    """Not 'Conv2d breaks 1 rule(s) of the layer contract' for a built-in layer."""
    assert main(["check-layer", *argv]) == 2
    assert capsys.readouterr().err == f"mpidp: error: {said}\n"


def test_a_layer_that_never_returns_is_ended_by_the_timeout(capsys, tmp_path):
    """A forward that never returns: one line naming the bound, exit 3, within seconds."""
    import time
    path = tmp_path / "stuck_layer.py"
    path.write_text("import time\nfrom mpidp import nn\n\n\nclass Stuck(nn.Layer):\n"
                    "    def forward(self, x):  # 'never' (20 s: a thread left behind ends)\n"
                    "        end = time.monotonic() + 20\n"
                    "        while time.monotonic() < end:\n            time.sleep(0.01)\n"
                    "        return x\n\n"
                    "    def backward(self, dy, accumulate=False, need_input_grad=True):\n"
                    "        return dy\n")
    t = time.monotonic()
    assert main(["check-layer", f"{path}:Stuck", "--timeout", "1"]) == 3
    assert time.monotonic() - t < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not finish within --timeout 1 s" in err[0], err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e9"])
def test_a_timeout_out_of_range_is_refused(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["check-layer", "Dense", "--timeout", value])
    assert exc.value.code == 2 and "--timeout" in capsys.readouterr().err
