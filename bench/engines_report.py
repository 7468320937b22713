"""Inside vLLM and SGLang: their built-in n-gram drafters against ngramspec's (issue 29).

    python bench engines [--limit 12] [--families code-edit,agentic] [--k 16] [--d 16]

Each engine's half runs in its own virtual environment (``.venv-vllm``, ``.venv-sglang``, made
by ``.ci/engines``), in the contract tests' harnesses (tests/engine_harness.py) on the same
requests of ../shared/traces:

- vLLM: the V1 runner's call sequence (4 rows, requests arriving every 3 steps, chunked
  prefills, rows condensed), greedy verification. vLLM's own ``ngram`` proposer (its numba
  ``NgramProposer``: default lookup 5..5, and 2..5) next to ``NgramspecProposer`` with
  ngram-mod (serve's defaults), the llama.cpp chain and ngram-suffix; K = --k tokens.
- SGLang: the NGRAM worker's own ``_prepare_draft_tokens`` / ``_update_ngram_corpus`` (2
  requests at a time), greedy tree verification. SGLang's ``NgramCorpus`` (its defaults, a tree
  of --d tokens) next to ``NgramspecCorpus`` in the same --d budget: a chain for every type but
  ngram-suffix, whose tree (the chain, then its next-best branches) is shown beside its chain.

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
             ("ngramspec ngram-mod (serve's defaults)", ""),
             (f"ngramspec {CHAIN}", f"--spec-type {CHAIN}"),
             ("ngramspec ngram-suffix", "--spec-type ngram-suffix")]
# (row, spec flags or None for SGLang's own corpus, NgramspecCorpus's tree option)
SGLANG_ROWS = [("SGLang NgramCorpus (built-in, its defaults)", (None, False)),
               ("ngramspec ngram-mod (serve's defaults)", ("", True)),
               (f"ngramspec {CHAIN}", (f"--spec-type {CHAIN}", True)),
               ("ngramspec ngram-suffix, chain (tree=False)", ("--spec-type ngram-suffix", False)),
               ("ngramspec ngram-suffix, tree (the default)", ("--spec-type ngram-suffix", True))]
MAX_LEN = 1 << 15


def _harness():
    sys.path.insert(0, str(ROOT / "tests"))
    import engine_harness
    return engine_harness


def _traces(args):
    from ngramspec.traces import read_requests
    out = {}
    for fam in args.families.split(","):
        reqs = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limit=args.limit)
        out[fam] = [r for r in reqs if len(r.prompt) + len(r.output) < MAX_LEN - 1]
    return out


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
            for name, how in VLLM_ROWS:
                if isinstance(how, tuple):
                    prop = h.VllmNgram(h.tiny_vllm_config(tmp, MAX_LEN, 4, method="ngram",
                                                          num_speculative_tokens=args.k,
                                                          prompt_lookup_min=how[1],
                                                          prompt_lookup_max=how[2]))
                else:
                    prop = NgramspecProposer.from_limits(args.k, MAX_LEN, 4, spec=how)
                sims = h.sim_requests(trace)
                h.RunnerSim(sims, 4, MAX_LEN).run(prop)
                table[f"{fam}|{name}"] = _row(sims, h, gpu)
                print(f"  vllm {fam} {name}: {table[f'{fam}|{name}']}", file=sys.stderr)
    return table


def part_sglang(args):
    from ngramspec.cost import load_cost_model
    from ngramspec.integrations.sglang import NgramspecCorpus, worker_class
    h = _harness()
    h.stub_cuda_only_kernels()
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    gpu = load_cost_model("gpu")
    table = {}
    for fam, trace in _traces(args).items():
        for name, (how, tree) in SGLANG_ROWS:
            if how is None:
                corpus, depth = NgramCorpus(draft_token_num=args.d), 18
            else:
                corpus, depth = NgramspecCorpus(draft_token_num=args.d, spec=how,
                                                tree=tree), MAX_LEN
            done = h.run_ngram_worker(worker_class(), corpus, trace, args.d, depth)
            table[f"{fam}|{name}"] = _row(done, h, gpu)
            print(f"  sglang {fam} {name}: {table[f'{fam}|{name}']}", file=sys.stderr)
    return table


PARTS = {"vllm": part_vllm, "sglang": part_sglang}


def render(result, p=print):
    a = result["args"]
    p("# ngramspec inside vLLM and SGLang, side by side (issue 29)\n")
    p(f"`{result['command']}` at `{result['revision']}`, {a['limit']} requests per family "
      f"(those under {MAX_LEN} tokens), vllm {result['versions'].get('vllm')}, sglang "
      f"{result['versions'].get('sglang')}. Modeled GPU speed-up: the `gpu` cost profile "
      "(8B bf16) over the verification steps; deterministic (no timing).\n")
    for engine, rows, budget in (("vllm", VLLM_ROWS, f"K = {a['k']} speculative tokens, "
                                  "a step verifies its draft"),
                                 ("sglang", SGLANG_ROWS, f"a tree of d = {a['d']} tokens, "
                                  "every step verifies all of it")):
        table = result.get(engine)
        if not table:
            p(f"## {engine}: not run ({result['skipped'].get(engine, '')})\n")
            continue
        fams = a["families"].split(",")
        p(f"## Inside {'vLLM' if engine == 'vllm' else 'SGLang'} ({budget})\n")
        p("| drafter | " + " | ".join(f"{f}: tokens/step | {f}: GPU speed-up" for f in fams)
          + " |")
        p("|---|" + "---:|---:|" * len(fams))
        for name, _ in rows:
            cells = []
            for f in fams:
                r = table[f"{f}|{name}"]
                cells += [f"{r['tokens_per_step']:.2f}", f"{r['gpu_speedup']:.2f}x"]
            p(f"| {name} | " + " | ".join(cells) + " |")
        p("")


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--limit", type=int, default=12, help="requests per family (default 12)")
    ap.add_argument("--families", default="code-edit,agentic")
    ap.add_argument("--k", type=int, default=16, help="vLLM's num_speculative_tokens")
    ap.add_argument("--d", type=int, default=16, help="SGLang's speculative_num_draft_tokens")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=benchlib.result_path("engines.json"))
    ap.add_argument("--md", default=benchlib.result_path("engines.md"))
    args = ap.parse_args(argv)
    if args.part:                       # inside the engine's venv: its table as JSON on stdout
        json.dump(PARTS[args.part](args), sys.stdout)
        return 0
    result = {"command": benchlib.command_line("engines", argv), "revision": _revision(),
              "args": {k: getattr(args, k) for k in ("limit", "families", "k", "d")},
              "versions": {}, "skipped": {}}
    for engine in PARTS:
        python = ROOT / f".venv-{engine}" / "bin" / "python"
        if not python.exists():
            result["skipped"][engine] = f"no {python.parent.parent.name}: run .ci/engines"
            continue
        cmd = [str(python), __file__, "--part", engine, "--limit", str(args.limit),
               "--families", args.families, "--k", str(args.k), "--d", str(args.d)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        sys.stderr.write("".join(l + "\n" for l in out.stderr.splitlines()
                                 if l.startswith("  ")))
        if out.returncode:
            raise RuntimeError(f"{engine} part failed:\n{out.stderr[-3000:]}")
        result[engine] = json.loads(out.stdout)
        result["versions"][engine] = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version('{engine}'))"],
            capture_output=True, text=True).stdout.strip()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.md, "w") as f:
        render(result, p=lambda s="": f.write(s + "\n"))
    render(result)
    return 0


def _revision() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
