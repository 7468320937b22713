"""A/B: the draft-call cost of two ngramspec checkouts, measured interleaved on this machine.

    python bench ab A_ROOT B_ROOT [--rounds 6] [--sizes 1k,8k,32k,128k]
                  [--proposers simple,map-k,map-k4v,mod] [--families chat=30,agentic=8]
                  [--json FILE]

Each root is a checkout with its extensions built (``python setup.py build_ext --inplace``).
A round runs one worker process per checkout (the order alternates between rounds), so both see
the same machine load; each worker imports its checkout's ``ngramspec`` (``$NGRAMSPEC_TREE``,
see `benchlib`) and this ``bench/``'s ``benchlib`` (neither checkout needs a copy of it), and
times, as ``kernel_report.py`` and ``replay_report.py`` do, the steady draft calls by context
size, the fixed cost of a call on a 16-token context, and the replay loop's draft calls on the
first requests of some trace families. The table gives each call's minimum
over all rounds, averaged over the calls (`benchlib.per_call_us`), for A and B and their ratio.
The two checkouts must make the same drafts: the worker reports every draft length and the
script stops if they differ.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec.traces import read_requests


def worker(args):
    engines = benchlib.Engines()
    out = {"ngramspec": __import__("ngramspec").__file__, "steady": {}, "overhead": {},
           "replay": {}}
    corpus = benchlib.Corpus()
    names = args.proposers.split(",")
    for label in args.sizes.split(","):
        ctx = corpus.context(label, benchlib.SIZES[label])
        for name in names:
            factory = engines.factory(name)
            plan = benchlib.make_plan(factory, ctx)
            runs = [benchlib.run_timed(benchlib.prepare(factory, ctx, plan), plan.steps)
                    for _ in range(args.inner)]
            out["steady"][f"{name} {label}"] = {"ns": np.vstack(runs).min(axis=0).tolist(),
                                                "lengths": plan.lengths}
    small = np.arange(100, 116, dtype=np.int32)
    clock = time.perf_counter_ns
    for name in names:
        eng = engines.factory(name)()
        eng.begin(0, small)
        draft, best = eng.draft, None
        for _ in range(5):
            t0 = clock()
            for _ in range(2000):
                draft(0, small, 7)
            t = (clock() - t0) / 2000
            best = t if best is None else min(best, t)
        out["overhead"][name] = best
    for item in args.families.split(",") if args.families else []:
        fam, _, n = item.partition("=")
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), int(n or 20))
        for name in names:
            runs, drafts = [], None
            for _ in range(args.inner):
                s = benchlib.replay_family(engines.factory(name), requests)
                runs.append(s["call_ns"])
                drafts = [s["n_drafts"], s["n_draft_tokens"], s["n_acc_tokens"], s["n_steps"]]
            out["replay"][f"{name} {fam}"] = {"ns": np.vstack(runs).min(axis=0).tolist(),
                                              "lengths": drafts}
    json.dump(out, sys.stdout)


def merge(acc, res):
    for part in ("steady", "replay"):
        for key, val in res[part].items():
            have = acc[part].setdefault(key, val)
            if have is val:
                continue
            if have["lengths"] != val["lengths"]:
                raise SystemExit(f"{key}: the drafts differ between runs or checkouts")
            have["ns"] = [min(a, b) for a, b in zip(have["ns"], val["ns"])]
    for key, val in res["overhead"].items():
        acc["overhead"][key] = min(acc["overhead"].get(key, val), val)


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("a", help="checkout A (baseline)")
    ap.add_argument("b", help="checkout B")
    ap.add_argument("--rounds", type=int, default=6, help="worker runs per checkout")
    ap.add_argument("--inner", type=int, default=3, help="rounds inside each worker")
    ap.add_argument("--sizes", default="1k,8k,32k,128k")
    ap.add_argument("--proposers", default="simple,map-k,map-k4v,mod")
    ap.add_argument("--families", default="chat=30,agentic=8,code-edit=10",
                    help="replayed families as FAMILY=N (first N requests); '' for none")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("ab.json"),
                    help="write the table as JSON here (default: %(default)s)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    roots = {"A": os.path.abspath(args.a), "B": os.path.abspath(args.b)}
    acc = {k: {"steady": {}, "overhead": {}, "replay": {}} for k in roots}
    for r in range(args.rounds):
        for k in (("A", "B") if r % 2 == 0 else ("B", "A")):
            # the worker's benchlib puts checkout k's ngramspec first on sys.path
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", **{benchlib.TREE_ENV: roots[k]})
            cmd = [sys.executable, os.path.abspath(__file__), "x", "x", "--worker",
                   "--inner", str(args.inner), "--sizes", args.sizes,
                   "--proposers", args.proposers, "--families", args.families]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                            env=env, cwd=roots[k]).stdout)
            if not res["ngramspec"].startswith(roots[k]):
                raise SystemExit(f"{k}: imported {res['ngramspec']}, not {roots[k]}")
            merge(acc[k], res)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    for part in ("steady", "replay"):
        for key in acc["A"][part]:
            if acc["A"][part][key]["lengths"] != acc["B"][part][key]["lengths"]:
                raise SystemExit(f"{key}: A and B make different drafts")
    print(f"A = {roots['A']}\nB = {roots['B']}\n{args.rounds} rounds x {args.inner}, "
          "us per draft call (each call's minimum, averaged over the calls)\n")
    print("| measurement | A | B | B / A |\n|---|---|---|---|")
    table = {}
    for part in ("steady", "overhead", "replay"):
        for key in acc["A"][part]:
            a, b = acc["A"][part][key], acc["B"][part][key]
            if part == "overhead":
                ua, ub = a / 1000, b / 1000
            else:
                ua, ub = (sum(x["ns"]) / len(x["ns"]) / 1000 if x["ns"] else 0.0 for x in (a, b))
            label = {"steady": "steady", "overhead": "fixed cost", "replay": "replay"}[part]
            table[f"{label} {key}"] = (ua, ub)
            print(f"| {label} {key} | {ua:.3f} | {ub:.3f} | {ub / ua if ua else 0:.2f}× |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
