"""An engine's requests on the slots of one `SpecEngine`, each request a `SlotLoop`.

vLLM and SGLang call a proposer once per batch step with each request's tokens so far (prompt +
output, ending with the last verified token). A request's loop learns what the target accepted
from how its tokens grew: the new tokens are the accepted draft prefix plus the target's own
token, which is exactly `SlotLoop.verify`'s target. Anything else (tokens that do not continue
the pending draft) is not the same request any more. A host that verifies a draft *tree* (SGLang)
may accept a branch beside the chain: the request's pending `Request.tree` says which paths
continue it, and the branch's tokens join the loop's context as steps without a draft.
"""
from __future__ import annotations

import heapq
import os
from typing import Dict, Hashable, Optional

import numpy as np

from ngramspec import store_log
from ngramspec.config import SpecConfig
from ngramspec.draft_engine import NO_DRAFT
from ngramspec.engine import SpecEngine
from ngramspec.loop import SlotLoop, common_prefix, draft_budget
from ngramspec.policy import FIXED, AutoPolicy, DraftPolicy
from ngramspec.prediction import PredictedEngine, PredictionDrafter

__all__ = ["MAX_DRAFT", "SPEC_ENV", "RequestLoops", "engine_from_env", "same_tokens",
           "tree_holds"]

#: The environment variable holding llama-server's spec flags for an embedded engine.
SPEC_ENV = "NGRAMSPEC_SPEC"

#: The longest draft a host may ask for (vLLM's ``num_speculative_tokens``, SGLang's
#: ``speculative_num_draft_tokens`` - 1): the engine keeps a draft buffer per slot and SGLang's
#: trees are d x d masks per request, so the bound keeps a typo from allocating gigabytes.
MAX_DRAFT = 1024

#: Known tokens `Request.holds` compares at each end of a request's tokens.
EDGE = 32

#: Step records a request's loop keeps (`SlotLoop`'s ``keep_steps``): a host's request may
#: generate for hours, and only the policy (the last step) and a test's look back read them.
KEEP_STEPS = 16


def engine_from_env(n_slots: int, flags: Optional[str] = None):
    """The engine and draft-length policy of ``$NGRAMSPEC_SPEC`` (or of `flags`).

    Parameters
    ----------
    n_slots : int
        Requests drafted for at once (the engine's slots).
    flags : str, optional
        llama-server flags; default: ``$NGRAMSPEC_SPEC``, empty meaning ``serve``'s defaults.

    Returns
    -------
    (SpecEngine, policy)

    Raises
    ------
    ValueError
        A bad flag, with ``serve``'s message prefixed by ``NGRAMSPEC_SPEC``; a bad
        ``$NGRAMSPEC_STORE`` (`ngramspec.store_log`), named so.
    """
    if flags is None:
        flags = os.environ.get(SPEC_ENV, "")
    spec_type, params, make_policy = SpecConfig.from_flags(flags, prog=SPEC_ENV).engine_parts(
        SPEC_ENV)
    engine = SpecEngine(spec_type or "none", n_slots=n_slots, **params)
    store_log.attach_from_env(engine)        # $NGRAMSPEC_STORE: the replicas share the store
    return engine, make_policy()


