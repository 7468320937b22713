"""Reading golden files: llama.cpp's own drafts, steps and statistics on recorded traces, in the
format `ngramspec replay --drafts` writes (a header line with the oracle's arguments and the
summary, then one record per request). The parity tests, the pure-Python reference's check and
the C++ baseline's check all read them through here."""
from __future__ import annotations

import gzip
import json
import os


def read_golden(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(header, request records) of a gzipped golden file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        header = json.loads(f.readline())
        records = [json.loads(line) for line in f if line.strip()]
    return header, records


def oracle_config(header: dict) -> tuple[str, dict, str, int]:
    """(spec type list, engine parameters, state, slot count) from a golden header's oracle
    arguments: ``--type``, ``--state``, ``--slots`` and the integer ``--spec-ngram-*`` sizes
    (parameter names as the engine takes them: ``--spec-ngram-mod-n-match`` ->
    ``ngram_mod_n_match``). Cache-file arguments (the ngram-cache files) are refused: their
    readers pass paths, which only the replay command line resolves."""
    args = header["oracle_args"]
    spec_type, state, n_slots, params = None, "shared", 1, {}
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--type":
            spec_type = value
        elif flag == "--state":
            state = value
        elif flag == "--slots":
            n_slots = int(value)
        elif flag.startswith("--spec-ngram-"):
            params[flag[len("--spec-"):].replace("-", "_")] = int(value)
        else:
            raise ValueError(f"oracle argument {flag}: not understood here "
                             "(allowed: --type, --state, --slots, --spec-ngram-*)")
    if spec_type is None:
        raise ValueError("no --type among the oracle arguments")
    return spec_type, params, state, n_slots
