"""Fixtures of the benchmark suites, and a per-call summary printed after a benchmark run.

Smoke mode (``--benchmark-disable``, as CI runs it): every benchmark body runs once, with its
assertions. Benchmark mode: pedantic rounds with a fresh, warmed engine per round; the
terminal summary then prints the microseconds per draft call (round time / calls in the
round) by context size, next to llama.cpp's figures from the spec, and the replay table.
"""
import os
import sys

import pytest

import benchlib

RESULTS = pytest.StashKey[dict]()


def pytest_configure(config):
    config.stash[RESULTS] = {"steady": {}, "replay": []}
    # pytest imports every conftest.py outside a package as the module "conftest" (the last one
    # loaded keeps the name) and the modules of tests/ do `from conftest import ...`: give the
    # name up, so theirs is imported from their own directory (first on sys.path then).
    if getattr(sys.modules.get("conftest"), "__file__", None) == __file__:
        del sys.modules["conftest"]


@pytest.fixture(scope="session")
def smoke(request):
    """True when benchmarks are disabled: run every body once, keep it quick."""
    return bool(request.config.getoption("benchmark_disable", False))


@pytest.fixture(scope="session")
def rounds(smoke):
    """Rounds per pedantic benchmark (NGRAMSPEC_BENCH_ROUNDS overrides the default)."""
    def pick(default):
        return 1 if smoke else int(os.environ.get("NGRAMSPEC_BENCH_ROUNDS", default))
    return pick


@pytest.fixture(scope="session")
def corpus():
    if not benchlib.TRACES.is_dir():
        pytest.fail(f"traces not found at {benchlib.TRACES} (set NGRAMSPEC_SHARED)")
    return benchlib.Corpus("code-edit")


@pytest.fixture(scope="session")
def contexts(corpus):
    return {label: corpus.context(label, size) for label, size in benchlib.SIZES.items()}


@pytest.fixture(scope="session")
def engines():
    return benchlib.Engines()


@pytest.fixture(scope="session")
def results(request):
    """Where the benchmarks leave figures for the terminal summary."""
    return request.config.stash[RESULTS]


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    res = config.stash.get(RESULTS, None)
    if not res:
        return
    if res["steady"]:
        _steady_table(terminalreporter, res["steady"])
    if res["replay"]:
        _replay_table(terminalreporter, res["replay"])


def _steady_table(tr, steady):
    sizes = [s for s in benchlib.SIZES if any(k[1] == s for k in steady)]
    names = [n for n in [*benchlib.PROPOSERS, benchlib.PROMPT_LOOKUP]
             if any(k[0] == n for k in steady)]
    tr.write_sep("=", "ngramspec: us per draft call, steady state (min over rounds)")
    tr.write_line("round time / draft calls in the round (draft + accept as the server makes "
                  "them); llama.cpp: spec section 9, its own traces")
    tr.write_line(f"{'proposer':<14}" + "".join(f"{s:>12}" for s in sizes))
    for name in names:
        cells = []
        for s in sizes:
            v = steady.get((name, s))
            cells.append(f"{v:>12.3f}" if v is not None else f"{'-':>12}")
        tr.write_line(f"{name:<14}" + "".join(cells))
    ratios = []
    for name in benchlib.LLAMA_CPP_US["synthetic"]:
        cells = []
        for s in sizes:
            ref = benchlib.SIZE_REF.get(s)
            v = steady.get((name, s))
            if ref is None or v is None:
                cells.append(f"{'-':>12}")
                continue
            r = v / benchlib.LLAMA_CPP_US[ref][name]
            ratios.append(r)
            cells.append(f"{r:>11.2f}x")
        tr.write_line(f"{name + ' / llama':<14}" + "".join(cells))
    if ratios:
        tr.write_line(f"geometric mean ngramspec/llama.cpp (sizes with a spec row): "
                      f"{benchlib.geomean(ratios):.3f}")


def _replay_table(tr, rows):
    tr.write_sep("=", "replay: per trace family and proposer (subsets of the test suite)")
    tr.write_line(f"{'family':<16}{'proposer':<15}{'traces':>7}{'tok/step':>10}{'acc rate':>10}"
                  f"{'us/call':>10}{'mean ctx':>10}")
    for r in rows:
        tr.write_line(f"{r['family']:<16}{r['name']:<15}{r['n_traces']:>7}"
                      f"{r['tokens_per_step']:>10.3f}{r['acc_rate']:>10.3f}"
                      f"{r['us_per_gen_call']:>10.2f}{r['mean_context']:>10.0f}")
