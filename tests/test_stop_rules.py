"""The one stop rule set (`ngramspec.stop_rules`) every driver applies to a step's tokens."""
import pytest
from hypothesis import given, strategies as st

from ngramspec.stop_rules import (CONTEXT, FINISH_REASONS, LENGTH, STOP, context_full, cut_step,
                                  openai_finish_reason)

EOG = 2
is_eog = {EOG}.__contains__


@pytest.mark.parametrize("tokens, n_out, max_tokens, eog, expected", [
    ([5, 6, 7], 0, -1, is_eog, (3, None)),          # no limit, no end token
    ([5, 2, 7], 0, -1, is_eog, (2, STOP)),          # end token kept, what follows dropped
    ([5, 2, 7], 0, -1, None, (3, None)),            # ignore_eos
    ([5, 6, 7], 8, 10, is_eog, (2, LENGTH)),        # the limit cuts the step
    ([5, 2, 7], 8, 10, is_eog, (2, STOP)),          # an end token at the limit's last place
    ([5, 6, 2], 8, 10, is_eog, (2, LENGTH)),        # an end token past the limit is not emitted
    ([5], 9, 10, is_eog, (1, LENGTH)),
    ([5], 0, 0, is_eog, (0, LENGTH)),               # max_tokens = 0: nothing
])
def test_cut_step(tokens, n_out, max_tokens, eog, expected):
    assert cut_step(tokens, n_out, max_tokens, eog) == expected


@given(st.lists(st.integers(0, 5), min_size=1, max_size=12), st.integers(0, 20), st.integers(-1, 30),
       st.booleans())
def test_cut_step_is_the_token_by_token_rule(tokens, n_out, max_tokens, honour_eog):
    """A step (never empty: the target always adds a token) emitted one token at a time, stopping at the first end token or at the limit,
    keeps the same tokens for the same reason."""
    kept, reason = 0, None
    for t in tokens:
        if 0 <= max_tokens <= n_out + kept:
            reason = LENGTH
            break
        kept += 1
        if honour_eog and is_eog(t):
            reason = STOP
            break
        if 0 <= max_tokens == n_out + kept:
            reason = LENGTH
            break
    assert cut_step(tokens, n_out, max_tokens, is_eog if honour_eog else None) == (kept, reason)


def test_openai_names():
    assert [openai_finish_reason(r) for r in (STOP, LENGTH, CONTEXT)] == ["stop", "length",
                                                                          "length"]
    assert all(openai_finish_reason(r) in ("stop", "length") for r in FINISH_REASONS)
    with pytest.raises(ValueError, match="finish reason = 'eos' is out of range: allowed stop, length"):
        openai_finish_reason("eos")


def test_context_full():
    assert not context_full(7, 8) and context_full(8, 8) and context_full(9, 8)
