"""``python bench fleet``'s loop, smoke-sized: N replicas sharing the store log hold the store
one server would hold, so they draft almost as one engine with their slots does (what differs is
the calibration, which each replica learns from its share of the traffic); without the log they
draft less."""
import benchlib
from fleet_report import route, run_fleet
from ngramspec.traces import read_requests


def test_replicas_with_the_log_draft_as_one_store_with_their_slots():
    reqs = read_requests(str(benchlib.TRACES / "reasoning.jsonl.gz"), 20)
    one = run_fleet(reqs, 1, "round-robin", False, 12)
    alone = run_fleet(reqs, 4, "round-robin", False, 3)
    shared = run_fleet(reqs, 4, "round-robin", True, 3)
    # the stores hold the same sequences; each replica's calibration sees a quarter of the steps
    assert shared["tokens_per_step"] >= 0.97 * one["tokens_per_step"]
    assert shared["published"] == 20 and shared["ingested"] == 20 * 3 and not shared["skipped"]
    assert alone["tokens_per_step"] < shared["tokens_per_step"]


def test_sticky_routing_keeps_a_conversation_on_one_replica():
    reqs = read_requests(str(benchlib.TRACES / "agentic.jsonl.gz"), 80)
    homes = {}
    for req, r in zip(reqs, route(reqs, 4, "sticky")):
        assert homes.setdefault(req.extra["conversation"], r) == r
    assert len(set(homes.values())) == min(4, len(homes))
