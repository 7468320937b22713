"""Load figures of ``ngramspec serve`` side by side with llama.cpp's llama-server: requests/s,
tokens/s and completion tokens per CPU-second at 1, 2, 4 and 8 concurrent clients, speculative
and plain.

Servers (all with the same model file, ``-np/--slots N``, ``-c`` (the whole context), ``-t``,
``-b`` and the same spec flags, ``generate``'s ngram-mod defaults unless told otherwise):

- ``ngramspec``: one ``ngramspec serve`` process. Its modes are per request: ``spec`` (the
  ``"fixed"`` policy: llama.cpp's draft bounds, what llama-server does), ``auto`` (the joint
  cost-aware draft lengths of the scheduler, ``--spec-policy auto`` at start so its cost curve is
  measured before the first request) and ``plain`` (``"speculative": {"enabled": false}``).
- ``llama-server`` (bench/llama_server.py, built from the llama.cpp that llama-cpp-python
  vendors): llama-server has no per-request switch, so ``spec`` is one process with the
  ``--spec-type`` flags (``llama_server.spec_flags``) and ``plain`` a second one without them.
  Both run ``--kv-unified`` (one KV buffer for all slots: ngramspec's scheduler always uses one)
  and llama-server's other defaults (``cache_prompt``, the RAM prompt cache, ...).

Clients: each sends greedy ``/v1/completions`` requests (``temperature 0``, the prompt as token
ids from a trace family of ``../shared/traces``, ``max_tokens``) back to back, the same bodies to
every server. A configuration (server, mode, client count) sends ``--requests`` requests in all,
client i taking requests i, i + C, ...; they cycle over ``--prompts`` distinct prompts.

Prompt caching: both servers keep a finished request's KV in its slot and reuse the longest
common prefix for the next request (llama-server's ``cache_prompt``, default on; ngramspec's
slots), so after the warm-up pass — every distinct prompt once, at once, on every server — a
request whose prompt a free slot holds decodes only the prompt's last token. llama-server also
saves idle slots to a RAM prompt cache (``--cache-ram``, default on) and restores from it;
ngramspec has no RAM cache. With more clients than slots, two requests of one prompt may run at
once, and one of them re-processes its prompt; the table's "prompt tokens" column counts the
prompt tokens each configuration decoded (``timings.prompt_n``), so that cost is visible.

"same text": requests whose text equals the one of the same server's plain mode at the first
client count (first round), for the same prompt. Greedy verification is lossless only up to
float-noise ties, and the embedded 135M model has near-ties in these prompts (gaps of 0.01-0.06
logit, ``ngramspec.llama.live.divergence_report``), which a different batch composition or KV layout
may tip: a difference here is not, by itself, a wrong output.

Rounds: each round runs every configuration of every server once; within a client count the
order of the (server, mode) pairs rotates between rounds. Figures are medians over rounds; a
ratio is the median of the per-round ratios (neighbouring runs share the machine's load).
CPU-seconds: user + system time of the serving process over the configuration, summed over its
threads (``/proc/PID/stat``; HTTP and Python threads included on both sides), so completion
tokens per CPU-second is the figure that other jobs on a shared machine do not inflate (with
``-t 1``, ggml computes on one thread of each server).

Usage::

    python bench serve-load                      # code-edit prompts, 4 slots, 1/2/4/8 clients
    python bench serve-load --rounds 2 --md table.md
    NGRAMSPEC_LLAMA_SERVER=/path/to/llama-server python bench serve-load --servers llama-server
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
from llama_server import LlamaServer, find_binary, proc_cpu_seconds, spec_flags
from ngramspec.config import SPEC_PROFILES
from ngramspec.registry import all_params
from ngramspec.server.process import ServerProcess

GENERATE_DEFAULTS = dict(SPEC_PROFILES["serve"].params)   # serve's own spec defaults

ROOT = benchlib.ROOT

TRACES = benchlib.TRACES
#: (server, mode) pairs; the ngramspec modes are request fields, llama-server's are processes.
SYSTEMS = ("ngramspec spec", "ngramspec auto", "ngramspec plain", "llama-server spec",
           "llama-server plain")
MODE_FIELDS = {"spec": {"enabled": True, "policy": "fixed"},
               "auto": {"enabled": True, "policy": "auto"},
               "plain": {"enabled": False}}


def load_prompts(family: str, n: int, max_len: int, min_len: int = 64) -> list:
    with gzip.open(TRACES / f"{family}.jsonl.gz", "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    prompts = [r["prompt"] for r in recs if min_len <= len(r["prompt"]) <= max_len]
    if len(prompts) < n:
        raise SystemExit(f"only {len(prompts)} {family} prompts of {min_len}..{max_len} tokens")
    return prompts[:n]


class Target:
    """One server process and the request fields of one mode on it."""

    def __init__(self, name: str, url: str, pid: int, fields: dict):
        self.name, self.url, self.pid, self.fields = name, url, pid, fields


def run_config(target: Target, prompts, clients: int, max_tokens: int) -> dict:
    """Send every prompt once with `clients` concurrent clients; aggregate figures."""
    body = {"max_tokens": max_tokens, "temperature": 0, **target.fields}

    def client(share):
        out = []
        with httpx.Client(base_url=target.url, timeout=900) as c:
            for i, p in share:
                r = c.post("/v1/completions", json={**body, "prompt": p})
                r.raise_for_status()
                out.append((i, r.json()))
        return out

    indexed = list(enumerate(prompts))
    shares = [indexed[i::clients] for i in range(clients)]
    cpu0 = proc_cpu_seconds(target.pid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = sorted((res for part in pool.map(client, shares) for res in part),
                         key=lambda x: x[0])
    wall = time.perf_counter() - t0
    cpu = proc_cpu_seconds(target.pid) - cpu0
    resps = [r for _, r in results]
    timings = [r.get("timings", {}) for r in resps]
    tokens = sum(r["usage"]["completion_tokens"] for r in resps)
    return {"requests": len(resps), "wall_s": wall, "cpu_s": cpu,
            "requests_per_s": len(resps) / wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu if cpu > 0 else float("nan"),
            "prompt_n": sum(int(t.get("prompt_n", 0)) for t in timings),
            "cache_n": sum(int(t.get("cache_n", 0)) for t in timings),
            "draft_n": sum(int(t.get("draft_n", 0)) for t in timings),
            "draft_n_accepted": sum(int(t.get("draft_n_accepted", 0)) for t in timings),
            "texts": [r["choices"][0]["text"] for r in resps]}


def ngramspec_spec_args(spec_type: str, params: dict) -> list:
    known = all_params()
    out = ["--spec-type", spec_type]
    for name, value in params.items():
        out += [known[name].flag, str(value)]
    return out


def machine() -> tuple:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=ROOT).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return model, rev + ("+dirty" if dirty else "")


def summarize(runs: list, clients: list, systems: list, rounds: int) -> list:
    """Per client count and system: medians over rounds, ratios of neighbouring runs."""
    # Greedy output of each server's plain mode at the first client count, first round: the
    # reference its other runs are compared with (equal up to float-noise ties).
    base_texts = {}
    for r in runs:
        if r["system"].endswith(" plain") and r["clients"] == clients[0]:
            base_texts.setdefault(r["system"].split()[0], r["texts"])
    rows = []
    for c in clients:
        for s in systems:
            sel = [r for r in runs if r["clients"] == c and r["system"] == s]
            if not sel:
                continue
            row = {"clients": c, "system": s, "rounds": len(sel)}
            for k in ("requests_per_s", "tokens_per_s", "tokens_per_cpu_s", "prompt_n"):
                row[k] = statistics.median(r[k] for r in sel)
            row["draft_n"] = sum(r["draft_n"] for r in sel)
            row["draft_n_accepted"] = sum(r["draft_n_accepted"] for r in sel)
            ref = base_texts.get(s.split()[0])
            row["same_text"] = (sum(a == b for r in sel for a, b in zip(r["texts"], ref)),
                                sum(len(r["texts"]) for r in sel)) if ref else None
            rows.append(row)
    by = {(r["clients"], r["system"], r["round"]): r for r in runs}

    def ratio(c, a, b, key):
        vals = [by[c, a, k][key] / by[c, b, k][key] for k in range(rounds)
                if (c, a, k) in by and (c, b, k) in by and by[c, b, k][key] > 0]
        return statistics.median(vals) if vals else None

    for row in rows:
        c, s = row["clients"], row["system"]
        server = s.split()[0]
        row["x_plain_wall"] = ratio(c, s, f"{server} plain", "tokens_per_s")
        row["x_plain_cpu"] = ratio(c, s, f"{server} plain", "tokens_per_cpu_s")
        if server == "ngramspec":
            other = "llama-server " + ("plain" if s.endswith("plain") else "spec")
            row["x_llama_wall"] = ratio(c, s, other, "tokens_per_s")
            row["x_llama_cpu"] = ratio(c, s, other, "tokens_per_cpu_s")
    return rows


def markdown(rows: list) -> str:
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    lines = ["| clients | server, mode | req/s | tok/s (wall) | tok per CPU-s | × plain (wall) "
             "| × plain (CPU) | × llama-server (wall) | × llama-server (CPU) | accepted / drafted "
             "| prompt tokens decoded | same text |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        same = f"{r['same_text'][0]}/{r['same_text'][1]}" if r["same_text"] else "—"
        lines.append(
            f"| {r['clients']} | {r['system']} | {r['requests_per_s']:.3f} | "
            f"{r['tokens_per_s']:.1f} | {r['tokens_per_cpu_s']:.1f} | "
            f"{f(r['x_plain_wall'], '.2f')} | {f(r['x_plain_cpu'], '.2f')} | "
            f"{f(r.get('x_llama_wall'), '.2f')} | {f(r.get('x_llama_cpu'), '.2f')} | "
            f"{r['draft_n_accepted']} / {r['draft_n']} | {r['prompt_n']:.0f} | {same} |")
    return "\n".join(lines)


def _parser():
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--family", default="code-edit")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per configuration")
    ap.add_argument("--prompts", type=int, default=None,
                    help="distinct prompts (default: --slots)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec-type", default="ngram-mod")
    ap.add_argument("--spec-params", default=json.dumps(GENERATE_DEFAULTS),
                    help="JSON of engine keywords, passed to both servers as flags "
                         "(default: generate's %(default)s)")
    ap.add_argument("--servers", default="ngramspec,llama-server")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="(server, mode) pairs to run (default: all)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: "
                    "$NGRAMSPEC_LLAMA_SERVER, bench/build, PATH)")
    ap.add_argument("--json", "--out", dest="out", metavar="FILE",
                    default=benchlib.result_path("serve-load.json"),
                    help="write the runs as JSON here (default: %(default)s)")
    ap.add_argument("--md", "--markdown", dest="markdown", metavar="FILE",
                    help="also write the table to this file (results/serve-load.md is the "
                         "written-up reading: do not overwrite it)")
    return ap


def _start_servers(args, systems, params, binary, model, stops) -> dict:
    """The target of every system, its server started; each server's stop goes to `stops`."""
    common = ["-c", str(args.ctx_size), "-t", str(args.threads), "-b", str(args.batch_size)]
    targets = {}
    if any(s.startswith("ngramspec") for s in systems):
        srv = ServerProcess("--slots", args.slots, *common,
                            *ngramspec_spec_args(args.spec_type, params),
                            "--spec-policy", "auto" if "ngramspec auto" in systems else "fixed",
                            "--queue-size", max(64, args.requests), "--log-level", "warning",
                            cwd=str(ROOT), timeout=600)
        stops.append(srv.stop)
        for s in systems:
            if s.startswith("ngramspec "):
                targets[s] = Target(s, srv.url, srv.proc.pid,
                                    {"speculative": MODE_FIELDS[s.split()[1]]})
    for mode, flags in (("spec", spec_flags(args.spec_type, params)), ("plain", [])):
        name = f"llama-server {mode}"
        if name not in systems:
            continue
        ls = LlamaServer(binary, model, threads=args.threads, ctx_size=args.ctx_size,
                         slots=args.slots, batch_size=args.batch_size,
                         flags=["--kv-unified", *flags])
        ls.__enter__()
        stops.append(ls.__exit__)
        targets[name] = Target(name, ls.base_url, ls.proc.pid, {})
    return targets


