"""ngram-cache files on the command line and the dynamic cache that outlives a run (issue 5).

``--lookup-cache-static/-dynamic FILE`` on ``replay`` and ``generate``: loaded once before any
model, ngram-cache added to the chain, a bad file reported as one line with its byte offset.
Merging into the dynamic file is atomic and locked: concurrent processes lose no counts and a
failed rename leaves the previous file whole.
"""
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from ngramspec._cache import NgramCache
from ngramspec.cache_file import load_cache, merge_into_dynamic, save_cache
from ngramspec.config import load_cache_files

from clitools import cli
from conftest import GOLDEN, ROOT, TRACES
from golden import read_golden

STATIC_BIN = GOLDEN / "static-cache-code-edit.bin"


# --------------------------------------------------------------------------------------------
# load_cache_files: the shared loader of replay and generate
# --------------------------------------------------------------------------------------------

def test_load_cache_files_adds_the_type_and_loads_once(tmp_path):
    assert load_cache_files("ngram-mod", {"ngram_mod_n_match": 8}) == \
        ("ngram-mod", {"ngram_mod_n_match": 8})
    types, params = load_cache_files("ngram-mod", {"lookup_cache_static": str(STATIC_BIN)})
    assert types == "ngram-mod,ngram-cache"
    assert isinstance(params["lookup_cache_static"], NgramCache)
    assert len(params["lookup_cache_static"]) == 32948
    types, params = load_cache_files("none", {"lookup_cache_dynamic": str(tmp_path / "new.bin")})
    assert types == "ngram-cache" and len(params["lookup_cache_dynamic"]) == 0
    assert not (tmp_path / "new.bin").exists()       # created by the first merge, not here
    types, _ = load_cache_files("ngram-cache,ngram-simple",
                                {"lookup_cache_dynamic": str(tmp_path / "new.bin")})
    assert types == "ngram-cache,ngram-simple"     # already there: the list is left as given
    with pytest.raises(FileNotFoundError, match="--lookup-cache-static"):
        load_cache_files("ngram-cache", {"lookup_cache_static": str(tmp_path / "none.bin")})


# --------------------------------------------------------------------------------------------
# replay --lookup-cache-static / --lookup-cache-dynamic
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["fresh", "shared"])
def test_replay_cli_static_file_gives_the_golden_drafts(tmp_path, capsys, state):
    """The CLI path (files loaded once by load_cache_files, one engine per request in fresh
    state) reproduces the golden static-cache files; --spec-type defaults are extended."""
    header, expected = read_golden(GOLDEN / f"code-edit.cache-static.{state}.jsonl.gz")
    out = tmp_path / "out.jsonl"
    r = cli(capsys, "replay", TRACES / "code-edit.jsonl.gz", "--spec-type", "none",
                     "--lookup-cache-static", STATIC_BIN, "--state", state,
                     "--limit", header["summary"]["n_traces"], "--drafts", "--output", out)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["config"] == "ngram-cache"
    assert [r["drafts"] for r in lines[1:]] == [r["drafts"] for r in expected]
    assert [r["steps"] for r in lines[1:]] == [r["steps"] for r in expected]


def test_replay_cli_missing_dynamic_file_is_empty(tmp_path, capsys):
    dyn = tmp_path / "dyn.bin"
    r = cli(capsys, "replay", TRACES / "chat.jsonl.gz", "--limit", "2",
                       "--lookup-cache-dynamic", dyn)
    assert r.returncode == 0, r.stderr
    assert "spec-type ngram-mod,ngram-cache" in r.stdout and "ngram-cache: #calls" in r.stdout
    assert not dyn.exists()                          # replay only reads it


BAD_FILES = {
    "truncated.bin": (STATIC_BIN.read_bytes()[:1000], "byte offset 836"),
    "corrupt.bin": (struct.pack("<4ii", 1, 2, -1, -1, 0), "byte offset 16"),
    "badkey.bin": (struct.pack("<4ii2i", 1, -1, 5, -1, 1, 3, 1), "byte offset 0"),
}


