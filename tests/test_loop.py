"""The one slot loop (ngramspec.loop): llama-server's bound, begin/draft/accept order, targets
that end early, a driver's cut, and a policy's moments around the loop (the driver calls them:
DraftPolicy.draft / verify). Golden parity of the loop itself is tests/test_golden.py."""
import numpy as np
import pytest

from ngramspec import SpecEngine
from ngramspec.loop import SlotLoop, draft_budget, run_recorded
from ngramspec.policy import FIXED, DraftPolicy
from ngramspec.validation import OutOfRange


class ScriptedEngine:
    """An engine that drafts from a script and records every call it gets."""

    def __init__(self, drafts=()):
        self.script = [np.asarray(d, dtype=np.int32) for d in drafts]
        self.calls = []

    def begin(self, slot, prompt):
        self.calls.append(("begin", slot, list(prompt)))

    def draft(self, slot, context, sampled, n_max):
        self.calls.append(("draft", slot, list(context), sampled, n_max))
        d = self.script.pop(0) if self.script else np.empty(0, dtype=np.int32)
        return d if n_max is None else d[:n_max]

    def accept(self, slot, n):
        self.calls.append(("accept", slot, n))


def test_step_order_context_and_record():
    eng = ScriptedEngine([[5, 6, 7], [], [9]])
    loop = SlotLoop(eng, 2, [1, 2, 3], 4)
    assert eng.calls == [("begin", 2, [1, 2, 3])]
    assert (loop.sampled, loop.n_output, loop.done) == (4, 1, False)
    assert loop.propose().tolist() == [5, 6, 7]
    assert loop.verify([5, 6, 8, 0]) == 2          # mismatch at 2: the target's own token is 8
    assert loop.context.tolist() == [1, 2, 3, 4, 5, 6]
    assert (loop.sampled, loop.n_output) == (8, 4)
    assert loop.propose().tolist() == []           # empty draft: no accept
    assert loop.verify([3]) == 0
    assert loop.propose().tolist() == [9]
    assert loop.verify([0, 1]) == 0                # rejected: accept(0) all the same
    assert [c[0] for c in eng.calls] == ["begin", "draft", "accept", "draft", "draft", "accept"]
    assert eng.calls[2] == ("accept", 2, 2) and eng.calls[5] == ("accept", 2, 0)
    assert eng.calls[3][2:4] == ([1, 2, 3, 4, 5, 6], 8)
    rec = loop.record()
    assert rec["steps"] == [[3, 2, 1], [0, 0, 1], [1, 0, 1]]
    assert (rec["n_output"], rec["n_steps"], rec["n_draft_calls"], rec["n_drafts"],
            rec["n_draft_tokens"], rec["n_acc_drafts"], rec["n_acc_tokens"]) == (6, 3, 3, 2, 4,
                                                                                 1, 2)
    assert rec["acc_rate"] == 0.5 and rec["tokens_per_step"] == round(5 / 3, 4)
    assert loop.timers.n_begin == 1 and loop.timers.n_draft == 3 and loop.timers.n_accept == 2


def test_context_bound_and_no_call_when_it_is_not_positive():
    eng = ScriptedEngine([[7] * 10] * 4)
    loop = SlotLoop(eng, 0, list(range(10)), 1, n_ctx=16)
    bounds = []
    while not loop.done and loop.n_context < 16:
        d = loop.propose()
        bounds.append(loop.n_draft_max)
        loop.verify(list(d) + [3])                 # the whole draft accepted
    assert bounds[0] == 16 - 10 - 2
    assert [c[4] for c in eng.calls if c[0] == "draft"] == [b for b in bounds if b > 0]
    assert loop.steps[-1][2] == 0                  # bound <= 0: a plain step, no draft call
    assert all(s[0] <= 16 - 2 for s in loop.steps)


def test_the_driver_bound_is_per_call_and_joins_the_server_bound():
    """propose(n_max) takes the step's budget, which the driver computes once (draft_budget: its
    caps and the loop's room, n_ctx - L - 2); the loop only checks it (issue 39)."""
    eng = ScriptedEngine([[7] * 10] * 3)
    loop = SlotLoop(eng, 0, list(range(10)), 1)
    assert loop.propose(3).tolist() == [7, 7, 7] and loop.n_draft_max == 3
    loop.verify([7, 7, 7, 2])
    assert loop.propose().size == 10 and loop.n_draft_max is None
    loop.verify([0])
    bounded = SlotLoop(ScriptedEngine([[7] * 10]), 0, list(range(10)), 1, n_ctx=16)
    assert bounded.room() == 16 - 10 - 2 and draft_budget(bounded, 5, None) == 4
    assert draft_budget(bounded, 3) == 3 and draft_budget(loop) is None
    with pytest.raises(OutOfRange, match=r"^n_max = 5 is out of range: allowed <= 4 \(the loop's"):
        bounded.propose(5)                         # beyond the room: the driver's mistake
    assert bounded.propose(draft_budget(bounded, 5)).size == 4 and bounded.n_draft_max == 4
    with pytest.raises(TypeError):
        SlotLoop(eng, 0, [1], 2, n_max=4)          # one way only: the per-call bound


