"""Validation of token arrays and token ids at every public entry (issue 4, item 1; issue 20,
point 10): wrong dtypes, shapes and out-of-range ids are refused naming the offending position,
bools and byte strings are not token ids, and every accepted form of a token array drafts exactly
what a contiguous int32 array drafts.
"""
from __future__ import annotations

import array
import re

import numpy as np
import pytest

from ngramspec import ModPool, PyProposer, SpecEngine
from ngramspec._proposer import TOKEN_MAX
from ngramspec.traces import read_requests

from conftest import TRACES
from validation_common import CHAIN, NGRAM_TYPES, engine_with_pending_draft, repetitive


# ---------------------------------------------------------------------------------------------
# token arrays and token ids
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.array([1.0, 2.0]), [1.0, 2.0], np.array([1, 2], np.float32),
                                 [1, 2.5], np.array([1 + 2j]), np.array([True, False]),
                                 np.array(["1", "2"])],
                         ids=["float64", "float-list", "float32", "mixed", "complex", "bool",
                              "str"])
def test_non_integer_token_arrays(bad):
    eng = SpecEngine(CHAIN)
    with pytest.raises(TypeError, match=r"prompt must hold integer token ids, got dtype"):
        eng.begin(0, bad)
    with pytest.raises(TypeError, match=r"context must hold integer token ids, got dtype"):
        eng.draft(0, bad, 1)


@pytest.mark.parametrize("bad", [np.zeros((2, 3), np.int32), [[1, 2], [3, 4]],
                                 np.zeros((1, 5), np.int64), np.int32(7), 7],
                         ids=["2d-int32", "2d-list", "row-vector", "0d-array", "scalar"])
def test_non_1d_token_arrays(bad):
    eng = SpecEngine(CHAIN)
    shape = np.shape(bad)
    with pytest.raises(ValueError, match=re.escape(f"prompt must be a 1-D sequence of token ids, "
                                                   f"got shape {shape}")):
        eng.begin(0, bad)
    with pytest.raises(ValueError, match=re.escape(f"context must be a 1-D sequence of token ids, "
                                                   f"got shape {shape}")):
        eng.draft(0, bad, 1)


@pytest.mark.parametrize("bad", [[[1], [2, 3]], object()], ids=["ragged", "object"])
def test_unconvertible_token_arrays(bad):
    eng = SpecEngine(CHAIN)
    with pytest.raises((TypeError, ValueError), match="prompt"):
        eng.begin(0, bad)


BAD_IDS = [
    ("list", -1), ("list", -2**31), ("list", 2**31), ("list", 2**32), ("list", 2**63),
    ("list", 2**64), ("list", 10**30),
    ("int32", -1), ("int32", -2**31),
    ("int64", -1), ("int64", -2**63), ("int64", 2**31), ("int64", 2**32 + 5), ("int64", 2**63 - 1),
    ("uint32", 2**31), ("uint64", 2**63), ("uint64", 2**64 - 1), ("int8", -1),
]


@pytest.mark.parametrize("form, bad", BAD_IDS, ids=[f"{f}:{b}" for f, b in BAD_IDS])
@pytest.mark.parametrize("where", ["prompt", "context"])
def test_out_of_range_token_ids(form, bad, where):
    """-1 is the pool's EMPTY sentinel and ids are int32: both ends are rejected, at the
    position they occur, whatever the container (the slot is left untouched)."""
    eng = SpecEngine(CHAIN)
    good = [5, 6, 7, 8, 9]
    tokens = good[:3] + [bad] + good[3:]
    arg = tokens if form == "list" else np.array(tokens, dtype=form)
    msg = rf"{where}\[3\] = {bad} is not a token id: ids must be in 0 \.\. {TOKEN_MAX}"
    with pytest.raises(ValueError, match=msg):
        if where == "prompt":
            eng.begin(0, arg)
        else:
            eng.draft(0, arg, 1)


def test_out_of_range_id_is_reported_at_its_first_position():
    eng = SpecEngine("ngram-mod")
    with pytest.raises(ValueError, match=r"prompt\[2\] = -1 "):
        eng.begin(0, np.array([1, 2, -1, 4, -1], np.int32))


@pytest.mark.parametrize("first", ["int32", "list"])
def test_every_context_is_validated_whole(first):
    """A bad id early in a context is rejected even after the slot drafted on a longer valid
    context: the engine may skip re-checking only tokens it has already seen in the *same*
    buffer, never a prefix of a different array."""
    eng = SpecEngine(CHAIN, **FORM_PARAMS)
    good = repetitive(300)
    eng.begin(0, good[:50])
    eng.draft(0, good if first == "int32" else good.tolist(), 7)
    bad = good.copy()
    bad[3] = -1
    with pytest.raises(ValueError, match=r"context\[3\] = -1 is not a token id"):
        eng.draft(0, bad, 7)
    bad = np.concatenate([good, good[:20]])
    bad[100] = -5
    with pytest.raises(ValueError, match=r"context\[100\] = -5 is not a token id"):
        eng.draft(0, bad, 7)


