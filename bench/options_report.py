"""Issue 7, point 2: the named options that fix llama.cpp's server-state collapse, measured.

llama-server keeps each proposer's state from one request to the next on a slot. ngram-map-k and
ngram-map-k4v then keep indexing entries of earlier requests and skip positions of a new prompt
that is not an extension of the previous one; ngram-cache keeps growing one context cache over
every request. Each option below is off by default (golden parity) and changes only that.

Every DEV family file is replayed in server state (one engine, slot 0, requests in file order,
state kept), with the golden files' replay loop, once with the option off and once on:

    python bench/options_report.py                   # whole files, every option (~5 min)
    python bench/options_report.py --limit 100       # the first 100 requests of each family
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from suffix_report import FAMILIES, cell, replay_family, traces_dir  # noqa: E402

from ngramspec._core import SpecEngine  # noqa: E402
from ngramspec.spec_types import REGISTRY  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

# (spec type, option keyword): the option's value 0 is llama.cpp's behaviour
OPTIONS = (
    ("ngram-map-k", "ngram_map_k_reindex"),
    ("ngram-map-k4v", "ngram_map_k4v_reindex"),
    ("ngram-cache", "ngram_cache_restart"),
)


def available(spec_type, keyword):
    t = REGISTRY.get(spec_type)
    return t is not None and any(p.name == keyword for p in t.params)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, help="first N requests per family")
    ap.add_argument("--family", action="append", choices=FAMILIES)
    ap.add_argument("--json", help="also write the measurements to this file")
    args = ap.parse_args(argv)
    families = args.family or list(FAMILIES)
    rows = {}
    for spec_type, keyword in OPTIONS:
        if not available(spec_type, keyword):
            print(f"skipping {spec_type}: no option {keyword} in this build", file=sys.stderr)
            continue
        for value in (0, 1):
            rows[f"{spec_type}, {keyword}={value}"] = (spec_type, {keyword: value})
    measured = {name: {} for name in rows}
    for fam in families:
        requests = read_requests(os.path.join(traces_dir(), f"{fam}.jsonl.gz"), args.limit)
        for name, (spec_type, params) in rows.items():
            r = replay_family(SpecEngine(spec_type, n_slots=1, **params), requests)
            measured[name][fam] = r
            print(f"{fam:16s} {name:40s} {cell(r)}  {r['seconds']:.1f} s", file=sys.stderr)
    print("| configuration (shared state) | " + " | ".join(families) + " |")
    print("|---|" + "---|" * len(families))
    for name, per_fam in measured.items():
        print(f"| {name} | " + " | ".join(cell(per_fam[f]) for f in families) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(measured, f, indent=1)


if __name__ == "__main__":
    main()
