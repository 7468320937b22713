"""``run-batch``'s files (issue 34 section 1): an output that is not this command's result file
is never changed, the output is locked for the run, and the input is read as bytes, a line at a
time, within the body limit.

Everything here is refused before a model loads (no llama_cpp needed); the runs that answer
requests are in tests/test_batch.py.
"""
import fcntl
import json
import os
import resource
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from clitools import cli  # noqa: E402
from conftest import ROOT  # noqa: E402

from ngramspec.server.batch import open_batch, scan_input  # noqa: E402
from ngramspec.server.batch_files import LineTooLong, ResultFile, request_lines  # noqa: E402

FLAGS = ("-t", "1", "-c", "256", "-np", "1", "--no-progress")


def _request(cid, prompt="The capital of France is"):
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 4}})


def _result(cid):
    return json.dumps({"id": "batch_req_" + cid.encode().hex()[:24], "custom_id": cid,
                       "response": {"status_code": 200, "request_id": "x", "body": {}},
                       "error": None})


REQUESTS = (_request("a") + "\n" + _request("b") + "\n").encode()


def _refused(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


@pytest.mark.parametrize("content", [
    b'{"db_password": "x"}',                  # the settings file: 40 bytes gone before
    b'{"db_password": "x"}\n',
    REQUESTS,                                 # -i and -o swapped: a request file
    REQUESTS[:-1],                            # ... without its final newline
    (_result("a") + "\n").encode() + b'{"note": "not ours"}',   # a foreign last line
    (_result("a") + "\n" + '{"id": "batch_req_1", "custom_id": "b"}' + "\n").encode(),
    b"\x00\x01binary data\n" * 3,
])
def test_an_output_that_is_not_a_result_file_is_left_as_it_was(tmp_path, capsys, content):
    inp, out = tmp_path / "in.jsonl", tmp_path / "settings.json"
    inp.write_bytes(REQUESTS)
    out.write_bytes(content)
    # a model that does not exist: whatever happens, nothing loads
    r = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS, "--model", tmp_path / "x.gguf")
    _refused(r, f"-o {out}", "not a batch result line", "left as it was")
    assert out.read_bytes() == content


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink"])
def test_an_output_that_is_the_input_is_refused(tmp_path, capsys, link):
    inp = tmp_path / "same.jsonl"
    inp.write_bytes(REQUESTS[:-1])            # no final newline: its last request went before
    out = {"same": lambda: inp, "symlink": lambda: tmp_path / "link.jsonl",
           "hardlink": lambda: tmp_path / "hard.jsonl"}[link]()
    if link == "symlink":
        out.symlink_to(inp)
    elif link == "hardlink":
        os.link(inp, out)
    r = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS, "--model", tmp_path / "x.gguf")
    _refused(r, f"-o {out} is the input file -i {inp}")
    assert inp.read_bytes() == REQUESTS[:-1]


def test_a_cut_result_line_stays_until_the_run_writes(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(REQUESTS)
    content = (_result("a") + "\n").encode() + b'{"id": "batch_req_cut", "custom_id": "b'
    out.write_bytes(content)
    r = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS, "--model", tmp_path / "x.gguf")
    _refused(r, "--model", "not found")       # the run fails at the model ...
    assert out.read_bytes() == content       # ... and the output is as it was
    with open_batch(str(inp), str(out)) as batch:
        assert (batch.lines, batch.skipped) == (2, 1)
        assert batch.output.done_ids == {"a"}
        assert out.read_bytes() == content
        batch.output.start()                  # what a run does first: the cut line goes
        assert out.read_bytes() == (_result("a") + "\n").encode()


