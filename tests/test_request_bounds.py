"""Issue 25 §3-§5 below the server: values that do not fit are refused, naming the field and the
allowed range, instead of being cut to 32 bits, overflowing float32 or exhausting memory; the
trace and log readers refuse a FIFO instead of blocking on it. No model needed (the scheduler's
queue has its test in test_server_limits.py, with the server's)."""
import json
import os
import threading

import pytest

from clitools import cli
from ngramspec import SpecEngine
from ngramspec.request_params import SamplingParams
from ngramspec.registry import MAP_SLOT_BYTES, _physical_memory


# -- §3: integers that do not fit int32, biases that do not fit float32 ------------------------

@pytest.mark.parametrize("field, value", [
    ("top_k", 2**32 + 1), ("top_k", 2**32), ("top_k", 2**64), ("top_k", 2**31),
    ("repeat_last_n", 2**32), ("repeat_last_n", 2**31), ("max_tokens", 2**32 + 5),
])
def test_integers_beyond_int32_are_refused(field, value):
    with pytest.raises(ValueError, match=rf"^{field} = {value} is out of range: allowed "
                                         rf"-?\d+ \.\. 2147483647$"):
        SamplingParams(**{field: value})
    assert getattr(SamplingParams(**{field: 2**31 - 1}), field) == 2**31 - 1


@pytest.mark.parametrize("bias", [1e308, 100.5, -101, float("inf"), float("nan"), 10**400])
def test_logit_bias_beyond_100_is_refused(bias):
    with pytest.raises(ValueError, match=r"logit_bias\[12\] = .* is out of range: allowed "
                                         r"-100 \.\. 100, or -inf"):
        SamplingParams(logit_bias={12: bias})


def test_logit_bias_bounds_and_ban_are_kept():
    p = SamplingParams(logit_bias={1: 100, 2: -100, 3: float("-inf"), 4: 0.5})
    assert p.logit_bias == {1: 100.0, 2: -100.0, 3: float("-inf"), 4: 0.5}


def test_stop_strings_are_bounded():
    assert SamplingParams(stop=["x" * 1024]).stop == ("x" * 1024,)
    for bad in ("", "x" * 1025):
        with pytest.raises(ValueError, match=rf"stop strings must have 1 \.\. 1024 characters, "
                                             rf"got {len(bad)}"):
            SamplingParams(stop=[bad])


# -- §4: logit_bias keys are canonical token ids of the vocabulary ---------------------------

@pytest.mark.parametrize("key", ["²", "--1", "-1", "+5", "007", " 5", "5 ", "1e3", "٣",
                                 "7" * 5000, "49152", ""])
def test_logit_bias_keys_must_be_token_ids(key):
    pytest.importorskip("pydantic")
    from ngramspec.server.errors import FieldError
    from ngramspec.server.schemas import CompletionRequest

    body = CompletionRequest(prompt="x", logit_bias={key: 1})
    with pytest.raises(FieldError) as info:
        body.token_bias(49152)
    assert info.value.param == "logit_bias"
    assert info.value.message.startswith("logit_bias: key ")
    assert "allowed 0 .. 49151" in info.value.message
    assert len(info.value.message) < 200            # a 5000-digit key is not echoed whole


def test_logit_bias_keys_in_range_convert():
    pytest.importorskip("pydantic")
    from ngramspec.server.schemas import CompletionRequest

    body = CompletionRequest(prompt="x", logit_bias={"0": 1, "49151": -2.5, "12": 3})
    assert body.token_bias(49152) == {0: 1, 49151: -2.5, 12: 3}


# -- §4: a blank API key would switch authentication off --------------------------------------

@pytest.mark.parametrize("value", ["", " ", " , ", "key,", ",key", "a,,b"])
def test_blank_api_keys_are_refused(value):
    pytest.importorskip("fastapi")
    from ngramspec.server.auth import parse_api_keys
    with pytest.raises(ValueError, match=r"--api-key \(or \$NGRAMSPEC_API_KEY\): .* empty or "
                                         r"blank key"):
        parse_api_keys(value)


