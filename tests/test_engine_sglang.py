"""The SGLang contract, inside sglang 0.5.23 (.ci/engines runs it in .venv-sglang; the main
suite skips it): the plug-in loaded by SGLang's own ``load_plugins``, and `NgramspecCorpus`
driven through the NGRAM worker's own corpus-calling methods (``_prepare_draft_tokens``,
``_update_ngram_corpus``) next to SGLang's ``NgramCorpus`` on the same requests. Its C++ corpus
compiles with g++ on first use (cached afterwards). ngram-suffix's draft trees are verified by
SGLang's own greedy tree verification: the links its worker derives from a mask
(``_derive_tree_links``) and its Triton verify kernel, run by Triton's interpreter on the CPU."""
import importlib.metadata
import os
import re

import numpy as np
import pytest

# before Triton is imported: its kernels run in the interpreter (no GPU here)
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("sglang")

from conftest import TRACES  # noqa: E402
from engine_harness import (PER_REQUEST, SUBSET_ARGS, edited,  # noqa: E402
                            greedy_tree_verify, subset_reference,
                            predicted_reference, refound_after, run_ngram_worker,
                            stub_cuda_only_kernels, synthetic_trace, tokens_per_step,
                            tree_paths, word_tokenizer)

from ngramspec.integrations import sglang as ours  # noqa: E402
from ngramspec.integrations.requests import engine_from_env  # noqa: E402
from ngramspec.loop import run_recorded  # noqa: E402
from ngramspec.traces import read_requests  # noqa: E402

stub_cuda_only_kernels()
D = 9
MAX_LEN = 1 << 14
# the keywords SGLang's NGRAMWorker builds its corpus with (ngram_worker.py)
WORKER_KWARGS = dict(min_bfs_breadth=1, max_bfs_breadth=8, match_type="BFS", capacity=1000000,
                     max_trie_depth=18, draft_token_num=D, external_sam_budget=0,
                     external_corpus_max_tokens=10000000)


@pytest.fixture(scope="module")
def registered():
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    return SpeculativeAlgorithm.from_string(ours.ALGORITHM)


@pytest.fixture(scope="module", params=["code-edit", "agentic"])
def trace(request):
    return read_requests(str(TRACES / f"{request.param}.jsonl.gz"), limit=4)


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert "ngramspec.integrations.sglang:register" in {ep.value for ep in eps}


def test_load_plugins_registers_ngramspec(registered):
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    assert registered.name == ours.ALGORITHM
    assert registered.is_ngram() and not registered.has_draft_kv()
    assert registered.supports_overlap
    worker = registered.factory(None)
    assert issubclass(worker, NGRAMWorker) and worker is ours.worker_class()
    ours.register()                                  # loaded twice: registered once


def test_built_as_sglangs_corpus_is_built(monkeypatch):
    monkeypatch.setenv("NGRAMSPEC_SPEC", "--spec-type ngram-suffix")
    corpus = ours.NgramspecCorpus(**WORKER_KWARGS)
    assert corpus.draft_token_num == D
    assert [s["type"] for s in corpus.engine.stats()] == ["ngram-suffix"]


def test_drafts_through_the_ngram_worker_are_spec_engines(registered, trace):
    """Through the NGRAM worker's own methods, each request's chain is SpecEngine's draft for
    that request alone, and every request's state is erased when it leaves."""
    corpus = ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN),
                                  spec=PER_REQUEST)
    done = run_ngram_worker(ours.worker_class(), corpus, trace, D, MAX_LEN)
    for r in done:
        ref = run_recorded(engine_from_env(1, PER_REQUEST)[0], 0, r.trace.prompt,
                           r.trace.output, record_drafts=True, n_max=D - 1)
        want = [{tuple(dr)} if dr and dr != [0] else set() for dr in ref.drafts]
        assert r.paths[:len(want)] == want, r.rid
    assert not corpus.requests.requests


def test_next_to_sglangs_own_corpus(registered, trace):
    """SGLang's NgramCorpus through the same harness (its trees: sets of paths) drafts and is
    verified too: the side-by-side bench's SGLang row."""
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    done = run_ngram_worker(NGRAMWorker, NgramCorpus(**WORKER_KWARGS), trace, D, 18)
    assert sum(s[1] for r in done for s in r.steps) > 0
    assert any(len(p) > 1 for r in done for p in r.paths)     # real trees, several branches


# -- ngram-suffix's draft trees ----------------------------------------------------------------

SUFFIX = "--spec-type ngram-suffix"


