"""SGLang's step layout (`ngramspec._tree.lay_out_trees`, through `TreeBatch`) against the numpy
layout it replaced, on random trees and chains: the same tokens and ancestor masks bit for bit."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngramspec._tree import lay_out_trees
from ngramspec.integrations.sglang import TreeBatch, tree_buffers


def numpy_layout(rows, d):
    """The layout as TreeBatch.finish computed it before the kernel: vectorized scatters of
    tokens and parent slots, then ``d`` passes of "a node's row is its parent's plus itself"."""
    bs = len(rows)
    tokens = np.zeros((bs, d), dtype=np.int64)
    parents = np.zeros((bs, d), dtype=np.intp)
    for i, (root, toks, par) in enumerate(rows):
        tokens[i, 0] = root
        n = len(toks)
        tokens[i, 1:n + 1] = toks
        parents[i, 1:n + 1] = (np.arange(-1, n - 1) if par is None else np.asarray(par)) + 1
    mask = np.zeros((bs, d, d), dtype=bool)
    mask[:, :, 0] = True
    idx = np.arange(d)
    mask[:, idx, idx] = True
    batch = np.arange(bs)
    for j in range(2, d):
        mask[:, j, 1:j] |= mask[batch, parents[:, j], 1:j]
    return tokens.reshape(-1), mask.reshape(-1)


@st.composite
def step_rows(draw):
    """A step: ``d`` and per row a root, its tokens, and its parents (None: a chain)."""
    d = draw(st.integers(1, 12))
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        n = draw(st.integers(0, d - 1))
        toks = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
        par = None if draw(st.booleans()) else [draw(st.integers(-1, i - 1)) for i in range(n)]
        rows.append((draw(st.integers(0, 2**31 - 1)), toks, par))
    return d, rows


@settings(max_examples=300, deadline=None)
@given(step_rows(), st.booleans())
def test_kernel_layout_is_the_numpy_layout(step, slot_rows):
    """Rows copied in (`add`) or placed from shared buffers rows apart (`place`, as the corpus
    places a slot's tree), chains and trees, empty and full: the numpy layout's bytes."""
    d, rows = step
    want_tok, want_mask = numpy_layout(rows, d)
    if slot_rows:                    # the corpus's way: trees in other rows of shared buffers
        tok, par = tree_buffers(2 * len(rows) + 1, d)
        batch = TreeBatch(len(rows), d, [root for root, _, _ in rows], buffers=(tok, par))
        for i, (_, toks, p) in enumerate(rows):
            row = 2 * len(rows) - 2 * i
            tok[row, :len(toks)] = toks
            if p is not None:
                par[row, :len(toks)] = p
            batch.place(i, row, len(toks), p is None)
    else:
        batch = TreeBatch(len(rows), d)
        for i, (root, toks, p) in enumerate(rows):
            batch.set(i, root, np.array(toks, dtype=np.int64), None if p is None else np.array(p))
    got_tok, got_mask = batch.finish()
    assert got_tok.dtype == np.int64 and got_mask.dtype == np.bool_
    assert got_tok.tobytes() == want_tok.tobytes()
    assert got_mask.tobytes() == want_mask.tobytes()


def _args(bs=1, d=4, n=2):
    tok, par = tree_buffers(bs, d)
    return [np.zeros(bs, dtype=np.int64), np.zeros(bs, dtype=np.intp),
            np.full(bs, n, dtype=np.int32), np.zeros(bs, dtype=np.uint8), tok, par, d]


def test_bad_layouts_are_refused_by_name():
    args = _args()
    args[2][0] = 4
    with pytest.raises(ValueError, match=r"lens\[0\] = 4 is out of range: allowed 0 \.\. 3"):
        lay_out_trees(*args)
    args = _args()
    args[1][0] = 1
    with pytest.raises(ValueError, match=r"rows\[0\] = 1 is out of range: allowed 0 \.\. 0"):
        lay_out_trees(*args)
    args = _args()
    args[5][0, 1] = 1                # node 1 under itself
    with pytest.raises(ValueError, match="row 0: each node's parent must come before it"):
        lay_out_trees(*args)
    args = _args()
    args[5][0, 1] = -2
    with pytest.raises(ValueError, match="row 0: each node's parent must come before it"):
        lay_out_trees(*args)
    args = _args(bs=2)
    args[2] = args[2][:1]
    with pytest.raises(ValueError, match="roots, rows, lens and chain hold 2, 2, 1 and 2 rows"):
        lay_out_trees(*args)
    args = _args(n=0)
    args[1][0] = -1                  # an empty row reads no buffer row
    tok, mask = lay_out_trees(*args)
    assert tok.tolist() == [0, 0, 0, 0] and mask.reshape(4, 4).sum() == 7
