"""Modeled speed of every configuration, fixed and auto, on the embedded model's own output.

    python bench policy [--code 8] [--chat 6] [--reasoning 4] [--agentic 4] [--n-predict 256]
                        [--outputs bench/results/policy-outputs.jsonl.gz] [--cost-model NAME]
    python bench policy --recorded 40 [--cost-model NAME]

A live run (``python bench e2e``) times generation, and on a shared machine identical work varies
by 10-15 % from run to run, so single prompts say little and tuning on them is tuning on noise.
This report takes the timing out. The embedded model's plain greedy output on e2e's prompts is
generated once (``--outputs`` keeps it, gzip'd JSON lines like ../shared/traces); every
configuration is then driven through the one verification loop against that output
(`ngramspec.replay`), which under greedy verification accepts exactly what a live run accepts:
the drafts are the live drafts, step for step. Each run is priced by a cost model (default: this
machine's cached calibration of the embedded model, one thread):

    modeled speed-up = output tokens after the first / sum over steps of c(k_i + 1, L_i)

(`ngramspec.cost.modeled_speedup`; plain decoding is 1 by construction), next to the oracle's
(`ngramspec.cost.oracle_speedup`: the true continuation drafted, the best k per step). Per family
the geometric mean over its prompts and the lowest single prompt. It is deterministic and takes
seconds: the auto policy's constants were chosen with it (bench/results/e2e-notes.md). With
``--recorded N`` the prompts' recorded trace outputs (other models' text, N prompts per family)
stand in for the embedded model's: a larger set, less like the live runs.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import time

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path

from e2e_report import AUTO, CONFIGS, load_prompts, machine, pick  # noqa: E402
from ngramspec.cost import load_cost_model, modeled_speedup, oracle_speedup  # noqa: E402
from ngramspec.policy import AutoPolicy  # noqa: E402
from ngramspec.replay import replay  # noqa: E402
from ngramspec.traces import Request, read_requests  # noqa: E402

FAMILIES = ("code-edit", "chat", "reasoning", "agentic")
DEFAULT_OUTPUTS = benchlib.RESULTS / "policy-outputs.jsonl.gz"
#: The configurations compared by default: llama.cpp's types alone and chained, ngram-suffix,
#: fixed and auto.
DEFAULT_CONFIGS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-mod 8/32",
                   "ngram-cache", "chain", "ngram-suffix", "ngram-mod 8/32 auto", "chain auto",
                   "ngram-suffix auto")


def generate_outputs(path, counts, n_predict: int, threads: int = 1, log=print) -> list:
    """Plain greedy outputs of the embedded model on e2e's prompts, written to `path`."""
    from ngramspec.llama import generate_plain, load_model
    from ngramspec.llama.model import default_model_path
    prompts = load_prompts(counts["code-edit"], counts["chat"], n_reasoning=counts["reasoning"],
                           n_agentic=counts["agentic"])
    llm = load_model(default_model_path(), n_ctx=4096, n_threads=threads)
    rows = []
    for family, r in prompts:
        t0 = time.perf_counter()
        res = generate_plain(llm, list(r.prompt), n_predict=n_predict)
        rows.append({"id": r.id, "family": family, "prompt": [int(t) for t in r.prompt],
                     "output": [int(t) for t in res.output_tokens]})
        log(f"  {family} {r.id}: {res.n_output} tokens ({time.perf_counter() - t0:.1f} s)")
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


def read_outputs(path) -> list:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def recorded_outputs(n: int, n_predict: int, max_prompt: int = 3500) -> list:
    """`n` prompts per family with their recorded outputs, cut to `n_predict` tokens."""
    rows = []
    for family in FAMILIES:
        reqs = read_requests(str(benchlib.TRACES / f"{family}.jsonl.gz"))
        # e2e's prompt windows, widened so that 40 prompts of every family fit
        lo, hi = {"code-edit": (300, 3000), "chat": (10, 1000)}.get(family, (1, 1 << 30))
        for r in pick(reqs, n, lo, hi):
            rows.append({"id": r.id, "family": family,
                         "prompt": [int(t) for t in r.prompt[-max_prompt:]],
                         "output": [int(t) for t in r.output[:n_predict]]})
    return rows


def evaluate(rows, cost_model, names) -> list:
    """Per prompt: family, oracle and the modeled speed-up of each configuration."""
    out = []
    for row in rows:
        req = Request(row["id"], np.asarray(row["prompt"], np.int32),
                      np.asarray(row["output"], np.int32), {})
        res = {"id": row["id"], "family": row["family"], "n_output": len(row["output"]),
               "oracle": oracle_speedup(cost_model, len(req.prompt), len(req.output))["speedup"]}
        for name in names:
            types, params = CONFIGS[name]
            factory = None
            if name in AUTO:
                def factory():
                    return AutoPolicy(cost_model, proposer_time=False)
            rec = replay([req], types, params, state="fresh",
                         policy_factory=factory).requests[0]
            res[name] = modeled_speedup([rec], cost_model)["speedup"]
        out.append(res)
    return out


