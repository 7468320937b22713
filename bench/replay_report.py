"""Replay every trace family through every proposer and llama-cpp-python's prompt lookup.

    python bench replay [--repeat 3] [--families code-edit,agentic,...]
                        [--limit FAMILY=N ...] [--json FILE] [--md FILE]
                        [--no-cpp] [--no-prompt-lookup] [--slots 1,16,64,256]

The loop is ``ngramspec replay``'s (``ngramspec.replay.replay_request``: one server slot,
shared state, greedy verification against the recorded output); llama-cpp-python's
`LlamaPromptLookupDecoding` runs in it as an ngramspec `PyProposer`. Per family and proposer
it prints tokens per verification step, acceptance rate and us per draft call (the driver's
``us_per_gen_call`` method, over --repeat runs interleaved so every proposer sees the same
machine load; each call's minimum over the runs, see `benchlib.per_call_us`), next to the
llama.cpp C++ baseline (``llamacpp_baseline``) replaying the same requests in the same loop,
alternately with ngramspec, its calls timed inside C++, and next to the spec's section 9 row
whose context range is nearest the family's mean context at the draft calls (its traces, not
these).

A second table replays the same requests through ngram-suffix with several server slots
(`ngramspec.replay.replay(..., n_slots=N)`: still one request after another, request t on slot
t % N, each request ended as a server ends it): what ngram-suffix learns is the server's, so
tokens per step must not fall with the slot count (issue 35: 256 slots >= 0.98x of 1).
"""
from __future__ import annotations

import json
import sys

import benchlib
from benchlib import (CPP, LLAMA_CPP_ROWS, LLAMA_CPP_US, PROMPT_LOOKUP, PROPOSERS, geomean,
                      is_cpp)
from ngramspec.replay import replay
from ngramspec.traces import read_requests

FAMILIES = ["code-edit", "agentic", "reasoning", "chat", "model-generated"]
CORE = ["simple", "map-k", "map-k4v", "mod"]


def run(args):
    limits = dict(benchlib.REPORT_LIMITS)
    for item in args.limit or []:
        fam, _, n = item.partition("=")
        limits[fam] = int(n) if n not in ("", "all") else None
    families = args.families.split(",")
    # ngramspec and the C++ baseline alternate, so both see the same machine load
    names = [x for n in PROPOSERS for x in ([n] if args.no_cpp else [n, CPP + n])]
    names += [PROMPT_LOOKUP] if not args.no_prompt_lookup else []
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
            if is_cpp(name):
                ours = table[(fam, name[len(CPP):])]
                for k in ("n_steps", "n_draft_calls", "n_drafts", "n_draft_tokens",
                          "n_acc_tokens"):
                    if table[(fam, name)][k] != ours[k]:
                        raise RuntimeError(f"{fam}/{name}: {k} differs from ngramspec's")
        print(f"  {fam}: {len(requests)} requests done", file=sys.stderr)
    return families, names, limits, table


def run_slots(families, limits, slot_counts):
    """ngram-suffix's tokens per step per family and slot count: {(family, n_slots): value}."""
    out = {}
    for fam in families:
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limits.get(fam))
        for n in slot_counts:
            s = replay(requests, "ngram-suffix", n_slots=n).summary
            out[(fam, n)] = s["n_output"] / s["n_steps"] if s["n_steps"] else 0.0
        print(f"  {fam}: slots {slot_counts} done", file=sys.stderr)
    return out


def render_slots(families, limits, slot_counts, by_slots, p=print):
    """The slot-count table; returns the worst ratio of the most slots to one slot."""
    top = max(slot_counts)
    p(f"\nngram-suffix, tokens per step by server slots (requests one after another, request t "
      f"on slot t % N; target: {top} slots >= 0.98x of 1):\n")
    p("| family (requests) | " + " | ".join(f"{n} slot{'s' if n > 1 else ''}"
                                           for n in slot_counts) + f" | {top} / 1 |")
    p("|---|" + "---|" * (len(slot_counts) + 1))
    worst = None
    for fam in families:
        lim = limits.get(fam)
        label = f"{fam} ({'first ' + str(lim) if lim is not None else 'all'})"
        ratio = by_slots[(fam, top)] / by_slots[(fam, 1)] if by_slots[(fam, 1)] else 0.0
        worst = ratio if worst is None else min(worst, ratio)
        p(f"| {label} | " + " | ".join(f"{by_slots[(fam, n)]:.3f}" for n in slot_counts)
          + f" | **{ratio:.3f}×** |")
    return worst