def sglang_verify(req, row, mask, rest):
    """SGLang's greedy verification of one request's tree: the links the NGRAM worker derives
    from the mask, then ``verify_tree_greedy_triton`` with the target's token after each node's
    path (the recorded continuation where the path agrees with it, else -1, which no draft
    token equals). Asserts the mask is a tree SGLang reads as written: row i holds i and
    exactly the ancestors of i along the parents it derives (the last ancestor before i)."""
    import torch
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
    from sglang.srt.speculative.ngram_worker import _derive_tree_links
    d = len(row)
    mask = np.asarray(mask, dtype=bool)
    parent = [-1] + [max(j for j in range(i) if mask[i, j]) for i in range(1, d)]
    path = [[]]
    for i in range(1, d):
        assert mask[i, i] and mask[i, 0]
        anc = {i}
        j = parent[i]
        while j >= 0:
            anc.add(j)
            j = parent[j]
        assert set(np.flatnonzero(mask[i]).tolist()) == anc, f"row {i} is not its ancestors"
        path.append(path[parent[i]] + [int(row[i])])
    target = [rest[len(p)] if len(p) < len(rest) and p == rest[:len(p)] else -1 for p in path]
    next_token, next_sibling = _derive_tree_links(mask.reshape(-1), 1, d)
    accept_index = torch.full((1, d), -1, dtype=torch.int64)
    accept_num = torch.zeros(1, dtype=torch.int64)
    verify_tree_greedy_triton(torch.full((d,), -1, dtype=torch.int64), accept_index, accept_num,
                              torch.from_numpy(np.asarray(row, dtype=np.int64)).reshape(1, d),
                              torch.arange(d).reshape(1, d), next_token, next_sibling,
                              torch.tensor([target], dtype=torch.int64))
    n = int(accept_num[0])
    return [int(row[i]) for i in accept_index[0, 1:n + 1].tolist()]


def test_suffix_trees_verified_by_sglang(registered, trace, monkeypatch):
    """ngram-suffix through the NGRAM worker with trees (best first: the chain is not forced
    first): every mask is one SGLang reads as written, SGLang's verification accepts what the
    greedy model of the harness accepts, trees branch, and requests are erased as they
    leave."""
    monkeypatch.setenv("NGRAMSPEC_SPEC", SUFFIX)
    corpus = ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN))
    assert corpus.tree_proposer is not None
    n_branchy = 0

    def verify(req, row, mask, rest):
        nonlocal n_branchy
        acc = sglang_verify(req, row, mask, rest)
        assert acc == greedy_tree_verify(req, row, mask, rest)
        n_branchy += len(tree_paths(row, mask)) > 1
        return acc

    run_ngram_worker(ours.worker_class(), corpus, trace, D, MAX_LEN, verify=verify)
    assert n_branchy > 0 and not corpus.requests.requests


def test_suffix_trees_accept_at_least_the_chains(registered, trace):
    """On the same requests through the NGRAM worker, ngram-suffix's trees verify at least as
    many tokens per step as its chains (SGLang pays for D tokens either way); SGLang's own
    NgramCorpus for reference, all verified by SGLang's kernel."""
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    from sglang.srt.speculative.ngram_worker import NGRAMWorker
    rates = {}
    for name, corpus, depth in (
            ("tree", ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN),
                                          spec=SUFFIX), MAX_LEN),
            ("chain", ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN),
                                           spec=SUFFIX, tree=False), MAX_LEN),
            ("sglang", NgramCorpus(**WORKER_KWARGS), 18)):
        worker = NGRAMWorker if name == "sglang" else ours.worker_class()
        done = run_ngram_worker(worker, corpus, trace, D, depth, verify=sglang_verify)
        rates[name] = tokens_per_step(done)
    assert rates["tree"] >= rates["chain"] > 1.0, rates
    assert rates["sglang"] > 1.0, rates


# -- overlap scheduling and SGLang's scale -----------------------------------------------------

def _check_paths_are_spec_engines(done, n_max):
    for r in done:
        ref = run_recorded(engine_from_env(1, PER_REQUEST)[0], 0, r.trace.prompt,
                           r.trace.output, record_drafts=True, n_max=n_max)
        want = [{tuple(dr)} if dr and dr != [0] else set() for dr in ref.drafts]
        assert r.paths[:len(want)] == want, r.rid


def test_overlap_scheduling_drafts_what_sync_drafts(registered, trace):
    """Under overlap scheduling the last round's tokens come from ``spec_info`` (not yet in
    ``output_ids``, a new request's first token too): the same drafts as sync scheduling,
    SpecEngine's for each request alone."""
    runs = []
    for overlap in (False, True):
        corpus = ours.NgramspecCorpus(**WORKER_KWARGS, spec=PER_REQUEST)
        done = run_ngram_worker(ours.worker_class(), corpus, trace, D, 18, batch_size=3,
                                overlap=overlap)
        _check_paths_are_spec_engines(done, D - 1)
        runs.append({r.rid: r.paths for r in done})
        assert not corpus.requests.requests
    assert runs[0] == runs[1]


