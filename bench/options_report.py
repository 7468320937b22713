"""Issue 7, point 2: the named options that fix llama.cpp's server-state collapse, measured.

llama-server keeps each proposer's state from one request to the next on a slot. ngram-map-k and
ngram-map-k4v then keep indexing entries of earlier requests and skip positions of a new prompt
that is not an extension of the previous one; ngram-cache keeps growing one context cache over
every request. Each option below is off by default (golden parity) and changes only that.

Every DEV family file is replayed in server state (one engine, slot 0, requests in file order,
state kept), with the golden files' replay loop, once with the option off and once on:

    python bench options                   # whole files, every option (~5 min)
    python bench options --limit 100       # the first 100 requests of each family
    python bench options --type ngram-cache --limit 100   # one option only
    python bench options --cache-cost      # ngram-cache restart: begin cost, memory
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec import SpecEngine
from ngramspec.registry import TYPES
from ngramspec.traces import read_requests
from suffix_report import FAMILIES, cell, replay_family

# (spec type, option keyword): the option's value 0 is llama.cpp's behaviour
OPTIONS = (
    ("ngram-map-k", "ngram_map_k_reindex"),
    ("ngram-map-k4v", "ngram_map_k4v_reindex"),
    ("ngram-cache", "ngram_cache_restart"),
)


def available(spec_type, keyword):
    t = TYPES.get(spec_type)
    return t is not None and any(p.name == keyword for p in t.params)


def cache_restart_cost(sizes=(1024, 8192, 32768), rounds=7):
    """What ngram_cache_restart costs per request, by prompt size: begin() freeing the context
    cache the previous request of that size left (GIL released from 4096 n-grams on), next to
    the first draft that learns the prompt (paid with or without the option on a new slot) and
    the slot's memory then. Prompts are cut from the agentic family's token stream. Rounds
    alternate the sizes; medians in µs (perf_counter around the engine call)."""
    reqs = read_requests(str(benchlib.TRACES / "agentic.jsonl.gz"))
    stream = np.concatenate([np.concatenate([r.prompt[-2000:], r.output]) for r in reqs[:400]])
    engine = SpecEngine("ngram-cache", n_slots=1, ngram_cache_restart=1)
    samples = {n: {"begin_free": [], "first_draft": [], "memory": 0} for n in sizes}
    pc = time.perf_counter
    for r in range(rounds):
        for n in sizes:
            prompt = stream[20000 + r:20000 + r + n]
            engine.begin(0, prompt[:1])       # empty slot
            t0 = pc()
            engine.draft(0, prompt, int(stream[20000 + r + n]))
            samples[n]["first_draft"].append((pc() - t0) * 1e6)
            samples[n]["memory"] = engine.memory_bytes()
            t0 = pc()
            engine.begin(0, prompt)           # frees what this request learned
            samples[n]["begin_free"].append((pc() - t0) * 1e6)
    rows = []
    for n in sizes:
        m = samples[n]["memory"]
        rows.append(dict(prompt=n, begin_restart_us=statistics.median(samples[n]["begin_free"]),
                         first_draft_us=statistics.median(samples[n]["first_draft"]),
                         memory_mib=m / 2 ** 20, bytes_per_token=m / n))
    return rows


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--limit", type=int, help="first N requests per family")
    ap.add_argument("--family", action="append", choices=FAMILIES)
    ap.add_argument("--type", action="append", choices=sorted({t for t, _ in OPTIONS}),
                    help="only this spec type's option (repeatable; default: all)")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("options.json"),
                    help="write the measurements here (default: %(default)s)")
    ap.add_argument("--cache-cost", action="store_true",
                    help="measure ngram-cache restart's begin cost and memory instead")
    args = ap.parse_args(argv)
    if args.cache_cost:
        print("| prompt (tokens) | begin with restart (µs) | first draft: learn the prompt (µs) "
              "| slot memory (MiB) | bytes per token |")
        print("|---:|---:|---:|---:|---:|")
        for row in cache_restart_cost():
            print(f"| {row['prompt']} | {row['begin_restart_us']:.0f} | "
                  f"{row['first_draft_us']:.0f} | {row['memory_mib']:.2f} | "
                  f"{row['bytes_per_token']:.0f} |")
        return
    families = args.family or list(FAMILIES)
    rows = {}
    for spec_type, keyword in OPTIONS:
        if args.type and spec_type not in args.type:
            continue
        if not available(spec_type, keyword):
            print(f"skipping {spec_type}: no option {keyword} in this build", file=sys.stderr)
            continue
        for value in (0, 1):
            rows[f"{spec_type}, {keyword}={value}"] = (spec_type, {keyword: value})
    measured = {name: {} for name in rows}
    for fam in families:
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), args.limit)
        for name, (spec_type, params) in rows.items():
            r = replay_family(SpecEngine(spec_type, n_slots=1, **params), requests)
            measured[name][fam] = r
            print(f"{fam:16s} {name:40s} {cell(r)}  {r['seconds']:.1f} s, "
                  f"{r['us_per_draft']:.2f} us/draft, {r['us_per_begin']:.1f} us/begin, "
                  f"{r['memory_mib']:.1f} MiB after the last request", file=sys.stderr,
                  flush=True)
    print("| configuration (shared state) | " + " | ".join(families) + " |")
    print("|---|" + "---|" * len(families))
    for name, per_fam in measured.items():
        print(f"| {name} | " + " | ".join(cell(per_fam[f]) for f in families) + " |")
    with open(args.json, "w") as f:
        json.dump(measured, f, indent=1)


if __name__ == "__main__":
    main()
