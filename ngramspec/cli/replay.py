"""``ngramspec replay``: replay token traces through a proposer chain (offline verification)."""
from __future__ import annotations

import json
import os

from ngramspec.files import atomic_write_bytes, same_file
from ngramspec.cli.common import (Progress, add_draft_bound_flag, add_output_flag,
                                  add_progress_flags, add_slots_flag, add_store_flag,
                                  check_writable, int_arg)
from ngramspec.config import (SpecConfig, add_policy_arguments, add_spec_arguments,
                              load_cache_files)
from ngramspec.cost import load_cost_model, modeled_speedup, oracle_speedup
from ngramspec.policy import AutoPolicy
from ngramspec.replay import replay
from ngramspec.stats import acceptance_line, statistics_line
from ngramspec.traces import read_requests


#: Largest --slots: far above any server's slot count, and a bound on what the engine allocates.
MAX_SLOTS = 65536


def add_parser(subparsers):
    p = subparsers.add_parser(
        "replay", help="replay token traces through a proposer chain",
        description="Replay .jsonl/.jsonl.gz token traces under greedy verification and report "
                    "llama.cpp's statistics.")
    p.add_argument("traces", nargs="+", metavar="TRACES", help="trace files (.jsonl, .jsonl.gz)")
    add_spec_arguments(p, "llama.cpp")
    add_policy_arguments(p, "llama.cpp", why="llama.cpp's, what llama-server drafts; auto needs "
                                             "--cost-model",
                     cost_default="none: no modeled speed-up, and auto needs one")
    p.add_argument("--state", choices=("shared", "fresh"), default="shared",
                   help="shared: one engine for all requests (a server); fresh: one per request "
                        "(default: shared)")
    add_slots_flag(p, kind=int_arg(1, MAX_SLOTS), default=1, metavar="K",
                   help=f"server slots, 1 .. {MAX_SLOTS}; request t runs on slot t %% K "
                        f"(default: 1, one slot that serves the requests in turn)")
    p.add_argument("--limit", type=int_arg(1), default=None, metavar="N",
                   help="replay only the first N requests of each file (default: all)")
    p.add_argument("--repeat", type=int_arg(1), default=1, metavar="R",
                   help="replay R times and report the fastest timings (default: 1)")
    add_draft_bound_flag(p)
    add_store_flag(p)
    p.add_argument("--drafts", action="store_true",
                   help="record every draft (with --output; default: off)")
    add_output_flag(p, help="also write golden-format JSON lines to FILE (replaced only when "
                            "the whole run succeeds; default: none)")
    add_progress_flags(p)
    p.set_defaults(run=run)
    return p


def _policies(args):
    """(name, policy factory) of each replay: the --spec-policy one first; with --cost-model and
    the fixed policy, auto against that cost model as well, for the comparison."""
    if args.cost_model is None:
        if args.spec_policy == "auto":
            raise ValueError("--spec-policy auto in replay needs --cost-model FILE|NAME "
                             "(the verify-cost curve it weighs drafts against)")
        return None, [("fixed", None)]
    cost_model = load_cost_model(args.cost_model)

    def auto():
        # proposer time measured here says nothing about the machine the cost model describes
        return AutoPolicy(cost_model, proposer_time=False)
    runs = [("auto", auto)] if args.spec_policy == "auto" else [("fixed", None), ("auto", auto)]
    return cost_model, runs


def _oracle(records, cost_model):
    """The oracle's modeled speed-up over the requests (drafts = the recorded output)."""
    plans = [oracle_speedup(cost_model, r["n_prompt"], r["n_output"]) for r in records]
    tokens = sum(p["tokens"] for p in plans)
    cost = sum(p["cost"] for p in plans)
    return {"cost_model": cost_model.name, "tokens": tokens, "cost": round(cost, 3),
            "speedup": round(tokens / cost, 4) if cost else 1.0}


def run(args) -> int:
    cost_model, runs = _policies(args)
    # Flags, then files: a bad flag is reported as such, whatever the files hold.
    given = dict(SpecConfig.from_args(args, "llama.cpp").params)
    if args.output:
        check_writable("--output", args.output, streams=True)
        for path in args.traces:
            if same_file(args.output, path):     # the output would replace the trace
                raise ValueError(f"--output {args.output} is the trace file {path} (the same "
                                 "file): write the replay's lines to another file")
    # cache files are read once, for every trace file and every engine of --state fresh
    args.spec_type, params = load_cache_files(args.spec_type, given)
    lines = []
    for path in args.traces:
        requests = read_requests(path, args.limit)
        result = None
        for name, factory in runs:
            with Progress(f"replay {os.path.basename(path)} ({name})", len(requests),
                          enabled=args.progress, unit="request") as progress:
                res = replay(requests, args.spec_type, params, state=args.state,
                             n_slots=args.slots, record_drafts=args.drafts, repeat=args.repeat,
                             n_ctx=args.ctx_size, policy_factory=factory, progress=progress,
                             store=args.store)
            if result is None:
                result = res
                result.summary["spec_policy"] = name
            if cost_model is not None:
                result.summary.setdefault("modeled", {})[name] = {
                    **modeled_speedup(res.requests, cost_model),
                    "tokens_per_step": res.summary["tokens_per_step"],
                    **({"policy": res.summary["policy"]} if "policy" in res.summary else {})}
        if cost_model is not None:
            result.summary["modeled"]["oracle"] = _oracle(result.requests, cost_model)
        result.summary["params"] = given     # file names, not the loaded caches
        if args.output:
            head = {"config": args.spec_type, "family": _family(requests, path),
                    "file": path, "summary": result.summary}
            lines.append(json.dumps(head) + "\n")
            lines.extend(json.dumps(rec) + "\n" for rec in result.requests)
        _print_report(path, result)
    if args.output:
        _write_output(args.output, "".join(lines))
        print(f"{args.output}: {len(lines)} JSON lines written")
    return 0


def _write_output(path: str, text: str) -> None:
    """Write ``--output`` once every trace replayed, so a failed run leaves FILE as it was.

    A regular file (or a new one) is replaced atomically, through a symbolic link to its target;
    a pipe or device (``/dev/stdout``) is written as it is.
    """
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        atomic_write_bytes(os.path.realpath(path), text.encode("utf-8"))


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
    modeled = s.get("modeled", {})
    oracle = modeled.get("oracle")
    for name, m in modeled.items():
        if name == "oracle":
            continue
        share = ""
        if oracle and oracle["speedup"] > 1:
            # a share of the gain only where there is a gain: a slow-down is no negative share
            share = (f", {(m['speedup'] - 1) / (oracle['speedup'] - 1):.0%} of the oracle's gain"
                     if m["speedup"] > 1 else ", no gain over plain decoding")
        print(f"  modeled speed-up ({name}, cost model {m['cost_model']}): {m['speedup']:.3f}x "
              f"({m['tokens']} tokens for {m['cost']:.1f} single-token decodes, "
              f"{m['tokens_per_step']:.3f} tokens per step{share})")
    if oracle:
        print(f"  modeled speed-up (oracle: drafts = the recorded output, best length per "
              f"step): {oracle['speedup']:.3f}x")
