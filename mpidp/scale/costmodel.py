"""A latency-bandwidth (alpha-beta-gamma) model of a data-parallel step. Pure NumPy.

Sending ``m`` bytes costs ``alpha + m * beta``, reducing them ``m * gamma``; the
algorithms' costs at ``P`` ranks are the standard formulas (Thakur, Rabenseifner & Gropp
2005; :func:`allreduce_time`). A step is ``compute(B/P) + wait(P) + communicate(P, m)``:
compute is measured (:class:`Compute`), and ``wait``, what a synchronous step loses to the
slowest of ``P`` ranks whose step times spread by ``jitter``, is ``jitter * sqrt(2 ln P)``
means (the Gaussian extreme-value rate)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

ALGORITHMS = ("ring", "recursive-doubling", "parameter-server", "reduce-broadcast")


@dataclass
class Fit:
    """Fitted constants: seconds, seconds per byte, seconds per byte reduced."""

    alpha: float
    beta: float
    gamma: float


@dataclass
class Compute:
    """A rank's compute per step: ``overhead + per_sample * b`` seconds for ``b`` local samples
    alone, times ``contention`` (>= 1) when all compute at once; ``jitter`` (>= 0): the
    standard deviation of a step's time over its mean."""

    per_sample: float
    overhead: float = 0.0
    contention: float = 1.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        self.contention = max(1.0, float(self.contention))
        self.jitter = max(0.0, float(self.jitter))

    def scaled(self, factor: float) -> Compute:
        """The same machine doing ``factor`` times the work per step (a bigger model)."""
        return replace(self, per_sample=self.per_sample * factor, overhead=self.overhead * factor)


def fit_alpha_beta(nbytes: np.ndarray, seconds: np.ndarray, small: int = 4096,
                   large: int = 1 << 18) -> tuple[float, float]:
    """``t = alpha + beta * m`` from ping-pong samples (Hockney): ``alpha`` the mean time of
    the messages of at most ``small`` bytes, ``beta`` the least-squares slope of ``t - alpha``
    over those of at least ``large`` (one line when a range is empty). Both >= 0."""
    m, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    lo, hi = m <= small, m >= large
    if not lo.any() or not hi.any():
        (alpha, beta), *_ = np.linalg.lstsq(np.column_stack([np.ones(len(m)), m]), t, rcond=None)
    else:
        alpha = float(t[lo].mean())
        beta = float(np.dot(m[hi], t[hi] - alpha) / np.dot(m[hi], m[hi]))
    return max(float(alpha), 0.0), max(float(beta), 0.0)


def fit_gamma(P: int, nbytes: np.ndarray, seconds: np.ndarray, alpha: float, beta: float,
              algorithm: str = "ring") -> float:
    """``gamma`` that best explains measured allreduce times at ``P`` ranks, given alpha, beta."""
    m = np.asarray(nbytes, float)
    base = allreduce_time(P, m, Fit(alpha, beta, 0.0), algorithm)
    per_byte = allreduce_time(P, m, Fit(0.0, 0.0, 1.0), algorithm)
    g = float(np.dot(per_byte, np.asarray(seconds) - base)
              / max(np.dot(per_byte, per_byte), 1e-300))
    return max(g, 0.0)


def allreduce_time(P, m, fit: Fit, algorithm: str = "ring"):
    """Predicted seconds to combine ``m`` bytes over ``P`` ranks (arrays broadcast):

    * ``ring``: ``2(P-1) alpha + 2 (P-1)/P m beta + (P-1)/P m gamma``;
    * ``recursive-doubling``: ``log2(P) (alpha + m beta + m gamma)``;
    * ``parameter-server`` (central): ``2 (P-1) (alpha + m beta) + (P-1) m gamma``;
    * ``reduce-broadcast`` (mpidp's ``ps`` between nodes: reduce-scatter, gather to the
      server, scatter + allgather): ``(3 (P-1) + log2 P) alpha + 4 (P-1)/P m beta + (P-1)/P
      m gamma``: twice a ring's bytes, but no link carries more than ``2 m``."""
    P, m = np.asarray(P, float), np.asarray(m, float)
    if algorithm == "ring":
        t = 2 * (P - 1) * fit.alpha + 2 * (P - 1) / P * m * fit.beta + (P - 1) / P * m * fit.gamma
    elif algorithm == "recursive-doubling":
        t = np.log2(np.maximum(P, 1)) * (fit.alpha + m * fit.beta + m * fit.gamma)
    elif algorithm == "parameter-server":
        t = 2 * (P - 1) * (fit.alpha + m * fit.beta) + (P - 1) * m * fit.gamma
    elif algorithm == "reduce-broadcast":
        t = ((3 * (P - 1) + np.log2(np.maximum(P, 1))) * fit.alpha
             + 4 * (P - 1) / P * m * fit.beta + (P - 1) / P * m * fit.gamma)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    return np.where(P <= 1, 0.0, t)


def step_time(P, m, batch: int, compute: float | Compute, fit: Fit, algorithm: str = "ring",
              cores: int | None = None):
    """Predicted step seconds at ``P`` ranks for a global ``batch`` and ``m`` gradient bytes
    (``compute``: a :class:`Compute` or seconds per sample; ``cores``: ranks share them)."""
    c = compute if isinstance(compute, Compute) else Compute(float(compute))
    P = np.asarray(P, float)
    per_core = 1.0 if cores is None else np.ceil(P / cores)
    work = per_core * (c.overhead + c.per_sample * batch / P) * np.where(P > 1, c.contention, 1.0)
    wait = work * c.jitter * np.sqrt(2 * np.log(np.maximum(P, 1)))
    return work + wait + allreduce_time(P, m, fit, algorithm)


