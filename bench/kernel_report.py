"""Per-call cost by context size, begin/reset costs and memory per slot, as Markdown tables.

    python bench kernels [--rounds 15] [--sizes 1k,8k,32k,48k,128k] [--json FILE]
                         [--md FILE] [--no-cpp] [--no-prompt-lookup]

Everything compared is measured side by side in this one run: each round prepares a fresh,
warmed engine for every proposer in turn, each followed by the same configuration on the
llama.cpp C++ baseline (``llamacpp_baseline``), then llama-cpp-python's prompt lookup, and
replays the same draft calls on it (see `benchlib`). The C++ baseline times its calls inside
C++. A draft call is timed as ``ngramspec
replay`` times it (``us_per_gen_call``: perf_counter_ns around the engine's draft call from
Python); the table gives each call's minimum over the rounds averaged over the calls (the spec's
statistic is the minimum over repeats; per call, it is robust to the scheduler pre-empting a
call on this shared 2-core machine), the same with the median, and the best round's mean. The
ratios to llama.cpp use the C++ baseline measured here; a second table still compares with the
spec's section 9 (llama.cpp's own C++ on its own traces, not measured here).
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import numpy as np

import benchlib
from benchlib import (CPP, LLAMA_CPP_ROWS, LLAMA_CPP_US, MIB, PROMPT_LOOKUP, PROPOSERS,
                      SIZE_REF, SIZES, geomean, is_cpp)
from ngramspec import ModPool

CORE = ["simple", "map-k", "map-k4v", "mod"]


def steady(ctxs, engines, names, rounds, pl_rounds):
    """(name, size) -> {"us", "median", "min", "calls", "drafts", "mean_context"}: us per
    draft call (per-call minimum, per-call median, best round's mean). `names` alternate
    ngramspec and C++ configurations, so every round measures both under the same load."""
    out = {}
    for label, ctx in ctxs.items():
        plans = {}
        for name in names:
            factory = engines.factory(name)
            plans[name] = (factory, benchlib.make_plan(factory, ctx))
            if is_cpp(name):
                ours = plans[name[len(CPP):]][1]
                if plans[name][1].lengths != ours.lengths:
                    raise AssertionError(f"{name} at {label}: drafts differ from ngramspec's")
        samples = {name: [] for name in names}
        for r in range(rounds):
            for name in names:
                if name == PROMPT_LOOKUP and r >= pl_rounds:
                    continue
                factory, plan = plans[name]
                # Free the previous engine first: its teardown would otherwise run between
                # this one's warm-up and its measured calls and evict the lines they read.
                engine = None
                engine = benchlib.prepare(factory, ctx, plan)
                samples[name].append(benchlib.run_timed(engine, plan.steps))
        for name in names:
            plan = plans[name][1]
            out[(name, label)] = {
                "us": benchlib.per_call_us(samples[name], "min"),
                "median": benchlib.per_call_us(samples[name], "median"),
                "min": min(float(r.mean()) for r in samples[name]) / 1000,
                "calls": len(plan.steps), "drafts": sum(1 for n in plan.lengths if n),
                "mean_context": plan.mean_context}
        print(f"  steady {label} done", file=sys.stderr)
    return out


def first_draft(ctxs, engines, names, rounds):
    """(name, size) -> min us of the first draft call after begin on a `size` prompt."""
    out = {}
    clock = time.perf_counter_ns
    for label, ctx in ctxs.items():
        prompt = ctx.tokens[:ctx.size]
        sampled = int(ctx.tokens[ctx.size])
        best = {}
        for _ in range(rounds):
            for name in names:
                engine = engines.factory(name)()
                engine.begin(0, prompt)
                t0 = clock()
                engine.draft(0, prompt, sampled)
                t = (clock() - t0) / 1000
                if is_cpp(name):
                    t = engine.last_ns / 1000         # timed inside C++
                best[name] = min(best.get(name, t), t)
        for name in names:
            out[(name, label)] = best[name]
    return out


def begins(ctxs, engines, names, rounds):
    """(name, size) -> min ms of begin() on a fresh engine; ("rewrite " + name, size) for
    ngram-map's begin after the history was rewritten."""
    out = {}
    clock = time.perf_counter_ns
    for label, ctx in ctxs.items():
        prompt = ctx.tokens[:ctx.size]
        best = {}
        map_plans = {m: benchlib.make_plan(engines.factory(m), ctx) for m in names
                     if m.endswith(("map-k", "map-k4v"))}
        for _ in range(rounds):
            for name in names:
                engine = engines.factory(name)()
                t0 = clock()
                engine.begin(0, prompt)
                t = (clock() - t0) / 1e6
                if is_cpp(name):
                    t = engine.last_begin_ns / 1e6
                best[name] = min(best.get(name, t), t)
            for m, plan in map_plans.items():
                engine = benchlib.prepare(engines.factory(m), ctx, plan)
                benchlib.run(engine, plan.steps)
                half = ctx.tokens[:ctx.size // 2]
                t0 = clock()
                engine.begin(0, half)
                t = (clock() - t0) / 1e6
                if is_cpp(m):
                    t = engine.last_begin_ns / 1e6
                best["rewrite " + m] = min(best.get("rewrite " + m, t), t)
        out.update({(k, label): v for k, v in best.items()})
    return out


def pool_costs(rounds):
    clock = time.perf_counter_ns
    pool = ModPool()
    reset, alloc = [], []
    for _ in range(rounds):
        t0 = clock()
        pool.reset()
        reset.append((clock() - t0) / 1e6)
        t0 = clock()
        p = ModPool()
        alloc.append((clock() - t0) / 1e6)
        del p
    return {"reset": (min(reset), statistics.median(reset)),
            "alloc": (min(alloc), statistics.median(alloc))}


def overhead(engines, names, rounds, n=2000):
    """us per draft call on a 16-token context (no n-gram proposer can draft)."""
    ctx = np.arange(100, 116, dtype=np.int32)
    out = {}
    clock = time.perf_counter_ns
    made = {}
    for name in names:
        made[name] = engines.factory(name)()
        made[name].begin(0, ctx)
    for _ in range(rounds):
        for name in names:
            engine = made[name]
            draft = engine.draft
            if is_cpp(name):                # timed inside C++, call by call
                total = 0
                for _ in range(n):
                    draft(0, ctx, 7)
                    total += engine.last_ns
                t = total / n / 1000
            else:
                t0 = clock()
                for _ in range(n):
                    draft(0, ctx, 7)
                t = (clock() - t0) / n / 1000
            out[name] = min(out.get(name, t), t)
    return out


def fmt(v, digits=2):
    return "—" if v is None else f"{v:.{digits}f}"


def cpp_section(p, st, labels):
    """The measured comparison with llama.cpp's algorithms in C++; returns {(name, size): ratio}."""
    p("## Ratio ngramspec / llama.cpp C++, measured here side by side\n")
    p("The C++ baseline (`bench/llamacpp_baseline`, llama.cpp's algorithms and glue from the spec, "
      "`g++ -O2`, every golden draft reproduced: `python bench cpp-baseline`) replays the same "
      "plans as ngramspec, in alternating rounds. Its calls are timed inside C++ (steady_clock "
      "around the glue's draft call), ngramspec's from Python as `ngramspec replay` does; both "
      "with the same statistic (each call's minimum over the rounds, averaged over the calls).\n")
    p("| proposer | size | mean context | ngramspec µs | C++ µs | ratio ngramspec/C++ "
      "| (ratio of per-call medians) |")
    p("|---|---|---|---|---|---|---|")
    ratios, med = {}, {}
    for name in PROPOSERS:
        for l in labels:
            ours, cpp = st[(name, l)], st[(CPP + name, l)]
            ratios[(name, l)] = ours["us"] / cpp["us"]
            med[(name, l)] = ours["median"] / cpp["median"]
            p(f"| {name} | {l} | {ours['mean_context']:.0f} | {ours['us']:.3f} | {cpp['us']:.3f} "
              f"| **{ratios[(name, l)]:.2f}×** | {med[(name, l)]:.2f}× |")
    p("\nRatio ngramspec / C++ by size:\n")
    p("| proposer | " + " | ".join(labels) + " | geometric mean | max |")
    p("|" + "---|" * (len(labels) + 3))
    for name in PROPOSERS:
        rs = [ratios[(name, l)] for l in labels]
        p(f"| {name} | " + " | ".join(f"{r:.2f}×" for r in rs)
          + f" | {geomean(rs):.2f}× | {max(rs):.2f}× |")
    core = {k: v for k, v in ratios.items() if k[0] in CORE}
    worst = max(core, key=core.get)
    p(f"\nGeometric mean over the {len(core)} (proposer, size) pairs of the four proposers: "
      f"**{geomean(list(core.values())):.3f}×** (target <= 1.0); largest **{core[worst]:.2f}×** "
      f"({worst[0]} at {worst[1]}; target <= 2×). With per-call medians: geometric mean "
      f"{geomean([med[k] for k in core]):.3f}×, largest {max(med[k] for k in core):.2f}×. "
      f"The chain, all four at once: geometric mean "
      f"{geomean([ratios[('chain', l)] for l in labels]):.2f}×.\n")
    ref_labels = [l for l in labels if l in SIZE_REF]
    if ref_labels:
        p("The C++ baseline here next to the spec's section 9 figures (llama.cpp's own code on "
          "the spec's traces and machine), µs per call:\n")
        p("| proposer | " + " | ".join(f"{l}: here / {LLAMA_CPP_ROWS[SIZE_REF[l]]}"
                                       for l in ref_labels) + " |")
        p("|" + "---|" * (len(ref_labels) + 1))
        for name in CORE:
            p(f"| {name} | " + " | ".join(
                f"{st[(CPP + name, l)]['us']:.2f} / {LLAMA_CPP_US[SIZE_REF[l]][name]:.2f}"
                for l in ref_labels) + " |")
        p("")
    return ratios, med


def report(args):
    labels = args.sizes.split(",")
    ngram = [x for n in PROPOSERS for x in ([n] if args.no_cpp else [n, CPP + n])]
    names = ngram + ([PROMPT_LOOKUP] if not args.no_prompt_lookup else [])
    m = _measure(args, labels, ngram, names)
    lines = []

    def p(text=""):
        print(text)
        lines.append(text)

    st = m["steady"]
    _steady_section(p, m, labels, names)
    cpp_ratios, cpp_med = ({}, {}) if args.no_cpp else cpp_section(p, st, labels)
    ratios, gm = _ratio_section(p, st, labels, names, args.no_cpp)
    _call_sections(p, m, labels, ngram, names)
    _memory_section(p, m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m["info"], "timer_ns": m["timer"],
                       "steady": {f"{n}@{l}": v for (n, l), v in st.items()},
                       "first_draft": {f"{n}@{l}": v for (n, l), v in m["first"].items()},
                       "begin_ms": {f"{n}@{l}": v for (n, l), v in m["begin"].items()},
                       "pool_ms": m["pool"], "overhead_us": m["overhead"], "memory": m["mem"],
                       "ratios": {f"{n}@{l}": v for (n, l), v in ratios.items()},
                       "geomean": gm,
                       "ratios_cpp": {f"{n}@{l}": v for (n, l), v in cpp_ratios.items()},
                       "ratios_cpp_median": {f"{n}@{l}": v for (n, l), v in cpp_med.items()},
                       "geomean_cpp": geomean([v for (n, l), v in cpp_ratios.items()
                                               if n in CORE])}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")


def _measure(args, labels, ngram, names) -> dict:
    """Every figure of the report: machine, timer, steady draft calls, first drafts, begins,
    pool costs, fixed call cost, memory."""
    corpus = benchlib.Corpus("code-edit")
    ctxs = {label: corpus.context(label, SIZES[label]) for label in labels}
    engines = benchlib.Engines()
    m = {"info": benchlib.machine(with_cpp=not args.no_cpp),
         "timer": benchlib.timer_overhead_ns()}
    m["steady"] = steady(ctxs, engines, names, args.rounds, args.pl_rounds)
    m["first"] = first_draft(ctxs, engines, ngram, args.rounds)
    m["begin"] = begins({k: v for k, v in ctxs.items() if k != "48k"}, engines, ngram,
                        max(3, args.rounds // 2))
    m["pool"] = pool_costs(max(5, args.rounds))
    m["overhead"] = overhead(engines, names, max(5, args.rounds // 2))
    with tempfile.TemporaryDirectory() as tmp:
        m["mem_ctx"] = corpus.context("8k", SIZES["8k"])
        m["mem"] = benchlib.memprobe_many([(n, s) for n in PROPOSERS for s in (1, 16, 64)],
                                          m["mem_ctx"], 256, tmp)
    return m


def _steady_section(p, m, labels, names) -> None:
    st = m["steady"]
    p("## Machine\n")
    for k, v in m["info"].items():
        p(f"- {k}: {v}")
    p(f"- an empty `perf_counter_ns()` interval reads {m['timer']:.0f} ns on this machine "
      f"(included in every per-call figure, as in `ngramspec replay`)\n")

    p("## Draft call, steady state: us per call\n")
    p("Each call's minimum over the rounds, averaged over the calls; in parentheses the same "
      "with each call's median, then the best round's mean per call.\n")
    p("Context: code-edit traces concatenated as one session (`bench/benchlib.py`); begin on the "
      "request's prompt, warm replay to the size, then the draft calls while the context grows "
      "by the window shown.\n")
    head = "| proposer | " + " | ".join(labels) + " |"
    p(head)
    p("|" + "---|" * (len(labels) + 1))
    for name in names:
        cells = [f"{st[(name, l)]['us']:.3f} ({st[(name, l)]['median']:.3f}; "
                 f"{st[(name, l)]['min']:.3f})" for l in labels]
        p(f"| {name} | " + " | ".join(cells) + " |")
    p("| calls / drafts per round (simple) | " + " | ".join(
        f"{st[('simple', l)]['calls']} / {st[('simple', l)]['drafts']}" for l in labels) + " |")
    p("| mean context at the calls (simple) | " + " | ".join(
        f"{st[('simple', l)]['mean_context']:.0f}" for l in labels) + " |")
    p("")


def _ratio_section(p, st, labels, names, no_cpp):
    """Ours / llama.cpp's per call (the spec's figures) and the long-context speed-ups;
    returns the ratios and their geometric mean."""
    p("## Ratio ngramspec / llama.cpp per call (llama.cpp: spec section 9, its own C++ on its "
      "own traces, not measured here)\n")
    ref_labels = [l for l in labels if l in SIZE_REF]
    p("| proposer | " + " | ".join(f"{l} vs {LLAMA_CPP_ROWS[SIZE_REF[l]]}" for l in ref_labels)
      + " | geometric mean | max |")
    p("|" + "---|" * (len(ref_labels) + 3))
    ratios = {}
    for name in CORE:
        cells, rs = [], []
        for l in ref_labels:
            ours = st[(name, l)]["us"]
            ref = LLAMA_CPP_US[SIZE_REF[l]][name]
            r = ours / ref
            rs.append(r)
            ratios[(name, l)] = r
            cells.append(f"{ours:.3f} / {ref:.2f} = **{r:.2f}×**")
        p(f"| {name} | " + " | ".join(cells) + f" | {geomean(rs):.2f}× | {max(rs):.2f}× |")
    gm = geomean(list(ratios.values()))
    med = {(n, l): st[(n, l)]["median"] / LLAMA_CPP_US[SIZE_REF[l]][n] for (n, l) in ratios}
    p(f"\nGeometric mean over {len(ratios)} (proposer, size) pairs: **{gm:.3f}×** "
      f"(target <= 1.0); largest: **{max(ratios.values()):.2f}×** "
      f"({max(ratios, key=ratios.get)[0]} at {max(ratios, key=ratios.get)[1]}; target <= 2×). "
      f"With each call's median instead of its minimum: geometric mean "
      f"{geomean(list(med.values())):.3f}×, largest {max(med.values()):.2f}×.\n")
    _long_context_lines(p, st, labels, no_cpp)
    if PROMPT_LOOKUP in names:
        p("\nSpeed-up over llama-cpp-python's LlamaPromptLookupDecoding (its us / ours), same "
          "contexts, same run:\n")
        p("| proposer | " + " | ".join(labels) + " |")
        p("|" + "---|" * (len(labels) + 1))
        for name in PROPOSERS:
            p(f"| {name} | " + " | ".join(
                f"{st[(PROMPT_LOOKUP, l)]['us'] / st[(name, l)]['us']:.0f}×" for l in labels)
              + " |")
    p("")
    return ratios, gm


def _long_context_lines(p, st, labels, no_cpp) -> None:
    if "32k" in labels:
        est = benchlib.llama_simple_estimate(SIZES["32k"])
        ours = st[("simple", "32k")]["us"]
        p(f"ngram-simple at 32k: {ours:.3f} us vs llama.cpp ≈{est:.1f} us (linear interpolation "
          f"of the spec's 13.4 us at ~9.4k and 58.7 us at ~47k; not a measurement): "
          f"**{est / ours:.1f}× faster** (target >= 10×).")
    if "48k" in labels:
        ours = st[("simple", "48k")]["us"]
        p(f"ngram-simple at 48k: {ours:.3f} us vs llama.cpp 58.7 us (python_long, measured): "
          f"**{58.7 / ours:.1f}× faster**.")
    for l in ("32k", "48k", "128k"):
        if l in labels and not no_cpp:
            ours, cpp = st[("simple", l)]["us"], st[(CPP + "simple", l)]["us"]
            p(f"ngram-simple at {l}, C++ baseline measured here: {ours:.3f} us vs {cpp:.1f} us: "
              f"**{cpp / ours:.1f}× faster**.")


def _call_sections(p, m, labels, ngram, names) -> None:
    """First draft after begin, the fixed cost of a call, begin() and the pool's reset."""
    fd, oh, bg, pc = m["first"], m["overhead"], m["begin"], m["pool"]
    p("## First draft after begin: us (min over rounds)\n")
    p("| proposer | " + " | ".join(labels) + " |")
    p("|" + "---|" * (len(labels) + 1))
    for name in ngram:
        p(f"| {name} | " + " | ".join(fmt(fd[(name, l)], 2) for l in labels) + " |")
    p("")

    p("## Fixed cost of a draft call (16-token context, nothing drafted): us per call\n")
    p("| " + " | ".join(names) + " |")
    p("|" + "---|" * len(names))
    p("| " + " | ".join(f"{oh[n]:.3f}" for n in names) + " |\n")

    blabels = [l for l in labels if l != "48k"]
    p("## begin() and pool reset: ms (min over rounds)\n")
    p("| begin on a prompt of | " + " | ".join(blabels) + " |")
    p("|" + "---|" * (len(blabels) + 1))
    rewrites = ["rewrite " + m for m in ngram if m.endswith(("map-k", "map-k4v"))]
    for name in [*ngram, *rewrites]:
        label = name if not name.startswith("rewrite") else \
            name[len("rewrite "):] + ", history rewritten (index cleanup)"
        p(f"| {label} | " + " | ".join(f"{bg[(name, l)]:.3f}" for l in blabels) + " |")
    p(f"\nModPool.reset(): {pc['reset'][0]:.3f} ms (median {pc['reset'][1]:.3f}); "
      f"ModPool(): {pc['alloc'][0]:.3f} ms (median {pc['alloc'][1]:.3f}). llama.cpp (spec): "
      + "; ".join(f"{k}: {v} ms" for k, v in benchlib.LLAMA_CPP_BEGIN_MS.items()) + ".\n")


def _memory_section(p, m) -> None:
    p("## Memory\n")
    p(f"Every slot served the 8k request (begin on {m['mem_ctx'].prompt_len} prompt tokens, "
      f"then 256 replayed verification steps). `memory_bytes()` is the engine's own accounting "
      f"(the shared ModPool not included); RSS is the process's resident-set growth, measured "
      f"in a fresh process.\n")
    p("| proposer | slots | memory_bytes() per slot | RSS growth per slot | ModPool bytes "
      "| ModPool RSS growth |")
    p("|---|---|---|---|---|---|")
    for row in m["mem"]:
        s = row["slots"]
        p(f"| {row['name']} | {s} | {row['memory_bytes'] / s / 1024:.1f} KiB "
          f"| {row['rss_engine'] / s / 1024:.1f} KiB "
          f"| {row['pool_nbytes'] / MIB:.0f} MiB | {row['rss_pool'] / MIB:.2f} MiB |")


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--sizes", default=",".join(SIZES), help="context sizes (default: all)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds per measurement")
    ap.add_argument("--pl-rounds", type=int, default=3, help="rounds for the prompt lookup")
    ap.add_argument("--no-prompt-lookup", action="store_true",
                    help="skip llama-cpp-python's LlamaPromptLookupDecoding")
    ap.add_argument("--no-cpp", action="store_true", help="skip the llama.cpp C++ baseline")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("kernels.json"),
                    help="write the figures as JSON here (default: %(default)s)")
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("kernels.md"),
                    help="write the tables as Markdown here (default: %(default)s)")
    report(ap.parse_args(argv))


if __name__ == "__main__":
    main()
