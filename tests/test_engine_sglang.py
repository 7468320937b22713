"""The SGLang contract, inside sglang 0.5.23 (.ci/engines runs it in .venv-sglang; the main
suite skips it): the plug-in loaded by SGLang's own ``load_plugins``, and `NgramspecCorpus`
driven through the NGRAM worker's own corpus-calling methods (``_prepare_draft_tokens``,
``_update_ngram_corpus``) next to SGLang's ``NgramCorpus`` on the same requests. Its C++ corpus
compiles with g++ on first use (cached afterwards)."""
import importlib.metadata

import pytest

pytest.importorskip("sglang")

from conftest import TRACES  # noqa: E402
from engine_harness import PER_REQUEST, run_ngram_worker, stub_cuda_only_kernels  # noqa: E402

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
    done = run_ngram_worker(ours.worker_class(), NgramCorpus(**WORKER_KWARGS), trace, D, 18)
    assert sum(s[1] for r in done for s in r.steps) > 0
    assert any(len(p) > 1 for r in done for p in r.paths)     # real trees, several branches
