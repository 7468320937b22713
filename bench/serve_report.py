"""Aggregate throughput of the batched scheduler: C concurrent clients, speculative against plain.

    python bench serve [--clients 1,2,4,8] [--rounds 3] [--requests 2] [--n-predict 128]
                       [--code 4] [--code-max 1800] [--chat 4]
                       [--warm-prompts] [--json FILE] [--md FILE]

Each client sends its requests one after another (a closed loop, as a chat user or an agent
does); C clients run at once against one `ngramspec.llama.Scheduler` with ``n_slots = max(C)``,
one decode thread. A run is one (C, configuration) pair on a fresh scheduler (empty KV cache,
empty ngram-mod pool), so every configuration starts from the same state; the rounds rotate the
order of the configurations so that all see the same machine load. Prompts: code-edit and chat
requests of the shared traces (as ``e2e_report.py`` picks them), client i taking prompts
i, i + C, ...; greedy, ``--n-predict`` tokens at most. With ``--warm-prompts`` each client's
first prompt is decoded before the clock starts (the timed request finds it in its slot's cache),
so the figures measure generation, where speculation acts, rather than prompt processing.

Figures per run: output tokens per second of wall time, and per CPU-second of the decode thread
(``Scheduler.stats()["t_steps_cpu_s"]``: llama.cpp computes on that thread with one decode
thread, so other processes on a shared machine do not inflate it); the table gives medians over
the rounds and the median of the per-round ratios speculative / plain.

Configurations: ``plain`` (every request with ``SpeculationParams(enabled=False)``),
``ngram-mod`` (n_min 8, n_max 32: ``generate``'s defaults) and ``ngram-mod auto`` (the same chain
with the scheduler's joint cost-aware draft lengths, when available).
"""
from __future__ import annotations

import json
import statistics
import threading
import time

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from e2e_report import load_prompts, machine
from ngramspec.config import SpecConfig
from ngramspec.llama import SamplingParams, Scheduler, SpeculationParams, load_model

MOD = dict(ngram_mod_n_min=8, ngram_mod_n_max=32)
CONFIGS = {
    "plain": dict(spec=False, policy="fixed"),
    "ngram-mod": dict(spec=True, policy="fixed"),
    "ngram-mod auto": dict(spec=True, policy="auto"),
}


def run(llm, prompts, clients, n_requests, n_predict, n_slots, n_ctx_slot, config, warm):
    spec = SpecConfig.from_keywords("ngram-mod", policy=config["policy"], **MOD)
    sched = Scheduler(llm, spec, n_slots=n_slots, n_ctx=n_slots * n_ctx_slot, n_threads=1,
                      queue_size=max(64, clients * n_requests))
    spec = SpeculationParams(enabled=config["spec"])
    done = []
    lock = threading.Lock()

    def client(i):
        for j in range(n_requests):
            p = prompts[(i + j * clients) % len(prompts)]
            res = sched.submit(p, SamplingParams(max_tokens=n_predict), spec).result()
            with lock:
                done.append(res)

    sched.start()
    if warm:
        # Prompts decoded beforehand (untimed): the timed requests find them in the slots'
        # caches and decode only their last token, so the figures are generation throughput.
        firsts = [prompts[(i + j * clients) % len(prompts)] for j in range(n_requests)
                  for i in range(clients)][:n_slots]
        for h in [sched.submit(p, SamplingParams(max_tokens=1), spec) for p in firsts]:
            h.result()
        c_warm = sched.stats()["t_steps_cpu_s"]
    else:
        c_warm = 0.0
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    st = sched.stats()
    sched.stop(timeout=60)
    n_out = sum(r.predicted_n for r in done)
    cpu = st["t_steps_cpu_s"] - c_warm
    return {"wall_s": wall, "cpu_s": cpu, "tokens": n_out,
            "tok_s": n_out / wall, "tok_cpu_s": n_out / cpu,
            "decode_calls": st["decode_calls"], "decode_tokens": st["decode_tokens"],
            "drafted": st["n_draft_tokens"], "accepted": st["n_acc_tokens"]}


