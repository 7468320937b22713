"""Inside vLLM and SGLang: their built-in n-gram drafters against ngramspec's (issue 29).

    python bench engines [--limit 12] [--families code-edit,agentic] [--k 16] [--d 16]
                         [--in-flight 4,64] [--mix-conversations] [--engines vllm,sglang]

Each engine's half runs in its own virtual environment (``.venv-vllm``, ``.venv-sglang``, made
by ``.ci/engines``), in the contract tests' harnesses (tests/engine_harness.py) on the same
requests of ../shared/traces:

- vLLM: the V1 runner's call sequence (--in-flight rows: at 4 requests arriving every 3
  steps, above 4 all at once, waiting for a row; a conversation's next turn once the previous
  one is answered, so a trace of few conversations fills few rows: --mix-conversations takes
  the requests turn by turn across all of them; chunked prefills, rows condensed, request ids
  handed as the plug-in's hook does), greedy verification, every proposer sized for
  max_num_seqs 256 (vLLM's default). vLLM's own ``ngram`` proposer (its numba
  ``NgramProposer``: default lookup 5..5, and 2..5) and ``suffix`` (ArcticInference 0.3.0,
  vLLM's defaults) next to ``NgramspecProposer`` with ngram-mod (serve's defaults), the
  llama.cpp chain and ngram-suffix; K = --k tokens.
- SGLang: the NGRAM worker's own ``_prepare_draft_tokens`` / ``_update_ngram_corpus`` (2
  requests at a time), greedy tree verification. SGLang's ``NgramCorpus`` (its defaults, a tree
  of --d tokens) next to ``NgramspecCorpus`` in the same --d budget: a chain for every type but
  ngram-suffix, whose tree (the chain, then its next-best branches) is shown beside its chain.
- The trees table (issue 37): ``python bench trees``' rows (its harness, its requests), run in
  SGLang's environment: SGLang's ``NgramCorpus`` as its worker drives it and with each prompt
  also in its trie, next to ngram-suffix's chain and its best-first ``draft_tree``.
- The "+ prediction" rows (issue 37): each request carries a prediction in its engine arguments
  (vLLM's ``extra_args``, SGLang's ``custom_params``), cut from its prompt as ``python bench
  prediction`` cuts it (the last user message from where the output's first tokens occur): on
  code edits the file before the edit; on agentic turns whatever of the user's message that
  finds, rarely the output (a poor prediction). In SGLang a request with a prediction drafts a
  chain (its prediction's, else the chain's), not ngram-suffix's tree.

Per row: tokens per verification step and the modeled GPU speed-up (`ngramspec.cost`'s ``gpu``
profile: an 8B bf16 model, `modeled_speedup`). A vLLM step verifies its draft, k + 1 tokens;
an SGLang step always verifies the whole tree of d tokens, whatever the drafter found.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHAIN = "ngram-mod,ngram-map-k4v,ngram-simple"
VLLM_ROWS = [("vLLM ngram (built-in, lookup 5..5)", ("ngram", 5, 5)),
             ("vLLM ngram (built-in, lookup 2..5)", ("ngram", 2, 5)),
             ("vLLM suffix (built-in, ArcticInference 0.3.0, vLLM's defaults)", ("suffix",)),
             ("ngramspec ngram-mod (serve's defaults)", ""),
             (f"ngramspec {CHAIN}", f"--spec-type {CHAIN}"),
             ("ngramspec ngram-suffix", "--spec-type ngram-suffix"),
             ("ngramspec ngram-suffix + prediction (issue 37)", ("predict",
                                                                 "--spec-type ngram-suffix"))]
# (row, spec flags or None for SGLang's own corpus, NgramspecCorpus's tree option)
SGLANG_ROWS = [("SGLang NgramCorpus (built-in, its defaults)", (None, False)),
               ("ngramspec ngram-mod (serve's defaults)", ("", True)),
               (f"ngramspec {CHAIN}", (f"--spec-type {CHAIN}", True)),
               ("ngramspec ngram-suffix, chain (tree=False)", ("--spec-type ngram-suffix", False)),
               ("ngramspec ngram-suffix, tree (the default)", ("--spec-type ngram-suffix", True)),
               ("ngramspec ngram-suffix + prediction (issue 37)",
                (("predict", "--spec-type ngram-suffix"), True))]
MAX_LEN = 1 << 15
MAX_NUM_SEQS = 256      # vLLM's default max_num_seqs: the proposers are sized by it


def _harness():
    sys.path.insert(0, str(ROOT / "tests"))
    import engine_harness
    return engine_harness


def _traces(args):
    from ngramspec.traces import read_requests
    out = {}
    for fam in args.families.split(","):
        path = str(benchlib.TRACES / f"{fam}.jsonl.gz")
        if args.mix_conversations:
            reqs = _first_turns(read_requests(path), args.limit)
        else:
            reqs = read_requests(path, limit=args.limit)
        out[fam] = [r for r in reqs if len(r.prompt) + len(r.output) < MAX_LEN - 1]
    return out


def _first_turns(reqs, limit: int):
    """`limit` requests taken turn by turn across the trace's conversations (every
    conversation's first turn, then every second turn, ...), in that order: as many
    conversations as possible run at once, each turn still after the one before."""
    by_conv = {}
    for r in reqs:
        by_conv.setdefault(r.extra.get("conversation", r.id), []).append(r)
    picked, turn = [], 0
    while len(picked) < limit and any(turn < len(v) for v in by_conv.values()):
        for turns in by_conv.values():
            if turn < len(turns) and len(picked) < limit:
                picked.append(turns[turn])
        turn += 1
    return picked       # turn by turn: a waiting next turn blocks no other conversation's


def _row(reqs, harness, cost_model):
    from ngramspec.cost import modeled_speedup
    recs = harness.records(reqs)
    return {"tokens_per_step": round(harness.tokens_per_step(reqs), 3),
            "gpu_speedup": modeled_speedup(recs, cost_model)["speedup"],
            "requests": len(recs), "steps": sum(len(r["steps"]) for r in recs)}


def part_vllm(args):
    from ngramspec.cost import load_cost_model
    from ngramspec.integrations.vllm import NgramspecProposer
    h = _harness()
    gpu = load_cost_model("gpu")
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam, trace in _traces(args).items():
            for rows in args.in_flight:
                for name, how in VLLM_ROWS:
                    prop = _vllm_proposer(h, tmp, args, how, trace, NgramspecProposer)
                    # above 4 rows every request arrives at once (a conversation's turns
                    # still one after another: a later prompt holds the earlier answer)
                    sims = h.sim_requests(trace, spread=3 if rows <= 4 else 0)
                    if _predicts(how):
                        for r in sims:
                            r.extra_args = prediction_args(r.prompt, r.output)
                    h.RunnerSim(sims, rows, MAX_LEN, with_ids=True).run(prop)
                    key = f"{fam}|{rows}|{name}"
                    table[key] = _row(sims, h, gpu)
                    print(f"  vllm {fam} {rows} in flight, {name}: {table[key]}",
                          file=sys.stderr)
    return table


def _vllm_proposer(h, tmp, args, how, trace, ours):
    """A row's proposer, built for vLLM's default max_num_seqs (256) whatever runs at once."""
    if _predicts(how):
        how = how[1]
    elif how == ("suffix",):
        return h.VllmSuffix(h.tiny_vllm_config(tmp, MAX_LEN, MAX_NUM_SEQS, method="suffix",
                                               num_speculative_tokens=args.k),
                            {t.id: len(t.prompt) for t in trace})
    if isinstance(how, tuple):
        return h.VllmNgram(h.tiny_vllm_config(tmp, MAX_LEN, MAX_NUM_SEQS, method="ngram",
                                              num_speculative_tokens=args.k,
                                              prompt_lookup_min=how[1],
                                              prompt_lookup_max=how[2]))
    return ours.from_limits(args.k, MAX_LEN, MAX_NUM_SEQS, spec=how)


def _predicts(how) -> bool:
    return isinstance(how, tuple) and how[:1] == ("predict",)


def prediction_args(prompt, output):
    """A request's engine arguments carrying its prediction: on code edits the file before the
    edit, cut from the prompt (`prediction_report.prediction_of`, as ``python bench prediction``
    cuts it); None where it has none (it drafts with the chain alone)."""
    from prediction_report import prediction_of
    pred = prediction_of(prompt, output)
    return {"prediction": pred.tolist()} if len(pred) else None


def part_sglang(args):
    from ngramspec.cost import load_cost_model
    from ngramspec.integrations.sglang import NgramspecCorpus, worker_class
    h = _harness()
    h.stub_cuda_only_kernels()
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    gpu = load_cost_model("gpu")
    table = {}
    for fam, trace in _traces(args).items():
        for name, (how, tree) in SGLANG_ROWS:
            params = None
            if _predicts(how):
                params, how = sglang_prediction_params(trace), how[1]
            if how is None:      # SGLang's own worker and corpus
                worker, corpus, depth = NGRAMWorker, NgramCorpus(draft_token_num=args.d), 18
            else:
                worker, corpus, depth = worker_class(), NgramspecCorpus(
                    draft_token_num=args.d, spec=how, tree=tree), MAX_LEN
            done = h.run_ngram_worker(worker, corpus, trace, args.d, depth, params=params)
            table[f"{fam}|{name}"] = _row(done, h, gpu)
            print(f"  sglang {fam} {name}: {table[f'{fam}|{name}']}", file=sys.stderr)
    import suffix_tree_report
    table["trees"] = suffix_tree_report.measure()
    return table


def sglang_prediction_params(trace):
    """Each request's SGLang ``SamplingParams`` with its prediction in ``custom_params``
    (`prediction_args`)."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    return {t.id: SamplingParams(custom_params=prediction_args(t.prompt, t.output))
            for t in trace}