def test_n_predict_bounds_drafts_and_ends_the_request():
    eng = ScriptedEngine([[7] * 10] * 4)
    loop = SlotLoop(eng, 0, [1, 2], 1, n_predict=5)
    assert loop.propose().tolist() == [7] * 3      # n_remaining - 1 = 5 - 1 - 1
    loop.verify([7, 7, 7, 9])
    assert loop.n_output == 5 and loop.done
    with pytest.raises(RuntimeError, match="finished"):
        loop.propose()
    assert SlotLoop(None, 0, [1], 1, n_predict=1).done


def test_a_target_that_ends_with_the_draft_ends_the_request():
    loop = SlotLoop(ScriptedEngine([[4, 5]]), 0, [1, 2, 3], 3)
    loop.propose()
    assert loop.verify([4, 5]) == 2
    assert loop.done and loop.n_output == 3 and loop.context.tolist() == [1, 2, 3, 3, 4, 5]


def test_n_verified_cuts_the_compared_draft():
    eng = ScriptedEngine([[4, 5, 6]])
    loop = SlotLoop(eng, 0, [1], 2)
    loop.propose()
    assert loop.verify([4, 5], n_verified=1) == 1
    assert eng.calls[-1] == ("accept", 0, 1) and loop.sampled == 5


def test_n_verified_out_of_range_leaves_the_step_open():
    loop = SlotLoop(ScriptedEngine([[4, 5]]), 0, [1], 2)
    loop.propose()
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=f"n_verified = {bad} is out of range: allowed 0 .. 2"):
            loop.verify([4, 5, 6], n_verified=bad)
    assert loop.verify([4, 5, 6]) == 2


def test_misuse_raises():
    loop = SlotLoop(ScriptedEngine(), 0, [1], 2)
    with pytest.raises(RuntimeError, match="without propose"):
        loop.verify([1])
    loop.propose()
    with pytest.raises(RuntimeError, match="twice"):
        loop.propose()


def test_no_engine_is_plain_decoding():
    loop = SlotLoop(None, 0, [1, 2], 3)
    for t in (4, 5):
        assert loop.propose().size == 0
        loop.verify([t])
    assert loop.steps == [[0, 0, 0], [0, 0, 0]] and loop.context.tolist() == [1, 2, 3, 4]
    assert loop.timers.n_begin == 0


def test_context_buffer_grows_past_capacity():
    eng = ScriptedEngine([[9] * 50] * 10)
    loop = SlotLoop(eng, 0, [1], 2, capacity=4)
    expect = [1]
    while loop.n_output < 300:
        d = loop.propose()
        expect += [loop.sampled] + d.tolist()
        loop.verify(list(d) + [8])
    assert loop.context.tolist() == expect
    assert eng.calls[-1][0] == "accept" and eng.calls[-2][2] == expect[:len(eng.calls[-2][2])]


def test_a_drivers_cut_is_what_verify_verifies_and_counts():
    eng = ScriptedEngine([[4, 5, 6, 7]])
    loop = SlotLoop(eng, 0, [1, 2], 3)
    with pytest.raises(RuntimeError, match="without propose"):
        loop.cut(0)
    loop.propose()
    with pytest.raises(ValueError, match=r"cut\(5\) is out of range: allowed 0 .. 4"):
        loop.cut(5)
    assert loop.pending_draft.tolist() == [4, 5, 6, 7]      # a refused cut changes nothing
    assert loop.cut(2).tolist() == [4, 5] and loop.pending_draft.tolist() == [4, 5]
    assert loop.verify([4, 5, 6]) == 2
    assert loop.steps == [[2, 2, 1]] and loop.n_draft_tokens == 2 and loop.sampled == 6


class Recorder(DraftPolicy):
    """A policy recording its moments; the driver calls them (the loop knows no policy)."""

    def __init__(self, lower, keep):
        self.lower, self.keep, self.seen = lower, keep, []

    def before_draft(self, loop, bound):
        self.seen.append(("before", bound, len(loop.engine.calls)))
        return self.lower

    def after_draft(self, loop, draft):
        self.seen.append(("after", draft.tolist(), loop.pending_draft.tolist()))
        return min(self.keep, len(draft))

    def observe(self, loop, n_draft, n_acc):
        self.seen.append(("observe", n_draft, n_acc, loop.n_context))


