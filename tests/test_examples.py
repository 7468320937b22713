"""The example files shipped in the package (`ngramspec.examples`): the trace sample is exactly
the stated cut of ``../shared/traces``, small, readable by every reader, and found without
``../shared``.

``python tests/test_examples.py`` rewrites the sample from ``../shared/traces`` (after a change
of `SAMPLE`); the test below then holds the shipped files to it.
"""
from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys

import pytest

from conftest import ROOT, TRACES

from ngramspec import examples
from ngramspec.traces import read_requests
from ngramspec.validation import OutOfRange

# family -> the number of leading lines of ../shared/traces/FAMILY.jsonl.gz in the sample (the
# agentic and reasoning lines are the first turns of one trajectory, in order).
SAMPLE = {"code-edit": 20, "agentic": 16, "reasoning": 8, "chat": 12, "model-generated": 8}
MAX_SAMPLE_BYTES = 256 * 1024     # all families together: "well under 1 MB" (issue 40)


def cut(family: str) -> bytes:
    """The sample's uncompressed bytes: the family's first `SAMPLE` lines, verbatim."""
    with gzip.open(TRACES / f"{family}.jsonl.gz", "rb") as f:
        lines = [f.readline() for _ in range(SAMPLE[family])]
    return b"".join(lines)


def write_sample() -> None:
    for family in SAMPLE:
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as gz:
            gz.write(cut(family))
        (ROOT / "ngramspec" / "examples" / "traces" / f"{family}.jsonl.gz").write_bytes(
            buf.getvalue())


def test_families_are_the_corpus_families():
    assert set(examples.FAMILIES) == set(SAMPLE)


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_sample_is_the_stated_cut_of_the_corpus(family, shared_dir):
    with gzip.open(examples.traces(family), "rb") as f:
        assert f.read() == cut(family)


def test_sample_is_small():
    total = sum(os.path.getsize(examples.traces(f)) for f in examples.FAMILIES)
    assert 0 < total <= MAX_SAMPLE_BYTES


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_sample_reads_as_requests(family):
    requests = read_requests(examples.traces(family))
    assert len(requests) == SAMPLE[family]
    assert all(len(r.prompt) and len(r.output) for r in requests)


def test_unknown_family_and_file_are_refused_with_the_allowed_names():
    with pytest.raises(OutOfRange, match=r"family = 'code' is out of range: allowed code-edit, "
                                         r"agentic"):
        examples.traces("code")
    with pytest.raises(FileNotFoundError, match="code_edit_prompt.txt"):
        examples.path("nope.txt")
    with pytest.raises(FileNotFoundError):
        examples.path("../__init__.py")      # only files of the examples folder


def test_paths_from_the_shell_without_shared(tmp_path):
    """``python -m ngramspec.examples`` prints the sample's paths; nothing reads ../shared."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NGRAMSPEC_SHARED=str(tmp_path / "missing"))
    res = subprocess.run([sys.executable, "-m", "ngramspec.examples", "chat", "agentic"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [examples.traces("chat"), examples.traces("agentic")]
    bad = subprocess.run([sys.executable, "-m", "ngramspec.examples", "code"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "family = 'code' is out of range" in bad.stderr


def test_sample_ships_with_the_package(tmp_path):
    """pyproject's package data carries the sample: setuptools' build of the pure-Python part
    (what a wheel or a non-editable install holds) has every file the helpers name."""
    res = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base",
                          str(tmp_path), "build_py", "--build-lib", str(tmp_path / "lib")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "would be ignored" not in res.stderr          # every data folder is listed
    shipped = tmp_path / "lib" / "ngramspec" / "examples"
    here = ROOT / "ngramspec" / "examples"
    for family in examples.FAMILIES:
        name = os.path.relpath(examples.traces(family), here)
        assert (shipped / name).read_bytes() == (here / name).read_bytes(), name
    for name in ("traces/README.md", "code_edit_prompt.txt", "batch.jsonl", "__main__.py"):
        assert (shipped / name).is_file(), name


if __name__ == "__main__":
    write_sample()
