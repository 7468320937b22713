"""Command-line input that used to mislead or crash (issue 20 points 9-10, issue 14 point 5).

Every error is one line on stderr with exit code 2, naming the flag (or file and line) and the
allowed range. Runs in-process (`clitools.cli`) except where a fresh interpreter is the point.
"""
import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from clitools import cli
from conftest import ROOT, TRACES

from ngramspec import traces
from ngramspec.traces import TraceError, read_requests

GOOD = json.dumps({"prompt": [1, 2, 3, 1, 2, 3], "output": [1, 2, 3]})


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.endswith("\n") and r.stderr.count("\n") == 1, repr(r.stderr)
    for needle in needles:
        assert needle in r.stderr, (needle, r.stderr)


def write(path, text):
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


# ---------------------------------------------------------------------------------------------
# issue 20 point 9: --prompt-tokens ids are checked before the int32 conversion
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, shown", [
    ([4294967297, 4294967298], "4294967298"),   # wrapped to [1, 2] before (the largest is named)
    ([2**63], str(2**63)),                        # became [0]
    ([5, 2**31], str(2**31)),
    ([-1], "-1"),
])
def test_prompt_tokens_range_checked_before_conversion(tmp_path, capsys, ids, shown):
    path = write(tmp_path / "p.json", json.dumps(ids))
    r = cli(capsys, "generate", "--prompt-tokens", path, "-n", "1")
    one_line_error(r, f"--prompt-tokens {path}[", f"= {shown} is not a token id",
                   "0 .. 2147483647")


def test_prompt_tokens_huge_integer_names_the_flag(tmp_path, capsys):
    path = write(tmp_path / "p.json", "[" + "7" * 5000 + "]")
    r = cli(capsys, "generate", "--prompt-tokens", path, "-n", "1")
    one_line_error(r, f"--prompt-tokens {path}", "4300 digits")


def test_prompt_tokens_as_python_ints_keep_their_value():
    """The Python API (the drivers' one validator): ids beyond int32 are refused, not wrapped."""
    from ngramspec.tokens import token_array
    with pytest.raises(ValueError, match=r"prompt_tokens\[1\] = 4294967298 is not a token id: "
                                         r"ids must be in 0 \.\. 2147483647"):
        token_array([4294967297, 4294967298], "prompt_tokens", non_empty=True)
    with pytest.raises(ValueError, match="is not a token id"):
        token_array([2**63], "prompt_tokens")
    with pytest.raises(ValueError, match="prompt_tokens must hold at least one token id"):
        token_array([], "prompt_tokens", non_empty=True)
    assert token_array([1, 2], "prompt_tokens").tolist() == [1, 2]


# ---------------------------------------------------------------------------------------------
# issue 20 point 10
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needles", [
    (["--slots", "99999999999999999999"], ["argument --slots", "1 .. 65536"]),
    (["--slots", "100000000"], ["argument --slots", "1 .. 65536"]),
    (["--spec-ngram-map-k-min-hits", "1e23"], ["--spec-ngram-map-k-min-hits", "1e23"]),
    (["--spec-ngram-map-k-min-hits", str(10**23)],
     ["--spec-ngram-map-k-min-hits", "out of range: allowed 1 .. 2147483647"]),
    (["--spec-ngram-mod-n-match", str(-2**40)], ["--spec-ngram-mod-n-match", "1 .. 1024"]),
    (["--ctx-size", str(2**40)], ["--ctx-size", "0 .. 2147483647"]),
    (["--limit", "0"], ["argument --limit", "1 .."]),
])
def test_replay_numeric_flags_one_line(tmp_path, capsys, flags, needles):
    path = write(tmp_path / "t.jsonl", GOOD + "\n")
    one_line_error(cli(capsys, "replay", path, "--spec-type", "ngram-map-k,ngram-mod", *flags),
                   *needles)


