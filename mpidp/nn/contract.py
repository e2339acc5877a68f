"""Run a layer class through the layer contract of ``docs/extending.md`` (its table: :data:`RULES`,
each named in the report's lines) before any training: :func:`check_layer`, in float64. No MPI:
P ranks are simulated in one process by threads whose ``context.reduce_sum`` sums over them."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import MpidpError
from .context import Context
from .layers import Layer
from .model import Sequential, as_shape, from_spec

RULES = ("shapes", "buffers", "gradients", "accumulate", "sums", "empty", "collectives",
         "state", "ranks", "config")
FD_STEP, FD_TOL, EXACT_TOL = 1e-6, 1e-6, 1e-10
FD_COORDS = 200  # finite differences at most this many coordinates of each array
WAIT_S = 10.0  # a simulated rank waits this long in reduce_sum for the others


@dataclass
class Report:
    """What :func:`check_layer` found: ``failures`` holds ``(rule, message)`` pairs, one per
    broken rule; ``checked`` the rules that ran; ``skipped`` those that could not."""

    layer: str
    checked: list[str] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        """One line per broken rule, ``"rule: what is wrong"``."""
        return [f"{rule}: {message}" for rule, message in self.failures]

    def __str__(self) -> str:
        if self.ok:
            tail = f" ({', '.join(self.skipped)} not checked)" if self.skipped else ""
            return f"{self.layer}: every rule holds ({', '.join(self.checked)}){tail}"
        head = f"{self.layer} breaks {len(self.failures)} rule(s) of the layer contract:"
        return "\n".join([head, *self.lines()])


class _Broken(Exception):
    """A rule is broken (its message)."""


def _describe(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _worst(got: np.ndarray, want: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """The largest difference relative to the arrays' scale (at least 1), and where."""
    diff = np.abs(np.asarray(got, np.float64) - want)
    if not diff.size:
        return 0.0, ()
    scale = max(1.0, float(np.max(np.abs(want), initial=0)), float(np.max(np.abs(got), initial=0)))
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return float(diff[at]) / scale, tuple(int(i) for i in at)


def _compare(got, want, tol: float, what: str, hint: str = "") -> None:
    if np.shape(got) != np.shape(want):
        raise _Broken(f"{what} has shape {np.shape(got)}, expected {np.shape(want)}{hint}")
    err, at = _worst(got, want)
    if not err <= tol:  # NaN fails too
        raise _Broken(f"{what} differs by {err:.3g} (relative) at {list(at)}: "
                      f"{float(np.asarray(got)[at]):.6g} instead of {float(np.asarray(want)[at]):.6g}{hint}")