def summarize(per_prompt, names) -> dict:
    """Per family and over all prompts: geometric mean and lowest prompt of each column."""
    groups = {f: [p for p in per_prompt if p["family"] == f] for f in FAMILIES}
    groups = {f: ps for f, ps in groups.items() if ps}
    groups["all"] = per_prompt
    return {f: {n: {"geomean": round(benchlib.geomean([p[n] for p in ps]), 4),
                    "min": round(min(p[n] for p in ps), 4)}
                for n in ("oracle", *names)} | {"n": len(ps)}
            for f, ps in groups.items()}


def share(x: float, oracle: float) -> float:
    return (x - 1.0) / (oracle - 1.0) if oracle > 1.0 else math.nan


def render(res) -> str:
    lines = []
    p = lines.append
    names, summary = res["names"], res["summary"]
    p("# Modeled speed of the draft-length policies")
    p("")
    p(f"Generated by `{res['command']}` (see its docstring for the method); revision "
      f"`{res['revision']}`. Outputs: {res['outputs']}. Cost model: {res['cost_model']}.")
    p("")
    p("Modeled speed-up over plain decoding (output tokens / Σ c(k + 1, L) over the steps), per "
      "family the geometric mean over its prompts and, in brackets, the lowest single prompt; "
      "share: (speed-up - 1) / (oracle - 1).")
    p("")
    fams = [f for f in summary if f != "all"] + ["all"]
    p("| configuration | " + " | ".join(f"{f} ({summary[f]['n']})" for f in fams)
      + " | share of oracle (all) |")
    p("|---|" + "---|" * (len(fams) + 1))
    for name in ("oracle", *names):
        cells = [f"{summary[f][name]['geomean']:.3f} ({summary[f][name]['min']:.3f})"
                 for f in fams]
        sh = share(summary["all"][name]["geomean"], summary["all"]["oracle"]["geomean"])
        p(f"| {name} | " + " | ".join(cells) + f" | {sh:.0%} |")
    p("")
    auto = [n for n in names if n in AUTO]
    fixed = [n for n in names if n not in AUTO]
    if auto and fixed:
        p("Best auto against best fixed, per family (geometric means):")
        p("")
        for f in fams:
            ba = max(auto, key=lambda n: summary[f][n]["geomean"])
            bf = max(fixed, key=lambda n: summary[f][n]["geomean"])
            p(f"- {f}: {ba} {summary[f][ba]['geomean']:.3f}, {bf} "
              f"{summary[f][bf]['geomean']:.3f}")
        p("")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    for family, default in (("code", 8), ("chat", 6), ("reasoning", 4), ("agentic", 4)):
        ap.add_argument(f"--{family}", type=int, default=default,
                        help=f"{family} prompts when generating outputs (default {default})")
    ap.add_argument("--n-predict", type=int, default=256,
                    help="output tokens per prompt (default 256)")
    ap.add_argument("--outputs", default=str(DEFAULT_OUTPUTS),
                    help="the embedded model's greedy outputs: read when the file exists, "
                         "generated and written otherwise (default %(default)s)")
    ap.add_argument("--regenerate", action="store_true",
                    help="generate the outputs again even when the file exists")
    ap.add_argument("--recorded", type=int, metavar="N",
                    help="use N prompts per family with the traces' recorded outputs instead")
    ap.add_argument("--cost-model", default="local", metavar="FILE|NAME",
                    help="c(k) to price the steps with (default: local, this machine's cached "
                         "calibration; cpu-embedded and gpu are named profiles)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma list of e2e configuration names (default: %(default)s)")
    ap.add_argument("--json", default=benchlib.result_path("policy.json"))
    ap.add_argument("--md", default=benchlib.result_path("policy.md"))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(CONFIGS)}")
    if args.recorded is not None and args.recorded < 1:
        ap.error("--recorded must be >= 1")
    # after the checks that need nothing: "local" needs this machine's cached calibration
    try:
        cost_model = load_cost_model(args.cost_model)
    except (ValueError, KeyError, OSError) as exc:
        ap.error(f"--cost-model {args.cost_model}: {exc}")
    if args.recorded is not None:
        rows = recorded_outputs(args.recorded, args.n_predict)
        outputs = (f"{args.recorded} prompts per family with the traces' recorded outputs, cut "
                   f"to {args.n_predict} tokens")
    else:
        counts = {"code-edit": args.code, "chat": args.chat, "reasoning": args.reasoning,
                  "agentic": args.agentic}
        path = args.outputs
        if os.path.exists(path) and not args.regenerate:
            rows = read_outputs(path)
        else:
            print(f"generating the embedded model's greedy outputs into {path}")
            rows = generate_outputs(path, counts, args.n_predict)
        outputs = (f"the embedded model's own greedy outputs of {len(rows)} prompts "
                   f"(`{os.path.relpath(path, benchlib.ROOT)}`)")
    per_prompt = evaluate(rows, cost_model, names)
    info = machine()
    res = {"command": benchlib.command_line("policy", argv), "revision": info.get("revision"),
           "outputs": outputs, "cost_model": cost_model.source or cost_model.name,
           "names": names, "per_prompt": per_prompt, "summary": summarize(per_prompt, names)}
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    text = render(res)
    with open(args.md, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
