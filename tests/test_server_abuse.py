"""Issue 34 §2: the server refuses before it parses, bounds every list, and leaks no prompt.

Most tests use the session's live server (`servertools`: 4 slots of 1024 tokens, an API key);
one module server tests what needs its own flags (per-key cache isolation, hidden cache_n, the
draft model served beside the target, a small concurrency cap). Every reproducer of the issue
failed before the change and passes after it.
"""
import asyncio
import json
import socket
import time

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from clitools import cli  # noqa: E402
from servertools import COPY_PROMPT, CTX, KEY, SLOTS, Server, metric, metrics  # noqa: E402

N_PROMPT = CTX // SLOTS - 1          # tokens a slot's prompt may have


def _raw(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection; what the server sends until it closes (or the first
    answer when it keeps the connection open)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _error(r, status, param):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


# -- bodies bounded before validation ------------------------------------------------------------

def test_many_chat_messages_are_refused_by_their_count(http):
    body = {"messages": [{"role": "user", "content": ""}] * 200_000, "max_tokens": 2}
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=body)
    err = _error(r, 400, "messages")
    assert f"200000 messages cannot fit a slot's context" in err["message"], err
    assert f"allowed at most {N_PROMPT} messages" in err["message"], err
    assert err["code"] == "context_length_exceeded"
    # Before, the 200k messages were validated and rendered: seconds of the event loop.
    assert time.monotonic() - t0 < 20
    assert http.get("/health").json()["status"] == "ok"


def test_chat_contents_are_bounded_in_sum_before_rendering(http):
    body = {"messages": [{"role": "user", "content": "x" * 20_000}] * 100, "max_tokens": 2}
    err = _error(http.post("/v1/chat/completions", json=body), 400, "messages")
    assert "the contents (2000000 characters) cannot fit a slot's context" in err["message"], err
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 30_000}]}]
             * 50, "max_tokens": 2}
    err = _error(http.post("/v1/chat/completions", json=parts), 400, "messages")
    assert "the contents (1500000 characters)" in err["message"], err


@pytest.mark.parametrize("batch", [False, True])
def test_a_long_token_prompt_is_refused_by_its_length(http, batch):
    ids = [1] * 2_000_000                 # 4 MB of JSON: under the body limit
    r = http.post("/v1/completions", content=json.dumps(
        {"prompt": [ids] if batch else ids, "max_tokens": 2}, separators=(",", ":")),
        headers={"Content-Type": "application/json"})
    err = _error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert f"the prompt (2000000 tokens) does not fit a slot's context: allowed at most " \
           f"{N_PROMPT} prompt tokens" in err["message"], err
    # the longest allowed prompt is still served
    ok = http.post("/v1/completions", json={"prompt": [1] * N_PROMPT, "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_large_bodies_parsed_by_the_worker_answer_as_small_ones(http):
    # over 64 KiB (an ignored OpenAI "user" field): parsed in the worker process
    pad = {"user": "u" * 100_000}
    small = http.post("/v1/completions", json={"prompt": COPY_PROMPT, "max_tokens": 4,
                                               "temperature": 0})
    large = http.post("/v1/completions", json={"prompt": COPY_PROMPT, "max_tokens": 4,
                                               "temperature": 0, **pad})
    assert small.status_code == large.status_code == 200, large.text
    assert large.json()["choices"] == small.json()["choices"]
    err = _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten", **pad}),
                 400, "max_tokens")
    assert err["message"].startswith("max_tokens: "), err
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **pad})
    assert chat.status_code == 200, chat.text


