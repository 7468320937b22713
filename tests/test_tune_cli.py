"""``ngramspec tune`` end to end: the table, the commands, the files, and that replaying the
recommended flags gives exactly the reported figures."""
import gzip
import json
import shlex

import pytest

from ngramspec.cost import load_cost_model, modeled_speedup

from clitools import cli
from conftest import TRACES

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

SMALL = str(TRACES / "model-generated.jsonl.gz")
# llama-server's options that the recommended command may use (spec section 2, plus the model,
# the slot count and the context size)
LLAMA_SERVER_FLAGS = {"-m", "--spec-type", "--spec-ngram-simple-size-n",
                      "--spec-ngram-simple-size-m", "--spec-ngram-map-k-size-n",
                      "--spec-ngram-map-k-size-m", "--spec-ngram-map-k4v-size-n",
                      "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-min-hits",
                      "--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min",
                      "--spec-ngram-mod-n-max", "--lookup-cache-static", "--parallel",
                      "--ctx-size"}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    capsys = _Capture()
    res = capsys.run("tune", SMALL, "--limit", 10, "--slots", "1,3", "--output", out,
                     "--cost-model", "cpu-embedded", "--jobs", 2, "--no-progress",
                     "--ctx-size", 1024)
    assert res.returncode == 0, res.stderr
    with open(out / "report.json", encoding="utf-8") as f:
        return out, res, json.load(f)


class _Capture:
    """The CLI in-process with its output captured, for a module-scoped fixture (capsys is
    per test)."""

    def run(self, *argv):
        import contextlib
        import io
        from types import SimpleNamespace

        from ngramspec.cli import main
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as exc:
                rc = exc.code
        return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_prints_table_and_commands_and_writes_files(tuned):
    out, res, report = tuned
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"{len(report['ranking'])} configurations replayed on 5 held-out "
                               f"requests (5 for training), cost model cpu-embedded")
    assert lines[1].split() == ["rank", "speed-up", "tok/step", "accept", "slots", "llama",
                                "configuration"]
    first = report["ranking"][0]
    assert lines[2].split()[:3] == ["1", f"{first['speedup']:.3f}x",
                                    f"{first['tokens_per_step']:.3f}"]
    for k in ("1", "3"):
        cmd = report["best"][k]["llama_server"]["command"]
        assert f"  {cmd}" in lines
        assert cmd.startswith("llama-server -m MODEL.gguf --spec-type ")
        flags = {a for a in shlex.split(cmd) if a.startswith("-")}
        assert flags <= LLAMA_SERVER_FLAGS, flags - LLAMA_SERVER_FLAGS
        assert f"--parallel {k}" in cmd and "--ctx-size 1024" in cmd
        assert report["best"][k]["ngramspec"]["python"].startswith("SpecEngine(")
    assert "best llama-server command (3 slots)" in res.stdout
    assert "best ngramspec configuration (1 slot)" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "acceptance_vs_tokens_per_step.png", "heldout.jsonl.gz", "report.json", "speedup_vs_n_max.png",
        "static.bin"]
    assert report["plots"] == ["speedup_vs_n_max.png", "acceptance_vs_tokens_per_step.png"]
    assert [r["rank"] for r in report["ranking"]] == list(range(1, len(report["ranking"]) + 1))
    assert report["n_train"] == 5 and report["n_heldout"] == 5 and report["slots"] == [1, 3]
    assert set(report["grids"]["llama.cpp"]) == {"ngram-simple", "ngram-map-k",
                                                 "ngram-map-k4v", "ngram-mod", "ngram-cache"}
    with gzip.open(out / "heldout.jsonl.gz", "rt") as f:
        assert [json.loads(line)["id"] for line in f] == report["heldout_ids"]


