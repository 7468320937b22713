"""Server-sent events of a streamed completion or chat completion (OpenAI's chunk format).

A stream sends the text as it is generated, then a closing chunk with the finish reason and
llama-server's timings, the usage when the client asked for it, and ``data: [DONE]``. A failure
after the response has started is reported in the stream (an error event), as OpenAI does.

Notes
-----
Thread-safety: each stream is one async generator on the event loop.
"""
from __future__ import annotations

import json
import logging
import time

from ngramspec.server import schemas
from ngramspec.server.errors import error_body
from ngramspec.server.reasoning import ReasoningSplitter
from ngramspec.server.results import (cancelled_message, completion_timings,
                                      completion_usage)
from ngramspec.stop_rules import CANCELLED, openai_finish_reason

log = logging.getLogger("ngramspec.server")


def sse(model) -> str:
    """One ``data:`` event of a pydantic model."""
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


async def _events(state, handle, n_prompt, include_usage, envelope, choices, opening=(),
                  predicted=False):
    """SSE events of a streamed request: ``envelope(choices, **extra)`` builds one chunk,
    ``choices(text, finish)`` the choices of new text, each sent in a chunk of its own
    (``text`` None: the closing ones, the last of which carries ``finish``; none: all held
    back, a possible reasoning tag)."""
    for chunk in opening:
        yield sse(chunk)
    try:
        async for piece in state.bridge.chunks(handle):
            if piece is None:
                yield ": keep-alive\n\n"
            elif piece.text:
                for c in choices(piece.text, None):
                    yield sse(envelope([c]))
        done = await state.bridge.result(handle)
        state.metrics.observe_completion(done)
    except Exception as exc:  # the response has started: report in the stream, as OpenAI
        log.exception("stream failed")
        body = error_body(f"generation failed: {type(exc).__name__}: {exc}",
                          type="server_error")
        yield f"data: {json.dumps(body)}\n\n"
        return
    if done.finish_reason == CANCELLED:  # the server is stopping (or the client left)
        body = error_body(cancelled_message(done), type="unavailable_error",
                          code="unavailable")
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
        return
    *held, last = choices(None, openai_finish_reason(done.finish_reason))
    for c in held:
        yield sse(envelope([c]))
    yield sse(envelope([last], timings=completion_timings(done, state.hide_cache_n)))
    if include_usage:
        yield sse(envelope([], usage=completion_usage(done, n_prompt, predicted)))
    yield "data: [DONE]\n\n"


def text_stream(state, handle, rid, n_prompt, include_usage, name, predicted):
    """The events of a streamed ``/v1/completions`` request."""
    created = int(time.time())
    return _events(
        state, handle, n_prompt, include_usage,
        lambda choices, **extra: schemas.CompletionResponse(
            id=rid, created=created, model=name, choices=choices, **extra),
        lambda text, finish: [schemas.CompletionChoice(text=text or "", finish_reason=finish)],
        predicted=predicted)


def chat_stream(state, handle, rid, n_prompt, include_usage, name, predicted):
    """The events of a streamed ``/v1/chat/completions`` request: a first chunk with the
    assistant's role, then content deltas; with ``deepseek``, ``reasoning_content`` deltas
    too, never in the same chunk as content (a piece that crosses ``</think>`` is sent as two
    chunks, the reasoning first)."""
    created = int(time.time())
    splitter = ReasoningSplitter() if state.reasoning_format == "deepseek" else None

    def envelope(choices, **extra):
        return schemas.ChatCompletionChunk(id=rid, created=created, model=name,
                                           choices=choices, **extra)

    def choices(text, finish):
        reasoning = None
        if splitter is not None:
            # the closing call releases what the splitter still holds
            reasoning, text = splitter.push(text) if text is not None else splitter.finish()
        deltas = [d for d in (schemas.ChatDelta(reasoning_content=reasoning or None),
                              schemas.ChatDelta(content=text or None))
                  if d.reasoning_content is not None or d.content is not None]
        if finish is not None and not deltas:
            deltas = [schemas.ChatDelta()]
        return [schemas.ChatChunkChoice(delta=d, finish_reason=finish if i == len(deltas) - 1
                                        else None) for i, d in enumerate(deltas)]

    opening = schemas.ChatChunkChoice(delta=schemas.ChatDelta(role="assistant", content=""))
    return _events(state, handle, n_prompt, include_usage, envelope, choices,
                   opening=[envelope([opening])], predicted=predicted)
