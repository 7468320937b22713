"""The scheduler seen from the event loop: submit, stream, wait, cancel on disconnect.

The scheduler's calls block (``RequestHandle.result()``, iterating a handle); they run on a
thread pool of the bridge's own, sized for every request the scheduler can hold at once (its
slots plus its bounded queue), so that waiting requests never starve each other or Starlette's
pool. The event loop only waits on futures.

A request whose client goes away is cancelled on the scheduler (which frees its slot within
one step): streams notice it when Starlette cancels the response (the ASGI disconnect
message) or when a write fails; non-streamed requests poll ``Request.is_disconnected()``
while they wait.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

from starlette.requests import Request

from ngramspec.request import QueueFull
from ngramspec.server.errors import APIError

# How often a waiting request checks that its client is still there, and how long a stream
# stays silent before it sends an SSE comment (a write is what reveals a closed connection).
POLL_S = 0.25
KEEPALIVE_S = 5.0
_END = object()


class SchedulerBridge:
    """Runs requests on a backend (`ngramspec.backend.Backend`) from coroutines.

    Parameters
    ----------
    scheduler : ngramspec.backend.Backend
        Started by the caller (or by the app's lifespan).
    max_pending : int
        Requests the scheduler can hold at once (slots + queue): the size of the thread pool.

    Notes
    -----
    Memory: one thread per request in flight (at most ``max_pending``), idle threads exit.

    Thread-safety: the coroutines may run concurrently on one event loop; the scheduler's
    ``submit`` and ``RequestHandle.cancel`` are thread-safe.
    """

    def __init__(self, scheduler, max_pending: int):
        self.scheduler = scheduler
        self._pool = ThreadPoolExecutor(max_workers=max(4, max_pending + 4),
                                        thread_name_prefix="ngramspec-request")

    def close(self) -> None:
        """Stop the pool without waiting; queued calls are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args):
        """``fn(*args)`` on the bridge's pool.

        Parameters
        ----------
        fn : callable
        *args
            Its arguments.

        Returns
        -------
        object
            What `fn` returns (its exception propagates).
        """
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def submit(self, prompt_tokens, sampling, speculation, *, prediction=None,
                     scheduler=None, cache_owner=None, cache_prompt: bool = True):
        """Submit a request to the scheduler.

        Parameters
        ----------
        prompt_tokens : sequence of int
        sampling : SamplingParams
        speculation : SpeculationParams
        prediction : sequence of int, optional
            Predicted Outputs' tokens (the scheduler's ``prediction``).
        scheduler : Backend, optional
            Another scheduler served by the same app (a second model); default the bridge's.
        cache_owner : str, optional
        cache_prompt : bool
            The scheduler's prompt-cache arguments (whose cached prompts the request may
            reuse; none when False).

        Returns
        -------
        RequestHandle

        Raises
        ------
        APIError
            503 when the queue is full or the scheduler is stopped. Parameter errors propagate as
            the scheduler raises them.
        """
        try:
            target = self.scheduler if scheduler is None else scheduler
            return await self.run(lambda: target.submit(
                prompt_tokens, sampling, speculation,
                prediction=prediction, cache_owner=cache_owner, cache_prompt=cache_prompt))
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later",
                           code="queue_full") from None
        except RuntimeError as exc:  # stopped (shutting down)
            raise APIError(503, f"the server is shutting down: {exc}",
                           code="unavailable") from None

    async def result(self, handle, request: Optional[Request] = None):
        """The request's `Completion`; cancels it if the client disconnects first.

        Parameters
        ----------
        handle : RequestHandle
        request : starlette.requests.Request, optional
            The HTTP request whose disconnect cancels the generation.

        Returns
        -------
        Completion
        """
        fut = asyncio.ensure_future(self.run(handle.result))
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=POLL_S)
                if done:
                    return fut.result()
                if request is not None and await request.is_disconnected():
                    handle.cancel()
                    return await fut
        finally:
            if not handle.done:
                handle.cancel()

    async def chunks(self, handle) -> AsyncIterator:
        """The handle's chunks as they are emitted; ``None`` items are keep-alive ticks.

        Cancelling the consumer (a client disconnect) cancels the request.

        Parameters
        ----------
        handle : RequestHandle

        Yields
        ------
        chunk or None
        """
        it = iter(handle)
        try:
            while True:
                fut = asyncio.ensure_future(self.run(next, it, _END))
                while True:
                    done, _ = await asyncio.wait({fut}, timeout=KEEPALIVE_S)
                    if done:
                        break
                    yield None
                chunk = fut.result()
                if chunk is _END:
                    return
                yield chunk
        finally:
            if not handle.done:
                handle.cancel()