def test_a_second_run_on_the_same_output_exits_2_naming_it(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(REQUESTS)
    out.write_bytes((_result("a") + "\n").encode())
    with open(out, "rb") as held:             # another run holds the file (flock, as ours)
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = cli(capsys, "run-batch", "-i", inp, "-o", out, *FLAGS)
        _refused(r, f"-o {out}", "another run-batch is writing this file")
        with pytest.raises(ValueError, match="locked"):
            ResultFile(str(out), str(inp))
    assert out.read_bytes() == (_result("a") + "\n").encode()
    with open_batch(str(inp), str(out)) as batch:    # free again
        with pytest.raises(ValueError, match="another run-batch"):
            open_batch(str(inp), str(out))           # one process, two runs: refused too
        assert batch.skipped == 1


def test_fifo_and_device_are_refused(tmp_path, capsys):
    inp, fifo = tmp_path / "in.jsonl", tmp_path / "fifo"
    inp.write_bytes(REQUESTS)
    os.mkfifo(fifo)
    _refused(cli(capsys, "run-batch", "-i", fifo, "-o", tmp_path / "o", *FLAGS), f"-i {fifo}",
             "FIFO")
    _refused(cli(capsys, "run-batch", "-i", inp, "-o", fifo, *FLAGS), f"-o {fifo}",
             "not a regular file")
    _refused(cli(capsys, "run-batch", "-i", "/dev/zero", "-o", tmp_path / "o", *FLAGS),
             "-i /dev/zero", "character device")
    # a new output that a failed run never wrote to is not left behind, an old one stays
    _refused(cli(capsys, "run-batch", "-i", inp, "-o", tmp_path / "o", *FLAGS, "--model",
                 tmp_path / "x.gguf"), "model file not found")
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").write_bytes(b"")
    _refused(cli(capsys, "run-batch", "-i", inp, "-o", tmp_path / "o", *FLAGS, "--model",
                 tmp_path / "x.gguf"), "model file not found")
    assert (tmp_path / "o").read_bytes() == b""


def test_lines_are_split_on_newline_only_with_their_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _request("a").encode() + b"\n"
                     b"\n   \n"
                     + _request("b\rc").replace("\\r", "\r").encode().replace(b"{", b"{\r", 1)
                     + b"\n\xff\xfe\n" + b"x" * 5000 + b"\n" + b"[" * 100000 + b"\n"
                     + b"y" * 5000)
    got = list(request_lines(str(path), 4096))
    assert [n for n, _ in got] == [1, 4, 5, 6, 7, 8]
    assert got[0][1] == _request("a").encode()              # the byte-order mark dropped
    assert got[1][1].startswith(b"{\r") and b"b\rc" in got[1][1]   # one line, \r kept
    assert isinstance(got[3][1], LineTooLong) and got[3][1].size == 5000
    assert isinstance(got[5][1], LineTooLong) and got[5][1].size == 5000   # no final newline
    assert got[2][1] == b"\xff\xfe"
    assert isinstance(got[4][1], LineTooLong) and got[4][1].size == 100000


def test_duplicate_ids_are_found_by_line_number(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(REQUESTS + b"\n" + _request("a").encode() + b"\n")
    with pytest.raises(ValueError, match="custom_id 'a' appears on lines 1 and 4"):
        scan_input(str(path))


_MEASURE = """
import resource, sys
from ngramspec.server.batch import open_batch
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open_batch(sys.argv[1], sys.argv[2], max_line=1 << 20) as batch:
    pass
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(batch.lines, batch.skipped, len(batch.output.done_ids), (after - before) // 1024)
"""


def test_resume_and_long_lines_are_streamed(tmp_path):
    """A 64 MiB input line is skipped unread and a 64 MiB output is read a line at a time: the
    peak memory grows by far less than either (it grew by several times each before)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "wb") as f:
        f.write(REQUESTS)
        f.write(b'{"custom_id": "long", "body": "' + b"z" * (64 << 20) + b'"}\n')
    filler = "w" * 4000
    with open(out, "wb") as f:
        for i in range(16000):                  # ~64 MiB of result lines
            line = json.loads(_result(f"done-{i}"))
            line["response"]["body"] = {"text": filler}
            f.write(json.dumps(line).encode() + b"\n")
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(inp), str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines, skipped, done, grown_mib = map(int, r.stdout.split())
    assert (lines, skipped, done) == (3, 0, 16000)
    assert grown_mib < 24, grown_mib


def test_limit_flags_are_serves(capsys):
    r = cli(capsys, "run-batch", "--help")
    flat = " ".join(r.stdout.split())
    assert "--max-body-size BYTES" in flat and "--escape-special-in-input" in flat
    r = cli(capsys, "run-batch", "-i", "x", "-o", "y", "--max-body-size", "10")
    assert r.returncode == 2 and "--max-body-size: 10 is out of range" in r.stderr


def test_the_summary_line_reads_the_runs_draft_counts():
    """The summary embeds the one counter type (`DraftCounts`): the run's counts are the
    scheduler's after the run minus before it, and the line states them as it always did."""
    from ngramspec.server.batch import BatchSummary
    from ngramspec.stats import DraftCounts
    before = {"n_draft_tokens": 2, "n_acc_tokens": 1, "requests_finished": 4}
    after = {"n_draft_tokens": 10, "n_acc_tokens": 7, "requests_finished": 9}
    run = DraftCounts.of(after).minus(DraftCounts.of(before))
    assert (run.n_draft_tokens, run.n_acc_tokens, run.n_drafts) == (8, 6, 0)
    summary = BatchSummary(lines=5, skipped=1, done=4, errors=1, prompt_tokens=30,
                           completion_tokens=20, seconds=2.0, counts=run,
                           accepted_prediction_tokens=3, rejected_prediction_tokens=2)
    assert (summary.n_draft_tokens, summary.n_acc_tokens) == (8, 6)
    assert summary.line() == (
        "5 lines: 4 done (1 errors), 1 already in the output; 30 prompt + 20 completion "
        "tokens in 2.0 s (10.0 tokens/s); 6/8 draft tokens accepted (75.0%), prediction "
        "tokens 3 accepted / 2 rejected")
    assert BatchSummary().line().endswith("(0.0 tokens/s); no drafts")