class _Group:
    """P simulated ranks: ``reduce_sum(rank)`` is a barrier-backed sum over the threads."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.slots: list[np.ndarray | None] = [None] * size

    def reduce_sum(self, rank: int) -> Callable[[np.ndarray], np.ndarray]:
        def reduce_sum(a: np.ndarray) -> np.ndarray:
            self.slots[rank] = np.array(a, copy=True)
            self.barrier.wait()
            sizes = [s.shape for s in self.slots]
            if len(set(sizes)) > 1:
                raise _Broken(f"reduce_sum got arrays of shapes {sizes} on the ranks")
            total = sum(self.slots[1:], self.slots[0].copy())
            self.barrier.wait()
            a[...] = total
            return a
        return reduce_sum


class _Checker:
    def __init__(self, make: Callable[[], Layer], in_shape: tuple[int, ...], ranks: int,
                 rows: int, seed: int) -> None:
        self.make, self.in_shape, self.ranks, self.rows = make, in_shape, ranks, rows
        self.rng, self.seed = np.random.default_rng(seed), seed
        self.ref = self.model()
        self.ref.init_(self.rng)
        self.params0, self.state0 = self.ref.params.copy(), self.ref.state.copy()
        self.reads = bool(getattr(self.ref.layers[0], "reads", ""))
        self.x = self.inputs(rows)
        self.dy = self.rng.normal(size=(rows, *self.ref.out_shape))

    def model(self) -> Sequential:
        layer = self.make()
        if not isinstance(layer, Layer):
            raise _Broken(f"the factory gave {type(layer).__name__}, not an mpidp.nn.Layer")
        return Sequential([layer], self.in_shape, np.float64)

    def inputs(self, n: int) -> np.ndarray:
        if self.reads:  # token ids, say: whole numbers
            return self.rng.integers(0, 2, size=(n, *self.in_shape)).astype(np.float64)
        return self.rng.normal(size=(n, *self.in_shape))

    def fresh(self, model: Sequential, index: np.ndarray, reduce_sum=None) -> Sequential:
        """``model`` at the starting parameters and state, in a training step of ``index``."""
        model.params[...], model.state[...] = self.params0, self.state0
        ctx = Context(training=True, seed=self.seed, index=np.asarray(index, np.int64))
        if reduce_sum is not None:
            ctx.reduce_sum, ctx.group_size = reduce_sum, self.ranks
        model.set_context(ctx)
        return model

    def step(self, model: Sequential, x: np.ndarray, dy: np.ndarray, accumulate: bool = False):
        """Forward and backward: ``(y, dx, grads, state)`` (copies)."""
        y = np.array(model.forward(x), copy=True)
        dx = model.backward(dy, accumulate, input_grad=not self.reads)
        return y, None if dx is None else np.array(dx, copy=True), model.grads.copy(), \
            model.state.copy()

    # ------------------------------------------------------------------ the rules
    def shapes(self) -> None:
        m = self.fresh(self.ref, np.arange(self.rows))
        y, dx, _, _ = self.step(m, self.x, self.dy)
        if y.shape != (self.rows, *m.out_shape):
            raise _Broken(f"forward of {self.x.shape} gave {y.shape}, expected "
                          f"{(self.rows, *m.out_shape)} (output_shape says {m.out_shape})")
        if not self.reads and (dx is None or np.shape(dx) != self.x.shape):
            raise _Broken(f"backward gave an input gradient of shape {np.shape(dx)}, expected {self.x.shape}")
        for what, got in (("forward", y), ("backward", dx)):
            bad = None if got is None else np.argwhere(~np.isfinite(got))
            if bad is not None and len(bad):
                at = tuple(int(i) for i in bad[0])
                raise _Broken(f"{what} of finite inputs gave {got[at]} at {list(at)} "
                              f"({len(bad)} non-finite value(s)): it must give finite values")

    def buffers(self) -> None:
        m = self.fresh(self.ref, np.arange(self.rows))
        self.step(m, self.x, self.dy)
        layer = m.layers[0]
        for what, views, flat in (("parameter", layer.params, m.params),
                                  ("gradient", layer.grads, m.grads),
                                  ("state", layer.state, m.state)):
            for name, view in views.items():
                if not np.shares_memory(view, flat):
                    raise _Broken(f"{what} {name!r} is no longer a view into the model's flat "
                                  f"{what} buffer: write in place ({name}[...] = ...)")

    def gradients(self) -> None:
        m = self.fresh(self.ref, np.arange(self.rows))
        _, dx, grads, _ = self.step(m, self.x, self.dy)

        def loss() -> float:
            m.state[...] = self.state0
            return float(np.sum(m.forward(self.x) * self.dy))

        for name, array, got in self._targets(m, dx, grads):
            flat, want = array.reshape(-1), np.zeros(array.size)
            picks = np.arange(flat.size) if flat.size <= FD_COORDS else \
                self.rng.choice(flat.size, FD_COORDS, replace=False)
            for i in picks:
                keep = flat[i]
                flat[i] = keep + FD_STEP
                up = loss()
                flat[i] = keep - FD_STEP
                down = loss()
                flat[i] = keep
                want[i] = (up - down) / (2 * FD_STEP)
            _compare(np.asarray(got).reshape(-1)[picks], want[picks], FD_TOL,
                     f"the {name} against central finite differences")

    def _targets(self, m: Sequential, dx, grads):
        if not self.reads:
            yield "input gradient", self.x, dx
        lo = 0
        for name, view in m.layers[0].params.items():
            yield f"gradient of parameter {name!r}", view, grads[lo:lo + view.size]
            lo += view.size

    def accumulate(self) -> None:
        m = self.fresh(self.ref, np.arange(self.rows))
        _, _, once, _ = self.step(m, self.x, self.dy)
        m.state[...] = self.state0
        _, _, twice, _ = self.step(m, self.x, self.dy, accumulate=True)
        _compare(twice, 2 * once, EXACT_TOL, "the gradient after a second backward with "
                 "accumulate=True", ": it must add to the gradients, not replace them")

    def sums(self) -> None:
        m = self.fresh(self.ref, np.arange(self.rows))
        _, dx, g, _ = self.step(m, self.x, self.dy)
        m = self.fresh(self.ref, np.tile(np.arange(self.rows), 2))
        _, dx2, g2, _ = self.step(m, np.concatenate([self.x, self.x]), np.concatenate([self.dy, self.dy]))
        if g.any() and not np.allclose(g2, 2 * g, rtol=EXACT_TOL, atol=EXACT_TOL * 10):
            ratio = float(g2 @ g / (g @ g))
            raise _Broken(f"the parameter gradients of a batch given twice are {ratio:.3g} times those "
                          f"of the batch, not 2 times: backward must write sums over the rows, not means")
        if dx is not None:
            for half in (dx2[:self.rows], dx2[self.rows:]):
                _compare(half, dx, EXACT_TOL, "the input gradient of a row of a batch given "
                         "twice", " (it must not depend on the number of rows)")

    def counted(self, n: int) -> list[tuple[int, ...]]:
        """The shapes ``reduce_sum`` gets in a step of ``n`` rows, in order."""
        calls: list[tuple[int, ...]] = []
        m = self.fresh(self.model(), np.arange(n), lambda a: calls.append(np.shape(a)) or a)
        self.step(m, self.x[:n], self.dy[:n])
        return calls

    def empty(self) -> None:
        try:
            self.calls = {0: self.counted(0)}
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: any failure
            raise _Broken(f"forward and backward of 0 rows raised {_describe(exc)}: a rank "
                          f"may hold no rows of a step and still runs every layer") from None

    def collectives(self) -> None:
        self.calls.update({n: self.counted(n) for n in (self.rows, 1)})
        if len({tuple(c) for c in self.calls.values()}) > 1:
            said = "; ".join(f"{n} row{'s' * (n != 1)}: {len(c)} call(s) of sizes "
                             f"{[int(np.prod(s)) for s in c]}" for n, c in self.calls.items())
            raise _Broken(f"reduce_sum is called differently with different numbers of rows "
                          f"({said}): every rank must make the same calls, whatever its rows")

    def simulate(self) -> None:
        """Rules ``state`` and ``ranks``: P threads, one of them with no rows."""
        one = self.step(self.fresh(self.ref, np.arange(self.rows)), self.x, self.dy)
        sizes = [len(p) for p in np.array_split(np.arange(self.rows), self.ranks - 1)]
        sizes.insert(1, 0)
        edges = np.cumsum([0, *sizes])
        group, out, errors = _Group(self.ranks), [None] * self.ranks, [None] * self.ranks
        models = [self.model() for _ in range(self.ranks)]

        def run(r: int) -> None:
            lo, hi = edges[r], edges[r + 1]
            try:
                m = self.fresh(models[r], np.arange(lo, hi), group.reduce_sum(r))
                out[r] = self.step(m, self.x[lo:hi], self.dy[lo:hi])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[r] = exc
                group.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = [(r, e) for r, e in enumerate(errors)
               if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if any(e is not None for e in errors):
            r, e = bad[0] if bad else (0, errors[0])
            self.failures.append(("ranks", f"{self.ranks} simulated ranks of {sizes} rows: "
                                           f"rank {r} raised {_describe(e)}"))
            return
        where = f"{self.ranks} simulated ranks holding {sizes} rows"
        self.rule("state", self._state, one, out, where)
        self.rule("ranks", self._ranks, one, out, where)

    def _state(self, one, out, where: str) -> None:
        layer = self.ref.layers[0]
        names = [repr(k) for k, v in layer.state.items() for _ in range(v.size)]
        for r in range(1, self.ranks):
            if not np.array_equal(out[r][3], out[0][3]):
                _, at = _worst(out[r][3], out[0][3])
                raise _Broken(f"state {names[at[0]] if at else ''} differs between ranks 0 and "
                              f"{r} ({where}): update it only from figures summed with "
                              f"context.reduce_sum, never from the rank's own rows")
        _compare(out[0][3], one[3], EXACT_TOL, f"the state after one step on {where}",
                 " from what one process holds")

    def _ranks(self, one, out, where: str) -> None:
        _compare(np.concatenate([o[0] for o in out]), one[0], EXACT_TOL,
                 f"the output on {where}", " from one process's")
        if one[1] is not None:
            _compare(np.concatenate([o[1] for o in out]), one[1], EXACT_TOL,
                     f"the input gradient on {where}", " from one process's")
        _compare(np.sum([o[2] for o in out], axis=0), one[2], EXACT_TOL,
                 f"the sum of the ranks' parameter gradients on {where}", " from one process's")

    def config(self) -> None:
        try:
            again = from_spec(self.ref.spec(), np.float64)
        except ValueError as exc:
            raise _Broken(f"the layer cannot be rebuilt from its config: {exc}") from None
        again.params[...], again.state[...] = self.params0, self.state0
        m = self.fresh(self.ref, np.arange(self.rows))
        m.context.training = again.context.training = False
        _compare(again.forward(self.x), m.forward(self.x), EXACT_TOL,
                 "the rebuilt layer's evaluation output", " (config() misses a setting)")

    # ------------------------------------------------------------------ bookkeeping
    def run(self, report: Report) -> None:
        self.checked, self.failures = report.checked, report.failures
        if self.rule("shapes", self.shapes) and self.rule("buffers", self.buffers):
            for name in ("gradients", "accumulate", "sums"):
                self.rule(name, getattr(self, name))
            if self.rule("empty", self.empty) and self.rule("collectives", self.collectives):
                self.simulate()
            self.rule("config", self.config)
        broken = {rule for rule, _ in report.failures}
        report.skipped = [r for r in RULES if r not in report.checked and r not in broken]

    def rule(self, name: str, check: Callable, *args) -> bool:
        try:
            check(*args)
        except _Broken as exc:
            self.failures.append((name, str(exc)))
            return False
        except MemoryError:  # the size of the check, not a rule
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: any failure
            self.failures.append((name, f"raised {_describe(exc)}"))
            return False
        self.checked.append(name)
        return True


def check_layer(layer: Layer | Callable[[], Layer], n_in: int | Sequence[int] = 8, *,
                ranks: int = 3, rows: int = 7, seed: int = 0, strict: bool = True) -> Report:
    """Check a layer against the layer contract (:data:`RULES`) in float64. ``layer``: a
    :class:`mpidp.nn.Layer` class or a function taking no arguments that makes a fresh layer, or
    a layer not yet in a model (copied for each use). ``n_in``: the per-sample input shape (a
    width or a tuple). ``ranks`` >= 2 simulated ranks split a batch of ``rows`` rows, one rank
    holding none. Returns the :class:`Report`; with ``strict`` (default), raises
    :class:`mpidp.errors.MpidpError` naming every broken rule, one line each, instead.
    ``MemoryError`` (inputs too large for this machine) is raised as it is: not the layer's fault."""
    if isinstance(layer, Layer):
        proto = layer

        def layer() -> Layer:
            return copy.deepcopy(proto)
    if not callable(layer):
        raise TypeError(f"check_layer needs a Layer, a Layer class or a function that makes "
                        f"one, got {layer!r}")
    if not (isinstance(ranks, int) and ranks >= 2 and isinstance(rows, int) and rows >= ranks):
        raise ValueError(f"check_layer needs ranks >= 2 and rows >= ranks, got ranks={ranks!r}, "
                         f"rows={rows!r}")
    in_shape = as_shape(n_in)
    name = getattr(layer, "__qualname__", None) or type(layer).__name__
    report = Report(name)
    with np.errstate(all="ignore"):  # a layer's NaN is reported once, as a broken rule
        try:
            checker = _Checker(layer, in_shape, ranks, rows, seed)
            report.layer = repr(checker.ref.layers[0])
        except _Broken as exc:
            report.failures.append(("shapes", str(exc)))
        except MemoryError:
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: any failure
            report.failures.append(("shapes", f"the layer cannot be built for per-sample "
                                    f"shape {in_shape}: {_describe(exc)}"))
        else:
            checker.run(report)
    if strict and not report.ok:
        raise MpidpError(str(report))
    return report
