"""Every proposer is usable alone the same way: begin / draft / accept, as the engine uses it.

A proposer driven through its own Python methods must draft exactly what a one-type `SpecEngine`
drafts on the same steps (the engine adds only checks and statistics), and must refuse what the
engine refuses: a bad slot, an accept without a pending draft, an accepted count beyond it.
"""
import numpy as np
import pytest

from conftest import TRACES
from ngramspec import ModPool, SpecEngine
from ngramspec.registry import build_proposers
from ngramspec.traces import read_requests

TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
         "ngram-suffix")


@pytest.fixture(scope="module")
def requests():
    return read_requests(str(TRACES / "code-edit.jsonl.gz"), 3)


def _steps(proposer_or_engine, req, slot=0):
    """Greedy verification against the recorded output; every draft, in order."""
    prompt = np.ascontiguousarray(req.prompt, dtype=np.int32)
    out = np.ascontiguousarray(req.output, dtype=np.int32)
    proposer_or_engine.begin(slot, prompt)
    seq = np.concatenate([prompt, out]).astype(np.int32)
    drafts, pos = [], len(prompt)
    while pos < len(seq) - 1:
        draft = proposer_or_engine.draft(slot, seq[:pos], int(seq[pos]))
        drafts.append(draft.tolist())
        truth = seq[pos + 1:pos + 1 + len(draft)]
        n = 0
        while n < len(truth) and draft[n] == truth[n]:
            n += 1
        if len(draft):
            proposer_or_engine.accept(slot, n)
        pos += 1 + n
    return drafts


@pytest.mark.parametrize("spec_type", TYPES)
def test_a_proposer_alone_drafts_what_its_engine_drafts(spec_type, requests):
    (proposer,) = build_proposers(spec_type, 2, ModPool() if spec_type == "ngram-mod" else None,
                                  {})
    engine = SpecEngine(spec_type, n_slots=2)
    drafted = 0
    for req in requests:
        alone, chained = _steps(proposer, req, slot=1), _steps(engine, req, slot=1)
        assert alone == chained
        drafted += sum(map(len, alone))
    assert drafted > 0          # the comparison covered real drafts


@pytest.mark.parametrize("spec_type", TYPES)
def test_a_proposer_alone_refuses_what_the_engine_refuses(spec_type, requests):
    (p,) = build_proposers(spec_type, 1, ModPool() if spec_type == "ngram-mod" else None, {})
    prompt = np.ascontiguousarray(requests[0].prompt, dtype=np.int32)
    with pytest.raises(IndexError, match=r"slot = 1 is out of range: allowed 0 \.\. 0"):
        p.begin(1, prompt)
    with pytest.raises(TypeError, match="slot must be an integer"):
        p.draft("0", prompt, 1)
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        p.accept(0, 0)
    with pytest.raises(ValueError, match="is not a token id"):
        p.begin(0, [1, -5])
    # A repetitive context every type drafts from, then one accept within the draft's length.
    ctx = np.tile(np.arange(1, 40, dtype=np.int32), 8)
    p.begin(0, ctx[:64])
    draft = p.draft(0, ctx[:-1], int(ctx[-1]))
    assert len(draft) > 0, spec_type
    with pytest.raises(ValueError, match="n_accepted"):
        p.accept(0, len(draft) + 1)
    p.accept(0, len(draft))
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        p.accept(0, 0)          # once per draft
