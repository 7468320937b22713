"""``ngramspec replay``: output formats and options, run as users run it."""
import gzip
import json
import os
import subprocess
import sys

import pytest

from conftest import GOLDEN, ROOT, TRACES
from golden import read_golden


def run_cli(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "ngramspec", *args], capture_output=True,
                          text=True, env=env, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_replay_prints_table_and_llamacpp_lines():
    out = run_cli("replay", str(TRACES / "code-edit.jsonl.gz"), "--spec-type", "ngram-mod",
                  "--limit", "3").stdout
    assert "tokens per step" in out and "us per draft call" in out
    assert "statistics        ngram-mod: #calls(b,g,a) =    3 " in out
    assert "draft acceptance = 0." in out


def test_replay_output_is_golden_format(tmp_path):
    golden = GOLDEN / "model-generated.chain.shared-2slots.jsonl.gz"
    header, expected = read_golden(golden)
    out = tmp_path / "out.jsonl"
    run_cli("replay", str(TRACES / "model-generated.jsonl.gz"), "--spec-type",
            "ngram-mod,ngram-map-k4v,ngram-simple", "--slots", "2",
            "--limit", str(header["summary"]["n_traces"]), "--drafts", "--repeat", "2",
            "--output", str(out))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    summary = lines[0]["summary"]
    for key in ("us_per_gen_call", "us_per_acc_call", "us_per_begin_call"):
        assert summary[key] > 0
    assert summary["repeat"] == 2
    want = header["summary"]
    for key in ("n_traces", "n_output", "n_steps", "n_drafts", "n_draft_tokens",
                "n_acc_tokens", "acc_rate"):
        assert summary[key] == want[key]
    assert [{k: s[k] for k in want["llama_stats"][0]} for s in summary["llama_stats"]] \
        == want["llama_stats"]
    assert len(lines) - 1 == len(expected)
    for got, exp in zip(lines[1:], expected):
        assert got["steps"] == exp["steps"] and got["drafts"] == exp["drafts"]
        assert got["id"] == exp["id"] and got["slot"] == exp["slot"]


def test_replay_fresh_state_and_plain_jsonl(tmp_path):
    src = tmp_path / "t.jsonl"
    with gzip.open(TRACES / "chat.jsonl.gz", "rt") as f:
        src.write_text("".join(next(f) for _ in range(3)))
    out = tmp_path / "o.jsonl"
    run_cli("replay", str(src), "--spec-type", "ngram-simple", "--state", "fresh",
            "--output", str(out))
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["summary"]["state"] == "fresh"
    assert "drafts" not in json.loads(lines[1])


@pytest.mark.parametrize("args, message", [
    (["--spec-type", "ngram-bogus"], "unknown spec type 'ngram-bogus'"),
    (["--spec-ngram-mod-n-match", "0"], "--spec-ngram-mod-n-match = 0 is out of range: allowed 1 .. 1024"),
    (["--slots", "0"], "--slots"),
])
def test_replay_bad_flags_one_line_exit_2(args, message):
    proc = run_cli("replay", str(TRACES / "chat.jsonl.gz"), "--limit", "1", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_replay_bad_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1, 2], "output": [3]}\n{"prompt": [1, \n')
    proc = run_cli("replay", str(bad), check=False)
    assert proc.returncode == 2
    assert f"{bad}:2: malformed JSON" in proc.stderr and "Traceback" not in proc.stderr
