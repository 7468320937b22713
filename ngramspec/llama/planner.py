"""What one step of the batched scheduler decodes: the step plan, and the planner that builds it.

vLLM v1's split: ``schedule()`` returns a plain plan and ``update_from_output()`` applies the
model's output to it. Here `plan_step` is the first half. It reads the running requests and
decides, before anything is decoded,

* which requests end now (a cancel, a slot context with no cell left for the next token:
  `ngramspec.stop_rules.context_full`);
* each generating slot's run ``[sampled] + draft``: the draft made through the request's
  policy (`ngramspec.policy.DraftPolicy.draft`) and `ngramspec.loop.SlotLoop`, within the one
  budget `ngramspec.loop.draft_budget` computes (the batch's share per slot, the request's
  ``n_max``, the slot's room), dropped below its ``n_min``; for the requests of the joint
  cost-aware policy, cut to the lengths `ngramspec.policy.AutoPolicy.choose` chooses for the
  whole step. Data flows planner -> policy -> loop -> engine;
* each prompt's next chunk, in the tokens of ``n_batch`` the runs leave.

It touches no llama context: the executor (`ngramspec.llama.executor`) decodes the plan in one
``llama_decode``, then samples, verifies and trims the KV cache. A request is anything with the
attributes the planner reads (`PlannedRequest`), so the planner is tested without a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Protocol, Sequence, Tuple

import numpy as np

from ngramspec.loop import SlotLoop, draft_budget
from ngramspec.policy import DraftPolicy
from ngramspec.stop_rules import CANCELLED, CONTEXT, context_full

__all__ = ["PREFILL_RESERVE", "PlannedRequest", "PromptChunk", "StepPlan", "Verify", "plan_step"]

#: Prompt tokens a step keeps for admitted prompts when drafts could fill the whole batch.
PREFILL_RESERVE = 64


class _SlotId(Protocol):
    id: int


class _DraftBounds(Protocol):
    n_max: Optional[int]
    n_min: Optional[int]


class PlannedRequest(Protocol):
    """What the planner reads of an admitted request (`ngramspec.llama.running.RunningRequest`
    in the scheduler; plain objects in the tests).

    Attributes
    ----------
    cancel_requested : bool
    loop : SlotLoop or None
        None while the prompt is being decoded.
    policy : DraftPolicy
        The draft-length policy the planner drafts through (`ngramspec.policy.FIXED`, or the
        scheduler's joint `AutoPolicy`), and the executor verifies through.
    spec : has ``n_max`` and ``n_min`` (None: no bound of the request's own)
    prompt : numpy.ndarray
    n_past : int
        Prompt tokens already in the slot's KV cache.
    slot : has ``id`` (the sequence id)
    """

    cancel_requested: bool
    loop: Optional[SlotLoop]
    policy: DraftPolicy
    spec: _DraftBounds
    prompt: np.ndarray
    n_past: int
    slot: _SlotId


@dataclass(frozen=True, eq=False)
class Verify:
    """One generating slot's run: ``[sampled] + draft`` at positions ``pos0 ..``, logits at each.

    Attributes
    ----------
    req : the request
    seq : int
        Its sequence id (= slot).
    tokens : numpy.ndarray
        int32 ``[sampled] + draft``: the draft as the step verifies it (cut by the joint choice).
    pos0 : int
        Position of ``sampled`` (the slot's context length).
    """

    req: object = field(repr=False)
    seq: int
    tokens: np.ndarray
    pos0: int

    @property
    def draft(self) -> np.ndarray:
        """The draft tokens the step verifies."""
        return self.tokens[1:]


@dataclass(frozen=True)
class PromptChunk:
    """The part ``prompt[start:stop]`` of a request's prompt the step decodes; with ``last`` it
    completes the prompt and its last token's logits give the first output token."""

    req: object = field(repr=False)
    seq: int
    start: int
    stop: int
    last: bool

    @property
    def tokens(self) -> np.ndarray:
        return self.req.prompt[self.start:self.stop]


@dataclass(frozen=True)
class StepPlan:
    """One step: the requests that end before it, and the runs its one ``llama_decode`` decodes
    (generating slots first, then prompt chunks, in batch order).

    Notes
    -----
    Memory: one int32 array per generating slot (its run). Thread-safety: immutable.
    """

    finishes: Tuple[Tuple[object, str], ...]
    verifies: Tuple[Verify, ...]
    chunks: Tuple[PromptChunk, ...]

    def __str__(self) -> str:
        """One line per entry, by slot: what the step ends, verifies and prefills."""
        lines = [f"end slot {r.slot.id}: {reason}" for r, reason in self.finishes]
        lines += [f"verify slot {v.seq} at {v.pos0}: {int(v.tokens[0])} + draft "
                  f"{v.draft.tolist()}" for v in self.verifies]
        lines += [f"prompt slot {c.seq}: {c.start} .. {c.stop}{' (last)' if c.last else ''}"
                  for c in self.chunks]
        return "\n".join(lines) or "nothing to decode"

    def split(self, n_batch: int, n_ctx_slot: int,
              min_run: int) -> Tuple[Tuple["StepPlan", int], ...]:
        """The plan as the deterministic mode decodes it (`ngramspec.llama.deterministic`),
        without the ends: ``(part, pad_to)`` pairs, one decode each.

        Generating slots' runs share a decode only padded to one length (llama.cpp then gives
        every KV stream the same tokens in one ubatch): the runs of at most ``min_run`` tokens
        (plain steps, empty drafts) go together; the longer ones together where padding them to
        the longest at most doubles their tokens, else each alone (measured: padding a step's
        drafts to its longest cost more than separate decodes). Every prompt chunk alone.
        """
        short = [r for r in self.verifies if len(r.tokens) <= min_run]
        long_ = [r for r in self.verifies if len(r.tokens) > min_run]
        parts = _together(short, min_run, n_batch, n_ctx_slot)
        L = max([0] + [len(r.tokens) for r in long_])
        if L * len(long_) <= 2 * sum(len(r.tokens) for r in long_):
            parts += _together(long_, L, n_batch, n_ctx_slot)
        else:
            parts += [(StepPlan((), (r,), ()), 0) for r in long_]
        return tuple(parts + [(StepPlan((), (), (c,)), 0) for c in self.chunks])

    @property
    def n_tokens(self) -> int:
        """Tokens of the batch."""
        return sum(len(v.tokens) for v in self.verifies) + sum(c.stop - c.start
                                                               for c in self.chunks)


def _together(runs: Sequence[Verify], L: int, n_batch: int, n_ctx_slot: int) -> list:
    """``runs`` padded to ``L`` tokens in one decode where they fit the batch and their slots'
    contexts, else one decode each."""
    if len(runs) > 1 and L * len(runs) <= n_batch and all(r.pos0 + L <= n_ctx_slot
                                                         for r in runs):
        return [(StepPlan((), tuple(runs), ()), L)]
    return [(StepPlan((), (r,), ()), 0) for r in runs]


def plan_step(active: Sequence[PlannedRequest], n_batch: int, n_ctx_slot: int, joint=None) -> StepPlan:
    """The plan of the next step over the admitted requests ``active`` (admission order).

    Parameters
    ----------
    active : sequence of requests
        Generating ones have a ``loop`` (`ngramspec.loop.SlotLoop`); the others are processing
        their prompt (``n_past`` of its tokens are in the slot's KV cache).
    n_batch : int
        Tokens of one decode.
    n_ctx_slot : int
        A slot's share of the KV cache.
    joint : AutoPolicy, optional
        The policy whose loops' drafts are cut jointly (`AutoPolicy.choose`).

    Returns
    -------
    StepPlan

    Notes
    -----
    Drafts each generating slot's draft through its policy (``policy.draft``: the loop is then
    waiting for its verification, ``policy.verify``); changes nothing else. Thread-safety: the decode thread's, as the loops.
    """
    cancelled = [r for r in active if r.cancel_requested]
    running = [r for r in active if not r.cancel_requested]
    pre = [r for r in running if r.loop is None]
    gen, full = [], []
    for r in running:
        if r.loop is not None:
            # the sampled token needs a cell: none left ends the request before the decode
            (full if context_full(r.loop.n_context, n_ctx_slot) else gen).append(r)
    finishes = tuple([(r, CANCELLED) for r in cancelled] + [(r, CONTEXT) for r in full])
    drafts = _propose(gen, bool(pre), n_batch)
    if joint is not None:
        _cut_jointly(gen, drafts, pre, n_batch, joint)
    verifies = []
    for r, draft in zip(gen, drafts):
        run = np.empty(len(draft) + 1, dtype=np.int32)
        run[0] = r.loop.sampled
        run[1:] = draft
        verifies.append(Verify(r, r.slot.id, run, r.loop.n_context))
    free = n_batch - sum(len(v.tokens) for v in verifies)
    chunks = []
    for r in pre:
        n = min(free, r.prompt.size - r.n_past)
        if n <= 0:
            continue
        chunks.append(PromptChunk(r, r.slot.id, r.n_past, r.n_past + n,
                                  r.n_past + n == r.prompt.size))
        free -= n
    return StepPlan(finishes, tuple(verifies), tuple(chunks))


def _propose(gen: Sequence, prompts_waiting: bool, n_batch: int) -> List[np.ndarray]:
    """Each generating request's draft, bounded so that all of them fit the batch with room kept
    for the prompts being processed."""
    reserve = min(PREFILL_RESERVE, n_batch // 4) if prompts_waiting else 0
    cap = max(0, (n_batch - reserve) // max(1, len(gen)) - 1)
    drafts = []
    for r in gen:
        # the slot's one budget: the batch share, the request's n_max, the context's room and
        # the output's (the loop only checks it)
        drafts.append(r.policy.draft(r.loop, draft_budget(r.loop, cap, r.spec.n_max),
                                     r.spec.n_min or 0))
    return drafts


def _cut_jointly(gen: Sequence, drafts: List[np.ndarray], pre: Sequence, n_batch: int,
                 joint) -> None:
    """Cut the drafts of `joint`'s requests to the lengths it chooses for the whole step (the
    loop keeps its whole pending draft: verification counts the cut part as not verified)."""
    auto = [i for i, r in enumerate(gen) if r.policy is joint and len(drafts[i])]
    if not auto:
        return
    n_fixed = sum(len(d) for r, d in zip(gen, drafts) if r.policy is not joint)
    n_prompt = min(sum(r.prompt.size - r.n_past for r in pre),
                   max(0, n_batch - len(gen) - n_fixed))
    ks = joint.choose([gen[i].loop for i in auto], [len(drafts[i]) for i in auto],
                      n_base=len(gen) + n_fixed + n_prompt, e_base=float(len(gen)))
    for i, k in zip(auto, ks):
        drafts[i] = drafts[i][:k]

