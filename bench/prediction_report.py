"""What a Predicted Output buys on code edits: tokens per step and modeled speed-up.

    python bench prediction [--limit N] [--configs ngram-mod,chain] [--json FILE] [--md FILE]

Each code-edit trace's prompt holds the file before the edit and its output is the file after
it. The prediction is the file before the edit as the trace records allow: the prompt's user
message from the first token the output starts with (the file's first line, when the edit
leaves it alone) to the message's end, a closing code fence dropped. Every request is replayed
through the one verification loop (`ngramspec.loop.run_recorded`, greedy verification against
the recorded output: the drafts a live run makes, step for step) with the chain alone and with
the prediction drafting first (`ngramspec.prediction.PredictedEngine`, as ``serve`` and
``run-batch`` run a request with ``prediction``), and with the prediction alone. Each run is
priced by the ``cpu-embedded`` and ``gpu`` cost profiles (`ngramspec.cost.modeled_speedup`:
output tokens after the first over the sum of c(k_i + 1, L_i); plain decoding is 1). Figures
are over all requests together (tokens / cost); ``min`` is the lowest single request.

The rows "inside vLLM" and "inside SGLang" (issue 37; ``--engines``, each engine's part run in
its ``.venv-ENGINE``) send the same requests through the engines' contract-test harnesses
(tests/engine_harness.py) with serve's default chain, the prediction carried in the request's
engine arguments (vLLM's ``extra_args``, SGLang's ``custom_params``) as a client's would be;
an SGLang step verifies its whole tree of d tokens, whatever the drafter found.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path

from ngramspec.cost import load_cost_model, modeled_speedup  # noqa: E402
from ngramspec.engine import SpecEngine  # noqa: E402
from ngramspec.loop import run_recorded  # noqa: E402
from ngramspec.prediction import PredictedEngine, PredictionDrafter  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

#: SmolLM2's chat markers (../shared/traces/README.md) and the tokens of a code fence line.
IM_START, IM_END = 1, 2
PROFILES = ("cpu-embedded", "gpu")
#: name -> (spec_type, engine keywords); "ngram-mod 8/32" is serve's default chain
CONFIGS = {
    "none": (None, {}),
    "ngram-mod 8/32": ("ngram-mod", {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}),
    "chain": ("ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod",
              {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}),
}
ANCHOR = 4      # output tokens that must match the prompt where the file starts


def prediction_of(prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """The file before the edit, cut from the prompt's last user message (see the docstring)."""
    p = prompt.tolist()
    starts = [i for i, t in enumerate(p) if t == IM_START]
    if len(starts) < 2:
        return np.empty(0, dtype=np.int32)
    user_start, user_end = starts[-2], starts[-1]
    while user_end > user_start and p[user_end - 1] != IM_END:
        user_end -= 1
    user = p[user_start:user_end - 1]
    head = output[:ANCHOR].tolist()
    begin = next((i for i in range(len(user) - ANCHOR + 1) if user[i:i + ANCHOR] == head), None)
    if begin is None:
        # the edit changes the first tokens: the file is the message's longest run shared with
        # the output; start at the first line the output shares
        out = output.tolist()
        grams = {tuple(out[i:i + 8]) for i in range(len(out) - 7)}
        begin = next((i for i in range(len(user) - 7) if tuple(user[i:i + 8]) in grams), None)
        if begin is None:
            return np.empty(0, dtype=np.int32)
        while begin > 0 and user[begin - 1] != 198:      # back to the line's start ("\n" = 198)
            begin -= 1
    return np.asarray(user[begin:], dtype=np.int32)


def replay_one(spec_type, params, prompt, output, prediction):
    engine = SpecEngine(spec_type, **params) if spec_type else None
    if prediction is not None:
        engine = PredictedEngine(PredictionDrafter(prediction), engine)
    loop = run_recorded(engine, 0, prompt, output)
    rec = loop.record()
    if prediction is not None:
        rec["accepted_prediction_tokens"] = engine.accepted_prediction_tokens
        rec["rejected_prediction_tokens"] = engine.rejected_prediction_tokens
    return rec


def _requests(args):
    requests = read_requests(str(benchlib.TRACES / "code-edit.jsonl.gz"))
    return requests[:args.limit] if args.limit else requests


def _priced(label: str, recs, profiles, prediction: bool) -> dict:
    """A table row of golden-format records: tokens per step, the profiles' speed-ups."""
    row = {"config": label, "prediction": prediction, "requests": len(recs),
           "tokens_per_step": round(sum(r["n_output"] - 1 for r in recs)
                                    / sum(len(r["steps"]) for r in recs), 3)}
    for prof, cm in profiles.items():
        row[prof] = modeled_speedup(recs, cm)["speedup"]
        row[prof + " min"] = round(min(modeled_speedup([r], cm)["speedup"] for r in recs), 3)
    return row


