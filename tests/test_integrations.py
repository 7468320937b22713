"""The integrations' request following, without the engines: vLLM's runner call sequence on
recorded traces (`engine_harness.RunnerSim`), SGLang's corpus calls, ``$NGRAMSPEC_SPEC`` parsing.
tests/test_engine_vllm.py and test_engine_sglang.py repeat the contract inside the real engines."""
import numpy as np
import pytest

from conftest import TRACES
from engine_harness import (PER_REQUEST, SHARED, accepted_path, check_drafts_are_spec_engines,
                            check_moving_rows_changes_nothing,
                            check_request_ids_match_token_following, tree_paths)

from ngramspec import SpecEngine
from ngramspec.integrations.requests import SPEC_ENV, engine_from_env
from ngramspec.integrations.sglang import NgramspecCorpus, TreeBatch, chain_tree, tree_layout
from ngramspec.integrations.vllm import NgramspecProposer
from ngramspec.loop import SlotLoop, run_recorded
from ngramspec.traces import read_requests

K = 8
MAX_LEN = 1 << 14


def _trace(name, n):
    return [r for r in read_requests(str(TRACES / f"{name}.jsonl.gz"), limit=n)
            if len(r.prompt) + len(r.output) < MAX_LEN - 1]


@pytest.fixture(scope="module", params=["code-edit", "agentic"])
def trace(request):
    return _trace(request.param, 6)


def _make(flags, n):
    return NgramspecProposer.from_limits(K, MAX_LEN, n, spec=flags)


def test_drafts_are_spec_engines_for_each_request(trace):
    check_drafts_are_spec_engines(_make, trace, K, MAX_LEN)


@pytest.mark.parametrize("flags", [PER_REQUEST, SHARED, SHARED + " --spec-policy auto"])
def test_moving_rows_changes_nothing(trace, flags):
    check_moving_rows_changes_nothing(_make, trace, K, MAX_LEN, flags)


def test_request_ids_match_token_following(trace):
    check_request_ids_match_token_following(_make, trace, MAX_LEN)


def test_a_new_request_that_continues_an_ended_one():
    """A request whose tokens continue a finished one's (its prompt: the other's tokens and one
    more) is taken for it when only tokens tell; with request ids it is a new request."""
    tr = _trace("code-edit", 1)[0]
    prompt = tr.prompt[:600]
    for with_ids, same in ((False, True), (True, False)):
        prop = NgramspecProposer.from_limits(K, MAX_LEN, 2, spec=PER_REQUEST)
        tok = np.zeros((2, MAX_LEN), dtype=np.int32)
        num = np.zeros(2, dtype=np.int32)
        tok[0, :600] = prompt
        num[0] = 600
        if with_ids:
            prop.set_request_ids(["a"])
        prop.propose([[int(prompt[-1])]], num, tok)
        first = prop.requests.requests[next(iter(prop.requests.requests))]
        tok[0, 600] = 7                          # request b: a's tokens and one more
        num[0] = 601
        if with_ids:
            prop.set_request_ids(["b"], ["a"])
        prop.propose([[7]], num, tok)
        live = list(prop.requests.requests.values())
        assert len(live) == 1
        assert (live[0] is first) == same


def test_drafts_are_capped_by_k_and_the_row_length():
    flags = "--spec-type ngram-mod --spec-ngram-mod-n-match 2 --spec-ngram-mod-n-min 1"
    prop = NgramspecProposer.from_limits(4, 40, 1, spec=flags)
    tok = np.zeros((1, 40), dtype=np.int32)
    pattern = np.tile(np.arange(1, 11, dtype=np.int32), 4)
    for n in (20, 34, 36, 38, 39):
        tok[0, :n] = pattern[:n]
        prop.requests.clear()
        prop._rows = []
        d = prop.propose([[int(tok[0, n - 1])]], np.array([n], dtype=np.int32), tok)[0]
        assert len(d) == max(0, min(4, 40 - n - 1)), n
        assert d == pattern[n:n + len(d)].tolist()