class Request:
    """One request of the host engine: its key, loop and arrival number.

    Attributes
    ----------
    key : hashable
    loop : SlotLoop
    seq : int
        Arrival order (requests are drafted for in this order, whatever rows they sit in).
    n : int
        Tokens known: the loop's context plus the token it verifies next.
    n_max, n_min : int
        The request's own ``speculative.n_max`` (None: none; every step's budget is
        `draft_budget` of it and the host's) and ``speculative.n_min``.
    policy : DraftPolicy
        The draft-length policy its steps go through (the host's, or `FIXED`).
    propose, verify : callable
        The policy's ``draft`` and ``verify`` bound to the loop (`DraftPolicy.bind`: a
        `FixedPolicy`'s are the loop's own).
    plain : bool
        Whether it drafts with the host's engine and ``n_max`` (no prediction, proposer
        subset or bound of its own): what a host's extras beyond the chain (SGLang's trees)
        may build on.
    tree : (tokens, parents) or None
        The draft tree the host verifies next, when it is more than the pending chain (the
        chain is its first path; ``parents[i]`` < i, -1 for the root). Set by the host's
        adapter after `RequestLoops.advance`, consumed by the next one.

    Notes
    -----
    Memory: the loop's (4 bytes per token of context).

    Thread-safety: not thread-safe; owned by one `RequestLoops`.
    """

    __slots__ = ("key", "loop", "seq", "n", "last_step", "pending", "tree", "n_max", "n_min",
                 "plain", "policy", "propose", "verify")

    def __init__(self, key, loop: SlotLoop, seq: int, step: int, n_max: Optional[int] = None,
                 n_min: int = 0, plain: bool = True, policy: DraftPolicy = FIXED):
        self.key = key
        self.loop = loop
        self.seq = seq
        self.n = loop.n_context + 1
        self.last_step = step
        self.pending = False      # a draft was proposed and not verified yet
        self.tree = None
        self.n_max = n_max        # the request's own draft cap (the host's is RequestLoops')
        self.n_min = n_min
        self.plain = plain        # drafts with the host's engine and n_max (no own subset, bound)
        self.policy = policy
        self.propose, self.verify = policy.bind(loop)

    def continues(self, new_tokens) -> bool:
        """Whether `new_tokens` (after the known ones) are the pending draft's accepted prefix
        (or a path of its `tree`) plus one token of the target's."""
        g = len(new_tokens)
        if g <= 1:
            return True             # nothing accepted: the target's token alone
        draft = self.loop.pending_draft
        if g - 1 <= len(draft) and same_tokens(new_tokens[:g - 1], draft[:g - 1]):
            return True
        return self.tree is not None and tree_holds(*self.tree, new_tokens[:g - 1])

    def holds(self, tokens, n: int, *, same_request: bool = False) -> bool:
        """Whether ``tokens[:n]`` extends this request's known tokens by a continuation.

        The known tokens are compared at their first and last `EDGE` positions, not all of
        them: O(1) per row and step, whatever the context (a host's row only ever grows, so a
        row that matches at both ends and continues the pending draft is the same request; a
        full compare was a third of vLLM's per-step cost at 32k tokens). `same_request`: the
        host says the row is this request (its id): only the continuation is checked."""
        m = self.n
        if n < m:
            return False
        loop = self.loop
        L = m - 1
        if int(tokens[L]) != loop.sampled:
            return False
        if not same_request:
            known = loop.context
            e = EDGE if L > 2 * EDGE else L
            if not (same_tokens(tokens[:e], known[:e])
                    and same_tokens(tokens[L - e:L], known[L - e:L])):
                return False
        return self.continues(tokens[m:n])


def same_tokens(a, b) -> bool:
    """Whether two short 1-D token arrays are equal (bytes when the dtypes agree: a tenth of
    ``np.array_equal``'s cost on a handful of tokens)."""
    if len(a) != len(b):
        return False
    if a.dtype == b.dtype and a.flags.c_contiguous and b.flags.c_contiguous:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def tree_holds(tokens, parents, path) -> bool:
    """Whether `path` goes down the tree from its root (``parents[i]`` < i, -1 the root)."""
    node = -1
    for x in path:
        for i in range(node + 1, len(tokens)):
            if parents[i] == node and tokens[i] == x:
                node = i
                break
        else:
            return False
    return True