@pytest.mark.parametrize("flag", ["--lookup-cache-static", "--lookup-cache-dynamic"])
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_replay_cli_bad_cache_file_one_line_exit_2(tmp_path, flag, name):
    data, where = BAD_FILES[name]
    bad = tmp_path / name
    bad.write_bytes(data)
    proc = subprocess.run([sys.executable, "-m", "ngramspec", "replay",
                           str(TRACES / "chat.jsonl.gz"), "--limit", "1", flag, str(bad)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert str(bad) in lines[0] and where in lines[0], lines[0]


def test_replay_cli_missing_static_file(tmp_path, capsys):
    r = cli(capsys, "replay", TRACES / "chat.jsonl.gz", "--limit", "1",
                     "--lookup-cache-static", tmp_path / "none.bin")
    assert r.returncode == 2 and "none.bin" in r.stderr and "--lookup-cache-static" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# generate: cache files are read before the model
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--lookup-cache-static", "--lookup-cache-dynamic"])
def test_generate_cli_bad_cache_file_fails_before_the_model(tmp_path, capsys, flag):
    data, where = BAD_FILES["truncated.bin"]
    bad = tmp_path / "t.bin"
    bad.write_bytes(data)
    # the model path does not exist either: the cache file is checked first
    r = cli(capsys, "generate", "--prompt", "x", "--model", tmp_path / "none.gguf",
                       flag, bad)
    assert r.returncode == 2 and r.stdout == ""
    err = r.stderr
    assert len(err.strip().splitlines()) == 1 and str(bad) in err and where in err, err
    assert bad.read_bytes() == data                  # never rewritten


# --------------------------------------------------------------------------------------------
# merge_into_dynamic: atomic, locked
# --------------------------------------------------------------------------------------------

def test_two_processes_merging_concurrently_lose_no_counts(tmp_path):
    path = tmp_path / "dyn.bin"
    go = tmp_path / "go"
    code = textwrap.dedent(f"""
        import os, sys, time
        from ngramspec.cache_file import merge_into_dynamic
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        tok = int(sys.argv[1])
        for _ in range(40):
            merge_into_dynamic({str(path)!r}, [1, 2, tok] * 200)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tok)], cwd=ROOT)
             for tok in (3, 4)]
    go.write_text("")
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    got = load_cache(path).to_dict()
    # each merge adds 200 of (1,)->2, 200 of (1,2)->tok: 2 processes x 40 merges
    assert got[(1,)] == {2: 2 * 40 * 200}
    assert got[(1, 2)] == {3: 40 * 200, 4: 40 * 200}
    assert sorted(os.listdir(tmp_path)) == ["dyn.bin", "dyn.bin.lock", "go"]


def test_failed_replace_leaves_the_old_dynamic_file(tmp_path, monkeypatch):
    path = tmp_path / "dyn.bin"
    merge_into_dynamic(path, [1, 2, 3, 1, 2, 3])
    good = path.read_bytes()

    def fail(src, dst):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="Input/output"):
        merge_into_dynamic(path, list(range(5000)))
    assert path.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["dyn.bin", "dyn.bin.lock"]   # temp file removed
    monkeypatch.undo()
    # the lock was released: the next merge goes through and keeps the earlier counts
    merge_into_dynamic(path, [1, 2])
    assert load_cache(path).to_dict()[(1,)] == {2: 3}


def test_merge_into_a_corrupt_dynamic_file_keeps_it(tmp_path):
    path = tmp_path / "dyn.bin"
    save_cache(NgramCache(), path)
    path.write_bytes(BAD_FILES["corrupt.bin"][0])
    with pytest.raises(ValueError, match="byte offset 16"):
        merge_into_dynamic(path, [1, 2, 3])
    assert path.read_bytes() == BAD_FILES["corrupt.bin"][0]


def test_replay_api_summary_with_loaded_caches_serialises(tmp_path):
    """replay() given loaded NgramCache objects and a PathLike: the summary still goes through
    json.dumps (paths as strings, loaded objects by their repr)."""
    from ngramspec.replay import replay
    from ngramspec.traces import read_requests
    requests = read_requests(str(TRACES / "code-edit.jsonl.gz"), limit=2)
    static = load_cache(STATIC_BIN)
    result = replay(requests, "ngram-cache", {"lookup_cache_static": static,
                                             "lookup_cache_dynamic": tmp_path / "dyn.bin"})
    params = json.loads(json.dumps(result.summary))["params"]
    assert params["lookup_cache_static"] == repr(static)
    assert params["lookup_cache_dynamic"] == str(tmp_path / "dyn.bin")
