"""A request body as a validated request, without letting one client stall the others.

FastAPI would parse and validate a body on the event loop, before any check of ours: 289k empty
chat messages in 8 MiB cost seconds of event-loop CPU and hundreds of MB, and a list of 4 M
token ids was copied twice before the scheduler refused its length. Here:

1. the body (already read whole, bounded by `ngramspec.server.limits.RequestLimits`) is parsed
   with ``json.loads`` — on the event loop only when it is small (`INLINE_BYTES`), else on the
   app's thread pool, at most `PARSERS` large bodies at once (`BodyParser`), so that many large
   bodies arriving together neither add up in memory nor take every core;
2. the parsed JSON's lists are bounded before pydantic copies them (``precheck``): a chat's
   message count and its summed content against a slot's context, a prompt of token ids
   against a slot's context;
3. pydantic validates what is left, in the same thread.

Errors are the app's usual 400s: malformed JSON, a body that is no object, the field a
precheck refuses (`ngramspec.server.errors.FieldError`), pydantic's errors through FastAPI's
handler.

Notes
-----
Thread-safety: `BodyParser.parse` runs on the event loop (its semaphore is the loop's); the
parsing function is pure and runs on any thread.
"""
from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ngramspec.server.errors import APIError, FieldError

#: Bodies up to this size are parsed on the event loop (a thread hop costs more than them).
INLINE_BYTES = 64 << 10
#: Large bodies parsed at once; more wait their turn (each costs up to ~30x its size).
PARSERS = 2


class BodyBounds:
    """What a slot can hold, for the prechecks of a parsed body.

    Parameters
    ----------
    n_ctx_slot : int
        A slot's context in tokens: a prompt must leave one cell for the first output token.
    max_text_bytes : int or None
        UTF-8 bytes of text that certainly cannot fit a slot
        (`ngramspec.server.limits.PromptTextBound.max_bytes`); None: no bound.

    Notes
    -----
    Thread-safety: immutable.
    """

    def __init__(self, n_ctx_slot: int, max_text_bytes: Optional[int]):
        self.n_tokens = max(0, n_ctx_slot - 1)
        self.max_text_bytes = max_text_bytes

    def token_prompt(self, prompt, field: str) -> None:
        """Refuse a list of token ids longer than a slot's prompt can be (its length only:
        nothing is copied)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]                       # a batch of one prompt
        if isinstance(prompt, list) and len(prompt) > self.n_tokens:
            raise FieldError(field, f"{field}: the prompt ({len(prompt)} tokens) does not fit a "
                                    f"slot's context: allowed at most {self.n_tokens} prompt "
                                    f"tokens (one cell is kept for the first output token)",
                             code="context_length_exceeded")

    def messages(self, messages, field: str = "messages") -> None:
        """Refuse more messages than a slot's context has tokens (each renders to at least
        one), and contents whose summed characters already pass the text bound (a character
        is at least one UTF-8 byte), before any message is validated or rendered."""
        if not isinstance(messages, list):
            return                                   # pydantic names the type error
        if len(messages) > self.n_tokens:
            raise FieldError(field, f"{field}: {len(messages)} messages cannot fit a slot's "
                                    f"context (each is at least one token): allowed at most "
                                    f"{self.n_tokens} messages",
                             code="context_length_exceeded")
        if self.max_text_bytes is None:
            return
        chars = 0
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p["text"]) for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        if chars > self.max_text_bytes:
            raise FieldError(field, f"{field}: the contents ({chars} characters) cannot fit a "
                                    f"slot's context of {self.n_tokens} prompt tokens: allowed "
                                    f"at most {self.max_text_bytes} bytes in all",
                             code="context_length_exceeded")


def parse_body(raw: bytes, model, bounds: BodyBounds):
    """``model`` validated from the JSON body ``raw``; ``model.precheck(obj, bounds)`` runs on
    the parsed JSON first.

    Parameters
    ----------
    raw : bytes
    model : pydantic model class with a ``precheck`` classmethod
    bounds : BodyBounds

    Returns
    -------
    model instance

    Raises
    ------
    APIError
        400: malformed JSON (or nested too deeply), a body that is no JSON object.
    FieldError
        A precheck refused a field.
    fastapi.exceptions.RequestValidationError
        pydantic's errors, answered by the app's handler (a 400 naming the field).
    """
    if not raw.strip():
        raise APIError(400, "the request body must be a JSON object")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc.msg} (at character {exc.pos})") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"malformed JSON body: not UTF-8 (at byte {exc.start})") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(obj, dict):
        raise APIError(400, "the request body must be a JSON object")
    model.precheck(obj, bounds)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


class BodyParser:
    """Parses request bodies: small ones on the event loop, large ones on a thread pool, at
    most ``parsers`` of them at once.

    Parameters
    ----------
    run : coroutine function
        ``await run(fn, *args)`` runs ``fn`` on a thread pool (`SchedulerBridge.run`).
    bounds : BodyBounds
    parsers : int
        Large bodies parsed at once.

    Notes
    -----
    Memory: the large bodies waiting for a parser stay as bytes (bounded by the server's
    concurrency cap and body size); at most ``parsers`` are expanded into objects at once.

    Thread-safety: `parse` runs on one event loop.
    """

    def __init__(self, run, bounds: BodyBounds, parsers: int = PARSERS):
        self._run = run
        self.bounds = bounds
        self._parsers = asyncio.Semaphore(parsers)

    async def parse(self, request, model):
        """The request's body as ``model`` (see `parse_body`)."""
        raw = await request.body()
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw, model, self.bounds)
        async with self._parsers:
            return await self._run(parse_body, raw, model, self.bounds)
