"""Shared pieces of the benchmarks: trace contexts, engines, replay plans, llama.cpp's figures.

A *context* of size S is a stretch of real tokens from ``../shared/traces/code-edit.jsonl.gz``
(requests concatenated as one long session: prompt, output, next prompt, ...), cut so that a
whole request's prompt ends a little before position S (at most 512 tokens) and its output
continues past it: the proposers see what a server sees while a model rewrites a file it was
given.

A *plan* records a short greedy-verification replay over a context, as ``ngramspec replay``
runs it: begin on the prompt, then draft / compare with the recorded tokens / accept / advance by
1 + accepted. The steps before position S warm the proposer's incremental state; the draft
calls made while the context grows from S to S + window (at most ``K``) are the measured ones.
Drafts are deterministic, so replaying the recorded plan on a freshly prepared engine repeats
exactly the same calls without the comparison work (and `run_checked` verifies that it does).

Run as a script it is the memory probe: ``python bench/benchlib.py memprobe NAME:SLOTS,...
CTX.npy PROMPT_LEN STEPS`` prints a JSON list (see `memprobe`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

BENCH = pathlib.Path(__file__).resolve().parent
RESULTS = BENCH / "results"      # every report's default output folder (bench/README.md: index)
TREE_ENV = "NGRAMSPEC_TREE"      # `python bench --tree PATH` sets it; subprocesses inherit it


def _usage_error(message: str):
    print(f"bench: {message}", file=sys.stderr)
    sys.exit(2)


def _tree() -> pathlib.Path | None:
    """The checkout whose ``ngramspec`` the benchmarks measure; None: whatever is importable.

    ``$NGRAMSPEC_TREE`` names it explicitly (an A/B run points each side at its own checkout
    with this one ``bench/``). Otherwise the checkout ``bench/`` lives in, when its kernels are
    built in place: an editable install of another checkout would otherwise be measured.
    """
    named = os.environ.get(TREE_ENV)
    if named:
        tree = pathlib.Path(named).resolve()
        if not (tree / "ngramspec" / "__init__.py").is_file():
            _usage_error(f"{TREE_ENV}={named}: no ngramspec package there (a checkout's root, "
                         f"with its kernels built in place, is expected)")
        return tree
    return BENCH.parent if any((BENCH.parent / "ngramspec").glob("_engine*.so")) else None


# The only sys.path edit of the benchmarks: every script imports this module before ngramspec.
_TREE = _tree()
if _TREE is not None and (not sys.path or sys.path[0] != str(_TREE)):
    sys.path.insert(0, str(_TREE))
ROOT = _TREE or BENCH.parent      # the measured checkout (revision, examples, server's cwd)
_loaded = sys.modules.get("ngramspec")
if os.environ.get(TREE_ENV) and _loaded is not None and not str(
        pathlib.Path(_loaded.__file__).resolve()).startswith(str(ROOT) + os.sep):
    _usage_error(f"{TREE_ENV}={ROOT}, but ngramspec was already imported from "
                 f"{_loaded.__file__}")

import ngramspec
from ngramspec import ModPool, PyProposer, SpecEngine
from ngramspec.loop import SlotLoop
from ngramspec.replay import Timers, replay_request
from ngramspec.traces import read_requests

SHARED = pathlib.Path(os.environ.get("NGRAMSPEC_SHARED", BENCH.parent.parent / "shared"))
TRACES = SHARED / "traces"
MIB = 1 << 20

# The benchmarked configurations, llama.cpp's default parameters throughout. "chain" is every
# n-gram type at once (llama-server runs them in its fixed priority order, first draft wins).
PROPOSERS = {
    "simple": "ngram-simple",
    "map-k": "ngram-map-k",
    "map-k4v": "ngram-map-k4v",
    "mod": "ngram-mod",
    "chain": "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod",
}
PROMPT_LOOKUP = "prompt-lookup"        # llama-cpp-python's LlamaPromptLookupDecoding
CPP = "C++ "          # "C++ simple" ...: the configuration on llama.cpp's C++ (llamacpp_baseline)

# Context sizes (tokens). 48k is not one of issue 6's sizes: it matches the spec's python_long
# trace (44k-50k), the one measured llama.cpp figure above 14k.
SIZES = {"1k": 1024, "8k": 8192, "32k": 32768, "48k": 49152, "128k": 131072}
WARM = 512          # at most this many output tokens are replayed before the measured calls
K = 100             # at most this many measured draft calls per round (see `warm_window`)
TAIL = 4096         # tokens past the measured window (a draft may look ahead of it)

# Spec section 9: llama.cpp's own C++ (-O2, 2 cores, min of 7 repeats), us per draft call
# including its glue, on the spec's traces. Not measured here.
LLAMA_CPP_US = {
    "synthetic": {"simple": 0.83, "map-k": 0.17, "map-k4v": 0.21, "mod": 0.27},
    "python_edit": {"simple": 13.4, "map-k": 0.49, "map-k4v": 2.85, "mod": 0.67},
    "python_long": {"simple": 58.7, "map-k": 1.13, "map-k4v": 24.7, "mod": 5.8},
}
LLAMA_CPP_ROWS = {"synthetic": "synthetic (<=1.5k)", "python_edit": "python_edit (4.8k-14k)",
                  "python_long": "python_long (44k-50k)"}
# The spec row whose context range contains (or is nearest to) each benchmark size.
SIZE_REF = {"1k": "synthetic", "8k": "python_edit", "48k": "python_long"}
# llama.cpp's begin / reset costs from spec 5.2, 5.4 and 9 (milliseconds).
LLAMA_CPP_BEGIN_MS = {"mod begin, 14.5k prompt tokens": 0.5, "mod begin, 44k prompt tokens": 1.9,
                      "map begin with index cleanup (2^18 slots)": 0.3,
                      "ModPool reset (16 MiB fill)": 3.0}


def llama_simple_estimate(n_ctx: int) -> float:
    """llama.cpp's ngram-simple us per call at `n_ctx`, interpolated linearly between the spec's
    python_edit (13.4 us, taken at its mid-range 9.4k) and python_long (58.7 us at 47k) rows.

    ngram-simple's backward scan is O(L) when nothing matches, which the two figures follow.
    An estimate, not a measurement: used only where the spec has no row (32k).
    """
    x0, y0, x1, y1 = 9400, 13.4, 47000, 58.7
    return y0 + (y1 - y0) * (n_ctx - x0) / (x1 - x0)


# ------------------------------------------------------------------------------------------
# Command line: one style for every report (``python bench SUBCOMMAND``, bench/__main__.py)
# ------------------------------------------------------------------------------------------

def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A report's parser: its docstring's first paragraph as description, the rest as epilog."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(description=head, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def result_path(name: str) -> str:
    """Default output file of a report: ``bench/results/NAME`` (e.g. ``kernels.json``)."""
    return str(RESULTS / name)


def command_line(subcommand: str, argv=None) -> str:
    """The command that reproduces this run, as recorded in a report's output."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python bench", subcommand, *args])


