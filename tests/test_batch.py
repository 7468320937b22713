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
from ngramspec.llama.backend import LlamaBackend  # noqa: E402
from ngramspec.llama.scheduler import Scheduler  # noqa: E402
from ngramspec.config import SpecConfig  # noqa: E402
from ngramspec.request_params import SamplingParams  # noqa: E402
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
    assert not out.exists()


def _counting_batch(inp, n_requests, n_tokens):
    """A batch of ``n_requests`` counting prompts; their custom_ids."""
    ids = [f"req-{i}" for i in range(n_requests)]
    _write(inp, [_completion(cid, prompt=f"Count from {i} to {i + n_tokens}:", n=n_tokens)
                 for i, cid in enumerate(ids)])
    return ids


def _run_batch_until(inp, out, reached, seconds=300):
    """``run-batch`` in its own process, returned once ``reached()`` holds while it runs."""
    proc = subprocess.Popen([sys.executable, "-m", "ngramspec", "run-batch", "-i", str(inp),
                             "-o", str(out), *FLAGS], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not reached():
        time.sleep(0.05)
    if proc.poll() is not None or time.time() >= deadline:
        proc.kill()
        pytest.fail(f"run-batch ended (rc {proc.wait()}) or took {seconds} s before the "
                    "moment the test needs")
    return proc


def test_kill_9_mid_batch_then_a_rerun_completes_without_duplicates(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _counting_batch(inp, 8, 40)
    proc = _run_batch_until(inp, out,
                            lambda: out.exists() and out.read_text().count("\n") >= 2)
    try:
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
    s = Scheduler(None, SpecConfig.from_keywords("ngram-mod", profile="serve"), n_slots=2,
                  n_ctx=2048, n_threads=1)
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
    s = Scheduler(None, SpecConfig("ngram-mod"), n_slots=1, n_ctx=1024, n_threads=1)
    app = create_app(LlamaBackend(s), reasoning_format=reasoning_format)
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
    target = Scheduler(None, SpecConfig("ngram-mod"), n_slots=1, n_ctx=1024, n_threads=1)
    draft = Scheduler(target.llm, SpecConfig("none"), n_slots=1, n_ctx=1024, n_threads=1)
    app = create_app(LlamaBackend(target), model_name="target",
                     models={"small": LlamaBackend(draft)})
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


# -- issue 34: each bad line is its own error; a full disk is one clean error ------------------

def test_each_bad_line_is_its_own_error_with_its_line_number(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps(_completion("ok-cr")).replace(", ", ",\r ").encode(),   # \r: whitespace
             b'{"custom_id": "utf8", "method": "POST", "note": "caf\xe9"}',
             b"[" * 100000,
             b'{"custom_id": "broken", ',
             json.dumps(_completion("bad-body", temperature="hot")).encode(),
             json.dumps(_completion("long", prompt="x" * 300000)).encode(),
             b'{"custom_id": "\\ud800", "url": "/v1/embeddings"}']   # no UTF-8 for it
    inp.write_bytes(b"\n".join(lines) + b"\n")
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS, "--max-body-size", "200000")
    assert res.returncode == 0, res.stderr
    assert "7 lines: 7 done (6 errors)" in res.stderr
    results = _read(out)
    by_line = {r["error"]["line"]: r for r in results if r["error"]}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7]
    assert by_line[7]["custom_id"] == "\ud800" and by_line[7]["error"]["code"] == "invalid_url"
    ok = next(r for r in results if r["error"] is None)
    assert ok["custom_id"] == "ok-cr" and ok["response"]["status_code"] == 200
    for n, needle in [(2, "line 2 is not UTF-8 text"), (3, "line 3 is not JSON"),
                      (4, "line 4 is not JSON"),
                      (6, "line 6 (300") ]:
        assert needle in by_line[n]["error"]["message"], by_line[n]
        assert by_line[n]["custom_id"] is None
    assert "nested too deeply" in by_line[3]["error"]["message"]
    assert "(column " in by_line[4]["error"]["message"]
    assert "line 1" not in by_line[4]["error"]["message"]     # JSON's own line: always 1
    assert "longer than the limit of 200000 bytes (--max-body-size)" in \
        by_line[6]["error"]["message"]
    assert by_line[5]["custom_id"] == "bad-body" and by_line[5]["error"]["param"] == "temperature"
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS, "--max-body-size", "200000")
    assert res.returncode == 0 and "7 already in the output" in res.stderr
    assert len(_read(out)) == 7


def _file_size_limit(n_bytes):
    def limit():
        # EFBIG on the real write path, as a full disk gives ENOSPC, instead of a SIGXFSZ death
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))
    return limit


def test_a_full_disk_is_one_error_line_and_a_rerun_completes(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = [f"req-{i}" for i in range(12)]
    _write(inp, [_completion(cid, prompt=f"Count from {i}:", n=4) for i, cid in enumerate(ids)])
    r = subprocess.run([sys.executable, "-m", "ngramspec", "run-batch", "-i", str(inp),
                        "-o", str(out), *FLAGS], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, preexec_fn=_file_size_limit(1500),
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 2, r.stderr
    assert "Task exception" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"-o {out}: cannot write a result: File too large" in r.stderr
    written = out.read_bytes()
    assert len(written) <= 1500
    complete = written[:written.rfind(b"\n") + 1]
    res = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
    assert res.returncode == 0, res.stderr
    assert sorted(r["custom_id"] for r in _read(out)) == sorted(ids)
    assert out.read_bytes().startswith(complete)


def test_two_runs_on_one_output_the_second_exits_2(tmp_path, capsys):
    import fcntl
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _counting_batch(inp, 4, 60)

    def locked():               # the first run holds the output's lock
        if not out.exists():
            return False
        with open(out, "rb") as probe:
            try:
                fcntl.flock(probe.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
        return False
    first = _run_batch_until(inp, out, locked)
    try:
        second = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
        assert second.returncode == 2
        assert f"-o {out}: another run-batch is writing this file" in second.stderr
        assert first.wait(600) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert sorted(r["custom_id"] for r in _read(out)) == sorted(ids)    # each once
