"""The generation endpoints: ``/v1/completions`` and ``/v1/chat/completions``.

Both tokenize the request on the app's thread pool, build the scheduler's parameters
(`ngramspec.server.fields`), submit, and answer with the whole completion or a stream of
events (`ngramspec.server.streaming`).

Notes
-----
Thread-safety: the handlers run on the event loop; blocking calls (tokenizing, submitting,
waiting) go through the app's `SchedulerBridge`.
"""
from __future__ import annotations

import time
import uuid
from typing import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ngramspec.server import schemas
from ngramspec.server.errors import APIError, FieldError
from ngramspec.server.fields import request_errors, request_params
from ngramspec.server.reasoning import split_reasoning
from ngramspec.server.results import (cancelled_message, completion_timings,
                                      completion_usage)
from ngramspec.server.state import server_state
from ngramspec.server.streaming import chat_stream, text_stream
from ngramspec.stop_rules import CANCELLED, openai_finish_reason

# The API key is checked before the body is read (`ngramspec.server.auth.KeyCheck`).
router = APIRouter()


def _body_doc(model) -> dict:
    """The route's request body in the OpenAPI schema (the body is parsed by
    `ngramspec.server.body`, not by a FastAPI parameter); its nested models go to the schema's
    components (`ngramspec.server.app`)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    BODY_DEFS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


#: Models the request bodies' schemas refer to, for the OpenAPI components.
BODY_DEFS: dict = {}


@router.post("/v1/completions", response_model=schemas.CompletionResponse,
             openapi_extra=_body_doc(schemas.CompletionRequest))
async def completions(request: Request):
    state = server_state(request)
    body = await state.bodies.parse(request, schemas.CompletionRequest)
    prompt = body.prompt
    if isinstance(prompt, str):
        state.text_bound.check(prompt, "prompt")
        tokens = await state.bridge.run(state.scheduler.tokenize_prompt, prompt)
    else:
        tokens = prompt
    return await _generate(state, body, [int(t) for t in tokens], "prompt", request, chat=False)


@router.post("/v1/chat/completions", response_model=schemas.ChatCompletionResponse,
             openapi_extra=_body_doc(schemas.ChatCompletionRequest))
async def chat_completions(request: Request):
    state = server_state(request)
    body = await state.bodies.parse(request, schemas.ChatCompletionRequest)
    backend = state.scheduler
    parts = await state.bridge.run(_chat_parts, backend, body.template_messages(),
                                   state.special_in_content)
    state.text_bound.check("".join(text for text, _ in parts), "messages")
    tokens = await state.bridge.run(backend.tokenize_parts, parts)
    return await _generate(state, body, [int(t) for t in tokens], "messages", request, chat=True)


async def _generate(state, body, tokens: Sequence[int], prompt_field: str, request: Request,
                    chat: bool):
    sampling, speculation = request_params(body, state, prompt_field)
    name, scheduler = state.scheduler_for(body.model)
    prediction = None
    if body.prediction is not None:
        text = body.prediction.text()
        state.text_bound.check(text, "prediction")   # unpaired surrogates, a certain overflow
        prediction = await state.bridge.run(state.scheduler.tokenize_output, text)
    with request_errors(prompt_field):
        handle = await state.bridge.submit(tokens, sampling, speculation, prediction=prediction,
                                           scheduler=scheduler,
                                           cache_owner=state.cache_owner(request),
                                           cache_prompt=body.cache_prompt)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    predicted = prediction is not None
    if body.stream:
        stream = chat_stream if chat else text_stream
        return StreamingResponse(stream(state, handle, rid, len(tokens), body.include_usage(),
                                        name, predicted),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    done = await state.bridge.result(handle, request)
    state.metrics.observe_completion(done)
    if done.finish_reason == CANCELLED:  # the client left (no one reads this) or a stop
        raise APIError(503, cancelled_message(done), code="unavailable")
    return _response(state, done, rid, name, chat, len(tokens), predicted)


def _response(state, done, rid: str, name: str, chat: bool, n_prompt: int, predicted: bool):
    """The whole (non-streamed) completion or chat completion of a finished request."""
    finish = openai_finish_reason(done.finish_reason)
    usage = completion_usage(done, n_prompt, predicted)
    timings = completion_timings(done, state.hide_cache_n)
    if chat:
        reasoning, content = None, done.text
        if state.reasoning_format == "deepseek":
            reasoning, content = split_reasoning(done.text)
        message = schemas.AssistantMessage(content=content, reasoning_content=reasoning)
        return schemas.ChatCompletionResponse(
            id=rid, created=int(time.time()), model=name,
            choices=[schemas.ChatChoice(message=message, finish_reason=finish)],
            usage=usage, timings=timings)
    return schemas.CompletionResponse(
        id=rid, created=int(time.time()), model=name,
        choices=[schemas.CompletionChoice(text=done.text, finish_reason=finish)],
        usage=usage, timings=timings)


def _chat_parts(backend, messages, special_in_content):
    try:
        return backend.render_chat_parts(messages, special_in_content)
    except ValueError as exc:  # no chat template in the model, or the template rejects them
        raise FieldError("messages", str(exc)) from None
