"""Draft-length policies for the verification loop (`ngramspec.loop.SlotLoop`).

A policy has three moments in a step: a bound before the draft call, the verified length after
it, and what it learns after the verification. The drivers (the scheduler's planner and
executor, the live driver, `ngramspec.loop.run_recorded`, the engines' request table) call them
through `DraftPolicy.draft` and `DraftPolicy.verify`, which wrap the loop's own calls: data
flows driver -> policy -> loop -> engine, and the loop knows no policy.

- ``fixed`` (`FixedPolicy`): llama.cpp's behaviour, the whole draft is verified. The default of
  ``replay``, `SpecEngine` users and the golden files.
- ``auto`` (`AutoPolicy`): cost-aware. At each step it verifies the k of the draft's n tokens
  (0 <= k <= n) that maximizes the expected tokens per unit of time,

      E[accepted + 1 | k] / c(k + 1, L),

  where c is the verify-cost curve (`ngramspec.cost.CostModel`: a batch of k + 1 tokens over
  a KV cache of L tokens, in single-token decodes) and E comes from a per-slot, per-proposer,
  per-position acceptance estimate (`ngramspec.acceptance.AcceptanceEstimator`). k = 0 is a
  plain decode step.

  The estimates learn from every draft, verified or not (`ngramspec.acceptance.DraftOutcomes`):
  under greedy verification the output says afterwards how much of any draft the target would
  have accepted, so a draft cut short still teaches the positions after the cut, and a slot
  decoding plainly still sees whether its drafts have turned good, without spending a verified
  probe on it. Positions beyond the observed ones are not assumed as good as the last observed
  one: each further position is discounted (``depth``), so a draft is verified only a little
  beyond what the evidence supports (on a CPU, where c(k) grows almost like k, a long draft
  rejected early costs many decodes).

  ngram-suffix scores its own drafts; with ``use_proposer_probs`` those probabilities are used
  instead of the learned estimates. They are off by default: on the embedded model's own output
  (bench/results/e2e-notes.md) the learned estimates gave ngram-suffix 1.150x modeled against
  1.097x with its replay-tuned tables.

  A proposer whose own time is a sizeable part of a decode (a draft model) has it added to the
  cost and is not called at all when no draft would pay, except for a probe now and then (after
  8 skipped calls, then 16, 32, ... up to 128 while its drafts keep not paying): a draft that is
  never made teaches nothing.

  A driver that decodes several slots' drafts in one batch (the scheduler) makes the policy
  ``joint``: every slot drafts and the estimates learn as above, then
  :meth:`AutoPolicy.choose` cuts all the step's drafts together. One step decodes every
  slot's ``[sampled] + draft`` (and prompt chunks) in one decode, whose cost depends on the total
  token count N, not on how it is split among slots, and yields per slot 1 + the accepted draft
  tokens, so the lengths k_s maximize

      (sum_s 1 + E[accepted_s | k_s]) / c(N0 + sum_s k_s, L),

  N0 the step's tokens that do not depend on the choice. The marginal gain of a slot's j-th draft
  token, q_1...q_j, never grows with j, so for each total M the best split takes the M largest
  gains over all slots (an exchange argument); the choice is the M with the best ratio
  (:meth:`AutoPolicy.best_split`).
"""
from __future__ import annotations

import operator
from functools import partial
from typing import Dict, List, Optional, Sequence

import numpy as np

from ngramspec.acceptance import (AcceptanceEstimator, DraftOutcomes, expected_accepted,
                                  lean_on_previous)
from ngramspec.cost import CostModel
from ngramspec.draft_engine import ReportsDraftProbs
from ngramspec.validation import Refused, check_choice, check_int

__all__ = ["AutoPolicy", "DraftPolicy", "FIXED", "FixedPolicy", "POLICIES", "make_policy"]

#: Policy names: ``--spec-policy``, a request's ``speculation.policy``, ``SpecConfig(policy=)``.
POLICIES = ("auto", "fixed")