def test_no_draft_ever_holds_an_invalid_id():
    """Whatever the caller passes, a draft holds only ids in 0 .. 2**31-1 (-1 is EMPTY): a
    context with -1 padding where the engine has already seen valid tokens is refused too."""
    good = repetitive(300)
    for lo in range(100, 200, 20):
        eng = SpecEngine(CHAIN, **FORM_PARAMS)
        eng.begin(0, good[:100])
        eng.draft(0, good[:200], int(good[200]))
        bad = good.copy()
        bad[lo:lo + 20] = -1  # a caller bug, in a prefix as long as one already drafted on
        for L in range(201, 240):
            try:
                d = eng.draft(0, bad[:L], int(good[L]))
            except ValueError:
                continue
            assert (d >= 0).all(), f"draft {d.tolist()} holds -1 (context length {L})"
            if len(d):
                eng.accept(0, 0)


@pytest.mark.parametrize("bad", [-1, -2**31, 2**31, 2**32, 2**64])
def test_out_of_range_sampled(bad):
    eng = SpecEngine(CHAIN)
    with pytest.raises(ValueError, match=rf"sampled = {bad} is not a token id"):
        eng.draft(0, [1, 2, 3], bad)
    with pytest.raises(ValueError, match=rf"sampled = {bad} is not a token id"):
        eng.draft(0, [1, 2, 3], np.int64(bad) if -2**63 <= bad < 2**63 else bad)


@pytest.mark.parametrize("bad", [1.0, "1", None, np.float64(3)])
def test_sampled_of_wrong_type(bad):
    eng = SpecEngine(CHAIN)
    with pytest.raises(TypeError, match="sampled must be an integer token id"):
        eng.draft(0, [1, 2, 3], bad)


def test_token_id_extremes_are_accepted():
    eng = SpecEngine(CHAIN, ngram_mod_n_match=2, ngram_mod_n_min=1)
    ctx = np.array([0, TOKEN_MAX] * 50, dtype=np.int64)
    eng.begin(0, ctx)
    d = eng.draft(0, ctx, 0)
    assert d.tolist()[:2] == [TOKEN_MAX, 0]


@pytest.mark.parametrize("bad", [-1, -2**70])
def test_n_max_out_of_range(bad):
    eng = SpecEngine("ngram-simple")
    with pytest.raises(ValueError, match=rf"n_max = {bad} is out of range: allowed >= 0"):
        eng.draft(0, [1, 2, 3], 4, n_max=bad)
    with pytest.raises(TypeError, match="n_max must be an integer"):
        eng.draft(0, [1, 2, 3], 4, n_max=2.0)


@pytest.mark.parametrize("big", [2**31, 2**63 - 1, 2**63, 2**70])
def test_huge_n_max_is_no_bound(big):
    """A bound larger than any draft truncates nothing (or is refused by name): never an
    anonymous OverflowError from the C conversion."""
    eng, draft = engine_with_pending_draft()
    eng.accept(0, 0)
    ctx = np.tile(np.arange(10, 18, dtype=np.int32), 10)
    try:
        got = eng.draft(0, ctx, 10, n_max=big)
    except ValueError as exc:
        assert "n_max" in str(exc)
    else:
        assert got.tolist() == draft.tolist()


def test_pool_get_validates_its_key():
    with pytest.raises(ValueError, match=r"key\[1\] = -1 is not a token id"):
        ModPool().get([3, -1])


def test_py_proposer_draft_is_validated():
    class Bad(PyProposer):
        def __init__(self, draft):
            super().__init__("bad", 1, 4)
            self.result = draft

        def on_draft(self, slot, inp, sampled):
            return self.result

    for result, exc, msg in [([1, -1], ValueError, r"bad draft\[1\] = -1"),
                             ([1.5], TypeError, "bad draft must hold integer"),
                             ([1, 2, 3, 4, 5], ValueError, "bad drafted 5 tokens: allowed 0 .. 4")]:
        eng = SpecEngine.from_proposers([Bad(result)])
        with pytest.raises(exc, match=msg):
            eng.draft(0, [1, 2, 3], 4)


# ---------------------------------------------------------------------------------------------
# every accepted form of a token array drafts what a contiguous int32 array drafts
# ---------------------------------------------------------------------------------------------