class RequestLoops:
    """Requests keyed by the host's ids (or any hashable), each on its own engine slot.

    Parameters
    ----------
    engine : SpecEngine
    n_slots : int
        The engine's slots; when all are taken, a new request takes the slot of the one seen
        least recently (a host that never says a request ended cannot leak slots).
    n_ctx : int
        `SlotLoop`'s context bound: drafts are at most ``n_ctx - L - 2`` tokens.
    n_max : int, optional
        The host's number of speculative tokens, every step's `SlotLoop.propose` bound.
    policy : DraftPolicy, optional
        Draft-length policy shared by all requests (`ngramspec.policy`); None: llama.cpp's
        `FIXED`.

    Notes
    -----
    Memory: per live request its loop's context (4 bytes per token) and the engine's per-slot
    state; cross-request state (ngram-mod pool, ngram-suffix store, ngram-cache) is the engine's,
    kept for the process.

    Thread-safety: not thread-safe; the host calls it from its one scheduling thread.
    """

    def __init__(self, engine, n_slots: int, *, n_ctx: int = 0, n_max: Optional[int] = None,
                 policy=None):
        self.engine = engine
        self.n_ctx = n_ctx
        self.n_max = n_max
        self.policy = FIXED if policy is None else policy
        self.requests: Dict[Hashable, Request] = {}
        self.n_slots = n_slots
        self._free = list(range(n_slots))
        self._engines: Dict[tuple, SpecEngine] = {}
        self._seq = 0
        self.step = 0

    def get(self, key) -> Optional[Request]:
        """The live request `key`, or None."""
        return self.requests.get(key)

    def begin(self, key, prompt, first_token: int, control=None) -> Request:
        """Start request `key` (ending any earlier one of that key) on the lowest free slot.

        Parameters
        ----------
        key : hashable
        prompt : 1-D int array
            Its tokens before `first_token`.
        first_token : int
            The last token the target produced (the next one verified).
        control : RequestControl, optional
            The request's ``speculative`` fields and prediction
            (`ngramspec.integrations.request_args`): as ``serve`` runs such a request, the
            prediction drafts first, the request's subset of the chain where it has nothing;
            ``enabled: false`` drafts nothing.
        """
        self.end(key)
        if not self._free:
            oldest = min(self.requests.values(), key=lambda r: (r.last_step, r.seq))
            self.end(oldest.key)
        slot = heapq.heappop(self._free)
        engine, n_max, n_min, policy = self.engine, None, 0, self.policy
        if control is not None:
            engine, n_max, n_min, policy = self._controlled(control)
        loop = SlotLoop(engine, slot, prompt, int(first_token), n_ctx=self.n_ctx,
                        capacity=len(prompt) + 256, keep_steps=KEEP_STEPS)
        # plain: its own n_max, if any, bounds nothing below the host's
        own_bound = n_max is not None and (self.n_max is None or n_max < self.n_max)
        req = Request(key, loop, self._seq, self.step, n_max, n_min,
                      plain=engine is self.engine and not own_bound,
                      policy=policy)
        self._seq += 1
        self.requests[key] = req
        return req

    def _controlled(self, control):
        """``(engine, n_max, n_min, policy)`` of a request with its own fields, as the scheduler
        builds them (`ngramspec.llama.scheduler`): the chain's subset of its types (the same
        proposer objects, so slots and shared stores stay one), the prediction in front; its
        own ``n_max`` (None: none; `advance`'s `draft_budget` joins it with the host's);
        ``policy: fixed`` is llama.cpp's (`FIXED`), ``auto`` the host's (`request_args.control_of`
        refuses it where the host's is not auto)."""
        spec = control.spec
        n_max, n_min, engine, policy = None, 0, self.engine, self.policy
        if spec is not None:
            if not spec.enabled:
                return NO_DRAFT, None, 0, FIXED
            engine = self.engine.subset(spec.types, self._engines)
            n_max = spec.n_max
            n_min = spec.n_min or 0
            if spec.policy == "fixed":
                policy = FIXED
        if control.prediction is not None:
            engine = PredictedEngine(PredictionDrafter(control.prediction), engine)
        return engine, n_max, n_min, policy

    @property
    def auto(self) -> bool:
        """Whether the host's draft-length policy is ``auto`` (requests may ask for it)."""
        return isinstance(self.policy, AutoPolicy)

    def advance(self, req: Request, new_tokens) -> np.ndarray:
        """Verify the pending draft against `new_tokens` (when any), then draft; returns the draft.

        Parameters
        ----------
        req : Request
        new_tokens : 1-D int array (or a list of one int)
            The tokens after the known ones: the accepted draft prefix and the target's token
            (`Request.continues` must hold).
        """
        g = len(new_tokens)
        req.last_step = self.step
        if req.pending and not g:       # asked again before the target verified
            return req.loop.pending_draft
        if g == 1:
            # the target's token alone (the common step): nothing accepted, no slicing
            req.verify(new_tokens, n_verified=0)
            req.n += 1
            req.tree = None
        elif g:
            # n_verified: the host may have verified only part of the draft (a token budget);
            # the token after the accepted prefix is the target's, even if it equals the draft's
            k = g - 1
            if req.tree is not None:
                k = common_prefix(req.loop.pending_draft[:k], new_tokens)
            req.verify(new_tokens[:k + 1], n_verified=k)
            # a tree branch beside the chain: its tokens join the context without a draft
            for i in range(k + 1, g):
                req.propose(0)
                req.verify(new_tokens[i:i + 1])
            req.n += g
            req.tree = None
        req.pending = True
        # the step's one budget: the host's n_max, the request's, the loop's room
        return req.propose(draft_budget(req.loop, self.n_max, req.n_max), req.n_min)

    def end(self, key) -> None:
        """Forget request `key` (no-op if unknown); its slot is free again, and what the engine
        learns from finished requests (ngram-suffix's store) it learns from this one now."""
        req = self.requests.pop(key, None)
        if req is not None:
            self.engine.end(req.loop.slot)
            heapq.heappush(self._free, req.loop.slot)

    def clear(self) -> None:
        """End every request."""
        for key in list(self.requests):
            self.end(key)
