"""The one draft -> verify -> accept loop: llama-server's slot loop, split around the target.

llama-server runs each generating slot through the same steps (``server_context::update_slots``
with ``common_speculative_draft`` / ``common_speculative_accept``): begin the proposers once on
the full prompt, emit the first token from the prompt pass, then per step

1. bound the draft by ``n_draft_max`` (``server_slot::get_n_draft_max``): ``n_ctx - L - 2``, and
   ``n_remaining - 1`` when ``n_predict`` is set; no draft call at all when it is <= 0;
2. draft from the tokens in the KV cache and the last sampled token;
3. let the target decode ``[sampled] + draft`` and verify it
   (``common_sampler_sample_and_accept_n``): the accepted draft prefix plus one token of the
   target's own;
4. report the accepted length to the proposers after every non-empty draft, also when it is 0.

`SlotLoop` holds one request's side of that: :meth:`SlotLoop.propose` is steps 1-2 and
:meth:`SlotLoop.verify` is step 4 given the target's tokens of step 3, so any target sits between
them: a recorded output (:func:`run_recorded`, the replay driver and the golden files), one
live llama context (``ngramspec.llama.live``), the llama-cpp-python plug-in, a batched
scheduler that decodes many slots' drafts at once.

The loop knows no draft-length policy: it drafts within the bound its driver gives it, keeps the
cut its driver makes (`SlotLoop.cut`) and verifies. A driver with a policy calls the policy's
``draft`` and ``verify`` (`ngramspec.policy.DraftPolicy`), which wrap these calls, so data flows
one way: driver -> policy -> loop -> engine.

This module imports neither llama_cpp nor the compiled kernels: an engine is a
`ngramspec.draft_engine.DraftEngine`, of which the loop calls only the required ``begin(slot,
prompt)``, ``draft(slot, context, sampled, n_max)`` and ``accept(slot, n)``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields

import numpy as np

from ngramspec.draft_engine import NoDraftEngine, as_engine
from ngramspec.stats import DraftCounts
from ngramspec.validation import OutOfRange, check_int

__all__ = ["SlotLoop", "Timers", "common_prefix", "draft_budget", "run_recorded"]

_EMPTY = np.empty(0, dtype=np.int32)
_EMPTY.setflags(write=False)
_INT32 = np.dtype(np.int32)
_clock = time.perf_counter_ns


def common_prefix(draft, target) -> int:
    """Length of the longest common prefix of two 1-D integer sequences.

    Parameters
    ----------
    draft : numpy.ndarray
    target : numpy.ndarray or sequence of int

    Returns
    -------
    int
    """
    k = min(len(draft), len(target))
    if k == 0:
        return 0
    diff = np.flatnonzero(draft[:k] != target[:k])
    return int(diff[0]) if len(diff) else k


@dataclass
class Timers:
    """Nanoseconds spent in, and number of, the engine's begin/draft/accept calls.

    Notes
    -----
    Memory: six integers.

    Thread-safety: not thread-safe; each loop owns its own, a driver sums them with :meth:`add`.
    """
    begin_ns: int = 0
    draft_ns: int = 0
    accept_ns: int = 0
    n_begin: int = 0
    n_draft: int = 0
    n_accept: int = 0

    def add(self, other: "Timers") -> None:
        """Add `other`'s times and counts into this one."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def per_call_us(self) -> dict:
        """Mean microseconds per draft, accept and begin call (0.0 where there was none)."""
        def us(ns, n):
            return round(ns / n / 1000, 4) if n else 0.0
        return {"us_per_gen_call": us(self.draft_ns, self.n_draft),
                "us_per_acc_call": us(self.accept_ns, self.n_accept),
                "us_per_begin_call": us(self.begin_ns, self.n_begin)}


