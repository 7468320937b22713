"""A graceful stop that answers every request: uvicorn's server, draining the scheduler first.

On SIGTERM uvicorn stops accepting connections, waits ``timeout_graceful_shutdown`` seconds for
the running requests, then cancels their tasks: a non-streamed request gets a bare text ``500
Internal Server Error``, a stream is cut mid-chunk, and the log fills with ``CancelledError``
tracebacks. `DrainingServer` cancels the scheduler's requests itself when the grace period
ends (the app's ``state.drain``); each handler then answers normally (an OpenAI-style 503, or a
stream's error event and ``data: [DONE]``) within the few seconds of `DRAIN_S` that uvicorn is
given on top.

Notes
-----
Thread-safety: runs on uvicorn's event loop.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("ngramspec.server")

#: Seconds uvicorn waits, after the grace period, for the drained requests' answers.
DRAIN_S = 3.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` that drains the app's requests at the end of the grace period.

    Parameters
    ----------
    config : uvicorn.Config
        Its ``timeout_graceful_shutdown`` should be ``grace + DRAIN_S``.
    drain : coroutine function
        Ends every running and queued request (the app's ``state.drain``).
    grace : float
        Seconds running requests may finish after the stop signal.

    Notes
    -----
    Memory: one task during the shutdown.

    Thread-safety: runs on uvicorn's event loop; `drain` runs the scheduler's blocking stop on
    the app's thread pool.
    """

    def __init__(self, config, drain, grace: float):
        super().__init__(config)
        self._drain, self._grace = drain, grace

    async def _drain_later(self) -> None:
        await asyncio.sleep(self._grace)
        log.info("grace period over: cancelling the requests still running")
        try:
            await self._drain()
        except Exception:
            log.exception("draining the scheduler failed")

    async def shutdown(self, sockets=None) -> None:
        task = asyncio.ensure_future(self._drain_later())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()
