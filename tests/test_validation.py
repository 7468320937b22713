"""Validation at every public entry (issue 4, item 1).

Every bad argument raises a Python exception of the documented type whose message names the
problem (the parameter, the slot, the offending position or value); nothing bad reaches a kernel.
The command line turns bad files and flags into one line on stderr and exit code 2, never a
traceback. Harmless edge cases (empty prompts, contexts shorter than n) are not errors, and every
accepted form of a token array drafts exactly what a contiguous int32 array drafts.
"""
from __future__ import annotations

import array
import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ngramspec import (MapProposer, ModPool, ModProposer, PyProposer, SimpleProposer,
                       SpecEngine, SuffixProposer)
from ngramspec.acceptance import AcceptanceEstimator
from ngramspec._proposer import TOKEN_MAX
from ngramspec.cli import main as cli_main
from ngramspec.request_params import SamplingParams, SpeculationParams
from ngramspec.replay import replay
from ngramspec.registry import TYPES
from ngramspec.traces import TraceError, read_requests

from conftest import ROOT, TRACES

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
CHAIN = ",".join(NGRAM_TYPES)

# Section 2 of the spec: every integer parameter of the n-gram types with its inclusive range
# (None: unbounded above).
SPEC_RANGES = {
    "ngram_simple_size_n": (1, 1024), "ngram_simple_size_m": (1, 1024),
    "ngram_simple_min_hits": (1, None),
    "ngram_map_k_size_n": (1, 1024), "ngram_map_k_size_m": (1, 1024),
    "ngram_map_k_min_hits": (1, None),
    "ngram_map_k4v_size_n": (1, 1024), "ngram_map_k4v_size_m": (1, 1024),
    "ngram_map_k4v_min_hits": (1, None),
    "ngram_mod_n_match": (1, 1024), "ngram_mod_n_min": (0, 1024), "ngram_mod_n_max": (0, 1024),
}


def _type_of(param: str) -> str:
    for spec in TYPES.values():
        if any(p.name == param for p in spec.params):
            return spec.name
    raise KeyError(param)