def measure(args):
    code_max = min(args.code_max, args.n_ctx_slot - args.n_predict - 16)
    reqs = load_prompts(args.code, args.chat, code_range=(300, code_max), chat_range=(20, 400))
    prompts = [r.prompt for _, r in reqs]
    llm = load_model(n_ctx=64, n_threads=1)
    configs = [c for c in args.configs.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    n_slots = max(clients)
    info = machine()
    t_start = time.time()
    runs = []
    for rnd in range(args.rounds):
        for c in clients:
            order = configs[rnd % len(configs):] + configs[:rnd % len(configs)]
            for name in order:
                r = run(llm, prompts, c, args.requests, args.n_predict, n_slots, args.n_ctx_slot,
                        CONFIGS[name], args.warm_prompts)
                r.update(round=rnd, clients=c, config=name)
                runs.append(r)
                print(f"round {rnd} clients {c} {name:15s} {r['tok_s']:7.1f} tok/s wall "
                      f"{r['tok_cpu_s']:7.1f} tok/cpu-s  accepted {r['accepted']}/{r['drafted']}",
                      flush=True)
    info["load_average_end"] = open("/proc/loadavg").read().split()[:3]
    info["seconds"] = round(time.time() - t_start, 1)
    return {"machine": info, "args": vars(args), "runs": runs,
            "summary": summarize(runs, configs, clients)}


def summarize(runs, configs, clients):
    out = {}
    for c in clients:
        row = {}
        for name in configs:
            rs = [r for r in runs if r["clients"] == c and r["config"] == name]
            row[name] = {"tok_s": statistics.median(r["tok_s"] for r in rs),
                         "tok_cpu_s": statistics.median(r["tok_cpu_s"] for r in rs),
                         "accepted": sum(r["accepted"] for r in rs),
                         "drafted": sum(r["drafted"] for r in rs),
                         "tokens_per_decode": statistics.median(
                             r["tokens"] / max(1, r["decode_calls"]) for r in rs)}
            if name != "plain" and "plain" in configs:
                pairs = [(r, p) for r in rs for p in runs if p["config"] == "plain"
                         and p["clients"] == c and p["round"] == r["round"]]
                row[name]["x_plain"] = statistics.median(r["tok_s"] / p["tok_s"] for r, p in pairs)
                row[name]["x_plain_cpu"] = statistics.median(r["tok_cpu_s"] / p["tok_cpu_s"]
                                                             for r, p in pairs)
        out[str(c)] = row
    return out


def markdown(res, command):
    m = res["machine"]
    lines = [
        "# Serving throughput: concurrent clients on the batched scheduler",
        "",
        f"Generated by `{command}` (method in the script's docstring). Model: the embedded "
        f"SmolLM2-135M-Instruct Q4_1, one decode thread; CPU {m.get('cpu', '?')}; revision "
        f"`{m.get('revision', '?')}`; load average {' '.join(m.get('load_average', []))} at the "
        f"start, {' '.join(m.get('load_average_end', []))} at the end ({m['seconds']} s).",
        "",
        "| clients | configuration | tok/s (wall) | tok per CPU-s | × plain (wall) | × plain (CPU) "
        "| accepted / drafted | tokens per decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c, row in res["summary"].items():
        for name, v in row.items():
            lines.append(
                f"| {c} | {name} | {v['tok_s']:.1f} | {v['tok_cpu_s']:.1f} | "
                f"{v.get('x_plain', 1.0):.3f} | {v.get('x_plain_cpu', 1.0):.3f} | "
                f"{v['accepted']} / {v['drafted']} | {v['tokens_per_decode']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--configs", default="plain,ngram-mod,ngram-mod auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--n-ctx-slot", type=int, default=2048)
    ap.add_argument("--code", type=int, default=4)
    ap.add_argument("--code-max", type=int, default=1800, help="longest code-edit prompt")
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--warm-prompts", action="store_true",
                    help="decode each client's first prompt before the clock starts (figures "
                         "of generation only)")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("serve.json"),
                    help="write the runs as JSON here (default: %(default)s)")
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("serve.md"),
                    help="write the Markdown report here (default: %(default)s)")
    args = ap.parse_args(argv)
    res = measure(args)
    command = benchlib.command_line("serve", argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    md = markdown(res, command.strip())
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
