"""What every route of the app shares: the served backends (`ngramspec.backend.Backend`), the
bridge to them, the metrics, the settings of `ngramspec.server.app.create_app`, the body parser,
whose prompt cache a request may reuse.

One `ServerState` is built per app and kept on ``app.state.server``; a route reads it with
``server_state(request)``.

Notes
-----
Thread-safety: the state is read-only after `create_app` (the bridge, the metrics and the
schedulers are thread-safe themselves); ``app.state.ready`` is set by the lifespan on the event
loop.
"""
from __future__ import annotations

import time
from typing import Optional

from fastapi import Request

from ngramspec.server.auth import cache_owner, request_key
from ngramspec.server.body import BodyBounds, BodyParser
from ngramspec.server.bridge import SchedulerBridge
from ngramspec.server.limits import PromptTextBound
from ngramspec.server.metrics import ServerMetrics


class ServerState:
    """The app's shared objects and settings (see `create_app` for the parameters).

    Attributes
    ----------
    scheduler : ngramspec.backend.Backend
        The main model's.
    others : dict of str to Backend
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
    cache_isolation : "shared" or "per-key"
        Whose cached prompts a request may reuse (`cache_owner`).
    hide_cache_n : bool
        Responses leave ``timings.cache_n`` and ``timings.prompt_n`` out.
    bridge : SchedulerBridge
    metrics : ServerMetrics
    text_bound : PromptTextBound
    bodies : BodyParser

    Notes
    -----
    Memory: the bridge's thread pool and the metrics' registry (a few dozen series).

    Thread-safety: read-only once built.
    """

    def __init__(self, scheduler, *, model_name: str, api_keys, defaults: dict,
                 n_predict: int, others: dict, special_in_content: bool,
                 reasoning_format: str, cache_isolation: str = "shared",
                 hide_cache_n: bool = False):
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
        self.cache_isolation, self.hide_cache_n = cache_isolation, hide_cache_n
        served = self.served()
        self.bridge = SchedulerBridge(scheduler, sum(s.n_slots + s.queue_size for s in served))
        self.metrics = ServerMetrics(dict(self.named()))
        self.text_bound = PromptTextBound(scheduler.max_token_bytes(), self.n_ctx_slot)
        self.bodies = BodyParser(BodyBounds(self.n_ctx_slot, self.text_bound.max_bytes))

    def served(self) -> list:
        """Every scheduler the app serves, the main one first."""
        return [self.scheduler] + list(self.others.values())

    def named(self) -> list:
        """``(model id, scheduler)`` of every served model, the main one first."""
        return [(self.model_name, self.scheduler)] + list(self.others.items())

    def cache_owner(self, request: Request) -> Optional[str]:
        """The prompt-cache owner of a request (the scheduler's ``cache_owner``): None with
        ``cache_isolation="shared"`` (every request may reuse every cached prompt); with
        ``"per-key"``, the API key the request presented, or without ``--api-key`` the client's
        address (behind a proxy: the proxy's, so all its clients share one owner)."""
        if self.cache_isolation != "per-key":
            return None
        if self.api_keys:
            return cache_owner(request_key(request.scope["headers"]))
        client = request.client
        return "client:" + (client.host if client is not None else "")

    def scheduler_for(self, model: Optional[str]):
        """``(model id, scheduler)`` a request's ``model`` field picks: one of `others` by id,
        else the main model."""
        if model in self.others:
            return model, self.others[model]
        return self.model_name, self.scheduler


def server_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    return request.app.state.server
