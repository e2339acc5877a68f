"""Feature standardisation with EXACT global statistics, computed data-parallel:
:class:`Standardize`, set by :meth:`Standardize.fit_` from the training set's global count,
mean and centred sum of squares, which ranks holding parts of it get in one of two ways
(the caller runs the collectives):

- one gather, not additive: every rank's :func:`moments` merged by :func:`combine_moments`
  (Chan et al.'s pairwise formula), accurate to about ``1e-16 * |mean| / std``;
- two allreduce sums, additive: :func:`pass1_sums`, :func:`pass1_mean`, then
  :func:`pass2_squares` about that mean, accurate to ~1e-15 relative whatever the data.

Both are exact for uneven and empty shards: what one process computes on all the rows."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .layers import ParameterFree, Shapes, is_finite_number, register_layer
from .norm import _SampleShaped

#: ``(count, mean, M2)``: rows, per-element mean and ``sum((x - mean)**2)``, both float64.
Moments = tuple[int, np.ndarray, np.ndarray]

_CHUNK = 1 << 20  # values per block in moments(): bounds the float64 temporary (8 MiB)


def _rows(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"{what} takes a batch (n, *sample_shape) with at least one sample "
                         f"axis, got shape {x.shape}: reshape a 1-D array to (n, 1)")
    return x


def _block_moments(x: np.ndarray) -> Moments:
    """Corrected two-pass moments of the rows of one block (n >= 1), in float64."""
    n = len(x)
    mean = np.sum(x, axis=0, dtype=np.float64) / n
    d = np.subtract(x, mean, dtype=np.float64)
    corr = d.sum(axis=0) / n  # the rounding error of the first mean
    m2 = np.einsum("i...,i...->...", d, d) - n * corr * corr
    return n, mean + corr, np.maximum(m2, 0.0)


def moments(x: np.ndarray) -> Moments:
    """This rank's ``(count, mean, M2)`` of the rows of ``x`` ``(n, *sample_shape)`` (zeros
    when ``n == 0``), in blocks merged by :func:`combine_moments`: bounded memory."""
    x = _rows(x, "moments")
    n, shape = len(x), x.shape[1:]
    if n == 0:
        return 0, np.zeros(shape), np.zeros(shape)
    step = max(1, _CHUNK // max(1, int(np.prod(shape))))
    return combine_moments(_block_moments(x[i:i + step]) for i in range(0, n, step))


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of the union of two disjoint sets of rows (Chan, Golub and LeVeque's
    update, below); either side may be empty (count 0)."""
    (na, ma, m2a), (nb, mb, m2b) = [(int(n), np.asarray(m, np.float64), np.asarray(q, np.float64))
                                    for n, m, q in (a, b)]
    if ma.shape != mb.shape:
        raise ValueError(f"cannot merge moments of shapes {ma.shape} and {mb.shape}")
    if nb == 0:
        return na, ma.copy(), m2a.copy()
    if na == 0:
        return nb, mb.copy(), m2b.copy()
    n = na + nb
    d = mb - ma
    return n, ma + d * (nb / n), m2a + m2b + d * d * (na * (nb / n))


