"""The FastAPI application: OpenAI's completion endpoints on the batched scheduler.

``create_app(scheduler, ...)`` builds an app that knows only the scheduler's interface
(``submit`` / ``RequestHandle`` / ``stats`` / ``llm`` for the tokenizer and chat template); the
command ``ngramspec serve`` (`ngramspec.cli.serve`) loads the model, builds the scheduler and
runs the app under uvicorn.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from typing import Optional, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ngramspec.llama.params import SamplingParams, SpeculationParams
from ngramspec.llama.tokenizer import (max_token_bytes, render_chat_parts, tokenize_output,
                                       tokenize_parts, tokenize_prompt)
from ngramspec.server import schemas
from ngramspec.server.auth import parse_api_keys
from ngramspec.server.bridge import SchedulerBridge
from ngramspec.server.errors import (APIError, FieldError, error_body, error_response,
                                    install_handlers)
from ngramspec.server.limits import (MAX_BODY_SIZE, READ_TIMEOUT_S, PromptTextBound,
                                     RequestLimits)
from ngramspec.server.metrics import HTTPCountMiddleware, ServerMetrics
from ngramspec.server.reasoning import REASONING_FORMATS, ReasoningSplitter, split_reasoning

log = logging.getLogger("ngramspec.server")

# Request fields -> SamplingParams fields (same names, by design of both APIs).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
                   "repeat_last_n", "frequency_penalty", "presence_penalty", "ignore_eos")
# SpeculationParams fields -> request field names.
SPECULATION_FIELDS = {"enabled": "speculative.enabled", "types": "speculative.type",
                      "n_max": "speculative.n_max", "n_min": "speculative.n_min",
                      "p_min": "speculative.p_min", "policy": "speculative.policy"}
# Completion.finish_reason -> OpenAI's (a full context is a length limit to the client).
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


@contextlib.contextmanager
def _errors_as_400(prompt_field: str, sampling_names: dict):
    """Turn the scheduler's parameter errors (ValueError/TypeError naming the field) into a 400
    naming the request's field: ``speculation.n_max`` -> ``speculative.n_max``,
    ``prompt_tokens`` -> ``prompt``/``messages``, a sampling field -> its request name."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        msg = " ".join(str(exc).split())
        m = re.match(r"speculation\.(\w+)(.*)$", msg)
        if m:
            param = SPECULATION_FIELDS.get(m.group(1), "speculative")
            raise FieldError(param, param + m.group(2)) from None
        if msg.startswith("policy "):
            raise FieldError("speculative.policy", msg) from None
        if msg.startswith("prompt_tokens"):
            code = "context_length_exceeded" if "does not fit" in msg else None
            raise FieldError(prompt_field, prompt_field + msg[len("prompt_tokens"):],
                             code=code) from None
        name = _named_field(msg, sampling_names)
        if name is None:
            raise FieldError("body", msg) from None
        param = sampling_names[name]
        raise FieldError(param, msg if name == param else f"{param}: {msg}") from None


def _named_field(message: str, candidates) -> Optional[str]:
    """The candidate field named earliest in an error message, if any."""
    best = None
    for name in candidates:
        m = re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), name)
    return best[1] if best else None


class _Config:
    """What the handlers need besides the scheduler (plain data)."""

    def __init__(self, scheduler, model_name, api_keys, defaults, n_predict):
        self.model_name = model_name
        self.api_keys = [k.encode("utf-8") for k in api_keys]
        self.defaults = dict(defaults)
        self.n_predict = n_predict
        self.created = int(time.time())
        self.n_slots = scheduler.n_slots
        self.n_ctx_slot = scheduler.n_ctx_slot
        self.n_vocab = scheduler.n_vocab


