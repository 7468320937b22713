"""Draft trees of a fixed size, verified as SGLang verifies them (issue 37 point 1).

    python bench trees [--families agentic,code-edit] [--limit 24] [--in-flight 4]
                       [--d 12,16] [--json FILE] [--md FILE]

SGLang's n-gram worker verifies a tree of exactly d tokens (the root, the last verified token,
included) every step, whatever the drafter found; greedy verification (``verify_tree_greedy``)
accepts the longest root path the target confirms. Here the target is the recorded output: from
the root, a node's child equal to the next recorded token is taken, until none is. The requests
run `--in-flight` at a time, in file order, a conversation's next turn only once the previous
one is answered (its prompt holds that answer), each on a slot of one ngram-suffix proposer,
which learns as a server does (store and calibration shared, a request ended when answered).

Rows: ngram-suffix's chain alone (d - 1 tokens at most, what a llama.cpp-style engine would
verify), and its `draft_tree` of d - 1 tokens below the root. Per row: tokens per verification
step (output tokens after the first / steps, as tests/engine_harness.py counts) and µs per
`draft_tree` call (each call timed, median over calls). Run in SGLang's environment
(``.venv-sglang/bin/python bench trees``), the report adds SGLang's own ``NgramCorpus`` driven
by SGLang's ``NGRAMWorker`` in the contract tests' harness (same requests, same batch), as its
worker drives it and with each prompt also put into its trie on admission.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

import benchlib
from ngramspec._suffix import SuffixProposer
from ngramspec.traces import read_requests


def tree_accept(tokens, parents, rest) -> int:
    """Greedy tree verification: how many tokens of the root path that `rest` (the target's
    next tokens) confirms, from the root down (SGLang's ``verify_tree_greedy`` rule)."""
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(int(p), {})[int(tokens[i])] = i
    node, n = -1, 0
    while n < len(rest):
        node = children.get(node, {}).get(int(rest[n]))
        if node is None:
            break
        n += 1
    return n


class Live:
    """One request in flight: its slot, context and recorded output."""

    def __init__(self, req, slot):
        self.req, self.slot = req, slot
        self.ctx = [int(t) for t in req.prompt]
        self.out = req.output.tolist()
        self.produced = 1                     # the first token comes from the prompt pass
        self.steps = 0


def run_family(requests, d: int, in_flight: int, tree: bool) -> dict:
    """Replays `requests` with trees of d tokens (tree=False: the chain, at most d - 1)."""
    prop = SuffixProposer(in_flight)
    queue = list(requests)
    last_of = {}
    after = {}
    for r in requests:
        conv = r.extra.get("conversation")
        after[r.id] = last_of.get(conv) if conv is not None else None
        if conv is not None:
            last_of[conv] = r.id
    done, live, free = set(), [], list(range(in_flight))
    n_out = n_steps = 0
    times = []
    while queue or live:
        while queue and free and (after[queue[0].id] is None or after[queue[0].id] in done):
            r = queue.pop(0)
            x = Live(r, free.pop(0))
            prop.begin(x.slot, np.asarray(x.ctx, dtype=np.int32))
            live.append(x)
        for x in list(live):
            rest = x.out[x.produced:]
            sampled = x.out[x.produced - 1]
            chain = prop.draft(x.slot, np.asarray(x.ctx, dtype=np.int32), sampled)
            if tree:
                t0 = time.perf_counter_ns()
                toks, pars = prop.draft_tree(x.slot, min(len(chain), d - 1), d - 1)
                times.append(time.perf_counter_ns() - t0)
                k = tree_accept(toks, pars, rest)
            else:
                chain = chain[:d - 1]
                k = 0
                while k < len(chain) and k < len(rest) and chain[k] == rest[k]:
                    k += 1
            acc = rest[:k]
            j = 0
            while j < len(chain) and j < k and chain[j] == acc[j]:
                j += 1
            if len(chain):
                prop.accept(x.slot, j)
            x.ctx += [sampled] + acc
            x.produced += k + 1
            x.steps += 1
            if x.produced >= len(x.out):
                prop.end(x.slot)
                live.remove(x)
                free.append(x.slot)
                free.sort()
                done.add(x.req.id)
                n_out += len(x.out) - 1         # the harness's count: after the first
                n_steps += x.steps
    return dict(tokens_per_step=n_out / n_steps if n_steps else 0.0, n_steps=n_steps,
                n_output=n_out, us_per_tree=float(np.median(times)) / 1000 if times else None)


def run_sglang(requests, d: int, in_flight: int, with_prompts: bool) -> float:
    """SGLang's NgramCorpus through its NGRAMWorker (tests/engine_harness.run_ngram_worker);
    with_prompts: each request's prompt is put into the trie before its first draft."""
    sys.path.insert(0, str(benchlib.ROOT / "tests"))
    import engine_harness as h
    h.stub_cuda_only_kernels()
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class PromptCorpus(NgramCorpus):
        """NgramCorpus that also holds every admitted request's prompt (SGLang's FIXME in
        ``_update_ngram_corpus``: put ``origin_input_ids + output_ids`` at extend)."""
        prompts = {r.id: r.prompt.tolist() for r in requests}
        seen = set()

        def batch_get(self, req_ids, batch_tokens, total_lens):
            new = [self.prompts[rid] for rid in req_ids if rid not in self.seen]
            if new:
                self.seen.update(req_ids)
                self.batch_put(new)
                self.synchronize()
            return super().batch_get(req_ids, batch_tokens, total_lens)

    corpus = (PromptCorpus if with_prompts else NgramCorpus)(draft_token_num=d)
    done = h.run_ngram_worker(NGRAMWorker, corpus, requests, d, 18, batch_size=in_flight)
    return h.tokens_per_step(done)


# The harness (issue 37): the first 24 requests of each family, 4 in flight, d = 12, 16.
FAMILIES, LIMIT, IN_FLIGHT, DS = "agentic,code-edit", 24, 4, (12, 16)
# (row key, label), in table order; the SGLang rows only where SGLang is importable
ROWS = [("sglang", "SGLang NgramCorpus, as its worker drives it"),
        ("sglang+prompts", "SGLang NgramCorpus with each prompt in its trie"),
        (False, "ngram-suffix chain (<= d - 1 tokens)"),
        (True, "ngram-suffix draft_tree (d - 1 tokens, best first)")]


def has_sglang() -> bool:
    try:
        import sglang  # noqa: F401
        return True
    except ImportError:
        return False


def measure(families=FAMILIES.split(","), ds=DS, limit=LIMIT, in_flight=IN_FLIGHT) -> list:
    """Every row of the table (SGLang's where it is importable): one dict per (family, d,
    row key), with tokens_per_step and us_per_tree (None for SGLang's rows)."""
    rows = []
    sg = has_sglang()
    for fam in families:
        requests = read_requests(str(benchlib.TRACES / f"{fam}.jsonl.gz"), limit)
        for d in ds:
            for tree in (False, True):
                rows.append(dict(run_family(requests, d, in_flight, tree), family=fam, d=d,
                                 tree=tree))
            for how in ("sglang", "sglang+prompts") if sg else ():
                rows.append(dict(tokens_per_step=run_sglang(requests, d, in_flight,
                                                            how == "sglang+prompts"),
                                 us_per_tree=None, family=fam, d=d, tree=how))
        print(f"  trees: {fam} done", file=sys.stderr)
    return rows


def table(rows) -> list:
    """`measure`'s rows as a Markdown table (lines): a row per drafter, a column per (family,
    d), µs per draft_tree call beside ngram-suffix's tree."""
    by = {(r["family"], r["d"], r["tree"]): r for r in rows}
    cols = list(dict.fromkeys((r["family"], r["d"]) for r in rows))
    lines = ["| row | " + " | ".join(f"{f} d = {d}" for f, d in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key, label in ROWS:
        if (cols[0][0], cols[0][1], key) not in by:
            continue
        cells = []
        for f, d in cols:
            r = by[(f, d, key)]
            us = f" ({r['us_per_tree']:.1f} µs)" if r["us_per_tree"] is not None else ""
            cells.append(f"{r['tokens_per_step']:.3f}{us}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    ap = benchlib.argument_parser(__doc__)
    ap.add_argument("--families", default=FAMILIES)
    ap.add_argument("--limit", type=int, default=LIMIT, help="first N requests of each family")
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT)
    ap.add_argument("--d", default=",".join(map(str, DS)), help="tree sizes, the root included")
    ap.add_argument("--json", metavar="FILE", default=benchlib.result_path("trees.json"))
    ap.add_argument("--md", metavar="FILE", default=benchlib.result_path("trees.md"))
    args = ap.parse_args(argv)
    info = benchlib.machine(with_cpp=False)
    if has_sglang():
        import sglang
        info["sglang"] = sglang.__version__
    rows = measure(args.families.split(","), [int(x) for x in args.d.split(",")], args.limit,
                   args.in_flight)
    lines = ["Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()) + "\n",
             f"Tokens per verification step, first {args.limit} requests, {args.in_flight} in "
             f"flight, greedy tree verification against the recorded outputs (µs per draft_tree "
             f"call):\n", *table(rows)]
    print("\n".join(lines))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "limit": args.limit, "in_flight": args.in_flight,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