def combine_moments(parts: Iterable[Moments]) -> Moments:
    """The moments of all the rows of disjoint parts, by a pairwise tree of
    :func:`merge_moments` (their order matters only to rounding)."""
    level = list(parts)
    if not level:
        raise ValueError("combine_moments needs at least one (count, mean, M2) part")
    while len(level) > 1:  # neighbours in pairs; an odd one out waits for the next round
        level = [merge_moments(*level[i:i + 2]) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    n, mean, m2 = level[0]
    return int(n), np.asarray(mean, np.float64), np.asarray(m2, np.float64)


def pass1_sums(x: np.ndarray) -> np.ndarray:
    """First pass of the two-pass route: ``[count, *sum(x, axis=0).ravel()]`` float64
    ``(1 + F,)``, to be summed over the ranks (Allreduce)."""
    x = _rows(x, "pass1_sums")
    return np.concatenate([[len(x)], np.sum(x, axis=0, dtype=np.float64).ravel()])


def pass1_mean(total: np.ndarray) -> tuple[int, np.ndarray]:
    """``(count, mean (F,))`` from the summed :func:`pass1_sums`; mean 0 when count is 0."""
    total = np.asarray(total, np.float64).ravel()
    n = int(total[0])
    return n, (total[1:] / n if n > 0 else np.zeros(total.size - 1))


def pass2_squares(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Second pass: ``sum((x - mean)**2, axis=0).ravel()`` float64 ``(F,)`` about the
    GLOBAL ``mean`` (:func:`pass1_mean`), to be summed over the ranks: the ``M2``."""
    x = _rows(x, "pass2_squares")
    f = int(np.prod(x.shape[1:]))
    mean = np.asarray(mean, np.float64).ravel()
    if mean.size != f:
        raise ValueError(f"pass2_squares: mean has {mean.size} items, the samples {f}")
    out = np.zeros(f)
    step = max(1, _CHUNK // max(1, f))
    for i in range(0, len(x), step):
        d = np.subtract(x[i:i + step].reshape(-1, f), mean, dtype=np.float64)
        out += np.einsum("ij,ij->j", d, d)
    return out


@register_layer
class Standardize(_SampleShaped, ParameterFree):
    """Per-element standardisation ``y = (x - mean) / std`` of samples of any shape; state
    ``mean`` (zeros) and ``std`` (ones) of the per-sample shape, set by :meth:`fit_`.
    Nothing trained, the same in training and evaluation, no collective."""

    _std: np.ndarray | None = None  # the std of the last forward, for input_grad

    def state_shapes(self) -> Shapes:
        return {"mean": self._known_shape(), "std": self._known_shape()}

    def init_(self, rng: np.random.Generator) -> None:
        if self.state:  # a scratch copy (a pipeline's other stages) may have none bound
            self.state["mean"][...], self.state["std"][...] = 0, 1

    def fit_(self, count: int, mean: np.ndarray, m2: np.ndarray, eps: float = 1e-10) -> Standardize:
        """Set the state from the training set's GLOBAL moments (``count`` >= 1; ``mean``,
        ``m2`` of the per-sample shape or flat); returns self. ``std = sqrt(M2 / count)``
        (biased, as scikit-learn's); a feature constant up to rounding (``std <= eps *
        |mean|``, or below the dtype's smallest normal) gets ``std = 1``: only centred."""
        if self.shape is None or not self.state:
            raise ValueError("Standardize.fit_ needs the layer in a model (its state bound)")
        if int(count) < 1:
            raise ValueError(f"Standardize.fit_ needs at least one training row, got count {count}")
        if not is_finite_number(eps) or eps < 0:
            raise ValueError(f"Standardize.fit_ eps must be a finite number >= 0, got {eps!r}")
        size = int(np.prod(self.shape))
        mean, m2 = (np.asarray(a, np.float64).ravel() for a in (mean, m2))
        if mean.size != size or m2.size != size:
            raise ValueError(f"Standardize.fit_: mean and M2 must have {size} items (shape "
                             f"{self.shape}), got {mean.size} and {m2.size}")
        if not (np.isfinite(mean).all() and np.isfinite(m2).all()):
            raise ValueError("Standardize.fit_: the mean or M2 holds NaN or Inf: the training "
                             "data has non-finite values")
        std = np.sqrt(np.maximum(m2, 0.0) / int(count))
        tiny = np.finfo(self.state["std"].dtype).tiny  # what would be 0 in the state's dtype
        std[(std <= eps * np.abs(mean)) | (std < tiny)] = 1.0
        self.state["mean"][...] = mean.reshape(self.shape)
        self.state["std"][...] = std.reshape(self.shape)
        return self

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._check_batch(x)
        std = self.state["std"]
        if not (std > 0).all():
            raise ValueError("Standardize has a std <= 0 (or NaN) in its state: initialise the "
                             "model (model.init_) or call Standardize.fit_ before using it")
        self._std = std
        y = np.subtract(x, self.state["mean"])
        y /= std
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        return dy / self._std