def geomean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# ------------------------------------------------------------------------------------------
# Engines
# ------------------------------------------------------------------------------------------

class PromptLookupProposer(PyProposer):
    """llama-cpp-python's `LlamaPromptLookupDecoding` as an ngramspec proposer.

    llama-cpp-python calls it with the tokens evaluated so far, which in ngramspec's terms is
    the context plus the sampled token. Defaults are llama-cpp-python's
    (``max_ngram_size=2``, ``num_pred_tokens=10``).
    """

    def __init__(self, n_slots=1, max_ngram_size=2, num_pred_tokens=10):
        super().__init__(PROMPT_LOOKUP, n_slots, num_pred_tokens)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size,
                                                num_pred_tokens=num_pred_tokens)

    def on_draft(self, slot, inp, sampled):
        # input_ids is positional-only in llama-cpp-python; an intc array as Llama passes it
        return self.lookup(np.append(inp, np.intc(sampled)))


def is_cpp(name: str) -> bool:
    return name.startswith(CPP)


def cpp_factory(name: str, n_slots: int = 1):
    """Fresh llama.cpp C++ baseline engines for a benchmarked configuration (empty pool)."""
    from llamacpp_baseline import CppEngine     # builds the library on first use
    spec = PROPOSERS[name]
    return lambda: CppEngine(spec, n_slots)