def _strided(a):
    big = np.zeros(2 * len(a) + 1, dtype=np.int32)
    big[1::2] = a
    view = big[1::2]
    assert not view.flags.c_contiguous or len(a) <= 1
    return view


def _readonly(a):
    r = np.array(a, dtype=np.int32)
    r.flags.writeable = False
    return r


def _misaligned(a):
    raw = np.zeros(4 * len(a) + 1, dtype=np.uint8)
    view = raw[1:].view(np.int32)
    view[:] = a
    assert not view.flags.aligned or len(a) == 0
    return view


def _reversed_twice(a):
    r = np.array(a[::-1], dtype=np.int32)
    return r[::-1]  # negative stride


class _Sub(np.ndarray):
    pass


FORMS = {
    "int32": lambda a: a,
    "list": lambda a: a.tolist(),
    "tuple": lambda a: tuple(a.tolist()),
    "int64": lambda a: a.astype(np.int64),
    "uint32": lambda a: a.astype(np.uint32),
    "uint16": lambda a: a.astype(np.uint16),  # trace ids are < 49152
    "big-endian": lambda a: a.astype(">i4"),
    "strided": _strided,
    "negative-stride": _reversed_twice,
    "read-only": _readonly,
    "misaligned": _misaligned,
    "subclass": lambda a: np.array(a, dtype=np.int32).view(_Sub),
    "array.array": lambda a: array.array("i", a.tobytes()),
    "memoryview": lambda a: memoryview(np.array(a, dtype=np.int32)),
}

FORM_PARAMS = {"ngram_simple_size_n": 4, "ngram_simple_size_m": 16, "ngram_map_k_size_n": 4,
               "ngram_map_k_size_m": 16, "ngram_map_k4v_size_n": 3, "ngram_map_k4v_size_m": 12,
               "ngram_mod_n_match": 6, "ngram_mod_n_min": 2, "ngram_mod_n_max": 24}


def _replay_in_form(typ, requests, form, n_slots=2):
    """llama-server's loop (greedy verification) with every token array passed via `form`."""
    eng = SpecEngine(typ, n_slots=n_slots, **FORM_PARAMS)
    drafts = []
    for t, req in enumerate(requests):
        slot = t % n_slots
        prompt, out = req.prompt, req.output
        buf = np.empty(len(prompt) + len(out) + 1, dtype=np.int32)
        buf[:len(prompt)] = prompt
        L = len(prompt)
        eng.begin(slot, form(prompt))
        produced, sampled = 1, int(out[0])
        while produced < len(out):
            d = eng.draft(slot, form(buf[:L]), sampled)
            assert d.dtype == np.int32
            k = 0
            if len(d):
                rest = out[produced:produced + len(d)]
                while k < len(rest) and d[k] == rest[k]:
                    k += 1
                eng.accept(slot, k)
            drafts.append(d.tolist())
            buf[L] = sampled
            buf[L + 1:L + 1 + k] = out[produced:produced + k]
            L += 1 + k
            produced += k
            if produced >= len(out):
                break
            sampled = int(out[produced])
            produced += 1
    return drafts, eng.stats()


@pytest.fixture(scope="module")
def form_requests():
    return read_requests(str(TRACES / "model-generated.jsonl.gz"), 6)


@pytest.fixture(scope="module")
def form_baseline(form_requests):
    return {typ: _replay_in_form(typ, form_requests, FORMS["int32"]) for typ in NGRAM_TYPES}


@pytest.mark.parametrize("form", sorted(set(FORMS) - {"int32"}))
def test_token_array_forms_give_identical_replays(form, form_requests, form_baseline):
    for typ in NGRAM_TYPES:
        drafts, stats = _replay_in_form(typ, form_requests, FORMS[form])
        want_drafts, want_stats = form_baseline[typ]
        assert sum(map(len, want_drafts)) > 0, f"{typ} never drafted: a weak comparison"
        assert drafts == want_drafts, f"{typ}: drafts differ when tokens are given as {form}"
        strip = [{k: v for k, v in s.items() if not k.startswith("t_")} for s in stats]
        want = [{k: v for k, v in s.items() if not k.startswith("t_")} for s in want_stats]
        assert strip == want


def test_input_arrays_are_not_modified_and_drafts_are_fresh():
    eng = SpecEngine(CHAIN, **FORM_PARAMS)
    stream = repetitive()
    ctx, sampled = stream[:-1].copy(), int(stream[-1])
    copy = ctx.copy()
    eng.begin(0, ctx)
    d1 = eng.draft(0, ctx, sampled)
    assert len(d1) > 0 and np.array_equal(ctx, copy)
    eng.accept(0, 0)
    d2 = eng.draft(0, ctx, sampled)
    assert d2.tolist() == d1.tolist() and not np.shares_memory(d1, d2)
    d1[:] = 0  # a returned draft is the caller's: writing it changes nothing in the engine
    eng.accept(0, 0)
    assert eng.draft(0, ctx, sampled).tolist() == d2.tolist()