def efficiency(P, m, batch: int, compute: float | Compute, fit: Fit, algorithm: str = "ring"):
    """Parallel efficiency ``T(1) / (P T(P))`` at fixed global batch (strong scaling)."""
    t1 = step_time(1, m, batch, compute, fit, algorithm)
    return t1 / (np.asarray(P, float) * step_time(P, m, batch, compute, fit, algorithm))


def ps_limit(m: float, batch: int, compute: float | Compute, fit: Fit, max_P: int = 1024) -> int:
    """The rank count beyond which a central parameter server gets SLOWER per step: the P
    minimising its predicted step time (powers of two up to ``max_P``)."""
    Ps = 2 ** np.arange(0, int(np.log2(max_P)) + 1)
    t = step_time(Ps, m, batch, compute, fit, "parameter-server")
    return int(Ps[int(np.argmin(t))])


def prediction_table(fit: Fit, compute_per_param: float | Compute, batch: int,
                     params=(1e4, 1e5, 1e6, 1e7, 1e8, 1e9), bytes_per_param: int = 4,
                     Ps=(1, 2, 4, 8, 16, 64, 256, 1024)) -> list[dict]:
    """Rows ``{params, P, algorithm, step_s, efficiency}``, compute scaling with the parameter
    count from ``compute_per_param``, a one-parameter model's (s per sample, or a Compute)."""
    per_param = (compute_per_param if isinstance(compute_per_param, Compute)
                 else Compute(float(compute_per_param)))
    models = [(int(n), n * bytes_per_param, per_param.scaled(n)) for n in params]
    return [{"params": n, "P": int(P), "algorithm": alg,
             "step_s": float(step_time(P, m, batch, c, fit, alg)),
             "efficiency": float(efficiency(P, m, batch, c, fit, alg))}
            for n, m, c in models for alg in ALGORITHMS for P in Ps]


#: The schedules :func:`mode_step_time` predicts, by name, and how each exchanges the gradient.
MODES = {"allreduce": "flat", "overlapped": "overlap", "overlapped-forward": "overlap-next",
         "compressed": "coded", "node-aware": "leaders"}


def mode_step_time(mode: str, P: int, m: float, compute: float, fit: Fit, *,
                   backward: float = 2 / 3, first_bucket: float = 0.0, codec: float = 0.0,
                   per_node: int = 1, link_hops: int = 1, cpu_per_byte: float = 0.0,
                   wire_share: float = 0.5, cores: int | None = None,
                   last_bucket: float = 0.0, node: float = 0.0) -> float:
    """Predicted seconds of one step of schedule ``mode`` (:data:`MODES`) at ``P`` ranks with
    ``m`` gradient bytes, from a measured ``compute`` ``c`` (forward + backward + update of
    one rank's share) and the link's :class:`Fit`:

    * ``allreduce``: ``c + ring(P, m)``;
    * ``overlapped``: ``(1 - backward) c + max(backward c, first_bucket backward c + ring(P,
      m))``: the exchange starts ``first_bucket`` into backward (``backward``: its share of c);
    * ``overlapped-forward``: ``max(c, first_bucket backward c + ring(P, m))``;
    * ``compressed``: as ``overlapped`` on ``wire_share`` of the bytes, plus ``codec`` seconds;
    * in these three the last bucket's ``ring(P, last_bucket m)`` follows backward, and the
      exchange's work on the computing cores (``cpu_per_byte`` per byte sent) lengthens it;
    * ``node-aware``: ``P / per_node`` leaders run the ring, plus ``node`` seconds inside nodes.

    ``link_hops``: hops of the flat ring sharing the busiest link's direction. ``cores``: the
    cores all ``P`` ranks share (None: their own); ``s = exchanging / cores`` ranks then share
    each core's work, and a ring moves a byte in ``max(beta, s cpu_per_byte)``."""
    shape = MODES.get(mode)
    if shape is None:
        raise ValueError(f"unknown mode {mode!r}; expected one of {tuple(MODES)}")

    def shared(exchanging: int) -> float:  # ranks per core driving an exchange at once
        return 1.0 if cores is None else max(exchanging / max(cores, 1), 1.0)

    if shape in ("flat", "leaders"):  # one ring after compute: of all P ranks, or of the leaders
        flat = shape == "flat"
        ring = P if flat else max(P // max(per_node, 1), 1)
        per_byte = max(fit.beta * (max(link_hops, 1) if flat else 1), shared(ring) * cpu_per_byte)
        return (compute + (0.0 if flat else node)
                + float(allreduce_time(ring, m, Fit(fit.alpha, per_byte, fit.gamma))))
    b, coded = backward * compute, shape == "coded"
    wire = m * wire_share if coded else m
    cpu = shared(P) * cpu_per_byte * wire * 2 * (P - 1) / max(P, 1)
    ring = float(allreduce_time(P, wire, fit))
    last = float(allreduce_time(P, last_bucket * wire, fit)) if last_bucket > 0 else 0.0
    if shape == "overlap-next":
        return max(compute + cpu + last, first_bucket * b + ring)
    return (compute - b) + max(b + cpu + last, first_bucket * b + ring) + (codec if coded else 0.0)
