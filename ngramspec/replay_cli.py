"""``ngramspec replay``: replay token traces through a proposer chain (offline verification)."""
from __future__ import annotations

import json
import os

from ngramspec.cli_common import add_spec_flags, check_spec_flags, engine_params, load_cache_files
from ngramspec.replay import ProgressBar, replay
from ngramspec.stats import acceptance_line, statistics_line
from ngramspec.traces import read_requests


def positive(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def nonnegative(text):
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def add_parser(subparsers):
    p = subparsers.add_parser(
        "replay", help="replay token traces through a proposer chain",
        description="Replay .jsonl/.jsonl.gz token traces under greedy verification and report "
                    "llama.cpp's statistics.")
    p.add_argument("traces", nargs="+", metavar="TRACES", help="trace files (.jsonl, .jsonl.gz)")
    add_spec_flags(p)
    p.add_argument("--state", choices=("shared", "fresh"), default="shared",
                   help="shared: one engine for all requests (a server); fresh: one per request")
    p.add_argument("--slots", type=positive, default=1, metavar="K",
                   help="server slots; request t runs on slot t %% K")
    p.add_argument("--limit", type=positive, default=None, metavar="N",
                   help="replay only the first N requests of each file")
    p.add_argument("--repeat", type=positive, default=1, metavar="R",
                   help="replay R times and report the fastest timings")
    p.add_argument("--ctx-size", type=nonnegative, default=0, metavar="N",
                   help="bound drafts by llama-server's n_ctx - L - 2 (0: unbounded)")
    p.add_argument("--drafts", action="store_true", help="record every draft (with --output)")
    p.add_argument("--output", metavar="FILE", help="write golden-format JSON lines to FILE")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    given = engine_params(args)
    check_spec_flags(args.spec_type, given)
    # cache files are read once, for every trace file and every engine of --state fresh
    args.spec_type, params = load_cache_files(args.spec_type, given)
    out = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for path in args.traces:
            requests = read_requests(path, args.limit)
            result = replay(requests, args.spec_type, params, state=args.state,
                            n_slots=args.slots, record_drafts=args.drafts, repeat=args.repeat,
                            n_ctx=args.ctx_size,
                            progress=ProgressBar(f"replay {os.path.basename(path)}"))
            result.summary["params"] = given     # file names, not the loaded caches
            if out is not None:
                head = {"config": args.spec_type, "family": _family(requests, path),
                        "file": path, "summary": result.summary}
                out.write(json.dumps(head) + "\n")
                for rec in result.requests:
                    out.write(json.dumps(rec) + "\n")
            else:
                _print_report(path, result)
    finally:
        if out is not None:
            out.close()
    return 0


def _family(requests, path):
    if requests and "family" in requests[0].extra:
        return requests[0].extra["family"]
    return os.path.basename(path).split(".")[0]


def _print_report(path, result):
    s = result.summary
    print(f"{path}: {s['n_traces']} requests, spec-type {s['types']}, state {s['state']}, "
          f"{s['slots']} slot(s)")
    print(f"  {'output tokens':<22}{s['n_output']:>10}")
    print(f"  {'verification steps':<22}{s['n_steps']:>10}")
    print(f"  {'tokens per step':<22}{s['tokens_per_step']:>10.4f}")
    print(f"  {'drafts':<22}{s['n_drafts']:>10}")
    print(f"  {'drafted tokens':<22}{s['n_draft_tokens']:>10}")
    print(f"  {'accepted tokens':<22}{s['n_acc_tokens']:>10}")
    print(f"  {'acceptance rate':<22}{s['acc_rate']:>10.4f}")
    print(f"  {'us per draft call':<22}{s['us_per_gen_call']:>10.3f}")
    print(f"  {'us per accept call':<22}{s['us_per_acc_call']:>10.3f}")
    print(f"  {'us per begin call':<22}{s['us_per_begin_call']:>10.3f}")
    print("  " + acceptance_line(s["n_acc_tokens"], s["n_draft_tokens"], s["n_drafts"]))
    for st in s["llama_stats"]:
        print("  " + statistics_line(st))