# ---------------------------------------------------------------------------------------------
# the token type (house style point 3)
# ---------------------------------------------------------------------------------------------

def test_token_type_is_int32():
    assert np.dtype(np.intc) == np.dtype(np.int32)
    eng = SpecEngine(CHAIN, **FORM_PARAMS)
    ctx = repetitive()
    eng.begin(0, ctx.tolist())
    for s in range(20, 60):
        d = eng.draft(0, ctx[:s].astype(np.int64), int(ctx[s]))
        assert isinstance(d, np.ndarray) and d.dtype == np.int32 and d.ndim == 1
        assert d.flags.c_contiguous
        if len(d):
            eng.accept(0, 0)
    empty = SpecEngine("none").draft(0, [], 0)
    assert empty.dtype == np.int32
    req = read_requests(str(TRACES / "chat.jsonl.gz"), 1)[0]
    assert req.prompt.dtype == np.int32 and req.output.dtype == np.int32


# ---------------------------------------------------------------------------------------------
# bools and byte strings (issue 20, point 10): refused wherever an integer or token ids are
# expected, as slot=True always was
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, np.bool_(True)], ids=["True", "False", "np.bool_"])
def test_bool_sampled_is_refused(bad):
    eng = SpecEngine(CHAIN)
    eng.begin(0, [1, 2, 3])
    with pytest.raises(TypeError, match=r"sampled must be an integer token id, got bool"):
        eng.draft(0, [1, 2, 3], bad)


@pytest.mark.parametrize("where", ["prompt", "context"])
@pytest.mark.parametrize("bad", [[5, True, 7], (5, 6, False)], ids=["list", "tuple"])
def test_bool_in_token_list_is_refused(where, bad):
    eng = SpecEngine(CHAIN)
    pos = [type(v) for v in bad].index(bool)
    with pytest.raises(TypeError, match=rf"{where}\[{pos}\] = {bad[pos]} is not a token id: "
                                        r"ids must be integers, not bool"):
        eng.begin(0, bad) if where == "prompt" else eng.draft(0, bad, 1)


@pytest.mark.parametrize("where", ["prompt", "context"])
@pytest.mark.parametrize("bad", [bytearray(b"\x01\x02\x03"), b"\x01\x02\x03",
                                 memoryview(bytearray(b"\x01\x02\x03")), memoryview(b"abc")],
                         ids=["bytearray", "bytes", "memoryview-bytearray", "memoryview-bytes"])
def test_byte_strings_are_not_token_ids(where, bad):
    """bytes were refused (a 0-d string array) while bytearray passed as uint8 ids: both are
    text or raw data, not token ids. Integer buffers (array.array, memoryview of an int array,
    numpy uint8) stay accepted: see FORMS."""
    eng = SpecEngine(CHAIN)
    with pytest.raises(TypeError, match=rf"{where} must be a 1-D sequence of integer token ids, "
                                        r"got (bytearray|bytes) \(bytes are not token ids"):
        eng.begin(0, bad) if where == "prompt" else eng.draft(0, bad, 1)
    eng.begin(0, np.frombuffer(bytes(bad), dtype=np.uint8))   # an explicit uint8 array is ids


@pytest.mark.parametrize("cls", ["SimpleProposer", "MapProposer", "ModProposer",
                                 "SuffixProposer", "NgramCacheProposer"])
def test_proposer_n_slots_bool_is_refused(cls):
    import ngramspec
    make = getattr(ngramspec, cls)
    with pytest.raises(TypeError, match=r"n_slots must be an integer, got bool"):
        make(n_slots=True)
    with pytest.raises(ValueError, match=r"n_slots = 0 is out of range: allowed >= 1"):
        make(n_slots=0)


@pytest.mark.parametrize("ids, ok", [([0, 9], True), ([], True), ([3, 10], False),
                                     ([TOKEN_MAX], False)])
def test_ids_below_a_models_vocabulary(ids, ok):
    # the one check of prompts and predictions against a model's vocabulary (scheduler, engines)
    from ngramspec.tokens import token_array
    if ok:
        assert token_array(ids, "prediction", n_vocab=10).tolist() == ids
    else:
        with pytest.raises(ValueError, match=r"^prediction: token ids must lie in 0 \.\. 9$"):
            token_array(ids, "prediction", n_vocab=10)
    assert token_array(ids, "prediction").tolist() == ids     # no model: any token id
