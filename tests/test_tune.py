"""``ngramspec.tune``: the sweep, the scores, the ranking and the plots."""
import math

import pytest

from ngramspec.replay import replay
from ngramspec.traces import read_requests
from ngramspec.cost import CostModel, modeled_speedup
from ngramspec.tune import (GRIDS, LLAMA_TYPES, MOD_N_MIN_FRACTIONS, NGRAMSPEC_GRIDS, STATIC,
                            Config, all_params, auto_configs, chain_configs, evaluate,
                            split_requests, sweep_configs, tune, type_param_names)

from conftest import TRACES

pytest.importorskip("matplotlib")


def _cost_model():
    """A verify-cost curve that grows with the batch and with the KV cache (two rows), so the
    context length of each step matters."""
    ks = [1, 2, 4, 8, 16, 64]
    short = [10.0, 11.0, 13.0, 17.0, 25.0, 73.0]
    long = [20.0, 23.0, 29.0, 41.0, 65.0, 209.0]
    return CostModel(ks, [0, 4096], [short, long], name="test", source="tests/test_tune.py")


@pytest.fixture(scope="module")
def small():
    """The first 10 requests of the model-generated family: 5 for training, 5 held out."""
    return split_requests(read_requests(str(TRACES / "model-generated.jsonl.gz"), 10), 0.5)


@pytest.fixture(scope="module")
def report(small, tmp_path_factory):
    train, heldout = small
    static = str(tmp_path_factory.mktemp("tune") / "static.bin")
    return tune(train, heldout, _cost_model(), slots=(1, 3), static_path=static, jobs=1)


def test_split_keeps_order_and_holds_out_the_last_requests(small):
    reqs = read_requests(str(TRACES / "model-generated.jsonl.gz"), 10)
    train, heldout = split_requests(reqs, 0.3)
    assert [r.id for r in train] == [r.id for r in reqs[:7]]
    assert [r.id for r in heldout] == [r.id for r in reqs[7:]]
    assert [len(p) for p in split_requests(reqs[:3], 0.5)] == [1, 2]
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=f"--holdout {bad}: allowed 0 < holdout < 1"):
            split_requests(reqs, bad)
    with pytest.raises(ValueError, match="at least 2 requests"):
        split_requests(reqs[:1], 0.5)


def test_sweep_covers_every_type_and_the_documented_grids():
    configs = sweep_configs(slots=(1, 4))
    assert len(configs) == len(set(configs))
    by_type = {}
    for c in configs:
        by_type.setdefault((c.spec_type, c.n_slots), []).append(c)
    assert {t for t, _ in by_type} == set(LLAMA_TYPES) | {"ngram-suffix"}
    for t in LLAMA_TYPES:
        llama = [c for c in by_type[(t, 1)] if c.llama_compatible]
        n_grid = math.prod(len(v) for v in GRIDS[t].values())
        if t == "ngram-mod":
            n_grid *= len(MOD_N_MIN_FRACTIONS)
        assert len(llama) == n_grid, t
        assert len(by_type[(t, 4)]) == len(by_type[(t, 1)])
    # llama.cpp's defaults are on the grid
    mod = {(p["ngram_mod_n_match"], p["ngram_mod_n_min"], p["ngram_mod_n_max"])
           for p in (c.params_dict for c in by_type[("ngram-mod", 1)])}
    assert (24, 48, 64) in mod
    simple = {(p["ngram_simple_size_n"], p["ngram_simple_size_m"])
              for p in (c.params_dict for c in by_type[("ngram-simple", 1)])}
    assert (12, 48) in simple
    # ngramspec's options: map re-indexing over the map grid, cache restart, ngram-suffix
    reindexed = [c for c in by_type[("ngram-map-k4v", 1)] if not c.llama_compatible]
    assert len(reindexed) == math.prod(len(v) for v in GRIDS["ngram-map-k4v"].values())
    assert all(c.params_dict["ngram_map_k4v_reindex"] == 1 for c in reindexed)
    caches = {(p.get("lookup_cache_static"), p.get("ngram_cache_restart"))
              for p in (c.params_dict for c in by_type[("ngram-cache", 1)])}
    assert caches == {(None, None), (STATIC, None), (None, 1), (STATIC, 1)}
    assert len(by_type[("ngram-suffix", 1)]) == math.prod(
        len(v) for v in NGRAMSPEC_GRIDS["ngram-suffix"].values())
    assert not any(c.llama_compatible for c in by_type[("ngram-suffix", 1)])
    # every parameter is in range for the engine (the registry checks it)
    known = all_params()
    for c in configs:
        for name, value in c.params:
            if name != "lookup_cache_static":
                assert known[name].check(value) == value
                assert any(name in type_param_names(t) for t in c.types)
    only = sweep_configs(slots=(2,), types=["ngram-mod"], ngramspec_options=False)
    assert {c.spec_type for c in only} == {"ngram-mod"} and {c.n_slots for c in only} == {2}


