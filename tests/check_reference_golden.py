"""Check tests/reference.py against llama.cpp's golden files.

    python tests/check_reference_golden.py [--limit N] [--golden-dir D] [--traces-dir D] FILES...

FILES are golden file names or paths (``<family>.<config>.<state>.jsonl.gz``; ngram-cache files
are another proposer and are refused). With --limit only the first N requests are replayed and the
statistics, which cover the whole file, are not compared. Exit status 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the checkout's ngramspec (the reference harness runs on its slot loop, ngramspec.loop)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import STAT_KEYS, RefChain, ref_replay  # noqa: E402

from ngramspec.golden_format import oracle_config, read_golden  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared"))


def load_requests(traces_dir: str, family: str, n: int):
    """The first `n` (prompt, output) pairs of a family's trace, as lists of ints (the pure-Python
    reference's input), read by the package's one trace reader."""
    path = os.path.join(traces_dir, family + ".jsonl.gz")
    return [(r.prompt.tolist(), r.output.tolist()) for r in read_requests(path, n)]


def check_file(path: str, traces_dir: str, limit: int | None) -> bool:
    name = os.path.basename(path)
    if ".cache-" in name:
        print(f"SKIP {name}: ngram-cache is not covered by the reference")
        return True
    head, lines = read_golden(path)
    types, params, state, n_slots = oracle_config(head)
    summary = head["summary"]
    n_traces = summary["n_traces"]
    assert len(lines) == n_traces, (len(lines), n_traces)
    n = n_traces if limit is None else min(limit, n_traces)
    requests = load_requests(traces_dir, head["family"], n)
    assert len(requests) == n

    t0 = time.perf_counter()
    per_req, stats = ref_replay(lambda: RefChain(types, n_slots, params), requests, state, n_slots)
    dt = time.perf_counter() - t0

    ok = True
    for t, (got, exp) in enumerate(zip(per_req, lines[:n])):
        if got["slot"] != exp["slot"]:
            print(f"FAIL {name} request {t}: slot {got['slot']} != {exp['slot']}")
            ok = False
        gd, ed = got["drafts"], exp["drafts"]
        gs, es = got["steps"], exp["steps"]
        for s in range(max(len(gd), len(ed))):
            a = gd[s] if s < len(gd) else None
            b = ed[s] if s < len(ed) else None
            if a != b:
                print(f"FAIL {name} request {t} draft call {s}:\n  ref    {a}\n  golden {b}")
                ok = False
                break
        if gs != es:
            first = next(i for i in range(max(len(gs), len(es)))
                         if (gs[i] if i < len(gs) else None) != (es[i] if i < len(es) else None))
            print(f"FAIL {name} request {t} step {first}: ref "
                  f"{gs[first] if first < len(gs) else None} golden "
                  f"{es[first] if first < len(es) else None}")
            ok = False
        if not ok:
            break
    full = n == n_traces
    if ok and full:
        exp_stats = summary["llama_stats"]
        got_stats = [{k: s[k] for k in ("type",) + STAT_KEYS} for s in stats]
        if got_stats != exp_stats:
            print(f"FAIL {name} llama_stats:\n  ref    {got_stats}\n  golden {exp_stats}")
            ok = False
    what = "all" if full else f"first {n} of"
    steps = sum(len(r["steps"]) for r in per_req)
    print(f"{'OK  ' if ok else 'BAD '} {name}: {what} {n_traces} requests, {steps} steps, "
          f"{'stats compared' if full else 'stats not compared'}, {dt:.1f}s", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--golden-dir", default=os.path.join(SHARED, "golden"))
    ap.add_argument("--traces-dir", default=os.path.join(SHARED, "traces"))
    a = ap.parse_args(argv)
    ok = True
    for f in a.files:
        path = f if os.path.exists(f) else os.path.join(a.golden_dir, f)
        ok &= check_file(path, a.traces_dir, a.limit)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
