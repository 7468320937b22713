"""The auto draft-length policy on the real embedded model: the output stays plain greedy."""
import json
import os
import re

import pytest

pytest.importorskip("llama_cpp")

from ngramspec import SpecEngine  # noqa: E402
from ngramspec.cli import main as cli_main  # noqa: E402
from ngramspec.cost import PROFILES  # noqa: E402
from ngramspec.llama import generate_plain, generate_speculative, load_model  # noqa: E402
from ngramspec.llama import tokenize_prompt  # noqa: E402
from ngramspec.policy import AutoPolicy  # noqa: E402
from greedy import assert_same_greedy  # noqa: E402
from test_live import EXAMPLE  # noqa: E402

N_CTX = 768
N_PREDICT = 96


@pytest.fixture(scope="module")
def llm():
    return load_model(n_ctx=N_CTX, n_threads=1)


@pytest.fixture(scope="module")
def prompt(llm):
    return tokenize_prompt(llm, EXAMPLE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def plain(llm, prompt):
    return generate_plain(llm, prompt, n_predict=N_PREDICT)


@pytest.mark.parametrize("profile", ["cpu-embedded", "gpu"])
@pytest.mark.parametrize("spec_type", ["ngram-mod,ngram-simple", "ngram-suffix"])
def test_auto_policy_gives_the_plain_greedy_output(llm, prompt, plain, profile, spec_type):
    policy = AutoPolicy(PROFILES[profile])
    res = generate_speculative(llm, prompt, SpecEngine(spec_type), n_predict=N_PREDICT,
                               policy=policy, record_steps=True)
    assert res.n_output == N_PREDICT
    assert_same_greedy(llm, prompt, res.output_tokens, plain.output_tokens)
    assert policy.n_steps == len(res.steps)
    if profile == "gpu":
        # a flat cost: drafts of the edited file get verified
        assert policy.n_verified > 0 and res.n_acc_tokens > 0


def test_generate_defaults_to_auto_and_calibrates_once(capsys):
    argv = ["generate", "--prompt", "a b c d a b c d a b c", "-n", "8", "-c", "256", "-b", "64",
            "-t", "1", "--spec-type", "ngram-mod"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert "calibrating the verify cost" in err
    # where the file goes (a file the user did not ask for): the session's cache folder here
    assert f"cached in {os.environ['NGRAMSPEC_CACHE_DIR']}{os.sep}" in err
    assert "policy auto (cost model calibrated): the proposers drafted " in out
    # the two drafted counts say what each counts: all drafted tokens, or the verified ones
    line = next(ln for ln in out.splitlines() if ln.startswith("policy auto"))
    drafted, verified = map(int, re.search(r"drafted (\d+) tokens in \d+ drafts; (\d+) of them "
                                           r"verified", line).groups())
    assert verified <= drafted
    assert f"/{verified} verified draft tokens accepted" in out
    assert "#gen tokens counts every drafted token, before the policy's cut" in out
    gen = sum(int(ln.split("#gen tokens =")[1].split(",")[0]) for ln in out.splitlines()
              if "#gen tokens =" in ln)
    assert gen == drafted
    assert cli_main(argv + ["--json"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert "calibrating" not in err                      # cached now
    assert res["spec_policy"] == "auto" and res["policy"]["steps"] > 0
    assert cli_main(argv + ["--json", "--spec-policy", "fixed"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["spec_policy"] == "fixed" and "policy" not in res
    assert cli_main(argv + ["--json", "--cost-model", "gpu"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"]["cost_model"] == "gpu"


@pytest.mark.parametrize("argv, needle", [
    (["--cost-model", "nonexistent-profile"], "--cost-model nonexistent-profile"),
    (["--spec-policy", "greedy"], "--spec-policy"),
])
def test_generate_policy_flag_errors(capsys, argv, needle):
    try:
        rc = cli_main(["generate", "--prompt", "x", "-n", "2", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
