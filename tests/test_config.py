"""`ngramspec.config`: the speculative configuration below the command line — profiles,
keywords, flags in a string (an embedding engine's $NGRAMSPEC_SPEC) and the command line's
help rendered from it."""
import argparse

import numpy as np
import pytest

from ngramspec.config import (SPEC_PROFILES, SpecConfig, add_policy_arguments,
                              add_spec_arguments)
from ngramspec.policy import AutoPolicy
from ngramspec.validation import OutOfRange


def test_profiles_are_the_commands_defaults():
    assert dict(SpecConfig.from_keywords("ngram-mod").params) == {}        # llama.cpp's
    serve = SpecConfig.from_keywords("ngram-mod", profile="serve")
    assert dict(serve.params) == {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}
    assert serve.policy == "fixed"
    assert SpecConfig.from_keywords("ngram-mod", profile="generate").policy == "auto"
    with pytest.raises(OutOfRange, match=r"^profile = 'gpu' is out of range: allowed llama\.cpp"):
        SpecConfig.from_keywords(profile="gpu")


def test_keywords_win_and_one_bound_moves_the_other():
    low = SpecConfig.from_keywords("ngram-mod", profile="serve", ngram_mod_n_max=4)
    assert (low.params["ngram_mod_n_min"], low.params["ngram_mod_n_max"]) == (4, 4)
    high = SpecConfig.from_keywords("ngram-mod", profile="serve", ngram_mod_n_min=48)
    assert (high.params["ngram_mod_n_min"], high.params["ngram_mod_n_max"]) == (48, 48)
    with pytest.raises(TypeError):
        high.params["ngram_mod_n_min"] = 1                  # read-only
    # errors name the keyword (flags are named by flag: below)
    with pytest.raises(OutOfRange, match=r"^ngram_mod_n_max = 5000 is out of range"):
        SpecConfig.from_keywords("ngram-mod", ngram_mod_n_max=5000)
    with pytest.raises(OutOfRange, match=r"^policy = 'best' is out of range: allowed auto"):
        SpecConfig.from_keywords("ngram-mod", policy="best")


def test_flags_in_a_string_as_an_embedding_engine_gives_them():
    config = SpecConfig.from_flags("--spec-type ngram-simple,ngram-mod --spec-policy auto")
    assert config.spec_type == "ngram-simple,ngram-mod" and config.cost_model == "gpu"
    spec_type, params, make = config.engine_parts()
    assert params == {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}
    first, second = make(), make()
    assert isinstance(first, AutoPolicy) and first is not second       # one per engine
    assert SpecConfig.from_flags("").policy == "fixed"
    with pytest.raises(ValueError, match=r"^X: --spec-ngram-mod-n-max = 5000 is out of range"):
        SpecConfig.from_flags(["--spec-ngram-mod-n-max", "5000"], prog="X")
    with pytest.raises(ValueError, match=r"^X: unrecognized arguments: --bogus"):
        SpecConfig.from_flags("--bogus", prog="X")
    missing = SpecConfig.from_flags("--lookup-cache-static /nonexistent/c.bin", prog="X")
    with pytest.raises(ValueError, match=r"^X: --lookup-cache-static /nonexistent/c\.bin: no "):
        missing.engine_parts("X")


def test_the_help_states_the_profiles_defaults():
    def helped(profile):
        parser = argparse.ArgumentParser()
        add_spec_arguments(parser, profile)
        add_policy_arguments(parser, profile, why="why", cost_default="gpu")
        return " ".join(parser.format_help().split()), parser

    text, parser = helped("serve")
    assert "(default: 32, shorter than llama.cpp's 64 for a CPU" in text
    assert "--spec-policy {auto,fixed}" in text and "(default: fixed, why)" in text
    assert vars(parser.parse_args([]))["ngram_mod_n_max"] is None    # the profile fills it
    text, parser = helped("llama.cpp")
    assert "(default: 64, 0..1024)" in text and "shorter than" not in text
    assert helped("generate")[1].parse_args([]).spec_policy == "auto"
    assert SPEC_PROFILES["generate"].params == SPEC_PROFILES["serve"].params


def test_the_scheduler_reads_its_chain_and_files_from_the_config(tmp_path):
    """What `ngramspec.llama.Scheduler` takes of a `SpecConfig`: its chain (a draft model adds
    draft-simple, as ``--model-draft`` does), changed keywords (checked), and its files loaded
    once before any model (a cache file adds ngram-cache; loading again keeps the objects)."""
    from ngramspec.cache_file import save_cache
    from ngramspec.cost import CostModel
    from ngramspec.engine import SpecEngine
    from ngramspec import NgramCache

    base = SpecConfig.from_keywords("ngram-mod,ngram-simple")
    assert base.types == ("ngram-simple", "ngram-mod")
    assert SpecConfig("none").types == ()
    drafted = base.with_params(model_draft="small.gguf", spec_draft_n_max=4)
    assert drafted.types == ("ngram-simple", "ngram-mod", "draft-simple")
    assert drafted.params["spec_draft_n_max"] == 4 and base.params.get("model_draft") is None
    with pytest.raises(OutOfRange, match=r"^ngram_mod_n_max = 5000 is out of range"):
        base.with_params(ngram_mod_n_max=5000)

    path = tmp_path / "static.bin"
    cache = NgramCache()
    cache.update(np.asarray(list(range(40)) * 3, dtype=np.int32), 1, 2)
    save_cache(cache, path)
    config = SpecConfig.from_keywords("ngram-mod", lookup_cache_static=str(path),
                                      cost_model="gpu")
    loaded = config.with_files_loaded()
    assert loaded.spec_type == "ngram-mod,ngram-cache" and config.cost_model == "gpu"
    assert isinstance(loaded.params["lookup_cache_static"], NgramCache)
    assert isinstance(loaded.cost_model, CostModel)
    again = loaded.with_files_loaded()
    assert again.params["lookup_cache_static"] is loaded.params["lookup_cache_static"]
    assert again.cost_model is loaded.cost_model and again.spec_type == loaded.spec_type
    SpecEngine(list(loaded.types), **loaded.params)         # what ChainEngines builds
    with pytest.raises(ValueError, match="--cost-model nope: neither a file nor a profile"):
        SpecConfig(cost_model="nope").with_files_loaded()