def render(families, names, limits, table, repeat, pl_repeat, p=print):
    """The Markdown tables; returns the ratios to the C++ baseline and to the spec's figures."""
    has_cpp = any(is_cpp(n) for n in names)
    p("| family (requests replayed) | proposer | tokens/step | acceptance | drafts / calls "
      "| µs per draft call | (median) | (best run's mean) | ×faster than prompt lookup "
      + ("| C++ µs | ratio ngramspec/C++ " if has_cpp else "")
      + "| spec §9 µs (row) | ngramspec / spec §9 |")
    p("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if has_cpp else "") + "---|---|")
    ratios, cpp_ratios, cpp_med = {}, {}, {}
    for fam in families:
        base = table.get((fam, PROMPT_LOOKUP))
        n = table[(fam, names[0])]["n_traces"]
        lim = limits.get(fam)
        fam_label = f"{fam} ({'first ' + str(n) if lim is not None else 'all ' + str(n)})"
        mean_ctx = table[(fam, "simple")]["mean_context"] if (fam, "simple") in table else 0
        row = benchlib.spec_row_for(mean_ctx)
        for name in names:
            if is_cpp(name):
                continue
            s = table[(fam, name)]
            us = s["us_min"]
            speed = f"{base['us_min'] / us:.0f}×" if base and name != PROMPT_LOOKUP \
                else "—"
            cpp_cells = ""
            if has_cpp:
                c = table.get((fam, CPP + name))
                if c is None:
                    cpp_cells = "| — | — "
                else:
                    cpp_ratios[(fam, name)] = us / c["us_min"]
                    cpp_med[(fam, name)] = s["us_median"] / c["us_median"]
                    cpp_cells = f"| {c['us_min']:.3f} | **{cpp_ratios[(fam, name)]:.2f}×** "
            ref, ratio = "—", "—"
            if name in CORE:
                ref_us = LLAMA_CPP_US[row][name]
                ratios[(fam, name)] = us / ref_us
                ref = f"{ref_us:.2f} ({row})"
                ratio = f"{us / ref_us:.2f}×"
            p(f"| {fam_label} | {name} | {s['tokens_per_step']:.3f} | {s['acc_rate']:.3f} "
              f"| {s['n_drafts']} / {s['n_draft_calls']} | {us:.3f} | {s['us_median']:.3f} "
              f"| {s['us_per_gen_call']:.3f} | {speed} {cpp_cells}| {ref} | {ratio} |")
            fam_label = ""
    p("")
    p("Mean context at the draft calls: " + "; ".join(
        f"{fam} {table[(fam, 'simple')]['mean_context']:.0f} tokens" for fam in families
        if (fam, "simple") in table) + ".")
    p(f"µs per draft call: every call timed as the replay driver times it (perf_counter_ns "
      f"around the engine's draft call), each call's minimum over {repeat} interleaved runs, "
      f"averaged over the calls ({pl_repeat} run(s) for the prompt lookup); then the same with "
      f"each call's median, and the replay driver's `us_per_gen_call` as it reports it (total "
      f"draft time / calls) for the best run, which counts pre-empted calls in full. "
      + ("C++ µs: the llama.cpp C++ baseline on the same requests in the same loop, run "
         "alternately with ngramspec, each call timed inside C++ (steady_clock around the "
         "glue's draft call), same statistic. " if has_cpp else "")
      + "Spec §9 rows (llama.cpp's own figures on the spec's traces, not measured here): "
      + "; ".join(f"{k} = {v}" for k, v in LLAMA_CPP_ROWS.items()) + ".")
    if cpp_ratios:
        core = {k: v for k, v in cpp_ratios.items() if k[1] in CORE}
        worst = max(core, key=core.get)
        p(f"\nRatio ngramspec / C++, geometric mean over the {len(core)} (family, proposer) "
          f"pairs: **{geomean(list(core.values())):.3f}×** (target <= 1.0); largest "
          f"**{core[worst]:.2f}×** ({worst[1]} on {worst[0]}; target <= 2×). With per-call "
          f"medians: geometric mean {geomean([cpp_med[k] for k in core]):.3f}×, largest "
          f"{max(cpp_med[k] for k in core):.2f}×.\n")
        p("| proposer | " + " | ".join(families) + " | geometric mean | max |")
        p("|" + "---|" * (len(families) + 3))
        for name in [*CORE, "chain"]:
            rs = [cpp_ratios[(f, name)] for f in families if (f, name) in cpp_ratios]
            if rs:
                p(f"| {name} | " + " | ".join(f"{r:.2f}×" for r in rs)
                  + f" | {geomean(rs):.2f}× | {max(rs):.2f}× |")
    if ratios:
        gm = geomean(list(ratios.values()))
        worst = max(ratios, key=ratios.get)
        p(f"\nAgainst the spec's section 9 figures instead (other traces, other machine): "
          f"geometric mean of ngramspec / llama.cpp over {len(ratios)} (family, proposer) "
          f"pairs {gm:.3f}×, largest {ratios[worst]:.2f}× ({worst[1]} on {worst[0]}).")
    return ratios, cpp_ratios, cpp_med


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--limit", action="append", metavar="FAMILY=N",
                    help="replay the first N requests of FAMILY (N=all: every request); "
                         f"defaults: {benchlib.REPORT_LIMITS}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per ngramspec proposer")
    ap.add_argument("--pl-repeat", type=int, default=1, help="runs of the prompt lookup")
    ap.add_argument("--no-prompt-lookup", action="store_true",
                    help="skip llama-cpp-python's LlamaPromptLookupDecoding")
    ap.add_argument("--no-cpp", action="store_true", help="skip the llama.cpp C++ baseline")
    ap.add_argument("--slots", default="1,16,64,256",
                    help="slot counts of the ngram-suffix table, 1 first (empty: no table)")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("replay.json"),
                    help="write the summaries as JSON here (default: %(default)s)")
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("replay.md"),
                    help="write the tables as Markdown here (default: %(default)s)")
    args = ap.parse_args(argv)
    info = benchlib.machine(with_cpp=not args.no_cpp)
    families, names, limits, table = run(args)
    slot_counts = [int(x) for x in args.slots.split(",") if x]
    if slot_counts and slot_counts[0] != 1:
        ap.error(f"--slots = {args.slots!r}: the first slot count must be 1")
    by_slots = run_slots(families, limits, slot_counts) if slot_counts else {}
    lines = []

    def p(text=""):
        print(text)
        lines.append(text)

    p("Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + "\n")
    ratios, cpp_ratios, cpp_med = render(families, names, limits, table, args.repeat,
                                         args.pl_repeat, p)
    worst_slots = render_slots(families, limits, slot_counts, by_slots, p) if by_slots else None
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": limits,
                       "rows": [dict({k: v for k, v in s.items() if k != "stats"},
                                     family=fam, name=name)
                                for (fam, name), s in table.items()],
                       "machine": info,
                       "ratios": {f"{n}@{f}": v for (f, n), v in ratios.items()},
                       "ratios_cpp": {f"{n}@{f}": v for (f, n), v in cpp_ratios.items()},
                       "ratios_cpp_median": {f"{n}@{f}": v for (f, n), v in cpp_med.items()},
                       "geomean_cpp": geomean([v for (f, n), v in cpp_ratios.items()
                                               if n in CORE]),
                       "suffix_by_slots": {f"{f}@{n}": v for (f, n), v in by_slots.items()},
                       "suffix_slots_worst_ratio": worst_slots}, f, indent=1)


if __name__ == "__main__":
    main()
