"""Token ids outside the target's vocabulary (issue 20, point 8).

A cache file built with another tokenizer holds ids the target model lacks; drafted, they made
``llama_decode`` fail ("returned -1") without naming the cache or the token. With the target's
vocabulary size set (`SpecEngine.set_vocab`, which the live driver calls with
``llm.n_vocab()``), such a cache is refused with an error naming the file and the token, and
no draft ever holds an id >= n_vocab.
"""
import json
import struct

import numpy as np
import pytest

from ngramspec import SpecEngine
from ngramspec._cache import NgramCache, NgramCacheProposer, _draft_once
from ngramspec.cache_file import load_cache, save_cache


def cache_file(path, records):
    """A cache file of ``[(ngram, [(token, count), ...]), ...]``."""
    out = bytearray()
    for ngram, pairs in records:
        out += struct.pack("<4ii", *(list(ngram) + [-1] * (4 - len(ngram))), len(pairs))
        for tok, cnt in pairs:
            out += struct.pack("<ii", tok, cnt)
    path.write_bytes(bytes(out))
    return path


def test_drafts_end_before_the_first_token_outside_the_vocabulary():
    ctx = [1, 2, 3, 70, 4] * 4 + [1, 2]
    free = NgramCacheProposer(1)
    bounded = NgramCacheProposer(1, n_vocab=50)
    got_free = _draft_once(free, 0, ctx, 3)
    assert 70 in got_free                               # the context cache drafts it ...
    cut = got_free.index(70)
    assert _draft_once(bounded, 0, ctx, 3) == got_free[:cut]    # ... the bound stops there
    bounded.set_vocab(None)                             # no bound: llama.cpp's draft again
    bounded.reset()
    assert _draft_once(bounded, 0, ctx, 3) == got_free
    bounded.set_vocab(71)
    bounded.reset()
    assert _draft_once(bounded, 0, ctx, 3) == got_free


@pytest.mark.parametrize("which", ["static", "dynamic"])
def test_a_cache_of_another_tokenizer_is_refused_naming_file_and_token(tmp_path, which):
    path = cache_file(tmp_path / f"{which}.bin",
                      [((5, 6), [(7, 3), (60001, 2)]), ((8, 9), [(10, 1)])])
    eng = SpecEngine("ngram-cache", **{f"lookup_cache_{which}": path})
    with pytest.raises(ValueError) as info:
        eng.set_vocab(49152)
    msg = str(info.value)
    assert str(path) in msg and "60001" in msg and "49152" in msg and which in msg, msg
    assert eng.proposers[0].n_vocab is None             # the bound was not set
    eng.set_vocab(60002)                                # a vocabulary that holds it: fine
    assert eng.proposers[0].n_vocab == 60002
    # an n-gram key outside the vocabulary is refused too (the file is foreign all the same)
    key = cache_file(tmp_path / "key.bin", [((5, 90000), [(7, 3)])])
    with pytest.raises(ValueError, match="token id 90000"):
        SpecEngine("ngram-cache", lookup_cache_static=key).set_vocab(49152)


def test_an_in_memory_cache_is_named_by_its_role():
    c = NgramCache()
    c.update([1, 2, 99])
    p = NgramCacheProposer(1, static=c)
    with pytest.raises(ValueError, match="the static cache: token id 99 is outside"):
        p.set_vocab(50)
    with pytest.raises(ValueError, match="the static cache: token id 99"):
        NgramCacheProposer(1, static=c.copy(), n_vocab=99)
    NgramCacheProposer(1, static=c.copy(), n_vocab=100)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-3, ValueError),
                                          (2 ** 31 + 1, ValueError), (True, TypeError),
                                          (2.0, TypeError), ("5", TypeError)])
def test_n_vocab_range(value, error):
    with pytest.raises(error, match="n_vocab"):
        NgramCacheProposer(1, n_vocab=value)
    with pytest.raises(error, match="n_vocab"):
        SpecEngine("ngram-simple").set_vocab(value)      # checked even without ngram-cache


