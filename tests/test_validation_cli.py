"""Validation of trace files and of the command line (issue 4, item 1): a bad file names the
file and its line; the command line turns bad files and flags into one line on stderr and exit
code 2, never a traceback.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from ngramspec.cli import main as cli_main
from ngramspec.traces import TraceError, read_requests

from conftest import ROOT
from validation_common import CHAIN


# ---------------------------------------------------------------------------------------------
# trace files (Python API)
# ---------------------------------------------------------------------------------------------

def _write(path, text: str | bytes):
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


GOOD_LINE = json.dumps({"prompt": [1, 2, 3, 1, 2, 3, 1, 2], "output": [3, 1, 2, 3]})


def test_trace_errors_name_file_and_line(tmp_path):
    cases = {
        "malformed.jsonl": (GOOD_LINE + "\n" + '{"prompt": [1, 2,\n', 2, "malformed JSON"),
        "field.jsonl": (GOOD_LINE + "\n" + '{"prompt": "abc", "output": [1]}\n', 2,
                        "field 'prompt' must be a list of integer token ids"),
        "missing.jsonl": (GOOD_LINE + "\n\n" + '{"output": [1]}\n', 3, "missing field 'prompt'"),
        "negative.jsonl": (GOOD_LINE + "\n" + '{"prompt": [1, -1], "output": [1]}\n', 2,
                           "field 'prompt'[1] = -1 is not a token id: ids must be in "
                           "0 .. 2147483647"),
        "huge.jsonl": ('{"prompt": [1], "output": [1, 100000000000000000000000]}\n', 1,
                       "field 'output'[1] = 100000000000000000000000 is not a token id: "
                       "ids must be in 0 .. 2147483647"),
        "notobject.jsonl": ("[1, 2]\n", 1, "expected a JSON object per line"),
        "deep.jsonl": (GOOD_LINE + "\n" + '{"prompt": ' + "[" * 100_000 + "]" * 100_000
                       + ', "output": [1]}\n', 2, ""),
    }
    for name, (text, line, what) in cases.items():
        path = _write(tmp_path / name, text)
        with pytest.raises(TraceError) as exc:
            read_requests(path)
        assert str(exc.value).startswith(f"{path}:{line}: {what}"), str(exc.value)


def test_trace_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match=re.escape(f"{path}: no such file")):
        read_requests(path)


def test_trace_truncated_gzip(tmp_path):
    lines = "".join(json.dumps({"prompt": list(range(i, i + 300)), "output": [1, 2]}) + "\n"
                    for i in range(300))
    data = gzip.compress(lines.encode())
    path = _write(tmp_path / "cut.jsonl.gz", data[:len(data) // 2])
    with pytest.raises(TraceError, match=re.escape(path) + r":\d+: corrupt or truncated gzip"):
        read_requests(path)
    path = _write(tmp_path / "plain.jsonl.gz", lines.encode())
    with pytest.raises(TraceError, match=re.escape(path) + r":1: corrupt or truncated gzip"):
        read_requests(path)


def test_trace_bad_utf8_names_its_line(tmp_path):
    path = _write(tmp_path / "latin.jsonl", (GOOD_LINE + "\n").encode() * 3
                  + b'{"id": "\xff", "prompt": [1], "output": [1]}\n')
    with pytest.raises(TraceError, match=re.escape(path) + r":4: not UTF-8"):
        read_requests(path)


# ---------------------------------------------------------------------------------------------
# the command line: one line on stderr, exit code 2, no traceback
# ---------------------------------------------------------------------------------------------

def _cli(args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "ngramspec", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc, *needles):
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    for needle in needles:
        assert needle in err, (needle, err)


def test_cli_file_errors(tmp_path):
    """The issue's cases, each through ``python -m ngramspec replay`` in a subprocess."""
    lines = "".join(json.dumps({"prompt": list(range(i, i + 300)), "output": [1, 2]}) + "\n"
                    for i in range(300))
    data = gzip.compress(lines.encode())
    _write(tmp_path / "cut.jsonl.gz", data[:len(data) // 2])
    _write(tmp_path / "malformed.jsonl", GOOD_LINE + "\n" + GOOD_LINE + "\n" + '{"prompt": [1,\n')
    _write(tmp_path / "types.jsonl", GOOD_LINE + "\n" + '{"prompt": [1, 2], "output": "ab"}\n')
    _write(tmp_path / "floats.jsonl", '{"prompt": [1.0, 2.0], "output": [1]}\n')
    cases = [
        (["malformed.jsonl"], ["malformed.jsonl:3:", "malformed JSON"]),
        (["cut.jsonl.gz"], ["cut.jsonl.gz:", "truncated gzip"]),
        (["missing.jsonl"], ["missing.jsonl", "no such file"]),
        (["types.jsonl"], ["types.jsonl:2:", "'output'"]),
        (["floats.jsonl"], ["floats.jsonl:1:", "'prompt'"]),
    ]
    for args, needles in cases:
        proc = _cli(["replay", *args, "--spec-type", "ngram-mod"], tmp_path)
        _assert_one_line_error(proc, *needles)
        assert re.search(r"\.jsonl(\.gz)?(:\d+)?: ", proc.stderr), proc.stderr


def test_cli_bad_flags(tmp_path):
    _write(tmp_path / "ok.jsonl", GOOD_LINE + "\n")
    cases = [
        (["--spec-type", "ngram-foo"], ["unknown spec type 'ngram-foo'"]),
        (["--spec-ngram-mod-n-match", "0"], ["--spec-ngram-mod-n-match = 0 is out of range"]),
        (["--spec-ngram-mod-n-max", "abc"], ["--spec-ngram-mod-n-max", "invalid int value"]),
        (["--slots", "0"], ["--slots"]),
        (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    ]
    for flags, needles in cases:
        proc = _cli(["replay", "ok.jsonl", *flags], tmp_path)
        _assert_one_line_error(proc, *needles)


def _cli_in_process(argv, capsys):
    """main() as the console script runs it; returns (exit code, stderr)."""
    try:
        rc = cli_main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--spec-type", "draft-mtp"], "'draft-mtp' is not supported"),
    (["--spec-ngram-simple-size-n", "1025"], "--spec-ngram-simple-size-n = 1025 is out of range"),
    (["--spec-ngram-map-k-size-m", "0"], "--spec-ngram-map-k-size-m = 0 is out of range"),
    (["--spec-ngram-map-k4v-min-hits", "0"], "--spec-ngram-map-k4v-min-hits = 0 is out of range"),
    (["--spec-ngram-mod-n-min", "-1"],
     "--spec-ngram-mod-n-min = -1 is out of range: allowed 0 .. 1024"),
    (["--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "4"],
     "--spec-ngram-mod-n-min = 8 is greater than --spec-ngram-mod-n-max = 4"),
    (["--spec-type", "draft-eagle3"], "allowed none, ngram-suffix, ngram-simple"),
    (["--spec-ngram-mod-n-match", "2.5"], "invalid int value: '2.5'"),
    (["--limit", "0"], "--limit"), (["--repeat", "-3"], "--repeat"), (["--slots", "x"], "--slots"),
    (["--state", "stale"], "invalid choice: 'stale'"),
    (["--ctx-size", "-5"], "--ctx-size"),
    (["--output", "/nonexistent-dir/out.jsonl"], "/nonexistent-dir/out.jsonl"),
])
def test_cli_bad_flags_in_process(tmp_path, capsys, flags, needle):
    path = _write(tmp_path / "ok.jsonl", GOOD_LINE + "\n")
    rc, err = _cli_in_process(["replay", path, *flags], capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("name, content, needle", [
    ("huge.jsonl", '{"prompt": [1, 2], "output": [1, 99999999999999999999999]}\n', "huge.jsonl:1:"),
    ("neg.jsonl", '{"prompt": [1, -2], "output": [1]}\n', "neg.jsonl:1:"),
    ("big.jsonl", '{"prompt": [1, 2147483648], "output": [1]}\n', "big.jsonl:1:"),
    ("bools.jsonl", '{"prompt": [true], "output": [1]}\n', "bools.jsonl:1:"),
    ("null.jsonl", '{"prompt": [1], "output": null}\n', "null.jsonl:1:"),
    ("array.jsonl", GOOD_LINE + "\n[1, 2, 3]\n", "array.jsonl:2:"),
    ("deep.jsonl", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "deep.jsonl:1:"),
    ("latin1.jsonl", b'{"prompt": [1], "output": [1], "id": "\xe9"}\n', "latin1.jsonl:1:"),
    ("notgz.jsonl.gz", GOOD_LINE + "\n", "notgz.jsonl.gz:1:"),
], ids=["huge", "negative", "big", "bools", "null", "array", "deep", "latin1", "notgz"])
def test_cli_bad_files_in_process(tmp_path, capsys, name, content, needle):
    path = _write(tmp_path / name, content)
    rc, err = _cli_in_process(["replay", path, "--spec-type", "ngram-simple"], capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and needle in err, err


def test_cli_directory_instead_of_file(tmp_path, capsys):
    rc, err = _cli_in_process(["replay", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 1 and str(tmp_path) in err, err


def test_cli_empty_requests_are_not_errors(tmp_path, capsys):
    path = _write(tmp_path / "edge.jsonl", "\n".join([
        '{"prompt": [], "output": [1, 2, 3]}', '{"prompt": [1, 2, 3], "output": []}',
        '{"prompt": [], "output": []}', "", GOOD_LINE]) + "\n")
    _write(tmp_path / "empty.jsonl", "")
    for f in (path, str(tmp_path / "empty.jsonl")):
        rc, err = _cli_in_process(["replay", f, "--spec-type", CHAIN], capsys)
        assert rc == 0 and err == "", err



def test_cli_number_flags_report_through_argparse(capsys):
    rc, err = _cli_in_process(["serve", "--port", "70000"], capsys)
    assert rc == 2 and "argument --port: 70000 is out of range: allowed 0 .. 65535" in err, err
    rc, err = _cli_in_process(["serve", "--read-timeout", "nan"], capsys)
    assert rc == 2 and "argument --read-timeout: nan is out of range: allowed >= 0.001" in err, err
    rc, err = _cli_in_process(["serve", "--port", "x"], capsys)
    assert rc == 2 and "argument --port: invalid int value: 'x'" in err, err
