"""Workloads that make partitioning matter. No MPI here.

``bow``: a bag-of-words classification set whose rows are sparse (CSR) with Zipf-like
(Pareto-tailed) lengths, stored SORTED BY LENGTH as real files often are: the short
documents first, the long ones last. With :class:`mpidp.nn.SparseDense` as the first layer
the work of a sample is proportional to its number of non-zeros, so a contiguous split of
this data is badly skewed. Every rank can generate any rows (seeded per chunk), and the
per-sample cost (``nnz + overhead``) is known from the lengths alone.
"""

from __future__ import annotations

import numpy as np

from .nn.sparse import CSR
from .sources import Source


class BowSource(Source):
    """``n_samples`` sparse documents over a vocabulary of ``n_features`` words.

    Row ``i`` has ``lengths[i]`` word occurrences (``lengths`` ascending, Pareto tail of
    index ``alpha`` from ``min_len``, capped at ``max_len``); words are drawn Zipf-like from
    the vocabulary; values are ``1/sqrt(length)``. The label is the class with the largest
    summed affinity of the row's words (a planted linear rule, so it is learnable).
    Row ``i`` is the same whatever rows are requested together.
    """

    CHUNK = 1024

    def __init__(self, n_samples: int = 20000, n_features: int = 2000, n_classes: int = 10,
                 seed: int = 0, min_len: int = 5, max_len: int = 1000, alpha: float = 1.1,
                 overhead: float = 8.0) -> None:
        if n_samples < 1 or n_features < 1 or n_classes < 2:
            raise ValueError(f"bow: need n_samples >= 1, n_features >= 1 and n_classes >= 2, "
                             f"got {n_samples}, {n_features}, {n_classes}")
        self.name, self.classification = "bow", True
        self.n_samples, self.n_features, self.n_classes = n_samples, n_features, n_classes
        self.seed, self.overhead = seed, float(overhead)
        rng = np.random.default_rng([seed, 0xB0])
        tail = min_len * (1.0 - rng.random(n_samples)) ** (-1.0 / alpha)
        self.lengths = np.sort(np.minimum(np.round(tail), max_len).astype(np.int64))
        ranks = np.arange(1, n_features + 1, dtype=np.float64)
        self._word_p = (1.0 / ranks) / np.sum(1.0 / ranks)  # Zipf word frequencies
        self._affinity = rng.standard_normal((n_features, n_classes))

    def costs(self) -> np.ndarray:
        """Work of each row, float64 ``(n_samples,)``: its non-zeros plus a fixed overhead
        (the dense layers after the sparse one)."""
        return self.lengths + self.overhead

    def _chunk(self, c: int) -> CSR:
        lo, hi = c * self.CHUNK, min((c + 1) * self.CHUNK, self.n_samples)
        lengths = self.lengths[lo:hi]
        rng = np.random.default_rng([self.seed, 0xB1, c])
        words = rng.choice(self.n_features, int(lengths.sum()), p=self._word_p)
        values = np.repeat(1.0 / np.sqrt(np.maximum(lengths, 1)), lengths)
        return CSR(np.concatenate([[0], np.cumsum(lengths)]), words, values, self.n_features)

    def _labels(self, X: CSR) -> np.ndarray:
        rows = np.repeat(np.arange(len(X)), X.row_lengths())
        score = np.zeros((len(X), self.n_classes))
        np.add.at(score, rows, self._affinity[X.indices] * X.data[:, None])
        return score.argmax(axis=1).astype(np.int64)

    def read(self, rows: np.ndarray) -> tuple[CSR, np.ndarray]:
        rows = np.asarray(rows, np.int64)
        chunk_of = rows // self.CHUNK
        parts = []
        for c in np.unique(chunk_of):
            parts.append(self._chunk(int(c))[rows[chunk_of == c] - c * self.CHUNK])
        X = CSR.concat(parts, self.n_features, np.float64)
        by_chunk = np.argsort(chunk_of, kind="stable")  # parts came chunk by chunk
        if (np.diff(by_chunk) < 0).any():
            X = X[np.argsort(by_chunk)]
        return X, self._labels(X)