def _rounds(targets, systems, distinct, prompts, clients, args) -> list:
    """Warm-up (every distinct prompt once, all at once, on every server), then each round's
    runs, the systems rotated per round."""
    for s in systems:
        run_config(targets[s], distinct, len(distinct), 4)
    print(f"servers up; load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for rnd in range(args.rounds):
        for c in clients:
            k = rnd % len(systems)
            for s in systems[k:] + systems[:k]:
                res = run_config(targets[s], prompts, c, args.max_tokens)
                res.update(round=rnd, clients=c, system=s)
                runs.append(res)
                print(f"round {rnd} clients {c} {s:18s}: {res['requests_per_s']:.3f} req/s "
                      f"{res['tokens_per_s']:6.1f} tok/s {res['tokens_per_cpu_s']:6.1f} "
                      f"tok/CPU-s (drafted {res['draft_n']}, accepted "
                      f"{res['draft_n_accepted']}, prompt {res['prompt_n']})", flush=True)
    return runs


def main(argv=None):
    args = _parser().parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    params = json.loads(args.spec_params)
    servers = args.servers.split(",")
    systems = [s for s in args.systems.split(",") if s.split()[0] in servers]
    binary = find_binary(args.llama_server)
    if "llama-server" in servers and binary is None:
        raise SystemExit("no llama-server binary (bench/build_llama_server.sh, or "
                         "$NGRAMSPEC_LLAMA_SERVER); use --servers ngramspec to skip it")
    from ngramspec.llama.model import default_model_path
    model = default_model_path()
    slot_ctx = args.ctx_size // args.slots
    distinct = load_prompts(args.family, args.prompts or args.slots,
                            min(args.max_prompt, slot_ctx - args.max_tokens - 8))
    prompts = [distinct[i % len(distinct)] for i in range(args.requests)]
    load0 = os.getloadavg()
    stops = []
    try:
        targets = _start_servers(args, systems, params, binary, model, stops)
        runs = _rounds(targets, systems, distinct, prompts, clients, args)
    finally:
        for stop in reversed(stops):
            try:
                stop()
            except Exception as exc:  # keep stopping the others
                print(f"stopping a server failed: {exc}", file=sys.stderr)
    load1 = os.getloadavg()
    rows = summarize(runs, clients, systems, args.rounds)
    cpu, rev = machine()
    report = {"command": benchlib.command_line("serve-load", argv),
              "revision": rev, "cpu": cpu, "loadavg_before": load0, "loadavg_after": load1,
              "settings": vars(args), "llama_server": str(binary) if binary else None,
              "prompt_tokens": [len(p) for p in distinct], "summary": rows,
              "runs": runs}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(rows)
    print(text)
    print(f"CPU: {cpu}; revision {rev}; load average before {load0[0]:.2f}, after {load1[0]:.2f}")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
