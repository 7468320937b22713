"""Bad requests to ``ngramspec serve``: a 400 in OpenAI's error format naming the field the client
sent, and the server carries on; the command line's one-line errors (the session's live server,
`servertools`)."""
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from clitools import cli  # noqa: E402
from ngramspec.request_params import SamplingParams, SpeculationParams  # noqa: E402
from ngramspec.tokens import token_array  # noqa: E402
from ngramspec.validation import ContextOverflow  # noqa: E402
from servertools import CTX, KEY, PROMPTS, SLOTS, greedy  # noqa: E402


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
    ("/v1/completions", {"prompt": [5, -1]}, "prompt"),
    ("/v1/completions", {"prompt": [2**40]}, "prompt"),
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


# -- the mapping itself: the error's field (data) -> the request's field, no message parsing ----

@pytest.mark.parametrize("make, prompt_field, param, message", [
    (lambda: SpeculationParams(n_max=5000), "prompt", "speculative.n_max",
     "speculative.n_max = 5000 is out of range: allowed 0 .. 1024"),
    (lambda: SpeculationParams(policy="fast"), "prompt", "speculative.policy",
     "speculative.policy = 'fast' is out of range: allowed auto, fixed or None"),
    (lambda: SamplingParams(top_p=2), "prompt", "top_p",
     "top_p = 2.0 is out of range: allowed 0.0 .. 1.0"),
    (lambda: SamplingParams(max_tokens=0), "prompt", "max_completion_tokens",
     "max_completion_tokens = 0 is out of range: allowed -1 (no limit) or >= 1"),
    (lambda: SamplingParams(logit_bias={12: 1e308}), "prompt", "logit_bias",
     "logit_bias[12] = 1e+308 is out of range: allowed -100 .. 100, or -inf (bans the token)"),
    (lambda: _raise(ContextOverflow("prompt_tokens", "does not fit")), "messages", "messages",
     "messages: does not fit"),
    (lambda: token_array([5, -1], "prompt_tokens"), "prompt", "prompt",
     "prompt[1] = -1 is not a token id: ids must be in 0 .. 2147483647"),
])
def test_scheduler_errors_name_the_request_field(make, prompt_field, param, message):
    from ngramspec.server.errors import FieldError
    from ngramspec.server.fields import request_errors

    with pytest.raises(FieldError) as info:
        with request_errors(prompt_field, "max_completion_tokens"):
            make()
    assert (info.value.param, info.value.message) == (param, message)
    overflow = info.value.code == "context_length_exceeded"
    assert overflow == (param == "messages")


def _raise(exc):
    raise exc