def test_spec_flags_fail_as_serve_does(monkeypatch):
    monkeypatch.setenv(SPEC_ENV, "--spec-type ngram-mod --spec-ngram-mod-n-min 2000")
    with pytest.raises(ValueError, match=r"NGRAMSPEC_SPEC: --spec-ngram-mod-n-min = 2000 is "
                                         r"out of range: allowed 0 \.\. 1024"):
        NgramspecProposer.from_limits(K, MAX_LEN, 2)
    monkeypatch.setenv(SPEC_ENV, "--spec-type ngram-nope")
    with pytest.raises(ValueError, match="NGRAMSPEC_SPEC: .*ngram-nope"):
        NgramspecCorpus(draft_token_num=8)
    monkeypatch.setenv(SPEC_ENV, "--spec-policy auto --cost-model nowhere.json")
    with pytest.raises(ValueError, match="NGRAMSPEC_SPEC: --cost-model nowhere.json"):
        NgramspecCorpus(draft_token_num=8)
    monkeypatch.setenv(SPEC_ENV, "--spec-ngram-mod-n-max 99x")
    with pytest.raises(ValueError, match="NGRAMSPEC_SPEC: argument --spec-ngram-mod-n-max"):
        NgramspecCorpus(draft_token_num=8)
    monkeypatch.delenv(SPEC_ENV)
    engine, policy = engine_from_env(1)          # serve's defaults: ngram-mod 8..32, fixed
    assert [s["type"] for s in engine.stats()] == ["ngram-mod"]
    assert type(policy).__name__ == "FixedPolicy"
    monkeypatch.setenv(SPEC_ENV, "--spec-type ngram-suffix --spec-policy auto")
    assert type(engine_from_env(1)[1]).__name__ == "AutoPolicy"


def test_chain_tree_is_sglangs_layout():
    tokens, mask = chain_tree(5, np.array([6, 7]), 5)
    assert tokens.tolist() == [5, 6, 7, 0, 0]
    assert mask.astype(int).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                         [1, 0, 0, 1, 0], [1, 0, 0, 0, 1]]


def chain_of(tokens, mask):
    """The chain below the root of a linear draft tree. The padding hangs off the root: a
    lone token 0 there is padding (SGLang's own reading of its trees)."""
    n = 0
    while n + 1 < len(tokens) and mask[n + 1, n]:
        n += 1
    if n == 1 and tokens[1] == 0:
        n = 0
    return [int(t) for t in tokens[1:n + 1]]


def _corpus_run(corpus, reqs, d, depth):
    """Requests through the corpus as SGLang's NGRAM worker calls it, two at a time, greedy
    chain verification against the recorded output; returns each request's drafts."""
    drafts = {r.id: [] for r in reqs}
    live = {}
    queue = list(reqs)
    while queue or live:
        while queue and len(live) < 2:
            r = queue.pop(0)
            live[r.id] = [r, list(r.prompt) + [int(r.output[0])]]
        ids = list(live)
        tails = [live[i][1][-depth:] for i in ids]
        lens = [len(live[i][1]) for i in ids]
        toks, masks = corpus.batch_get(ids, tails, lens)
        assert toks.shape == (len(ids) * d,) and masks.shape == (len(ids) * d * d,)
        for j, rid in enumerate(ids):
            r, seq = live[rid]
            row = toks[j * d:(j + 1) * d]
            assert row[0] == seq[-1]
            draft = chain_of(row, masks[j * d * d:(j + 1) * d * d].reshape(d, d))
            produced = len(seq) - len(r.prompt)
            rest = r.output[produced:].tolist()
            acc = 0
            while acc < len(draft) and acc < len(rest) and draft[acc] == rest[acc]:
                acc += 1
            drafts[rid].append(draft)
            seq.extend(rest[:acc + 1])
            if len(seq) >= len(r.prompt) + len(r.output):
                del live[rid]
                corpus.erase_match_state([rid])
    return drafts


def test_sglang_corpus_drafts_are_spec_engines():
    """Through batch_get with the worker's tails (all tokens, as register's worker passes) each
    request drafts what SpecEngine drafts for it alone."""
    reqs = _trace("code-edit", 4)
    d = 9
    corpus = NgramspecCorpus(draft_token_num=d, max_trie_depth=MAX_LEN, spec=PER_REQUEST)
    got = _corpus_run(corpus, reqs, d, MAX_LEN)
    for r in reqs:
        ref = run_recorded(engine_from_env(1, PER_REQUEST)[0], 0, r.prompt, r.output,
                           record_drafts=True, n_max=d - 1)
        want = ref.drafts
        assert got[r.id][:len(want)] == want, r.id
    assert not corpus.requests.requests            # every request ended