def test_policy_lowers_the_bound_and_shortens_the_draft():
    eng = ScriptedEngine([[4, 5, 6, 7, 8]])
    pol = Recorder(lower=4, keep=2)
    loop = SlotLoop(eng, 0, [1, 2], 3, n_ctx=100)
    assert pol.draft(loop).tolist() == [4, 5]     # budget None: the loop's room
    assert eng.calls[-1][4] == 4                   # min(100 - 2 - 2, 4)
    assert pol.verify(loop, [4, 5, 6]) == 2
    # before the draft call (only begin so far), after it, after the verification
    assert pol.seen == [("before", 96, 1), ("after", [4, 5, 6, 7], [4, 5, 6, 7]),
                        ("observe", 2, 2, 5)]
    assert eng.calls[-1] == ("accept", 0, 2) and loop.steps == [[2, 2, 1]]


def test_policy_sees_the_drivers_budget_which_the_loop_checks_first():
    pol = Recorder(lower=None, keep=9)
    loop = SlotLoop(ScriptedEngine([[4, 5, 6]]), 0, [1, 2], 3, n_ctx=10)
    with pytest.raises(OutOfRange, match=r"^n_max = 7 is out of range: allowed <= 6"):
        pol.draft(loop, 7)                         # beyond the room: refused before the policy
    assert pol.seen == []
    assert pol.draft(loop, draft_budget(loop, 2)).tolist() == [4, 5]
    assert pol.seen[0] == ("before", 2, 1) and loop.n_draft_max == 2


def test_policy_zero_bound_is_a_plain_step():
    eng = ScriptedEngine([[4]])
    pol = Recorder(lower=0, keep=9)
    loop = SlotLoop(eng, 0, [1], 3)
    assert pol.draft(loop).size == 0
    pol.verify(loop, [5])
    assert [c[0] for c in eng.calls] == ["begin"] and loop.steps == [[0, 0, 0]]
    assert pol.seen == [("before", None, 1), ("after", [], []), ("observe", 0, 0, 2)]


def test_policy_out_of_range_keep_is_refused():
    class Bad(DraftPolicy):
        def after_draft(self, loop, draft):
            return len(draft) + 1
    loop = SlotLoop(ScriptedEngine([[4]]), 0, [1], 3)
    with pytest.raises(ValueError, match=r"cut\(2\) is out of range: allowed 0 .. 1"):
        Bad().draft(loop)


def test_fixed_policy_is_the_loops_own_calls():
    """FIXED (llama.cpp's) and the base policy's no-op moments give the same steps as driving
    the loop directly."""
    steps = []
    for drive in (None, FIXED, DraftPolicy()):
        eng = ScriptedEngine([[5, 6, 7], [], [9], [4, 4]])
        loop = SlotLoop(eng, 0, [1, 2, 3], 4, n_ctx=12)
        for target in ([5, 6, 8, 0], [3], [0, 1], [4, 4, 4]):
            if drive is None:
                loop.propose(draft_budget(loop, 2))
                loop.verify(target)
            else:
                drive.draft(loop, draft_budget(loop, 2))
                drive.verify(loop, target)
        steps.append((loop.steps, loop.context.tolist(), eng.calls))
    assert steps[0] == steps[1] == steps[2]


def test_run_recorded_with_a_real_engine():
    prompt = np.array([1, 2, 3, 4, 5, 6, 1, 2, 3], dtype=np.int32)
    output = np.array([4, 5, 6, 1, 2, 3, 4, 5, 9], dtype=np.int32)
    e = SpecEngine("ngram-simple", ngram_simple_size_n=2, ngram_simple_size_m=3)
    loop = run_recorded(e, 0, prompt, output, record_drafts=True)
    assert loop.done is False and loop.n_output == len(output)
    rec = loop.record()
    # context [..1 2 3] + sampled 4: "3 4" -> "5 6 1" all accepted, then sampled 2 ...
    assert rec["drafts"][0] == [5, 6, 1]
    assert rec["steps"][0] == [3, 3, 1]
    assert loop.context.tolist() + [loop.sampled] == prompt.tolist() + output.tolist()
    s = e.stats()[0]
    assert (s["gen_tokens"], s["acc_tokens"]) == (rec["n_draft_tokens"], rec["n_acc_tokens"])
    for out in ([], [7]):
        rec = run_recorded(SpecEngine("ngram-simple"), 0, prompt, np.array(out, np.int32)).record()
        assert rec["n_output"] == len(out) and rec["steps"] == []


