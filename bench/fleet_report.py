"""A fleet of replicas against one shared store: tokens per step of ngram-suffix when the
requests of a server are spread over N data-parallel replicas, each one engine of its own,
without and with the store log (issue 35).

    python bench fleet [--families agentic,code-edit,...] [--limit FAMILY=N ...]
                       [--replicas 1,4,16] [--slots 64] [--store-only]
                       [--json FILE] [--md FILE]

Requests are replayed one after another in the trace file's order (the arrival order, kept),
through `ngramspec.replay.replay_request` (greedy verification against the recording). Request
t goes to a replica by the routing -- ``round-robin`` (t mod N) or ``sticky`` (every turn of a
conversation to the replica its first turn went to; conversations dealt round-robin; a request
without a conversation is one of its own) -- and to that replica's next slot (of ``--slots``,
round-robin). When it ends, its slot finishes it (``begin`` of an empty prompt: what a server's
slot does when the request ends), so the request reaches its replica's store at once, in every
configuration alike. With the log (the in-process backend, `ngramspec.store_log.MemoryLog`),
the replica publishes it and what its calibration learned from it, and every replica ingests
both (`Replica.sync`, in arrival order) before the next request starts: the log's lag is zero
here; a real deployment lags by its `interval` (50 ms) and a network round trip.
``--store-only``: the log carries the store's sequences only (``share_calibration=False``),
each replica calibrating from its own share of the traffic (the log before issue 35's
calibration entries).

The baseline, "one store", is one engine with the same ``--slots`` seeing every request (N = 1).
"""
from __future__ import annotations

import json
import sys

import numpy as np

import benchlib
from ngramspec.engine import SpecEngine
from ngramspec.replay import Timers, replay_request
from ngramspec.store_log import MemoryLog, Replica
from ngramspec.traces import read_requests

FAMILIES = ["agentic", "code-edit", "reasoning", "chat"]
#: The issue's request counts (agentic's first 200, as its 64-slot row).
LIMITS = {"agentic": 200, "code-edit": 100, "reasoning": 60, "chat": 100,
          "model-generated": None}
ROUTINGS = ("round-robin", "sticky")
EMPTY = np.empty(0, dtype=np.int32)


def route(requests, n: int, routing: str) -> list:
    """The replica of each request."""
    if routing == "round-robin":
        return [t % n for t in range(len(requests))]
    home: dict = {}
    out = []
    for t, req in enumerate(requests):
        conv = req.extra.get("conversation") or f"#{t}"
        if conv not in home:
            home[conv] = len(home) % n
        out.append(home[conv])
    return out


def run_fleet(requests, n: int, routing: str, shared_log: bool, n_slots: int,
              share_calibration: bool = True) -> dict:
    """Replay `requests` over `n` replicas; totals and tokens per step."""
    engines = [SpecEngine("ngram-suffix", n_slots=n_slots) for _ in range(n)]
    log = MemoryLog()
    replicas = [Replica(e.proposers[0], log, model="bench", share_calibration=share_calibration)
                for e in engines] if shared_log else []
    used = [0] * n
    timers = Timers()
    n_out = n_steps = n_acc = n_draft = 0
    for req, r in zip(requests, route(requests, n, routing)):
        slot = used[r] % n_slots
        used[r] += 1
        rec = replay_request(engines[r], slot, req.prompt, req.output, False, timers)
        engines[r].begin(slot, EMPTY)            # the request ends: its slot finishes it
        if replicas:
            replicas[r].sync()                   # publish ...
            for k, rep in enumerate(replicas):   # ... and every other replica ingests
                if k != r:
                    rep.sync()
        n_out += rec["n_output"]
        n_steps += rec["n_steps"]
        n_acc += rec["n_acc_tokens"]
        n_draft += rec["n_draft_tokens"]
    logged = [rep.stats() for rep in replicas]
    return dict(n_traces=len(requests), n_output=n_out, n_steps=n_steps,
                n_acc_tokens=n_acc, n_draft_tokens=n_draft,
                tokens_per_step=n_out / n_steps if n_steps else 0.0,
                published=sum(s["published"] for s in logged),
                ingested=sum(s["ingested"] for s in logged),
                calibration_published=sum(s["calibration_published"] for s in logged),
                calibration_ingested=sum(s["calibration_ingested"] for s in logged),
                skipped=sum(s["skipped"] for s in logged))


