"""``ngramspec calibrate``: measure the verify-cost curve c(k) of a GGUF model and cache it."""
from __future__ import annotations

import json
import sys

from ngramspec import cost
from ngramspec.cli.common import (add_context_flags, add_model_flags, check_model_file,
                                  positive_int)
from ngramspec.llama import calibration
from ngramspec.llama.model import load_model


def _ks(text):
    return tuple(sorted({positive_int(part) for part in text.split(",")}))


def add_parser(subparsers):
    p = subparsers.add_parser(
        "calibrate", help="measure what verifying k draft tokens costs on this machine",
        description="Decode batches of k tokens at three KV-cache lengths on the model and print "
                    "c(k) = time(k tokens) / time(1 token), the curve the auto speculation "
                    "policy weighs drafts against. The result is cached per model file, thread "
                    "count, batch size and llama.cpp backend (a platform cache dir, or "
                    "$NGRAMSPEC_CACHE_DIR); a cached curve is printed as it is unless --refresh.")
    add_model_flags(p, draft=False, help="model")
    add_context_flags(p, ctx_help="context size (default: %(default)s, as generate); bounds the "
                                  "KV lengths measured")
    p.add_argument("--ks", type=_ks, default=None, metavar="K,K,...",
                   help="batch sizes to measure, a comma list of integers >= 1 (default: "
                        "1,2,3,4,6,8,12,16,32,64; 1 is always measured)")
    p.add_argument("--reps", type=positive_int, default=3, metavar="N",
                   help="decodes per point, the fastest kept (default: 3)")
    p.add_argument("--refresh", action="store_true",
                   help="measure again even when a cached curve exists")
    p.add_argument("--json", action="store_true", help="print the cost model as JSON")
    p.set_defaults(run=run)
    return p


def _execute(args):
    check_model_file("--model", args.model)
    k_max = max(args.ks or calibration.DEFAULT_KS)
    if k_max > args.batch_size:
        raise ValueError(f"--ks: batches of up to {k_max} tokens need --batch-size >= {k_max}")
    if args.ctx_size < k_max + 32:
        raise ValueError(f"--ctx-size must be >= {k_max + 32} to calibrate batches of {k_max} "
                         f"tokens, got {args.ctx_size}")
    llm = load_model(args.model, n_ctx=args.ctx_size, n_batch=args.batch_size,
                     n_threads=args.threads)
    key = calibration.key_for(llm)
    path = cost.cache_path(key)
    progress = None if args.json else (lambda msg: sys.stderr.write(msg + "\n"))
    measured = []

    def measure():
        measured.append(True)
        return calibration.calibrate(llm, ks=args.ks or calibration.DEFAULT_KS,
                                     reps=args.reps, progress=progress)

    model = cost.cached_calibration(key, measure, refresh=args.refresh)
    fresh = bool(measured)
    return model, path, fresh


def _print_text(model, path, fresh):
    meta = model.meta
    out = [f"{'measured' if fresh else 'cached'}: {model.source}",
           f"cache file: {path}",
           f"calibration took {meta.get('calibration_s', 0):.1f} s"]
    head = "| k | " + " | ".join(f"c(k) at KV {p}" for p in model.n_pasts) + " |"
    out += ["", head, "|" + "---|" * (len(model.n_pasts) + 1)]
    for k in model.ks:
        out.append(f"| {k} | " + " | ".join(f"{model.cost(k, p):.2f}" for p in model.n_pasts)
                   + " |")
    out.append("| t(1) ms | " + " | ".join(f"{model.seconds(1, p) * 1e3:.2f}"
                                           for p in model.n_pasts) + " |")
    best = max(model.ks, key=lambda k: k / model.cost(k, model.n_pasts[0]))
    out.append("")
    gain = best / model.cost(best, model.n_pasts[0])
    out.append(f"ceiling with every draft token accepted: {gain:.2f}x "
               f"(batches of {best}, KV {model.n_pasts[0]})")
    sys.stdout.write("\n".join(out) + "\n")


def run(args) -> int:
    model, path, fresh = _execute(args)
    if args.json:
        sys.stdout.write(json.dumps({**model.to_dict(), "cache_file": str(path),
                                     "measured": fresh}) + "\n")
    else:
        _print_text(model, path, fresh)
    return 0
