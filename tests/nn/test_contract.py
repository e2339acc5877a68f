"""``mpidp.nn.check_layer``: every built-in layer keeps the layer contract, and a user layer
that breaks one rule is caught with that rule named, one line per broken rule."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn
from mpidp.errors import MpidpError
from mpidp.nn.contract import RULES, check_layer

BUILT_IN = {
    "Dense": (lambda: nn.Dense(None, 4), 8),
    "BatchNorm": (nn.BatchNorm, 5),
    "BatchNorm-2d": (nn.BatchNorm, (3, 4, 4)),
    "LayerNorm": (nn.LayerNorm, (2, 3)),
    "Conv2d": (lambda: nn.Conv2d(3, 3, stride=2, padding=1), (2, 5, 5)),
    "Conv1d": (lambda: nn.Conv1d(2, 3), (2, 6)),
    "MaxPool": (lambda: nn.MaxPool(2), (2, 4, 4)),
    "AvgPool": (lambda: nn.AvgPool(2), (2, 4, 4)),
    "GlobalAvgPool": (nn.GlobalAvgPool, (2, 4, 4)),
    "Dropout": (lambda: nn.Dropout(0.3), 6),
    "Embedding": (lambda: nn.Embedding(2, 3), 4),
    "GELU": (nn.GELU, 5),
    "Softmax": (nn.Softmax, 5),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.1), 5),
    "Residual": (lambda: nn.Residual([nn.Dense(None, 5), nn.BatchNorm()]), 5),
}


@pytest.mark.parametrize("name", BUILT_IN)
def test_built_in_layers_keep_every_rule(name):
    make, n_in = BUILT_IN[name]
    report = check_layer(make, n_in)
    assert report.ok and report.checked == list(RULES) and not report.skipped, str(report)
    assert str(report).endswith(f"every rule holds ({', '.join(RULES)})")


# ------------------------------------------------------------------ layers that break one rule

class _Scale(nn.Layer):
    """y = x * w, one weight per feature: the base of the broken layers below."""

    def output_shape(self, in_shape):
        self.width = in_shape[-1]
        return in_shape

    def param_shapes(self):
        return {"w": (self.width,)}

    def init_(self, rng):
        self.params["w"][...] = rng.normal(size=self.width)

    def forward(self, x):
        self.x = x
        return x * self.params["w"]

    def dw(self, dy):
        return (dy * self.x).sum(axis=0)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        if accumulate:
            self.grads["w"] += self.dw(dy)
        else:
            self.grads["w"][...] = self.dw(dy)
        return dy * self.params["w"] if need_input_grad else None


class WrongParamGrad(_Scale):
    def dw(self, dy):
        return 0.5 * (dy * self.x).sum(axis=0)


class WrongInputGrad(nn.Layer):
    def forward(self, x):
        self.x = x
        return x ** 2

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy * self.x  # should be 2 x dy


class MeanGrads(_Scale):
    def dw(self, dy):
        return (dy * self.x).sum(axis=0) / max(len(dy), 1)


class Replaces(_Scale):
    def backward(self, dy, accumulate=False, need_input_grad=True):
        self.grads["w"][...] = self.dw(dy)  # ignores accumulate
        return dy * self.params["w"]


class Rebinds(_Scale):
    def backward(self, dy, accumulate=False, need_input_grad=True):
        self.grads = {"w": self.dw(dy)}  # a new array: the model's buffer never sees it
        return dy * self.params["w"]


class WrongShape(nn.Layer):
    def forward(self, x):
        return x[:, :-1]

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


class _Centre(nn.Layer):
    """x - mean of the global batch, a running mean as state (docs/extending.md)."""

    needs = frozenset({"replica-sums"})

    def output_shape(self, in_shape):
        self.width = in_shape[-1]
        return in_shape

    def state_shapes(self):
        return {"mean": (self.width,)}

    def sums(self, x):
        return self.context.reduce_sum(np.concatenate([[len(x)], x.sum(axis=0)]))

    def forward(self, x):
        sums = self.sums(x)
        self.n, mean = sums[0], sums[1:] / max(sums[0], 1)
        self.state["mean"][...] = 0.9 * self.state["mean"] + 0.1 * self.new_mean(x, mean)
        return x - mean

    def new_mean(self, x, mean):
        return mean

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy - self.context.reduce_sum(dy.sum(axis=0)) / max(self.n, 1)


class Centre(_Centre):
    pass


class SkipsWhenEmpty(_Centre):
    def backward(self, dy, accumulate=False, need_input_grad=True):
        if not len(dy):
            return dy  # no rows: no sum (the other ranks wait for it)
        return super().backward(dy, accumulate, need_input_grad)


class FailsWhenEmpty(_Centre):
    def forward(self, x):
        self.top = x.max(axis=0)  # no rows: ValueError
        return super().forward(x)


class OwnRowsState(_Centre):
    def new_mean(self, x, mean):
        return x.mean(axis=0) if len(x) else np.zeros(self.width)  # this rank's rows only


class OwnRowsMean(_Centre):
    def sums(self, x):
        return np.concatenate([[len(x)], x.sum(axis=0)])  # no reduce_sum: not the global mean


class ForgetsSetting(_Scale):
    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.gain = gain  # not in config(): a reloaded layer has gain 1

    def forward(self, x):
        return self.gain * super().forward(x)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return super().backward(self.gain * dy, accumulate, need_input_grad)


for _cls in (WrongParamGrad, WrongInputGrad, MeanGrads, Replaces, Rebinds, WrongShape, Centre,
             SkipsWhenEmpty, FailsWhenEmpty, OwnRowsState, OwnRowsMean):
    nn.register_layer(_cls, name=f"contract-test-{_cls.__name__}")

BROKEN = {  # layer factory: the rules it breaks
    WrongParamGrad: {"gradients"},
    WrongInputGrad: {"gradients"},
    MeanGrads: {"gradients", "sums", "ranks"},  # the loss is a sum over the rows
    Replaces: {"accumulate"},
    Rebinds: {"buffers"},
    WrongShape: {"shapes"},
    SkipsWhenEmpty: {"collectives"},
    FailsWhenEmpty: {"empty"},
    OwnRowsState: {"state"},
    OwnRowsMean: {"state", "ranks"},  # its state follows its own mean too
    (lambda: ForgetsSetting(2.0)): {"config"},
}


@pytest.mark.parametrize("make", BROKEN, ids=lambda m: getattr(m, "__name__", "ForgetsSetting"))
def test_a_broken_rule_is_named_one_line_each(make):
    report = check_layer(make, 4, strict=False)
    rules = [rule for rule, _ in report.failures]
    assert set(rules) == BROKEN[make] and len(rules) == len(set(rules)), str(report)
    assert report.lines() == [f"{r}: {m}" for r, m in report.failures]
    assert all("\n" not in line for line in report.lines())
    with pytest.raises(MpidpError) as err:
        check_layer(make, 4)
    lines = str(err.value).splitlines()
    assert "breaks" in lines[0] and sorted(line.split(":")[0] for line in lines[1:]) == \
        sorted(rules)


def test_the_messages_say_what_to_do():
    said = {cls: "\n".join(check_layer(cls, 4, strict=False).lines())
            for cls in (MeanGrads, OwnRowsState, SkipsWhenEmpty, Rebinds)}
    assert "sums over the rows, not means" in said[MeanGrads]
    assert "differs between ranks 0 and" in said[OwnRowsState]
    assert "0 rows: 1 call(s) of sizes [5]; 7 rows: 2 call(s)" in said[SkipsWhenEmpty]
    assert "write in place" in said[Rebinds]


def test_a_layer_instance_or_a_class_is_taken_and_the_documented_example_passes():
    assert check_layer(Centre(), 3).ok
    assert check_layer(Centre, 5).ok


def test_a_layer_that_cannot_be_built_is_one_shapes_line():
    report = check_layer(lambda: nn.Conv2d(2, 3), 4, strict=False)  # needs (C, H, W)
    assert [r for r, _ in report.failures] == ["shapes"]
    assert "per-sample shape (4,)" in report.lines()[0]


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError):
        check_layer(3)
    with pytest.raises(ValueError, match="ranks >= 2"):
        check_layer(nn.ReLU, ranks=1)


class NonFinite(nn.Layer):
    """Gives NaN (or, with ``value=inf``, Inf) for finite inputs."""

    def __init__(self, value: float = np.nan) -> None:
        super().__init__()
        self.value = value

    def forward(self, x):
        return x * self.value

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


class Exits(nn.Layer):
    def forward(self, x):
        raise SystemExit(0)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


@pytest.mark.parametrize("value, shown", [(np.nan, "nan"), (np.inf, "inf")])
def test_non_finite_outputs_are_one_shapes_line_without_numpy_warnings(value, shown):
    """Not 'differs by nan ... nan instead of nan' in three rules, and RuntimeWarnings."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = check_layer(lambda: NonFinite(value), 4, strict=False)
    assert report.lines() == [f"shapes: forward of finite inputs gave {shown} at [0, 0] "
                              f"(28 non-finite value(s)): it must give finite values"]


def test_a_layer_that_calls_sys_exit_breaks_a_rule_and_ends_nothing():
    report = check_layer(Exits, 4, strict=False)
    assert report.lines() == ["shapes: raised SystemExit: 0"]


class Huge(nn.Layer):
    def forward(self, x):
        raise MemoryError("Unable to allocate")

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


def test_memory_that_runs_out_is_raised_not_reported_as_a_broken_rule():
    with pytest.raises(MemoryError):
        check_layer(Huge, 4, strict=False)
