"""``python bench fleet``'s loop, smoke-sized: N replicas sharing the store log hold the store
and the calibration one server would hold, so they draft as one engine with their slots does
(the calibration arrives a request late, as a block); without the log they draft less."""
import benchlib
from fleet_report import route, run_fleet
from ngramspec.traces import read_requests


def test_replicas_with_the_log_draft_as_one_store_with_their_slots():
    reqs = read_requests(str(benchlib.TRACES / "reasoning.jsonl.gz"), 20)
    one = run_fleet(reqs, 1, "round-robin", False, 12)
    alone = run_fleet(reqs, 4, "round-robin", False, 3)
    shared = run_fleet(reqs, 4, "round-robin", True, 3)
    store_only = run_fleet(reqs, 4, "round-robin", True, 3, share_calibration=False)
    # the stores hold the same sequences, the calibrations learn from every replica's steps
    assert shared["tokens_per_step"] >= 0.99 * one["tokens_per_step"]
    assert shared["published"] == 20 and shared["ingested"] == 20 * 3 and not shared["skipped"]
    assert shared["calibration_published"] == 20
    assert shared["calibration_ingested"] == 20 * 3
    assert store_only["calibration_published"] == store_only["calibration_ingested"] == 0
    assert store_only["tokens_per_step"] < shared["tokens_per_step"]
    assert alone["tokens_per_step"] < shared["tokens_per_step"]


def test_sticky_routing_keeps_a_conversation_on_one_replica():
    reqs = read_requests(str(benchlib.TRACES / "agentic.jsonl.gz"), 80)
    homes = {}
    for req, r in zip(reqs, route(reqs, 4, "sticky")):
        assert homes.setdefault(req.extra["conversation"], r) == r
    assert len(set(homes.values())) == min(4, len(homes))
