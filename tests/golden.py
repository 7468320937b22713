"""Reading the golden files of ../shared/golden and replaying them with ngramspec."""
from __future__ import annotations

import pathlib

from ngramspec.cli import build_parser
from ngramspec.config import engine_params
from ngramspec.golden_format import read_golden
from ngramspec.replay import COUNTERS, replay
from ngramspec.traces import read_requests

#: Per-request figures and summary figures a replay must reproduce exactly.
REQUEST_KEYS = ("n_steps", "n_drafts", "n_draft_tokens", "n_acc_drafts", "n_acc_tokens",
                "acc_rate", "tokens_per_step")
SUMMARY_KEYS = ("n_traces", "n_output", "n_steps", "n_draft_calls", "n_drafts",
                "n_draft_tokens", "n_acc_drafts", "n_acc_tokens", "n_accept_calls", "acc_rate")


def replay_args(header: dict, golden_dir: pathlib.Path, traces: pathlib.Path):
    """The oracle's arguments as an ``ngramspec replay`` command line, parsed."""
    oracle = list(header["oracle_args"])
    argv = ["replay", str(traces / f"{header['family']}.jsonl.gz")]
    i = 0
    while i < len(oracle):
        flag, value = oracle[i], oracle[i + 1]
        if flag == "--type":
            flag = "--spec-type"
        if flag.startswith("--lookup-cache"):
            value = str(golden_dir / value)
        argv += [flag, value]
        i += 2
    argv += ["--limit", str(header["summary"]["n_traces"]), "--drafts"]
    args = build_parser().parse_args(argv)
    return args, engine_params(args)


def check_golden(path: pathlib.Path, golden_dir: pathlib.Path, traces: pathlib.Path) -> None:
    """Replay a golden file's traces as its oracle did (through the engine and the replay
    driver) and assert that every draft, step, per-request figure, the summary and llama.cpp's
    counters equal the file's."""
    header, expected = read_golden(path)
    args, params = replay_args(header, golden_dir, traces)
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
        for key in REQUEST_KEYS:
            assert got[key] == want[key], f"request {want['trace']}: {key}"
    summary, want_summary = result.summary, header["summary"]
    for key in SUMMARY_KEYS:
        assert summary[key] == want_summary[key], key
    got_stats = [{k: s[k] for k in ("type", *COUNTERS)} for s in summary["llama_stats"]]
    assert got_stats == want_summary["llama_stats"]
