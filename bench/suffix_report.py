"""Replay report for ngram-suffix (issue 7): the DEV trace families in server state.

Every family's requests go, in file order, through ONE engine with one slot that keeps its state
from request to request (a running server), with the golden files' replay loop
(`ngramspec.replay.replay_request`: greedy verification, no n_max bound). The table is issue 7's,
extended with ngramspec's rows: tokens per verification step (sum of n_output / sum of n_steps)
and, in parentheses, the draft acceptance rate (accepted draft tokens / drafted tokens).

    python bench suffix                       # all families, + llama.cpp chain row
    python bench suffix --no-chain --family chat --param ngram_suffix_min_prob=0.01
    python bench suffix --cost                # draft-call cost at 1k / 8k / 32k context

The SuffixDecoding and vLLM rows are issue 7's figures (measured with ArcticInference on the same
files); the ngram-suffix row, and the llama.cpp chain row when the engine has those types, are
measured here.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec import SpecEngine
from ngramspec.registry import TYPES
from ngramspec.replay import Timers, replay_request
from ngramspec.traces import read_requests

SUFFIX_PARAMS = {p.name: p for p in TYPES["ngram-suffix"].params}

FAMILIES = ("code-edit", "agentic", "reasoning", "chat", "model-generated")
# issue 7's rows: (tokens per step, acceptance) per family
ISSUE_ROWS = {
    "vLLM defaults (depth 24, 32 tokens, global cache)":
        [(10.52, .92), (2.65, .42), (1.72, .29), (1.38, .25), (5.02, .79)],
    "ArcticInference defaults (depth 64, 64 tokens)":
        [(20.70, .92), (2.71, .38), (1.72, .28), (1.39, .25), (5.92, .76)],
    "tuned SuffixDecoding (depth 128, 64 tokens, spec factor 2)":
        [(31.47, .87), (2.97, .25), (1.82, .18), (1.44, .16), (6.80, .62)],
    "llama.cpp chain (simple, map-k4v, mod), shared (issue)":
        [(16.62, .86), (1.36, .21), (1.11, .14), (1.03, .16), (3.38, .75)],
}
TUNED = "tuned SuffixDecoding (depth 128, 64 tokens, spec factor 2)"
CHAIN = "ngram-mod,ngram-map-k4v,ngram-simple"


def replay_family(engine, requests):
    """Server state: one engine, slot 0, requests in file order. Returns the totals."""
    timers = Timers()
    tot = dict(n_output=0, n_steps=0, n_draft_tokens=0, n_acc_tokens=0)
    t0 = time.perf_counter()
    for req in requests:
        rec = replay_request(engine, 0, req.prompt, req.output, False, timers)
        for k in tot:
            tot[k] += rec[k]
    st = engine.stats()[0]
    tot.update(
        tokens_per_step=tot["n_output"] / tot["n_steps"] if tot["n_steps"] else 0.0,
        acc_rate=tot["n_acc_tokens"] / tot["n_draft_tokens"] if tot["n_draft_tokens"] else 0.0,
        # the proposer's own time, as the engine measures it around c_draft / c_begin
        us_per_draft=st["t_draft_us"] / max(st["calls_g"], 1),
        us_per_begin=st["t_begin_us"] / max(st["calls_b"], 1),
        seconds=time.perf_counter() - t0,
        memory_mib=engine.memory_bytes() / 2 ** 20)
    return tot


def suffix_engine(params):
    return SpecEngine("ngram-suffix", **params)


def chain_engine():
    try:
        return SpecEngine(CHAIN, n_slots=1)
    except (ValueError, TypeError):          # types not available in this build
        return None


def cell(r):
    return f"{r['tokens_per_step']:.2f} ({r['acc_rate']:.2f})"


def report(families, params, with_chain, limit):
    measured = {"ngramspec ngram-suffix (defaults)" if not params else
                f"ngramspec ngram-suffix ({', '.join(f'{k}={v}' for k, v in params.items())})": {}}
    if with_chain and chain_engine() is not None:
        measured["ngramspec llama.cpp chain (simple, map-k4v, mod), shared"] = {}
    for fam in families:
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limit)
        for name in measured:
            engine = suffix_engine(params) if "suffix" in name else chain_engine()
            r = replay_family(engine, requests)
            measured[name][fam] = r
            print(f"# {name}: {fam}: {cell(r)} in {r['seconds']:.1f} s, "
                  f"{r['us_per_draft']:.2f} us/draft, {r['memory_mib']:.1f} MiB",
                  file=sys.stderr, flush=True)
    lines = ["| configuration | " + " | ".join(families) + " |",
             "|---|" + "---|" * len(families)]
    for name, row in ISSUE_ROWS.items():
        vals = [row[FAMILIES.index(f)] for f in families]
        lines.append(f"| {name} | " + " | ".join(f"{t:.2f} ({a:.2f})" for t, a in vals) + " |")
    for name, res in measured.items():
        lines.append(f"| **{name}** | " + " | ".join(cell(res[f]) for f in families) + " |")
    suffix_row = next(iter(measured.values()))
    verdict = []
    for f in families:
        t, a = ISSUE_ROWS[TUNED][FAMILIES.index(f)]
        r = suffix_row[f]
        ok = r["tokens_per_step"] > t and r["acc_rate"] >= a
        verdict.append(f"{f}: {r['tokens_per_step'] / t - 1:+.1%} tokens/step, acceptance "
                       f"{r['acc_rate']:.3f} vs {a:.2f} -> {'beats' if ok else 'MISSES'}")
    return "\n".join(lines), verdict, measured


# ---------------------------------------------------------------------------------------------
# draft-call cost at a given context size
# ---------------------------------------------------------------------------------------------

def cost(params, sizes=(1024, 8192, 32768), n_out=2048, repeat=3):
    """µs per draft / begin call with a context of ~size tokens, as the engine times the
    proposer (best of `repeat` runs). A long real token stream (the agentic family's prompts and
    outputs, concatenated) is cut into prompt = `size` tokens and output = the next `n_out`
    tokens, after warm-up requests that fill the global store. A draft call's cost does not
    grow with the context (O(new tokens + draft length)); begin's is linear in the prompt."""
    reqs = read_requests(str(benchlib.TRACES / "agentic.jsonl.gz"))
    stream = np.concatenate([np.concatenate([r.prompt[-2000:], r.output]) for r in reqs[:400]])
    rows = []
    for size in sizes:
        best = None
        for _ in range(repeat):
            engine = suffix_engine(params)
            timers = Timers()
            # warm-up: the global store holds the outputs of the other ~1460 agentic requests
            # (~390k tokens, ~50 MiB: its lookups miss the caches as a busy server's would)
            for r in reqs[400:1900]:
                head = r.prompt[-16:]
                engine.begin(0, head)
                engine.draft(0, np.concatenate([head, r.output[:-1]]), int(r.output[-1]))
            base = engine.stats()[0]
            a = 20000
            prompt, output = stream[a:a + size], stream[a + size:a + size + n_out]
            replay_request(engine, 0, prompt, output, False, timers)
            st = engine.stats()[0]
            calls = st["calls_g"] - base["calls_g"]
            row = dict(context=size, draft_calls=calls,
                       us_per_draft=(st["t_draft_us"] - base["t_draft_us"]) / calls,
                       us_begin=st["t_begin_us"] - base["t_begin_us"],
                       memory_mib=engine.memory_bytes() / 2 ** 20)
            if best is None or row["us_per_draft"] < best["us_per_draft"]:
                best = row
        rows.append(best)
    return rows


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--family", action="append", choices=FAMILIES,
                    help="a family to replay (repeatable; default: all)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help=f"an ngram-suffix parameter: {', '.join(SUFFIX_PARAMS)}")
    ap.add_argument("--limit", type=int, help="first N requests per family (for quick runs)")
    ap.add_argument("--no-chain", action="store_true", help="skip the llama.cpp chain row")
    ap.add_argument("--cost", action="store_true", help="measure the draft-call cost instead")
    ap.add_argument("--json", metavar="FILE",
                    help="write the measurements here (default: bench/results/suffix.json, "
                         "with --cost suffix-cost.json)")
    args = ap.parse_args(argv)
    params = {}
    for kv in args.param:
        k, _, v = kv.partition("=")
        if k not in SUFFIX_PARAMS:
            ap.error(f"unknown parameter {k!r}")
        params[k] = SUFFIX_PARAMS[k].kind(v)
    if args.cost:
        rows = cost(params)
        print("| context (tokens) | draft calls | µs per draft call | begin (µs) "
              "| memory (MiB) |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['context']} | {r['draft_calls']} | {r['us_per_draft']:.2f} | "
                  f"{r['us_begin']} | {r['memory_mib']:.1f} |")
        out = rows
    else:
        table, verdict, measured = report(args.family or list(FAMILIES), params,
                                          not args.no_chain, args.limit)
        print(table)
        print()
        for v in verdict:
            print("-", v)
        out = measured
    with open(args.json or benchlib.result_path("suffix-cost.json" if args.cost
                                                else "suffix.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
