"""``ngramspec tune``: replay a user's own logs under every proposer setting, print the best
llama-server flags.

    ngramspec tune LOG... [--format F] [--model GGUF] [--limit N] [--holdout F] [--slots 1,4]
                   [--cost-model FILE|NAME] [--jobs N] [--output DIR]

Prints the ranked table, the best llama-server command line (llama.cpp's options only) and the
best ngramspec configuration for each slot count; with ``--output DIR`` also writes
``report.json``, the plots (``speedup_vs_n_max.png``, ``acceptance_vs_tokens_per_step.png``),
the static cache built from the training split (``static.bin``, what ``--lookup-cache-static``
names) and the held-out requests as a trace file (``heldout.jsonl.gz``), on which
``ngramspec replay`` with the printed flags gives the printed figures.
"""
from __future__ import annotations

import gzip
import json
import os
import shlex
import sys
import tempfile

from ngramspec.files import atomic_write_bytes
from ngramspec.cli.common import (Progress, add_draft_bound_flag, add_model_flags,
                                  add_output_flag, add_progress_flags, add_slots_flag,
                                  check_model_file, positive_int)
from ngramspec.config import add_cost_model_argument
from ngramspec.cost import PROFILES, load_cost_model
from ngramspec.llama.model import gpu_offload_available
from ngramspec.llama.tokenizer import Tokenizer
from ngramspec.logs import FORMATS, read_logs
from ngramspec.tune import (GRIDS, JOBS_PER_CORE, MOD_N_MIN_FRACTIONS, NGRAMSPEC_GRIDS, Config,
                            available_cores, parse_types, split_requests, tune)
from ngramspec.tune_plot import require_matplotlib, save_plots

# --cost-model's default follows the machine (`default_cost_model`): a GPU's curve priced on a
# CPU recommends drafts that lose there, and so does another CPU's (the cpu-embedded profile's
# advice and this machine's calibration's can differ completely: issue 40).
GPU_COST_MODEL, CPU_COST_MODEL, LOCAL_COST_MODEL = "gpu", "cpu-embedded", "local"
REPORT_FILE = "report.json"
HELDOUT_FILE = "heldout.jsonl.gz"
STATIC_FILE = "static.bin"


def default_cost_model(model=None) -> tuple:
    """``(name, why)``: ``gpu`` where this llama.cpp build offloads to a GPU; else ``local``
    where this machine has a cached calibration of the embedded model and ``model`` is that
    model (None); else ``cpu-embedded``. ``why`` says so in words, for stderr."""
    if gpu_offload_available():
        return GPU_COST_MODEL, "llama.cpp here offloads to a GPU"
    if model is None and LOCAL_COST_MODEL in PROFILES:
        return LOCAL_COST_MODEL, ("this machine's calibration of the embedded model, cached by "
                                  "`ngramspec calibrate` or generate's first auto run")
    return CPU_COST_MODEL, ("no calibration on this machine yet: `ngramspec calibrate -t 1` "
                            "makes one, which tune then uses")


def _fraction(text):
    value = float(text)
    if not 0.0 < value < 1.0:
        raise ValueError(text)
    return value


_fraction.__name__ = "number between 0 and 1"


def _slot_list(text):
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(text)
    return tuple(dict.fromkeys(values))