def uses_pool(name: str) -> bool:
    return "ngram-mod" in PROPOSERS.get(name, name)


class Engines:
    """Builds fresh engines; the ngram ones share one ModPool, emptied for every new engine
    (a fresh server has an empty pool)."""

    def __init__(self):
        self.pool = ModPool()

    def factory(self, name: str, n_slots: int = 1):
        if is_cpp(name):
            return cpp_factory(name[len(CPP):], n_slots)
        if name == PROMPT_LOOKUP:
            return lambda: SpecEngine.from_proposers([PromptLookupProposer(n_slots)], n_slots)
        spec = PROPOSERS.get(name, name)     # a short name, or any --spec-type list
        if not uses_pool(name):
            return lambda: SpecEngine(spec, n_slots=n_slots)
        pool = self.pool

        def make():
            pool.reset()
            return SpecEngine(spec, n_slots=n_slots, pool=pool)
        return make


# ------------------------------------------------------------------------------------------
# Contexts from real traces
# ------------------------------------------------------------------------------------------

class Corpus:
    """All requests of one trace family concatenated: prompt, output, prompt, output, ..."""

    def __init__(self, family: str = "code-edit", limit: int | None = None):
        requests = read_requests(str(TRACES / f"{family}.jsonl.gz"), limit)
        parts, spans, pos = [], [], 0
        for r in requests:
            spans.append((pos, pos + len(r.prompt), pos + len(r.prompt) + len(r.output)))
            pos += len(r.prompt) + len(r.output)
            parts += [r.prompt, r.output]
        self.family = family
        self.tokens = np.ascontiguousarray(np.concatenate(parts), dtype=np.int32)
        self.spans = spans        # (prompt start, output start, output end) per request

    def context(self, label: str, size: int) -> "Context":
        """`size` tokens of context ending `warm` tokens into a request's output.

        The request is the first whose whole prompt fits in the context and whose output
        covers the warm-up and (most of) the measured window; earlier requests fill the
        context before its prompt, as in a long session.
        """
        warm, window = warm_window(size)
        for p0, a, b in self.spans:
            begin = size - warm                          # begin() gets tokens[:begin]
            start = a - begin
            if (start >= 0 and p0 >= start and b - a >= warm + min(window, 2048)
                    and start + size + window + TAIL <= len(self.tokens)):
                tokens = np.ascontiguousarray(self.tokens[start:start + size + window + TAIL])
                return Context(label, size, window, tokens, begin)
        raise ValueError(f"{self.family}: no request fits a {size}-token context")