PARTS = {"vllm": part_vllm, "sglang": part_sglang}


def render(result, p=print):
    a = result["args"]
    p("# ngramspec inside vLLM and SGLang, side by side (issue 29)\n")
    p(f"`{result['command']}` at `{result['revision']}`, {a['limit']} requests per family "
      f"(those under {MAX_LEN} tokens), vllm {result['versions'].get('vllm')}, sglang "
      f"{result['versions'].get('sglang')}. Modeled GPU speed-up: the `gpu` cost profile "
      "(8B bf16) over the verification steps; deterministic (no timing).\n")
    for engine, rows, budget in (("vllm", VLLM_ROWS, f"K = {a['k']} speculative tokens, "
                                  "a step verifies its draft, max_num_seqs 256"),
                                 ("sglang", SGLANG_ROWS, f"a tree of d = {a['d']} tokens, "
                                  "every step verifies all of it")):
        table = result.get(engine)
        if not table:
            p(f"## {engine}: not run ({result['skipped'].get(engine, '')})\n")
            continue
        fams = a["families"].split(",")
        cols = ([(f, n) for f in fams for n in a["in_flight"]] if engine == "vllm"
                else [(f, None) for f in fams])
        p(f"## Inside {'vLLM' if engine == 'vllm' else 'SGLang'} ({budget})\n")
        p("| drafter | " + " | ".join(
            f"{f}{'' if n is None else f', {n} in flight'}: tokens/step, GPU speed-up"
            for f, n in cols) + " |")
        p("|---|" + "---:|" * len(cols))
        for name, _ in rows:
            cells = []
            for f, n in cols:
                r = table[f"{f}|{name}" if n is None else f"{f}|{n}|{name}"]
                cells.append(f"{r['tokens_per_step']:.2f}, {r['gpu_speedup']:.2f}x")
            p(f"| {name} | " + " | ".join(cells) + " |")
        p("")
        if engine == "sglang" and table.get("trees"):
            render_trees(table["trees"], p)