_slot_list.__name__ = "comma list of integers >= 1"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "tune", help="sweep every proposer and parameter over your logs, print the best flags",
        description="Replay request logs (token traces, OpenAI-style chat logs or prompt/response "
                    "text pairs, JSONL) under every spec type and parameter on a grid, score "
                    "each on a held-out split (tokens per step, acceptance, modeled speed-up) "
                    "and print the best llama-server command line.")
    p.add_argument("logs", nargs="+", metavar="LOG", help="log files (.jsonl, .jsonl.gz)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="log format: trace (token ids), chat (OpenAI messages + reply), text "
                        "(prompt/response strings); auto decides from the first line "
                        "(default: %(default)s)")
    add_model_flags(p, draft=False, help="target model whose tokenizer reads chat logs and "
                                         "text pairs (loaded vocabulary-only)")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="use the first N requests of each file")
    p.add_argument("--holdout", type=_fraction, default=0.5, metavar="F",
                   help="fraction of the requests, the last ones, held out for scoring; the "
                        "rest builds the static cache (default: %(default)s)")
    add_slots_flag(p, kind=_slot_list, default=(1, 4), metavar="K[,K...]",
                   help="server slot counts to sweep, a comma list (default: 1,4: one slot "
                        "across requests, and several)")
    p.add_argument("--types", metavar="LIST",
                   help="sweep only these spec types (comma list; default all)")
    p.add_argument("--llama-only", action="store_true",
                   help="leave out ngramspec's own options (map re-indexing, cache restart, "
                        "ngram-suffix, the auto policy)")
    p.add_argument("--no-chains", action="store_true",
                   help="do not try chains of the best configuration of each type")
    p.add_argument("--no-auto", action="store_true",
                   help="do not try the auto draft-length policy (--spec-policy auto)")
    add_cost_model_argument(p, "verify-cost curve the modeled speed-ups are priced with",
                        f"{GPU_COST_MODEL} where llama.cpp here offloads to a GPU, else local "
                        f"where this machine has a calibration of the embedded model, else "
                        f"{CPU_COST_MODEL}; said on stderr")
    add_draft_bound_flag(p)
    p.add_argument("--jobs", "-j", type=positive_int, default=None, metavar="N",
                   help=f"worker processes, at most one per configuration and "
                        f"{JOBS_PER_CORE} per core (said on stderr when that caps N; default: "
                        f"the cores this process may use)")
    p.add_argument("--top", type=positive_int, default=20, metavar="N",
                   help="table rows to print (default: %(default)s)")
    add_output_flag(p, metavar="DIR", help="write report.json, the plots, static.bin and "
                                           "heldout.jsonl.gz in this folder (default: none)")
    add_progress_flags(p)
    p.set_defaults(run=run)
    return p


def write_traces(path: str, requests) -> None:
    """Requests as a gzip trace file that ``ngramspec replay`` reads."""
    lines = "".join(json.dumps({"id": r.id, "prompt": r.prompt.tolist(),
                                "output": r.output.tolist()}) + "\n" for r in requests)
    atomic_write_bytes(path, gzip.compress(lines.encode("utf-8")))


def run(args) -> int:
    types = None
    if args.types is not None:
        types = parse_types(args.types)
        if not types:
            raise ValueError(f"--types {args.types!r}: name at least one spec type")
    chosen = args.cost_model is None
    if chosen:
        args.cost_model, why = default_cost_model(args.model)
    cost_model = load_cost_model(args.cost_model)
    check_model_file("--model", args.model)
    requests, tokenizer = read_logs(args.logs, args.format, args.limit,
                                    lambda: Tokenizer(args.model))
    train, heldout = split_requests(requests, args.holdout)
    out_dir = args.output
    if out_dir is not None:
        require_matplotlib()
        os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ngramspec-tune-") as tmp:
        static_path = os.path.join(out_dir or tmp, STATIC_FILE)
        with Progress("tune", enabled=args.progress, unit="config") as progress:
            report = tune(train, heldout, cost_model, slots=args.slots, types=types,
                          ngramspec_options=not args.llama_only, chains=not args.no_chains,
                          auto=not args.no_auto,
                          static_path=static_path, n_ctx=args.ctx_size,
                          jobs=args.jobs or available_cores(), progress=progress,
                          cost_name=args.cost_model,
                          note=lambda text: sys.stderr.write(f"tune: {text}\n"))
        if chosen:   # said after the sweep's own checks, so that an error stays one line
            sys.stderr.write(f"tune: cost model {args.cost_model} ({why}; --cost-model "
                             f"{GPU_COST_MODEL} prices drafts for a GPU server)\n")
        if out_dir is None:   # the cache file goes away with the temporary folder
            report.static_cache = STATIC_FILE
            _relabel_static(report, static_path, STATIC_FILE)
        model = args.model or (tokenizer.model_path if tokenizer else "MODEL.gguf")
        heldout_path = os.path.join(out_dir, HELDOUT_FILE) if out_dir else None
        summary = _print(report, args, model, heldout_path)
        if out_dir is not None:
            _write_outputs(report, out_dir, heldout, requests, args, summary)
    return 0


def _relabel_static(report, old, new):
    for e in report.entries:
        p = e.config.params_dict
        if p.get("lookup_cache_static") == old:
            p["lookup_cache_static"] = new
            e.config = Config.make(e.config.spec_type, p, e.config.n_slots, e.config.policy)


