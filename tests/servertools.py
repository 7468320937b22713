"""What the live server tests share (``test_server_*.py``): the server's settings, the prompts
chosen for stable greedy text, and small HTTP helpers. The fixtures (one server process for the
whole session, its clients) are in ``conftest.py``.

Kept small for a loaded 2-core box: one decode thread, short outputs (<= 48 tokens), 4 slots.
"""
import pathlib
import time

import ngramspec
from ngramspec.server.process import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"
CTX, SLOTS = 4096, 4                  # 1024 tokens per slot
EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"
# The greedy equalities of the server tests (stream = non-stream, concurrent = sequential,
# chat = completion of the rendered chat) hold only where no greedy choice is a near tie: the KV-cache layout and the batch
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


def metrics(http):
    from prometheus_client.parser import text_string_to_metric_families

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


def sse_events(response):
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[len("data: "):])
    return events


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False
