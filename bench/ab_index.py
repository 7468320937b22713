"""A/B: the one-off index builds of two ngramspec checkouts, measured interleaved.

    python bench ab-index A_ROOT B_ROOT [--rounds 16]

ngram-simple builds its position index over the whole context in the first draft after
begin(); ngram-map-k4v builds its statistics index over a long prompt in begin(). Each round
runs one worker process per checkout (order alternating); a worker times, on the code-edit
traces concatenated and cut to 32k and 128k tokens, begin + first draft (ngram-simple) and
begin (ngram-map-k4v), best of 3. The table gives the minimum over all rounds in ms. Each worker
imports its checkout's ``ngramspec`` through ``$NGRAMSPEC_TREE`` (see `benchlib`) and this
``bench/``'s ``benchlib``, as ``ab`` does.
"""
import json
import os
import subprocess
import sys

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))

WORKER = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import benchlib
import ngramspec
from ngramspec import SpecEngine
from ngramspec.traces import read_requests
reqs = read_requests(str(benchlib.TRACES / "code-edit.jsonl.gz"), None)
toks = np.concatenate([np.concatenate([r.prompt, r.output]) for r in reqs]).astype(np.int32)
out = {"file": ngramspec.__file__}
for size in (32768, 131072):
    ctx = np.ascontiguousarray(np.tile(toks, 1 + size // len(toks))[:size])
    for spec, what in (("ngram-simple", "begin + first draft"), ("ngram-map-k4v", "begin")):
        best = None
        for _ in range(3):
            e = SpecEngine(spec)
            t0 = time.perf_counter()
            e.begin(0, ctx)
            if spec == "ngram-simple":
                e.draft(0, ctx, int(ctx[-1]))
            t = time.perf_counter() - t0
            best = t if best is None else min(best, t)
            e = None
        out[f"{spec} {what} {size // 1024}k"] = best * 1000
print(json.dumps(out))
'''


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("a", help="checkout A (baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--rounds", type=int, default=16, help="worker runs per checkout")
    args = ap.parse_args(argv)
    roots = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    acc = {"A": {}, "B": {}}
    for r in range(args.rounds):
        for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
            env = dict(os.environ, **{benchlib.TREE_ENV: roots[k]})
            res = json.loads(subprocess.run([sys.executable, "-c", WORKER, HERE], check=True,
                                            capture_output=True, text=True, env=env,
                                            cwd=roots[k]).stdout)
            if not res.pop("file").startswith(roots[k]):
                raise SystemExit(f"{k}: imported another ngramspec than {roots[k]}")
            for key, v in res.items():
                acc[k][key] = min(acc[k].get(key, v), v)
    print("| measurement | A (ms) | B (ms) | B / A |\n|---|---|---|---|")
    for key in acc["A"]:
        x, y = acc["A"][key], acc["B"][key]
        print(f"| {key} | {x:.2f} | {y:.2f} | {y / x:.2f}× |")


if __name__ == "__main__":
    main()
