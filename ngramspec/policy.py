"""Draft-length policies for the verification loop (`ngramspec.loop.SlotLoop`).

- ``fixed`` (`FixedPolicy`): llama.cpp's behaviour, the whole draft is verified. The default of
  ``replay``, `SpecEngine` users and the golden files.
- ``auto`` (`AutoPolicy`): cost-aware. At each step it verifies the k of the draft's n tokens
  (0 <= k <= n) that maximizes the expected tokens per unit of time,

      E[accepted + 1 | k] / c(k + 1, L),

  where c is the verify-cost curve (`ngramspec.cost.CostModel`: a batch of k + 1 tokens over
  a KV cache of L tokens, in single-token decodes) and E comes from the drafting proposer: its
  own per-token probabilities where it has them (ngram-suffix), otherwise a per-slot,
  per-proposer, per-position acceptance estimate learned online from the verified steps
  (`ngramspec.acceptance.AcceptanceEstimator`, censoring-aware). k = 0 is a plain decode step.
  A slot probes its first draft, and a slot that stopped verifying drafts probes a short one
  now and then (after 8 plain steps, then 16, 32, ... up to 128), so it learns when drafting
  pays again.

  Extension: a verified draft that was cut short and accepted whole says only "at least k"
  about the positions after k (censored), so the estimates there stay at what the positions
  before them suggest, and on a CPU, where c(k) grows almost like k, that keeps a confident
  proposer's long drafts cut forever (ngram-mod's copies of a file are accepted whole, and pay
  only when verified long). So the next draft is verified to twice that
  length (up to the draft's own), while every draft since is accepted whole — slow start:
  the lengths double, and the first rejection ends it at a cost of at most the tokens won
  before it. The estimates then rest on observed positions; where the next position was
  already observed (less than once, counts faded), no extension. Only where such a draft, accepted
  whole, would pay at all (k + 1 > c(k + 1)). A proposer whose own
  time is a sizeable part of a decode (a draft model) has it added to the cost and is not
  called at all when no draft would pay.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np

from ngramspec.acceptance import AcceptanceEstimator, expected_accepted, lean_on_previous
from ngramspec.cost import CostModel
from ngramspec.loop import FixedPolicy

__all__ = ["AutoPolicy", "FixedPolicy", "POLICIES", "make_policy"]

#: Policy names of ``--spec-policy``.
POLICIES = ("auto", "fixed")


class _SlotState:
    __slots__ = ("estimators", "since_verified", "probe_interval", "pending", "probing",
                 "n_drafted", "n_past", "draft_s_per_token", "draft_ns0", "extend_to")

    def __init__(self, probe_min: int):
        self.estimators: Dict[int, AcceptanceEstimator] = {}
        # steps since the last verified draft; a new slot probes its first draft (a request
        # may be too short to wait for the first probe)
        self.since_verified = probe_min
        self.probe_interval = probe_min
        self.pending = -1             # proposer index of the draft being verified
        self.probing = False
        self.n_drafted = 0            # length of the draft being verified, before any cut
        self.n_past = 0
        self.draft_s_per_token = 0.0  # moving average of the proposer's seconds per token
        self.draft_ns0 = -1           # the loop's draft timer before this step's call
        self.extend_to = 0            # verify the next draft to at least this length (extension)


class AutoPolicy:
    """Cost-aware draft length: verify the k maximizing E[accepted + 1 | k] / c(k + 1, L).

    Parameters
    ----------
    cost_model : CostModel
        The target's verify-cost curve (calibrated, cached, or a named profile).
    probe_len : int
        Draft tokens a probe verifies.
    probe_min, probe_max : int
        Plain steps before the first probe, and the longest wait between probes (the wait
        doubles after each probe that is rejected).
    extend : bool
        Extension (module docstring): after a cut draft is accepted whole, verify the next
        one to twice the length. Drafts scored by their proposer (ngram-suffix) are not
        extended: each says itself what it is worth.
    prior, prior_weight, decay : float
        Of the acceptance estimators (`AcceptanceEstimator`).
    use_proposer_probs : bool
        Take ngram-suffix's own per-token probabilities for its drafts.
    proposer_time : bool
        Count the proposer's own time (meaningful only when the cost model was measured on the
        machine that runs the proposer; ``replay`` against a profile turns it off).

    Attributes
    ----------
    n_steps, n_drafts_seen, n_verified, n_truncated, n_plain, n_probes, n_skipped_calls : int
        Steps seen, steps with a draft, steps that verified a draft, drafts shortened, drafts
        dropped (a plain step), probes, draft calls skipped.
    n_extended : int
        Drafts verified longer than the estimates alone chose (extension).

    Raises
    ------
    TypeError
        `cost_model` is not a `CostModel`.
    ValueError
        `probe_len`, `probe_min` < 1, `probe_max` < `probe_min`, or an estimator parameter
        out of range.

    Notes
    -----
    Memory: per slot and proposer one estimator (4 KiB).

    Thread-safety: one policy may serve all slots of a driver; each slot's state is touched
    only by the thread driving that slot (the loop's rule). The counters are plain integers
    updated without a lock: exact with one driving thread, approximate with several.
    """

    def __init__(self, cost_model: CostModel, *, probe_len: int = 2, probe_min: int = 8,
                 probe_max: int = 128, prior: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.95, use_proposer_probs: bool = True,
                 proposer_time: bool = True, extend: bool = True):
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        for name, value, lo in (("probe_len", probe_len, 1), ("probe_min", probe_min, 1),
                                ("probe_max", probe_max, probe_min)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        AcceptanceEstimator(1, prior=prior, prior_weight=prior_weight, decay=decay)  # checks
        self.cost_model = cost_model
        self.probe_len = probe_len
        self.probe_min = probe_min
        self.probe_max = probe_max
        self._est_args = dict(prior=prior, prior_weight=prior_weight, decay=decay)
        self.use_proposer_probs = use_proposer_probs
        self.proposer_time = proposer_time
        self.extend = bool(extend)
        self._slots: Dict[int, _SlotState] = {}
        self._costs: Dict[int, np.ndarray] = {}
        self.n_steps = self.n_drafts_seen = self.n_verified = self.n_truncated = 0
        self.n_plain = self.n_probes = self.n_skipped_calls = self.n_extended = 0

    # -- helpers ---------------------------------------------------------------------------

    def _state(self, slot: int) -> _SlotState:
        st = self._slots.get(slot)
        if st is None:
            st = self._slots.setdefault(slot, _SlotState(self.probe_min))
        return st

    def _estimator(self, st: _SlotState, proposer: int) -> AcceptanceEstimator:
        est = st.estimators.get(proposer)
        if est is None:
            est = st.estimators[proposer] = AcceptanceEstimator(**self._est_args)
        return est

    def costs(self, n: int, n_past: int) -> np.ndarray:
        """c(1 .. n, n_past), memoized per 64 tokens of KV length (c varies slowly with it).

        Parameters
        ----------
        n : int
            Batch sizes 1 .. n (at least 65 are computed).
        n_past : int
            KV cache length.

        Returns
        -------
        numpy.ndarray
            float64, ``[c(1), c(2), ...]``, at least `n` entries.
        """
        bucket = n_past >> 6
        c = self._costs.get(bucket)
        if c is None or len(c) < n:
            c = self.cost_model.costs(max(n, 65), bucket << 6)
            if len(self._costs) > 4096:
                self._costs.clear()
            self._costs[bucket] = c
        return c[:n]

    @staticmethod
    def best_k(expected: np.ndarray, costs: np.ndarray) -> int:
        """The k maximizing (expected[k] + 1) / costs[k]; the smallest k on ties.

        Parameters
        ----------
        expected : numpy.ndarray
            ``expected[k]`` = E[accepted | k drafted tokens verified], k = 0 .. n.
        costs : numpy.ndarray
            ``costs[k]``: the cost of verifying k drafted tokens (c(k + 1) plus any proposer time).

        Returns
        -------
        int
        """
        return int(np.argmax((expected + 1.0) / costs))

    def _probabilities(self, loop, st: _SlotState, proposer: int, n: int):
        """(q_1 .. q_n, whether they are the proposer's own for this very draft)."""
        if self.use_proposer_probs and proposer >= 0:
            prop = _proposer(loop.engine, proposer)
            probs = getattr(prop, "draft_probs", None)
            if probs is not None:
                p, tried = probs(loop.slot)
                if len(p) >= n:
                    w = self._est_args["prior_weight"]
                    return lean_on_previous(p[:n], tried[:n], w), True
        return self._estimator(st, proposer).conditional(n), False

    def _probe_due(self, st: _SlotState) -> bool:
        return st.since_verified >= st.probe_interval

    # -- the loop's hooks ------------------------------------------------------------------

    def before_draft(self, loop) -> Optional[int]:
        """Skip the draft call (0) when the proposer is expensive and no draft would pay.

        Parameters
        ----------
        loop : SlotLoop

        Returns
        -------
        int or None
            0 to skip the call, None to keep the server's bound.
        """
        if not self.proposer_time or loop.engine is None:
            return None
        st = self._state(loop.slot)
        st.draft_ns0 = loop.timers.draft_ns
        per_token = st.draft_s_per_token
        if per_token <= 0.0:
            return None
        L = loop.n_context
        t1 = self.cost_model.seconds(1, L)
        if per_token < 0.01 * t1:       # n-gram proposers: microseconds against milliseconds
            return None
        bound = loop.n_draft_max if loop.n_draft_max is not None else 64
        n = max(1, min(bound, 256))
        q = self._estimator(st, max(st.pending, 0)).conditional(n)
        c = self.costs(n + 1, L) + np.arange(n + 1) * (per_token / t1)
        k = self.best_k(expected_accepted(q), c)
        if k == 0:
            if self._probe_due(st):
                return min(self.probe_len, n)
            self.n_skipped_calls += 1
            return 0
        return k

    def after_draft(self, loop, draft: np.ndarray) -> int:
        """How many of the draft's tokens to verify.

        Parameters
        ----------
        loop : SlotLoop
        draft : numpy.ndarray
            The draft the engine returned.

        Returns
        -------
        int
            0 .. len(draft): the best k under the cost model, or `probe_len` tokens when that
            is 0 and a probe is due; 0 makes the step a plain decode.
        """
        self.n_steps += 1
        n = len(draft)
        st = self._state(loop.slot)
        st.probing = False
        if n == 0:
            st.pending = -1
            return 0
        self.n_drafts_seen += 1
        engine = loop.engine
        last = getattr(engine, "last_proposer", None)
        proposer = last(loop.slot) if last is not None else 0
        st.pending = proposer
        if self.proposer_time and st.draft_ns0 >= 0:
            per_token = (loop.timers.draft_ns - st.draft_ns0) / 1e9 / n
            avg = st.draft_s_per_token
            st.draft_s_per_token = per_token if avg == 0.0 else 0.8 * avg + 0.2 * per_token
            st.draft_ns0 = -1
        q, own = self._probabilities(loop, st, proposer, n)
        k = self.best_k(expected_accepted(q), self.costs(n + 1, loop.n_context))
        st.n_drafted = n
        st.n_past = loop.n_context
        # A proposer that scores each draft itself needs no probe: its next draft says anew
        # what it is worth. The position estimates only learn from what is verified.
        if own:
            st.extend_to = 0
        elif st.extend_to > k:
            # extension: the last verified draft was cut and accepted whole; worth trying
            # where the longer draft, accepted whole, would pay (never when c(k) = k)
            m = min(st.extend_to, n)
            if m > k and m + 1 > self.costs(m + 1, loop.n_context)[m]:
                k = m
                self.n_extended += 1
        if k == 0 and not own and self._probe_due(st):
            k = min(self.probe_len, n)
            st.probing = True
            self.n_probes += 1
        if k == 0:
            self.n_plain += 1
        elif k < n:
            self.n_truncated += 1
        return k

    def observe(self, loop, n_draft: int, n_accepted: int) -> None:
        """Learn from the verified step.

        Parameters
        ----------
        loop : SlotLoop
        n_draft : int
            Draft tokens verified (0: a plain step).
        n_accepted : int
            Of them, accepted.
        """
        st = self._state(loop.slot)
        if n_draft == 0:
            st.since_verified += 1
            return
        self.n_verified += 1
        est = self._estimator(st, max(st.pending, 0))
        est.observe(n_draft, n_accepted)
        st.since_verified = 0
        # Extension: a draft cut short (n_draft < drafted) and accepted whole says nothing of
        # the positions after it; where they are hardly known (less than one observation
        # reached the next one), verify the next draft twice as far. A rejection ends it.
        whole = n_accepted == n_draft
        st.extend_to = (2 * n_draft if self.extend and whole and n_draft < st.n_drafted
                        and est.tried[min(n_draft, est.n_max - 1)] < 1.0 else 0)
        if st.probing:
            # Probe again soon after a probe that was accepted whole (one is not enough to
            # make a costly draft pay) or that makes drafting pay already; later otherwise.
            n = max(st.n_drafted, 1)
            pays = self.best_k(est.expected(n), self.costs(n + 1, st.n_past)) > 0
            st.probe_interval = (self.probe_min if pays or n_accepted == n_draft
                                 else min(2 * st.probe_interval, self.probe_max))
        else:
            st.probe_interval = self.probe_min

    def summary(self) -> dict:
        """The counters (see Attributes) and the cost model's name, as a dict."""
        return {"policy": "auto", "cost_model": self.cost_model.name, "steps": self.n_steps,
                "drafts": self.n_drafts_seen, "verified": self.n_verified,
                "truncated": self.n_truncated, "plain": self.n_plain, "probes": self.n_probes,
                "extended": self.n_extended, "skipped_calls": self.n_skipped_calls}


def _proposer(engine, index: int):
    props = getattr(engine, "proposers", None)
    if props is None or not 0 <= index < len(props):
        return None
    return props[index]


def make_policy(name: str, cost_model: Optional[CostModel] = None, **kwargs):
    """The policy `name` of ``--spec-policy``.

    Parameters
    ----------
    name : {"fixed", "auto"}
    cost_model : CostModel, optional
        Required by ``auto``.
    **kwargs
        `AutoPolicy`'s keywords.

    Returns
    -------
    FixedPolicy or AutoPolicy

    Raises
    ------
    ValueError
        An unknown name, or ``auto`` without a cost model.
    """
    if name == "fixed":
        return FixedPolicy()
    if name == "auto":
        if cost_model is None:
            raise ValueError("--spec-policy auto needs a cost model")
        return AutoPolicy(cost_model, **kwargs)
    raise ValueError(f"--spec-policy {name!r}: allowed {', '.join(POLICIES)}")
