"""Online estimates of how much of a draft the target will accept.

For a proposer without probabilities of its own, the chance that drafted token i is accepted is
modeled by position alone: q_i = P(token i accepted | tokens 1 .. i-1 accepted). A verified step
with a draft of n tokens of which a were accepted shows, for each position,

- i <= a: reached and accepted;
- i = a + 1 (when a < n): reached and rejected;
- i > a + 1: not reached: nothing is known (censored).

Counting trials and successes per position that way is the Kaplan-Meier estimate of the
accepted length's survival function, so a fully accepted draft of n tokens says only "accepted
>= n" and never drags the estimate of position n + 1 down (nor up). The probability that the
first k tokens are all accepted is S_k = q_1 * ... * q_k, and the expected number accepted of a
k-token draft is E[A | k] = S_1 + ... + S_k.

Counts fade geometrically (``decay`` per observation), so a slot follows its request's phases
(copying a file, then writing new text); sparse positions borrow from the position before
(``prior_weight`` pseudo-observations of q_{i-1}, discounted by ``depth``), the first from
``prior``.
:func:`lean_on_previous` does the same for probabilities that come with their own evidence
counts (ngram-suffix's calibration cells).
"""
from __future__ import annotations

import numpy as np

from ngramspec.loop import common_prefix
from ngramspec.validation import OutOfRange, check_int, check_real

__all__ = ["AcceptanceEstimator", "DraftOutcomes", "expected_accepted", "lean_on_previous"]


def expected_accepted(q: np.ndarray) -> np.ndarray:
    """``E[A | k]`` for k = 0 .. len(q) from conditional acceptance probabilities.

    Parameters
    ----------
    q : numpy.ndarray
        q_i = P(token i accepted | tokens 1 .. i-1 accepted).

    Returns
    -------
    numpy.ndarray
        len(q) + 1 floats, element k = S_1 + ... + S_k (element 0 is 0).
    """
    out = np.zeros(len(q) + 1)
    if len(q):
        np.cumsum(np.cumprod(q), out=out[1:])
    return out


def lean_on_previous(p: np.ndarray, tried: np.ndarray, weight: float = 2.0) -> np.ndarray:
    """Probabilities backed by evidence counts, each shrunk towards the result before it.

    A proposer's own estimate for a late draft position may rest on almost nothing (a policy
    that cuts drafts short never lets those positions be scored): there the position before it is
    the better guess.

    Parameters
    ----------
    p : numpy.ndarray
        Probabilities per position.
    tried : numpy.ndarray
        Observations behind each.
    weight : float
        Pseudo-observations of the previous position's result; the first position is kept.

    Returns
    -------
    numpy.ndarray
        float64, a new array.
    """
    q = np.array(p, dtype=np.float64)
    for j in range(1, len(q)):
        q[j] = (tried[j] * q[j] + weight * q[j - 1]) / (tried[j] + weight)
    return q


class AcceptanceEstimator:
    """Per-position conditional acceptance of one proposer on one slot, censoring-aware.

    Parameters
    ----------
    n_max : int
        Longest draft followed (positions beyond it share the last one's estimate).
    prior : float
        Prior acceptance of the first position, 0 < prior < 1.
    prior_weight : float
        Pseudo-observations by which each position leans on the one before (the first on
        ``prior``).
    decay : float
        Every observation multiplies the earlier counts by this (0 < decay <= 1): a horizon of
        about ``1 / (1 - decay)`` steps.
    depth : float
        0 < depth <= 1. A position leans on the one before times `depth`, and every position
        beyond the observed ones is `depth` times the one before: the estimate does not take
        a draft to be as good past the evidence as at its edge (1.0: it does).

    Raises
    ------
    ValueError
        A parameter out of its range (the message names it).

    Notes
    -----
    Memory: two float64 arrays of ``n_max`` (4 KiB at 256).

    Thread-safety: not thread-safe; one per slot, used by the thread driving the slot.
    """

    __slots__ = ("n_max", "prior", "prior_weight", "decay", "tried", "accepted", "_n_seen",
                 "_q", "n_obs", "depth")

    def __init__(self, n_max: int = 256, *, prior: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.95, depth: float = 1.0):
        self.n_max = n_max = check_int("n_max", n_max, 1)
        self.prior = check_real("prior", prior, 0.0, 1.0, lo_open=True, hi_open=True)
        self.prior_weight = check_real("prior_weight", prior_weight, 0.0, lo_open=True)
        self.decay = check_real("decay", decay, 0.0, 1.0, lo_open=True)
        self.depth = check_real("depth", depth, 0.0, 1.0, lo_open=True)
        self.tried = np.zeros(n_max)
        self.accepted = np.zeros(n_max)
        self._n_seen = 0          # positions with any count: 0 .. _n_seen - 1
        self._q = None            # cached conditional estimates, None when stale
        self.n_obs = 0

    def observe(self, n_draft: int, n_accepted: int) -> None:
        """Learn from one verified draft (`fade`, then `count`).

        Counts fade per observation, not per step: a slot that stopped drafting keeps what it
        learned until drafts bring news.

        Parameters
        ----------
        n_draft : int
            Draft tokens verified (0 is ignored).
        n_accepted : int
            Of them, accepted.

        Raises
        ------
        ValueError
            `n_accepted` outside 0 .. `n_draft`.
        """
        if not 0 <= n_accepted <= n_draft:
            raise OutOfRange("n_accepted", n_accepted, f"0 .. n_draft = {n_draft}")
        if n_draft == 0:
            return
        self.fade()
        self.count(0, n_accepted, n_accepted < n_draft)
        self.n_obs += 1

    def fade(self) -> None:
        """Multiply every count by ``decay``: one draft's worth of forgetting."""
        seen = self._n_seen
        if self.decay < 1.0 and seen:
            self.tried[:seen] *= self.decay
            self.accepted[:seen] *= self.decay
            self._q = None

    def count(self, lo: int, hi: int, rejected: bool) -> None:
        """Positions ``lo + 1 .. hi`` (1-based) of a draft were reached and accepted, and
        position ``hi + 1`` was reached and rejected when `rejected`; no fading.

        `DraftOutcomes` resolves a draft position by position as the output grows, so one
        draft's evidence may arrive over several calls (``lo`` = the positions counted before).

        Parameters
        ----------
        lo, hi : int
            0 <= lo <= hi.
        rejected : bool
        """
        n_max = self.n_max
        a, b = min(lo, n_max), min(hi, n_max)
        if b > a:
            self.tried[a:b] += 1.0
            self.accepted[a:b] += 1.0
        reached = b
        if rejected and b < n_max:
            self.tried[b] += 1.0
            reached = b + 1
        if reached > self._n_seen:
            self._n_seen = reached
        self._q = None

    def conditional(self, n: int) -> np.ndarray:
        """q_1 .. q_n as a float64 array, each shrunk towards the one before (do not modify it)."""
        if self._q is None:
            q = np.empty(self.n_max)
            prev, w = self.prior, self.prior_weight
            t, s = self.tried, self.accepted
            seen = self._n_seen
            for i in range(seen):
                prev = (s[i] + w * prev * self.depth) / (t[i] + w)
                q[i] = prev
            # unseen positions: the last seen one's estimate, discounted once more per position
            q[seen:] = prev * self.depth ** np.arange(1, self.n_max - seen + 1)
            self._q = q
        if n <= self.n_max:
            return self._q[:n]
        return np.concatenate([self._q, np.full(n - self.n_max, self._q[-1])])

    def expected(self, n: int) -> np.ndarray:
        """``E[A | k]`` for k = 0 .. n, n + 1 floats (see :func:`expected_accepted`)."""
        return expected_accepted(self.conditional(n))