def test_sglang_reused_request_id_gets_no_stale_draft():
    """SGLang issue 38129: a request id used again after others' inserts; ours begins anew."""
    reqs = _trace("code-edit", 2)
    d = 6
    corpus = NgramspecCorpus(draft_token_num=d, max_trie_depth=MAX_LEN, spec=PER_REQUEST)
    a, b = reqs
    corpus.batch_get(["x"], [list(a.prompt) + [int(a.output[0])]], [len(a.prompt) + 1])
    seq = list(b.prompt) + [int(b.output[0])]
    toks, _ = corpus.batch_get(["x"], [seq], [len(seq)])
    engine = SpecEngine("ngram-simple,ngram-map-k4v", 1, ngram_map_k4v_reindex=1)
    ref = run_recorded(engine, 0, b.prompt, b.output, record_drafts=True, n_max=d - 1).drafts[0]
    assert [int(t) for t in toks[1:1 + len(ref)]] == ref


# -- SGLang: ngram-suffix fills the draft tree -------------------------------------------------

def test_tree_layout_is_sglangs_ancestor_mask():
    """Row i: ones at i and its ancestors; SGLang's parent (the last ancestor before i) is the
    given one; the padding hangs off the root."""
    tokens, parents = np.array([6, 7, 8, 9]), np.array([-1, 0, -1, 1])
    flat, mask = tree_layout(5, tokens, parents, 6)
    assert flat.tolist() == [5, 6, 7, 8, 9, 0]
    assert mask.astype(int).tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                         [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0],
                                         [1, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1]]
    sglang_parent = [max(j for j in range(i) if mask[i, j]) - 1 for i in range(1, 5)]
    assert sglang_parent == parents.tolist()
    assert tree_paths(flat, mask) == {(6, 7, 9), (8,)}


def test_tree_batch_rows_are_each_requests_own_layout():
    """A step's rows laid out together (TreeBatch's vectorized writes) are each row's own
    `tree_layout`: trees, chains, empty drafts and full ones side by side."""
    d = 5
    rows = [(5, [6, 7, 8, 9], [-1, 0, -1, 1]), (3, [4], None), (2, [], None),
            (9, [1, 2, 3, 4], None), (8, [7, 6], [-1, -1])]
    batch = TreeBatch(len(rows), d)
    for i, (root, toks, parents) in enumerate(rows):
        batch.set(i, root, np.array(toks, dtype=np.int32),
                  None if parents is None else np.array(parents, dtype=np.int32))
    flat, mask = batch.finish()
    for i, (root, toks, parents) in enumerate(rows):
        par = np.arange(-1, len(toks) - 1) if parents is None else np.array(parents)
        want_flat, want_mask = tree_layout(root, np.array(toks), par, d)
        assert flat[i * d:(i + 1) * d].tolist() == want_flat.tolist()
        assert mask[i * d * d:(i + 1) * d * d].reshape(d, d).tolist() == want_mask.tolist()
    # the roots given at once (batch_get reads a step's in one call), each row's tokens after
    at_once = TreeBatch(len(rows), d, [root for root, _, _ in rows])
    for i, (_, toks, parents) in enumerate(rows):
        at_once.add(i, np.array(toks, dtype=np.int32),
                    None if parents is None else np.array(parents, dtype=np.int32))
    flat2, mask2 = at_once.finish()
    assert flat2.tolist() == flat.tolist() and mask2.tolist() == mask.tolist()
    with pytest.raises(ValueError, match=r"len\(tokens\) = 5 is out of range: allowed 0 \.\. 4"):
        batch.set(0, 1, np.arange(5))
    with pytest.raises(ValueError, match=r"len\(tokens\) = 5 is out of range: allowed 0 \.\. 4"):
        at_once.add(0, np.arange(5))


