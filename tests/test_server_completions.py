"""``/v1/completions`` end to end with the real embedded model: the official ``openai`` client,
raw HTTP with llama-server's timings, concurrent clients, the per-request ``speculative`` fields
(the session's live server, `servertools`)."""
from concurrent.futures import ThreadPoolExecutor

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servertools import COPY_PROMPT, PROMPTS, greedy  # noqa: E402


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
