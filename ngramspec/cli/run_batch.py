"""``ngramspec run-batch -i FILE -o FILE``: an OpenAI Batch API file on the batched scheduler.

Takes ``serve``'s model, slot, request-default, request-limit and speculation flags
(`ngramspec.cli.serve`); the work is `ngramspec.server.batch`'s. Problems that concern the whole
files (a missing input, duplicate custom_ids, an output that is the input, another run's or not
a result file) fail before the model loads, and leave the output as it was.
"""
from __future__ import annotations

import sys

from ngramspec.cli.common import (CtrlC, Progress, add_output_flag, add_progress_flags,
                                  check_writable)
from ngramspec.cli.serve import (add_request_limit_flags, add_serving_flags, build_app,
                                 check_serving_flags, request_limits)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "run-batch", help="answer an OpenAI Batch API file (JSONL) on the batched scheduler",
        description="Each input line {custom_id, method: POST, url: /v1/chat/completions or "
                    "/v1/completions, body} gets one output line {id, custom_id, response: "
                    "{status_code, request_id, body}, error}, bodies as serve answers them. "
                    "Resumable: custom_ids already in the output are skipped, so a killed run "
                    "is completed by running it again. The output is locked while a run "
                    "writes it, and is only ever appended to: a file that does not hold "
                    "run-batch results (or is the input) is refused and left as it was.")
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="requests, one JSON object a line")
    add_output_flag(p, required=True, old_name="--output-file",
                    help="results, appended (created if missing)")
    add_serving_flags(p, temp=0.8)
    add_request_limit_flags(p, "a longer input line is that line's error, skipped unread")
    add_progress_flags(p)
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    check_serving_flags(args)
    from ngramspec.server.batch import IN_FLIGHT_PER_SLOT, open_batch, run_batch

    limits = request_limits(args)
    check_writable("-o", args.output)      # its folder, its permissions
    # the output locked and both files checked before the model loads; nothing written yet
    with open_batch(args.input_file, args.output, limits["max_body_size"]) as batch:
        # every slot busy, one more request each waiting in the queue
        args.queue_size = IN_FLIGHT_PER_SLOT * args.slots
        with CtrlC() as ctrl_c:
            app, backend, _ = build_app(args, **limits)
            ctrl_c.check()      # a Ctrl-C that the model load's logging swallowed
        with Progress("run-batch", enabled=args.progress, unit="req") as bar:
            summary = run_batch(app, backend, batch, progress=bar)
    sys.stderr.write(f"run-batch: {summary.line()}\n")
    return 0
