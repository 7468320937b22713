"""``GET /metrics``: Prometheus text under llama-server's, vLLM's and ngramspec's names.

The values are read from ``scheduler.stats()`` when Prometheus scrapes (a custom collector), so
the scheduler keeps one set of counters and the server adds only its HTTP counts. Names:

- llama-server's (``llamacpp:``): ``prompt_tokens_total``, ``prompt_seconds_total``,
  ``tokens_predicted_total``, ``tokens_predicted_seconds_total``, ``n_decode_total``,
  ``prompt_tokens_seconds`` and ``predicted_tokens_seconds``
  (tokens/s), ``requests_processing`` (slots busy), ``requests_deferred`` (queue length), and the
  speculative counters llama-server's clients read, ``n_drafted_total`` and
  ``n_drafted_accepted_total`` (every verified draft, a Predicted Output's included, as the
  responses' ``draft_n`` / ``draft_n_accepted``; accepted = kept in the output);
- vLLM's (``vllm:``, label ``model_name``, one series per served model):
  ``num_requests_running``, ``num_requests_waiting``, ``prompt_tokens_total``,
  ``generation_tokens_total``, ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``;
- ngramspec's (``ngramspec:``): the speculative counters per proposer (label ``spec_type``),
  cached prompt tokens, requests submitted/finished/cancelled, slots, queue, and HTTP requests
  by endpoint and status.

The times (``*_seconds_total`` and the tokens/s gauges) are sums over finished requests, as
llama-server keeps them.

Notes
-----
Memory: one registry per app (several apps in one process do not share counters).
Thread-safety: prometheus_client's counters are thread-safe; ``collect`` reads one
``scheduler.stats()`` snapshot per scrape.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ngramspec import store_log

# Paths counted under their own label; anything else (404s, probes) is "other", so that random
# URLs cannot grow the label set.
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


class _Timing:
    """Sums over finished requests of what the scheduler reports per request (its counters
    have no times): llama-server's prompt and generation seconds."""

    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_n = self.prompt_s = self.predicted_n = self.predicted_s = 0.0

    def add(self, done) -> None:
        with self._lock:
            self.prompt_n += done.prompt_n - done.prompt_cached_n
            self.prompt_s += done.prompt_ms / 1e3
            self.predicted_n += done.predicted_n
            self.predicted_s += done.predicted_ms / 1e3

    def snapshot(self) -> tuple:
        with self._lock:
            return self.prompt_n, self.prompt_s, self.predicted_n, self.predicted_s


def _family(kind, name, doc, value, labels=None):
    fam = kind(name, doc, labels=list(labels or {}))
    fam.add_metric(list((labels or {}).values()), value)
    return fam


def _ratio(a, b):
    return a / b if b > 0 else 0.0