def render_trees(rows, p) -> None:
    """The issue-37 trees table (``python bench trees``' harness and table) under SGLang's."""
    import suffix_tree_report as t
    p(f"### Trees against SGLang's trie with the prompts (issue 37, `python bench trees`' "
      f"harness: first {t.LIMIT} requests, {t.IN_FLIGHT} in flight, tokens/step; median µs "
      "per `draft_tree` call, timed on this machine)\n")
    for line in t.table(rows):
        p(line)
    p("")


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--limit", type=int, default=12, help="requests per family (default 12)")
    ap.add_argument("--families", default="code-edit,agentic")
    ap.add_argument("--k", type=int, default=16, help="vLLM's num_speculative_tokens")
    ap.add_argument("--d", type=int, default=16, help="SGLang's speculative_num_draft_tokens")
    ap.add_argument("--in-flight", type=lambda t: [int(x) for x in t.split(",")],
                    default=[4, 64], help="vLLM's requests in flight (rows; default 4,64)")
    ap.add_argument("--engines", default="vllm,sglang", help="default vllm,sglang")
    ap.add_argument("--mix-conversations", action="store_true",
                    help="take the --limit requests turn by turn across all conversations")
    args = parse_with_parts(ap, argv, PARTS, "engines")
    if args.part:
        return 0
    result = {"command": benchlib.command_line("engines", argv), "revision": _revision(),
              "args": {k: getattr(args, k) for k in ("limit", "families", "k", "d",
                                                     "in_flight", "mix_conversations")},
              "versions": {}, "skipped": {}}
    run_parts(__file__, args.engines.split(","),
              ["--limit", str(args.limit), "--families", args.families, "--k", str(args.k),
               "--d", str(args.d), "--in-flight", ",".join(map(str, args.in_flight))]
              + ["--mix-conversations"] * args.mix_conversations, result)
    write_report(result, args, render)
    return 0


