"""A normal request's latency while 8 clients attack ``ngramspec serve`` (issue 34 §2).

One server on 127.0.0.1 (the embedded model, an API key, ``-t 1``). First the idle latency of a
normal request (a short greedy completion with the key) and of ``/health``; then, for each
attack class, ``--clients`` threads send that attack back to back for ``--seconds`` while the
normal request and ``/health`` are timed again. The figure is each class's median latency over
the idle median ("Done when": under 2x), with the attack requests sent, their statuses and the
server's peak memory (VmHWM) after the class.

Attack classes (bodies just under the default 8 MiB ``--max-body-size``):

- ``chat-messages``: a chat of ~270k empty messages;
- ``chat-contents``: a chat whose contents sum to ~8 MB;
- ``token-prompt``: a prompt of ~4 M token ids;
- ``no-key``: an 8 MB body without the API key;
- ``malformed``: 8 MB of JSON that never closes, with the key.

Loopback only, bounded in time (``--seconds`` per class) and in count (``--max-requests`` per
client and class).

Usage::

    python bench serve-abuse                       # 8 clients, 8 s per class
    python bench serve-abuse --seconds 4 --md table.md
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import pathlib
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from ngramspec.server.process import ServerProcess
from llama_server import proc_cpu_seconds
from serve_load import machine

ROOT = benchlib.ROOT
KEY = "bench-key-0123456789"
BODY = 8 << 20
NORMAL = {"prompt": "def add(a, b):\n    return", "max_tokens": 8, "temperature": 0}


def attack_bodies() -> dict:
    """Each class's ``(path, body bytes, with the key)``, just under the body limit."""
    empty = b'{"role":"user","content":""},'
    n_msg = (BODY - 64) // len(empty)
    messages = b'{"max_tokens":2,"messages":[' + empty * (n_msg - 1) + empty[:-1] + b"]}"
    big = b'{"role":"user","content":"' + b"x" * ((BODY - 512) // 8) + b'"},'
    contents = b'{"max_tokens":2,"messages":[' + big * 7 + big[:-1] + b"]}"
    n_ids = (BODY - 64) // 2
    tokens = b'{"max_tokens":2,"prompt":[' + b"1," * (n_ids - 1) + b"1]}"
    unauth = b'{"prompt":"' + b"y" * (BODY - 64) + b'"}'
    malformed = b'{"prompt":[' + b"1," * ((BODY - 64) // 2)
    out = {"chat-messages": ("/v1/chat/completions", messages, True),
           "chat-contents": ("/v1/chat/completions", contents, True),
           "token-prompt": ("/v1/completions", tokens, True),
           "no-key": ("/v1/completions", unauth, False),
           "malformed": ("/v1/completions", malformed, True)}
    for name, (_, body, _) in out.items():
        assert len(body) <= BODY, (name, len(body))
    return out


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")




def server_cpu_seconds(pid: int) -> float:
    """CPU seconds of the server and of its child processes (the body parser)."""
    pids = {pid}
    for children in pathlib.Path(f"/proc/{pid}/task").glob("*/children"):
        pids.update(int(c) for c in children.read_text().split())
    total = 0.0
    for p in pids:
        try:
            total += proc_cpu_seconds(p)
        except OSError:          # ended meanwhile
            pass
    return total


def probes(url: str, n: int) -> dict:
    """Median seconds of the normal request and of /health, ``n`` of each, alternating."""
    auth = {"Authorization": f"Bearer {KEY}"}
    normal, health = [], []
    with httpx.Client(base_url=url, headers=auth, timeout=120) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json=NORMAL)
            normal.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            t0 = time.perf_counter()
            c.get("/health")
            health.append(time.perf_counter() - t0)
    return {"normal_s": statistics.median(normal), "health_s": statistics.median(health),
            "normal_max_s": max(normal)}


def _attackers(url: str, path: str, body: bytes, headers: dict, clients: int,
               seconds: float, max_requests: int, out) -> None:
    """The attacking clients: ``clients`` threads, in a process of their own at the lowest
    priority (attackers on other machines would not take the server's cores); puts their
    statuses and CPU seconds on ``out``."""
    os.nice(19)
    deadline = time.monotonic() + seconds
    statuses: dict = {}
    lock = threading.Lock()

    def client(_):
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(max_requests):
                if time.monotonic() > deadline:
                    return
                try:
                    code = str(c.post(path, content=body, headers=headers).status_code)
                except httpx.HTTPError as exc:
                    code = type(exc).__name__
                with lock:
                    statuses[code] = statuses.get(code, 0) + 1

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    out.put((statuses, time.process_time()))


def attack(url: str, path: str, body: bytes, keyed: bool, clients: int, seconds: float,
           max_requests: int, n_probes: int) -> dict:
    """``clients`` attacking clients sending ``body`` to ``path`` back to back for ``seconds``
    while the probes run."""
    headers = {"Content-Type": "application/json"}
    if keyed:
        headers["Authorization"] = f"Bearer {KEY}"
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_attackers, args=(url, path, body, headers, clients, seconds,
                                                max_requests, out))
    proc.start()
    time.sleep(min(1.0, seconds / 4))          # the attack is under way
    res = probes(url, n_probes)
    statuses, cpu = out.get(timeout=seconds + 120)
    proc.join(30)
    res["statuses"] = statuses
    res["attack_requests"] = sum(statuses.values())
    res["attack_cpu_s"] = cpu
    return res


