"""Issue 30: $LLAMA_ARG_N_GPU_LAYERS (llama-server's variable for -ngl) reaches every model that
ngramspec loads through ``load_llama``, so generate, calibrate, serve and the server processes
the benchmarks start offload alike on a GPU build; a bad value is refused with its name."""
import pytest

from ngramspec.llama.repack import GPU_LAYERS_ENV, gpu_layers_from_env


@pytest.mark.parametrize("text, expected", [("", None), ("  ", None), ("-1", -1), ("0", 0),
                                            (" 99 ", 99)])
def test_value(text, expected):
    assert gpu_layers_from_env({GPU_LAYERS_ENV: text}) == expected
    assert gpu_layers_from_env({}) is None


@pytest.mark.parametrize("text", ["all", "-2", "1.5"])
def test_bad_value_names_the_variable(text):
    with pytest.raises(ValueError, match="LLAMA_ARG_N_GPU_LAYERS must be an integer >= -1"):
        gpu_layers_from_env({GPU_LAYERS_ENV: text})


def test_load_model_takes_it_and_an_explicit_keyword_wins(monkeypatch):
    pytest.importorskip("llama_cpp")
    from ngramspec.llama.model import default_model_path, load_model
    from ngramspec.llama.repack import load_llama
    monkeypatch.setenv(GPU_LAYERS_ENV, "7")
    llm = load_model(default_model_path(), n_ctx=64, n_threads=1)
    assert llm.model_params.n_gpu_layers == 7
    llm = load_llama(default_model_path(), n_ctx=64, n_threads=1, n_gpu_layers=0, verbose=False)
    assert llm.model_params.n_gpu_layers == 0
    monkeypatch.setenv(GPU_LAYERS_ENV, "x")
    with pytest.raises(ValueError, match=GPU_LAYERS_ENV):
        load_model(default_model_path(), n_ctx=64, n_threads=1)
