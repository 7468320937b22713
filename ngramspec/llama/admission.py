"""Which queued request goes into which free slot: the scheduler's cache-aware admission.

A slot keeps the KV cache of its last request, and an admitted request decodes only the part of
its prompt that its slot does not hold (the longest common prefix, llama-server's
``cache_prompt``). Admitting strictly first come, first served into the free slot with the
longest common prefix (llama-server's choice) re-processes a whole prompt whenever the slot that
holds it is busy — with more clients than slots, two requests of one conversation or of one
shared document are often in flight at once — and on a CPU re-processing a prompt costs as much
as generating hundreds of tokens.

So a queued request that a *busy* slot would serve better (its prompt shares at least
`MIN_GAIN` more tokens with the prompt that slot is running than with any free slot's cache)
waits for that slot, but never longer than re-processing the difference would take
(``prompt_seconds(gain)``, from the scheduler's measured step cost curve): the ski-rental rule,
which never costs more than twice the better choice made in hindsight. Requests behind a waiting
one are admitted meanwhile, so a free slot does not idle while another request could use it.

A request reuses only the caches of its own ``cache_owner`` (None: everyone's, llama-server's
behaviour; the server sets one per API key with ``--cache-isolation per-key``), and none with
``cache_prompt`` off: a shared cache tells a client, through the prompt's time and
``timings.cache_n``, how much of its prompt another client sent.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ngramspec.loop import common_prefix

__all__ = ["MIN_GAIN", "SlotTable", "best_slot", "may_reuse", "plan"]

#: Cached prompt tokens a busy slot must offer beyond the best free slot before a request waits.
MIN_GAIN = 16
#: Queued requests looked at per free slot in one admission pass (bounds the work of a step).
SCAN_PER_SLOT = 4


def may_reuse(req, owner) -> bool:
    """Whether ``req`` may reuse a cache that a request of ``owner`` left: with its
    ``cache_prompt`` on (llama-server's per-request switch) and the same ``cache_owner``
    (None = the shared cache). Objects without the attributes share (the defaults)."""
    return getattr(req, "cache_prompt", True) and getattr(req, "cache_owner", None) == owner


def best_slot(prompt: np.ndarray, slots: Sequence, req=None) -> Tuple[object, int]:
    """The slot (``.cached``, ``.n_cached``, ``.last_used``, optional ``.owner``) whose cache
    shares the longest prefix with ``prompt``, the least recently used one on ties; and that
    prefix's length. A cache that ``req`` may not reuse (`may_reuse`) counts as sharing
    nothing."""
    best, best_lcp = None, -1
    for s in slots:
        ok = req is None or may_reuse(req, getattr(s, "owner", None))
        lcp = common_prefix(s.cached[:s.n_cached], prompt) if ok else 0
        if lcp > best_lcp or (lcp == best_lcp and s.last_used < best.last_used):
            best, best_lcp = s, lcp
    return best, best_lcp


def plan(queue: Iterable, free: Sequence, running: Sequence[np.ndarray], now: float,
         prompt_seconds: Callable[[int], float],
         owners: Optional[Sequence] = None) -> List[tuple]:
    """One admission pass: ``(request, slot, cached prefix)`` for each request to admit now.

    Parameters
    ----------
    queue : iterable of requests (``.prompt``: int32 array, ``.t_submit``: seconds), in arrival
        order.
    free : the free slots (``.cached``, ``.n_cached``, ``.last_used``).
    running : the prompts of the requests the busy slots run (their slots will hold them).
    now : the clock of ``t_submit``.
    prompt_seconds : callable(n) -> estimated seconds to decode n prompt tokens.
    owners : the ``cache_owner`` of each of `running` (default: all None, the shared cache).
        A request (``.cache_owner``, ``.cache_prompt``: optional) reuses, and waits for, only
        caches it `may_reuse`.

    Notes
    -----
    Pure: reads its arguments, changes nothing (the scheduler applies the plan). Thread-safety:
    as its arguments.
    """
    free = list(free)
    running = list(running)
    owners = list(owners) if owners is not None else [None] * len(running)
    out = []
    for req in itertools.islice(queue, SCAN_PER_SLOT * max(1, len(free) + len(running))):
        if not free:
            break
        last = req.prompt.size - 1        # the prompt's last token is always decoded
        slot, lcp = best_slot(req.prompt, free, req)
        held = max((common_prefix(p, req.prompt) for p, o in zip(running, owners)
                    if may_reuse(req, o)), default=-1)
        if held >= 0:
            gain = min(held, last) - min(lcp, last)
            if gain >= MIN_GAIN and now - req.t_submit < prompt_seconds(gain):
                continue                  # wait for the busy slot that holds the prompt
        free = [s for s in free if s is not slot]
        running.append(req.prompt)
        owners.append(getattr(req, "cache_owner", None))
        out.append((req, slot, lcp))
    return out


class SlotTable:
    """The scheduler's slots (`ngramspec.llama.running.Slot`): which request each runs, and the
    admission pass that fills the free ones (`plan`).

    Parameters
    ----------
    slots : sequence of Slot

    Notes
    -----
    Memory: the slots. Thread-safety: the scheduler's lock guards it (the decode thread changes
    it, `n_free` and `n_busy` are read from any thread under that lock).
    """

    def __init__(self, slots: Sequence):
        self.slots = list(slots)
        self._use = 0

    def n_free(self) -> int:
        return sum(1 for s in self.slots if s.req is None)

    def n_busy(self) -> int:
        return len(self.slots) - self.n_free()

    def admit(self, waiting, now: float, prompt_seconds: Callable[[int], float],
              context) -> List[tuple]:
        """Move the requests `plan` admits from `waiting` (a deque) into their free slots
        (``RunningRequest.admit`` on `context`); returns ``(request, cached prefix kept)``."""
        free = [s for s in self.slots if s.req is None]
        if not waiting or not free:
            return []
        busy = [s.req for s in self.slots if s.req is not None]
        out = []
        for req, slot, lcp in plan(waiting, free, [r.prompt for r in busy], now, prompt_seconds,
                                   [r.cache_owner for r in busy]):
            waiting.remove(req)
            self._use += 1
            slot.last_used = self._use
            out.append((req, req.admit(slot, lcp, context)))
        return out