def warm_window(size: int) -> tuple[int, int]:
    """(output tokens replayed before the measured calls, context growth they may span)."""
    return min(WARM, size // 8), max(256, size // 8)


@dataclass
class Context:
    label: str
    size: int                  # measured calls: context length in [size, size + window)
    window: int
    tokens: np.ndarray         # int32: the context, then what the target "generates"
    prompt_len: int            # begin() gets tokens[:prompt_len]

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[:self.prompt_len]


# ------------------------------------------------------------------------------------------
# Replay plans: the stateful draft call measured correctly
# ------------------------------------------------------------------------------------------

@dataclass
class Plan:
    warm: list                 # (context view, sampled, n_accepted or -1 = no accept) per call
    steps: list                # the K measured calls, same layout
    lengths: list              # draft length of each measured call
    contexts: list = field(default_factory=list)   # context length of each measured call

    @property
    def mean_context(self) -> float:
        return sum(self.contexts) / len(self.contexts)

    @property
    def drafted(self) -> int:
        return sum(self.lengths)


def replay_steps(engine, slot: int, tokens: np.ndarray, prompt_len: int):
    """`tokens` as one request verified by the slot loop (``ngramspec.loop``): begin on the
    first `prompt_len` tokens, then the rest is the recorded output. Yields ``(L, sampled,
    draft, n_accepted)`` per step, L being the context length the draft call saw."""
    loop = SlotLoop(engine, slot, tokens[:prompt_len], int(tokens[prompt_len]),
                    capacity=len(tokens))
    while not loop.done:
        L, sampled = loop.n_context, loop.sampled
        draft = loop.propose()
        acc = loop.verify(tokens[L + 1:L + 2 + len(draft)])
        yield L, sampled, draft, acc


def make_plan(factory, ctx: Context, k: int = K, slot: int = 0) -> Plan:
    """Replay `ctx` on a fresh engine as ``ngramspec replay`` does and record every call."""
    seq = ctx.tokens
    plan = Plan([], [], [])
    if ctx.prompt_len >= ctx.size + ctx.window:
        return plan
    for L, sampled, draft, acc in replay_steps(factory(), slot, seq, ctx.prompt_len):
        step = (seq[:L], sampled, acc if len(draft) else -1)
        if L < ctx.size:
            plan.warm.append(step)
        else:
            plan.steps.append(step)
            plan.lengths.append(len(draft))
            plan.contexts.append(L)
        if len(plan.steps) >= k or L + 1 + acc >= ctx.size + ctx.window:
            return plan
    raise ValueError(f"context {ctx.label}: the replay ran past its {len(seq)} tokens")


def prepare(factory, ctx: Context, plan: Plan, slot: int = 0):
    """A fresh engine in the state the measured calls start from."""
    engine = factory()
    engine.begin(slot, ctx.prompt)
    run(engine, plan.warm, slot)
    return engine


def run(engine, steps, slot: int = 0) -> int:
    """The calls of `steps` as the server makes them: draft, then accept after a draft."""
    draft, accept = engine.draft, engine.accept
    for view, sampled, acc in steps:
        draft(slot, view, sampled)
        if acc >= 0:
            accept(slot, acc)
    return len(steps)


def run_timed(engine, steps, slot: int = 0) -> np.ndarray:
    """`run`, timing each draft call as ``ngramspec replay`` does; returns the ns per call.

    The C++ baseline's calls are timed inside C++ (its ``last_ns``), not from Python."""
    draft, accept, clock = engine.draft, engine.accept, time.perf_counter_ns
    times = [0] * len(steps)
    if hasattr(engine, "last_ns"):
        for i, (view, sampled, acc) in enumerate(steps):
            draft(slot, view, sampled)
            times[i] = engine.last_ns
            if acc >= 0:
                accept(slot, acc)
        return np.asarray(times, dtype=np.int64)
    for i, (view, sampled, acc) in enumerate(steps):
        t0 = clock()
        draft(slot, view, sampled)
        times[i] = clock() - t0
        if acc >= 0:
            accept(slot, acc)
    return np.asarray(times, dtype=np.int64)


def run_checked(engine, plan: Plan, slot: int = 0) -> int:
    """`run` over the measured steps, asserting every draft has its recorded length."""
    draft, accept = engine.draft, engine.accept
    drafted = 0
    for i, (view, sampled, acc) in enumerate(plan.steps):
        d = draft(slot, view, sampled)
        if len(d) != plan.lengths[i]:
            raise AssertionError(f"call {i}: draft of {len(d)} tokens, the plan recorded "
                                 f"{plan.lengths[i]}: the replay is not deterministic")
        drafted += len(d)
        if acc >= 0:
            accept(slot, acc)
    return drafted


def timer_overhead_ns(n: int = 20000) -> float:
    """What an empty ``t0 = clock(); clock() - t0`` interval reads on this machine (ns)."""
    clock = time.perf_counter_ns
    best = None
    for _ in range(5):
        total = 0
        for _ in range(n):
            t0 = clock()
            total += clock() - t0
        best = total / n if best is None else min(best, total / n)
    return best


# ------------------------------------------------------------------------------------------
# Trace-family replay (the replay driver's own loop, any engine)
# ------------------------------------------------------------------------------------------

# Subsets replayed by the report (first N requests of each file; None = all).
REPORT_LIMITS = {"code-edit": None, "agentic": 100, "reasoning": None, "chat": None,
                 "model-generated": None}


class TimedEngine:
    """An engine as the replay loop sees it, keeping the time of every draft call (ns) as
    ``ngramspec replay`` measures it: perf_counter_ns around the engine's draft call."""

    __slots__ = ("engine", "begin", "accept", "_draft", "times")

    def __init__(self, engine):
        self.engine = engine
        self.begin, self.accept, self._draft = engine.begin, engine.accept, engine.draft
        self.times = []

    def draft(self, slot, context, sampled, n_max=None):
        clock = time.perf_counter_ns
        t0 = clock()
        d = self._draft(slot, context, sampled, n_max)
        self.times.append(clock() - t0)
        return d


def replay_family(factory, requests, n_slots: int = 1) -> dict:
    """``ngramspec.replay.replay``'s shared-state loop (request t on slot t % n_slots, through
    ``replay_request``) over an engine from `factory`: the summary fields of ``ngramspec
    replay``, the mean context length at the draft calls, and every draft call's time
    (``call_ns``, in call order: the same calls in every run, drafts being deterministic).
    The C++ baseline times its calls itself (``CppEngine.times``)."""
    engine = factory()
    if hasattr(engine, "times"):
        engine.times = []
    else:
        engine = TimedEngine(engine)
    timers = Timers()
    keys = ("n_output", "n_steps", "n_draft_calls", "n_drafts", "n_draft_tokens",
            "n_acc_drafts", "n_acc_tokens")
    totals = dict.fromkeys(keys, 0)
    ctx_sum = 0
    for t, req in enumerate(requests):
        rec = replay_request(engine, t % n_slots, req.prompt, req.output, False, timers)
        end = getattr(getattr(engine, "engine", engine), "end", None)
        if end is not None:               # the request is over, as `ngramspec replay` ends it
            end(t % n_slots)
        for k in keys:
            totals[k] += rec[k]
        L = rec["n_prompt"]
        for n_d, n_acc, called in rec["steps"]:
            ctx_sum += L * called
            L += 1 + n_acc
    s = dict(totals, n_traces=len(requests), **timers.per_call_us())
    s["acc_rate"] = s["n_acc_tokens"] / s["n_draft_tokens"] if s["n_draft_tokens"] else 0.0
    s["tokens_per_step"] = s["n_output"] / s["n_steps"] if s["n_steps"] else 0.0
    s["mean_context"] = ctx_sum / s["n_draft_calls"] if s["n_draft_calls"] else 0.0
    s["call_ns"] = np.asarray(engine.times, dtype=np.int64)
    # the driver's figure, from the calls' own intervals (its Timers also saw the proxy's work)
    s["us_per_gen_call"] = float(s["call_ns"].mean()) / 1000 if len(engine.times) else 0.0
    s["stats"] = getattr(engine, "engine", engine).stats()
    return s


def per_call_us(runs, stat: str = "min") -> float:
    """Mean over calls of each call's minimum (or median) over `runs`: arrays of per-call ns,
    the same calls in every run. On this shared 2-core machine a call the scheduler pre-empted,
    or that ran on caches another process just flushed, does not count; a call that is slow in
    every run (an index catching up, a pool re-insertion) does. The minimum is the spec's own
    statistic (llama.cpp's figures are the minimum over 7 repeats), taken per call."""
    m = np.vstack(runs)
    m = m.min(axis=0) if stat == "min" else np.median(m, axis=0)
    return float(m.mean()) / 1000 if m.size else 0.0


def spec_row_for(n_ctx: float) -> str:
    """The spec section 9 row nearest a mean context length (by its range)."""
    if n_ctx <= 3000:
        return "synthetic"
    if n_ctx <= 29000:
        return "python_edit"
    return "python_long"


def machine(with_cpp: bool = True) -> dict:
    """CPU model and cores (lscpu), Python and numpy versions, the checkout's revision, the
    llama-cpp-python version and the C++ baseline's compiler and flags."""
    info = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "Hypervisor vendor",
                               "L2 cache", "L3 cache"):
                info[key.strip()] = value.strip()
    except OSError:
        pass
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True).stdout.strip()
        info["revision"] = rev
    except OSError:
        pass
    try:
        import llama_cpp
        info["llama-cpp-python"] = llama_cpp.__version__
    except ImportError:
        pass
    if with_cpp:
        import llamacpp_baseline
        info["C++ baseline"] = (f"{llamacpp_baseline.compiler_version()}, "
                                f"{' '.join(llamacpp_baseline.FLAGS)}; an empty steady_clock "
                                f"interval reads {llamacpp_baseline.timer_overhead_ns()} ns")
    with open("/proc/loadavg") as f:
        info["load average at start"] = " ".join(f.read().split()[:3])
    return info


