"""``replay --spec-policy / --cost-model``: modeled speed-ups, and fixed stays golden."""
import json

import pytest

from conftest import GOLDEN, TRACES
from golden import read_golden
from ngramspec.cost import PROFILES, modeled_speedup, step_costs
from ngramspec.replay import replay
from ngramspec.traces import read_requests
from test_replay_cli import run_cli

CHAT = str(TRACES / "chat.jsonl.gz")


def test_step_costs_follow_the_kv_length():
    cm = PROFILES["gpu"]
    steps = [[0, 0, 0], [3, 2, 1], [4, 0, 1]]
    c = step_costs(cm, 100, steps)
    assert c[0] == 1.0
    assert c[1] == pytest.approx(cm.cost(4, 101))
    assert c[2] == pytest.approx(cm.cost(5, 104))       # 100 + 1 + (1 + 2)
    assert len(step_costs(cm, 5, [])) == 0
    recs = [{"n_prompt": 100, "n_output": 1 + 1 + 3 + 1, "steps": steps}]
    m = modeled_speedup(recs, cm)
    assert m["tokens"] == 5 and m["speedup"] == pytest.approx(5 / c.sum(), abs=1e-4)


def test_replay_reports_fixed_and_auto_modeled_speedups(tmp_path):
    out = run_cli("replay", CHAT, "--limit", "5", "--cost-model", "cpu-embedded").stdout
    assert "modeled speed-up (fixed, cost model cpu-embedded)" in out
    assert "modeled speed-up (auto, cost model cpu-embedded)" in out
    dst = tmp_path / "o.jsonl"
    run_cli("replay", CHAT, "--limit", "5", "--cost-model", "cpu-embedded", "--spec-type",
            "ngram-suffix", "--output", str(dst))
    summary = json.loads(dst.read_text().splitlines()[0])["summary"]
    assert summary["spec_policy"] == "fixed"
    fixed, auto = summary["modeled"]["fixed"], summary["modeled"]["auto"]
    assert fixed["tokens"] == auto["tokens"] > 0
    # chat under a CPU cost: ngram-suffix's drafts lose as they come; auto declines them
    assert fixed["speedup"] < 0.9 < auto["speedup"]
    assert auto["policy"]["plain"] > 0


def test_replay_auto_only(tmp_path):
    dst = tmp_path / "o.jsonl"
    run_cli("replay", CHAT, "--limit", "3", "--spec-policy", "auto", "--cost-model", "gpu",
            "--output", str(dst))
    summary = json.loads(dst.read_text().splitlines()[0])["summary"]
    assert summary["spec_policy"] == "auto" and list(summary["modeled"]) == ["auto"]
    assert summary["policy"]["policy"] == "auto"


def test_replay_cost_model_file(tmp_path):
    path = tmp_path / "cm.json"
    path.write_text(json.dumps(PROFILES["gpu"].to_dict()))
    out = run_cli("replay", CHAT, "--limit", "2", "--cost-model", str(path)).stdout
    assert "cost model gpu" in out


@pytest.mark.parametrize("args, message", [
    (["--spec-policy", "auto"], "--spec-policy auto in replay needs --cost-model"),
    (["--cost-model", "nope"], "--cost-model nope: neither a file nor a profile name"),
    (["--spec-policy", "best"], "--spec-policy"),
])
def test_replay_policy_errors(args, message):
    proc = run_cli("replay", CHAT, "--limit", "1", *args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["code-edit.chain.shared", "agentic.map-k-default.shared"])
def test_fixed_policy_with_a_cost_model_keeps_golden_parity(name, tmp_path):
    """The records written are the fixed policy's, with the auto comparison run beside them."""
    path = GOLDEN / f"{name}.jsonl.gz"
    if not path.exists():
        pytest.skip(f"no golden file {path.name}")
    header, expected = read_golden(path)
    from golden import replay_args
    args, params = replay_args(header, GOLDEN, TRACES)
    requests = read_requests(args.traces[0], args.limit)
    from ngramspec.policy import make_policy
    result = replay(requests, args.spec_type, params, state=args.state, n_slots=args.slots,
                    record_drafts=True, policy_factory=lambda: make_policy("fixed"))
    for got, want in zip(result.requests, expected):
        assert got["drafts"] == want["drafts"] and got["steps"] == want["steps"]
