"""``ngramspec run-batch -i FILE -o FILE``: an OpenAI Batch API file on the batched scheduler.

Takes ``serve``'s model, slot, request-default and speculation flags (`ngramspec.cli.serve`);
the work is `ngramspec.server.batch`'s. Input problems that concern the whole file (missing,
duplicate custom_ids, an output that is not a result file) fail before the model loads.
"""
from __future__ import annotations

import os
import sys

from ngramspec.cli.common import Progress, add_output_flag, add_progress_flags, check_writable
from ngramspec.cli.serve import add_serving_flags, build_app, check_serving_flags


def add_parser(subparsers):
    p = subparsers.add_parser(
        "run-batch", help="answer an OpenAI Batch API file (JSONL) on the batched scheduler",
        description="Each input line {custom_id, method: POST, url: /v1/chat/completions or "
                    "/v1/completions, body} gets one output line {id, custom_id, response: "
                    "{status_code, request_id, body}, error}, bodies as serve answers them. "
                    "Resumable: custom_ids already in the output are skipped, so a killed run "
                    "is completed by running it again.")
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="requests, one JSON object a line")
    add_output_flag(p, required=True, old_name="--output-file",
                    help="results, appended (created if missing)")
    add_serving_flags(p, temp=0.8)
    add_progress_flags(p)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    check_serving_flags(args)
    from ngramspec.server.batch import IN_FLIGHT_PER_SLOT, read_done, run_batch, scan_input

    if not os.path.isfile(args.input_file):
        raise ValueError(f"-i: input file not found: {args.input_file}")
    check_writable("--output", args.output)
    scan_input(args.input_file)          # duplicate custom_ids: refused before the model loads
    read_done(args.output)
    # every slot busy, one more request each waiting in the queue
    args.queue_size = IN_FLIGHT_PER_SLOT * args.slots
    app, scheduler, _ = build_app(args)
    with Progress("run-batch", enabled=args.progress, unit="req") as bar:
        summary = run_batch(app, scheduler, args.input_file, args.output, progress=bar)
    sys.stderr.write(f"run-batch: {summary.line()}\n")
    return 0
