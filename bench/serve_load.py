"""Load figures of ``ngramspec serve``: requests/s and tokens/s at 1, 4 and 8 concurrent clients,
speculative against plain decoding, on one server.

One server process (the embedded model, ``--slots`` slots) answers every configuration: plain
decoding is the same server with ``"speculative": {"enabled": false}`` in each request, so both
modes share the process, the KV cache and the machine's state. Modes and client counts are
interleaved in every round (round r runs 1, 4, 8 clients, each spec then plain, the order of the
two modes alternating between rounds), and the figures are medians over rounds.

Each client sends greedy ``/v1/completions`` requests (token-id prompts from a trace family of
``../shared/traces``, ``max_tokens`` each) back to back; a configuration sends ``requests`` in all,
cycling over ``--prompts`` distinct prompts (default: one per slot, so that after the warm-up
every prompt is in a slot's KV cache and the figures measure generation, where speculation acts,
not prompt processing on a CPU). Aggregate tokens/s = completion tokens / wall time of the
configuration.

Usage::

    python bench serve-load                      # code-edit prompts, 4 slots, 3 rounds
    python bench serve-load --family chat --rounds 2 --max-tokens 96
    python bench serve-load --json bench/results/serve-load.json --md table.md
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec.server.process import ServerProcess

ROOT = benchlib.ROOT
TRACES = benchlib.TRACES


def load_prompts(family: str, n: int, max_len: int, min_len: int = 64) -> list:
    with gzip.open(TRACES / f"{family}.jsonl.gz", "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    prompts = [r["prompt"] for r in recs if min_len <= len(r["prompt"]) <= max_len]
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} {family} prompts of {min_len}..{max_len} tokens")
    return prompts[:n]


def run_config(url, prompts, clients, max_tokens, speculative):
    """Send every prompt once with `clients` concurrent clients; aggregate figures."""
    body = {"max_tokens": max_tokens, "temperature": 0,
            "speculative": {"enabled": speculative}}

    def client(share):
        out = []
        with httpx.Client(base_url=url, timeout=600) as c:
            for p in share:
                r = c.post("/v1/completions", json={**body, "prompt": p})
                r.raise_for_status()
                out.append(r.json())
        return out

    shares = [prompts[i::clients] for i in range(clients)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [res for part in pool.map(client, shares) for res in part]
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    drafted = sum(r["timings"]["draft_n"] for r in results)
    accepted = sum(r["timings"]["draft_n_accepted"] for r in results)
    return {"requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
            "tokens": tokens, "tokens_per_s": tokens / wall, "draft_n": drafted,
            "draft_n_accepted": accepted,
            "texts": [r["choices"][0]["text"] for r in results]}


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--family", default="code-edit")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per configuration")
    ap.add_argument("--prompts", type=int, default=None,
                    help="distinct prompts (default: --slots)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec-type", default="ngram-mod")
    ap.add_argument("--json", "--out", dest="out", metavar="FILE",
                    default=benchlib.result_path("serve-load.json"),
                    help="write the runs as JSON here (default: %(default)s)")
    ap.add_argument("--md", "--markdown", dest="markdown", metavar="FILE",
                    help="also write the table to this file (results/serve-load.md is the "
                         "written-up reading: do not overwrite it)")
    args = ap.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    slot_ctx = args.ctx_size // args.slots
    distinct = load_prompts(args.family, args.prompts or args.slots,
                            min(args.max_prompt, slot_ctx - args.max_tokens - 8))
    prompts = [distinct[i % len(distinct)] for i in range(args.requests)]
    load = os.getloadavg()
    srv = ServerProcess("--slots", args.slots, "-c", args.ctx_size, "-t", args.threads,
                        "--spec-type", args.spec_type, "--queue-size", max(64, args.requests),
                        "--log-level", "warning", cwd=str(ROOT), timeout=300)
    runs = []
    try:
        run_config(srv.url, distinct, len(distinct), 8, True)  # warm-up: prompts into slots
        for rnd in range(args.rounds):
            for c in clients:
                modes = (True, False) if rnd % 2 == 0 else (False, True)
                for spec in modes:
                    res = run_config(srv.url, prompts, c, args.max_tokens, spec)
                    res.update(round=rnd, clients=c, speculative=spec)
                    runs.append(res)
                    print(f"round {rnd} clients {c} {'spec ' if spec else 'plain'}: "
                          f"{res['requests_per_s']:.3f} req/s {res['tokens_per_s']:.1f} tok/s "
                          f"(drafted {res['draft_n']}, accepted {res['draft_n_accepted']})",
                          flush=True)
    finally:
        srv.stop()
    summary = []
    for c in clients:
        row = {"clients": c}
        for spec, name in ((True, "spec"), (False, "plain")):
            sel = [r for r in runs if r["clients"] == c and r["speculative"] == spec]
            row[f"{name}_requests_per_s"] = statistics.median(r["requests_per_s"] for r in sel)
            row[f"{name}_tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in sel)
            if spec:
                row["accepted_per_drafted"] = (sum(r["draft_n_accepted"] for r in sel)
                                               / max(1, sum(r["draft_n"] for r in sel)))
        # Ratio per round (spec and plain of one round ran back to back), then the median.
        ratios = []
        for rnd in range(args.rounds):
            pair = {r["speculative"]: r for r in runs if r["clients"] == c and r["round"] == rnd}
            ratios.append(pair[True]["tokens_per_s"] / pair[False]["tokens_per_s"])
        row["speedup"] = statistics.median(ratios)
        same = all(r["texts"] == next(q for q in runs if q["clients"] == c
                                      and not q["speculative"])["texts"]
                   for r in runs if r["clients"] == c)
        row["outputs_identical"] = same
        summary.append(row)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    report = {"command": benchlib.command_line("serve-load", argv),
              "commit": rev, "cpu": model, "loadavg_before": load,
              "loadavg_after": os.getloadavg(), "settings": vars(args),
              "prompt_tokens": [len(p) for p in distinct], "summary": summary,
              "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs]}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    table = ["| clients | spec req/s | plain req/s | spec tok/s | plain tok/s | speed-up "
             "(median of rounds) | accepted/drafted | same text |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in summary:
        table.append(f"| {r['clients']} | {r['spec_requests_per_s']:.3f} | "
                     f"{r['plain_requests_per_s']:.3f} | {r['spec_tokens_per_s']:.1f} | "
                     f"{r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['accepted_per_drafted']:.2f} | "
                     f"{'yes' if r['outputs_identical'] else 'no'} |")
    text = "\n".join(table)
    print(text)
    print(f"CPU: {model}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