def test_config_flags_labels_and_compatibility():
    c = Config.make("ngram-mod", {"ngram_mod_n_max": 32, "ngram_mod_n_match": 16,
                                  "ngram_mod_n_min": 8}, 2)
    assert c.flags() == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16",
                         "--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "32"]
    assert c.label() == "ngram-mod n_match=16 n_min=8 n_max=32"
    assert c.llama_compatible and c.n_max == 32
    k = Config.make("ngram-map-k", {"ngram_map_k_reindex": 1})
    assert not k.llama_compatible and k.family == "ngram-map-k +reindex"
    assert Config.make("ngram-map-k", {"ngram_map_k_reindex": 1}, 1, "auto").family == \
        "ngram-map-k +reindex"
    assert Config.make("ngram-map-k", {"ngram_map_k_reindex": 0}).llama_compatible
    assert Config.make("ngram-cache", {"lookup_cache_static": "s.bin"}).flags() == \
        ["--spec-type", "ngram-cache", "--lookup-cache-static", "s.bin"]
    assert Config.make("ngram-cache", {}).n_max == 8


def test_chains_pair_the_best_of_each_type():
    best = [Config.make("ngram-mod", {"ngram_mod_n_max": 32}, 3),
            Config.make("ngram-simple", {"ngram_simple_size_n": 4}, 3),
            Config.make("ngram-cache", {"ngram_cache_restart": 1}, 3)]
    chains = chain_configs(best)
    assert [c.spec_type for c in chains] == [
        "ngram-simple,ngram-mod", "ngram-mod,ngram-cache", "ngram-simple,ngram-cache",
        "ngram-simple,ngram-mod,ngram-cache"]
    assert chains[-1].params_dict == {"ngram_mod_n_max": 32, "ngram_simple_size_n": 4,
                                      "ngram_cache_restart": 1}
    assert {c.n_slots for c in chains} == {3}
    assert not chains[-1].llama_compatible and chains[0].llama_compatible
    assert chain_configs(best[:2], max_len=3) == chains[:1]


def test_modeled_speedup_by_hand():
    cost = _cost_model()
    # prompt of 10; steps: 3 drafted / 2 accepted, no draft, 2 drafted / 2 accepted: the 7
    # output tokens are 1 (prompt pass) + 3 + 1 + 2
    rec = {"n_prompt": 10, "n_output": 7, "steps": [[3, 2, 1], [0, 0, 1], [2, 2, 1]]}
    spec = cost.cost(4, 10) + cost.cost(1, 13) + cost.cost(3, 14)
    got = modeled_speedup([rec, rec], cost)
    assert got["tokens"] == 12 and got["cost"] == pytest.approx(2 * spec, abs=1e-3)
    assert got["speedup"] == round(12 / (2 * spec), 4)
    # never drafting is exactly plain decoding
    rec = {"n_prompt": 5, "n_output": 4, "steps": [[0, 0, 1]] * 3}
    assert modeled_speedup([rec], cost)["speedup"] == 1.0
    assert Config.make("ngram-mod", {}, 1).policy_factory(cost) is None


