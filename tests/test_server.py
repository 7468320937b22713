"""``ngramspec serve`` end to end: the real server (a subprocess on 127.0.0.1, a free port) with
the real embedded model, driven by the official ``openai`` client and by raw HTTP (httpx).

Kept small for a loaded 2-core box: one decode thread, short outputs (<= 48 tokens), two server
processes (the main one with 4 slots, and a 1-slot one for the full queue and SIGTERM).
"""
import json
import pathlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import ngramspec  # noqa: E402
from clitools import cli  # noqa: E402
from ngramspec.server.process import ServerProcess  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"
CTX, SLOTS = 4096, 4                  # 1024 tokens per slot
EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"
# Greedy equalities below (stream = non-stream, concurrent = sequential, chat = completion of the
# rendered chat) hold only where no greedy choice is a near tie: the KV-cache layout and the batch
# composition change the logits' low bits (float noise), and the 135M model has ties within 0.05
# logit on most short prompts ("The capital of France is"). The prompts here were chosen for a
# top-2 logit gap >= 0.4 on every greedy token they are asked for: the example code edit with the
# first lines of its answer (the model copies the file), and chats with a forced answer.
EXAMPLE_TEXT = EXAMPLE.read_text(encoding="utf-8")
_CODE = EXAMPLE_TEXT.split("```python\n", 1)[1].splitlines(keepends=True)
COPY_PROMPT = EXAMPLE_TEXT + "```python\n#"         # gap >= 0.5 over 48 tokens
PROMPTS = [EXAMPLE_TEXT + "```python\n" + "".join(_CODE[:k])  # gap >= 0.4 over 20 tokens
           for k in (1, 3, 4, 6, 8, 9, 10, 11)]
CHAT_REPEAT = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat."}]
CHAT_COUNT = [{"role": "user", "content": "Write the numbers from 1 to 10 separated by commas."}]


def Server(*args):
    return ServerProcess("-t", "1", *args, cwd=str(ROOT))


@pytest.fixture(scope="module")
def server():
    srv = Server("-c", str(CTX), "-np", str(SLOTS), "--api-key", KEY,
                 "--spec-type", "ngram-mod,ngram-simple", "--queue-size", "16")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def vocab():
    from ngramspec.llama.model import default_model_path
    return llama_cpp.Llama(default_model_path(), vocab_only=True, verbose=False)


def metrics(http):
    r = http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(snapshot, name, **labels):
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def greedy(http, prompt, max_tokens=16, **extra):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


# -- the endpoints ------------------------------------------------------------------------------

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


def test_completion_with_the_openai_client(client, http):
    res = client.completions.create(model="anything", prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0)
    choice = res.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert res.usage.completion_tokens == 16
    assert res.usage.total_tokens == res.usage.prompt_tokens + 16
    assert res.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # Greedy is deterministic: the raw request gives the same text, with llama-server's timings.
    raw = greedy(http, PROMPTS[0])
    assert raw["choices"][0]["text"] == choice.text
    t = raw["timings"]
    assert t["predicted_n"] == 16
    # The repeated prompt comes from the slot's KV cache (all but its last token).
    assert t["prompt_n"] + t["cache_n"] == res.usage.prompt_tokens and t["prompt_n"] >= 1
    assert t["predicted_per_second"] > 0 and t["predicted_ms"] > 0
    assert t["draft_n_accepted"] <= t["draft_n"]