class SlotLoop:
    """One request on one engine slot: begin, then ``propose() -> verify(target)`` per step.

    Construction calls ``engine.begin(slot, prompt)`` (timed): the context (the tokens in the
    target's KV cache) is the prompt, `first_token` (the prompt pass's output) is the first
    output token and the next to be verified.

    Parameters
    ----------
    engine : DraftEngine or None
        A `ngramspec.draft_engine.DraftEngine` (the loop calls ``begin``, ``draft``, ``accept``);
        a `NoDraftEngine` (None stands for `NO_DRAFT`) runs the loop without drafts (plain
        decoding, no draft call).
    slot : int
        The engine slot (llama-server's ``seq_id``).
    prompt : 1-D int array-like
        The full prompt; the engine validates it.
    first_token : int or None
        The token sampled from the prompt pass; ``None`` for a request without output (the loop
        is done at once).
    n_ctx : int
        The target's context size; > 0 bounds every draft by ``n_ctx - L - 2`` (L = context
        length), 0 leaves drafts unbounded by context.
    n_predict : int
        Output token limit, < 0 (-1) for none (`ngramspec.stop_rules`' sentinel); >= 0 bounds
        drafts by ``n_remaining - 1`` and ends the request once that many tokens are out.
    record_drafts : bool
        Keep every verified draft (``drafts``; the golden files' ``--drafts``).
    capacity : int
        Expected final context length: the context buffer is allocated once at that size (it
        grows by doubling past it). A constant buffer lets the engine validate each token once.
    keep_steps : int or None
        Step records kept in `steps`: None keeps every one (the golden files, replays); k > 0
        keeps (at least) the last k, so a long-lived request's records take O(k) memory, not
        O(steps) (a host engine's request: ~90 bytes a step, 0.7 GB at 256 x 32k-token
        generations). `n_steps` counts them all either way.

    Attributes
    ----------
    done : bool
        The request has ended: the target returned no token after the accepted draft, or
        ``n_predict`` tokens are out. `propose` and `verify` raise once it is set.
    sampled : int
        The last output token, the one the next step verifies (not yet in the context); once
        the target has ended the request it is stale (already in the context).
    n_output : int
        Output tokens so far, `sampled` included.
    n_draft_max : int or None
        The bound of the current step's draft call: `propose`'s ``n_max`` (None: unbounded).
    steps : list of [n_draft, n_accepted, draft_called]
        One entry per verified step, as the golden files list them (the last ones only, with
        ``keep_steps``).
    n_steps : int
        Verified steps so far.
    drafts : list of list of int
        The verified drafts (with ``record_drafts``).
    counts : DraftCounts
        Draft calls made, non-empty drafts, drafted tokens, drafts with an accepted token,
        accepted tokens (``n_draft_calls`` ... ``n_acc_tokens`` read them too).
    begin_ns, draft_ns, accept_ns : int
        Nanoseconds spent in the engine's begin, draft and accept calls (`timers` sums them
        up with the call counts).

    Notes
    -----
    Memory: the context buffer (4 bytes per token of ``capacity`` or the longest context), the
    step records (at most ``2 * keep_steps`` with it) and drafts with ``record_drafts``.

    Thread-safety: not thread-safe; one thread drives a loop. Loops on different slots of one
    engine may run in different threads (the engine allows one thread per slot).
    """

    __slots__ = ("engine", "slot", "n_ctx", "n_predict", "record_drafts", "done",
                 "sampled", "n_output", "n_prompt", "n_draft_max", "steps", "n_steps", "drafts",
                 "counts", "_speculates", "begin_ns", "draft_ns", "accept_ns", "_buf", "_len",
                 "_draft", "_called", "_bounded", "_room", "_keep", "_steps_cap")

    def __init__(self, engine, slot: int, prompt, first_token, *, n_ctx: int = 0,
                 n_predict: int = -1, record_drafts: bool = False, capacity: int = 0,
                 keep_steps: int | None = None):
        self.engine = engine = as_engine(engine)
        self._speculates = not isinstance(engine, NoDraftEngine)
        self.slot = slot
        self.n_ctx = int(n_ctx)
        self.n_predict = int(n_predict)
        self._bounded = self.n_ctx > 0 or self.n_predict >= 0
        self.record_drafts = record_drafts
        self.begin_ns = self.draft_ns = self.accept_ns = 0
        self.steps = []
        self.n_steps = 0
        # the records are trimmed to the last `_keep` once they reach twice that: O(1) a step
        self._keep = None if keep_steps is None else check_int("keep_steps", keep_steps, 1)
        self._steps_cap = sys.maxsize if keep_steps is None else 2 * self._keep
        self.drafts = []
        self.counts = DraftCounts()
        self.n_draft_max = None
        self._draft = None
        self._called = 0
        if self._speculates:
            t0 = _clock()
            engine.begin(slot, prompt)      # validates the prompt before it is copied below
            self.begin_ns = _clock() - t0
        n = len(prompt)
        self.n_prompt = n
        self._buf = np.empty(max(int(capacity), n + 64), dtype=np.int32)
        self._buf[:n] = prompt
        self._len = n
        if first_token is None:
            self.sampled = -1
            self.n_output = 0
            self.done = True
        else:
            self.sampled = int(first_token)
            self.n_output = 1
            self.done = 0 <= self.n_predict <= 1
        self._room = self._room_now()

    @property
    def timers(self) -> Timers:
        """The engine calls' times and counts so far (a new `Timers`)."""
        return Timers(self.begin_ns, self.draft_ns, self.accept_ns,
                      int(self._speculates), self.counts.n_draft_calls, self.counts.n_drafts)

    # the counts under their own names (`counts` holds them)
    n_draft_calls = property(lambda self: self.counts.n_draft_calls)
    n_drafts = property(lambda self: self.counts.n_drafts)
    n_draft_tokens = property(lambda self: self.counts.n_draft_tokens)
    n_acc_drafts = property(lambda self: self.counts.n_acc_drafts)
    n_acc_tokens = property(lambda self: self.counts.n_acc_tokens)

    @property
    def context(self) -> np.ndarray:
        """The tokens in the target's KV cache: prompt + verified output, without `sampled`.

        A read-only view of the loop's buffer, valid until the next `verify`.
        """
        view = self._buf[:self._len]
        view.flags.writeable = False
        return view

    @property
    def n_context(self) -> int:
        """Length of `context` (llama-server's L)."""
        return self._len

    @property
    def pending_draft(self) -> np.ndarray:
        """The draft `propose` returned that `verify` has not consumed yet (empty if none)."""
        return _EMPTY if self._draft is None else self._draft

    def room(self) -> int | None:
        """llama-server's bound of the next draft (step 1): ``n_ctx - L - 2`` with a context
        size, ``n_remaining - 1`` with an output limit, the smaller of both; None: unbounded."""
        return self._room

    def _room_now(self) -> int | None:
        # `room`, computed once per step (construction, `verify`): drivers, policies and the
        # loop's own check read it several times a step
        bound = None
        if self._bounded:
            if self.n_ctx > 0:
                bound = self.n_ctx - self._len - 2
            if self.n_predict >= 0:
                remaining = self.n_predict - self.n_output - 1
                bound = remaining if bound is None else min(bound, remaining)
        return bound

    def bound(self, n_max: int | None = None) -> int | None:
        """Step 1: the bound of the next draft, the driver's budget checked against `room`.

        Parameters
        ----------
        n_max : int, optional
            The step's draft budget, which the driver computed once (`draft_budget`: its batch
            share, the request's ``speculation.n_max``, a host engine's number of speculative
            tokens, and the loop's `room`). None: the `room` itself (a driver with no bound of
            its own).

        Returns
        -------
        int or None
            `n_max`, or the room where it is None; None: unbounded. <= 0: no draft call.

        Raises
        ------
        OutOfRange
            A budget beyond the loop's `room` (the driver skipped `draft_budget`).
        """
        if not self._bounded:
            return n_max
        room = self._room
        if n_max is None:
            return room
        if n_max > max(room, 0):
            raise OutOfRange("n_max", n_max, f"<= {max(room, 0)} (the loop's room: "
                             "ngramspec.loop.draft_budget)")
        return n_max

    def propose(self, n_max: int | None = None, n_min: int = 0) -> np.ndarray:
        """Steps 1-2: draft within the step's budget (timed).

        Parameters
        ----------
        n_max : int, optional
            The step's draft budget (`bound`: checked against `room`, None for the room
            itself). It is `n_draft_max`; <= 0 makes the step a plain decode without a draft
            call, as llama-server does.
        n_min : int
            A draft shorter than this is dropped (llama.cpp's ``n_min``).

        Returns
        -------
        numpy.ndarray
            The int32 draft (maybe empty), pending until `verify`; a driver may `cut` it first.

        Raises
        ------
        RuntimeError
            The request is done, or the previous draft was not verified yet.
        OutOfRange
            A budget beyond the loop's `room` (the driver skipped `draft_budget`).
        """
        if self.done:
            raise RuntimeError("propose() on a finished request")
        if self._draft is not None:
            raise RuntimeError("propose() twice without verify()")
        # `bound` inlined where it is cheap: the replay loop's steps are a few microseconds
        if self._bounded:
            bound = self._room if n_max is None else self.bound(n_max)
        else:
            bound = n_max
        self.n_draft_max = bound
        if not self._speculates or (bound is not None and bound <= 0):
            draft = _EMPTY                  # llama-server makes no draft call then
            self._called = 0
        else:
            context = self._buf[:self._len]     # the driver's view, made outside the timed call
            t0 = _clock()
            draft = self.engine.draft(self.slot, context, self.sampled, bound)
            self.draft_ns += _clock() - t0
            self.counts.n_draft_calls += 1
            self._called = 1
            if type(draft) is not np.ndarray or draft.dtype is not _INT32:
                draft = np.asarray(draft, dtype=np.int32)
            if len(draft) < n_min:
                draft = _EMPTY
        self._draft = draft
        return draft

    def cut(self, k: int) -> np.ndarray:
        """Keep the first `k` tokens of the pending draft (a policy's choice): `verify` then
        verifies and counts only those. Returns the draft to verify.

        Raises
        ------
        RuntimeError
            No `propose` since the last `verify`.
        ValueError
            `k` out of 0 .. the draft's length; the draft stays as it was.
        """
        draft = self._draft
        if draft is None:
            raise RuntimeError("cut() without propose()")
        if not 0 <= k <= len(draft):
            raise ValueError(f"cut({k}) is out of range: allowed 0 .. {len(draft)}")
        draft = self._draft = draft[:k]
        return draft

    def verify(self, target, *, n_verified: int | None = None) -> int:
        """Step 4: accept the draft's prefix that `target` confirms; returns its length.

        Parameters
        ----------
        target : 1-D int array-like
            The target's token after ``[sampled] + draft[:i]`` for i = 0, 1, ...: at most
            ``len(draft) + 1`` tokens, possibly fewer (a sampler stops at the first mismatch, a
            recorded output ends). When no token follows the accepted prefix the request is done.
        n_verified : int, optional
            Draft tokens the target decoded, when it cut the draft (llama-cpp-python trims
            drafts to its free context); the rest count as rejected. Default: all.

        Returns
        -------
        int
            Accepted draft tokens (``engine.accept`` got the same, after a non-empty draft).

        Raises
        ------
        RuntimeError
            No `propose` since the last `verify`.
        ValueError
            `n_verified` out of 0 .. len(draft); the step stays open.
        """
        draft = self._draft
        if draft is None:
            raise RuntimeError("verify() without propose()")
        n_d = len(draft)
        if n_verified is not None and not 0 <= n_verified <= n_d:
            # the step stays open: nothing was accepted yet
            raise ValueError(f"n_verified = {n_verified} is out of range: allowed 0 .. {n_d}")
        self._draft = None
        n_acc = 0
        if n_d:
            if n_verified is None:
                n_acc = common_prefix(draft, target)
            elif n_verified:            # 0: the host decoded none of it, nothing to compare
                n_acc = common_prefix(draft[:n_verified], target)
            t0 = _clock()
            self.engine.accept(self.slot, n_acc)
            self.accept_ns += _clock() - t0
            self.counts.verified(n_d, n_acc)
        steps = self.steps
        steps.append([n_d, n_acc, self._called])
        self.n_steps += 1
        if len(steps) >= self._steps_cap:
            del steps[:-self._keep]
        if self.record_drafts:
            self.drafts.append(draft.tolist())
        L = self._len
        buf = self._buf
        if L + 1 + n_acc > len(buf):
            grown = np.empty(max(2 * len(buf), L + 1 + n_acc), dtype=np.int32)
            grown[:L] = buf[:L]
            buf = self._buf = grown
        buf[L] = self.sampled
        if n_acc:
            buf[L + 1:L + 1 + n_acc] = draft[:n_acc]
        self._len = L + 1 + n_acc
        n_out = self.n_output + n_acc
        if n_acc < len(target):
            self.sampled = int(target[n_acc])
            n_out += 1
        else:
            self.done = True
        self.n_output = n_out
        if 0 <= self.n_predict <= n_out:
            self.done = True
        if self._bounded:
            self._room = self._room_now()
        return n_acc

    def record(self) -> dict:
        """The request's record in the golden files' format.

        Returns
        -------
        dict
            Counts, rates and ``steps`` (the last ones only, with ``keep_steps``); ``drafts``
            too with `record_drafts`.
        """
        n_steps = self.n_steps
        rec = {
            "slot": self.slot, "n_prompt": self.n_prompt, "n_output": self.n_output,
            "n_steps": n_steps, **self.counts.as_dict(), "acc_rate": self.counts.acc_rate,
            # the first output token comes from the prompt pass, not from a verification step
            "tokens_per_step": round((self.n_output - 1) / n_steps, 4) if n_steps else 0.0,
            "steps": self.steps,
        }
        if self.record_drafts:
            rec["drafts"] = self.drafts
        return rec