def test_evaluate_reports_replay_figures_unchanged(small):
    _, heldout = small
    c = Config.make("ngram-simple", {"ngram_simple_size_n": 3, "ngram_simple_size_m": 16}, 2)
    f = evaluate(c, heldout, _cost_model())
    r = replay(heldout, "ngram-simple", {"ngram_simple_size_n": 3, "ngram_simple_size_m": 16},
               n_slots=2)
    for k in ("n_output", "n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens",
              "tokens_per_step", "acc_rate"):
        assert f[k] == r.summary[k], k
    assert f["speedup"] == modeled_speedup(r.requests, _cost_model())["speedup"]
    assert f["speedup"] > 1.0


def test_ranking_is_deterministic_and_ordered(small, report, tmp_path):
    train, heldout = small
    again = tune(train, heldout, _cost_model(), slots=(1, 3), static_path=str(tmp_path / "s.bin"),
                 jobs=2)
    key = [(e.config.label(), e.config.n_slots, e.figures) for e in report.entries]
    assert [(e.config.label(), e.config.n_slots, e.figures) for e in again.entries] == key
    speedups = [e.figures["speedup"] for e in report.entries]
    assert speedups == sorted(speedups, reverse=True)
    assert len({e.config for e in report.entries}) == len(report.entries)
    # the sweep and the chains were all replayed, at both slot counts
    assert {e.config.n_slots for e in report.entries} == {1, 3}
    assert any(len(e.config.types) > 1 for e in report.entries)
    assert {e.config.spec_type for e in report.entries} >= set(LLAMA_TYPES) | {"ngram-suffix"}
    # a chain that drafts exactly as one of its members alone is left out
    singles = {(e.config.spec_type, e.config.params, e.config.n_slots): e.figures
               for e in report.entries if len(e.config.types) == 1 and
               e.config.policy == "fixed"}
    counters = ("n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens")
    for e in report.entries:
        if len(e.config.types) > 1 and e.config.policy == "fixed":
            p = e.config.params_dict
            for t in e.config.types:
                names = type_param_names(t)
                member = Config.make(t, {k: v for k, v in p.items() if k in names},
                                     e.config.n_slots)
                f = singles[(member.spec_type, member.params, member.n_slots)]
                assert [f[k] for k in counters] != [e.figures[k] for k in counters]
    # the static cache holds the training split's 2-grams, and its configurations used it
    assert any(e.config.params_dict.get("lookup_cache_static") == report.static_cache
               for e in report.entries)


def test_auto_policy_on_the_best_of_each_type(small, report):
    _, heldout = small
    autos = [e for e in report.entries if e.config.policy == "auto"]
    for k in (1, 3):
        types = {e.config.spec_type for e in autos if e.config.n_slots == k}
        assert types >= set(LLAMA_TYPES) | {"ngram-suffix"}
        assert any("," in t for t in types)          # and the best chain
    for e in autos:
        assert not e.config.llama_compatible and e.config.label().endswith(" policy=auto")
        assert e.config.flags("gpu")[-4:] == ["--spec-policy", "auto", "--cost-model", "gpu"]
    # auto_configs takes the best fixed configuration of each type, per slot count
    fixed = [e for e in report.entries if e.config.policy == "fixed"]
    want = auto_configs(fixed, (3,))
    best_mod = next(e.config for e in fixed if e.config.spec_type == "ngram-mod"
                    and e.config.n_slots == 3)
    assert Config.make("ngram-mod", best_mod.params_dict, 3, "auto") in want
    # its figures are the replay's with AutoPolicy against the same cost model
    e = next(e for e in autos if e.config.spec_type == "ngram-mod" and e.config.n_slots == 1)
    from ngramspec.policy import AutoPolicy
    r = replay(heldout, "ngram-mod", e.config.engine_params(), n_slots=1,
               policy_factory=lambda: AutoPolicy(_cost_model(), proposer_time=False))
    assert e.figures["n_steps"] == r.summary["n_steps"]
    assert e.figures["speedup"] == modeled_speedup(r.requests, _cost_model())["speedup"]
    with pytest.raises(ValueError, match="policy 'greedy': allowed auto, fixed"):
        Config.make("ngram-mod", {}, 1, "greedy")


