"""ngramspec's benchmarks, one entry point: ``python bench [--tree PATH] SUBCOMMAND [ARGS]``.

Run from the repository root (``python bench kernels --help`` for one subcommand's options).
Every report writes its figures under ``bench/results/`` by default; bench/README.md is the index
of what each subcommand measures and where its results are.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import subprocess
import sys

# subcommand -> (module in bench/, what it measures); the module exposes main(argv=None)
COMMANDS = {
    "kernels": ("kernel_report", "draft-call cost by context size, begin/reset, memory per "
                                 "slot, next to the C++ baseline"),
    "replay": ("replay_report", "replay of every trace family through every proposer, next to "
                                "the C++ baseline and llama-cpp-python's prompt lookup"),
    "cpp-baseline": ("cpp_baseline", "the C++ baseline reproduces every golden draft"),
    "ab": ("ab_steady", "A/B of two checkouts' draft-call costs, interleaved worker processes"),
    "ab-index": ("ab_index", "A/B of two checkouts' one-off index builds, interleaved workers"),
    "suffix": ("suffix_report", "ngram-suffix in server state on the trace families (issue 7)"),
    "trees": ("suffix_tree_report", "ngram-suffix's draft trees of d tokens, verified as SGLang "
                             "verifies them: tokens/step and us per tree"),
    "options": ("options_report", "the named options that fix llama.cpp's server-state "
                                  "collapse (reindex, cache restart)"),
    "e2e": ("e2e_report", "live generation on the embedded model: tokens/s vs plain greedy, "
                          "batch cost c(k), auto policy, oracle"),
    "policy": ("policy_report", "modeled speed of every configuration, fixed and auto, on the "
                                "embedded model's own greedy output (no timing noise)"),
    "prediction": ("prediction_report", "Predicted Outputs on code edits: tokens/step and "
                                        "modeled speed-up with and without the prediction"),
    "repack": ("repack_report", "llama.cpp's weight repacking on/off, and the plug-in's loop"),
    "determinism": ("determinism_report", "which decode paths change one sequence's logits "
                                          "bit-wise (issue 38), and the deterministic mode's cost"),
    "serve": ("serve_report", "the batched scheduler: aggregate tokens/s of 1-8 concurrent "
                              "clients"),
    "serve-load": ("serve_load", "`ngramspec serve` under load: requests/s and tokens/s, "
                                 "speculative vs plain"),
    "serve-abuse": ("serve_abuse_report", "a normal request's latency while 8 clients send "
                                          "each attack class (big bodies, no key, ...)"),
    "engines": ("engines_report", "inside vLLM and SGLang: their built-in n-gram drafters next to "
                                  "ngramspec's, tokens per step and modeled GPU speed-up"),
    "fleet": ("fleet_report", "ngram-suffix over 1, 4, 16 data-parallel replicas, without and "
                              "with the shared store log, against one store"),
    "engines-overhead": ("engines_overhead_report", "inside vLLM and SGLang at 1-256 requests x "
                                                    "4k-32k tokens: CPU ms per decode step of "
                                                    "each drafter"),
    "build-llama-server": (None, "build llama.cpp's llama-server from llama-cpp-python's "
                                 "vendored sources (build_llama_server.sh)"),
    "gpu-prepare": ("gpu.prepare", "the GPU device kit: trimmed llama-cpp-python source, "
                                   "wheels, model parts, traces in bench/gpu/kit/"),
    "gpu-report": ("gpu.report", "render a GPU kit result (gpu.json) as gpu.md"),
    "gpu-profile": ("gpu.profile_entry", "a measured curve of gpu.json as cost.py's gpu profile"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommands:\n" + "\n".join(f"  {name:<20}{what}"
                                            for name, (_, what) in COMMANDS.items()))
    ap.add_argument("--tree", metavar="PATH",
                    help="measure the ngramspec of this checkout (its kernels built in place) "
                         "instead of the one bench/ is in; sets $NGRAMSPEC_TREE, which worker "
                         "processes inherit")
    ap.add_argument("command", choices=COMMANDS, metavar="SUBCOMMAND",
                    help="one of: " + ", ".join(COMMANDS))
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's own arguments")
    args = ap.parse_args(argv)
    if args.tree:
        os.environ["NGRAMSPEC_TREE"] = os.path.abspath(args.tree)
    module_name = COMMANDS[args.command][0]
    here = pathlib.Path(__file__).resolve().parent
    if module_name is None:
        return subprocess.run(["bash", str(here / "build_llama_server.sh"), *args.args]).returncode
    if str(here) not in sys.path:     # `python bench` puts it first already; runpy may not
        sys.path.insert(0, str(here))
    # the subcommand's usage line and recorded command read sys.argv
    sys.argv = [f"python bench {args.command}", *args.args]
    return importlib.import_module(module_name).main(args.args) or 0


if __name__ == "__main__":
    sys.exit(main())
