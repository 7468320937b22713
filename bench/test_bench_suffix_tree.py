"""`python bench trees` (bench/suffix_tree_report.py): its greedy tree verification is the contract
tests' (every root path's longest confirmed prefix, tests/engine_harness.py), and on a few
requests ngram-suffix's trees accept more per step than its chains."""
import random
import sys

import benchlib
import suffix_tree_report as tree_report
from ngramspec.traces import read_requests

sys.path.insert(0, str(benchlib.ROOT / "tests"))
from engine_harness import accepted_path  # noqa: E402


def root_paths(tokens, parents):
    """Every root-to-node path of a (tokens, parents) tree, as tuples."""
    paths = set()
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.append(int(tokens[node]))
            node = parents[node]
        paths.add(tuple(reversed(path)))
    return paths


def test_tree_accept_is_greedy_tree_verification():
    rng = random.Random(7)
    for _ in range(500):
        tokens, parents = [], []
        for _ in range(rng.randint(0, 15)):
            p = rng.randint(-1, len(tokens) - 1)
            taken = {tokens[j] for j in range(len(tokens)) if parents[j] == p}
            free = [t for t in range(4) if t not in taken]
            if not free:
                continue
            tokens.append(rng.choice(free))
            parents.append(p)
        rest = [rng.randint(0, 3) for _ in range(rng.randint(0, 8))]
        want = len(accepted_path(root_paths(tokens, parents), rest))
        assert tree_report.tree_accept(tokens, parents, rest) == want


def test_trees_accept_more_than_chains():
    requests = read_requests(str(benchlib.TRACES / "agentic.jsonl.gz"), 6)
    chain = tree_report.run_family(requests, 12, 2, tree=False)
    tree = tree_report.run_family(requests, 12, 2, tree=True)
    assert chain["n_output"] == tree["n_output"] == sum(len(r.output) - 1 for r in requests)
    assert tree["tokens_per_step"] > chain["tokens_per_step"] > 1.0
    assert tree["us_per_tree"] > 0 and chain["us_per_tree"] is None


def test_table_and_engines_section_show_the_measured_rows():
    """`measure`'s rows become one table line per drafter (SGLang's only where it is
    importable), and `python bench engines` prints the same table under SGLang's."""
    import engines_report
    rows = tree_report.measure(["agentic"], [6], limit=3, in_flight=2)
    lines = tree_report.table(rows)
    by = {r["tree"]: r for r in rows}
    assert lines[0] == "| row | agentic d = 6 |"
    assert lines[-1] == (f"| ngram-suffix draft_tree (d - 1 tokens, best first) | "
                         f"{by[True]['tokens_per_step']:.3f} ({by[True]['us_per_tree']:.1f} µs) |")
    assert len(lines) == 2 + len(by) and len(by) == (4 if tree_report.has_sglang() else 2)
    out = []
    engines_report.render_trees(rows, out.append)
    assert out[0].startswith("### Trees against SGLang's trie") and out[1:-1] == lines