def test_worker_copies_only_new_tokens(registered, trace):
    """After a request's first sight the worker hands the corpus only its new tokens (the
    accepted ones and the root), never its whole sequence: O(new tokens) per step."""
    corpus = ours.NgramspecCorpus(**WORKER_KWARGS, spec=PER_REQUEST)
    seen = []
    real = corpus.batch_get

    def batch_get(req_ids, batch_tokens, total_lens, full_tokens=None, args_of=None):
        seen.append([(len(t), n) for t, n in zip(batch_tokens, total_lens)])
        return real(req_ids, batch_tokens, total_lens, full_tokens, args_of)
    corpus.batch_get = batch_get
    run_ngram_worker(ours.worker_class(), corpus, trace, D, 18, batch_size=3, overlap=True)
    firsts = sum(1 for step in seen for g, n in step if g == n)
    assert firsts == len(trace)                     # the whole sequence once per request
    assert all(g <= D for step in seen for g, n in step if g != n)


def test_a_request_that_lost_track_gets_its_whole_sequence(registered):
    """A request whose tokens stop continuing what the corpus knows (SGLang re-ran it) begins
    anew on its whole sequence (`full_tokens`), not on the short tail."""
    from array import array
    from types import SimpleNamespace

    from engine_harness import _Batch, ngram_worker
    corpus = ours.NgramspecCorpus(**WORKER_KWARGS, spec=PER_REQUEST)
    worker = ngram_worker(ours.worker_class(), corpus, D, 18)
    prompt = [5, 6, 7, 8] * 50
    req = SimpleNamespace(rid="r", origin_input_ids_unpadded=prompt, output_ids=array("q", [5]))
    worker._prepare_draft_tokens(_Batch([req]))
    req.output_ids.extend([99, 98])              # continues no draft of the request's
    worker._prepare_draft_tokens(_Batch([req]))
    loop = corpus.requests.get("r").loop
    assert loop.context.tolist() + [loop.sampled] == prompt + [5, 99, 98]


# -- Predicted Outputs and per-request control through SGLang's request path (issue 37) -------

def sglang_params(custom_params, tokenizer=None, vocab_size=50000):
    """SGLang's ``SamplingParams`` of a request as its tokenizer manager builds and checks it
    (``normalize`` with the tokenizer, ``verify`` with the vocabulary), the plug-in loaded."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    params = SamplingParams(max_new_tokens=64, custom_params=custom_params)
    params.normalize(tokenizer)
    params.verify(vocab_size)
    return params


def test_custom_params_are_checked_and_a_text_prediction_tokenized(registered):
    tok = word_tokenizer(["def", "f", "(", ")", ":", "return", "1"])
    params = sglang_params({"prediction": {"type": "content", "content": "def f ( ) : return 1"},
                            "speculative": {"n_max": 4}}, tok)
    assert params.custom_params["prediction"] == [1, 2, 3, 4, 5, 6, 7]
    assert params.custom_params["speculative"] == {"n_max": 4}
    assert sglang_params(None, tok).custom_params is None       # a plain request: untouched


@pytest.mark.parametrize("custom, message", [
    ({"speculative": {"n_max": 2000}}, "speculative.n_max = 2000 is out of range: allowed "
                                       "0 .. 1024"),
    ({"speculative": {"enabled": 1}}, "speculative.enabled: "),
    ({"speculative.n_min": 3, "speculative": {"n_min": 2}}, "speculative.n_min: 3 contradicts"),
    ({"prediction": [1, 60000]}, "prediction: token ids must lie in 0 .. 49999"),
    ({"prediction": "def"}, "prediction: text needs the model's tokenizer"),
])
def test_bad_custom_params_are_refused_naming_the_field(registered, custom, message):
    """Refused by the tokenizer manager's parameter check (a ValueError / TypeError: SGLang's
    400), before the request reaches the scheduler."""
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        sglang_params(custom, None)


def test_a_prediction_drafts_first_and_speculation_off_drafts_padding(registered):
    """Three copies of each code-edit request through the NGRAM worker, their
    ``custom_params`` on SGLang's SamplingParams: the predicted one's trees are the chain
    ``serve`` drafts (prediction first, found again after an insertion), the one with
    speculation off gets trees of padding only, the plain one ngram-suffix's trees."""
    from ngramspec.traces import Request as TraceRequest
    for t in read_requests(str(TRACES / "code-edit.jsonl.gz"), limit=3):
        pred, at = edited(t)
        kinds = {"predicted": {"prediction": pred.tolist()},
                 "off": {"speculative": {"enabled": False}}, "plain": None}
        reqs = [TraceRequest(f"{kind}-{t.id}", t.prompt, t.output, {}) for kind in kinds]
        params = {r.id: sglang_params(kinds[r.id.split("-")[0]]) for r in reqs}
        # per-request proposers: the drafts are exactly serve's; ngram-suffix: trees beside
        for flags in (PER_REQUEST, SUFFIX):
            corpus = ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN),
                                          spec=flags)
            done = {r.rid.split("-")[0]: r for r in run_ngram_worker(
                ours.worker_class(), corpus, reqs, D, MAX_LEN, batch_size=3, params=params)}
            predicted = done["predicted"]
            assert predicted.paths[0] == {tuple(pred[1:1 + 8].tolist())}
            assert all(len(p) <= 1 for p in predicted.paths)            # chains
            if flags == PER_REQUEST:
                ref = predicted_reference(pred, flags, t.prompt, t.output, D - 1)
                assert predicted.paths == [{tuple(dr)} if dr else set()
                                           for dr in ref.drafts][:len(predicted.paths)]
            else:
                assert any(len(p) > 1 for p in done["plain"].paths)    # ngram-suffix's trees
            pos = np.cumsum([1] + [s[1] + 1 for s in predicted.steps])[:-1]
            drafts = [next(iter(p)) if p else () for p in predicted.paths]
            assert refound_after(zip(pos, drafts), pred, at)
            assert all(p == set() for p in done["off"].paths)       # padding only
            assert any(done["plain"].paths)
            tps = [tokens_per_step([done[k]]) for k in ("predicted", "plain", "off")]
            assert tps[0] > tps[1] > tps[2] == 1.0, tps


