"""Cost-aware draft lengths chosen jointly for all slots of a batched step (policy ``"auto"``).

One step decodes every slot's ``[sampled] + draft`` (and prompt chunks) in one ``llama_decode``,
whose time depends on the total token count N, not on how it is split among slots. The step
yields, per slot, 1 + the accepted draft tokens. So the draft lengths k_s are chosen together to
maximize the expected output tokens per second of the step:

    sum_s (1 + E[accepted_s | k_s])  /  t(N0 + sum_s k_s)

with N0 the step's tokens that do not depend on the choice (one sampled token per slot, drafts of
``"fixed"`` requests, prompt chunks). E[accepted | k] = q_1 + q_1 q_2 + ... + q_1...q_k, where q_i
is the probability that draft position i is accepted given the earlier ones were (per request,
learned online from every draft's outcome, verified or not: `ngramspec.acceptance`; the first
position's prior is what the scheduler's recent drafts achieved). The marginal gain of a slot's j-th draft
token, q_1...q_j, never grows with j, so for each total M the best split takes the M largest gains
over all slots (an exchange argument); the choice is the M with the best ratio.

t(N) is the step cost curve (:class:`StepCost`), measured on the scheduler's own context at start
(a few decodes of 1 .. 64 tokens) and updated from every step's decode time.
"""
from __future__ import annotations

import bisect
import time
from typing import Dict, List, Sequence

import numpy as np

__all__ = ["StepCost", "choose_lengths"]

#: Batch sizes whose decode time is measured at start (then tracked per power-of-two bucket).
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Longest draft position with its own acceptance statistics (later positions share the last).
MAX_POS = 64
# 1 .. 8, then steps of about a quarter octave (10, 12, 16, 20, 24, ...)
_GRID = sorted(set(range(1, 9)) | {int(round(8 * 1.25 ** i)) for i in range(1, 40)})


class StepCost:
    """Decode seconds of a batch of N tokens: an exponential moving average per size bucket
    (1 .. 8, then a quarter-octave grid), interpolated linearly in between and extrapolated
    proportionally beyond the largest measured bucket.

    Notes
    -----
    Memory: a few dozen floats. Thread-safety: not thread-safe (the decode thread's).
    """

    def __init__(self, alpha: float = 0.1):
        self.alpha = alpha
        self._t: Dict[int, float] = {}    # bucket size -> seconds
        self._grid: List[int] = []
        self._times = np.empty(0)

    @staticmethod
    def bucket(n: int) -> int:
        """The grid size that ``n`` tokens are counted in (the smallest one >= n)."""
        return int(_GRID[min(bisect.bisect_left(_GRID, n), len(_GRID) - 1)])

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or seconds <= 0:
            return
        b = self.bucket(n)
        old = self._t.get(b)
        # scale to the bucket's size (the cost is close to linear within a quarter octave)
        s = seconds * b / n
        self._t[b] = s if old is None else old + self.alpha * (s - old)
        self._grid = sorted(self._t)
        self._times = np.array([self._t[g] for g in self._grid])

    @property
    def calibrated(self) -> bool:
        return len(self._grid) >= 2

    def __call__(self, n) -> np.ndarray:
        """t(n) for an array of token counts."""
        n = np.asarray(n, dtype=np.float64)
        grid = np.asarray(self._grid, dtype=np.float64)
        t = np.interp(n, grid, self._times)
        big = n > grid[-1]
        t[big] = self._times[-1] * n[big] / grid[-1]
        return t

    def calibrate(self, decode, sizes: Sequence[int] = CALIBRATION_SIZES, reps: int = 2) -> None:
        """Time ``decode(n)`` (one decode of n tokens) for each size, keeping the fastest rep."""
        for n in sizes:
            best = min(_timed(decode, n) for _ in range(reps))
            self._t.pop(self.bucket(n), None)
            self.observe(n, best)


def _timed(fn, n) -> float:
    t0 = time.perf_counter()
    fn(n)
    return time.perf_counter() - t0


def choose_lengths(gains: Sequence[np.ndarray], n_base: int, e_base: float, cost: StepCost
                   ) -> List[int]:
    """The k_s maximizing ``(e_base + sum of the chosen gains) / cost(n_base + sum k_s)``.

    Parameters
    ----------
    gains : list of 1-D arrays
        Per slot, the expected gain of its 1st, 2nd, ... draft token (non-increasing).
    n_base, e_base : the step's tokens and expected output tokens that do not depend on the choice.
    cost : StepCost
    """
    if not gains or all(len(g) == 0 for g in gains):
        return [0] * len(gains)
    owner = np.concatenate([np.full(len(g), s) for s, g in enumerate(gains)])
    allg = np.concatenate(gains)
    pos = np.concatenate([np.arange(len(g)) for g in gains])
    order = np.lexsort((pos, -allg))       # largest gains first, earlier positions on ties
    cum = np.concatenate([[0.0], np.cumsum(allg[order])])
    m = np.arange(len(cum))
    ratio = (e_base + cum) / cost(n_base + m)
    best = int(np.argmax(ratio))
    return np.bincount(owner[order[:best]], minlength=len(gains)).tolist()