def _engine_part(engine: str, args) -> list:
    """The engine's rows (inside its venv): serve's default chain (ngram-mod 8/32), without and
    with each request's prediction in its engine arguments, through the contract tests'
    harness (vLLM: the V1 runner's call sequence, K = 16, 4 rows; SGLang: the NGRAM worker,
    a tree of d = 16 tokens, 2 requests at a time), greedy verification."""
    from engines_report import _harness, prediction_args, sglang_prediction_params
    h = _harness()
    profiles = {name: load_cost_model(name) for name in PROFILES}
    requests = [r for r in _requests(args) if len(r.prompt) + len(r.output) < ENGINE_MAX_LEN - 1]
    rows = []
    for with_pred in (False, True):
        if engine == "vllm":
            from ngramspec.integrations.vllm import NgramspecProposer
            sims = h.sim_requests(requests)
            if with_pred:
                for r in sims:
                    r.extra_args = prediction_args(r.prompt, r.output)
            h.RunnerSim(sims, 4, ENGINE_MAX_LEN, with_ids=True).run(
                NgramspecProposer.from_limits(16, ENGINE_MAX_LEN, 256, spec=""))
            done, where = sims, "inside vLLM (K = 16)"
        else:
            h.stub_cuda_only_kernels()
            from ngramspec.integrations.sglang import NgramspecCorpus, worker_class
            done = h.run_ngram_worker(worker_class(), NgramspecCorpus(draft_token_num=16, spec=""),
                                      requests, 16, ENGINE_MAX_LEN,
                                      params=sglang_prediction_params(requests) if with_pred
                                      else None)
            where = "inside SGLang (d = 16)"
        label = ("prediction + " if with_pred else "") + f"ngram-mod 8/32, {where}"
        rows.append(_priced(label, h.records(done), profiles, with_pred))
        print(f"  {label:<28} {rows[-1]['tokens_per_step']:6.2f} tokens/step", file=sys.stderr)
    return rows


#: The engines' rows run for requests below this many tokens (the harnesses' row length).
ENGINE_MAX_LEN = 1 << 15
PARTS = {"vllm": lambda args: _engine_part("vllm", args),
         "sglang": lambda args: _engine_part("sglang", args)}


def run(args) -> dict:
    requests = _requests(args)
    profiles = {name: load_cost_model(name) for name in PROFILES}
    rows = []
    preds = [prediction_of(r.prompt, r.output) for r in requests]
    for name in args.configs:
        spec_type, params = CONFIGS[name]
        for with_pred in (False, True):
            if spec_type is None and not with_pred:
                continue            # plain decoding: 1 by construction
            recs = [replay_one(spec_type, params, r.prompt, r.output,
                               p if with_pred else None) for r, p in zip(requests, preds)]
            label = ("prediction + " + name if spec_type else "prediction alone") \
                if with_pred else name
            row = _priced(label, recs, profiles, with_pred)
            if with_pred:
                row["accepted_prediction_tokens"] = sum(r["accepted_prediction_tokens"]
                                                        for r in recs)
                row["rejected_prediction_tokens"] = sum(r["rejected_prediction_tokens"]
                                                        for r in recs)
            rows.append(row)
            print(f"  {label:<28} {row['tokens_per_step']:6.2f} tokens/step  "
                  + "  ".join(f"{p} {row[p]:.3f}" for p in profiles), file=sys.stderr)
    pred_tokens = sum(len(p) for p in preds)
    return {"command": benchlib.command_line("prediction"), "requests": len(requests),
            "output_tokens": int(sum(len(r.output) for r in requests)),
            "prediction_tokens": int(pred_tokens),
            "without_prediction": sum(1 for p in preds if len(p) == 0), "rows": rows}


def render(res: dict) -> str:
    cols = ["tokens_per_step"] + [x for p in PROFILES for x in (p, p + " min")]
    lines = ["# Predicted Outputs on code edits (modeled)", "",
             f"`{res['command']}`: {res['requests']} code-edit traces, {res['output_tokens']} "
             f"output tokens; predictions (the file before the edit, cut from the prompt) "
             f"{res['prediction_tokens']} tokens ({res['without_prediction']} requests without "
             "one). Greedy verification against the recorded output; speed-up over plain "
             "decoding as the cost profile models it (all requests together; min: the lowest "
             "request)."]
    eng = res.get("engines")
    if eng:
        lines[-1] += (" Inside the engines (vllm " + eng["versions"].get("vllm", "not run")
                      + ", sglang " + eng["versions"].get("sglang", "not run") + "): serve's "
                      "default chain through the contract tests' harnesses, the prediction in "
                      "the request's engine arguments; an SGLang step verifies all d tokens.")
    lines += ["", "| configuration | " + " | ".join(c.replace("_", " ") for c in cols)
              + " | accepted / rejected prediction tokens |", "|---|" + "---:|" * (len(cols) + 1)]
    for row in res["rows"]:
        pred = (f"{row['accepted_prediction_tokens']} / {row['rejected_prediction_tokens']}"
                if "accepted_prediction_tokens" in row else "—")
        lines.append(f"| {row['config']} | " + " | ".join(
            f"{row[c]:.3f}" if c != "tokens_per_step" else f"{row[c]:.2f}" for c in cols)
            + f" | {pred} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--limit", type=int, default=0, help="first N traces only (default: all)")
    ap.add_argument("--configs", default="none,ngram-mod 8/32,chain",
                    help="comma list of: " + ", ".join(CONFIGS) + " (default %(default)s)")
    ap.add_argument("--json", default=benchlib.result_path("prediction.json"))
    ap.add_argument("--md", default=benchlib.result_path("prediction.md"))
    ap.add_argument("--engines", default="vllm,sglang",
                    help="engines whose rows are added, each run in its .venv-ENGINE "
                         "(default %(default)s; empty: none)")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        json.dump(PARTS[args.part](args), sys.stdout)
        return 0
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(CONFIGS)}")
    if args.limit < 0:
        ap.error("--limit must be >= 0")
    res = run(args)
    from engines_report import run_parts
    engines = {"versions": {}, "skipped": {}}
    run_parts(__file__, [e for e in args.engines.split(",") if e],
              ["--limit", str(args.limit)], engines)
    for engine in ("vllm", "sglang"):
        res["rows"] += engines.get(engine, [])
    res["engines"] = {"versions": engines["versions"], "skipped": engines["skipped"]}
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    with open(args.md, "w") as f:
        f.write(render(res))
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