def _merged(stats: list) -> dict:
    """Several schedulers' ``stats()`` as one: counts summed, proposers' counts summed by type."""
    out = {k: sum(st[k] for st in stats) for k, v in stats[0].items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    props: dict = {}
    for st in stats:
        for spec_type, p in st.get("proposers", {}).items():
            mine = props.setdefault(spec_type, dict.fromkeys(p, 0))
            for key, value in p.items():
                if isinstance(value, (int, float)):
                    mine[key] = mine.get(key, 0) + value
    out["proposers"] = props
    return out


class _SchedulerCollector:
    """Builds the metric families from one ``stats()`` snapshot of each served scheduler:
    vLLM's per model (label ``model_name``), llama-server's and ngramspec's for the server as
    a whole (every served model's requests, ``serve -md``'s draft model's included)."""

    def __init__(self, schedulers: dict, timing: _Timing):
        self.schedulers, self.timing = dict(schedulers), timing

    def collect(self):
        per = {name: s.stats() for name, s in self.schedulers.items()}
        st = _merged(list(per.values()))
        yield from self._server(st)
        yield from self._vllm(per)
        yield from self._ngramspec(st)

    def _server(self, st):
        """llama-server's families."""
        # every verified draft (a Predicted Output's too), as the responses' draft_n count
        drafted, accepted = st["n_draft_tokens"], st["n_acc_tokens"]
        processed = st["tokens_prompt"] - st["tokens_prompt_cached"]
        t_prompt_n, t_prompt_s, t_pred_n, t_pred_s = self.timing.snapshot()
        counter = lambda *a: _family(CounterMetricFamily, *a)  # noqa: E731
        gauge = lambda *a: _family(GaugeMetricFamily, *a)  # noqa: E731

        # llama-server
        yield counter("llamacpp:prompt_tokens_total", "Number of prompt tokens processed.",
                      processed)
        yield counter("llamacpp:prompt_seconds_total", "Prompt process time (finished "
                      "requests)", t_prompt_s)
        yield counter("llamacpp:tokens_predicted_total", "Number of generation tokens processed.",
                      st["tokens_predicted"])
        yield counter("llamacpp:tokens_predicted_seconds_total", "Predict process time "
                      "(finished requests)", t_pred_s)
        yield counter("llamacpp:n_decode_total", "Total number of llama_decode() calls",
                      st["decode_calls"])
        yield gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    _ratio(t_prompt_n, t_prompt_s))
        yield gauge("llamacpp:predicted_tokens_seconds",
                    "Average generation throughput in tokens/s.", _ratio(t_pred_n, t_pred_s))
        yield gauge("llamacpp:requests_processing", "Number of requests processing.",
                    st["slots_busy"])
        yield gauge("llamacpp:requests_deferred", "Number of requests deferred.",
                    st["queue_length"])
        yield counter("llamacpp:n_drafted_total",
                      "Draft tokens verified (all proposers, predictions).",
                      drafted)
        yield counter("llamacpp:n_drafted_accepted_total",
                      "Draft tokens accepted by the target (all proposers, predictions).",
                      accepted)

    @staticmethod
    def _vllm(per: dict):
        """vLLM's families, one series per model (label ``model_name``)."""
        fams = [(GaugeMetricFamily, "vllm:num_requests_running",
                 "Number of requests in model execution batches.", lambda st, p: st["slots_busy"]),
                (GaugeMetricFamily, "vllm:num_requests_waiting",
                 "Number of requests waiting to be processed.", lambda st, p: st["queue_length"]),
                (CounterMetricFamily, "vllm:prompt_tokens_total",
                 "Number of prefill tokens processed.",
                 lambda st, p: st["tokens_prompt"] - st["tokens_prompt_cached"]),
                (CounterMetricFamily, "vllm:generation_tokens_total",
                 "Number of generation tokens processed.", lambda st, p: st["tokens_predicted"]),
                (CounterMetricFamily, "vllm:spec_decode_num_drafts_total",
                 "Number of spec decoding drafts.", lambda st, p: p("gen_drafts")),
                (CounterMetricFamily, "vllm:spec_decode_num_draft_tokens_total",
                 "Number of draft tokens.", lambda st, p: st["n_draft_tokens"]),
                (CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_total",
                 "Number of accepted tokens.", lambda st, p: st["n_acc_tokens"])]
        for kind, name, doc, value in fams:
            fam = kind(name, doc, labels=["model_name"])
            for model_name, st in per.items():
                props = st.get("proposers", {}).values()
                fam.add_metric([model_name], value(
                    st, lambda key, props=props: sum(q[key] for q in props)))
            yield fam

    def _ngramspec(self, st):
        """ngramspec's families: per proposer, slots, queue, requests."""
        props = st.get("proposers", {})
        counter = lambda *a: _family(CounterMetricFamily, *a)  # noqa: E731
        gauge = lambda *a: _family(GaugeMetricFamily, *a)  # noqa: E731
        fams = {key: CounterMetricFamily(f"ngramspec:spec_{name}", doc, labels=["spec_type"])
                for key, name, doc in (
                    ("gen_drafts", "drafts", "Non-empty drafts, per proposer."),
                    ("gen_tokens", "draft_tokens", "Draft tokens generated, per proposer."),
                    ("acc_drafts", "accepted_drafts", "Drafts with an accepted token."),
                    ("acc_tokens", "accepted_tokens", "Draft tokens accepted, per proposer."))}
        for spec_type, p in props.items():
            for key, fam in fams.items():
                fam.add_metric([spec_type], p[key])
        yield from fams.values()
        yield counter("ngramspec:prompt_tokens_cached_total", "Prompt tokens reused from a "
                      "slot's KV cache.", st["tokens_prompt_cached"])
        for key in ("requests_submitted", "requests_finished", "requests_cancelled"):
            yield counter(f"ngramspec:{key}_total", f"Requests {key.split('_')[1]}.", st[key])
        yield gauge("ngramspec:slots", "Slots of the scheduler.", st["n_slots"])
        yield gauge("ngramspec:slots_busy", "Slots holding a request.", st["slots_busy"])
        yield gauge("ngramspec:queue_length", "Requests waiting for a slot.", st["queue_length"])
        yield from _store_log_families()