def _tree_run(corpus, reqs, d):
    """Requests through batch_get two at a time, greedy tree verification (the longest path the
    recorded output confirms, as SGLang's verify walks it); per request the steps' accepted
    lengths, and per step the chain the request's loop drafted with the tree's paths."""
    acc_lens = {r.id: [] for r in reqs}
    seen = []
    live, queue = {}, list(reqs)
    while queue or live:
        while queue and len(live) < 2:
            r = queue.pop(0)
            live[r.id] = [r, list(r.prompt) + [int(r.output[0])]]
        ids = list(live)
        toks, masks = corpus.batch_get(ids, [live[i][1] for i in ids],
                                       [len(live[i][1]) for i in ids])
        for j, rid in enumerate(ids):
            r, seq = live[rid]
            row = toks[j * d:(j + 1) * d]
            mask = masks[j * d * d:(j + 1) * d * d].reshape(d, d)
            paths = tree_paths(row, mask)
            req = corpus.requests.get(rid)
            seen.append((req.loop.pending_draft.tolist(), row, paths))
            rest = r.output[len(seq) - len(r.prompt):].tolist()
            acc = accepted_path(paths, rest)
            acc_lens[rid].append(len(acc))
            seq.extend(rest[:len(acc) + 1])
            if len(seq) >= len(r.prompt) + len(r.output):
                del live[rid]
                corpus.erase_match_state([rid])
    return acc_lens, seen


@pytest.mark.parametrize("name", ["code-edit", "agentic"])
def test_sglang_corpus_trees_and_chains_accept_more_with_trees(name):
    """``tree=False`` lays the loop's chain out as the one path (slots 1 .. n, each under the
    one before); ngram-suffix's trees (best first, the chain not forced) branch, and on the
    traces they accept at least as many tokens per step as the chains."""
    reqs = _trace(name, 6)
    d = 9
    runs = {}
    for tree in (True, False):
        corpus = NgramspecCorpus(draft_token_num=d, max_trie_depth=MAX_LEN,
                                 spec="--spec-type ngram-suffix", tree=tree)
        assert (corpus.tree_proposer is not None) == tree
        acc_lens, seen = _tree_run(corpus, reqs, d)
        for chain, row, paths in seen:
            if not tree:
                assert row[1:len(chain) + 1].tolist() == chain
                assert len(paths) <= 1 and (not chain or tuple(chain) in paths)
        steps = sum(len(v) for v in acc_lens.values())
        runs[tree] = (sum(map(sum, acc_lens.values())) + steps) / steps
        assert not corpus.requests.requests
        if tree:
            assert any(len(p) > 1 for _, _, p in seen)                 # real branches
    assert runs[True] >= runs[False]
    assert NgramspecCorpus(draft_token_num=d, spec=SHARED).tree_proposer is None


def test_sglang_prefetch_changes_no_tree():
    """`batch_get` reads ahead for all its known rows at once (`SuffixProposer.prefetch`, with
    each row's first new token): the trees and the requests' steps are those of a corpus that
    does not, and the read-ahead did read (rows with accepted tokens included)."""
    reqs = _trace("code-edit", 4)
    d = 9
    runs, reads = {}, []

    class Recording:
        def __init__(self, prop):
            self.prop = prop

        def prefetch(self, slots, tokens):
            reads.append(self.prop.prefetch(slots, tokens))

    for fetch in (True, False):
        corpus = NgramspecCorpus(draft_token_num=d, max_trie_depth=MAX_LEN,
                                 spec="--spec-type ngram-suffix")
        (prop,) = corpus._prefetchers
        corpus._prefetchers = [Recording(prop)] if fetch else []
        acc_lens, seen = _tree_run(corpus, reqs, d)
        runs[fetch] = (acc_lens, [(chain, row.tolist(), paths) for chain, row, paths in seen])
    assert runs[True] == runs[False]
    assert any(sum(v) for v in runs[True][0].values())          # some steps accepted tokens
    assert sum(reads) > 0


