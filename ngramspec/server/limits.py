"""Bounds on what one client can make the server hold: body size, read time, prompt text.

* `RequestLimits`, an ASGI middleware: a body larger than ``max_body_size`` is a 413 before any
  of it is parsed (at once from ``Content-Length``, else as soon as the bytes received pass the
  limit), a body that has not fully arrived ``read_timeout`` seconds after its headers is a
  408, and a body that would pass the bytes all requests may hold at once is a 503. The body is
  read whole before the app sees it (the JSON parser needs all of it anyway).
* `HeaderTimeoutH11Protocol`, uvicorn's h11 protocol with a deadline on request headers:
  uvicorn only times out idle keep-alive connections, so a client sending half a header line
  would hold its connection (and a file descriptor) forever.
* `PromptTextBound`: a text prompt's length in UTF-8 bytes against the slot context, checked
  before tokenizing (a 50 MB prompt would otherwise cost a minute of tokenizing and 1.5 GB).

Notes
-----
Thread-safety: the middleware and the protocol run on the event loop; `PromptTextBound` is
immutable.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ngramspec.server.errors import FieldError, error_response

#: Default ``--max-body-size``: 8 MiB (a slot context of 128k tokens as text or as token ids
#: needs about 1 MiB).
MAX_BODY_SIZE = 8 << 20
#: Default ``--read-timeout``, seconds for a request's headers, and for its body.
READ_TIMEOUT_S = 30.0
#: Bodies of the largest size the server holds at once (read, or being answered), all requests
#: together; a body that would pass this is answered 503 (many large bodies cannot add up).
BODY_BUDGET_BODIES = 16


class RequestLimits:
    """ASGI middleware bounding a request body's size and the time it takes to arrive.

    Parameters
    ----------
    app : ASGI application
    max_body_size : int
        Bytes; a larger body is answered 413 without being parsed.
    read_timeout : float
        Seconds from the headers to the body's last byte; a slower body is answered 408.
    budget : int, optional
        Body bytes held at once by all requests together (read so far, or read and not yet
        answered); a body that would pass it is answered 503 ``server_busy`` at once. Default
        `BODY_BUDGET_BODIES` bodies of ``max_body_size``.

    Notes
    -----
    Memory: at most ``budget`` bytes of bodies in all.

    Thread-safety: runs on the event loop; the budget's count is the loop's.
    """

    def __init__(self, app, max_body_size: int = MAX_BODY_SIZE,
                 read_timeout: float = READ_TIMEOUT_S, budget: Optional[int] = None):
        self.app = app
        self.max_body_size = max_body_size
        self.read_timeout = read_timeout
        self.budget = BODY_BUDGET_BODIES * max_body_size if budget is None else budget
        self.held = 0             # body bytes held by the requests in flight

    def _too_large(self, what: str, drained: bool):
        # "Connection: close" unless the rest of the body was read: the connection is not
        # reusable then.
        return error_response(413, f"the request body ({what}) is larger than the server's "
                                   f"limit of {self.max_body_size} bytes (--max-body-size)",
                              code="request_too_large",
                              headers=None if drained else {"Connection": "close"})

    async def _drain(self, receive, deadline: float) -> bool:
        """Read and drop the rest of a body that passed the limit (at most as much again,
        before the deadline), so that a client still writing it reads the 413 instead of a
        reset connection. True when the whole body was read."""
        loop = asyncio.get_running_loop()
        dropped = 0
        while dropped <= self.max_body_size:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return False
            if message["type"] == "http.disconnect":
                return False
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_size:
            # refused before reading any of it
            await self._too_large(f"{int(declared)} bytes", False)(scope, receive, send)
            return
        held = [0]                # this request's share of `held`, released at its end
        try:
            body = await self._read(scope, receive, send, held)
            if body is None:
                return
            whole = {"type": "http.request", "body": body, "more_body": False}
            body = None

            async def replay():
                # The body once, then the client's own messages (a disconnect).
                nonlocal whole
                if whole is not None:
                    message, whole = whole, None
                    return message
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.held -= held[0]

    def _hold(self, n: int, held: list) -> bool:
        """Count ``n`` more body bytes of a request against the budget; False (nothing
        counted) when they would pass it."""
        if self.held + n > self.budget:
            return False
        self.held += n
        held[0] += n
        return True

    async def _read(self, scope, receive, send, held: list) -> Optional[bytes]:
        """The whole body (its bytes counted in ``held``); None when an error was answered
        instead (408, 413, 503) or the client left."""
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                resp = error_response(408, f"the request body did not arrive within "
                                           f"{self.read_timeout:g} s (--read-timeout)",
                                      code="request_timeout", headers={"Connection": "close"})
                await resp(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_size:
                chunks = None
                drained = not message.get("more_body", False) or \
                    await self._drain(receive, deadline)
                await self._too_large(f"more than {self.max_body_size} bytes", drained)(
                    scope, receive, send)
                return None
            if not self._hold(len(body), held):
                chunks = None
                await error_response(503, "the server holds too many request bodies at once; "
                                          "retry later", code="server_busy",
                                     headers={"Connection": "close"})(scope, receive, send)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a connection whose request line and headers are not complete
    ``header_timeout`` seconds after they began (the connection opened, or the first bytes of
    a next request arrived on a kept-alive one) is closed.

    An idle kept-alive connection is left to uvicorn's own ``timeout_keep_alive``. Set
    ``header_timeout`` on a subclass (`with_header_timeout`); uvicorn builds one protocol object
    per connection.

    Notes
    -----
    Memory: one timer per connection; h11 bounds the headers themselves (16 KiB).

    Thread-safety: runs on the event loop, as uvicorn's protocol does.
    """

    header_timeout: float = READ_TIMEOUT_S
    _header_timer: Optional[asyncio.TimerHandle] = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type:
        """A subclass with its own ``header_timeout`` (uvicorn's ``http=`` setting)."""
        return type(cls.__name__, (cls,), {"header_timeout": float(seconds)})

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        # Still waiting for (the rest of) a request line and its headers: drop the connection.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()           # a next request begins on a kept-alive connection
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm()            # idle now: uvicorn's keep-alive timeout applies
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class PromptTextBound:
    """A text prompt's length checked cheaply against a slot's context.

    A token stands for at most ``max_token_bytes`` bytes of text
    (the backend's ``max_token_bytes``), so a text of more than
    ``max_token_bytes * (n_ctx_slot - 1)`` UTF-8 bytes has more tokens than a slot can take
    (one cell is kept for the first output token): it is refused without tokenizing it.

    Parameters
    ----------
    max_token_bytes : int or None
        None: no bound holds for this tokenizer; only the encoding is checked.
    n_ctx_slot : int

    Notes
    -----
    Memory: none kept; a check encodes the text once (its UTF-8 size, freed at once).

    Thread-safety: immutable.
    """

    def __init__(self, max_token_bytes: Optional[int], n_ctx_slot: int):
        self.token_bytes = max_token_bytes
        self.n_tokens = max(0, n_ctx_slot - 1)
        self.max_bytes = None if max_token_bytes is None else max_token_bytes * self.n_tokens

    def check(self, text: str, field: str) -> None:
        """Raise `FieldError` naming ``field`` if ``text`` is not valid Unicode (an unpaired
        surrogate, which JSON's ``\\ud800`` escapes can carry) or certainly too long."""
        try:
            n = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise FieldError(field, f"{field}: character {exc.start} is an unpaired surrogate "
                                    f"(U+{ord(text[exc.start]):04X}): not valid Unicode "
                                    f"text") from None
        if self.max_bytes is not None and n > self.max_bytes:
            raise FieldError(field, f"{field}: the text ({n} bytes) cannot fit a slot's context "
                                    f"of {self.n_tokens} prompt tokens: allowed at most "
                                    f"{self.max_bytes} bytes (a token stands for at most "
                                    f"{self.token_bytes} bytes)", code="context_length_exceeded")
