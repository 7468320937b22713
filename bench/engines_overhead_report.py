"""Inside vLLM and SGLang at their scale: CPU time per decode step of each drafter (issue 36).

    python bench engines-overhead [--batch 1,16,64,256] [--context 4096,32768] [--steps 30]

B requests in flight with L-token contexts (synthetic repetitive streams,
tests/engine_harness.py's `synthetic_tokens`), one new token per request per step (the target's
own; every draft is rejected, so each step is a full verify + draft), driven through the
engines' own code paths in their virtual environments (``.venv-vllm``, ``.venv-sglang``, made by
``.ci/engines``):

- vLLM 0.33: the ``custom_class`` call the V1 runner makes (`SteadyRows`, request ids handed
  first as the ``vllm.general_plugins`` hook does) for ``NgramspecProposer`` (ngram-suffix),
  vLLM's ``NgramProposer`` (``ngram``, numba, lookup 2..5) and ``SuffixDecodingProposer``
  (``suffix``, ArcticInference 0.3.0, vLLM's defaults); K = 16.
- SGLang 0.5.23: the NGRAM worker's ``_prepare_draft_tokens`` + ``_update_ngram_corpus``
  (`SteadyBatch`, sync scheduling) with its ``NgramCorpus`` (max_trie_depth 18, the default)
  and ngramspec's ``NgramspecWorker`` + ``NgramspecCorpus`` (ngram-suffix, trees); d = 16.

Per cell: the median of the steady steps (ms) and the first step (every request's first sight:
the prompt handed over and indexed once). SGLang's ``NgramCorpus`` inserts on a thread of its
own; its wait is taken after each of its steps, untimed (before, its inserts ran during the
next drafter's step and were charged to it), and reported in a row of its own. The drafters
of one (B, L) run in one process, each on its own copy of the workload, in alternating blocks
of steps (`ROUNDS` blocks each: a burst of load from elsewhere on the machine hits them all
alike); the first step of a block is not timed: it pays for the other drafter's data having
pushed this one's out of the CPU caches (at 256 x 32k, 8.6-9.4 ms against 3.7-3.9 ms for
ngramspec's step; NgramCorpus's smaller trie lost less), which a server running one drafter
does not have. The machine's CPU and load are recorded beside them.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import benchlib  # first: it puts the measured checkout's ngramspec on sys.path
from engines_report import parse_with_parts, run_parts, write_report

ROOT = benchlib.ROOT
K = 16
D = 16
#: Blocks of steps per drafter, alternating (`_measure`).
ROUNDS = 3
SUFFIX = "--spec-type ngram-suffix"
VLLM_ROWS = ["vLLM ngram (built-in)", "vLLM suffix (ArcticInference)",
             "ngramspec ngram-suffix (custom_class)"]
SGLANG_ROWS = ["SGLang NgramCorpus (built-in)", "ngramspec ngram-suffix (NGRAMSPEC worker)"]
#: Drafters with work on a thread of their own (`_drain` waits for it): their row shows it.
BACKGROUND_ROWS = {SGLANG_ROWS[0]}


def _harness():
    sys.path.insert(0, str(ROOT / "tests"))
    import engine_harness
    return engine_harness


def _drain(driver) -> float:
    """Seconds spent waiting for `driver`'s background work (SGLang's ``NgramCorpus`` inserts
    the tokens ``_update_ngram_corpus`` queued on a thread of its own): 0 for drafters without
    any."""
    corpus = getattr(driver, "ngram_corpus", None)
    if corpus is None:
        return 0.0
    t0 = time.perf_counter()
    corpus.synchronize()
    return time.perf_counter() - t0


def _measure(make_workload, makers: dict, steps: int) -> dict:
    """Each drafter on its own copy of the workload (``steps + ROUNDS + 1`` steps long), in
    `ROUNDS` alternating blocks of ``steps / ROUNDS`` timed steps, each block after one untimed
    step that brings the drafter's data back into the caches (the module's docstring says
    why): per drafter the median steady step and the first step, in ms. A drafter's background
    work is waited for after its step, untimed there (it would otherwise run during the next
    drafter's step, on the same cores) and reported apart (``background_ms``: the median wait,
    a lower bound of its CPU time)."""
    runs = {name: (make_workload(), make()) for name, make in makers.items()}
    first = {}
    for name, (work, driver) in runs.items():
        first[name] = work.step(driver)
        _drain(driver)
    times = {name: [] for name in runs}
    background = {name: [] for name in runs}
    block = -(-steps // ROUNDS)
    for r in range(ROUNDS):
        n = min(block, steps - r * block)
        for name, (work, driver) in runs.items():
            work.step(driver)              # the block's warm-up
            _drain(driver)
            for _ in range(n):
                times[name].append(work.step(driver))
                background[name].append(_drain(driver))
    return {name: {"step_ms": round(1e3 * statistics.median(times[name]), 3),
                   "first_ms": round(1e3 * first[name], 1),
                   "background_ms": round(1e3 * statistics.median(background[name]), 3)}
            for name in runs}


def part_vllm(args):
    from ngramspec.integrations.vllm import NgramspecProposer
    h = _harness()
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        # numba compiles vLLM's ngram kernel on its first call: not a first sight's cost
        h.SteadyRows(1, 64, 2).step(h.VllmNgram(h.tiny_vllm_config(
            tmp, 256, 1, method="ngram", num_speculative_tokens=K, prompt_lookup_min=2,
            prompt_lookup_max=5)))
        for L in args.context:
            max_len = L + args.steps + ROUNDS + 64
            for B in args.batch:
                def workload():
                    return h.SteadyRows(B, L, args.steps + ROUNDS + 1, seed=B)
                makers = {
                    VLLM_ROWS[0]: lambda: h.VllmNgram(h.tiny_vllm_config(
                        tmp, max_len, B, method="ngram", num_speculative_tokens=K,
                        prompt_lookup_min=2, prompt_lookup_max=5)),
                    VLLM_ROWS[1]: lambda: h.VllmSuffix(h.tiny_vllm_config(
                        tmp, max_len, B, method="suffix", num_speculative_tokens=K),
                        {f"r{i}": L for i in range(B)}),
                    VLLM_ROWS[2]: lambda: NgramspecProposer.from_limits(K, max_len, B,
                                                                        spec=SUFFIX)}
                for name, cell in _measure(workload, makers, args.steps).items():
                    table[f"{B}|{L}|{name}"] = cell
                    print(f"  vllm B={B} L={L} {name}: {cell}", file=sys.stderr)
    return table


def part_sglang(args):
    from ngramspec.integrations.sglang import NgramspecCorpus, worker_class
    h = _harness()
    h.stub_cuda_only_kernels()
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    table = {}
    for L in args.context:
        for B in args.batch:
            def workload():
                return h.SteadyBatch(B, L, args.steps + ROUNDS + 1, seed=B)
            makers = {
                SGLANG_ROWS[0]: lambda: h.ngram_worker(NGRAMWorker, NgramCorpus(
                    draft_token_num=D, max_trie_depth=18), D, 18),
                SGLANG_ROWS[1]: lambda: h.ngram_worker(worker_class(), NgramspecCorpus(
                    draft_token_num=D, max_requests=B, spec=SUFFIX), D, 18)}
            for name, cell in _measure(workload, makers, args.steps).items():
                table[f"{B}|{L}|{name}"] = cell
                print(f"  sglang B={B} L={L} {name}: {cell}", file=sys.stderr)
    return table


PARTS = {"vllm": part_vllm, "sglang": part_sglang}


def render(result, p=print):
    a = result["args"]
    m = result["machine"]
    p("# Inside vLLM and SGLang: CPU ms per decode step (issue 36)\n")
    p(f"`{result['command']}` at `{m.get('revision')}`: {m.get('Model name')}, "
      f"{m.get('CPU(s)')} CPUs, load average {m.get('load average at start')} at start; "
      f"vllm {result['versions'].get('vllm')}, sglang {result['versions'].get('sglang')}. "
      f"Median of {a['steps']} steady steps (one new token per request per step; each "
      f"drafter in {ROUNDS} alternating blocks, a block's first step untimed: it refills the "
      "caches the other drafter emptied, which a server with one drafter does not do); in "
      "brackets the first step, every request's first sight. Lower is better. A drafter's "
      "background work (SGLang's NgramCorpus inserts on a thread of its own) is waited for "
      "after its step, untimed there so that it does not run during the next drafter's step, "
      "and shown in the row below it (the median wait: inside SGLang it runs beside the "
      "scheduler's other work until the next step waits for it, on a core of its own).\n")
    for engine, rows in (("vllm", VLLM_ROWS), ("sglang", SGLANG_ROWS)):
        table = result.get(engine)
        if not table:
            p(f"## {engine}: not run ({result['skipped'].get(engine, '')})\n")
            continue
        cols = [(B, L) for L in a["context"] for B in a["batch"]]
        p(f"## Inside {'vLLM' if engine == 'vllm' else 'SGLang'}\n")
        p("| drafter | " + " | ".join(f"B={B}, L={L // 1024}k" for B, L in cols) + " |")
        p("|---|" + "---:|" * len(cols))
        for name in rows:
            cells = [table.get(f"{B}|{L}|{name}") for B, L in cols]
            p(f"| {name} | " + " | ".join(
                f"{c['step_ms']:.2f} ({c['first_ms']:.0f})" if c else "-" for c in cells)
              + " |")
            if name in BACKGROUND_ROWS and any(c and "background_ms" in c for c in cells):
                p("| ... its background inserts, after the step | " + " | ".join(
                    f"+{c['background_ms']:.2f}" if c and "background_ms" in c else "-"
                    for c in cells) + " |")
        p("")


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--batch", type=_ints, default=[1, 16, 64, 256],
                    help="requests in flight (default 1,16,64,256)")
    ap.add_argument("--context", type=_ints, default=[4096, 32768],
                    help="tokens per request (default 4096,32768)")
    ap.add_argument("--steps", type=int, default=30, help="steady steps timed (default 30)")
    ap.add_argument("--engines", default="vllm,sglang")
    args = parse_with_parts(ap, argv, PARTS, "engines_overhead")
    if args.part:
        return 0
    result = {"command": benchlib.command_line("engines-overhead", argv),
              "machine": benchlib.machine(with_cpp=False),
              "args": {k: getattr(args, k) for k in ("batch", "context", "steps")},
              "versions": {}, "skipped": {}}
    run_parts(__file__, args.engines.split(","),
              ["--steps", str(args.steps), "--batch", ",".join(map(str, args.batch)),
               "--context", ",".join(map(str, args.context))], result,
              env=dict(os.environ, TRITON_INTERPRET="1"))
    write_report(result, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