def test_sglang_tree_branch_beside_the_chain_continues_the_request():
    """The target takes a branch beside the chain: the request goes on (same loop), its
    context holds the branch; tokens that follow no path of the tree begin a new request."""
    d = 6
    corpus = NgramspecCorpus(draft_token_num=d, max_trie_depth=MAX_LEN,
                             spec="--spec-type ngram-suffix --spec-ngram-suffix-max-draft 1")
    text = [7, 1, 2, 3, 8, 1, 2, 4, 10, 1, 2, 3, 11, 1, 2, 5, 12, 1, 2, 4, 13, 1, 2, 3, 14, 1, 2]
    toks, masks = corpus.batch_get(["r"], [text], [len(text)])
    paths = tree_paths(toks, masks.reshape(d, d))
    req = corpus.requests.get("r")
    chain = req.loop.pending_draft.tolist()
    branch = next(p for p in paths if p[0] not in chain[:1])
    loop = req.loop
    grown = text + list(branch) + [99]
    corpus.batch_get(["r"], [grown], [len(grown)])
    assert corpus.requests.get("r").loop is loop
    assert loop.context.tolist() + [loop.sampled] == grown
    other = grown + [98, 97]                  # 98 is on no path
    corpus.batch_get(["r"], [other], [len(other)])
    assert corpus.requests.get("r").loop is not loop


@pytest.mark.parametrize("make, message", [
    (lambda: NgramspecProposer.from_limits(0, MAX_LEN, 2),
     "num_speculative_tokens = 0 is out of range: allowed 1 .. 1024"),
    (lambda: NgramspecProposer.from_limits(2**40, MAX_LEN, 2),
     r"num_speculative_tokens = 1099511627776 is out of range: allowed 1 \.\. 1024"),
    (lambda: NgramspecProposer.from_limits(K, MAX_LEN, 2, tensor_parallel_size=0),
     "tensor_parallel_size = 0 is out of range: allowed >= 1"),
    (lambda: NgramspecProposer.from_limits(K, 40.5, 2),
     "max_model_len must be an integer, got float"),
    (lambda: NgramspecCorpus(draft_token_num=0), "draft_token_num = 0 is out of range"),
    (lambda: NgramspecCorpus(draft_token_num=2**40),
     r"draft_token_num = 1099511627776 is out of range: allowed 1 \.\. 1025"),
    (lambda: NgramspecCorpus(draft_token_num=4098),
     r"draft_token_num = 4098 is out of range: allowed 1 \.\. 1025"),
    (lambda: NgramspecCorpus(draft_token_num=8, max_requests=2.5),
     "max_requests must be an integer, got float"),
])
def test_host_limits_are_checked_not_cut(make, message):
    """The host's limits go through the one validator: a float is refused, not truncated."""
    with pytest.raises((ValueError, TypeError), match=message):
        make()


# -- issue 34: every plug-in argument checked where it comes in ----------------------------------

@pytest.mark.parametrize("tokens, message", [
    ([1, 2.5, 3], r"batch_tokens\[0\]"),
    ([1, "7", 3], r"batch_tokens\[0\]"),
    ([1, 2**31, 3], r"batch_tokens\[0\]\[1\] = 2147483648 is not a token id"),
    ([1, -1, 3], r"batch_tokens\[0\]\[1\] = -1 is not a token id"),
    ([], r"batch_tokens\[0\] must hold at least one token id"),
])
def test_sglang_corpus_refuses_bad_tokens(tokens, message):
    """A float, a string, an id outside 0 .. 2**31-1: refused naming the list and position,
    never converted (numpy would truncate 2.5 and overflow on 2**31)."""
    corpus = NgramspecCorpus(draft_token_num=4, spec=PER_REQUEST)
    with pytest.raises((ValueError, TypeError), match=message):
        corpus.batch_get(["r"], [tokens], [max(len(tokens), 1)])
    assert not corpus.requests.requests


def test_sglang_corpus_names_the_bad_tail_among_many():
    """The step's tails are checked at once; a bad one is still named by its own row."""
    corpus = NgramspecCorpus(draft_token_num=4, spec=PER_REQUEST)
    with pytest.raises(ValueError, match=r"batch_tokens\[1\]\[2\] = -3 is not a token id"):
        corpus.batch_get(["a", "b", "c"], [[1, 2], [3, 4, -3], [5]], [2, 3, 1])
    with pytest.raises(ValueError, match=r"batch_tokens\[2\] must hold at least one token id"):
        corpus.batch_get(["a", "b", "c"], [[1, 2], [3, 4], []], [2, 2, 1])
    assert not corpus.requests.requests