class DraftOutcomes:
    """Every draft's acceptance, verified or not, read off the output that follows it.

    Under greedy verification the target accepts a draft up to its first token that differs from
    the target's own continuation, so the output tells afterwards how much of any draft would have
    been accepted: of a draft cut short, of one dropped for a plain step. A policy that learns only
    from what it verified sees nothing beyond its cuts (censored) and nothing at all while it
    decodes plainly, so it must spend probes to find out whether drafting pays again; this reads
    the same facts for free. Each draft is resolved position by position as output arrives: a
    matching token is a position accepted, the first differing one a position rejected, and the
    draft is done (`AcceptanceEstimator.count`). With sampling the output is one draw of the
    target's choice, so the outcome is one sample of the acceptance.

    Parameters
    ----------
    max_pending : int
        Drafts followed at once; the oldest is dropped (its positions so far stay counted).

    Notes
    -----
    Memory: the pending drafts (at most `max_pending`, each an int32 copy).

    Thread-safety: not thread-safe; one per slot, used by the thread driving the slot.
    """

    __slots__ = ("max_pending", "pending")

    def __init__(self, max_pending: int = 64):
        self.max_pending = check_int("max_pending", max_pending, 1)
        self.pending = []     # [first predicted position, draft, estimators, positions counted]

    def clear(self) -> None:
        """Forget the pending drafts (a new request)."""
        self.pending.clear()

    def add(self, position: int, draft: np.ndarray, *estimators: AcceptanceEstimator) -> None:
        """Follow `draft`, whose first token predicts output position `position`.

        Each estimator fades once per draft (`AcceptanceEstimator.fade`).

        Parameters
        ----------
        position : int
            Index, in the request's token sequence (prompt + output), of the token the draft's
            first token predicts.
        draft : numpy.ndarray
            Copied.
        *estimators : AcceptanceEstimator
            Each receives the draft's outcome (a request's own and a shared one, say).
        """
        if len(draft) == 0:
            return
        for est in estimators:
            est.fade()
        if len(self.pending) >= self.max_pending:
            del self.pending[0]
        self.pending.append([int(position), np.array(draft, dtype=np.int32), estimators, 0])

    def resolve(self, tokens: np.ndarray, next_token: int = -1) -> None:
        """Count what the known tokens say of each pending draft.

        Parameters
        ----------
        tokens : numpy.ndarray
            The request's tokens so far (prompt + output), from position 0.
        next_token : int
            The token at position ``len(tokens)`` when it is already known (the target sampled
            it, the next step verifies it), -1 otherwise.
        """
        n_tok = len(tokens)
        end = n_tok + (next_token >= 0)
        keep = []
        for item in self.pending:
            start, draft, ests, done = item
            avail = min(len(draft), end - start)
            if avail <= done:
                keep.append(item)
                continue
            upto = max(min(avail, n_tok - start), done)
            matched = done + common_prefix(draft[done:upto], tokens[start + done:start + upto])
            # position n_tok, when the draft reaches it: the known next token
            rejected = matched < upto or (avail > upto and draft[upto] != next_token)
            if not rejected:
                matched = avail
            for est in ests:
                est.count(done, matched, rejected)
            if not rejected and matched < len(draft):
                item[3] = matched
                keep.append(item)
        self.pending = keep
