"""A progress bar for an epoch's steps on rank 0's stderr (no MPI)."""

from __future__ import annotations

import sys


class Progress:
    """A progress bar on stderr: tqdm when installed, otherwise a line per 10% of the epoch."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0) -> None:
        self.total, self.desc, self.enabled, self.n, self._bar = total, desc, enabled, initial, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=True,
                                 file=sys.stderr, dynamic_ncols=True, mininterval=0.1)
            except ImportError:
                pass

    def update(self, loss: float) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        elif self.enabled and (self.n == self.total or self.n % max(self.total // 10, 1) == 0):
            print(f"{self.desc}: {self.n}/{self.total} steps, loss {loss:.4f}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
