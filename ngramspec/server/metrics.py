"""``GET /metrics``: Prometheus text under llama-server's, vLLM's and ngramspec's names.

The values are read from ``scheduler.stats()`` when Prometheus scrapes (a custom collector), so
the scheduler keeps one set of counters and the server adds only its HTTP counts. Names:

- llama-server's (``llamacpp:``): ``prompt_tokens_total``, ``prompt_seconds_total``,
  ``tokens_predicted_total``, ``tokens_predicted_seconds_total``, ``n_decode_total``,
  ``n_busy_slots_per_decode``, ``prompt_tokens_seconds`` and ``predicted_tokens_seconds``
  (tokens/s), ``requests_processing`` (slots busy), ``requests_deferred`` (queue length), and the
  speculative counters llama-server's clients read, ``n_drafted_total`` and
  ``n_drafted_accepted_total``;
- vLLM's (``vllm:``, label ``model_name``): ``num_requests_running``, ``num_requests_waiting``,
  ``prompt_tokens_total``, ``generation_tokens_total``, ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``,
  ``spec_decode_num_accepted_tokens_per_pos_total`` (label ``position``);
- ngramspec's (``ngramspec:``): the speculative counters per proposer (label ``spec_type``),
  slots, queue, and HTTP requests by endpoint and status.

Notes
-----
Memory: one registry per app (several apps in one process do not share counters).
Thread-safety: prometheus_client's counters are thread-safe; ``collect`` reads one
``scheduler.stats()`` snapshot per scrape.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Paths counted under their own label; anything else (404s, probes) is "other", so that random
# URLs cannot grow the label set.
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


def _num(stats: dict, key: str) -> float:
    value = stats.get(key, 0)
    return float(value) if value is not None else 0.0


class _SchedulerCollector:
    """Builds the metric families from one ``scheduler.stats()`` snapshot."""

    def __init__(self, scheduler, model_name: str):
        self.scheduler, self.model_name = scheduler, model_name

    def collect(self):
        st = self.scheduler.stats()
        props = st.get("proposers", [])
        n = {k: _num(st, k) for k in (
            "n_slots", "slots_busy", "queue_length", "queue_size", "prompt_tokens_total",
            "prompt_seconds_total", "tokens_predicted_total", "tokens_predicted_seconds_total",
            "n_decode_total", "n_busy_slots_total", "requests_finished_total")}
        drafts = sum(int(p.get("gen_drafts", 0)) for p in props)
        drafted = sum(int(p.get("gen_tokens", 0)) for p in props)
        accepted = sum(int(p.get("acc_tokens", 0)) for p in props)

        def counter(name, doc, value, labels=None):
            fam = CounterMetricFamily(name, doc, labels=list(labels or {}))
            fam.add_metric(list((labels or {}).values()), value)
            return fam

        def gauge(name, doc, value, labels=None):
            fam = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            fam.add_metric(list((labels or {}).values()), value)
            return fam

        def ratio(a, b):
            return a / b if b > 0 else 0.0

        # llama-server
        yield counter("llamacpp:prompt_tokens_total", "Number of prompt tokens processed.",
                      n["prompt_tokens_total"])
        yield counter("llamacpp:prompt_seconds_total", "Prompt process time",
                      n["prompt_seconds_total"])
        yield counter("llamacpp:tokens_predicted_total", "Number of generation tokens processed.",
                      n["tokens_predicted_total"])
        yield counter("llamacpp:tokens_predicted_seconds_total", "Predict process time",
                      n["tokens_predicted_seconds_total"])
        yield counter("llamacpp:n_decode_total", "Total number of llama_decode() calls",
                      n["n_decode_total"])
        yield gauge("llamacpp:n_busy_slots_per_decode",
                    "Average number of busy slots per llama_decode() call",
                    ratio(n["n_busy_slots_total"], n["n_decode_total"]))
        yield gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    ratio(n["prompt_tokens_total"], n["prompt_seconds_total"]))
        yield gauge("llamacpp:predicted_tokens_seconds",
                    "Average generation throughput in tokens/s.",
                    ratio(n["tokens_predicted_total"], n["tokens_predicted_seconds_total"]))
        yield gauge("llamacpp:requests_processing", "Number of requests processing.",
                    n["slots_busy"])
        yield gauge("llamacpp:requests_deferred", "Number of requests deferred.",
                    n["queue_length"])
        yield counter("llamacpp:n_drafted_total", "Draft tokens generated (all proposers).",
                      drafted)
        yield counter("llamacpp:n_drafted_accepted_total",
                      "Draft tokens accepted by the target (all proposers).", accepted)

        # vLLM
        m = {"model_name": self.model_name}
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", n["slots_busy"], m)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    n["queue_length"], m)
        yield counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
                      n["prompt_tokens_total"], m)
        yield counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
                      n["tokens_predicted_total"], m)
        yield counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.",
                      drafts, m)
        yield counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.",
                      drafted, m)
        yield counter("vllm:spec_decode_num_accepted_tokens_total",
                      "Number of accepted tokens.", accepted, m)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=["model_name", "position"])
        width = max((len(p.get("acc_per_pos", ())) for p in props), default=0)
        for i in range(width):
            per_pos.add_metric([self.model_name, str(i)], sum(
                int(p["acc_per_pos"][i]) for p in props if len(p.get("acc_per_pos", ())) > i))
        yield per_pos

        # ngramspec: per proposer
        fams = {key: CounterMetricFamily(f"ngramspec:spec_{name}", doc, labels=["spec_type"])
                for key, name, doc in (
                    ("gen_drafts", "drafts", "Non-empty drafts, per proposer."),
                    ("gen_tokens", "draft_tokens", "Draft tokens generated, per proposer."),
                    ("acc_drafts", "accepted_drafts", "Drafts with >= 1 accepted token."),
                    ("acc_tokens", "accepted_tokens", "Draft tokens accepted, per proposer."))}
        for p in props:
            for key, fam in fams.items():
                fam.add_metric([str(p.get("type"))], int(p.get(key, 0)))
        yield from fams.values()
        yield gauge("ngramspec:slots", "Slots of the scheduler.", n["n_slots"])
        yield gauge("ngramspec:slots_busy", "Slots holding a request.", n["slots_busy"])
        yield gauge("ngramspec:queue_length", "Requests waiting for a slot.", n["queue_length"])
        yield gauge("ngramspec:queue_size", "Bound of the request queue (503 beyond).",
                    n["queue_size"])


class ServerMetrics:
    """The app's Prometheus registry: the scheduler's counters plus HTTP request counts.

    Notes
    -----
    Thread-safety: ``observe_http`` and ``render`` may be called from any thread.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, scheduler, model_name: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(scheduler, model_name))
        self.http = Counter("ngramspec:http_requests", "HTTP requests by endpoint and status.",
                            ["endpoint", "status"], registry=self.registry)

    def observe_http(self, path: str, status: int) -> None:
        self.http.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPCountMiddleware:
    """Pure ASGI middleware counting responses by endpoint and status (streams untouched)."""

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
