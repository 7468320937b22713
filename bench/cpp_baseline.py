"""Check the C++ baseline against llama.cpp's golden drafts: it must be llama.cpp-faithful.

    python bench cpp-baseline [--files GLOB] [-v]

Replays golden files of ``../shared/golden`` (every non-cache file by default: the four
proposers in default and small configurations, fresh and shared state, the chain, and the
2-slot files) through ``llamacpp_baseline.CppEngine`` in ``ngramspec replay``'s loop, and
requires every draft, every step and llama.cpp's statistics counters to equal the file's.
The timing tables compare ngramspec with this baseline, so this check is what makes them a
comparison with llama.cpp's own algorithms.
"""
from __future__ import annotations

import pathlib
import sys
import time

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from llamacpp_baseline import CppEngine
from ngramspec.golden_format import oracle_config, read_golden
from ngramspec.replay import COUNTERS, Timers, replay_request
from ngramspec.traces import read_requests

GOLDEN = benchlib.SHARED / "golden"


def golden_files(pattern: str = "*.jsonl.gz") -> list[pathlib.Path]:
    return sorted(p for p in GOLDEN.glob(pattern) if ".cache-" not in p.name)


def check_file(path: pathlib.Path, max_requests: int | None = None) -> dict:
    """Replay one golden file through the C++ baseline; raises AssertionError on a difference.

    `max_requests` stops after that many requests (the counters are then not compared)."""
    header, expected = read_golden(path)
    spec_type, params, state, n_slots = oracle_config(header)
    n = header["summary"]["n_traces"]
    requests = read_requests(str(benchlib.TRACES / f"{header['family']}.jsonl.gz"), n)
    if max_requests is not None:
        requests, expected = requests[:max_requests], expected[:max_requests]
    timers = Timers()
    engine, totals = None, None
    n_calls = 0
    for t, (req, want) in enumerate(zip(requests, expected)):
        slot = t % n_slots
        if engine is None or state == "fresh":
            totals = _add_stats(totals, engine)
            engine = CppEngine(spec_type, n_slots, **params)
        got = replay_request(engine, slot, req.prompt, req.output, True, timers)
        n_calls += got["n_draft_calls"]
        where = f"{path.name}: request {t} ({want['id']})"
        if got["slot"] != want["slot"]:
            raise AssertionError(f"{where}: slot {got['slot']} != {want['slot']}")
        for i, (gd, wd) in enumerate(zip(got["drafts"], want["drafts"])):
            if gd != wd:
                raise AssertionError(f"{where} draft call {i}: {gd[:8]}... != {wd[:8]}...")
        if got["steps"] != want["steps"]:
            raise AssertionError(f"{where}: steps differ")
    totals = _add_stats(totals, engine)
    if max_requests is None:
        want_stats = [{k: s[k] for k in ("type", *COUNTERS)}
                      for s in header["summary"]["llama_stats"]]
        if totals != want_stats:
            raise AssertionError(f"{path.name}: counters {totals} != {want_stats}")
    return {"file": path.name, "requests": len(requests), "draft_calls": n_calls}


def _add_stats(totals, engine):
    """Sum llama.cpp's counters over the engines of a fresh-state replay."""
    if engine is None:
        return totals
    stats = engine.stats()
    if totals is None:
        return stats
    for t, s in zip(totals, stats):
        for k in COUNTERS:
            t[k] += s[k]
    return totals


def main(argv=None) -> int:
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--files", default="*.jsonl.gz", help="glob of golden files (default: all)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per file")
    args = ap.parse_args(argv)
    files = golden_files(args.files)
    if not files:
        print(f"no golden files match {args.files!r} in {GOLDEN}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    failed, calls = [], 0
    for path in files:
        try:
            res = check_file(path)
            calls += res["draft_calls"]
            if args.verbose:
                print(f"ok   {path.name} ({res['requests']} requests, "
                      f"{res['draft_calls']} draft calls)")
        except AssertionError as e:
            failed.append(path.name)
            print(f"FAIL {e}")
    dt = time.perf_counter() - t0
    print(f"{len(files) - len(failed)} of {len(files)} golden files reproduced exactly by the "
          f"C++ baseline ({calls} draft calls, {dt:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