def parse_with_parts(ap, argv, parts, name):
    """Parse with ``--json`` / ``--md`` (``bench/results/NAME.*``) and the hidden ``--part``;
    with ``--part`` (inside an engine's venv) the part's table is dumped as JSON on stdout."""
    ap.add_argument("--part", choices=parts, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=benchlib.result_path(f"{name}.json"))
    ap.add_argument("--md", default=benchlib.result_path(f"{name}.md"))
    args = ap.parse_args(argv)
    if args.part:
        json.dump(parts[args.part](args), sys.stdout)
    return args


def write_report(result, args, render) -> None:
    """The result as JSON (``--json``) and Markdown (``--md``), and on stdout."""
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        render(result, p=lambda s="": f.write(s + "\n"))
    render(result)


def run_parts(script, engines, argv, result, env=None) -> None:
    """Run ``script --part ENGINE ARGV...`` in each engine's virtual environment
    (``.venv-ENGINE``); its JSON table goes to ``result[ENGINE]``, its version to
    ``result["versions"]``, a missing environment to ``result["skipped"]``. The parts' progress
    lines (stderr lines starting with two spaces) are passed on."""
    for engine in engines:
        python = ROOT / f".venv-{engine}" / "bin" / "python"
        if not python.exists():
            result["skipped"][engine] = f"no {python.parent.parent.name}: run .ci/engines"
            continue
        out = subprocess.run([str(python), str(script), "--part", engine, *argv],
                             capture_output=True, text=True, cwd=ROOT, env=env)
        sys.stderr.write("".join(l + "\n" for l in out.stderr.splitlines()
                                 if l.startswith("  ")))
        if out.returncode:
            raise RuntimeError(f"{engine} part failed:\n{out.stderr[-3000:]}")
        result[engine] = json.loads(out.stdout)
        result["versions"][engine] = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version('{engine}'))"],
            capture_output=True, text=True).stdout.strip()


def _revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