def test_at_scale_drafts_are_spec_engines_and_cost_less_than_sglangs_own(registered):
    """96 requests of 16-18k-token prompts, up to 64 in flight, joining at random (0-15 a step)
    and finishing at random (24-96 output tokens), overlap scheduling: every draft is
    SpecEngine's for its request alone, and the median step where no request joins, through the
    worker's two corpus-calling methods, costs at most SGLang's own NgramCorpus's in the same
    harness."""
    import statistics

    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    long_trace = synthetic_trace(96, 16384, seed=36)
    times = {}
    for name, corpus, worker_cls in (
            ("ours", ours.NgramspecCorpus(**WORKER_KWARGS, spec=PER_REQUEST),
             ours.worker_class()),
            ("sglang", NgramCorpus(**WORKER_KWARGS), None)):
        from sglang.srt.speculative.ngram_worker import NGRAMWorker
        rng = np.random.default_rng(36)
        steps = []
        done = run_ngram_worker(worker_cls or NGRAMWorker, corpus, long_trace, D, 18,
                                batch_size=64, overlap=True,
                                admit=lambda n: int(rng.integers(0, 16)), times=steps)
        # steps where no request joined: ours indexes a new request's prompt once (first
        # sight), SGLang's corpus never sees the prompt
        steady = [t for t, _, joined in steps if not joined]
        assert len(steady) >= 20 and max(bs for _, bs, _ in steps) == 64
        times[name] = statistics.median(steady)
        if name == "ours":
            assert max(len(r.trace.prompt) for r in done) >= 16384
            _check_paths_are_spec_engines(done, D - 1)
            assert not corpus.requests.requests
    print(f"median step: ngramspec {1e3 * times['ours']:.3f} ms, SGLang's NgramCorpus "
          f"{1e3 * times['sglang']:.3f} ms")
    assert times["ours"] <= 1.0 * times["sglang"], times


def test_a_requests_type_subset_and_bounds(registered):
    """``custom_params: {"speculative": {type, n_max, n_min}}`` on SGLang's SamplingParams:
    the request's tree is the chain of its subset alone (at most n_max tokens, none under
    n_min), its neighbour's ngram-suffix trees go on beside it."""
    from ngramspec.traces import Request as TraceRequest
    t = read_requests(str(TRACES / "code-edit.jsonl.gz"), limit=1)[0]
    reqs = [TraceRequest(rid, t.prompt, t.output, {}) for rid in ("subset", "whole")]
    corpus = ours.NgramspecCorpus(**dict(WORKER_KWARGS, max_trie_depth=MAX_LEN),
                                  spec=PER_REQUEST)
    done = {r.rid: r for r in run_ngram_worker(
        ours.worker_class(), corpus, reqs, D, MAX_LEN, batch_size=2,
        params={"subset": sglang_params(SUBSET_ARGS)})}
    want = [{tuple(d)} if d else set() for d in subset_reference(t)]
    assert done["subset"].paths == want[:len(done["subset"].paths)]
    assert any(done["subset"].paths)
    assert max(len(p) for paths in done["whole"].paths for p in paths) > 3
