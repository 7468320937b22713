"""Golden parity: every draft, step and llama.cpp counter equals what llama.cpp's own code gave.

One test per file of ../shared/golden (the ngram-cache files are tested in test_cache.py).
"""
import pytest

from ngramspec.replay import COUNTERS, replay
from ngramspec.traces import read_requests

from conftest import GOLDEN, TRACES
from golden import read_golden, replay_args

FILES = sorted(p for p in GOLDEN.glob("*.jsonl.gz") if ".cache-" not in p.name)


def test_golden_files_present():
    assert len(FILES) >= 90, f"expected the golden files in {GOLDEN}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.replace(".jsonl.gz", ""))
def test_golden(path):
    header, expected = read_golden(path)
    args, params = replay_args(header, GOLDEN, TRACES)
    requests = read_requests(args.traces[0], args.limit)
    result = replay(requests, args.spec_type, params, state=args.state, n_slots=args.slots,
                    record_drafts=True)
    assert len(result.requests) == len(expected)
    for got, want in zip(result.requests, expected):
        assert got["id"] == want["id"]
        assert got["slot"] == want["slot"]
        for t, (gd, wd) in enumerate(zip(got["drafts"], want["drafts"])):
            assert gd == wd, f"request {want['trace']} step {t}: draft differs"
        assert got["steps"] == want["steps"], f"request {want['trace']}: steps differ"
        for key in ("n_steps", "n_drafts", "n_draft_tokens", "n_acc_drafts", "n_acc_tokens",
                    "acc_rate", "tokens_per_step"):
            assert got[key] == want[key], f"request {want['trace']}: {key}"
    summary, want_summary = result.summary, header["summary"]
    for key in ("n_traces", "n_output", "n_steps", "n_draft_calls", "n_drafts",
                "n_draft_tokens", "n_acc_drafts", "n_acc_tokens", "n_accept_calls", "acc_rate"):
        assert summary[key] == want_summary[key], key
    got_stats = [{k: s[k] for k in ("type", *COUNTERS)} for s in summary["llama_stats"]]
    assert got_stats == want_summary["llama_stats"]