class DraftPolicy:
    """A draft-length policy's moments in a step, and the one sequence every driver calls them
    in around its `ngramspec.loop.SlotLoop`: ``draft`` (instead of ``loop.propose``), then
    ``verify`` (instead of ``loop.verify``).

    The moments, each a no-op here (llama.cpp's behaviour) for a subclass to override:

    1. ``before_draft(loop, bound)``: before the draft call, a bound lower than the step's
       (None keeps it; 0 makes the step a plain decode with no draft call);
    2. ``after_draft(loop, draft)``: how many of the draft's tokens to verify;
    3. ``observe(loop, n_draft, n_accepted)``: learn from the verified step.

    ``choose(loops, budgets)`` is the one decision of the verified lengths, for one loop (from
    ``after_draft``) or a batched step's loops jointly (the scheduler's planner calls it after
    every slot drafted).

    Notes
    -----
    Memory: none. Thread-safety: stateless, so shareable by any number of loops and threads.
    """

    def draft(self, loop, budget: Optional[int] = None, n_min: int = 0) -> np.ndarray:
        """A step's draft: the loop drafts within `budget` (`SlotLoop.bound`: checked against
        its room, None for the room) lowered by ``before_draft``, drops a draft shorter than
        `n_min`, and keeps the ``after_draft`` part of it pending (`SlotLoop.cut`).

        Returns
        -------
        numpy.ndarray
            The int32 draft to verify (maybe empty).

        Raises
        ------
        OutOfRange
            `budget` beyond the loop's room (the driver skipped `ngramspec.loop.draft_budget`).
        ValueError
            ``after_draft`` chose a length beyond the draft's.
        """
        bound = loop.bound(budget)        # the driver's budget checked before a moment sees it
        if bound is None or bound > 0:      # no draft call, no moment: as llama-server
            lower = self.before_draft(loop, bound)
            if lower is not None:
                lower = operator.index(lower)
                budget = lower if bound is None else min(bound, lower)
        draft = loop.propose(budget, n_min)
        k = self.after_draft(loop, draft)
        return draft if k == len(draft) else loop.cut(k)

    def verify(self, loop, target, *, n_verified: Optional[int] = None) -> int:
        """`SlotLoop.verify` of the pending draft, then ``observe``; returns the accepted
        length. `target` and `n_verified` as `SlotLoop.verify` takes them."""
        n_accepted = loop.verify(target, n_verified=n_verified)
        self.observe(loop, loop.steps[-1][0], n_accepted)     # the step's [n_draft, ...]
        return n_accepted

    def bind(self, loop):
        """``(propose, verify)``: `draft` and `verify` bound to `loop`, for a driver that calls
        them every step (`ngramspec.loop.run_recorded`, the engines' request table)."""
        return partial(self.draft, loop), partial(self.verify, loop)

    def before_draft(self, loop, bound: Optional[int]) -> Optional[int]:
        """No bound beyond the step's `bound`: None."""
        return None

    def after_draft(self, loop, draft: np.ndarray) -> int:
        """The whole draft is verified: ``len(draft)``."""
        return len(draft)

    def observe(self, loop, n_draft: int, n_accepted: int) -> None:
        """Nothing to learn."""

    def choose(self, loops, budgets, n_base=None, e_base=None) -> list:
        """Every draft is verified whole: the budgets."""
        return list(budgets)


class FixedPolicy(DraftPolicy):
    """llama.cpp's draft length: no bound beyond the driver's, the whole draft is verified.

    Its moments change nothing, so its ``draft`` and ``verify`` are the loop's own calls (three
    Python calls a step fewer: the replay loop's and the engines' hot path).

    Notes
    -----
    Memory: none. Thread-safety: stateless, so shareable by any number of loops and threads.
    """

    def draft(self, loop, budget: Optional[int] = None, n_min: int = 0) -> np.ndarray:
        """`SlotLoop.propose`: the whole draft within `budget`."""
        return loop.propose(budget, n_min)

    def verify(self, loop, target, *, n_verified: Optional[int] = None) -> int:
        """`SlotLoop.verify`."""
        return loop.verify(target, n_verified=n_verified)

    def bind(self, loop):
        """The loop's own `SlotLoop.propose` and `SlotLoop.verify` (a Python call a step fewer
        each than the bound `draft` and `verify`, which only forward to them)."""
        return loop.propose, loop.verify