# ------------------------------------------------------------------------------------------
# Memory probe (in a fresh process, so resident-set deltas are the engines' alone)
# ------------------------------------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memprobe(configs, ctx_path: str, prompt_len: int, n_steps: int) -> list[dict]:
    """For each (name, n_slots): an engine whose every slot serves the same request (begin on
    `prompt_len` tokens, then `n_steps` replayed verification steps); reports the engine's own
    accounting and the resident-set growth for its pool and for the engine. Nothing is freed
    between configurations, so each growth is that configuration's alone."""
    tokens = np.load(ctx_path)
    keep, out = [], []
    scratch = np.empty(len(tokens) * 4, dtype=np.int64)   # settle numpy's allocator first
    del scratch
    for name, n_slots in configs:
        rss0 = rss_bytes()
        pool = ModPool() if uses_pool(name) else None
        rss1 = rss_bytes()
        engine = SpecEngine(PROPOSERS[name], n_slots=n_slots, pool=pool)
        for slot in range(n_slots):
            L = prompt_len
            for done, (L, _, _, acc) in enumerate(replay_steps(engine, slot, tokens,
                                                               prompt_len)):
                L += 1 + acc
                if done + 1 >= n_steps or L + 1 >= len(tokens):
                    break
        rss2 = rss_bytes()
        keep.append((engine, pool))
        out.append({"name": name, "slots": n_slots, "context": int(L),
                    "memory_bytes": int(engine.memory_bytes()),
                    "pool_nbytes": int(pool.nbytes) if pool is not None else 0,
                    "rss_pool": rss1 - rss0, "rss_engine": rss2 - rss1})
    return out


def memprobe_many(configs, ctx: Context, n_steps: int, tmpdir) -> list[dict]:
    """`memprobe` of `configs` in a fresh Python process."""
    path = pathlib.Path(tmpdir) / f"ctx-{ctx.label}.npy"
    np.save(path, ctx.tokens)
    # the subprocess imports the very ngramspec this process uses
    here = str(pathlib.Path(ngramspec.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [here, os.environ.get("PYTHONPATH")])))
    spec = ",".join(f"{name}:{slots}" for name, slots in configs)
    proc = subprocess.run([sys.executable, __file__, "memprobe", spec, str(path),
                           str(ctx.prompt_len), str(n_steps)],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "memprobe":
        cfgs = [(c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[2].split(",")]
        print(json.dumps(memprobe(cfgs, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
    else:
        sys.exit("usage: benchlib.py memprobe NAME:SLOTS[,NAME:SLOTS...] CTX.npy PROMPT_LEN "
                 "STEPS")