def test_best_entries_and_commands(report):
    for k in (1, 3):
        llama = report.best(k, llama_compatible=True)
        ours = report.best(k, llama_compatible=False)
        assert llama.config.llama_compatible and llama.config.n_slots == k
        assert ours.figures["speedup"] >= llama.figures["speedup"]
        assert all(e.figures["speedup"] <= llama.figures["speedup"] for e in report.entries
                   if e.config.n_slots == k and e.config.llama_compatible)
        cmd = report.server_command(llama, "m.gguf")
        assert cmd.startswith("llama-server -m m.gguf --spec-type ")
        assert cmd.endswith(f"--parallel {k}")
    bad = next(e for e in report.entries if not e.config.llama_compatible)
    with pytest.raises(ValueError, match="ngramspec options"):
        report.server_command(bad)


def test_tune_rejects_bad_arguments(small):
    train, heldout = small
    with pytest.raises(ValueError, match="--slots"):
        tune(train, heldout, _cost_model(), slots=(0,))
    with pytest.raises(ValueError, match="--jobs 0"):
        tune(train, heldout, _cost_model(), jobs=0)


# --- plots -----------------------------------------------------------------------------------

def test_speedup_plot_has_one_line_per_type_with_the_best_per_n_max(report):
    from ngramspec.tune_plot import speedup_figure
    fig = speedup_figure(report.entries)
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("n_max")
    assert "speed-up" in ax.get_ylabel()
    lines = {line.get_label(): line for line in ax.get_lines() if not
             line.get_label().startswith("_")}
    assert "ngram-mod (1 slot)" in lines and "ngram-simple (3 slots)" in lines
    assert "ngram-map-k +reindex (1 slot)" in lines and "ngram-suffix (1 slot)" in lines
    assert "ngram-mod +auto (1 slot)" in lines
    for label, line in lines.items():
        family, slots = label.rsplit(" (", 1)
        k = int(slots.split()[0])
        policy = "auto" if family.endswith(" +auto") else "fixed"
        want = {}
        for e in report.entries:
            if e.config.family == family.replace(" +auto", "") and e.config.n_slots == k \
                    and e.config.policy == policy and e.config.n_max:
                want[e.config.n_max] = max(want.get(e.config.n_max, 0), e.figures["speedup"])
        assert list(line.get_xdata()) == sorted(want), label
        assert list(line.get_ydata()) == [want[x] for x in sorted(want)], label
        if family.endswith("+auto"):
            assert line.get_linestyle() == "None" and line.get_marker() == "*"
            base = lines[family[:-len(" +auto")] + f" ({slots}"]
            assert line.get_color() == base.get_color()
        else:
            assert line.get_linestyle() == ("-" if k == 1 else "--")
    assert list(lines["ngram-mod (1 slot)"].get_xdata()) == sorted(
        GRIDS["ngram-mod"]["ngram_mod_n_max"])


def test_pareto_plot_front_dominates_every_point(report):
    from ngramspec.tune_plot import pareto_figure, pareto_front
    fig = pareto_figure(report.entries)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "tokens per verification step"
    assert ax.get_ylabel().startswith("acceptance rate")
    (front,) = [line for line in ax.get_lines() if line.get_label() == "Pareto front"]
    fx, fy = list(front.get_xdata()), list(front.get_ydata())
    points = [(e.figures["tokens_per_step"], e.figures["acc_rate"]) for e in report.entries]
    assert fx == sorted(fx) and fy == sorted(fy, reverse=True)
    for x, y in zip(fx, fy):
        assert (x, y) in points
        assert not any(px >= x and py >= y and (px, py) != (x, y) for px, py in points)
    for px, py in points:
        assert any(x >= px and y >= py for x, y in zip(fx, fy))
    scattered = sum(len(c.get_offsets()) for c in ax.collections)
    assert scattered == len(points)
    assert pareto_front([(1, 1), (2, 0.5), (0.5, 0.5), (2, 0.4), (1, 1)]) == [0, 1]


def test_save_plots_writes_pngs(report, tmp_path):
    from ngramspec.tune_plot import PLOT_FILES, save_plots
    paths = save_plots(report.entries, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == list(PLOT_FILES)
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