def _replay_summary(capsys, tmp_path, argv):
    result = tmp_path / "replay.jsonl"
    res = cli(capsys, "replay", *argv, "--output", result)
    assert res.returncode == 0, res.stderr
    with open(result, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows[0]["summary"], rows[1:]


FIGURES = ("n_output", "n_steps", "n_drafts", "n_draft_tokens", "n_acc_tokens",
           "tokens_per_step", "acc_rate")


@pytest.mark.parametrize("slots", ["1", "3"])
def test_replaying_the_recommended_flags_gives_the_reported_figures(tuned, capsys, tmp_path,
                                                                    slots):
    out, _, report = tuned
    cost = load_cost_model("cpu-embedded")
    best = report["best"][slots]
    # the llama-server command, its options given to `ngramspec replay` as they are
    argv = shlex.split(best["llama_server"]["command"])
    assert argv[:3] == ["llama-server", "-m", "MODEL.gguf"]
    flags = argv[3:]
    i = flags.index("--parallel")
    flags[i] = "--slots"                        # llama-server's slot count, replay's name
    summary, records = _replay_summary(capsys, tmp_path, [out / "heldout.jsonl.gz", *flags])
    for k in FIGURES:
        assert summary[k] == best["llama_server"][k], k
    assert modeled_speedup(records, cost)["speedup"] == best["llama_server"]["speedup"]
    # the check command carries the cost model, so replay prints the same modeled speed-up
    assert best["llama_server"]["replay_command"].split()[3:] == \
        [str(a) for a in flags] + ["--cost-model", "cpu-embedded"]
    # the best ngramspec configuration, through its check command
    ours = best["ngramspec"]
    check = shlex.split(ours["replay_command"])
    assert check[:3] == ["ngramspec", "replay", str(out / "heldout.jsonl.gz")]
    assert " ".join(check[3:]).startswith(ours["flags"])
    summary, records = _replay_summary(capsys, tmp_path, check[2:])
    for k in FIGURES:
        assert summary[k] == ours[k], k
    assert modeled_speedup(records, cost)["speedup"] == ours["speedup"]
    assert summary["modeled"][summary["spec_policy"]]["speedup"] == ours["speedup"]
    assert ours["speedup"] >= best["llama_server"]["speedup"]
    # the best auto-policy setting too (its flags name the policy and the cost model)
    auto = next(r for r in report["ranking"] if r["policy"] == "auto" and
                r["slots"] == int(slots))
    from ngramspec.tune import Config
    config = Config.make(auto["spec_type"], auto["params"], auto["slots"], "auto")
    assert config.label() == auto["label"]
    summary, records = _replay_summary(capsys, tmp_path, [
        out / "heldout.jsonl.gz", *config.flags("cpu-embedded"), "--slots", slots,
        "--ctx-size", 1024])
    assert summary["spec_policy"] == "auto"
    for k in FIGURES:
        assert summary[k] == auto[k], k
    assert summary["modeled"]["auto"]["speedup"] == auto["speedup"]


def test_chat_logs_through_the_cli(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    log = tmp_path / "chat.jsonl"
    turns = [("Write a function add(a, b).", "def add(a, b):\n    return a + b\n"),
             ("Now sub(a, b).", "def sub(a, b):\n    return a - b\n"),
             ("And mul(a, b).", "def mul(a, b):\n    return a * b\n"),
             ("And div(a, b).", "def div(a, b):\n    return a / b\n")]
    with open(log, "w", encoding="utf-8") as f:
        for q, a in turns:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    res = cli(capsys, "tune", log, "--types", "ngram-simple,ngram-mod", "--slots", "1",
              "--llama-only", "--jobs", 1, "--no-progress", "--cost-model", "gpu")
    assert res.returncode == 0, res.stderr
    assert "on 2 held-out requests (2 for training)" in res.stdout
    from ngramspec.llama.model import default_model_path
    assert f"llama-server -m {shlex.quote(default_model_path())} --spec-type ngram-" \
        in res.stdout
    assert "best ngramspec configuration" in res.stdout   # the llama one: --llama-only
    assert " - " not in res.stdout.split("\n\n")[0]       # every row llama.cpp-compatible


@pytest.mark.parametrize("argv,message", [
    (["--holdout", "1.5"], "argument --holdout: invalid number between 0 and 1 value: '1.5'"),
    (["--slots", "0"], "argument --slots/-np/--parallel: invalid comma list of integers >= 1 "
                          "value: '0'"),
    (["--types", "ngram-foo"], "unknown spec type 'ngram-foo'"),
    (["--types", "draft-simple"], "--types: nothing to sweep; the types tune sweeps are "
                                  "ngram-suffix, ngram-simple, ngram-map-k"),
    (["--types", "ngram-suffix", "--llama-only"], "--types: nothing to sweep"),
    (["--cost-model", "nope"], "--cost-model nope: neither a file nor a profile name"),
    (["--limit", "1"], "--holdout 0.5 of 1 request(s) leaves an empty training or held-out"),
    (["--format", "chat"], ":1: field 'messages' must be a non-empty list"),
])
def test_bad_arguments_are_one_line_errors(capsys, argv, message):
    res = cli(capsys, "tune", SMALL, "--no-progress", *argv)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert res.stdout == ""


def test_malformed_log_names_file_and_line(capsys, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": [1, 2, 3], "output": [4, 5]}\n{"prompt": [1], "output": "x"}\n')
    res = cli(capsys, "tune", log, "--no-progress")
    assert res.returncode == 2
    assert res.stderr == (f"ngramspec tune: error: {log}:2: field 'output' must be a list of "
                          f"integer token ids\n")


def _local_calibration(folder):
    """A calibration of the embedded model in ``folder`` (the cost cache), as `ngramspec
    calibrate` leaves one: the cpu-embedded curve, stamped as measured here."""
    import os
    import time

    from ngramspec.cost import PROFILES
    from ngramspec.llama.model import default_model_path

    model = PROFILES["cpu-embedded"]
    model.meta = {**model.meta, "model": {"path": os.path.realpath(default_model_path())},
                  "created": time.time()}
    (folder / "cost").mkdir(parents=True)
    (folder / "cost" / "here.json").write_text(json.dumps(model.to_dict()))


def test_default_cost_model_is_this_machines_calibration(capsys, tmp_path, monkeypatch):
    """On a CPU, tune prices drafts with this machine's calibration once there is one (issue
    40: cpu-embedded's advice and this machine's differed completely), and says so."""
    pytest.importorskip("llama_cpp")
    from ngramspec.llama.model import gpu_offload_available
    if gpu_offload_available():
        pytest.skip("a GPU build defaults to the gpu profile")
    monkeypatch.setenv("NGRAMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["tune", SMALL, "--limit", 4, "--types", "ngram-mod", "--no-chains", "--no-auto",
            "--slots", "1", "--jobs", 1, "--no-progress"]
    r = cli(capsys, *argv)
    assert r.returncode == 0, r.stderr
    assert "tune: cost model cpu-embedded (no calibration on this machine yet: `ngramspec " \
           "calibrate -t 1` makes one" in r.stderr
    _local_calibration(tmp_path / "cache")
    r = cli(capsys, *argv)
    assert r.returncode == 0, r.stderr
    assert "tune: cost model local (this machine's calibration of the embedded model" in r.stderr
    assert "cost model local" in r.stdout.splitlines()[0]
    # a model of its own is not the calibrated one: the profile again
    from ngramspec.llama.model import default_model_path
    r = cli(capsys, *argv, "--model", default_model_path())
    assert r.returncode == 0 and "tune: cost model cpu-embedded" in r.stderr