def draft_budget(loop: SlotLoop, *caps: int | None) -> int | None:
    """A step's draft budget, the one computation every driver makes once per step: the
    smallest of its caps (a batch's share per slot, a request's ``n_max``, a host engine's
    number of speculative tokens; None: no cap) and the loop's `SlotLoop.room` (context room,
    output budget). None: unbounded. Drivers pass it to `SlotLoop.propose`."""
    bound = loop._room                  # `room`, read without a call: once per row and step
    for cap in caps:
        if cap is not None and (bound is None or cap < bound):
            bound = cap
    return bound


def run_recorded(engine, slot: int, prompt, output, *, n_ctx: int = 0, policy=None,
                 record_drafts: bool = False, n_max: int | None = None) -> SlotLoop:
    """One request verified against a recorded output (greedy replay); returns the finished loop.

    The target's tokens are the recording: a draft is accepted up to its first token that
    differs from it, and the request ends with the recording.

    Parameters
    ----------
    engine, slot, n_ctx, record_drafts
        As for :class:`SlotLoop`.
    policy : DraftPolicy, optional
        The draft-length policy this driver calls around the loop's steps
        (`ngramspec.policy.DraftPolicy.draft` and ``verify``); None: llama.cpp's (the loop's
        own calls, the golden files).
    n_max : int, optional
        Every step's `SlotLoop.propose` bound (an engine's number of speculative tokens).
    prompt, output : 1-D int arrays
        The request's prompt and its recorded output tokens.

    Returns
    -------
    SlotLoop
        Done; ``record()`` gives the golden-format record.
    """
    n_out = len(output)
    loop = SlotLoop(engine, slot, prompt, output[0] if n_out else None, n_ctx=n_ctx,
                    record_drafts=record_drafts, capacity=len(prompt) + n_out + 1)
    propose, verify = (loop.propose, loop.verify) if policy is None else policy.bind(loop)
    tokens = output.tolist() if isinstance(output, np.ndarray) else list(output)
    # no cap: the budget is the room (propose's default); no room: the cap at every step
    capped = n_max is not None and loop.room() is not None
    while not loop.done and loop.n_output < n_out:
        n_d = len(propose(draft_budget(loop, n_max) if capped else n_max))
        produced = loop.n_output
        # a list slice is the cheap target of the many steps without a draft; an array slice
        # compares faster with a draft
        verify(output[produced:produced + n_d + 1] if n_d else tokens[produced:produced + 1])
    return loop
