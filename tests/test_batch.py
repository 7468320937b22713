"""``ngramspec run-batch`` (`ngramspec.server.batch`), Predicted Outputs, reasoning content and
the draft model served on its own, with the real embedded model (one decode thread, short
outputs: a loaded 2-core box)."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import ngramspec  # noqa: E402
from clitools import cli  # noqa: E402
from ngramspec.llama.scheduler import Scheduler  # noqa: E402
from ngramspec.llama.params import SamplingParams  # noqa: E402
from ngramspec.server import create_app  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = pathlib.Path(ngramspec.__file__).parent / "examples"
BATCH = EXAMPLES / "batch.jsonl"
FLAGS = ("-t", "1", "-c", "2048", "-np", "2", "--no-progress")


def _read(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _write(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def _completion(cid, prompt="The capital of France is", n=8, **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "temperature": 0, "max_tokens": n, **body}}


@pytest.fixture(scope="module")
def example_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch") / "results.jsonl"
    # the README's command, with the output in a temporary folder
    rc = subprocess.run([sys.executable, "-m", "ngramspec", "run-batch", "-i", str(BATCH),
                         "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rc.returncode == 0, rc.stderr
    return _read(out), rc.stderr


def test_the_readme_example_reads_back_with_openai_types(example_results):
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    results, stderr = example_results
    by_id = {r["custom_id"]: r for r in results}
    assert sorted(by_id) == sorted(json.loads(line)["custom_id"]
                                   for line in BATCH.read_text().splitlines())
    for r in results:
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
    chat = ChatCompletion.model_validate(by_id["edit-chat"]["response"]["body"])
    edit = Completion.model_validate(by_id["edit-with-prediction"]["response"]["body"])
    plain = Completion.model_validate(by_id["edit-without-prediction"]["response"]["body"])
    # the prediction works (most of the copied file drafted by it) ...
    details = edit.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > edit.usage.completion_tokens // 2
    assert chat.usage.completion_tokens_details.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details is None
    # ... and changes nothing (this prompt has no near tie of greedy choices, see test_server)
    assert edit.choices[0].text == plain.choices[0].text and edit.usage.completion_tokens == 48
    body = by_id["edit-with-prediction"]["response"]["body"]
    assert body["timings"]["draft_n_accepted"] >= \
        edit.usage.completion_tokens_details.accepted_prediction_tokens
    assert "3 lines: 3 done (0 errors)" in stderr and "prediction tokens" in stderr
    assert BatchError.model_validate({"code": "x", "message": "y", "line": 1}).line == 1


def test_bad_lines_become_their_errors_and_the_batch_goes_on(tmp_path, capsys):
    from openai.types import BatchError, Completion

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, ['{"custom_id": "broken", ', _completion("ok"),
                 {**_completion("wrong-url"), "url": "/v1/embeddings"},
                 _completion("bad-body", temperature="hot"),
                 {"method": "POST", "url": "/v1/completions", "body": {}},
                 _completion("streamed", stream=True),
                 _completion("long-prediction", prediction={"type": "content",
                                                            "content": "word " * 1500}),
                 _completion("file-prediction", prediction={"type": "file", "content": "x"})])
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
    assert res.returncode == 0, res.stderr
    results = _read(out)
    assert len(results) == 8 and "8 lines: 8 done (7 errors)" in res.stderr
    by_id = {r["custom_id"]: r for r in results}
    Completion.model_validate(by_id["ok"]["response"]["body"])
    errors = {r["custom_id"]: BatchError.model_validate(r["error"]) for r in results
              if r["error"]}
    assert errors["wrong-url"].code == "invalid_url" and errors["wrong-url"].param == "url"
    assert errors["bad-body"].param == "temperature"
    assert by_id["bad-body"]["response"]["status_code"] == 400     # the server's own 400 body
    assert "temperature" in by_id["bad-body"]["response"]["body"]["error"]["message"]
    assert errors["streamed"].param == "body.stream"
    assert errors["long-prediction"].param == "prediction"
    assert "longer than any output" in errors["long-prediction"].message
    assert errors["file-prediction"].param.startswith("prediction")
    # lines without a custom_id are reported by line number
    no_id = sorted(r["error"]["line"] for r in results if r["custom_id"] is None)
    assert no_id == [1, 5]
    # a rerun finds everything done
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
    assert res.returncode == 0 and len(_read(out)) == 8
    assert "8 already in the output" in res.stderr


def test_duplicate_custom_ids_are_refused_before_any_work(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [_completion("a"), _completion("b"), _completion("a")])
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
    assert res.returncode == 2
    assert "custom_id 'a' appears on lines 1 and 3" in res.stderr
    assert not out.exists() or out.read_text() == ""


def test_kill_9_mid_batch_then_a_rerun_completes_without_duplicates(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"req-{i}" for i in range(8)]
    _write(inp, [_completion(cid, prompt=f"Count from {i} to {i + 40}:", n=40)
                 for i, cid in enumerate(ids)])
    proc = subprocess.Popen([sys.executable, "-m", "ngramspec", "run-batch", "-i", str(inp),
                             "-o", str(out), *FLAGS], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and out.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = out.read_bytes()
    done_before = [r["custom_id"] for r in _read(out)]
    assert 2 <= len(done_before) < 8
    with open(out, "ab") as f:      # a line cut by the kill mid-write
        f.write(b'{"id": "batch_req_cut", "custom_id": "req-')
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
    assert res.returncode == 0, res.stderr
    results = _read(out)
    assert sorted(r["custom_id"] for r in results) == sorted(ids)
    assert out.read_bytes().startswith(before)      # what was written stays as it was
    assert f"{len(done_before)} already in the output" in res.stderr


# -- on the scheduler and the app directly ------------------------------------------------------

@pytest.fixture(scope="module")
def sched():
    s = Scheduler(None, n_slots=2, n_ctx=2048, n_threads=1, spec_type="ngram-mod",
                  spec_params={"ngram_mod_n_min": 8, "ngram_mod_n_max": 32})
    s.start()
    yield s
    s.stop()


def _code_edit():
    text = (EXAMPLES / "code_edit_prompt.txt").read_text()
    code = text.split("```python\n", 1)[1].rsplit("```", 1)[0]
    return text + "```python\n", code


def test_a_prediction_leaves_greedy_output_unchanged(sched):
    prompt_text, code = _code_edit()
    prompt = sched.tokenize(prompt_text)
    greedy = SamplingParams(temperature=0, max_tokens=64)
    plain = sched.submit(prompt, greedy).result()
    lines = code.splitlines(keepends=True)
    edited = "".join(lines[:3] + ["# an inserted line\n"] + lines[3:8] + lines[10:])
    for pred_text in (code, edited, "nothing like the output at all " * 5):
        pred = sched.tokenize(pred_text, add_bos=False, special=False)
        done = sched.submit(prompt, greedy, prediction=pred).result()
        assert done.tokens == plain.tokens
        assert done.n_acc_tokens >= done.accepted_prediction_tokens
        if pred_text == code:
            assert done.accepted_prediction_tokens > 40
            assert done.rejected_prediction_tokens < done.accepted_prediction_tokens
    with pytest.raises(ValueError, match="prediction"):
        sched.submit(prompt, greedy, prediction=[sched.n_vocab])
    with pytest.raises(ValueError, match="prediction: 1025 tokens is longer"):
        sched.submit(prompt, greedy, prediction=[5] * (sched.n_ctx_slot + 1))


def test_a_prediction_leaves_a_seeded_sample_unchanged(sched):
    # Each output position is sampled once, in order, from one seeded chain whether or not a
    # draft is being verified (sample_run): the same seed gives the same tokens, so the
    # distribution is the plain one.
    prompt_text, code = _code_edit()
    prompt = sched.tokenize(prompt_text)
    sampled = SamplingParams(temperature=0.7, seed=1234, max_tokens=48)
    plain = sched.submit(prompt, sampled).result()
    pred = sched.tokenize(code, add_bos=False, special=False)
    done = sched.submit(prompt, sampled, prediction=pred).result()
    assert done.tokens == plain.tokens
    assert done.accepted_prediction_tokens > 0


def _post(app, path, body):
    from fastapi.testclient import TestClient
    with TestClient(app) as client:
        return client.post(path, json=body), client.get("/v1/models").json()


# The embedded model copies a think block from examples of one (its real output is split).
_SAY_HI = [{"role": "user", "content": "Say hi."},
           {"role": "assistant", "content": "<think>A greeting.</think>Hi!"}]
THINK = _SAY_HI * 4 + [{"role": "user", "content": "Say hi."}]


def _chat(reasoning_format, **extra):
    s = Scheduler(None, n_slots=1, n_ctx=1024, n_threads=1, spec_type="ngram-mod")
    app = create_app(s, reasoning_format=reasoning_format)
    r, _ = _post(app, "/v1/chat/completions", {"messages": THINK, "temperature": 0,
                                               "max_tokens": 32, **extra})
    assert r.status_code == 200, r.text
    return r


def test_reasoning_content_splits_the_models_own_think_block():
    raw = _chat("none").json()["choices"][0]["message"]
    text = raw["content"]           # --reasoning-format none: as generated
    assert "reasoning_content" not in raw       # no field of OpenAI's schema
    assert text.lstrip().startswith("<think>") and "</think>" in text, text
    reasoning = text.split("<think>", 1)[1].split("</think>", 1)[0].strip()
    content = text.split("</think>", 1)[1].lstrip()
    assert reasoning and content
    message = _chat("deepseek").json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    # streamed: delta.reasoning_content, then delta.content, the same texts
    r = _chat("deepseek", stream=True)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    # a chunk carries reasoning or content, never both; none carries a null reasoning field
    assert not [d for d in deltas if d.get("reasoning_content") and d.get("content")]
    assert all(d.get("reasoning_content", "x") is not None for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])
    r = _chat("none", stream=True)
    plain = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
             if line.startswith("data: {") and '"choices":[{' in line]
    assert plain and not any("reasoning_content" in d for d in plain)
    assert "".join(d.get("content") or "" for d in plain) == text


def test_the_draft_model_answers_alone_in_its_own_context():
    target = Scheduler(None, n_slots=1, n_ctx=1024, n_threads=1, spec_type="ngram-mod")
    draft = Scheduler(target.llm, n_slots=1, n_ctx=1024, n_threads=1, spec_type="none")
    app = create_app(target, model_name="target", models={"small": draft})
    r, models = _post(app, "/v1/completions", {"model": "small", "prompt": "Once upon a time",
                                                "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["model"] == "small"
    assert [m["id"] for m in models["data"]] == ["target", "small"]
    assert draft.stats()["requests_finished"] == 1
    assert target.stats()["requests_submitted"] == 0     # the target's slots and cache untouched


def test_serve_builds_the_draft_models_own_scheduler():
    from ngramspec.cli import build_parser
    from ngramspec.cli.serve import build_scheduler
    from ngramspec.llama.model import default_model_path

    args = build_parser().parse_args(["serve", "-t", "1", "-c", "512", "-np", "1",
                                      "-md", default_model_path()])
    model, target, others = build_scheduler(args)
    name = os.path.basename(default_model_path()) + "-draft"     # the model as its own draft
    assert list(others) == [name] and others[name].spec_types == ()
    assert "draft-simple" in target.spec_types
    assert others[name].llm is not target.llm
    for s in (target, *others.values()):
        s.stop()
