"""Reading the golden files of ../shared/golden and replaying them with ngramspec."""
from __future__ import annotations

import gzip
import json
import pathlib

from ngramspec.cli import build_parser
from ngramspec.cli.common import engine_params


def read_golden(path: pathlib.Path):
    """(header, request records) of a golden file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        header = json.loads(f.readline())
        records = [json.loads(line) for line in f if line.strip()]
    return header, records


def replay_args(header: dict, golden_dir: pathlib.Path, traces: pathlib.Path):
    """The oracle's arguments as an ``ngramspec replay`` command line, parsed."""
    oracle = list(header["oracle_args"])
    argv = ["replay", str(traces / f"{header['family']}.jsonl.gz")]
    i = 0
    while i < len(oracle):
        flag, value = oracle[i], oracle[i + 1]
        if flag == "--type":
            flag = "--spec-type"
        if flag.startswith("--lookup-cache"):
            value = str(golden_dir / value)
        argv += [flag, value]
        i += 2
    argv += ["--limit", str(header["summary"]["n_traces"]), "--drafts"]
    args = build_parser().parse_args(argv)
    return args, engine_params(args)