def test_engine_bound_applies_to_its_drafts():
    ctx = np.array([1, 2, 3, 70, 4] * 4 + [1, 2], dtype=np.int32)
    eng = SpecEngine("ngram-cache")
    eng.begin(0, ctx)
    free = eng.draft(0, ctx, 3).tolist()
    eng.accept(0, 0)
    assert 70 in free
    eng = SpecEngine("ngram-cache")
    eng.set_vocab(50)
    eng.begin(0, ctx)
    assert eng.draft(0, ctx, 3).tolist() == free[:free.index(70)]


# --------------------------------------------------------------------------------------------
# Live: the embedded model (n_vocab 49152)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("llama_cpp")
    from ngramspec.llama import load_model
    from ngramspec.llama.model import default_model_path
    return load_model(default_model_path(), n_ctx=256, n_threads=1)


def foreign_static_cache(path, prompt):
    """Every 2-gram of the prompt followed by id 60000 (beyond SmolLM2's 49152), as a cache
    of another tokenizer would have it: without the vocabulary check it is drafted."""
    grams = {(int(a), int(b)) for a, b in zip(prompt[:-1], prompt[1:])}
    return cache_file(path, [(g, [(60000, 50)]) for g in sorted(grams)])


def test_live_generation_refuses_a_foreign_cache(llm, tmp_path):
    from greedy import assert_same_greedy
    from ngramspec.llama import generate_plain, generate_speculative, tokenize_prompt
    prompt = tokenize_prompt(llm, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    path = foreign_static_cache(tmp_path / "foreign.bin", prompt)
    eng = SpecEngine("ngram-cache", lookup_cache_static=path)
    with pytest.raises(ValueError) as info:
        generate_speculative(llm, prompt, eng, n_predict=8)
    msg = str(info.value)
    assert str(path) in msg and "token id 60000" in msg and "49152" in msg, msg
    assert "llama_decode" not in msg
    # the same engine, its bound unset and the cache replaced by an in-vocabulary one, runs
    ok = tmp_path / "ok.bin"
    c = NgramCache()
    c.update(prompt, 2, 2)
    save_cache(c, ok)
    res = generate_speculative(llm, prompt, SpecEngine("ngram-cache", lookup_cache_static=ok),
                               n_predict=8)
    assert_same_greedy(llm, prompt, res.output_tokens,
                       generate_plain(llm, prompt, n_predict=8).output_tokens)
    assert load_cache(ok).max_token() < llm.n_vocab()


def test_cli_generate_with_a_foreign_cache_is_one_line_exit_2(llm, tmp_path, capsys):
    from ngramspec.cli import main
    from ngramspec.llama import tokenize_prompt
    prompt = tokenize_prompt(llm, "x = 1\ny = 2\nx = 1\n")
    toks = tmp_path / "prompt.json"
    toks.write_text(json.dumps([int(t) for t in prompt]))
    path = foreign_static_cache(tmp_path / "foreign.bin", prompt)
    rc = main(["generate", "--prompt-tokens", str(toks), "-n", "4", "-c", "256", "-t", "1",
               "--lookup-cache-static", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "60000" in err, err


def test_the_batched_scheduler_refuses_a_foreign_cache(llm, tmp_path):
    """The serving engine checks its chain against its model as the single-request driver
    does: a foreign cache stops the scheduler at construction, naming file and token."""
    from ngramspec.llama import tokenize_prompt
    from ngramspec.llama import Scheduler
    from ngramspec.config import SpecConfig
    prompt = tokenize_prompt(llm, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n")
    path = foreign_static_cache(tmp_path / "foreign.bin", prompt)
    with pytest.raises(ValueError) as info:
        Scheduler(llm, SpecConfig.from_keywords("ngram-cache", lookup_cache_static=path),
                  n_slots=1, n_ctx=256)
    msg = str(info.value)
    assert str(path) in msg and "token id 60000" in msg, msg
