"""Validation at every public entry (issue 4, item 1): the spec types and their parameters,
slots, accept, the harmless edge cases, and the one range check (`ngramspec.validation`).

Every bad argument raises a Python exception of the documented type whose message names the
problem (the parameter, the slot, the offending position or value); nothing bad reaches a kernel.
Harmless edge cases (empty prompts, contexts shorter than n) are not errors. Token arrays and ids
are in test_validation_tokens.py, trace files and the command line in test_validation_cli.py.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ngramspec import MapProposer, ModProposer, SimpleProposer, SpecEngine, SuffixProposer
from ngramspec.acceptance import AcceptanceEstimator
from ngramspec.cli import main as cli_main
from ngramspec.llama.params import SamplingParams, SpeculationParams
from ngramspec.replay import replay
from ngramspec.registry import TYPES

from validation_common import CHAIN, NGRAM_TYPES, engine_with_pending_draft


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
    eng, _ = engine_with_pending_draft()  # n_slots = 2
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
# accept
# ---------------------------------------------------------------------------------------------

def test_accept_more_than_drafted():
    eng, draft = engine_with_pending_draft()
    with pytest.raises(ValueError, match=rf"n_accepted = {len(draft) + 1} is out of range: "
                                         rf"allowed 0 \.\. {len(draft)}"):
        eng.accept(0, len(draft) + 1)
    with pytest.raises(ValueError, match="n_accepted = 65536 is out of range"):
        eng.accept(0, 65536)  # llama.cpp's uint16 would wrap this to 0
    eng.accept(0, len(draft))  # the failed calls left the pending draft in place


def test_accept_more_than_the_truncated_draft():
    """n_max truncates the draft; accept is bounded by what the caller actually received."""
    eng, draft = engine_with_pending_draft(n_max=2)
    assert len(draft) == 2
    with pytest.raises(ValueError, match=r"n_accepted = 3 is out of range: allowed 0 \.\. 2"):
        eng.accept(0, 3)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.0, TypeError), ("1", TypeError),
                                      (None, TypeError), (True, TypeError)])
def test_accept_bad_count(bad, exc):
    eng, _ = engine_with_pending_draft()
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
    eng, draft = engine_with_pending_draft()
    eng.accept(0, 1)
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 1)
    eng, draft = engine_with_pending_draft()
    eng.begin(0, [1, 2, 3])  # a new request drops the old draft
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 0)
    eng, draft = engine_with_pending_draft()
    eng.draft(0, [1, 2, 3], 4, n_max=0)  # the server made no draft this step
    with pytest.raises(ValueError, match="without a pending non-empty draft"):
        eng.accept(0, 0)


def test_pending_draft_is_per_slot():
    eng, draft = engine_with_pending_draft()
    with pytest.raises(ValueError, match="slot 1 without a pending"):
        eng.accept(1, 0)
    eng.accept(0, 0)


def test_failed_calls_leave_the_slot_unchanged():
    """A rejected call does not consume the pending draft or change any statistic."""
    eng, draft = engine_with_pending_draft()
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
