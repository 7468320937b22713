"""Calibration of the verify-cost curve on the real embedded model (short: small k, small KV)."""
import json

import pytest

pytest.importorskip("llama_cpp")

from clitools import cli  # noqa: E402
from ngramspec import cost  # noqa: E402
from ngramspec.llama import calibration  # noqa: E402
from ngramspec.llama import generate_plain, load_model  # noqa: E402

KS = (1, 2, 4, 8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NGRAMSPEC_CACHE_DIR", str(tmp_path))
    return tmp_path / "cost"


@pytest.fixture(scope="module")
def llm():
    return load_model(n_ctx=256, n_batch=64, n_threads=1)


def test_calibrate_measures_the_model(llm):
    m = calibration.calibrate(llm, ks=KS + (1000,), n_pasts=(16, 128), reps=1)
    assert m.ks == KS                       # 1000 > n_batch: dropped
    assert m.n_pasts == (16, 128)
    assert m.meta["n_threads"] == 1 and m.meta["n_batch"] == 64 and m.meta["n_ctx"] == 256
    assert m.meta["model"]["path"].endswith(".gguf")
    assert "CPU" in m.meta["backend"] or "AVX" in m.meta["backend"]
    for p in m.n_pasts:
        assert 0 < m.seconds(1, p) < 1.0
        # A batch of 8 costs more than one token and less than 8 separate decodes plus slack.
        assert 1.0 < m.cost(8, p) < 16
    # The model is usable afterwards: the KV cache was cleared.
    res = generate_plain(llm, [1, 2, 3, 4], n_predict=4)
    assert res.n_output == 4


def test_calibrate_refuses_kv_lengths_past_the_context(llm):
    with pytest.raises(ValueError, match="exceed n_ctx"):
        calibration.calibrate(llm, ks=KS, n_pasts=(250,), reps=1)
    with pytest.raises(ValueError, match="reps"):
        calibration.calibrate(llm, ks=KS, reps=0)


def test_calibration_for_is_cached_per_threads(llm, cache):
    first = calibration.calibration_for(llm, ks=(1, 2), n_pasts=(16,), reps=1)
    again = calibration.calibration_for(llm, ks=(1, 2), n_pasts=(16,), reps=1)
    assert again == first                                 # read back, not measured again
    assert len(list(cache.glob("*.json"))) == 1
    other = load_model(n_ctx=256, n_batch=64, n_threads=2)
    calibration.calibration_for(other, ks=(1, 2), n_pasts=(16,), reps=1)
    assert len(list(cache.glob("*.json"))) == 2           # another thread count: its own entry


def test_calibrate_cli_measures_then_reads_the_cache(capsys, cache):
    args = ["calibrate", "-t", "1", "-c", "128", "-b", "64", "--ks", "1,2,4", "--reps", "1"]
    r = cli(capsys, *args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("measured:")
    assert "| 4 |" in r.stdout and "c(k) at KV 32" in r.stdout
    assert "KV length 32" in r.stderr
    r = cli(capsys, *args, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["measured"] is False and d["ks"] == [1, 2, 4]
    assert cost.CostModel.from_dict({k: v for k, v in d.items()
                                     if k not in ("cache_file", "measured")}).cost(1) == 1.0
    r = cli(capsys, *args, "--refresh")
    assert r.returncode == 0 and r.stdout.startswith("measured:")
    # the embedded model's calibration is now the `local` profile
    assert "local" in cost.PROFILES


@pytest.mark.parametrize("argv, msg", [
    (["--ks", "1,0"], "--ks"),
    (["--ks", "1,x"], "--ks"),
    (["--ks", "1,128", "-b", "64"], "--batch-size"),
    (["-c", "40"], "--ctx-size"),
    (["--model", "/nonexistent.gguf"], "file not found"),
])
def test_calibrate_cli_errors(capsys, cache, argv, msg):
    r = cli(capsys, "calibrate", *argv)
    assert r.returncode == 2
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1
