"""A running request's output: its tokens through the stop rules and its text stream to the
client (the update half of the scheduler's step, after verification)."""
from __future__ import annotations

import logging
from typing import Callable, List, Optional

from ngramspec.stop_rules import LENGTH, STOP, cut_step

from ngramspec.request import Chunk
from .running import RunningRequest

__all__ = ["emit"]

log = logging.getLogger("ngramspec.scheduler")


def emit(r: RunningRequest, tokens: List[int],
         is_eog: Optional[Callable[[int], bool]]) -> Optional[str]:
    """Append the tokens a step produced for `r` (cut by the stop rules: an end-of-generation
    token where ``is_eog`` says so, ``max_tokens``, a stop string), stream them to its client;
    returns the finish reason when the request ends here, else None.

    Thread-safety: the decode thread's (the handle is thread-safe; ``on_token`` runs here, an
    exception in it cancels the request and is reported with its completion).
    """
    keep, reason = cut_step(tokens, len(r.tokens), r.sampling.max_tokens,
                            None if r.sampling.ignore_eos else is_eog)
    tokens = [int(t) for t in tokens[:keep]]
    n_kept, chunk = r.text.push(tokens)
    if r.text.stopped:
        tokens, reason = tokens[:n_kept], STOP
    r.tokens.extend(tokens)
    if reason is None and r.loop is not None and r.loop.done:
        reason = LENGTH  # the loop's output limit (sample_run stopped at it)
    if reason is not None:
        chunk += r.text.finish()
    if tokens or chunk:
        _deliver(r, tokens, chunk)
    return reason


def _deliver(r: RunningRequest, tokens: List[int], text: str) -> None:
    r.handle.deliver(Chunk(tokens, text))
    if r.on_token is not None:
        try:
            r.on_token(tokens, text)
        except Exception as exc:
            log.exception("on_token callback of request %d failed", r.id)
            r.callback_error = exc
            r.cancel_requested = True
