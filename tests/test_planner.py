"""The scheduler's planner without a model: which requests end before a step, which tokens of
which slots one decode gets (drafts bounded by the batch and the request, cut by the joint
policy), which prompt chunks fill the rest."""
import ast
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest

from ngramspec.llama import planner
from ngramspec.llama.planner import PREFILL_RESERVE, plan_step
from ngramspec.draft_engine import EngineDefaults
from ngramspec.loop import SlotLoop
from ngramspec.policy import FIXED, DraftPolicy
from ngramspec.stop_rules import CANCELLED, CONTEXT


class LongDrafts(EngineDefaults):
    """An engine that drafts as many tokens as it may (100, 101, ...), or none below `least`."""

    def __init__(self, least=0):
        self.least = least
        self.bounds = []

    def begin(self, slot, prompt):
        pass

    def draft(self, slot, context, sampled, n_max):
        self.bounds.append(n_max)
        n = 40 if n_max is None else n_max
        return np.arange(100, 100 + n, dtype=np.int32) if n >= self.least else []

    def accept(self, slot, n):
        pass


def generating(slot, n_context=10, engine=None, n_max=None, n_min=0, policy=FIXED):
    loop = SlotLoop(engine or LongDrafts(), slot, np.arange(1, n_context + 1), 7)
    return SimpleNamespace(cancel_requested=False, loop=loop, policy=policy,
                           slot=SimpleNamespace(id=slot),
                           spec=SimpleNamespace(n_max=n_max, n_min=n_min),
                           prompt=np.arange(1, n_context + 1, dtype=np.int32),
                           n_past=n_context)


def prompting(slot, size, n_past=0):
    return SimpleNamespace(cancel_requested=False, loop=None, policy=FIXED,
                           slot=SimpleNamespace(id=slot),
                           spec=SimpleNamespace(n_max=None, n_min=0),
                           prompt=np.arange(1, size + 1, dtype=np.int32), n_past=n_past)


def test_each_slot_gets_its_share_of_the_batch():
    a, b = generating(0, 10), generating(1, 20)
    plan = plan_step([a, b], n_batch=16, n_ctx_slot=64)
    assert plan.finishes == () and plan.chunks == ()
    assert [v.req for v in plan.verifies] == [a, b]
    for v, r in zip(plan.verifies, (a, b)):
        # [sampled] + draft at the slot's next position, 16 // 2 tokens each
        assert v.tokens[0] == 7 and len(v.tokens) == 8
        assert v.draft.tolist() == list(range(100, 107))
        assert v.pos0 == r.loop.n_context and v.seq == r.slot.id
        assert r.loop.pending_draft.tolist() == v.draft.tolist()
    assert plan.n_tokens == 16