def run(args):
    limits = dict(LIMITS)
    for item in args.limit or []:
        fam, _, n = item.partition("=")
        limits[fam] = int(n) if n not in ("", "all") else None
    sizes = [int(x) for x in args.replicas.split(",")]
    rows = []
    for fam in args.families.split(","):
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limits.get(fam))
        base = run_fleet(requests, 1, "round-robin", False, args.slots)
        rows.append(dict(base, family=fam, replicas=1, routing="—", log=False, ratio=1.0))
        for n in sizes:
            if n == 1:
                continue
            # the control: one store with the fleet's slots (each slot sees the requests a
            # replica's slot sees under round-robin): what the log can reach at best
            s = run_fleet(requests, 1, "round-robin", False, n * args.slots)
            rows.append(dict(s, family=fam, replicas=1, slots=n * args.slots, routing="—",
                             log=False, ratio=s["tokens_per_step"] / base["tokens_per_step"]))
            for routing in ROUTINGS:
                for shared in (False, True):
                    s = run_fleet(requests, n, routing, shared, args.slots,
                                  not args.store_only)
                    rows.append(dict(s, family=fam, replicas=n, routing=routing, log=shared,
                                     ratio=s["tokens_per_step"] / base["tokens_per_step"]))
        print(f"  {fam}: {len(requests)} requests done", file=sys.stderr)
    return limits, rows


def render(rows, slots, p=print, store_only=False):
    fams = list(dict.fromkeys(r["family"] for r in rows))
    cols = [(r["replicas"], r["routing"], r["log"], r.get("slots", slots)) for r in rows
            if r["family"] == fams[0]]
    p(f"Tokens per step of ngram-suffix, each replica {slots} slots; in brackets the ratio to "
      f"one store (N = 1, the same slots, every request).\n")
    p("| family (requests) | 1 (one store) | " + " | ".join(
        f"{n} {routing}{' + log' if log else ''}" if n > 1 else f"one store, {slots_} slots"
        for n, routing, log, slots_ in cols[1:]) + " |")
    p("|---|" + "---|" * len(cols))
    worst = None
    gaps = []
    for fam in fams:
        mine = [r for r in rows if r["family"] == fam]
        cells = [f"{mine[0]['tokens_per_step']:.3f}"]
        for r in mine[1:]:
            text = f"{r['tokens_per_step']:.3f} ({r['ratio']:.3f}×)"
            cells.append(f"**{text}**" if r["log"] else text)
            if r["log"] and (worst is None or r["ratio"] < worst["ratio"]):
                worst = r
            if r["log"] and r["routing"] == "round-robin":
                control = next(c for c in mine if c.get("slots") == r["replicas"] * slots)
                gaps.append(abs(r["tokens_per_step"] - control["tokens_per_step"]))
        p(f"| {fam} ({mine[0]['n_traces']}) | " + " | ".join(cells) + " |")
    if worst is not None:
        p(f"\nWith the log, the lowest ratio to one store is **{worst['ratio']:.3f}×** "
          f"({worst['family']}, {worst['replicas']} replicas, {worst['routing']}); goal >= "
          f"0.97×.")
    if gaps and store_only:
        p(f"\nThe log carried the store only (--store-only). N replicas round-robin with it "
          f"against one store with the same N × {slots} slots: largest difference in tokens "
          f"per step {max(gaps):.4f}. What remains between N replicas and one store of "
          f"{slots} slots is ngram-suffix's calibration, each replica's own here.")
    elif gaps:
        p(f"\nThe log carries the store's sequences and the calibration's deltas (per cell, "
          f"and the tokens-per-step average's). N replicas round-robin with it against one "
          f"store with the same N × {slots} slots: largest difference in tokens per step "
          f"{max(gaps):.4f}: another replica's outcomes arrive as a block when its request "
          f"ends (the bench syncs after each request), where one store folds them step by "
          f"step.")
    return worst


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--limit", action="append", metavar="FAMILY=N",
                    help=f"replay the first N requests of FAMILY (N=all); defaults: {LIMITS}")
    ap.add_argument("--replicas", default="1,4,16", help="replica counts (default: %(default)s)")
    ap.add_argument("--slots", type=int, default=64, help="slots per replica (default: 64)")
    ap.add_argument("--store-only", action="store_true",
                    help="the log carries the store only, not the calibration")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("fleet.json"))
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("fleet.md"))
    args = ap.parse_args(argv)
    info = benchlib.machine(with_cpp=False)
    limits, rows = run(args)
    lines = []

    def p(text=""):
        print(text)
        lines.append(text)

    p("Command: `" + benchlib.command_line("fleet", argv) + "`\n")
    p("Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + "\n")
    render(rows, args.slots, p, args.store_only)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": limits, "slots": args.slots, "machine": info, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
