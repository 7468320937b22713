"""The informational endpoints: ``/health``, ``/v1/models``, ``/metrics`` (and
``/openapi.json`` behind the key when the app has one).

Notes
-----
Thread-safety: the handlers run on the event loop and only read.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ngramspec.server import schemas
from ngramspec.server.errors import error_response
from ngramspec.server.state import server_state

# With a key, every route but /health and /v1/models needs it (`ngramspec.server.auth.KeyCheck`).
router = APIRouter()
# With a key, the schema is served behind it and the doc pages are off (`create_app`).
keyed_schema = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not request.app.state.ready:
        return error_response(503, "the server is starting or shutting down",
                              code="unavailable")
    state = server_state(request)
    # every served model's slots (serve -md: the draft model's requests too), and each apart
    per = {name: _slot_counts(s.stats()) for name, s in state.named()}
    out = {"status": "ok", **{k: sum(c[k] for c in per.values())
                              for k in ("slots_idle", "slots_processing", "queue_length")}}
    if len(per) > 1:
        out["models"] = per
    return out


def _slot_counts(st: dict) -> dict:
    return {"slots_idle": st["n_slots"] - st["slots_busy"], "slots_processing": st["slots_busy"],
            "queue_length": st["queue_length"]}


@router.get("/v1/models", response_model=schemas.ModelList)
async def models(request: Request):
    state = server_state(request)
    cards = [schemas.ModelCard(id=name, created=state.created, meta={
        "n_slots": s.n_slots, "n_ctx_slot": s.n_ctx_slot, "spec_types": list(s.spec_types),
        "policy": s.policy}) for name, s in state.named()]
    return schemas.ModelList(data=cards)


@router.get("/metrics")
async def prometheus(request: Request):
    metrics = server_state(request).metrics
    return PlainTextResponse(metrics.render(), media_type=metrics.content_type)


@keyed_schema.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request):
    return JSONResponse(request.app.openapi())