def test_memory_error_is_one_line(tmp_path):
    """An allocation the machine refuses (address-space limit): one line, exit 2. 2048 slots
    of ngram-map-k: 2 GiB of hash indexes, within the machine's memory (more would be refused
    before allocating, test_request_bounds.py), beyond this process's 1 GiB."""
    path = write(tmp_path / "t.jsonl", GOOD + "\n")
    code = ("import resource, sys; from ngramspec.cli import main; "
            "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            f"sys.exit(main(['replay', {path!r}, '--spec-type', 'ngram-map-k', "
            "'--slots', '2048']))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    one_line_error(proc, "out of memory", "--slots")


def test_trace_huge_integer_names_file_and_line(tmp_path, capsys):
    path = write(tmp_path / "t.jsonl", GOOD + "\n" + '{"prompt": [1], "output": [1], "id": '
                 + "9" * 5000 + "}\n")
    one_line_error(cli(capsys, "replay", path), f"{path}:2:", "4300 digits")


def test_cache_create_output_directory_named(tmp_path, capsys):
    r = cli(capsys, "cache", "create", "--traces", TRACES / "chat.jsonl.gz", "--limit", "2",
            "-o", tmp_path)
    one_line_error(r, f"--output {tmp_path}: is a directory")
    assert ".tmp" not in r.stderr
    assert list(tmp_path.iterdir()) == []   # nothing left behind
    r = cli(capsys, "cache", "merge", tmp_path / "none.bin", "-o", tmp_path)
    one_line_error(r, f"--output {tmp_path}: is a directory")


def test_replay_output_kept_when_the_run_fails(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    good = write(tmp_path / "good.jsonl", GOOD + "\n")
    bad = write(tmp_path / "bad.jsonl", GOOD + "\n{broken\n")
    r = cli(capsys, "replay", good, bad, "--output", out)
    one_line_error(r, f"{bad}:2:")
    assert out.read_text() == "previous results\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_replay_output_written_and_report_printed(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    good = write(tmp_path / "good.jsonl", GOOD + "\n" + GOOD + "\n")
    r = cli(capsys, "replay", good, "--spec-type", "ngram-simple", "--output", out)
    assert r.returncode == 0, r.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["summary"]["n_traces"] == 2
    assert "tokens per step" in r.stdout                 # the report, not dropped
    assert f"{out}: 3 JSON lines written" in r.stdout     # and where the records went


def test_replay_output_through_a_link_and_to_a_stream(tmp_path, capsys):
    good = write(tmp_path / "good.jsonl", GOOD + "\n")
    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    r = cli(capsys, "replay", good, "--output", link)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and len(target.read_text().splitlines()) == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    r = cli(capsys, "replay", good, "--output", fifo)
    assert r.returncode == 0, r.stderr
    assert len(reader.communicate(timeout=60)[0].splitlines()) == 2
    assert fifo.exists() and not fifo.is_file()          # still the pipe
    # a cache file is replaced atomically: a device or pipe is refused, named
    r = cli(capsys, "cache", "create", "--traces", good, "-o", fifo)
    one_line_error(r, f"--output {fifo}: is a FIFO, not a regular file")


@pytest.mark.parametrize("flags, needle", [
    (["--spec-type", "ngram-nope"], "unknown spec type 'ngram-nope'"),
    (["--spec-ngram-mod-n-match", "0"], "out of range"),
    (["--output", "/nonexistent-dir/o.jsonl"], "--output /nonexistent-dir/o.jsonl"),
])
def test_replay_checks_flags_before_reading_files(tmp_path, capsys, flags, needle):
    bad = write(tmp_path / "bad.jsonl", GOOD + "\n{broken\n")
    r = cli(capsys, "replay", bad, "--lookup-cache-static", tmp_path / "missing.bin", *flags)
    one_line_error(r, needle)
    assert "bad.jsonl" not in r.stderr and "missing.bin" not in r.stderr


@pytest.mark.parametrize("target", ["folder/x.bin", "file/x.bin", "dir"])
def test_generate_checks_dynamic_cache_writable_first(tmp_path, capsys, target):
    (tmp_path / "file").write_text("a regular file")
    (tmp_path / "dir").mkdir()
    path = tmp_path / target
    # a model that does not exist: the check comes before the model (and before generating)
    r = cli(capsys, "generate", "-p", "x", "--model", tmp_path / "none.gguf",
            "--lookup-cache-dynamic", path)
    one_line_error(r, f"--lookup-cache-dynamic {path}")
    assert "none.gguf" not in r.stderr and r.stdout == ""


def test_trace_bom_accepted(tmp_path):
    plain = write(tmp_path / "a.jsonl", GOOD + "\n" + GOOD + "\n")
    bom = write(tmp_path / "b.jsonl", b"\xef\xbb\xbf" + (GOOD + "\n" + GOOD + "\n").encode())
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(b"\xef\xbb\xbf" + (GOOD + "\n").encode())
    want = [(r.prompt.tolist(), r.output.tolist()) for r in read_requests(plain)]
    assert [(r.prompt.tolist(), r.output.tolist()) for r in read_requests(bom)] == want
    assert len(read_requests(str(tmp_path / "c.jsonl.gz"))) == 1
    # only at the start of the file: elsewhere it is not JSON
    mid = write(tmp_path / "d.jsonl", (GOOD + "\n").encode() + b"\xef\xbb\xbf" + GOOD.encode())
    with pytest.raises(TraceError, match=r"d\.jsonl:2:"):
        read_requests(mid)


def test_trace_line_length_bounded(tmp_path, capsys, monkeypatch):
    long_line = json.dumps({"prompt": list(range(500)), "output": [1]})
    path = write(tmp_path / "t.jsonl", GOOD + "\n" + long_line + "\n" + GOOD + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: line longer than 1000 bytes"):
        read_requests(path, max_line_bytes=1000)
    assert len(read_requests(path, max_line_bytes=len(long_line) + 1)) == 3  # newline included
    monkeypatch.setattr(traces, "MAX_LINE_BYTES", 1000)   # the CLI's bound
    one_line_error(cli(capsys, "replay", path), f"{path}:2: line longer than 1000 bytes")
    # the same through gzip
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(pathlib.Path(path).read_bytes()))
    one_line_error(cli(capsys, "replay", gz), f"{gz}:2: line longer")


def test_generate_flag_messages_name_the_flag(capsys):
    for flags, needle in [
            (["-c", "0"], "argument -c/--ctx-size: 0 is out of range: allowed 8 .."),
            (["-t", "0"], "argument -t/--threads: 0 is out of range: allowed 1 .. 512"),
            (["-b", "0"], "argument -b/--batch-size: 0 is out of range: allowed 1 .."),
            (["-n", "-5"], "argument -n/--n-predict: -5 is out of range: allowed -1 ..")]:
        r = cli(capsys, "generate", "-p", "x", *flags)
        one_line_error(r, needle)
        assert "_positive" not in r.stderr


def test_generate_missing_prompt_file_names_the_flag(tmp_path, capsys):
    r = cli(capsys, "generate", "-f", tmp_path / "none.txt")
    one_line_error(r, f"--prompt-file {tmp_path / 'none.txt'}: no such file")
    r = cli(capsys, "generate", "-f", tmp_path)
    one_line_error(r, "--prompt-file", "is a directory")
    bad = write(tmp_path / "latin1.txt", b"caf\xe9")
    one_line_error(cli(capsys, "generate", "-f", bad), "--prompt-file", "not UTF-8")


# ---------------------------------------------------------------------------------------------
# --help (issue 14 point 5)
# ---------------------------------------------------------------------------------------------

def _help(capsys, *argv):
    r = cli(capsys, *argv, "--help")
    assert r.returncode == 0
    return " ".join(r.stdout.split())


def test_help_texts(capsys):
    replay_help = _help(capsys, "replay")
    for default in ("(default: shared)", "(default: 1, one slot", "(default: all)",
                    "(default: 0, unbounded"):
        assert default in replay_help, default
    info = _help(capsys, "cache", "info")
    assert "n-grams by size" in info
    gen = _help(capsys, "generate")
    assert "bench/" not in gen            # not installed with the package
    assert "--repack {auto,on,off}" in gen and "--no-repack" in gen


# ---------------------------------------------------------------------------------------------
# live: --ctx-size honoured, BOM prompt files, -n 0
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live():
    pytest.importorskip("llama_cpp")
    from ngramspec.llama.model import default_model_path
    return default_model_path()


def _gen_json(capsys, *argv):
    r = cli(capsys, "generate", "-t", "1", "--json", *argv)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_ctx_size_is_honoured(live, capsys):
    """llama.cpp pads the context to 256 positions; --ctx-size 8 still means 8."""
    d = _gen_json(capsys, "-p", "a b a b", "-n", "50", "-c", "8")
    assert d["finish_reason"] == "context"
    # the KV cache holds at most 8 positions: the prompt and all outputs but the last
    assert d["n_prompt"] + d["n_output"] - 1 == 8
    r = cli(capsys, "generate", "-t", "1", "-p", "a b " * 10, "-n", "5", "-c", "8")
    one_line_error(r, "does not fit the context (n_ctx = 8)", "--ctx-size")


def test_prompt_file_bom_is_dropped(live, capsys, tmp_path):
    text = "def add(a, b):\n    return a + b\n"
    plain = write(tmp_path / "p.txt", text)
    bom = write(tmp_path / "b.txt", b"\xef\xbb\xbf" + text.encode())
    a = _gen_json(capsys, "-f", plain, "-n", "3", "-c", "256")
    b = _gen_json(capsys, "-f", bom, "-n", "3", "-c", "256")
    assert a["n_prompt"] == b["n_prompt"] and a["output_tokens"] == b["output_tokens"]


def test_n_predict_0_compare_says_na(live, capsys):
    r = cli(capsys, "generate", "-t", "1", "-p", "hello", "-n", "0", "-c", "256", "--compare")
    assert r.returncode == 0, r.stderr
    assert "speed-up:" in r.stdout and "n/a" in r.stdout and "0.00x" not in r.stdout
    d = _gen_json(capsys, "-p", "hello", "-n", "0", "-c", "256", "--compare")
    assert d["speedup"] is None


# ---------------------------------------------------------------------------------------------
# issue 14 point 5: an uncompiled source tree says what to do
# ---------------------------------------------------------------------------------------------

def test_uncompiled_tree_gives_a_clear_import_error(tmp_path):
    pkg = tmp_path / "ngramspec"
    shutil.copytree(ROOT / "ngramspec", pkg, ignore=shutil.ignore_patterns("*.so", "*.pyd",
                                                                           "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site-packages, so no editable install's import hook (CI's `pip install -e`) can
    # redirect the import to the built checkout; the copy in the working folder is found first,
    # as a source folder shadows a non-editable install.
    proc = subprocess.run([sys.executable, "-S", "-c", "import ngramspec"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ngramspec's compiled kernels (ngramspec._map)")
    assert "build_ext --inplace" in last and "pip install -e ." in last
    assert str(pkg) in last


def test_serve_policy_flag_is_spec_policy_and_the_old_one_warns(capsys):
    """serve's draft-length policy flag is --spec-policy, as in every other command; --policy
    still works for old command lines, with a note on stderr."""
    from ngramspec.cli import build_parser
    parser = build_parser()
    assert parser.parse_args(["serve"]).spec_policy == "fixed"
    assert parser.parse_args(["serve", "--spec-policy", "auto"]).spec_policy == "auto"
    assert "deprecated" not in capsys.readouterr().err
    assert parser.parse_args(["serve", "--policy", "auto"]).spec_policy == "auto"
    assert "--policy is deprecated, use --spec-policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--spec-policy", "greedy"])
    assert "invalid choice: 'greedy'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# issue 34 section 3: inputs that never end or are the output
# ---------------------------------------------------------------------------------------------

def _bounded_run(argv, timeout=120, **kw):
    """``ngramspec ARGV`` in a fresh interpreter whose memory is capped (2 GiB), so that a
    read that never ends fails here instead of filling the machine."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    return subprocess.run([sys.executable, "-m", "ngramspec", *map(str, argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=cap, **kw)


@pytest.mark.parametrize("flag", ["-f", "--prompt-tokens"])
def test_prompt_file_that_never_ends_is_refused_at_once(tmp_path, flag):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)                 # no writer: reading it would wait forever
    name = "--prompt-file" if flag == "-f" else flag
    for path, kind in ((fifo, "is a FIFO"), ("/dev/zero", "is a character device")):
        one_line_error(_bounded_run(["generate", flag, path]), f"{name} {path}: {kind}",
                       "regular files only")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:      # sparse: no disk used
        f.truncate((64 << 20) + 1)
    one_line_error(_bounded_run(["generate", flag, big]),
                   f"{name} {big}: 67108865 bytes: prompts are read up to 67108864 bytes")
    with open("/dev/zero", "rb") as zero:       # '-': stdin, a stream, read up to the bound
        one_line_error(_bounded_run(["generate", flag, "-"], stdin=zero),
                       f"{name} -: more than 67108864 bytes")


def test_prompt_from_stdin_is_still_read(capsys, monkeypatch):
    import io
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"[5, -1]")))
    r = cli(capsys, "generate", "--prompt-tokens", "-")
    one_line_error(r, "--prompt-tokens -[1] = -1 is not a token id")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"a": 1}\n{"b": 2}\n')))
    one_line_error(cli(capsys, "generate", "-f", "-"), "--prompt-file -: a JSONL file")


@pytest.mark.parametrize("link", ["same", "symlink", "hardlink"])
def test_replay_output_equal_to_its_trace_is_refused(tmp_path, capsys, link):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(GOOD + "\n")
    out = {"same": trace, "symlink": tmp_path / "link", "hardlink": tmp_path / "hard"}[link]
    if link == "symlink":
        out.symlink_to(trace)
    elif link == "hardlink":
        os.link(trace, out)
    r = cli(capsys, "replay", trace, "--output", out)
    one_line_error(r, f"--output {out} is the trace file {trace} (the same file)")
    assert trace.read_text() == GOOD + "\n"


def test_tune_jobs_are_capped_at_the_work_and_the_cores(capsys):
    from ngramspec.tune import JOBS_PER_CORE, available_cores, worker_count
    r = cli(capsys, "tune", TRACES / "model-generated.jsonl.gz", "--limit", "4", "--types",
            "ngram-simple", "--slots", "1", "--llama-only", "--no-chains", "--jobs", "1500",
            "--no-progress", "--cost-model", "gpu")
    assert r.returncode == 0, r.stderr
    note = next(ln for ln in r.stderr.splitlines() if ln.startswith("tune: --jobs 1500: "))
    n_workers = int(note.split(": ")[2].split()[0])
    n_configs = int(note.split("(")[1].split()[0])
    cores = available_cores()
    assert n_workers == min(n_configs, JOBS_PER_CORE * cores) == \
        worker_count(1500, n_configs), note
    assert f"at most {JOBS_PER_CORE} per core on {cores} cores" in note
    assert worker_count(1500, 60, cores=2) == 4 and worker_count(3, 60, cores=2) == 3
    assert worker_count(8, 5, cores=64) == 5 and worker_count(1, 0, cores=1) == 1
    r = cli(capsys, "tune", "--help")
    assert f"at most one per configuration and {JOBS_PER_CORE} per core" in \
        " ".join(r.stdout.split())