def test_chat_uses_the_gguf_template(client, http, vocab):
    from ngramspec.llama import render_chat
    res = client.chat.completions.create(model="m", messages=CHAT_REPEAT, max_tokens=12,
                                         temperature=0)
    msg = res.choices[0].message
    assert msg.role == "assistant" and msg.content
    # The same prompt rendered with the GGUF's template, sent as plain text, gives the same text.
    rendered = render_chat(vocab, CHAT_REPEAT)
    assert "<|im_start|>user\nRepeat exactly" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert greedy(http, rendered, max_tokens=12)["choices"][0]["text"] == msg.content
    # Content as a list of text parts is the same message.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Repeat exactly: "},
                                          {"type": "text", "text": "the cat sat on the mat."}]}]
    again = client.chat.completions.create(model="m", messages=parts, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == msg.content


def _sse_events(response):
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def test_streams_join_to_the_plain_text(client, http):
    whole = greedy(http, PROMPTS[1], max_tokens=20)["choices"][0]["text"]
    stream = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=20,
                                       temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert len(pieces) > 2 and "".join(pieces) == whole

    chat = dict(model="m", messages=CHAT_COUNT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    deltas, finish = [], None
    for c in client.chat.completions.create(**chat, stream=True):
        if c.choices:
            deltas.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert "".join(deltas) == whole and finish == "length"

    # Raw SSE: data lines, a final chunk with the timings, usage on request, then [DONE].
    with http.stream("POST", "/v1/chat/completions",
                     json={**chat, "stream": True,
                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["timings"]["predicted_n"] == 24
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


def test_eight_concurrent_clients_each_equal_their_sequential_result(client):
    def run(prompt):
        return client.completions.create(model="m", prompt=prompt, max_tokens=20,
                                         temperature=0).choices[0].text

    sequential = [run(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(run, PROMPTS))
    assert concurrent == sequential


def test_per_request_speculative_fields(http):
    prompt = COPY_PROMPT
    n = 48
    on = greedy(http, prompt, n, speculative={"type": "ngram-simple"})
    off = greedy(http, prompt, n, speculative={"enabled": False})
    flat_zero = greedy(http, prompt, n, **{"speculative.n_max": 0})
    too_long = greedy(http, prompt, n, speculative={"type": "ngram-simple"},
                      **{"speculative.n_min": 100})
    short = greedy(http, prompt, n, speculative={"type": "ngram-simple", "n_max": 2})
    assert on["timings"]["draft_n"] > 0 and on["timings"]["draft_n_accepted"] > 0
    for res in (off, flat_zero, too_long):
        assert res["timings"]["draft_n"] == 0
    # n_max 2: at most 2 draft tokens per step, one step per 1 + accepted tokens.
    assert 0 < short["timings"]["draft_n"] <= 2 * n
    # Lossless greedy: speculation changes the speed, not the text.
    text = off["choices"][0]["text"]
    for res in (on, flat_zero, too_long, short):
        assert res["choices"][0]["text"] == text


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


# -- bad input: a 400 naming the field, and the server carries on --------------------------------

LONG = list(range(100, 100 + CTX // SLOTS + 10))  # token ids, longer than a slot's context
BAD = [
    # (endpoint, body, param)
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [10**7]}, "prompt"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": "ngram-nope"}},
     "speculative.type"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": "ngram-map-k"}},
     "speculative.type"),
    ("/v1/completions", {"prompt": "x", "speculative": {"n_max": 5000}}, "speculative.n_max"),
    ("/v1/completions", {"prompt": "x", "speculative.n_max": -1}, "speculative.n_max"),
    ("/v1/completions", {"prompt": "x", "speculative": {"n_min": 9, "n_max": 4}},
     "speculative.n_min"),
    ("/v1/completions", {"prompt": "x", "speculative": {"policy": "fast"}}, "speculative.policy"),
    ("/v1/completions", {"prompt": "x", "speculative": {"enabled": "yes"}},
     "speculative.enabled"),
    ("/v1/completions", {"prompt": "x", "speculative": {"bogus": 1}}, "speculative.bogus"),
    ("/v1/completions", {"prompt": "x", "speculative": {"n_max": 4}, "speculative.n_max": 8},
     "speculative.n_max"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * (CTX // SLOTS + 10)}]},
     "messages"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD,
                         ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(http, endpoint, body, param):
    r = http.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"].startswith(param)
    if body.get("prompt") is LONG or param == "messages" and body["messages"]:
        assert err["code"] == "context_length_exceeded"


def test_malformed_bodies(http, server):
    for content, needle in ((b'{"prompt": "x",', "malformed JSON"),
                            (b"[1, 2]", "JSON object"), (b"", "JSON object")):
        r = http.post("/v1/completions", content=content,
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"]
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="x", max_tokens=-3)
    assert exc.value.body["param"] == "max_tokens"
    # None of it hurt the server.
    assert http.get("/health").json()["status"] == "ok"
    assert greedy(http, PROMPTS[0])["usage"]["completion_tokens"] == 16


# -- disconnects, the full queue, SIGTERM -------------------------------------------------------

def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_frees_the_slot(server, http):
    before = metric(metrics(http), "ngramspec:requests_cancelled_total")
    body = {"prompt": "Write a very long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "speculative": {"enabled": False}}
    # Streams: read the first chunk of each, then hang up.
    for _ in range(SLOTS):
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
    # A non-streamed request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5)
    assert _wait(lambda: metric(metrics(http), "ngramspec:requests_cancelled_total")
                 == before + SLOTS + 1), metrics(http)
    assert _wait(lambda: http.get("/health").json()["slots_processing"] == 0)
    assert greedy(http, PROMPTS[2])["usage"]["completion_tokens"] == 16


def test_full_queue_is_503_and_sigterm_stops_within_seconds():
    srv = Server("-c", "1024", "-np", "1", "--queue-size", "1", "--spec-type", "none",
                 "--timeout-graceful-shutdown", "1")
    try:
        body = {"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True}
        done = {}

        def post(name, stream):
            try:
                with httpx.stream("POST", srv.url + "/v1/completions",
                                  json={**body, "stream": stream}, timeout=60) as r:
                    done[name] = (r.status_code, list(r.iter_lines()))
            except httpx.HTTPError as exc:
                done[name] = exc

        running = threading.Thread(target=post, args=("running", True))
        running.start()
        assert _wait(lambda: httpx.get(srv.url + "/health").json()["slots_processing"] == 1)
        queued = threading.Thread(target=post, args=("queued", False))
        queued.start()
        assert _wait(lambda: httpx.get(srv.url + "/health").json()["queue_length"] == 1)
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_full"

        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(20)
        elapsed = time.monotonic() - t0
        running.join(10)
        queued.join(10)
        assert rc == 0, srv.output()
        assert elapsed < 15, elapsed
        assert "Application shutdown complete" in srv.output()
        # Both requests got an answer or a closed connection, none hangs.
        assert set(done) == {"running", "queued"}
    finally:
        srv.stop()


# -- command line -------------------------------------------------------------------------------

def test_cli_errors_are_one_line(capsys, tmp_path):
    res = cli(capsys, "serve", "--port", "70000")
    assert res.returncode == 2 and "--port" in res.stderr
    res = cli(capsys, "serve", "--model", tmp_path / "missing.gguf", "--port", "0")
    assert res.returncode == 2 and "model file not found" in res.stderr
    assert res.stderr.count("\n") == 1
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = cli(capsys, "serve", "--port", port)
    assert res.returncode == 2 and "cannot bind" in res.stderr
    assert res.stderr.count("\n") == 1
