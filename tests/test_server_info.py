"""``ngramspec serve``'s informational endpoints and access: the model list, health, the
Prometheus metrics against what the responses report, the API key (the session's live server,
`servertools`)."""
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servertools import COPY_PROMPT, CTX, KEY, SLOTS, greedy, metric, metrics  # noqa: E402


def test_binds_loopback_and_lists_the_model(server, http):
    assert server.url.startswith("http://127.0.0.1:")
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert card["meta"]["n_slots"] == SLOTS and card["meta"]["n_ctx_slot"] == CTX // SLOTS
    assert card["meta"]["spec_types"] == ["ngram-simple", "ngram-mod"]
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["slots_idle"] + health["slots_processing"] == SLOTS


def test_metrics_count_what_the_responses_report(http):
    before = metrics(http)
    res = greedy(http, COPY_PROMPT, 40,
                 speculative={"type": "ngram-simple"})
    after = metrics(http)
    t = res["timings"]
    assert t["draft_n"] > 0

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    m = {"model_name": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert delta("llamacpp:n_drafted_total") == t["draft_n"]
    assert delta("llamacpp:n_drafted_accepted_total") == t["draft_n_accepted"]
    assert delta("vllm:spec_decode_num_draft_tokens_total", **m) == t["draft_n"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total", **m) == t["draft_n_accepted"]
    assert delta("ngramspec:spec_draft_tokens_total", spec_type="ngram-simple") == t["draft_n"]
    assert delta("ngramspec:spec_draft_tokens_total", spec_type="ngram-mod") == 0
    assert delta("llamacpp:tokens_predicted_total") == res["usage"]["completion_tokens"]
    assert delta("vllm:generation_tokens_total", **m) == res["usage"]["completion_tokens"]
    assert delta("llamacpp:prompt_tokens_total") == t["prompt_n"]
    assert delta("ngramspec:http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert metric(after, "llamacpp:predicted_tokens_seconds") > 0
    assert metric(after, "llamacpp:requests_processing") == 0
    assert metric(after, "vllm:num_requests_waiting", **m) == 0
    assert metric(after, "ngramspec:slots") == SLOTS


def test_api_key(server):
    url = server.url
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.post(url + "/v1/completions", json=body,
                      headers={"X-Api-Key": KEY}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 200
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="m", prompt="hi", max_tokens=1)