def test_api_keys_parse():
    pytest.importorskip("fastapi")
    from ngramspec.server.auth import parse_api_keys
    assert parse_api_keys(None) == []
    assert parse_api_keys(" k1 , k2") == ["k1", "k2"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_a_blank_key_before_loading_the_model(capsys, monkeypatch, tmp_path, how):
    pytest.importorskip("fastapi")
    argv = ["serve", "--port", "0", "--model", tmp_path / "never-loaded.gguf"]
    if how == "flag":
        argv += ["--api-key", " , "]
    else:
        monkeypatch.setenv("NGRAMSPEC_API_KEY", " , ")
        # the flag's default is read when the parser is built
    r = cli(capsys, *argv)
    assert r.returncode == 2, r.stderr
    assert "empty or blank key" in r.stderr and r.stderr.count("\n") == 1
    assert "model file not found" not in r.stderr     # refused before the model


# -- §5: n_slots bounded by the memory its per-slot state needs -------------------------------

@pytest.mark.parametrize("types", ["ngram-map-k", "ngram-map-k4v", "ngram-mod,ngram-map-k"])
def test_huge_n_slots_is_refused_before_allocating(types):
    memory = _physical_memory()
    if memory is None:
        pytest.skip("no physical memory figure on this system")
    too_many = memory // MAP_SLOT_BYTES + 1
    for n in (too_many, 10**7, 2**40):
        with pytest.raises(MemoryError, match=rf"^n_slots = {n} is out of range: allowed 1 \.\. "
                                             rf"\d+ \(the proposers' per-slot state"):
            SpecEngine(types, n_slots=n)
    assert SpecEngine(types, n_slots=4).n_slots == 4


def test_huge_slot_count_on_the_command_line_names_the_flag(tmp_path, capsys):
    memory = _physical_memory()
    if memory is None or memory // MAP_SLOT_BYTES + 1 > 65536:   # replay's --slots limit
        pytest.skip("this machine's memory holds the most slots replay takes")
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"prompt": [1, 2, 3], "output": [4]}) + "\n")
    r = cli(capsys, "replay", trace, "--spec-type", "ngram-map-k", "--slots", 65536)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "n_slots = 65536 is out of range: allowed 1 .. " in r.stderr and "--slots" in r.stderr


def test_huge_n_slots_without_per_slot_tables_is_refused_too():
    with pytest.raises(MemoryError, match=r"^n_slots = 1099511627776 is out of range"):
        SpecEngine("ngram-simple", n_slots=2**40)


# -- §5: the trace and log readers refuse a FIFO instead of blocking on it -------------------

def _fifo(tmp_path):
    path = tmp_path / "fifo.jsonl"
    os.mkfifo(path)
    return path


def _without_blocking(fn):
    """``fn()`` on a thread; fails (instead of hanging the suite) if it blocks for 30 s."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        # unblock the reader: open the FIFO for writing, then close it
        pytest.fail("blocked on the FIFO")
    return out["r"]


@pytest.mark.parametrize("argv", [
    ["replay", "{fifo}"],
    ["tune", "{fifo}", "--output", "{out}"],
    ["cache", "create", "--traces", "{fifo}", "-o", "{out}/c.bin"],
    ["tune", "{fifo}", "--format", "chat", "--output", "{out}"],
])
def test_trace_and_log_readers_refuse_a_fifo(tmp_path, capsys, argv):
    fifo = _fifo(tmp_path)
    args = [a.format(fifo=fifo, out=tmp_path) for a in argv]
    r = _without_blocking(lambda: cli(capsys, *args))
    assert r.returncode == 2, r.stderr
    assert f"{fifo}: is a FIFO: traces and logs are read from regular files only" in r.stderr
    assert r.stderr.count("\n") == 1


def test_trace_reader_refuses_a_directory_and_reads_gzip(tmp_path):
    import gzip

    from ngramspec.traces import TraceError, read_requests
    with pytest.raises(TraceError, match="is a directory"):
        read_requests(str(tmp_path))
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": [1, 2], "output": [3]}) + "\n")
    (req,) = read_requests(str(path))
    assert list(req.prompt) == [1, 2] and list(req.output) == [3]
