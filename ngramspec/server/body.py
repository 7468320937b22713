"""A request body as a validated request, without letting one client stall the others.

FastAPI would parse and validate a body on the event loop, before any check of ours: 289k empty
chat messages in 8 MiB cost seconds of event-loop CPU and hundreds of MB, and a list of 4 M
token ids was copied twice before the scheduler refused its length. Here:

1. the body (already read whole, bounded by `ngramspec.server.limits.RequestLimits`) is parsed
   with ``json.loads`` — on the event loop only when it is small (`INLINE_BYTES`), else in a
   worker process, `PARSERS` large bodies at a time (`BodyParser`): ``json.loads`` and pydantic
   hold the GIL for the whole call (half a second for 8 MB of token ids), so in a thread they
   would stall the event loop and the decode thread just the same; one worker process also
   keeps many large bodies from taking every core;
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
parsing function is pure and runs on any thread or process.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Optional

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ngramspec.server.errors import APIError, FieldError

#: Bodies up to this size are parsed on the event loop (a thread hop costs more than them).
INLINE_BYTES = 64 << 10
#: Large bodies parsed at once, each in a worker process of its own; more wait their turn.
PARSERS = 1
#: The parser processes' niceness above the server's.
PARSER_NICE = 10


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


def check_object_shape(raw: bytes) -> None:
    """Refuse, without parsing it, a body that cannot be a JSON object: empty, beginning with
    another JSON value, or beginning with ``{`` but not ending with ``}`` (cut short, or never
    closed: 8 MB of an unclosed list would otherwise be parsed to its end).

    Raises
    ------
    APIError
        400.
    """
    head = raw.lstrip()[:1]
    if not head or head in b'["-0123456789tfn':
        raise APIError(400, "the request body must be a JSON object")
    if head == b"{" and not raw.rstrip().endswith(b"}"):
        raise APIError(400, "malformed JSON body: the object does not end with '}' (cut "
                            "short?)")


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
    check_object_shape(raw)
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


def _parse_outcome(raw: bytes, model, bounds: BodyBounds) -> tuple:
    """`parse_body` in a worker process, its outcome as plain data (an exception of ours does
    not survive pickling: its constructor takes keywords): ``("ok", request)``,
    ``("error", status, message, param, code)`` or ``("invalid", pydantic errors)``."""
    try:
        return ("ok", parse_body(raw, model, bounds))
    except APIError as exc:
        return ("error", exc.status, exc.message, exc.param, exc.code)
    except RequestValidationError as exc:
        return ("invalid", [{k: v for k, v in e.items() if k != "ctx"} for e in exc.errors()])


def _worker_setup() -> None:
    # Ctrl-C reaches the whole process group: the server, not its parser, handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below the decode thread's priority: on a busy machine a large body waits, not the
    # requests being generated.
    os.nice(PARSER_NICE)


class BodyParser:
    """Parses request bodies: small ones on the event loop, large ones in ``parsers`` worker
    processes (started at the first large body), one body per worker at a time.

    Parameters
    ----------
    bounds : BodyBounds
    parsers : int
        Large bodies parsed at once (worker processes).

    Notes
    -----
    Memory: the large bodies waiting for a parser stay as bytes (bounded by the server's body
    budget); a worker process (~60 MB, at a lower priority than the server: `PARSER_NICE`)
    expands one at a time.

    Thread-safety: `parse` and `close` run on one event loop.
    """

    def __init__(self, bounds: BodyBounds, parsers: int = PARSERS):
        self.bounds = bounds
        self._n = parsers
        self._parsers = asyncio.Semaphore(parsers)
        self._pool: Optional[ProcessPoolExecutor] = None

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawned, not forked: the server has threads (decode, pool) a fork would copy
            self._pool = ProcessPoolExecutor(self._n, mp_context=mp.get_context("spawn"),
                                             initializer=_worker_setup)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (the app's shutdown)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def parse(self, request, model):
        """The request's body as ``model`` (see `parse_body`)."""
        raw = await request.body()
        if len(raw) <= INLINE_BYTES:
            return parse_body(raw, model, self.bounds)
        loop = asyncio.get_running_loop()
        async with self._parsers:
            try:
                outcome = await loop.run_in_executor(self._workers(), _parse_outcome, raw,
                                                     model, self.bounds)
            except BrokenProcessPool:      # a worker died (killed): a new pool next time
                self.close()
                raise APIError(503, "the request parser failed; retry", code="unavailable")
        if outcome[0] == "ok":
            return outcome[1]
        if outcome[0] == "invalid":
            raise RequestValidationError(outcome[1])
        _, status, message, param, code = outcome
        if status == 400 and param is not None:
            raise FieldError(param, message, code=code)
        raise APIError(status, message, param=param, code=code)