def _row(rank, e):
    f = e.figures
    return (f"{rank:>4}  {f['speedup']:>7.3f}x  {f['tokens_per_step']:>8.3f}  "
            f"{f['acc_rate']:>6.3f}  {e.config.n_slots:>5}  "
            f"{'yes' if e.config.llama_compatible else '-':>5}  {e.config.label()}")


def _figures_line(e, n_heldout):
    f = e.figures
    return (f"{f['speedup']:.3f}x modeled speed-up, {f['tokens_per_step']:.4f} tokens/step, "
            f"acceptance {f['acc_rate']:.4f} ({f['n_acc_tokens']}/{f['n_draft_tokens']} drafted "
            f"tokens) on {n_heldout} held-out requests")


def _print(report, args, model, heldout_path) -> dict:
    print(f"{len(report.entries)} configurations replayed on {report.n_heldout} held-out "
          f"requests ({report.n_train} for training), cost model {report.cost_model}")
    print(f"{'rank':>4}  {'speed-up':>8}  {'tok/step':>8}  {'accept':>6}  {'slots':>5}  "
          f"{'llama':>5}  configuration")
    for i, e in enumerate(report.entries[:args.top]):
        print(_row(i + 1, e))
    if len(report.entries) > args.top:
        print(f"  ... {len(report.entries) - args.top} more"
              + (f" in {os.path.join(args.output, REPORT_FILE)}" if args.output else ""))
    summary = {}
    for k in report.slots:
        best = {}
        llama = report.best(k, llama_compatible=True)
        if llama is not None:
            cmd = report.server_command(llama, model)
            print(f"\nbest llama-server command ({k} slot{'s' if k > 1 else ''}): "
                  f"{_figures_line(llama, report.n_heldout)}")
            print(f"  {cmd}")
            best["llama_server"] = {"command": cmd, **llama.to_dict()}
            if heldout_path:
                check = report.replay_command(llama, heldout_path)
                print(f"  check: {check}")
                best["llama_server"]["replay_command"] = check
        ours = report.best(k, llama_compatible=False)
        if ours is not None:
            flags = shlex.join(ours.config.flags(report.cost_model))
            engine = _engine_call(ours.config, report.cost_model)
            print(f"best ngramspec configuration ({k} slot{'s' if k > 1 else ''}): "
                  f"{_figures_line(ours, report.n_heldout)}")
            print(f"  flags: {flags}")
            print(f"  Python: {engine}")
            best["ngramspec"] = {"flags": flags, "python": engine, **ours.to_dict()}
            if heldout_path:
                check = report.replay_command(ours, heldout_path)
                print(f"  check: {check}")
                best["ngramspec"]["replay_command"] = check
        summary[str(k)] = best
    return summary


def _engine_call(config, cost_model: str) -> str:
    kw = "".join(f", {k}={v!r}" for k, v in config.params)
    call = f"SpecEngine({config.spec_type!r}, n_slots={config.n_slots}{kw})"
    if config.policy == "auto":     # the drivers take the policy (generate_speculative, ...)
        call += f", policy=AutoPolicy(load_cost_model({cost_model!r}))"
    return call


def _write_outputs(report, out_dir, heldout, requests, args, summary) -> None:
    write_traces(os.path.join(out_dir, HELDOUT_FILE), heldout)
    plots = save_plots(report.entries, out_dir, report.cost_model)
    doc = {"logs": list(args.logs), "format": args.format, "limit": args.limit,
           "holdout": args.holdout, "n_requests": len(requests),
           "heldout_ids": [r.id for r in heldout],
           "grids": {"llama.cpp": GRIDS, "ngram_mod_n_min_fractions": MOD_N_MIN_FRACTIONS,
                     "ngramspec": NGRAMSPEC_GRIDS},
           "best": summary, "plots": [os.path.basename(p) for p in plots],
           **report.to_dict()}
    atomic_write_bytes(os.path.join(out_dir, REPORT_FILE),
                       json.dumps(doc, indent=1).encode("utf-8"))
    sys.stderr.write(f"wrote {REPORT_FILE}, {', '.join(os.path.basename(p) for p in plots)}, "
                     f"{STATIC_FILE}, {HELDOUT_FILE} to {out_dir}\n")
