"""Golden parity: every draft, step and llama.cpp counter equals what llama.cpp's own code gave.

One test per file of ../shared/golden (the ngram-cache files are tested in test_cache.py).
"""
import pytest

from conftest import GOLDEN, TRACES
from golden import check_golden

FILES = sorted(p for p in GOLDEN.glob("*.jsonl.gz") if ".cache-" not in p.name)


def test_golden_files_present():
    assert len(FILES) >= 90, f"expected the golden files in {GOLDEN}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.replace(".jsonl.gz", ""))
def test_golden(path):
    check_golden(path, GOLDEN, TRACES)
