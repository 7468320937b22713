"""Replay every trace family through every proposer and llama-cpp-python's prompt lookup.

    python bench/replay_report.py [--repeat 3] [--families code-edit,agentic,...]
                                  [--limit FAMILY=N ...] [--json FILE]

The loop is ``ngramspec replay``'s (``ngramspec.replay.replay_request``: one server slot,
shared state, greedy verification against the recorded output); llama-cpp-python's
`LlamaPromptLookupDecoding` runs in it as an ngramspec `PyProposer`. Per family and proposer
it prints tokens per verification step, acceptance rate and us per draft call (the driver's
``us_per_gen_call`` method, over --repeat runs interleaved so every proposer sees the same
machine load; each call's minimum over the runs, see `benchlib.per_call_us`), next to
llama.cpp's C++ per call from the spec's section 9 row whose context
range is nearest the family's mean context at the draft calls (its traces, not these).
"""
from __future__ import annotations

import argparse
import json
import sys

import benchlib
from benchlib import LLAMA_CPP_ROWS, LLAMA_CPP_US, PROMPT_LOOKUP, PROPOSERS, geomean
from ngramspec.traces import read_requests

FAMILIES = ["code-edit", "agentic", "reasoning", "chat", "model-generated"]
CORE = ["simple", "map-k", "map-k4v", "mod"]


def run(args):
    limits = dict(benchlib.REPORT_LIMITS)
    for item in args.limit or []:
        fam, _, n = item.partition("=")
        limits[fam] = int(n) if n not in ("", "all") else None
    families = args.families.split(",")
    names = [*PROPOSERS] + ([PROMPT_LOOKUP] if not args.no_prompt_lookup else [])
    engines = benchlib.Engines()
    table = {}
    for fam in families:
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limits.get(fam))
        runs = {name: [] for name in names}
        for r in range(args.repeat):
            for name in names:
                if name == PROMPT_LOOKUP and r >= args.pl_repeat:
                    continue
                s = benchlib.replay_family(engines.factory(name), requests)
                runs[name].append(s.pop("call_ns"))
                best = table.get((fam, name))
                if best is None:
                    table[(fam, name)] = s
                    continue
                for k in ("n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens"):
                    if s[k] != best[k]:
                        raise RuntimeError(f"{fam}/{name}: {k} differs between runs")
                if s["us_per_gen_call"] < best["us_per_gen_call"]:
                    best.update({k: s[k] for k in ("us_per_gen_call", "us_per_acc_call",
                                                   "us_per_begin_call")})
        for name in names:
            table[(fam, name)]["us_min"] = benchlib.per_call_us(runs[name], "min")
            table[(fam, name)]["us_median"] = benchlib.per_call_us(runs[name], "median")
        print(f"  {fam}: {len(requests)} requests done", file=sys.stderr)
    return families, names, limits, table


def render(families, names, limits, table, repeat, pl_repeat):
    p = print
    p("| family (requests replayed) | proposer | tokens/step | acceptance | drafts / calls "
      "| us per draft call | (median) | (best run's mean) | ×faster than prompt lookup "
      "| llama.cpp us (spec row) | ngramspec / llama.cpp |")
    p("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for fam in families:
        base = table.get((fam, PROMPT_LOOKUP))
        n = table[(fam, names[0])]["n_traces"]
        lim = limits.get(fam)
        fam_label = f"{fam} ({'first ' + str(n) if lim is not None else 'all ' + str(n)})"
        mean_ctx = table[(fam, "simple")]["mean_context"] if (fam, "simple") in table else 0
        row = benchlib.spec_row_for(mean_ctx)
        for name in names:
            s = table[(fam, name)]
            us = s["us_min"]
            speed = f"{base['us_min'] / us:.0f}×" if base and name != PROMPT_LOOKUP \
                else "—"
            ref, ratio = "—", "—"
            if name in CORE:
                ref_us = LLAMA_CPP_US[row][name]
                ratios[(fam, name)] = us / ref_us
                ref = f"{ref_us:.2f} ({row})"
                ratio = f"**{us / ref_us:.2f}×**"
            p(f"| {fam_label} | {name} | {s['tokens_per_step']:.3f} | {s['acc_rate']:.3f} "
              f"| {s['n_drafts']} / {s['n_draft_calls']} | {us:.3f} | {s['us_median']:.3f} "
              f"| {s['us_per_gen_call']:.3f} "
              f"| {speed} | {ref} | {ratio} |")
            fam_label = ""
    p("")
    p("Mean context at the draft calls: " + "; ".join(
        f"{fam} {table[(fam, 'simple')]['mean_context']:.0f} tokens" for fam in families
        if (fam, "simple") in table) + ".")
    p(f"us per draft call: every call timed as the replay driver times it (perf_counter_ns "
      f"around the engine's draft call), each call's minimum over {repeat} interleaved runs, "
      f"averaged over the calls ({pl_repeat} run(s) for the prompt lookup); then the same with "
      f"each call's median, and the replay driver's `us_per_gen_call` as it reports it (total "
      f"draft time / calls) for the best run, which counts pre-empted calls in full. "
      f"Spec rows: " + "; ".join(
          f"{k} = {v}" for k, v in LLAMA_CPP_ROWS.items()) + ".")
    if ratios:
        gm = geomean(list(ratios.values()))
        worst = max(ratios, key=ratios.get)
        p(f"\nGeometric mean of ngramspec / llama.cpp over {len(ratios)} (family, proposer) "
          f"pairs: **{gm:.3f}×** (target <= 1.0); largest **{ratios[worst]:.2f}×** "
          f"({worst[1]} on {worst[0]}; target <= 2×).")
        for name in CORE:
            rs = [v for (f, n), v in ratios.items() if n == name]
            p(f"- {name}: geometric mean {geomean(rs):.2f}×, max {max(rs):.2f}×")
        med = [table[(f, n)]["us_median"] / LLAMA_CPP_US[
            benchlib.spec_row_for(table[(f, "simple")]["mean_context"])][n] for (f, n) in ratios]
        p(f"\nWith each call's median instead of its minimum: geometric mean "
          f"{geomean(med):.3f}×, largest {max(med):.2f}×.")
    return ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--limit", action="append", metavar="FAMILY=N",
                    help="replay the first N requests of FAMILY (N=all: every request); "
                         f"defaults: {benchlib.REPORT_LIMITS}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per ngramspec proposer")
    ap.add_argument("--pl-repeat", type=int, default=1, help="runs of the prompt lookup")
    ap.add_argument("--no-prompt-lookup", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="also write the summaries as JSON")
    args = ap.parse_args(argv)
    families, names, limits, table = run(args)
    ratios = render(families, names, limits, table, args.repeat, args.pl_repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": limits,
                       "rows": [dict({k: v for k, v in s.items() if k != "stats"},
                                     family=fam, name=name)
                                for (fam, name), s in table.items()],
                       "ratios": {f"{n}@{f}": v for (f, n), v in ratios.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