def test_sglang_corpus_refuses_lists_of_other_lengths():
    corpus = NgramspecCorpus(draft_token_num=4, spec=PER_REQUEST)
    with pytest.raises(ValueError, match=r"batch_tokens: 1 token lists and 1 total_lens for 2 "
                                         r"req_ids: one each"):
        corpus.batch_get(["a", "b"], [[1, 2, 3]], [3])
    with pytest.raises(ValueError, match=r"total_lens\[0\] = 2 is out of range: allowed >= 3"):
        corpus.batch_get(["a"], [[1, 2, 3]], [2])


def test_vllm_proposer_refuses_more_rows_than_slots():
    """More rows than max_num_seqs would hand one slot to several requests: refused at once,
    naming the limit, with nothing changed."""
    prop = NgramspecProposer.from_limits(K, MAX_LEN, 2, spec=PER_REQUEST)
    tokens = np.tile(np.arange(1, 9, dtype=np.int32), (3, 4))
    with pytest.raises(ValueError, match=r"len\(sampled_token_ids\) = 3 is out of range: "
                                         r"allowed 0 \.\. 2 \(max_num_seqs"):
        prop.propose([[1], [1], [1]], np.array([20, 20, 20]), tokens)
    assert not prop.requests.requests
    assert len(prop.propose([[1], [1]], np.array([20, 20]), tokens[:2])) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(slot=-1), "slot = -1 is out of range: allowed >= 0"),
    (dict(slot=1.5), "slot must be an integer, got float"),
    (dict(n_ctx=-5), "n_ctx = -5 is out of range: allowed >= 0"),
])
def test_llama_cpp_draft_model_checks_its_arguments(kwargs, message):
    pytest.importorskip("llama_cpp")
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    with pytest.raises((ValueError, TypeError), match=message):
        NgramspecDraftModel("ngram-simple", **kwargs)