#: llama.cpp's policy, the drivers' default (stateless: one instance serves all).
FIXED = FixedPolicy()


class _SlotState:
    __slots__ = ("estimators", "outcomes", "loop", "since_draft", "probe_interval", "pending",
                 "draft_s_per_token", "draft_ns0")

    def __init__(self, probe_min: int):
        self.estimators: Dict[int, AcceptanceEstimator] = {}
        self.outcomes = DraftOutcomes()
        self.loop = None              # the request (SlotLoop) the pending outcomes belong to
        self.since_draft = 0          # draft calls skipped in a row (expensive proposers)
        self.probe_interval = probe_min
        self.pending = -1             # proposer index of the last draft
        self.draft_s_per_token = 0.0  # moving average of the proposer's seconds per token
        self.draft_ns0 = -1           # the loop's draft timer before this step's call


class AutoPolicy(DraftPolicy):
    """Cost-aware draft length: verify the k maximizing E[accepted + 1 | k] / c(k + 1, L).

    Parameters
    ----------
    cost_model : CostModel
        The target's verify-cost curve (calibrated, cached, or a named profile).
    probe_len : int
        Draft tokens asked of an expensive proposer for a probe.
    probe_min, probe_max : int
        Skipped draft calls of an expensive proposer before the first probe, and the longest
        wait between probes (the wait doubles after each probe whose draft would not pay).
    prior, prior_weight, decay, depth : float
        Of the acceptance estimators (`AcceptanceEstimator`).
    use_proposer_probs : bool
        Take ngram-suffix's own per-token probabilities for its drafts instead of the learned
        estimates (module docstring).
    proposer_time : bool
        Count the proposer's own time (meaningful only when the cost model was measured on the
        machine that runs the proposer; ``replay`` against a profile turns it off).
    joint : bool
        The driver decodes several slots in one batch and cuts their drafts together with
        `choose` after every slot drafted; ``after_draft`` then keeps the whole draft.

    Attributes
    ----------
    n_steps, n_drafts_seen, n_verified, n_truncated, n_plain, n_probes, n_skipped_calls : int
        Steps seen, steps with a draft, steps that verified a draft, drafts shortened, drafts
        dropped (a plain step), probes (draft calls made only to learn), draft calls skipped.

    Raises
    ------
    TypeError
        `cost_model` is not a `CostModel`.
    ValueError
        `probe_len`, `probe_min` < 1, `probe_max` < `probe_min`, or an estimator parameter
        out of range.

    Notes
    -----
    Memory: per slot and proposer one estimator (4 KiB); per slot the drafts whose outcome is
    still open (at most 64).

    Thread-safety: one policy may serve all slots of a driver; each slot's state is touched
    only by the thread driving that slot (the loop's rule). The counters are plain integers
    updated without a lock: exact with one driving thread, approximate with several.
    """

    def __init__(self, cost_model: CostModel, *, probe_len: int = 2, probe_min: int = 8,
                 probe_max: int = 128, prior: float = 0.5, prior_weight: float = 2.0,
                 decay: float = 0.95, depth: float = 0.95, use_proposer_probs: bool = False,
                 proposer_time: bool = True, joint: bool = False):
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        probe_len = check_int("probe_len", probe_len, 1)
        probe_min = check_int("probe_min", probe_min, 1)
        probe_max = check_int("probe_max", probe_max, probe_min)
        self._est_args = dict(prior=prior, prior_weight=prior_weight, decay=decay, depth=depth)
        AcceptanceEstimator(1, **self._est_args)  # checks
        self.cost_model = cost_model
        self.probe_len = probe_len
        self.probe_min = probe_min
        self.probe_max = probe_max
        self.use_proposer_probs = use_proposer_probs
        self.proposer_time = proposer_time
        self.joint = bool(joint)
        self._slots: Dict[int, _SlotState] = {}
        self._costs: Dict[int, np.ndarray] = {}
        self.n_steps = self.n_drafts_seen = self.n_verified = self.n_truncated = 0
        self.n_plain = self.n_probes = self.n_skipped_calls = 0

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

    @staticmethod
    def best_split(gains: Sequence[np.ndarray], n_base: int, e_base: float,
                   costs: np.ndarray) -> List[int]:
        """The k_s maximizing ``(e_base + sum_s gains[s][:k_s].sum()) / costs[N - 1]``, where
        N = n_base + sum k_s.

        Parameters
        ----------
        gains : sequence of numpy.ndarray
            Per slot, the expected gain of its 1st, 2nd, ... draft token (non-increasing).
        n_base : int
            The step's tokens that do not depend on the choice, >= 1.
        e_base : float
            The step's expected output tokens that do not depend on the choice.
        costs : numpy.ndarray
            ``costs[n - 1]``: the cost of a decode of n tokens, for n up to ``n_base`` plus
            every gain.

        Returns
        -------
        list of int
            One length per slot; fewer tokens on ties.
        """
        if not gains or all(len(g) == 0 for g in gains):
            return [0] * len(gains)
        owner = np.concatenate([np.full(len(g), s) for s, g in enumerate(gains)])
        allg = np.concatenate(gains)
        pos = np.concatenate([np.arange(len(g)) for g in gains])
        order = np.lexsort((pos, -allg))       # largest gains first, earlier positions on ties
        cum = np.concatenate([[0.0], np.cumsum(allg[order])])
        ratio = (e_base + cum) / costs[n_base - 1:n_base + len(allg)]
        best = int(np.argmax(ratio))
        return np.bincount(owner[order[:best]], minlength=len(gains)).tolist()

    def _probabilities(self, loop, st: _SlotState, proposer: int, n: int) -> np.ndarray:
        """q_1 .. q_n of the draft just made by `proposer`."""
        if self.use_proposer_probs and proposer >= 0:
            prop = loop.engine.proposers[proposer]
            if isinstance(prop, ReportsDraftProbs):
                p, tried = prop.draft_probs(loop.slot)
                if len(p) >= n:
                    return lean_on_previous(p[:n], tried[:n], self._est_args["prior_weight"])
        return self._estimator(st, max(proposer, 0)).conditional(n)

    # -- the step's moments (DraftPolicy) --------------------------------------------------

    def before_draft(self, loop, bound: Optional[int]) -> Optional[int]:
        """Skip the draft call (0) when the proposer is expensive and no draft would pay.

        Parameters
        ----------
        loop : SlotLoop
        bound : int or None
            The step's bound (the driver's budget; None: unbounded).

        Returns
        -------
        int or None
            0 to skip the call, a bound to ask for a shorter draft, None to keep the
            server's bound.
        """
        if not self.proposer_time or not loop.engine.speculates:
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
        n = max(1, min(bound if bound is not None else 64, 256))
        q = self._estimator(st, max(st.pending, 0)).conditional(n)
        c = self.costs(n + 1, L) + np.arange(n + 1) * (per_token / t1)
        k = self.best_k(expected_accepted(q), c)
        if k > 0:
            st.since_draft = 0
            st.probe_interval = self.probe_min
            return k
        if st.since_draft >= st.probe_interval:
            # a probe: the draft is made (and learned from), the next probe waits longer
            st.since_draft = 0
            st.probe_interval = min(2 * st.probe_interval, self.probe_max)
            self.n_probes += 1
            return min(self.probe_len, n)
        st.since_draft += 1
        self.n_skipped_calls += 1
        return 0

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
            0 .. len(draft): the best k under the cost model; 0 makes the step a plain decode.
        """
        self.n_steps += 1
        n = len(draft)
        st = self._state(loop.slot)
        if st.loop is not loop:           # a new request on this slot
            st.outcomes.clear()
            st.loop = loop
        if n == 0:
            st.pending = -1
            return 0
        self.n_drafts_seen += 1
        # -1: a draft of no chain proposer (a prediction's): the shared estimator, no probs
        proposer = loop.engine.last_proposer(loop.slot)
        st.pending = proposer
        if self.proposer_time and st.draft_ns0 >= 0:
            per_token = (loop.timers.draft_ns - st.draft_ns0) / 1e9 / n
            avg = st.draft_s_per_token
            st.draft_s_per_token = per_token if avg == 0.0 else 0.8 * avg + 0.2 * per_token
            st.draft_ns0 = -1
        # the draft's first token predicts the one after [context, sampled]
        st.outcomes.add(loop.n_context + 1, draft, self._estimator(st, max(proposer, 0)))
        if self.joint:
            return n                      # choose cuts it with the step's other drafts
        return self.choose([loop], [n])[0]

    def choose(self, loops: Sequence, budgets: Sequence[int], n_base: Optional[int] = None,
               e_base: Optional[float] = None) -> List[int]:
        """The one decision of a draft's verified length: for one request (a driver of one
        slot, through `after_draft`) or jointly for every "auto" slot of a batched step (the
        scheduler's planner).

        Parameters
        ----------
        loops : sequence of SlotLoop
            The slots whose fresh drafts are decoded in the step (this policy's ``after_draft``
            saw them).
        budgets : sequence of int
            Per loop, the draft tokens it may verify (its draft's length, >= 1).
        n_base : int, optional
            The step's tokens that do not depend on the choice (one sampled token per generating
            slot, other policies' drafts, prompt chunks), >= 1. Default: one per loop.
        e_base : float, optional
            The step's expected output tokens that do not depend on the choice (one per
            generating slot). Default: one per loop.

        Returns
        -------
        list of int
            One length per loop, 0 .. its budget (module docstring). For one loop it is
            `best_k`'s choice: `best_split` of one slot's non-increasing gains is the same.
        """
        if not loops:
            return []
        n_base = len(loops) if n_base is None else n_base
        e_base = float(len(loops)) if e_base is None else e_base
        gains = []
        for loop, n in zip(loops, budgets):
            st = self._state(loop.slot)
            gains.append(np.cumprod(self._probabilities(loop, st, st.pending, n)))
        # c varies slowly with the KV length: the step's slots are taken at their mean
        n_past = sum(loop.n_context for loop in loops) // len(loops)
        total = n_base + sum(len(g) for g in gains)
        ks = self.best_split(gains, n_base, e_base, self.costs(total, n_past))
        for g, k in zip(gains, ks):
            if k == 0:
                self.n_plain += 1
            elif k < len(g):
                self.n_truncated += 1
        return ks

    def observe(self, loop, n_draft: int, n_accepted: int) -> None:
        """Learn from the step: what the output now says of every open draft.

        Parameters
        ----------
        loop : SlotLoop
        n_draft : int
            Draft tokens verified (0: a plain step).
        n_accepted : int
            Of them, accepted.
        """
        st = self._state(loop.slot)
        if n_draft:
            self.n_verified += 1
        if st.loop is loop and st.outcomes.pending:
            st.outcomes.resolve(loop.context, -1 if loop.done else loop.sampled)

    def summary(self) -> dict:
        """The counters (see Attributes) and the cost model's name, as a dict."""
        return {"policy": "auto", "cost_model": self.cost_model.name, "steps": self.n_steps,
                "drafts": self.n_drafts_seen, "verified": self.n_verified,
                "truncated": self.n_truncated, "plain": self.n_plain, "probes": self.n_probes,
                "skipped_calls": self.n_skipped_calls}


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
    if check_choice("--spec-policy", name, POLICIES) == "fixed":
        return FixedPolicy()
    if cost_model is None:
        raise Refused("--spec-policy", "auto needs a cost model", sep=" ")
    return AutoPolicy(cost_model, **kwargs)
