"""Smoke run of the end-to-end report (bench/e2e_report.py) on the embedded model.

The full report takes minutes (bench/results/e2e.md); this runs its whole code path with tiny
sizes (one short code-edit and one chat prompt, 8 output tokens, one round, batches up to 4
tokens), so CI sees that every configuration still generates plain greedy decoding's output and
that the report renders. About 10-20 s on two cores.
"""
import json

import pytest

pytest.importorskip("llama_cpp")

import e2e_report  # noqa: E402
import llama_server  # noqa: E402
from ngramspec.cost import PROFILES  # noqa: E402


@pytest.fixture(scope="module")
def small_run():
    # a named cost model: no calibration in a smoke run
    return e2e_report.measure(n_code=1, n_chat=1, n_predict=8, runs=1, n_ctx=1024,
                              ks=(1, 2, 4), batch_threads=(1,), batch_reps=1,
                              code_range=(300, 700), log=lambda msg: None,
                              cost_model=PROFILES["cpu-embedded"])


def test_e2e_smoke(small_run):
    res = small_run
    names = res["settings"]["names"]
    # llama-server's configurations run where a binary is found (skipped with a note if not)
    server = llama_server.find_binary() is not None
    assert names == [n for n in e2e_report.ALL_NAMES
                     if server or n not in e2e_report.SERVER_CONFIGS]
    assert [p["family"] for p in res["per_prompt"]] == ["code-edit", "chat"]
    for row in res["per_prompt"]:
        assert set(row["configs"]) == set(names)
        for name, cell in row["configs"].items():
            assert 1 <= cell["n_output"] <= 8 and cell["tps"] > 0, name
            # Equal to plain greedy decoding, or a first difference that is a top-2 tie within
            # the float noise of the batched kernels (bench/results/e2e.md, tests/test_live.py).
            div = cell.get("divergence")
            assert cell["match"] or (div and div["within_float_noise"]), (name, div)
        assert set(row["replay"]) == set(e2e_report.CONFIGS)
        assert 0.0 <= row["match4_live"] <= 1.0
    batch = res["batch"]
    assert set(batch["ms"][1]) == {1, 2, 4} and all(v > 0 for v in batch["ms"][1].values())
    up, n = batch["ceiling"][1]
    assert n in (1, 2, 4) and up >= 1.0


def test_e2e_report_renders_and_round_trips(small_run, tmp_path):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(e2e_report._jsonable(small_run)))
    md = tmp_path / "e2e.md"
    assert e2e_report.main(["--render", str(path), "--md", str(md)]) == 0
    text = md.read_text()
    for name in small_run["settings"]["names"]:
        assert f"| {name} |" in text
    assert "ceiling" in text and "DIFFERS" not in text
    assert "## Against the oracle" in text and "| oracle (modeled) |" in text
    for row in small_run["per_prompt"]:
        assert row["oracle"] >= 1.0


def test_ceiling():
    # c(n) from the measurement this report was written with: 1 thread at 1.5k tokens
    ms = {1: 30.0, 2: 36.1, 4: 59.0, 8: 105.8, 16: 197.3, 32: 392.3, 64: 760.2}
    up, n = e2e_report.ceiling(ms)
    assert n == 64 and up == pytest.approx(64 * 30.0 / 760.2)
    assert e2e_report.match4([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == pytest.approx(0.2)


def test_server_configs_are_llama_cpp_fixed_ones():
    # llama-server runs llama.cpp's own types only, with the same flags as ngramspec's
    # configuration of the same name, and never a policy of ngramspec's.
    cfgs = e2e_report.SERVER_CONFIGS
    assert cfgs[e2e_report.LS_PLAIN] == (None, {})
    assert "llama-server ngram-mod 8/32" in cfgs and "llama-server chain" in cfgs
    for name, (types, params) in cfgs.items():
        if name == e2e_report.LS_PLAIN:
            continue
        ours = name[len(e2e_report.LS_PREFIX):]
        assert e2e_report.CONFIGS[ours] == (types, params) and ours not in e2e_report.AUTO
        assert "ngram-suffix" not in types
    assert llama_server.spec_flags(*cfgs["llama-server ngram-mod 8/16"]) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "16"]


def test_targets_from_a_result():
    # the targets table on a hand-made two-family result: auto loses on one prompt of chat,
    # wins code-edit against llama-server by 1.2x
    def cell(cpu, worst):
        # the wall-clock figures (the 2-thread targets) say the opposite of the CPU ones
        return {"vs_plain_cpu": cpu, "min_vs_plain_cpu": worst, "vs_plain": 2 - cpu,
                "min_vs_plain": 2 - worst}

    def fam(auto, fixed, server, worst):
        return {"ngram-mod 8/32 auto": cell(auto, worst), "ngram-mod": cell(fixed, fixed),
                "llama-server ngram-mod": cell(server, server)}
    res = {"settings": {"threads": 1,
                        "names": ["ngram-mod 8/32 auto", "ngram-mod", "llama-server ngram-mod"]},
           "per_family": {"code-edit": fam(1.32, 1.25, 1.1, 1.0), "chat": fam(0.99, 0.95, 0.9,
                                                                               0.95)}}
    rows = {t: met for t, _, met in e2e_report.targets(res)}
    assert rows["never slower: ngram-mod 8/32 auto >= 0.97× plain on every prompt"] is False
    assert rows["best everywhere, code-edit: auto >= the best fixed configuration"] is True
    assert rows["best everywhere, chat: auto >= the best fixed configuration"] is True
    assert rows["ahead of llama.cpp, code-edit: auto >= 1.1× llama-server's best fixed"] is True
    res["settings"]["threads"] = 2       # wall clock at 2 threads
    rows = {t: met for t, _, met in e2e_report.targets(res)}
    assert rows["never slower: ngram-mod 8/32 auto >= 0.97× plain on every prompt"] is True
    assert rows["best everywhere, code-edit: auto >= the best fixed configuration"] is False