def test_prompts_keep_a_reserve_and_fill_the_rest():
    a, b = generating(0), generating(1)
    p = prompting(2, size=30, n_past=3)
    n_batch = 32
    plan = plan_step([a, p, b], n_batch=n_batch, n_ctx_slot=64)
    reserve = min(PREFILL_RESERVE, n_batch // 4)
    assert [len(v.tokens) for v in plan.verifies] == [(n_batch - reserve) // 2] * 2
    (chunk,) = plan.chunks
    assert (chunk.req, chunk.seq, chunk.start) == (p, 2, 3)
    assert chunk.stop - chunk.start == n_batch - 2 * 12 and not chunk.last
    assert chunk.tokens.tolist() == list(range(4, 4 + 8))
    assert plan.n_tokens == n_batch
    assert p.n_past == 3            # the executor's update advances it, not the plan


def test_a_prompt_that_fits_is_its_last_chunk_and_a_full_batch_leaves_prompts_out():
    p, q = prompting(0, size=5, n_past=2), prompting(1, size=100)
    plan = plan_step([p, q], n_batch=8, n_ctx_slot=128)
    assert [(c.start, c.stop, c.last) for c in plan.chunks] == [(2, 5, True), (0, 5, False)]
    assert str(plan) == "prompt slot 0: 2 .. 5 (last)\nprompt slot 1: 0 .. 5"
    r = prompting(2, size=50)
    plan = plan_step([q, r], n_batch=8, n_ctx_slot=128)
    assert [c.req for c in plan.chunks] == [q]


def test_request_bounds_and_drafts_below_n_min():
    short = generating(0, n_max=2)
    dropped = generating(1, engine=LongDrafts(least=10), n_min=10)   # gets at most 7
    plan = plan_step([short, dropped], n_batch=16, n_ctx_slot=64)
    assert [len(v.draft) for v in plan.verifies] == [2, 0]


def test_cancelled_and_full_requests_end_before_the_decode():
    gone, full, fine = generating(0), generating(1, n_context=64), generating(2, n_context=63)
    gone.cancel_requested = True
    pending = prompting(3, size=4)
    pending.cancel_requested = True
    plan = plan_step([gone, full, fine, pending], n_batch=32, n_ctx_slot=64)
    assert plan.finishes == ((gone, CANCELLED), (pending, CANCELLED), (full, CONTEXT))
    assert [v.req for v in plan.verifies] == [fine] and plan.chunks == ()
    draft = plan.verifies[0].draft.tolist()
    assert str(plan).splitlines() == ["end slot 0: cancelled", "end slot 3: cancelled",
                                      "end slot 1: context",
                                      f"verify slot 2 at 63: 7 + draft {draft}"]
    assert gone.loop.pending_draft.size == 0 and full.loop.pending_draft.size == 0


class Joint(DraftPolicy):
    """A joint policy that verifies one token of each of its drafts, and records its inputs."""

    def __init__(self):
        self.calls = []
        self.drafted = []

    def after_draft(self, loop, draft):
        self.drafted.append(loop.slot)      # the planner drafts through the request's policy
        return len(draft)

    def choose(self, loops, budgets, n_base=None, e_base=None):
        assert list(budgets) == [len(lp.pending_draft) for lp in loops]
        self.calls.append(([lp.slot for lp in loops], n_base, e_base))
        return [1] * len(loops)


def test_the_joint_policy_cuts_its_drafts_for_the_whole_step():
    joint = Joint()
    auto, fixed = generating(0, policy=joint), generating(1, n_max=3)
    p = prompting(2, size=200)
    plan = plan_step([auto, fixed, p], n_batch=64, n_ctx_slot=512, joint=joint)
    cut, whole = plan.verifies
    assert cut.draft.tolist() == [100] and len(whole.draft) == 3
    # the loop keeps its whole draft: verification counts the cut part as not verified
    assert auto.loop.pending_draft.size > 1
    # the step's other tokens: two sampled, the fixed draft, the prompt tokens that fit
    ((slots, n_base, e_base),) = joint.calls
    assert slots == [0] and e_base == 2.0 and n_base == 2 + 3 + (64 - 2 - 3)
    assert joint.drafted == [0]        # the fixed request drafted through FIXED
    assert plan.n_tokens == 64


def test_nothing_to_do_is_an_empty_plan():
    plan = plan_step([], n_batch=8, n_ctx_slot=64)
    assert plan.n_tokens == 0 and plan.verifies == plan.chunks == plan.finishes == ()
    assert str(plan) == "nothing to decode"
    with pytest.raises(Exception):
        plan.finishes = ()          # a plan is a value


def test_the_planner_imports_no_llama_binding():
    """No llama_cpp, ctypes or sibling module of ngramspec.llama (all of which reach a context):
    the planner is plain Python over the loops."""
    tree = ast.parse(pathlib.Path(planner.__file__).read_text(encoding="utf-8"))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [("." * n.level) + (n.module or "") for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.startswith((".", "llama_cpp", "ctypes",
                                                                   "ngramspec.llama"))]