def test_malformed_and_deep_bodies_are_400s(http):
    for content, needle in ((b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                             "nested too deeply"),
                            (b'{"prompt": "x", "max_tokens": 1' + b"\xff}", "not UTF-8"),
                            (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", ""),
                            (b"[" * 100_000, "must be a JSON object"),
                            (b'{"prompt": [' + b"1, " * 1_000_000, "does not end with '}'")):
        r = http.post("/v1/completions", content=content,
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert needle in r.json()["error"]["message"]
    assert http.get("/health").json()["status"] == "ok"


# -- the key before the body ---------------------------------------------------------------------

def test_the_key_is_checked_before_the_body_is_read(server, http):
    # Malformed JSON without a key: 401, not 400 (the body is not parsed).
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    # 8 MB declared, 10 bytes sent: answered at once, without waiting for (or reading) the
    # body; before, the server waited for it until the read timeout.
    t0 = time.monotonic()
    answer = _raw(server.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 8000000\r\n"
                              b"\r\n{\"messages")
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - t0 < 5
    before = metrics(http)
    assert httpx.get(server.url + "/metrics").status_code == 401
    after = metrics(http)
    assert metric(after, "ngramspec:http_requests_total", endpoint="/metrics", status="401") \
        == metric(before, "ngramspec:http_requests_total", endpoint="/metrics",
                  status="401") + 1


# -- stop strings --------------------------------------------------------------------------------

def test_a_stop_string_with_an_unpaired_surrogate_is_a_400(http):
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": ["ok", "a\ud800"]})
    r = http.post("/v1/completions", content=body.encode("ascii"),
                  headers={"Content-Type": "application/json"})
    err = _error(r, 400, "stop")
    assert "character 1 is an unpaired surrogate (U+D800)" in err["message"], err


def test_a_stop_inside_an_accepted_prediction_counts_only_kept_tokens(http):
    base = {"prompt": COPY_PROMPT, "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    cut = 12
    while full.find(full[cut:cut + 4]) != cut:     # a stop string first found at `cut`
        cut += 1
    stop = full[cut:cut + 4]
    before = metrics(http)
    r = http.post("/v1/completions", json={**base, "stop": stop,
                                           "prediction": {"type": "content", "content": full}})
    after = metrics(http)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["choices"][0]["text"] == full[:cut]
    n_out = res["usage"]["completion_tokens"]
    accepted = res["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    # the first token is sampled from the prompt; every later kept token may be a draft's
    assert 0 < accepted <= n_out - 1, (accepted, n_out)
    assert res["timings"]["draft_n_accepted"] == accepted
    assert metric(after, "llamacpp:n_drafted_accepted_total") - \
        metric(before, "llamacpp:n_drafted_accepted_total") == accepted
    assert metric(after, "llamacpp:tokens_predicted_total") - \
        metric(before, "llamacpp:tokens_predicted_total") == n_out


# -- the prompt cache ----------------------------------------------------------------------------

def test_cache_prompt_false_reuses_nothing(http):
    body = {"prompt": COPY_PROMPT, "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()
    again = http.post("/v1/completions", json=body).json()
    assert again["timings"]["cache_n"] > 0          # the shared cache, llama-server's default
    fresh = http.post("/v1/completions", json={**body, "cache_prompt": False}).json()
    assert fresh["timings"]["cache_n"] == 0
    assert fresh["timings"]["prompt_n"] == fresh["usage"]["prompt_tokens"]
    assert fresh["choices"][0]["text"] == first["choices"][0]["text"]
    r = http.post("/v1/completions", json={**body, "cache_prompt": "no"})
    assert _error(r, 400, "cache_prompt")


# -- startup flags ---------------------------------------------------------------------------------

def test_start_flags_out_of_range_are_one_line_errors(capsys):
    res = cli(capsys, "serve", "-c", "2048", "-np", "2", "-n", "5000", "--port", "0")
    assert res.returncode == 2, res
    assert "--n-predict = 5000 is out of range: allowed -1 (until EOS or a full slot) or " \
           "1 .. 1024" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1
    res = cli(capsys, "serve", "--timeout-graceful-shutdown", "1e308", "--port", "0")
    assert res.returncode == 2 and "--timeout-graceful-shutdown" in res.stderr, res.stderr
    assert "out of range" in res.stderr and res.stderr.count("\n") == 1
    res = cli(capsys, "serve", "--limit-concurrency", "0", "--port", "0")
    assert res.returncode == 2 and "--limit-concurrency" in res.stderr, res.stderr


def test_create_app_refuses_n_predict_beyond_a_slot(inproc_scheduler):
    from ngramspec.server import create_app
    from ngramspec.validation import OutOfRange

    with pytest.raises(OutOfRange, match=r"^n_predict = 513 is out of range: allowed 1 \.\. 512"):
        create_app(inproc_scheduler, n_predict=513, manage_scheduler=False)
    create_app(inproc_scheduler, n_predict=512, manage_scheduler=False)


@pytest.fixture(scope="module")
def inproc_scheduler():
    """The llama.cpp scheduler (not started) as the server's backend."""
    from ngramspec.llama import Scheduler
    from ngramspec.config import SpecConfig
    from ngramspec.llama.backend import LlamaBackend
    return LlamaBackend(Scheduler(None, SpecConfig("none"), n_slots=1, n_ctx=512, n_threads=1))


def test_cache_owner_is_the_key_else_the_client_address(inproc_scheduler):
    from starlette.requests import Request

    from ngramspec.server import create_app

    def owner(app, key=None, host="10.0.0.1"):
        headers = [(b"authorization", b"Bearer " + key.encode())] if key else []
        return app.state.server.cache_owner(Request({"type": "http", "headers": headers,
                                                     "client": (host, 5000)}))

    keyed = create_app(inproc_scheduler, api_key="a1,b2", cache_isolation="per-key",
                       manage_scheduler=False)
    assert owner(keyed, "a1") != owner(keyed, "b2")
    assert owner(keyed, "a1") == owner(keyed, "a1", host="10.0.0.2")   # the key, not the host
    assert "a1" not in owner(keyed, "a1")                              # a digest of it
    open_app = create_app(inproc_scheduler, cache_isolation="per-key", manage_scheduler=False)
    assert owner(open_app) == owner(open_app, "any") != owner(open_app, host="10.0.0.2")
    shared = create_app(inproc_scheduler, manage_scheduler=False)
    assert owner(shared, "a1") is None
    with pytest.raises(ValueError, match="cache_isolation"):
        create_app(inproc_scheduler, cache_isolation="per-user", manage_scheduler=False)


def test_the_schema_documents_the_request_bodies(inproc_scheduler):
    from starlette.testclient import TestClient

    from ngramspec.server import create_app
    with TestClient(create_app(inproc_scheduler, manage_scheduler=False)) as c:
        schema = c.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    props = body["content"]["application/json"]["schema"]["properties"]
    assert "messages" in props and "cache_prompt" in props
    ref = json.dumps(props["messages"]).split('"$ref": "#/components/schemas/')[1].split('"')[0]
    assert "role" in schema["components"]["schemas"][ref]["properties"]


# -- the body budget -------------------------------------------------------------------------------

def test_bodies_held_at_once_are_bounded():
    """Two requests whose bodies arrive together: the second would pass the budget, so it is
    a 503 at once; once the first is answered, its bytes are released."""
    from ngramspec.server.limits import RequestLimits

    release = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    limits = RequestLimits(app, max_body_size=1000, budget=1500)

    async def request(size):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "headers": [], "path": "/v1/completions"}
        await limits(scope, receive, send)
        return sent[0]["status"]

    async def main():
        first = asyncio.ensure_future(request(1000))
        await asyncio.sleep(0.05)
        assert limits.held == 1000
        assert await request(600) == 503
        release.set()
        assert await first == 200
        assert limits.held == 0
        assert await request(1000) == 200

    asyncio.run(main())


# -- a server of its own: per-key isolation, hidden cache_n, the draft model, a concurrency cap --

K1, K2 = "key-one-0123456789", "key-two-0123456789"


@pytest.fixture(scope="module")
def isolated():
    from ngramspec.llama.model import default_model_path
    srv = Server("-c", 1024, "-np", 2, "--spec-type", "ngram-mod", "--api-key", f"{K1},{K2}",
                 "--cache-isolation", "per-key", "--hide-cache-n", "--limit-concurrency", "12",
                 "-md", default_model_path())
    yield srv
    srv.stop()


def _as(srv, key):
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"},
                        timeout=120)


def test_per_key_isolation_reuses_only_the_own_keys_cache(isolated):
    body = {"prompt": COPY_PROMPT[-1500:], "max_tokens": 2, "temperature": 0}
    with _as(isolated, K1) as one, _as(isolated, K2) as two:
        def cached(client):
            before = metric(metrics(one), "ngramspec:prompt_tokens_cached_total")
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            t = r.json()["timings"]
            # --hide-cache-n: the prompt's timings are absent, not null
            assert not {"cache_n", "prompt_n", "prompt_ms"} & set(t), t
            assert t["predicted_n"] == 2
            return metric(metrics(one), "ngramspec:prompt_tokens_cached_total") - before

        cached(one)
        assert cached(two) == 0             # key two finds nothing of key one's prompt
        assert cached(two) > 0              # its own prompt, once it sent it
        assert cached(one) > 0
        fresh = one.post("/v1/completions", json={**body, "cache_prompt": False})
        assert fresh.status_code == 200


def test_the_draft_models_requests_are_in_health_and_metrics(isolated):
    with _as(isolated, K1) as c:
        names = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert len(names) == 2
        before = metrics(c)
        r = c.post("/v1/completions", json={"model": names[1], "prompt": "Hello",
                                            "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == names[1], r.text
        after = metrics(c)
        health = c.get("/health").json()
    assert set(health["models"]) == set(names), health
    assert health["slots_idle"] == sum(m["slots_idle"] for m in health["models"].values()) == 4
    assert metric(after, "vllm:generation_tokens_total", model_name=names[1]) - \
        metric(before, "vllm:generation_tokens_total", model_name=names[1]) == 3
    assert metric(after, "ngramspec:requests_finished_total") - \
        metric(before, "ngramspec:requests_finished_total") == 1


def test_the_concurrency_cap_answers_503_and_recovers(isolated):
    host, port = isolated.url.rsplit("/", 1)[1].split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(12)]
    try:
        time.sleep(0.5)
        r = httpx.get(isolated.url + "/health")
        assert r.status_code == 503, r.text
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(isolated.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
