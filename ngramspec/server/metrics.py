"""``GET /metrics``: Prometheus text under llama-server's, vLLM's and ngramspec's names.

The values are read from ``scheduler.stats()`` when Prometheus scrapes (a custom collector), so
the scheduler keeps one set of counters and the server adds only its HTTP counts. Names:

- llama-server's (``llamacpp:``): ``prompt_tokens_total``, ``prompt_seconds_total``,
  ``tokens_predicted_total``, ``tokens_predicted_seconds_total``, ``n_decode_total``,
  ``prompt_tokens_seconds`` and ``predicted_tokens_seconds``
  (tokens/s), ``requests_processing`` (slots busy), ``requests_deferred`` (queue length), and the
  speculative counters llama-server's clients read, ``n_drafted_total`` and
  ``n_drafted_accepted_total``;
- vLLM's (``vllm:``, label ``model_name``): ``num_requests_running``, ``num_requests_waiting``,
  ``prompt_tokens_total``, ``generation_tokens_total``, ``spec_decode_num_drafts_total``,
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


class _SchedulerCollector:
    """Builds the metric families from one ``scheduler.stats()`` snapshot."""

    def __init__(self, scheduler, model_name: str, timing: _Timing):
        self.scheduler, self.model_name, self.timing = scheduler, model_name, timing

    def collect(self):
        st = self.scheduler.stats()
        props = st.get("proposers", {})
        drafts = sum(p["gen_drafts"] for p in props.values())
        drafted = sum(p["gen_tokens"] for p in props.values())
        accepted = sum(p["acc_tokens"] for p in props.values())
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
        yield counter("llamacpp:n_drafted_total", "Draft tokens generated (all proposers).",
                      drafted)
        yield counter("llamacpp:n_drafted_accepted_total",
                      "Draft tokens accepted by the target (all proposers).", accepted)

        # vLLM
        m = {"model_name": self.model_name}
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", st["slots_busy"], m)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    st["queue_length"], m)
        yield counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                      processed, m)
        yield counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                      st["tokens_predicted"], m)
        yield counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
                      drafts, m)
        yield counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                      drafted, m)
        yield counter("vllm:spec_decode_num_accepted_tokens_total",
                      "Number of accepted tokens.", accepted, m)

        # ngramspec: per proposer, slots, queue, requests
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
                     ("dropped", "Requests not published (backlog full while unreachable).")):
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
    scheduler : ngramspec.llama.Scheduler
    model_name : str
        The ``model`` label of the scheduler's metrics.

    Notes
    -----
    Memory: the registry and the running time sums, a few KiB.

    Thread-safety: every method may be called from any thread.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler, model_name: str):
        self.timing = _Timing()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler, model_name, self.timing))
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