def test_llama_cpp_draft_model_refuses_wide_ids():
    """int64 ids are checked as given: 2**32 + 1 is refused, not wrapped to 1."""
    pytest.importorskip("llama_cpp")
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    import warnings
    model = NgramspecDraftModel("ngram-simple", engine=SpecEngine("ngram-simple", 2), slot=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # the AMX note: CPU-dependent
        with pytest.raises(ValueError, match=r"input_ids\[2\] = 4294967297 is not a token id"):
            model(np.array([1, 2, 2**32 + 1, 4], dtype=np.int64))
        ids = np.array(list(range(1, 40)) * 4 + [1, 2], dtype=np.int64)
        draft = model(ids)
    want = SlotLoop(SpecEngine("ngram-simple", 1), 0, ids[:-1], int(ids[-1])).propose()
    assert draft.tolist() == want.tolist() and len(want) and model.n_requests == 1
    with pytest.raises(ValueError, match=r"slot = 2 is out of range: allowed 0 \.\. 1"):
        NgramspecDraftModel(engine=SpecEngine("ngram-simple", 2), slot=2)


@pytest.mark.parametrize("args, plain", [
    (None, True), ({"speculative": {"n_max": 7}}, True), ({"speculative": {"n_max": 3}}, False),
    ({"speculative": {"enabled": False}}, False), ({"prediction": [1, 2, 3]}, False)])
def test_a_request_is_plain_without_its_own_engine_or_bound(args, plain):
    """`Request.plain` (what SGLang's trees build on): the host's engine and n_max, a request's
    own n_max at or above the host's included; a lower bound, speculation off or a prediction
    is the request's own."""
    from ngramspec.integrations.request_args import checked_args, control_of
    corpus = NgramspecCorpus(draft_token_num=8, spec="--spec-type ngram-suffix")
    control = None if args is None else control_of(checked_args(args), corpus.chain)
    req = corpus.requests.begin("r", np.arange(40, dtype=np.int32) % 9, 3, control)
    assert req.plain is plain


@pytest.mark.parametrize("own, host, n_ctx, budget, n_draft", [
    (None, 6, 0, 6, 6), (3, 6, 0, 3, 3), (9, 6, 0, 6, 6), (4, None, 0, 4, 4),
    (None, None, 0, None, 64), (5, 6, 64, 2, 2)])
def test_a_requests_budget_is_its_own_n_max_the_hosts_and_the_room(own, host, n_ctx, budget,
                                                                   n_draft):
    """The request table's one budget per step (`draft_budget`): the smallest of the host's
    n_max, the request's own ``speculative.n_max`` and the loop's room (n_ctx - L - 2)."""
    from ngramspec.integrations.request_args import checked_args, control_of
    from ngramspec.integrations.requests import RequestLoops
    engine = SpecEngine("ngram-mod", 1)       # drafts 64 tokens of a repeated cycle
    table = RequestLoops(engine, 1, n_ctx=n_ctx, n_max=host)
    args = None if own is None else {"speculative": {"n_max": own}}
    control = None if args is None else control_of(checked_args(args), engine.types)
    prompt = np.arange(60, dtype=np.int32) % 9                  # L = 60: room 64 - 62 = 2
    req = table.begin("r", prompt, 6, control)
    draft = table.advance(req, [])
    assert len(draft) == n_draft and req.loop.n_draft_max == budget   # None: unbounded


def test_the_request_tables_policy_sees_every_step():
    """The request table drives each request through the host's policy (issue 39: driver ->
    policy -> loop): every draft passes its ``after_draft``, every verification its
    ``observe``; a tree branch's steps too (as steps without a draft)."""
    from ngramspec.cost import PROFILES
    from ngramspec.integrations.requests import RequestLoops
    from ngramspec.policy import AutoPolicy
    policy = AutoPolicy(PROFILES["gpu"], proposer_time=False)
    table = RequestLoops(SpecEngine("ngram-mod", 1), 1, n_max=8, policy=policy)
    req = table.begin("r", np.arange(60, dtype=np.int32) % 9, 6)
    draft = table.advance(req, [])
    for _ in range(5):               # the cycle goes on: every draft accepted whole
        nxt = (int(draft[-1]) + 1) % 9
        draft = table.advance(req, np.append(draft, nxt).astype(np.int32))
    # a branch beside the chain: one token accepted, then two of the branch (no draft each)
    req.tree = (np.array([draft[0], 0, 0], np.int32), np.array([-1, 0, 1]))
    last = table.advance(req, np.array([draft[0], 0, 0, 4], dtype=np.int32))
    s = policy.summary()
    # drafts: 1 + 5 + the last (if any) after 2 steps without one; verified: 5 + the branch's
    assert (s["steps"], s["drafts"], s["verified"]) == (9, 6 + bool(len(last)), 6)
    assert req.loop.steps[-3:] == [[len(draft), 1, 1], [0, 0, 0], [0, 0, 0]]


def test_the_request_tables_long_request_keeps_bounded_records():
    """A host's request may generate for hours: its loop keeps its last `KEEP_STEPS` step
    records, not one per step, and counts all of them. A `FixedPolicy` (not only `FIXED`)
    drives the loop's own calls, and its drafts and counts are those of the base policy's
    no-op moments (the same steps through `DraftPolicy.draft` / ``verify``)."""
    from ngramspec.integrations.requests import KEEP_STEPS, RequestLoops
    from ngramspec.policy import DraftPolicy, FixedPolicy
    stream = (np.arange(1200) * 7 % 23).astype(np.int32)      # repetitive: drafts accepted
    runs = []
    for policy in (None, FixedPolicy(), DraftPolicy()):
        table = RequestLoops(SpecEngine("ngram-suffix", 1), 1, n_max=8, policy=policy)
        req = table.begin("r", stream[:100], int(stream[100]))
        if not type(policy) is DraftPolicy:
            assert (req.propose, req.verify) == (req.loop.propose, req.loop.verify)
        drafts = [table.advance(req, []).tolist()]
        n = 101
        while n < 1100:
            draft = drafts[-1]
            k = 0
            while k < len(draft) and draft[k] == stream[n + k]:
                k += 1
            k -= k > 0 and n % 5 == 0           # now and then the target's token is its own
            drafts.append(table.advance(req, stream[n:n + k + 1]).tolist())
            n += k + 1
            assert len(req.loop.steps) < 2 * KEEP_STEPS
        runs.append((drafts, req.loop.counts, req.loop.n_steps, req.loop.steps,
                     req.loop.context.tolist()))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][2] == len(runs[0][0]) - 1 > 2 * KEEP_STEPS
    assert runs[0][1].n_acc_tokens > 0