def _store_log_families():
    """The store log's counters and lag, one sample per replica in this process (labelled by
    the log), when ``--store`` shares the store."""
    stats = [r.stats() for r in store_log.replicas()]
    if not stats:
        return
    for key, doc in (("published", "Finished requests published to the store log."),
                     ("ingested", "Other replicas' requests ingested into the store."),
                     ("skipped", "Corrupt or foreign store-log entries skipped."),
                     ("dropped", "Requests not published (backlog full while unreachable)."),
                     ("calibration_published", "Calibration deltas published to the store log."),
                     ("calibration_ingested", "Other replicas' calibration deltas folded in.")):
        fam = CounterMetricFamily(f"ngramspec:store_log_{key}", doc, labels=["log"])
        for s in stats:
            fam.add_metric([s["log"]], s[key])
        yield fam
    fam = GaugeMetricFamily("ngramspec:store_log_lag_seconds", "Publication to ingestion of "
                            "the last entry ingested.", labels=["log"])
    for s in stats:
        fam.add_metric([s["log"]], s["lag_seconds"])
    yield fam


class ServerMetrics:
    """The app's Prometheus registry.

    The scheduler's counters (read at each scrape), the finished requests' times and the HTTP
    request counts.

    Parameters
    ----------
    schedulers : dict of str to ngramspec.backend.Backend
        The served models by id (the ``model_name`` label of vLLM's families); the others
        count every model's requests together.

    Notes
    -----
    Memory: the registry and the running time sums, a few KiB.

    Thread-safety: every method may be called from any thread.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, schedulers: dict):
        self.timing = _Timing()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(schedulers, self.timing))
        self.http = Counter("ngramspec:http_requests", "HTTP requests by endpoint and status.",
                            ["endpoint", "status"], registry=self.registry)

    def observe_completion(self, done) -> None:
        """Count a finished request's prompt and generation times.

        Parameters
        ----------
        done : Completion
            The finished request (its ``timings``).
        """
        self.timing.add(done)

    def observe_http(self, path: str, status: int) -> None:
        """Count one HTTP response.

        Parameters
        ----------
        path : str
            The request path; paths outside `ENDPOINTS` count as ``other``.
        status : int
        """
        self.http.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def render(self) -> bytes:
        """The metrics in Prometheus' text format (`content_type`)."""
        return generate_latest(self.registry)


class HTTPCountMiddleware:
    """Pure ASGI middleware counting responses by endpoint and status (streams untouched).

    Parameters
    ----------
    app : ASGI application
    metrics : ServerMetrics

    Notes
    -----
    Memory: none per request beyond the status cell.

    Thread-safety: runs on the event loop; `ServerMetrics` counts from any thread.
    """

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]  # an exception before the response starts is a 500

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_http(scope["path"], status[0])