# -- one engine contract, one counter type (issue 39) ----------------------------------------

def test_the_engines_implement_one_contract():
    from ngramspec.draft_engine import NO_DRAFT, DraftEngine
    from ngramspec.prediction import PredictedEngine, PredictionDrafter
    chain = SpecEngine("ngram-mod")
    for eng in (chain, PredictedEngine(PredictionDrafter([1, 2, 3]), chain),
                PredictedEngine(PredictionDrafter([1, 2, 3])), NO_DRAFT):
        assert isinstance(eng, DraftEngine), eng
    assert not isinstance(ScriptedEngine(), DraftEngine)   # begin/draft/accept are not all
    assert (NO_DRAFT.speculates, NO_DRAFT.proposers, NO_DRAFT.stats()) == (False, (), [])
    assert chain.speculates and chain.accepted_prediction_tokens == 0


def test_no_engine_is_the_no_draft_engine():
    from ngramspec.draft_engine import NO_DRAFT
    for engine in (None, NO_DRAFT):
        loop = SlotLoop(engine, 0, [1, 2], 3)
        assert loop.engine is NO_DRAFT
        assert loop.propose().tolist() == []
        loop.verify([4])
        assert loop.counts.n_draft_calls == 0 and loop.timers.n_begin == 0
        assert loop.steps == [[0, 0, 0]]


def test_the_loop_counts_in_one_draft_counts():
    from ngramspec.stats import DraftCounts
    eng = ScriptedEngine([[5, 6, 7], [], [9, 9]])
    loop = SlotLoop(eng, 0, [1, 2, 3], 4)
    for target in ([5, 6, 8, 0], [3], [1]):
        loop.propose()
        loop.verify(target)
    assert loop.counts == DraftCounts(n_draft_calls=3, n_drafts=2, n_draft_tokens=5,
                                      n_acc_drafts=1, n_acc_tokens=2)
    rec = loop.record()
    assert {k: rec[k] for k in loop.counts.as_dict()} == loop.counts.as_dict()
    assert list(rec)[4:10] == ["n_draft_calls", "n_drafts", "n_draft_tokens", "n_acc_drafts",
                               "n_acc_tokens", "acc_rate"]     # the golden files' order
    assert rec["acc_rate"] == loop.counts.acc_rate == 0.4
    total = DraftCounts().add(loop.counts).add(loop.counts)
    assert total.n_acc_tokens == 4 and total.n_draft_calls == 6 and loop.counts.n_acc_tokens == 2


# -- bounded step records (issue 36: a host's request may run for hours) --------------------

def test_keep_steps_bounds_the_records_and_counts_them_all():
    """With ``keep_steps`` the loop keeps only its last records (O(keep) memory, not O(steps))
    and counts every step; everything else (context, counts, drafts, engine calls) is the
    unbounded loop's."""
    script = [[5, 6, 7], [], [9], [4, 4]] * 15
    targets = [[5, 6, 8, 0], [3], [0, 1], [4, 4, 4]] * 15
    full, kept = (SlotLoop(ScriptedEngine(script), 0, [1, 2, 3], 4, keep_steps=k)
                  for k in (None, 4))
    for i, target in enumerate(targets):
        for loop in (full, kept):
            loop.propose()
            loop.verify(target)
        assert 4 <= len(kept.steps) <= 8 or len(kept.steps) == i + 1
        assert kept.steps == full.steps[-len(kept.steps):]
    assert kept.n_steps == full.n_steps == len(full.steps) == len(targets)
    assert kept.engine.calls == full.engine.calls
    assert kept.context.tolist() == full.context.tolist() and kept.counts == full.counts
    rec_full, rec_kept = full.record(), kept.record()
    assert len(rec_kept.pop("steps")) <= 8 and len(rec_full.pop("steps")) == len(targets)
    assert rec_kept == rec_full
    with pytest.raises(OutOfRange, match="keep_steps"):
        SlotLoop(ScriptedEngine(), 0, [1], 2, keep_steps=0)


def test_a_step_verified_against_none_of_its_draft():
    """``n_verified=0`` (a host's step that decoded none of the draft): nothing compared,
    accept(0) all the same, the draft counted as verified and rejected."""
    eng = ScriptedEngine([[4, 5]])
    loop = SlotLoop(eng, 0, [1], 2)
    loop.propose()
    assert loop.verify([4], n_verified=0) == 0
    assert eng.calls[-1] == ("accept", 0, 0) and loop.sampled == 4
    assert loop.steps == [[2, 0, 1]] and loop.context.tolist() == [1, 2]
    assert (loop.counts.n_drafts, loop.counts.n_draft_tokens, loop.counts.n_acc_tokens) == (
        1, 2, 0)
