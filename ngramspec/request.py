"""What a submitted request gives back: its handle (wait, stream, cancel), chunks, completion."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from ngramspec.stats import DraftCounts

__all__ = ["QueueFull", "Chunk", "Completion", "RequestHandle"]


class QueueFull(RuntimeError):
    """The scheduler's bounded queue of waiting requests is full (retry later: HTTP 503)."""


@dataclass
class Chunk:
    """Tokens emitted by one step of one request, with the text they release.

    ``text`` may be empty (an incomplete UTF-8 character or a possible stop-string prefix is held
    back) and may belong to earlier tokens.
    """

    tokens: List[int]
    text: str


@dataclass
class Completion:
    """The outcome of one request.

    Attributes
    ----------
    tokens : list of int
        Emitted tokens (an EOS token included when the model stopped by itself; after a stop
        string, up to the token that completed it).
    text : str
        Their text, cut before a stop string.
    finish_reason : str
        ``"stop"`` (EOS or a stop string), ``"length"`` (``max_tokens``), ``"cancelled"``,
        ``"context"`` (the slot's context is full) or ``"error"``.
    prompt_n, prompt_cached_n : int
        Prompt tokens, and how many of them were reused from the slot's KV cache.
    predicted_n : int
        ``len(tokens)``.
    prompt_ms, predicted_ms : float
        Admission to first token; first token to the end.
    counts : DraftCounts
        The request's draft counts (`ngramspec.stats`); ``n_draft_tokens`` / ``n_acc_tokens``
        (a server response's ``timings.draft_n`` / ``draft_n_accepted``) read it.
    stop_string : str or None
        The stop string that ended the request.
    queued_ms : float
        Submission to admission.
    accepted_prediction_tokens, rejected_prediction_tokens : int
        With a prediction (Predicted Outputs): its drafted tokens the target accepted, and
        those it did not (OpenAI's ``usage.completion_tokens_details``); 0 without one.

    Notes
    -----
    Thread-safety: plain data, not modified once the handle is done.
    """

    tokens: List[int]
    text: str
    finish_reason: str
    prompt_n: int
    prompt_cached_n: int
    predicted_n: int
    prompt_ms: float
    predicted_ms: float
    counts: DraftCounts
    stop_string: Optional[str] = None
    queued_ms: float = 0.0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    n_draft_tokens = property(lambda self: self.counts.n_draft_tokens)
    n_acc_tokens = property(lambda self: self.counts.n_acc_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0


_END = object()


class RequestHandle:
    """A submitted request: wait for it, stream it, or cancel it.

    Parameters
    ----------
    request_id : int
    cancel : callable(request_id)
        Asks the scheduler to stop the request (`Scheduler.cancel`).

    Notes
    -----
    The client's side is `result`, iteration and `cancel`; the scheduler's decode thread is the
    producer (`deliver`, `complete`).

    Memory: the chunks not yet read, the completion.

    Thread-safety: every method may be called from any thread. Iterating the handle from two
    threads at once splits the chunks between them.
    """

    def __init__(self, request_id: int, cancel: Callable[[int], None]):
        self._id = request_id
        self._cancel = cancel
        self._chunks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Optional[Completion] = None
        self._error: Optional[BaseException] = None

    @property
    def id(self) -> int:
        return self._id

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to stop this request; its slot is freed within one step.

        The completion then has ``finish_reason == "cancelled"`` (unless it had finished already).
        """
        self._cancel(self._id)

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Wait for the completion.

        Raises
        ------
        TimeoutError
            When ``timeout`` seconds passed first.
        RuntimeError
            When the request failed (a decode error, an exception in its callback).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"request {self.id} failed: {self._error}") from self._error
        return self._completion

    def __iter__(self) -> Iterator[Chunk]:
        """Chunks as the steps emit them, until the request is done (then :meth:`result`)."""
        while True:
            item = self._chunks.get()
            if item is _END:
                self._chunks.put(_END)  # later iterations end at once too
                return
            yield item

    def deliver(self, chunk: Chunk) -> None:
        """The producer's side: a step's chunk for the client."""
        self._chunks.put(chunk)

    def complete(self, completion: Optional[Completion], error: Optional[BaseException]) -> None:
        """The producer's side, once: the request's outcome (or the error that ended it)."""
        self._completion, self._error = completion, error
        self._chunks.put(_END)
        self._done.set()
