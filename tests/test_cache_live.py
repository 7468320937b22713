"""The dynamic n-gram cache across live generations on the embedded model (no mocks).

``generate_speculative(..., update_dynamic_cache=path)`` and ``ngramspec generate
--lookup-cache-dynamic FILE`` merge the 1..4-grams of prompt + output into the file after each
run; the next run drafts from them (and its output is still plain greedy decoding's).
"""
import json
import pathlib

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import ngramspec  # noqa: E402
from ngramspec import SpecEngine  # noqa: E402
from ngramspec._cache import NgramCache  # noqa: E402
from ngramspec.cache_file import load_cache  # noqa: E402
from ngramspec.cli import main as cli_main  # noqa: E402
from ngramspec.llama import (generate_plain, generate_speculative, load_model,  # noqa: E402
                             tokenize_prompt)
from ngramspec.llama.model import default_model_path  # noqa: E402
from greedy import assert_same_greedy  # noqa: E402

N_CTX = 512
N_PREDICT = 24
EXAMPLE = pathlib.Path(ngramspec.__file__).parent / "examples" / "code_edit_prompt.txt"


@pytest.fixture(scope="module")
def llm():
    return load_model(default_model_path(), n_ctx=N_CTX, n_threads=1)


@pytest.fixture(scope="module")
def prompt(llm):
    toks = tokenize_prompt(llm, EXAMPLE.read_text(encoding="utf-8"))
    return toks[-(N_CTX - N_PREDICT - 16):]


def ngrams_of(tokens):
    c = NgramCache()
    c.update(np.asarray(tokens, dtype=np.int32), 1, 4)
    return c


def test_generation_merges_into_the_dynamic_file(llm, prompt, tmp_path):
    path = tmp_path / "dyn.bin"
    plain = generate_plain(llm, prompt, n_predict=N_PREDICT).output_tokens
    want = NgramCache()
    runs = []
    # run 1 starts the file (absent: an empty dynamic cache); runs 2 and 3 are restarted
    # "servers" that read it. Its strict thresholds want a 3- or 4-gram seen at least twice, so
    # the answer seen in two earlier runs is drafted in the third.
    for run in range(3):
        eng = SpecEngine("ngram-cache", lookup_cache_dynamic=path, ngram_cache_restart=1)
        res = generate_speculative(llm, prompt, eng, n_predict=N_PREDICT,
                                   update_dynamic_cache=path if run == 0 else str(path))
        assert_same_greedy(llm, prompt, res.output_tokens, plain)
        want.merge(ngrams_of(list(prompt) + res.output_tokens))
        assert load_cache(path).to_dict() == want.to_dict()
        assert res.dynamic_cache_ngrams == len(want)
        runs.append(res)
    assert runs[2].n_acc_tokens > runs[0].n_acc_tokens


def test_update_dynamic_cache_type_is_checked(llm, prompt):
    with pytest.raises(TypeError, match="update_dynamic_cache"):
        generate_speculative(llm, prompt, None, n_predict=2, update_dynamic_cache=3)


def test_cli_generate_saves_the_dynamic_cache(tmp_path, capsys, prompt):
    toks = tmp_path / "prompt.json"
    toks.write_text(json.dumps([int(t) for t in prompt]))
    dyn = tmp_path / "dyn.bin"
    base = ["generate", "--prompt-tokens", str(toks), "-n", str(N_PREDICT), "-c", str(N_CTX),
            "-t", "1", "--spec-type", "ngram-simple", "--lookup-cache-dynamic", str(dyn)]
    assert cli_main(base + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [s["type"] for s in res["stats"]] == ["ngram-simple", "ngram-cache"]
    n = len(ngrams_of(list(prompt) + res["output_tokens"]))
    assert res["dynamic_cache_ngrams"] == n == len(load_cache(dyn))
    assert cli_main(base) == 0
    out = capsys.readouterr().out
    assert f"dynamic cache: {n} n-grams saved" in out
