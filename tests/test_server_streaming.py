"""Streamed responses (server-sent events) and clients that leave: a stream joins to the plain
text, closes with the timings and usage; a client that hangs up frees its slot (the session's
live server, `servertools`)."""
import json

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servertools import (CHAT_COUNT, KEY, PROMPTS, SLOTS, greedy, metric, metrics,  # noqa: E402
                         sse_events, wait_for)


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
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["timings"]["predicted_n"] == 24
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


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
    assert wait_for(lambda: metric(metrics(http), "ngramspec:requests_cancelled_total")
                 == before + SLOTS + 1), metrics(http)
    assert wait_for(lambda: http.get("/health").json()["slots_processing"] == 0)
    assert greedy(http, PROMPTS[2])["usage"]["completion_tokens"] == 16
