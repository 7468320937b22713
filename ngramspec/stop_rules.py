"""When a generation ends, and how it says why: the one stop rule set of every driver.

Live generation (`ngramspec.llama.live`), the batched scheduler and the engine plug-ins emit a
step's tokens (the accepted draft and the target's next token) through `cut_step`, so they end a
request at the same token for the same reason. Stop *strings* are text, not tokens: the
scheduler's text stream (`ngramspec.llama.text.TextStream`) finds them and reports `STOP`.

Finish reasons are OpenAI's (``stop``, ``length``) plus ours where OpenAI has none; a server maps
them to the wire with `openai_finish_reason`.

The output limit has one sentinel everywhere: ``max_tokens < 0`` (-1) is no limit, ``>= 0``
bounds the output (0: nothing is generated).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from ngramspec.validation import check_choice

__all__ = ["STOP", "LENGTH", "CONTEXT", "CANCELLED", "ERROR", "INTERRUPTED", "FINISH_REASONS",
           "openai_finish_reason", "cut_step", "context_full"]

#: An end-of-generation token, or a stop string.
STOP = "stop"
#: The request's output limit (``max_tokens``, ``n_predict``).
LENGTH = "length"
#: The context (a slot's share of the KV cache) has no cell left for the next token.
CONTEXT = "context"
#: The client cancelled, or left.
CANCELLED = "cancelled"
#: A decode or a callback failed.
ERROR = "error"
#: Ctrl-C during a command-line generation (the partial output is kept).
INTERRUPTED = "interrupted"

FINISH_REASONS = (STOP, LENGTH, CONTEXT, CANCELLED, ERROR, INTERRUPTED)

# OpenAI reports a full context as "length"; it has no word for the others, which end a request
# no one reads (cancelled) or end it with an error response instead.
_OPENAI = {STOP: "stop", LENGTH: "length", CONTEXT: "length", CANCELLED: "stop"}


def openai_finish_reason(reason: str) -> str:
    """The ``finish_reason`` OpenAI's API uses for one of `FINISH_REASONS`.

    Raises
    ------
    ngramspec.validation.OutOfRange
        `reason` is not one of `FINISH_REASONS` (a ValueError).
    """
    return _OPENAI.get(check_choice("finish reason", reason, FINISH_REASONS), "stop")


def cut_step(tokens: Sequence[int], n_out: int, max_tokens: int,
             is_eog: Optional[Callable[[int], bool]]) -> Tuple[int, Optional[str]]:
    """How many of one step's `tokens` a request keeps, and why it ends (``None``: it goes on).

    Parameters
    ----------
    tokens : sequence of int
        The step's tokens in order (the accepted draft, then the target's token).
    n_out : int
        Output tokens the request emitted before this step.
    max_tokens : int
        The output limit; < 0 is none.
    is_eog : callable or None
        True for an end-of-generation token; ``None`` ignores them (``ignore_eos``).

    Returns
    -------
    (int, str or None)
        Tokens kept (an end-of-generation token included, the rest after it dropped, as
        llama-server's ``process_token`` stops the slot there) and `STOP`, `LENGTH` or ``None``.
    """
    keep, reason = len(tokens), None
    if is_eog is not None:
        for i, t in enumerate(tokens):
            if is_eog(t):
                keep, reason = i + 1, STOP
                break
    if max_tokens >= 0:
        if n_out + keep > max_tokens:       # the limit comes first (an end token after it goes)
            keep, reason = max(0, max_tokens - n_out), LENGTH
        elif n_out + keep == max_tokens and reason is None:
            reason = LENGTH                 # an end token at the limit's last place is a stop
    return keep, reason


def context_full(n_context: int, n_ctx: int) -> bool:
    """No cell is left for the next token: the one sampled last goes at position `n_context`
    (it is not in the cache yet), so a context of `n_ctx` cells is full at ``n_context = n_ctx``."""
    return n_context >= n_ctx