def _repetitive(n: int = 400, period: int = 37, seed: int = 0) -> np.ndarray:
    """A token stream that repeats with noise, so every proposer finds matches."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50_000, period)
    out = np.resize(base, n).astype(np.int32)
    noise = rng.random(n) < 0.05
    out[noise] = rng.integers(0, 50_000, int(noise.sum()))
    return out


def _engine_with_pending_draft(n_max=None):
    """An ngram-simple engine whose slot 0 has a pending draft; returns (engine, draft)."""
    eng = SpecEngine("ngram-simple", n_slots=2, ngram_simple_size_n=2, ngram_simple_size_m=6)
    ctx = np.tile(np.arange(10, 18, dtype=np.int32), 10)
    eng.begin(0, ctx)
    draft = eng.draft(0, ctx, 10, n_max=n_max)
    assert len(draft) > 0
    return eng, draft


# ---------------------------------------------------------------------------------------------
# spec types and parameters
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ngram-foo", "ngram_mod", "NGRAM-MOD", "ngram-mod2", "mod"])
def test_unknown_spec_type(name):
    with pytest.raises(ValueError, match=re.escape(repr(name))) as exc:
        SpecEngine(name)
    assert "unknown spec type" in str(exc.value)
    assert "ngram-mod" in str(exc.value)  # the message lists the allowed names


def test_unknown_spec_type_in_a_list():
    with pytest.raises(ValueError, match="unknown spec type 'ngram-bogus'"):
        SpecEngine("ngram-mod, ngram-bogus")
    with pytest.raises(ValueError, match="unknown spec type 'ngram-bogus'"):
        SpecEngine(["ngram-simple", "ngram-bogus"])


@pytest.mark.parametrize("name", ["draft-eagle3", "draft-mtp", "draft-dflash"])
def test_spec_type_known_to_llama_but_unsupported(name):
    with pytest.raises(ValueError, match=f"'{name}'.*not supported"):
        SpecEngine(name)


def test_unknown_type_lists_only_types_that_work():
    with pytest.raises(ValueError) as exc:
        SpecEngine("ngram-bogus")
    allowed = str(exc.value).partition("allowed ")[2].split(", ")
    assert allowed == ["none", *TYPES]
    assert not {"draft-eagle3", "draft-mtp", "draft-dflash"} & set(allowed)


def test_ngram_mod_n_min_above_n_max_is_refused_naming_both():
    with pytest.raises(ValueError, match="ngram_mod_n_min = 8 is greater than "
                                         "ngram_mod_n_max = 4"):
        SpecEngine("ngram-mod", ngram_mod_n_min=8, ngram_mod_n_max=4)
    SpecEngine("ngram-mod", ngram_mod_n_min=4, ngram_mod_n_max=4)
    SpecEngine("ngram-mod", ngram_mod_n_max=0)       # alone: llama.cpp's default n_min stays


def test_spec_type_help_lists_the_valid_types(capsys):
    with pytest.raises(SystemExit):
        cli_main(["replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ngram-mod, ngram-cache" in text and "none, ngram-suffix, ngram-simple" in text
    assert "draft-simple" not in text and "draft-mtp" not in text    # replay has no model


def test_every_parameter_has_one_flag_and_a_default_in_range():
    params = [p for spec in TYPES.values() for p in spec.params]
    assert len({p.name for p in params}) == len(params)
    for p in params:
        if p.kind in (int, float) and p.default is not None:
            assert p.check(p.default) == p.default
        if p.cli:
            assert p.flag.startswith("--") and "_" not in p.flag


@pytest.mark.parametrize("bad", [5, 2.5, object()])
def test_spec_type_of_wrong_type(bad):
    with pytest.raises(TypeError, match="spec_type"):
        SpecEngine(bad)


def test_unknown_parameter():
    with pytest.raises(TypeError, match="unknown parameter 'ngram_mod_n_matc'"):
        SpecEngine("ngram-mod", ngram_mod_n_matc=24)


@pytest.mark.parametrize("param", sorted(SPEC_RANGES))
def test_parameter_range_ends_are_accepted(param):
    lo, hi = SPEC_RANGES[param]
    typ = _type_of(param)
    for value in (lo, hi if hi is not None else 10**6):
        eng = SpecEngine(typ, **{param: value})
        assert eng.types == [typ]


@pytest.mark.parametrize("param", sorted(SPEC_RANGES))
def test_parameter_below_range(param):
    lo, hi = SPEC_RANGES[param]
    with pytest.raises(ValueError, match=rf"{param} = {lo - 1} is out of range"):
        SpecEngine(_type_of(param), **{param: lo - 1})


@pytest.mark.parametrize("param", sorted(p for p, r in SPEC_RANGES.items() if r[1] is not None))
def test_parameter_above_range(param):
    lo, hi = SPEC_RANGES[param]
    with pytest.raises(ValueError, match=rf"{param} = {hi + 1} is out of range: allowed {lo} .. {hi}"):
        SpecEngine(_type_of(param), **{param: hi + 1})
    with pytest.raises(ValueError, match=rf"{param} = {2**64} is out of range"):
        SpecEngine(_type_of(param), **{param: 2**64})


@pytest.mark.parametrize("bad", [2.0, "12", None, True, [12]])
def test_parameter_of_wrong_type(bad):
    with pytest.raises(TypeError, match="ngram_mod_n_match must be an integer"):
        SpecEngine("ngram-mod", ngram_mod_n_match=bad)


def test_numpy_integer_parameters_are_accepted():
    eng = SpecEngine("ngram-mod", ngram_mod_n_match=np.int64(3), ngram_mod_n_min=np.uint8(1),
                     ngram_mod_n_max=np.int32(8))
    assert eng.proposers[0].n_match == 3


# The proposer classes check their own arguments too (they are public).
@pytest.mark.parametrize("cls, kwargs, name", [
    (SimpleProposer, {"size_n": 0}, "size_n"), (SimpleProposer, {"size_n": 1025}, "size_n"),
    (SimpleProposer, {"size_m": 0}, "size_m"), (SimpleProposer, {"size_m": 1025}, "size_m"),
    (SimpleProposer, {"min_hits": 0}, "min_hits"),
    (MapProposer, {"size_n": 0}, "size_n"), (MapProposer, {"size_m": 1025}, "size_m"),
    (MapProposer, {"min_hits": 0, "key_only": False}, "min_hits"),
    (ModProposer, {"n_match": 0}, "n_match"), (ModProposer, {"n_match": 1025}, "n_match"),
    (ModProposer, {"n_min": -1}, "n_min"), (ModProposer, {"n_min": 1025}, "n_min"),
    (ModProposer, {"n_max": -1}, "n_max"), (ModProposer, {"n_max": 1025}, "n_max"),
    (SimpleProposer, {"n_slots": 0}, "n_slots"), (MapProposer, {"n_slots": 0}, "n_slots"),
    (ModProposer, {"n_slots": 0}, "n_slots"),
])
def test_proposer_parameter_ranges(cls, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} = -?\d+ is out of range"):
        cls(**kwargs)


def test_proposer_pool_of_wrong_type():
    with pytest.raises(TypeError, match="pool"):
        ModProposer(pool=object())
    with pytest.raises(TypeError, match="pool must be a ModPool"):
        SpecEngine("ngram-mod", pool=bytearray(16))


# ---------------------------------------------------------------------------------------------
# slots
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_slots", [0, -1, -2**40])
def test_n_slots_below_one(n_slots):
    with pytest.raises(ValueError, match=rf"n_slots = {n_slots} is out of range: allowed >= 1"):
        SpecEngine("ngram-mod", n_slots=n_slots)
    with pytest.raises(ValueError, match=rf"n_slots = {n_slots} is out of range"):
        replay([], "ngram-mod", n_slots=n_slots)


@pytest.mark.parametrize("n_slots", [1.0, "2", True, None])
def test_n_slots_of_wrong_type(n_slots):
    with pytest.raises(TypeError, match="n_slots must be an integer"):
        SpecEngine("ngram-simple", n_slots=n_slots)


@pytest.mark.parametrize("n_slots", [2**40, 2**61, 2**63 - 1, 2**63, 2**64])
def test_absurd_n_slots_fail_cleanly(n_slots):
    """No size_t overflow into a short allocation: a clean exception, never a crash."""
    for typ in ("none", "ngram-simple", "ngram-mod", "ngram-map-k"):
        with pytest.raises((ValueError, MemoryError, OverflowError)):
            SpecEngine(typ, n_slots=n_slots)


def test_proposer_with_too_few_slots():
    with pytest.raises(ValueError, match="ngram-simple has 1 slots, the engine needs 3"):
        SpecEngine.from_proposers([SimpleProposer(n_slots=1)], n_slots=3)


@pytest.mark.parametrize("slot", [2, 3, -1, 2**70, -2**70])
def test_slot_out_of_range(slot):
    eng, _ = _engine_with_pending_draft()  # n_slots = 2
    msg = rf"slot = {slot} is out of range: allowed 0 \.\. 1"
    with pytest.raises(IndexError, match=msg):
        eng.begin(slot, [1, 2, 3])
    with pytest.raises(IndexError, match=msg):
        eng.draft(slot, [1, 2, 3], 4)
    with pytest.raises(IndexError, match=msg):
        eng.accept(slot, 0)


@pytest.mark.parametrize("slot", [0.0, "0", None, True, [0]])
def test_slot_of_wrong_type(slot):
    eng = SpecEngine("ngram-simple", n_slots=2)
    with pytest.raises(TypeError, match="slot must be an integer"):
        eng.begin(slot, [1, 2, 3])
    with pytest.raises(TypeError, match="slot must be an integer"):
        eng.draft(slot, [1, 2, 3], 4)


def test_numpy_slot_is_accepted():
    eng = SpecEngine("ngram-simple", n_slots=2)
    eng.begin(np.int64(1), [1, 2, 3])
    assert len(eng.draft(np.uint8(1), [1, 2, 3], 4)) == 0


def test_diagnostic_methods_check_the_slot():
    with pytest.raises(IndexError, match="slot = 1 is out of range"):
        MapProposer(n_slots=1).n_keys(1)
    with pytest.raises(IndexError, match="slot = -1 is out of range"):
        ModProposer(n_slots=1).slot_state(-1)


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
    good = _repetitive(300)
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
    good = _repetitive(300)
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
    eng, draft = _engine_with_pending_draft()
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
# accept
# ---------------------------------------------------------------------------------------------

def test_accept_more_than_drafted():
    eng, draft = _engine_with_pending_draft()
    with pytest.raises(ValueError, match=rf"n_accepted = {len(draft) + 1} is out of range: "
                                         rf"allowed 0 \.\. {len(draft)}"):
        eng.accept(0, len(draft) + 1)
    with pytest.raises(ValueError, match="n_accepted = 65536 is out of range"):
        eng.accept(0, 65536)  # llama.cpp's uint16 would wrap this to 0
    eng.accept(0, len(draft))  # the failed calls left the pending draft in place


def test_accept_more_than_the_truncated_draft():
    """n_max truncates the draft; accept is bounded by what the caller actually received."""
    eng, draft = _engine_with_pending_draft(n_max=2)
    assert len(draft) == 2
    with pytest.raises(ValueError, match=r"n_accepted = 3 is out of range: allowed 0 \.\. 2"):
        eng.accept(0, 3)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.0, TypeError), ("1", TypeError),
                                      (None, TypeError), (True, TypeError)])
def test_accept_bad_count(bad, exc):
    eng, _ = _engine_with_pending_draft()
    with pytest.raises(exc, match="n_accepted"):
        eng.accept(0, bad)


def test_accept_without_a_draft():
    eng = SpecEngine("ngram-simple", n_slots=2, ngram_simple_size_n=2, ngram_simple_size_m=6)
    msg = "accept\\(\\) on slot 1 without a pending non-empty draft"
    with pytest.raises(ValueError, match=msg):
        eng.accept(1, 0)  # never drafted
    eng.begin(1, [1, 2, 3])
    eng.draft(1, [1, 2, 3], 4)  # empty draft: nothing to accept
    with pytest.raises(ValueError, match=msg):
        eng.accept(1, 0)


def test_accept_twice_and_after_a_new_request():
    eng, draft = _engine_with_pending_draft()
    eng.accept(0, 1)
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 1)
    eng, draft = _engine_with_pending_draft()
    eng.begin(0, [1, 2, 3])  # a new request drops the old draft
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 0)
    eng, draft = _engine_with_pending_draft()
    eng.draft(0, [1, 2, 3], 4, n_max=0)  # the server made no draft this step
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 0)


def test_pending_draft_is_per_slot():
    eng, draft = _engine_with_pending_draft()
    with pytest.raises(ValueError, match="slot 1 without a pending"):
        eng.accept(1, 0)
    eng.accept(0, 0)


def test_failed_calls_leave_the_slot_unchanged():
    """A rejected call does not consume the pending draft or change any statistic."""
    eng, draft = _engine_with_pending_draft()
    before = eng.stats()
    for call in (lambda: eng.draft(0, [1, -1], 3), lambda: eng.draft(0, [1, 2], -3),
                 lambda: eng.draft(0, [1, 2], 3, n_max=-1), lambda: eng.begin(0, [[1]]),
                 lambda: eng.accept(0, 99)):
        with pytest.raises((ValueError, TypeError)):
            call()
    assert eng.stats() == before
    eng.accept(0, len(draft))


# ---------------------------------------------------------------------------------------------
# harmless edge cases: empty drafts, not errors
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("typ", NGRAM_TYPES + (CHAIN, "none"))
@pytest.mark.parametrize("empty", [[], (), np.array([]), np.empty(0, np.int32),
                                   np.empty(0, np.int64), np.array([], dtype=np.float64)],
                         ids=["list", "tuple", "float-default", "int32", "int64", "float64"])
def test_empty_prompts_and_contexts(typ, empty):
    eng = SpecEngine(typ, n_slots=2)
    eng.begin(1, empty)
    d = eng.draft(1, empty, 7)
    assert d.dtype == np.int32 and len(d) == 0


@pytest.mark.parametrize("typ", NGRAM_TYPES)
def test_contexts_shorter_than_n(typ):
    n = 5
    params = {"ngram_simple_size_n": n, "ngram_map_k_size_n": n, "ngram_map_k4v_size_n": n,
              "ngram_mod_n_match": n, "ngram_mod_n_min": 0, "ngram_simple_size_m": 2,
              "ngram_map_k_size_m": 2, "ngram_map_k4v_size_m": 2}
    eng = SpecEngine(typ, **params)
    for L in range(n):
        ctx = [3] * L
        eng.begin(0, ctx)
        assert len(eng.draft(0, ctx, 3)) == 0
    # and a draft without any begin on a fresh slot is allowed
    eng2 = SpecEngine(typ, n_slots=3, **params)
    assert len(eng2.draft(2, [3, 3], 3)) == 0


def test_engine_without_proposers():
    eng = SpecEngine("none", n_slots=2)
    eng.begin(1, [1, 2, 3])
    assert len(eng.draft(1, [1, 2, 3], 4)) == 0
    assert eng.stats() == []


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
    stream = _repetitive()
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
    ctx = _repetitive()
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
# trace files (Python API)
# ---------------------------------------------------------------------------------------------

def _write(path, text: str | bytes):
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)
    return str(path)


GOOD_LINE = json.dumps({"prompt": [1, 2, 3, 1, 2, 3, 1, 2], "output": [3, 1, 2, 3]})


def test_trace_errors_name_file_and_line(tmp_path):
    cases = {
        "malformed.jsonl": (GOOD_LINE + "\n" + '{"prompt": [1, 2,\n', 2, "malformed JSON"),
        "field.jsonl": (GOOD_LINE + "\n" + '{"prompt": "abc", "output": [1]}\n', 2,
                        "field 'prompt' must be a list of integer token ids"),
        "missing.jsonl": (GOOD_LINE + "\n\n" + '{"output": [1]}\n', 3, "missing field 'prompt'"),
        "negative.jsonl": (GOOD_LINE + "\n" + '{"prompt": [1, -1], "output": [1]}\n', 2,
                           "field 'prompt'[1] = -1 is not a token id: ids must be in "
                           "0 .. 2147483647"),
        "huge.jsonl": ('{"prompt": [1], "output": [1, 100000000000000000000000]}\n', 1,
                       "field 'output'[1] = 100000000000000000000000 is not a token id: "
                       "ids must be in 0 .. 2147483647"),
        "notobject.jsonl": ("[1, 2]\n", 1, "expected a JSON object per line"),
        "deep.jsonl": (GOOD_LINE + "\n" + '{"prompt": ' + "[" * 100_000 + "]" * 100_000
                       + ', "output": [1]}\n', 2, ""),
    }
    for name, (text, line, what) in cases.items():
        path = _write(tmp_path / name, text)
        with pytest.raises(TraceError) as exc:
            read_requests(path)
        assert str(exc.value).startswith(f"{path}:{line}: {what}"), str(exc.value)


def test_trace_missing_file(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match=re.escape(f"{path}: no such file")):
        read_requests(path)


def test_trace_truncated_gzip(tmp_path):
    lines = "".join(json.dumps({"prompt": list(range(i, i + 300)), "output": [1, 2]}) + "\n"
                    for i in range(300))
    data = gzip.compress(lines.encode())
    path = _write(tmp_path / "cut.jsonl.gz", data[:len(data) // 2])
    with pytest.raises(TraceError, match=re.escape(path) + r":\d+: corrupt or truncated gzip"):
        read_requests(path)
    path = _write(tmp_path / "plain.jsonl.gz", lines.encode())
    with pytest.raises(TraceError, match=re.escape(path) + r":1: corrupt or truncated gzip"):
        read_requests(path)


def test_trace_bad_utf8_names_its_line(tmp_path):
    path = _write(tmp_path / "latin.jsonl", (GOOD_LINE + "\n").encode() * 3
                  + b'{"id": "\xff", "prompt": [1], "output": [1]}\n')
    with pytest.raises(TraceError, match=re.escape(path) + r":4: not UTF-8"):
        read_requests(path)


# ---------------------------------------------------------------------------------------------
# the command line: one line on stderr, exit code 2, no traceback
# ---------------------------------------------------------------------------------------------

def _cli(args, cwd):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "ngramspec", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _assert_one_line_error(proc, *needles):
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    for needle in needles:
        assert needle in err, (needle, err)


def test_cli_file_errors(tmp_path):
    """The issue's cases, each through ``python -m ngramspec replay`` in a subprocess."""
    lines = "".join(json.dumps({"prompt": list(range(i, i + 300)), "output": [1, 2]}) + "\n"
                    for i in range(300))
    data = gzip.compress(lines.encode())
    _write(tmp_path / "cut.jsonl.gz", data[:len(data) // 2])
    _write(tmp_path / "malformed.jsonl", GOOD_LINE + "\n" + GOOD_LINE + "\n" + '{"prompt": [1,\n')
    _write(tmp_path / "types.jsonl", GOOD_LINE + "\n" + '{"prompt": [1, 2], "output": "ab"}\n')
    _write(tmp_path / "floats.jsonl", '{"prompt": [1.0, 2.0], "output": [1]}\n')
    cases = [
        (["malformed.jsonl"], ["malformed.jsonl:3:", "malformed JSON"]),
        (["cut.jsonl.gz"], ["cut.jsonl.gz:", "truncated gzip"]),
        (["missing.jsonl"], ["missing.jsonl", "no such file"]),
        (["types.jsonl"], ["types.jsonl:2:", "'output'"]),
        (["floats.jsonl"], ["floats.jsonl:1:", "'prompt'"]),
    ]
    for args, needles in cases:
        proc = _cli(["replay", *args, "--spec-type", "ngram-mod"], tmp_path)
        _assert_one_line_error(proc, *needles)
        assert re.search(r"\.jsonl(\.gz)?(:\d+)?: ", proc.stderr), proc.stderr


def test_cli_bad_flags(tmp_path):
    _write(tmp_path / "ok.jsonl", GOOD_LINE + "\n")
    cases = [
        (["--spec-type", "ngram-foo"], ["unknown spec type 'ngram-foo'"]),
        (["--spec-ngram-mod-n-match", "0"], ["--spec-ngram-mod-n-match = 0 is out of range"]),
        (["--spec-ngram-mod-n-max", "abc"], ["--spec-ngram-mod-n-max", "invalid int value"]),
        (["--slots", "0"], ["--slots"]),
        (["--bogus-flag"], ["unrecognized arguments: --bogus-flag"]),
    ]
    for flags, needles in cases:
        proc = _cli(["replay", "ok.jsonl", *flags], tmp_path)
        _assert_one_line_error(proc, *needles)


def _cli_in_process(argv, capsys):
    """main() as the console script runs it; returns (exit code, stderr)."""
    try:
        rc = cli_main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--spec-type", "draft-mtp"], "'draft-mtp' is not supported"),
    (["--spec-ngram-simple-size-n", "1025"], "--spec-ngram-simple-size-n = 1025 is out of range"),
    (["--spec-ngram-map-k-size-m", "0"], "--spec-ngram-map-k-size-m = 0 is out of range"),
    (["--spec-ngram-map-k4v-min-hits", "0"], "--spec-ngram-map-k4v-min-hits = 0 is out of range"),
    (["--spec-ngram-mod-n-min", "-1"],
     "--spec-ngram-mod-n-min = -1 is out of range: allowed 0 .. 1024"),
    (["--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "4"],
     "--spec-ngram-mod-n-min = 8 is greater than --spec-ngram-mod-n-max = 4"),
    (["--spec-type", "draft-eagle3"], "allowed none, ngram-suffix, ngram-simple"),
    (["--spec-ngram-mod-n-match", "2.5"], "invalid int value: '2.5'"),
    (["--limit", "0"], "--limit"), (["--repeat", "-3"], "--repeat"), (["--slots", "x"], "--slots"),
    (["--state", "stale"], "invalid choice: 'stale'"),
    (["--ctx-size", "-5"], "--ctx-size"),
    (["--output", "/nonexistent-dir/out.jsonl"], "/nonexistent-dir/out.jsonl"),
])
def test_cli_bad_flags_in_process(tmp_path, capsys, flags, needle):
    path = _write(tmp_path / "ok.jsonl", GOOD_LINE + "\n")
    rc, err = _cli_in_process(["replay", path, *flags], capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("name, content, needle", [
    ("huge.jsonl", '{"prompt": [1, 2], "output": [1, 99999999999999999999999]}\n', "huge.jsonl:1:"),
    ("neg.jsonl", '{"prompt": [1, -2], "output": [1]}\n', "neg.jsonl:1:"),
    ("big.jsonl", '{"prompt": [1, 2147483648], "output": [1]}\n', "big.jsonl:1:"),
    ("bools.jsonl", '{"prompt": [true], "output": [1]}\n', "bools.jsonl:1:"),
    ("null.jsonl", '{"prompt": [1], "output": null}\n', "null.jsonl:1:"),
    ("array.jsonl", GOOD_LINE + "\n[1, 2, 3]\n", "array.jsonl:2:"),
    ("deep.jsonl", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "deep.jsonl:1:"),
    ("latin1.jsonl", b'{"prompt": [1], "output": [1], "id": "\xe9"}\n', "latin1.jsonl:1:"),
    ("notgz.jsonl.gz", GOOD_LINE + "\n", "notgz.jsonl.gz:1:"),
], ids=["huge", "negative", "big", "bools", "null", "array", "deep", "latin1", "notgz"])
def test_cli_bad_files_in_process(tmp_path, capsys, name, content, needle):
    path = _write(tmp_path / name, content)
    rc, err = _cli_in_process(["replay", path, "--spec-type", "ngram-simple"], capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and needle in err, err


def test_cli_directory_instead_of_file(tmp_path, capsys):
    rc, err = _cli_in_process(["replay", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 1 and str(tmp_path) in err, err


def test_cli_empty_requests_are_not_errors(tmp_path, capsys):
    path = _write(tmp_path / "edge.jsonl", "\n".join([
        '{"prompt": [], "output": [1, 2, 3]}', '{"prompt": [1, 2, 3], "output": []}',
        '{"prompt": [], "output": []}', "", GOOD_LINE]) + "\n")
    _write(tmp_path / "empty.jsonl", "")
    for f in (path, str(tmp_path / "empty.jsonl")):
        rc, err = _cli_in_process(["replay", f, "--spec-type", CHAIN], capsys)
        assert rc == 0 and err == "", err


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


# -- the one range check (ngramspec.validation): field as data, one message format -------------

def _raised(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("make, field, value, allowed", [
    (lambda: SpecEngine("ngram-mod", ngram_mod_n_max=2000), "ngram_mod_n_max", 2000, "0 .. 1024"),
    (lambda: ModProposer(n_match=0), "n_match", 0, "1 .. 1024"),
    (lambda: SuffixProposer(min_prob=1.5), "min_prob", 1.5, "0.0 .. 1.0"),
    (lambda: SamplingParams(top_k=-1), "top_k", -1, "0 .. 2147483647"),
    (lambda: SpeculationParams(n_max=2000), "speculation.n_max", 2000, "0 .. 1024"),
    (lambda: AcceptanceEstimator(prior=1.0), "prior", 1.0, "0.0 .. 1.0 (0.0 and 1.0 excluded)"),
])
def test_every_validator_raises_the_one_error_with_the_field_as_data(make, field, value, allowed):
    """The registry, the kernels, the request parameters and the estimators report through one
    helper: the field, the value and the range are attributes, and the message is built from
    them in one format."""
    from ngramspec.validation import OutOfRange, ParamError

    exc = _raised(make)
    assert isinstance(exc, OutOfRange) and isinstance(exc, ValueError)
    assert (exc.field, exc.value, exc.allowed) == (field, value, allowed)
    assert str(exc) == f"{field} = {value} is out of range: allowed {allowed}"
    assert isinstance(exc, ParamError) and exc.message_for("x.y") == str(exc).replace(field, "x.y")


def test_wrong_types_are_type_errors_naming_the_field():
    from ngramspec.validation import WrongType, check_int, check_real

    for check, expected in ((check_int, "an integer"), (check_real, "a number")):
        exc = _raised(check, "n_ctx", True, 1)
        assert isinstance(exc, WrongType) and isinstance(exc, TypeError)
        assert str(exc) == f"n_ctx must be {expected}, got bool" and exc.field == "n_ctx"
    assert check_int("n", np.int64(7), 1, 8) == 7 and type(check_int("n", np.int64(7))) is int
    assert check_real("x", np.float32(0.5), 0.0, 1.0) == 0.5


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_reals_that_are_not_finite_are_out_of_range(value):
    from ngramspec.validation import OutOfRange, check_real

    with pytest.raises(OutOfRange, match=r"^p = (nan|-?inf) is out of range: allowed >= 0\.0$"):
        check_real("p", value, 0.0)


def test_range_text_and_open_ends():
    from ngramspec.validation import check_real, range_text

    assert [range_text(1, 8), range_text(1), range_text(None, 8), range_text()] == \
        ["1 .. 8", ">= 1", "<= 8", "any"]
    assert range_text(0.0, lo_open=True) == "> 0.0"
    assert check_real("x", 1.0, 0.0, 1.0, lo_open=True) == 1.0
    with pytest.raises(ValueError, match=r"^x = 0\.0 is out of range: allowed 0\.0 \.\. 1\.0 "
                                         r"\(0\.0 excluded\)$"):
        check_real("x", 0.0, 0.0, 1.0, lo_open=True)


def test_parameter_errors_survive_pickling():
    """Worker processes send exceptions back pickled: the field stays data."""
    import pickle

    from ngramspec.validation import ContextOverflow, OutOfRange, check_choice

    exc = pickle.loads(pickle.dumps(_raised(check_choice, "policy", "fast", ("auto", "fixed"))))
    assert isinstance(exc, OutOfRange) and str(exc) == \
        "policy = 'fast' is out of range: allowed auto, fixed"
    assert (exc.field, exc.value) == ("policy", "fast")
    over = pickle.loads(pickle.dumps(ContextOverflow("prompt_tokens", "does not fit", value=9)))
    assert isinstance(over, ContextOverflow) and over.message_for("prompt") == \
        "prompt: does not fit" and over.value == 9


def test_cli_number_flags_report_through_argparse(capsys):
    rc, err = _cli_in_process(["serve", "--port", "70000"], capsys)
    assert rc == 2 and "argument --port: 70000 is out of range: allowed 0 .. 65535" in err, err
    rc, err = _cli_in_process(["serve", "--read-timeout", "nan"], capsys)
    assert rc == 2 and "argument --read-timeout: nan is out of range: allowed >= 0.001" in err, err
    rc, err = _cli_in_process(["serve", "--port", "x"], capsys)
    assert rc == 2 and "argument --port: invalid int value: 'x'" in err, err