def markdown(result: dict) -> str:
    lines = [f"CPU: {result['cpu']} ({result['cores']} cores), load average "
             f"{result['load'][0]:.2f} -> {result['load'][1]:.2f}, commit {result['commit']}; "
             f"`{result['command']}`", "",
             f"Idle: normal request {result['idle']['normal_s'] * 1e3:.0f} ms, /health "
             f"{result['idle']['health_s'] * 1e3:.1f} ms.", "",
             "| attack (8 clients) | requests sent | statuses | normal request (idle before) | "
             "x idle | /health | server cores | attackers' cores | server peak RSS |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["classes"].items():
        st = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        lines.append(f"| {name} | {r['attack_requests']} | {st} | {r['normal_s'] * 1e3:.0f} ms "
                     f"({r['idle_normal_s'] * 1e3:.0f} ms) | {r['x_idle']:.2f} | "
                     f"{r['health_s'] * 1e3:.1f} ms | {r['server_cores']:.2f} | "
                     f"{r['client_cores']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} MB |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0, help="per attack class")
    ap.add_argument("--max-requests", type=int, default=200, help="per client and class")
    ap.add_argument("--probes", type=int, default=5, help="normal requests timed per class")
    ap.add_argument("--classes", default=None, help="comma list (default: all)")
    ap.add_argument("--json", default=benchlib.result_path("serve-abuse.json"))
    ap.add_argument("--md", default=benchlib.result_path("serve-abuse.md"))
    args = ap.parse_args(argv)
    bodies = attack_bodies()
    names = args.classes.split(",") if args.classes else list(bodies)
    load0 = os.getloadavg()
    with ServerProcess("-t", "1", "-c", "2048", "-np", "2", "--api-key", KEY,
                       "--spec-type", "ngram-mod", cwd=str(ROOT)) as srv:
        probes(srv.url, 2)                     # warm-up
        idle = probes(srv.url, args.probes)
        print(f"idle: normal {idle['normal_s'] * 1e3:.0f} ms, health "
              f"{idle['health_s'] * 1e3:.1f} ms", flush=True)
        classes = {}
        for name in names:
            path, body, keyed = bodies[name]
            # the idle latency again just before each class: the machine's load drifts
            before = probes(srv.url, args.probes)
            cpu0, t0 = server_cpu_seconds(srv.proc.pid), time.monotonic()
            r = attack(srv.url, path, body, keyed, args.clients, args.seconds,
                       args.max_requests, args.probes)
            wall = time.monotonic() - t0
            # cores busy on average: the server's (parser included) and the attack clients'
            r["server_cores"] = (server_cpu_seconds(srv.proc.pid) - cpu0) / wall
            r["client_cores"] = r["attack_cpu_s"] / wall
            r["idle_normal_s"] = before["normal_s"]
            r["x_idle"] = r["normal_s"] / before["normal_s"]
            r["peak_rss_mb"] = vm_hwm_mb(srv.proc.pid)
            classes[name] = r
            print(f"{name}: {r['attack_requests']} sent {r['statuses']}, normal "
                  f"{r['normal_s'] * 1e3:.0f} ms = {r['x_idle']:.2f}x idle, health "
                  f"{r['health_s'] * 1e3:.1f} ms, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    cpu, rev = machine()
    result = {"command": benchlib.command_line("serve-abuse", argv), "cpu": cpu,
              "cores": os.cpu_count(), "load": [load0[0], os.getloadavg()[0]], "commit": rev,
              "clients": args.clients, "seconds": args.seconds, "idle": idle, "classes": classes}
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    pathlib.Path(args.md).write_text(markdown(result))
    print(markdown(result))
    return 0 if all(r["x_idle"] < 2 for r in classes.values()) else 1