def create_app(scheduler, *, model_name: str = "ngramspec", api_key: Optional[str] = None,
               defaults: Optional[dict] = None, n_predict: int = -1,
               manage_scheduler: bool = True, stop_timeout: float = 5.0,
               max_body_size: int = MAX_BODY_SIZE, read_timeout: float = READ_TIMEOUT_S,
               special_in_content: bool = True, reasoning_format: str = "none",
               models: Optional[dict] = None) -> FastAPI:
    """An OpenAI-compatible FastAPI app serving ``scheduler``.

    Parameters
    ----------
    scheduler : ngramspec.llama.scheduler.Scheduler
        The batched engine; its ``llm`` provides the tokenizer and the chat template.
    model_name : str
        The id listed by ``/v1/models`` and echoed in responses (a request's ``model`` field is
        not checked unless it names one of `models`, as llama-server serves one model).
    api_key : str, optional
        When given, every endpoint but ``/health`` and ``/v1/models`` needs
        ``Authorization: Bearer KEY`` (or ``X-Api-Key: KEY``); compared in constant time.
        Several keys: a comma list. ``/openapi.json`` needs the key too, and the ``/docs`` and
        ``/redoc`` pages are off (a browser would fetch the schema without the key). An empty
        or blank key raises ValueError (`ngramspec.server.auth.parse_api_keys`).
    defaults : dict, optional
        Sampling defaults for fields a request leaves out (e.g. ``{"temperature": 0.8}``,
        llama-server's ``--temp``); the scheduler's `SamplingParams` defaults otherwise.
    n_predict : int
        ``max_tokens`` of a request that gives none; ``-1`` = until EOS or a full slot context.
    manage_scheduler : bool
        Start the scheduler with the app and stop it (cancelling what still runs) at shutdown.
    stop_timeout : float
        Seconds the shutdown waits for the scheduler's decode thread.
    max_body_size : int
        Largest request body in bytes; a larger one is a 413 before it is parsed.
    read_timeout : float
        Seconds a request's body may take to arrive after its headers; then a 408.
    special_in_content : bool
        Parse special-token text (``<|im_start|>``) in chat messages' content, as llama-server
        does: a message can then forge turns of other roles. False tokenizes each message's
        content as plain text (`ngramspec.llama.tokenizer.render_chat_parts`).
    reasoning_format : "none" or "deepseek"
        llama-server's ``--reasoning-format``: ``deepseek`` returns a chat output's leading
        ``<think>...</think>`` block as ``message.reasoning_content`` (`ngramspec.server.reasoning`).
    models : dict of str to Scheduler, optional
        More models served beside `scheduler`, by id (``serve -md``: the draft model on its own,
        in its own context): a request whose ``model`` names one is generated by it; any other
        ``model`` gets `scheduler`. Listed by ``/v1/models``; started and stopped with the app.

    Returns
    -------
    fastapi.FastAPI

    Notes
    -----
    Memory: besides the scheduler, one thread per request in flight (`SchedulerBridge`) and a
    Prometheus registry of a few dozen series.

    Thread-safety: the handlers run on the event loop; every blocking scheduler call runs on
    the app's own thread pool (`SchedulerBridge`). Several apps may serve several schedulers in
    one process (each has its own registry and pool).
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ValueError(f"reasoning_format = {reasoning_format!r} is not allowed: "
                         f"{' or '.join(REASONING_FORMATS)}")
    others = dict(models or {})
    if model_name in others:
        raise ValueError(f"models: {model_name!r} names the main model too")
    keys = parse_api_keys(api_key)
    cfg = _Config(scheduler, model_name, keys, defaults or {}, n_predict)
    served = [scheduler] + list(others.values())
    bridge = SchedulerBridge(scheduler, sum(s.n_slots + s.queue_size for s in served))
    metrics = ServerMetrics(scheduler, model_name)
    text_bound = PromptTextBound(max_token_bytes(scheduler.llm), cfg.n_ctx_slot)

    async def drain():
        """End every running and queued request (each answers with what it has: an error
        event in a stream, a 503 otherwise) and stop the scheduler; once only matters."""
        if manage_scheduler:
            for s in served:
                await bridge.run(lambda s=s: s.stop(cancel=True, timeout=stop_timeout))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_scheduler:
            for s in served:
                s.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            # Requests still running after uvicorn's graceful period (when no DrainingServer
            # ended them already) are cancelled here.
            await drain()
            bridge.close()

    # With a key, the schema is served behind it (below) and the doc pages are off.
    docs = {} if not cfg.api_keys else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ngramspec", lifespan=lifespan,
                  description="OpenAI-compatible completions with draftless speculative "
                              "decoding under per-request control.", **docs)
    app.state.scheduler, app.state.metrics, app.state.bridge = scheduler, metrics, bridge
    app.state.ready = False
    app.state.drain = drain
    install_handlers(app)

    app.add_middleware(RequestLimits, max_body_size=max_body_size, read_timeout=read_timeout)
    app.add_middleware(HTTPCountMiddleware, metrics=metrics)

    async def require_key(request: Request):
        if not cfg.api_keys:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        token_b = token.strip().encode("utf-8")
        # Compare against every key (no early exit) so timing tells nothing about the keys.
        ok = False
        for key in cfg.api_keys:
            ok |= hmac.compare_digest(token_b, key)
        if not ok:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    # -- informational endpoints ---------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not app.state.ready:
            return error_response(503, "the server is starting or shutting down",
                                  code="unavailable")
        st = scheduler.stats()
        return {"status": "ok", "slots_idle": st["n_slots"] - st["slots_busy"],
                "slots_processing": st["slots_busy"], "queue_length": st["queue_length"]}

    @app.get("/v1/models", response_model=schemas.ModelList)
    async def models():
        card = schemas.ModelCard(id=cfg.model_name, created=cfg.created, meta={
            "n_slots": cfg.n_slots, "n_ctx_slot": cfg.n_ctx_slot,
            "spec_types": list(scheduler.spec_types), "policy": scheduler.policy})
        extra = [schemas.ModelCard(id=name, created=cfg.created, meta={
            "n_slots": s.n_slots, "n_ctx_slot": s.n_ctx_slot, "spec_types": list(s.spec_types),
            "policy": s.policy}) for name, s in others.items()]
        return schemas.ModelList(data=[card] + extra)

    @app.get("/metrics", dependencies=[Depends(require_key)])
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    if cfg.api_keys:
        @app.get("/openapi.json", dependencies=[Depends(require_key)], include_in_schema=False)
        async def openapi_schema():
            return JSONResponse(app.openapi())

    # -- generation ----------------------------------------------------------------------------

    @app.post("/v1/completions", dependencies=[Depends(require_key)],
              response_model=schemas.CompletionResponse)
    async def completions(body: schemas.CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, str):
            text_bound.check(prompt, "prompt")
            tokens = await bridge.run(tokenize_prompt, scheduler.llm, prompt)
        else:
            tokens = prompt
        return await _generate(body, [int(t) for t in tokens], "prompt", request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)],
              response_model=schemas.ChatCompletionResponse)
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request):
        parts = await bridge.run(_chat_parts, scheduler.llm, body.template_messages(),
                                 special_in_content)
        text_bound.check("".join(text for text, _ in parts), "messages")
        tokens = await bridge.run(tokenize_parts, scheduler.llm, parts)
        return await _generate(body, [int(t) for t in tokens], "messages", request, chat=True)

    async def _generate(body, tokens: Sequence[int], prompt_field: str, request: Request,
                        chat: bool):
        sampling, speculation = _request_params(body, tokens, prompt_field)
        name = body.model if body.model in others else cfg.model_name
        prediction = None
        if body.prediction is not None:
            text = body.prediction.text()
            text_bound.check(text, "prediction")      # unpaired surrogates, a certain overflow
            prediction = await bridge.run(tokenize_output, scheduler.llm, text)
        names = {n: n for n in SAMPLING_FIELDS + ("logit_bias", "prediction")}
        with _errors_as_400(prompt_field, names):
            handle = await bridge.submit(tokens, sampling, speculation, prediction=prediction,
                                         scheduler=others.get(name))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        predicted = prediction is not None
        if body.stream:
            stream = _chat_stream if chat else _text_stream
            return StreamingResponse(stream(handle, rid, len(tokens), body.include_usage(),
                                            name, predicted),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        done = await bridge.result(handle, request)
        metrics.observe_completion(done)
        if done.finish_reason == "cancelled":  # the client left (no one reads this) or a stop
            raise APIError(503, _cancelled_message(done), code="unavailable")
        finish = FINISH_REASONS.get(done.finish_reason, "stop")
        usage, timings = _usage(done, len(tokens), predicted), _timings(done)
        if chat:
            reasoning, content = None, done.text
            if reasoning_format == "deepseek":
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

    def _request_params(body, tokens, prompt_field):
        max_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) \
            is not None else "max_tokens"
        max_tokens = body.output_limit()
        if max_tokens is None:
            max_tokens = cfg.n_predict
        # The scheduler takes any count (-1: until the context is full); a count no slot can
        # ever reach is a client error here.
        if max_tokens > cfg.n_ctx_slot:
            raise FieldError(max_field, f"{max_tokens} is out of range: allowed 1 .. "
                                        f"{cfg.n_ctx_slot} (a slot's context), or -1 = until "
                                        "the context is full")
        values = dict(cfg.defaults)
        for name in SAMPLING_FIELDS:
            value = getattr(body, name)
            if value is not None:
                values[name] = value
        if body.logit_bias:
            values["logit_bias"] = body.token_bias(cfg.n_vocab)
        values["stop"] = body.stop_strings()
        values["max_tokens"] = max_tokens
        names = {**{n: n for n in values}, "max_tokens": max_field}
        with _errors_as_400(prompt_field, names):
            sampling = SamplingParams(**values)
        spec = body.speculative_options()
        if spec is None:
            return sampling, None
        with _errors_as_400(prompt_field, names):
            speculation = SpeculationParams(
                enabled=spec.enabled if spec.enabled is not None else True,
                types=spec.types(), n_max=spec.n_max, n_min=spec.n_min, p_min=spec.p_min,
                policy=spec.policy)
        return sampling, speculation

    def _usage(done, n_prompt, predicted=False):
        details = schemas.CompletionTokensDetails(
            accepted_prediction_tokens=done.accepted_prediction_tokens,
            rejected_prediction_tokens=done.rejected_prediction_tokens) if predicted else None
        return schemas.Usage(prompt_tokens=n_prompt, completion_tokens=done.predicted_n,
                             total_tokens=n_prompt + done.predicted_n,
                             completion_tokens_details=details)

    async def _stream(handle, n_prompt, include_usage, envelope, choice, opening=(),
                      predicted=False):
        """SSE events of a streamed request: ``envelope(choices, **extra)`` builds one chunk,
        ``choice(text, finish)`` one choice (``text`` None: the closing choice; a choice of None
        sends no chunk)."""
        for chunk in opening:
            yield _sse(chunk)
        try:
            async for piece in bridge.chunks(handle):
                if piece is None:
                    yield ": keep-alive\n\n"
                elif piece.text:
                    c = choice(piece.text, None)
                    if c is not None:      # None: all held back (a possible reasoning tag)
                        yield _sse(envelope([c]))
            done = await bridge.result(handle)
            metrics.observe_completion(done)
        except Exception as exc:  # the response has started: report in the stream, as OpenAI
            log.exception("stream failed")
            body = error_body(f"generation failed: {type(exc).__name__}: {exc}",
                              type="server_error")
            yield f"data: {json.dumps(body)}\n\n"
            return
        if done.finish_reason == "cancelled":  # the server is stopping (or the client left)
            body = error_body(_cancelled_message(done), type="unavailable_error",
                              code="unavailable")
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
        finish = FINISH_REASONS.get(done.finish_reason, "stop")
        yield _sse(envelope([choice(None, finish)], timings=_timings(done)))
        if include_usage:
            yield _sse(envelope([], usage=_usage(done, n_prompt, predicted)))
        yield "data: [DONE]\n\n"

    def _text_stream(handle, rid, n_prompt, include_usage, name, predicted):
        created = int(time.time())
        return _stream(
            handle, n_prompt, include_usage,
            lambda choices, **extra: schemas.CompletionResponse(
                id=rid, created=created, model=name, choices=choices, **extra),
            lambda text, finish: schemas.CompletionChoice(text=text or "", finish_reason=finish),
            predicted=predicted)

    def _chat_stream(handle, rid, n_prompt, include_usage, name, predicted):
        created = int(time.time())
        splitter = ReasoningSplitter() if reasoning_format == "deepseek" else None

        def envelope(choices, **extra):
            return schemas.ChatCompletionChunk(id=rid, created=created, model=name,
                                               choices=choices, **extra)

        def choice(text, finish, role=None):
            reasoning = None
            if splitter is not None and role is None:
                # the closing choice releases what the splitter still holds
                reasoning, text = splitter.push(text) if text is not None else splitter.finish()
                reasoning, text = reasoning or None, text or None
                if finish is None and reasoning is None and text is None:
                    return None
            return schemas.ChatChunkChoice(
                delta=schemas.ChatDelta(role=role, content=text, reasoning_content=reasoning),
                finish_reason=finish)

        return _stream(handle, n_prompt, include_usage, envelope, choice,
                       opening=[envelope([choice("", None, role="assistant")])],
                       predicted=predicted)

    return app


def _cancelled_message(done) -> str:
    return (f"the server is shutting down: the request was cancelled after "
            f"{done.predicted_n} tokens; retry later")


def _chat_parts(llm, messages, special_in_content):
    from jinja2 import TemplateError   # llama-cpp-python's dependency (the live extra)

    try:
        return render_chat_parts(llm, messages, special_in_content=special_in_content)
    except TemplateError as exc:
        raise FieldError("messages", f"the chat template rejects them: {exc}") from None
    except ValueError as exc:  # no chat template in the GGUF
        raise FieldError("messages", str(exc)) from None


def _timings(done) -> schemas.Timings:
    """llama-server's timings: ``prompt_n`` counts the prompt tokens decoded, ``cache_n`` those
    reused from the slot's KV cache."""
    def per_second(n, ms):
        return n / ms * 1e3 if ms > 0 else 0.0

    def per_token(n, ms):
        return ms / n if n > 0 else 0.0

    prompt_n = done.prompt_n - done.prompt_cached_n
    return schemas.Timings(
        cache_n=done.prompt_cached_n, prompt_n=prompt_n, prompt_ms=done.prompt_ms,
        prompt_per_token_ms=per_token(prompt_n, done.prompt_ms),
        prompt_per_second=per_second(prompt_n, done.prompt_ms),
        predicted_n=done.predicted_n, predicted_ms=done.predicted_ms,
        predicted_per_token_ms=per_token(done.predicted_n, done.predicted_ms),
        predicted_per_second=per_second(done.predicted_n, done.predicted_ms),
        draft_n=done.draft_n, draft_n_accepted=done.draft_n_accepted)


def _sse(model) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"
