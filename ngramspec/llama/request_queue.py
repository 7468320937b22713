"""The batched scheduler's submitted requests: those waiting for a slot, in order, and the
look-up of every unfinished one by id (`cancel`), under one lock shared with the decode thread.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Callable, Dict, List, Optional

from ngramspec.request import QueueFull
from .running import RunningRequest

__all__ = ["RequestQueue"]


class RequestQueue:
    """Submitted, unfinished requests.

    Parameters
    ----------
    size : int
        Requests that may wait beyond those the free slots will take.

    Attributes
    ----------
    cond : threading.Condition
        The lock of the queue and of the scheduler's slot bookkeeping; notified on each change.
    waiting : collections.deque of RunningRequest
        Not yet admitted, in submission order.
    stopping, closed : bool
        No more requests accepted; the scheduler is freed.

    Notes
    -----
    Memory: the waiting requests. Thread-safety: every method may be called from any thread;
    `waiting`, `stopping` and `closed` are read and changed with `cond` held.
    """

    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.waiting: deque = deque()
        self._live: Dict[int, RunningRequest] = {}
        self._ids = itertools.count(1)
        self.stopping = self.closed = False

    def put(self, make: Callable[[int], RunningRequest],
            n_free: Callable[[], int]) -> RunningRequest:
        """Queue the request ``make(id)``: `QueueFull` when `size` requests beyond the
        ``n_free()`` free slots (those the decode thread's next turn takes) already wait,
        RuntimeError once stopping."""
        with self.cond:
            if self.stopping or self.closed:
                raise RuntimeError("the scheduler is stopped")
            if len(self.waiting) >= self.size + n_free():
                raise QueueFull(f"the request queue is full ({self.size} waiting)")
            req = make(next(self._ids))
            self.waiting.append(req)
            self._live[req.id] = req
            self.cond.notify_all()
        return req

    def cancel(self, request_id: int) -> None:
        """Mark a request cancelled (a finished or unknown id is ignored)."""
        with self.cond:
            req = self._live.get(request_id)
            if req is not None:
                req.cancel_requested = True
            self.cond.notify_all()

    def finished(self, request_id: int) -> None:
        with self.cond:
            self._live.pop(request_id, None)

    def next_turn(self, n_active: int) -> bool:
        """Wait (`cond` held) until there is work or a stop; False: stopping with nothing left."""
        while not n_active and not self.waiting and not self.stopping:
            self.cond.wait()
        return not (self.stopping and not n_active and not self.waiting)

    def take_cancelled(self) -> List[RunningRequest]:
        """The waiting requests cancelled before admission, removed (`cond` held)."""
        gone = [r for r in self.waiting if r.cancel_requested]
        for r in gone:
            self.waiting.remove(r)
        return gone

    def stop(self, cancel_also: Optional[List[RunningRequest]] = None) -> None:
        """Accept no more requests; with `cancel_also` (the running ones), cancel those and
        every waiting one."""
        with self.cond:
            self.stopping = True
            if cancel_also is not None:
                for r in list(self.waiting) + list(cancel_also):
                    r.cancel_requested = True
            self.cond.notify_all()

    def close(self) -> bool:
        """Mark the scheduler freed; True the first time only."""
        with self.cond:
            first, self.closed = not self.closed, True
        return first

    def drain(self) -> List[RunningRequest]:
        """Stop accepting; the waiting requests, removed."""
        with self.cond:
            self.stopping = True
            pending = list(self.waiting)
            self.waiting.clear()
        return pending
