"""What every route of the app shares: the served schedulers, the bridge to them, the metrics,
the settings of `ngramspec.server.app.create_app`; and the API-key dependency.

One `ServerState` is built per app and kept on ``app.state.server``; a route reads it with
``server_state(request)``.

Notes
-----
Thread-safety: the state is read-only after `create_app` (the bridge, the metrics and the
schedulers are thread-safe themselves); ``app.state.ready`` is set by the lifespan on the event
loop.
"""
from __future__ import annotations

import hmac
import time
from typing import Optional

from fastapi import Request

from ngramspec.llama.tokenizer import max_token_bytes
from ngramspec.server.bridge import SchedulerBridge
from ngramspec.server.errors import APIError
from ngramspec.server.limits import PromptTextBound
from ngramspec.server.metrics import ServerMetrics


class ServerState:
    """The app's shared objects and settings (see `create_app` for the parameters).

    Attributes
    ----------
    scheduler : Scheduler
        The main model's.
    others : dict of str to Scheduler
        The other served models by id (``serve -md``).
    model_name : str
    api_keys : list of bytes
    defaults : dict
        Sampling defaults for fields a request leaves out.
    n_predict : int
        ``max_tokens`` of a request that gives none.
    created : int
        Unix time the app was built (``/v1/models``).
    n_slots, n_ctx_slot, n_vocab : int
        The main scheduler's.
    special_in_content : bool
    reasoning_format : str
    bridge : SchedulerBridge
    metrics : ServerMetrics
    text_bound : PromptTextBound

    Notes
    -----
    Memory: the bridge's thread pool and the metrics' registry (a few dozen series).

    Thread-safety: read-only once built.
    """

    def __init__(self, scheduler, *, model_name: str, api_keys, defaults: dict,
                 n_predict: int, others: dict, special_in_content: bool,
                 reasoning_format: str):
        self.scheduler, self.others = scheduler, dict(others)
        self.model_name = model_name
        self.api_keys = [k.encode("utf-8") for k in api_keys]
        self.defaults = dict(defaults)
        self.n_predict = n_predict
        self.created = int(time.time())
        self.n_slots = scheduler.n_slots
        self.n_ctx_slot = scheduler.n_ctx_slot
        self.n_vocab = scheduler.n_vocab
        self.special_in_content = special_in_content
        self.reasoning_format = reasoning_format
        served = self.served()
        self.bridge = SchedulerBridge(scheduler, sum(s.n_slots + s.queue_size for s in served))
        self.metrics = ServerMetrics(scheduler, model_name)
        self.text_bound = PromptTextBound(max_token_bytes(scheduler.llm), self.n_ctx_slot)

    def served(self) -> list:
        """Every scheduler the app serves, the main one first."""
        return [self.scheduler] + list(self.others.values())

    def scheduler_for(self, model: Optional[str]):
        """``(model id, scheduler)`` a request's ``model`` field picks: one of `others` by id,
        else the main model."""
        if model in self.others:
            return model, self.others[model]
        return self.model_name, self.scheduler


def server_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    return request.app.state.server


async def require_key(request: Request) -> None:
    """FastAPI dependency: ``Authorization: Bearer KEY`` (or ``X-Api-Key: KEY``) when the app
    has keys; compared with every key in constant time.

    Raises
    ------
    APIError
        401, ``invalid_api_key``.
    """
    keys = server_state(request).api_keys
    if not keys:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    token_b = token.strip().encode("utf-8")
    # Compare against every key (no early exit) so timing tells nothing about the keys.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token_b, key)
    if not ok:
        raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                       code="invalid_api_key")
