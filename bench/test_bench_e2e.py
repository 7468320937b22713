"""Smoke run of the end-to-end report (bench/e2e_report.py) on the embedded model.

The full report takes minutes (bench/results/e2e.md); this runs its whole code path with tiny
sizes (one short code-edit and one chat prompt, 8 output tokens, one round, batches up to 4
tokens), so CI sees that every configuration still generates plain greedy decoding's output and
that the report renders. About 10-20 s on two cores.
"""
import copy
import json
import types

import pytest

pytest.importorskip("llama_cpp")

import e2e_report  # noqa: E402
import llama_server  # noqa: E402
from ngramspec import SpecEngine  # noqa: E402
from ngramspec.cost import PROFILES, step_costs  # noqa: E402
from ngramspec.llama import generate_speculative, load_model  # noqa: E402
from ngramspec.llama.model import default_model_path  # noqa: E402


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


def test_modeled_speedup_prices_the_live_steps():
    # A real short live run: the modeled figure is (n_output - 1) over the live steps' cost
    # under the run's cost model, computed here by hand from an independent run's own steps.
    cm = PROFILES["cpu-embedded"]
    models = types.SimpleNamespace(ours=load_model(default_model_path(), n_ctx=1024,
                                                   n_threads=1), cost_model=cm)
    (_, req), = e2e_report.load_prompts(1, 0, code_range=(300, 700))
    plain = e2e_report.run_ours(models, e2e_report.PLAIN, req.prompt, 32)
    assert plain["step_shapes"] is None and plain["modeled"] == 1.0
    name = "ngram-suffix"     # drafts within 32 tokens of this prompt (ngram-mod does not)
    rec = e2e_report.run_ours(models, name, req.prompt, 32)
    types_, params = e2e_report.CONFIGS[name]
    ref = generate_speculative(models.ours, req.prompt, SpecEngine(types_, **params),
                               n_predict=32, record_steps=True)
    assert rec["tokens"] == ref.output_tokens
    assert any(len(draft) for _, _, draft, _ in ref.steps)   # it drafted: batches above 1
    assert rec["step_shapes"] == [(len(draft) + 1, L) for L, _, draft, _ in ref.steps]
    by_hand = sum(cm.cost(len(draft) + 1, L) for L, _, draft, _ in ref.steps)
    assert rec["modeled_cost"] == pytest.approx(by_hand, rel=1e-12)
    assert rec["modeled"] == pytest.approx((ref.n_output - 1) / by_hand, rel=1e-12)
    # the same steps as the replay's records price them (KV lengths derived from the prompt)
    derived = step_costs(cm, len(req.prompt),
                         [(len(draft), k, 1) for _, _, draft, k in ref.steps]).sum()
    assert by_hand == pytest.approx(derived, rel=1e-12)
    # two identical rounds: the ratio to plain is the modeled figure, the rounds equal
    cell = e2e_report.modeled_cell([rec, rec], [plain, plain])
    assert cell == {"modeled_vs_plain": rec["modeled"], "modeled_rounds_equal": True}
    other = dict(rec, step_shapes=rec["step_shapes"][:-1], modeled=rec["modeled"] * 0.9)
    cell = e2e_report.modeled_cell([rec, other], [plain, plain])
    assert cell["modeled_rounds_equal"] is False
    assert cell["modeled_vs_plain_range"] == [other["modeled"], rec["modeled"]]


def test_modeled_figures_in_the_report(small_run):
    names = small_run["settings"]["names"]
    ours = [n for n in names if n == e2e_report.PLAIN or n in e2e_report.CONFIGS]
    for row in small_run["per_prompt"]:
        assert row["configs"][e2e_report.PLAIN]["modeled_vs_plain"] == 1.0
        for name in names:
            cell = row["configs"][name]
            assert ("modeled_vs_plain" in cell) == (name in ours), name
            if name in ours:
                assert cell["modeled_vs_plain"] > 0 and cell["modeled_rounds_equal"], name
    for fam in small_run["per_family"].values():
        assert fam[e2e_report.PLAIN]["modeled_vs_plain"] == 1.0
        assert all("modeled_vs_plain" in fam[n] for n in ours)
    text = e2e_report.render(small_run)
    assert "code-edit: × plain (modeled)" in text and "| modeled × plain |" in text
    worst = [fig for t, fig, _ in e2e_report.targets(small_run) if t.startswith("never slower")]
    assert worst and all("modeled worst prompt " in f and "—" not in f for f in worst)


def test_render_without_modeled_fields(small_run, tmp_path):
    # a results file written before the modeled figures: rendered with "—" in their place
    old = copy.deepcopy(e2e_report._jsonable(small_run))
    for row in old["per_prompt"]:
        for cell in row["configs"].values():
            for k in ("modeled_vs_plain", "modeled_rounds_equal", "modeled_vs_plain_range"):
                cell.pop(k, None)
    for fam in old["per_family"].values():
        for cell in fam.values():
            cell.pop("modeled_vs_plain", None)
            cell.pop("min_modeled_vs_plain", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    md = tmp_path / "old.md"
    assert e2e_report.main(["--render", str(path), "--md", str(md)]) == 0
    text = md.read_text()
    plain = next(line for line in text.splitlines()
                 if line.startswith(f"| {e2e_report.PLAIN} | ") and line.count("|") > 8)
    assert "| — |" in plain
    assert "modeled worst prompt —" in text
