"""The modeled policy report (bench/policy_report.py): its figures are the replay's, priced right.

Everything but `generate_outputs` runs on recorded trace outputs and named cost profiles (no
model, a few seconds); the generation path runs once on the embedded model with a short output.
"""
import gzip
import json

import numpy as np
import pytest

import policy_report
from ngramspec.cost import PROFILES, modeled_speedup, step_costs
from ngramspec.replay import replay
from ngramspec.traces import Request

CPU = PROFILES["cpu-embedded"]


@pytest.fixture(scope="module")
def rows():
    return policy_report.recorded_outputs(1, 96)


def test_recorded_outputs_one_prompt_per_family(rows):
    assert [r["family"] for r in rows] == list(policy_report.FAMILIES)
    assert all(0 < len(r["output"]) <= 96 and 0 < len(r["prompt"]) <= 3500 for r in rows)


def test_modeled_figures_are_the_replays_steps_priced(rows):
    names = ["ngram-mod 8/32", "chain", "ngram-mod 8/32 auto"]
    per_prompt = policy_report.evaluate(rows, CPU, names)
    for row, res in zip(rows, per_prompt):
        # recomputed independently: the fixed configuration's replay, its steps priced one by one
        req = Request(row["id"], np.asarray(row["prompt"], np.int32),
                      np.asarray(row["output"], np.int32), {})
        rec = replay([req], "ngram-mod", {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32},
                     state="fresh").requests[0]
        cost = step_costs(CPU, len(row["prompt"]), rec["steps"]).sum()
        assert res["ngram-mod 8/32"] == pytest.approx((len(row["output"]) - 1) / cost, abs=1e-4)
        assert res["ngram-mod 8/32"] == modeled_speedup([rec], CPU)["speedup"]
        # no drafter beats the oracle (drafts of at most 64 tokens, as the oracle's)
        for name in names:
            assert 0 < res[name] <= res["oracle"] + 1e-9, name
    summary = policy_report.summarize(per_prompt, names)
    assert summary["all"]["n"] == len(rows)
    for name in names:
        values = [p[name] for p in per_prompt]
        assert summary["all"][name]["min"] == round(min(values), 4)
        assert min(values) <= summary["all"][name]["geomean"] <= max(values)


def test_main_writes_the_report(tmp_path):
    md, js = tmp_path / "p.md", tmp_path / "p.json"
    assert policy_report.main(["--recorded", "1", "--n-predict", "48", "--cost-model", "gpu",
                               "--configs", "ngram-mod,ngram-mod 8/32 auto",
                               "--md", str(md), "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["names"] == ["ngram-mod", "ngram-mod 8/32 auto"]
    assert len(res["per_prompt"]) == 4
    text = md.read_text()
    assert "| ngram-mod 8/32 auto |" in text and "gpu" in res["cost_model"].lower()


def test_bad_arguments_are_usage_errors(capsys):
    for argv, msg in ((["--configs", "ngram-nope"], "--configs: unknown ngram-nope"),
                      (["--cost-model", "no-such-profile"], "--cost-model no-such-profile"),
                      (["--recorded", "0"], "--recorded must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            policy_report.main(argv)
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


def test_generated_outputs_are_plain_greedy_decoding(tmp_path):
    pytest.importorskip("llama_cpp")
    from ngramspec.llama import generate_plain, load_model
    from ngramspec.llama.model import default_model_path
    path = tmp_path / "out.jsonl.gz"
    counts = {"code-edit": 0, "chat": 1, "reasoning": 0, "agentic": 0}
    rows = policy_report.generate_outputs(path, counts, 12, log=lambda msg: None)
    assert policy_report.read_outputs(path) == rows
    with gzip.open(path, "rt") as f:
        assert len(f.readlines()) == 1
    llm = load_model(default_model_path(), n_ctx=1024, n_threads=1)
    again = generate_plain(llm, rows[0]["prompt"], n_predict=12).output_tokens
    assert rows[0]["output"] == [int(t) for t in again] and len(again) == 12
