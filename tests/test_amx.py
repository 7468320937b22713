"""Issue 14: llama.cpp's AMX weight repacking crashes on multi-token batches.

The decision (``ngramspec.llama.repack``) is tested over injected CPU-flags sources; the live
tests check that the decided ``use_extra_bufts`` reaches ``llama_model_params`` of every model ngramspec loads,
at the C call (``llama_model_load_from_file``), not just on the Python side. A host without AMX
cannot show the crash itself.
"""
import warnings

import pytest

from ngramspec.llama import repack
from ngramspec.llama.repack import (REPACK_CHOICES, cpu_flags, extra_buffer_types, host_has_amx,
                              use_extra_bufts)

AMX_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8
"""
PLAIN_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma
"""


@pytest.fixture
def amx_file(tmp_path):
    path = tmp_path / "cpuinfo-amx"
    path.write_text(AMX_CPUINFO)
    return path


@pytest.fixture
def plain_file(tmp_path):
    path = tmp_path / "cpuinfo-plain"
    path.write_text(PLAIN_CPUINFO)
    return path


# ---------------------------------------------------------------------------------------------
# the decision
# ---------------------------------------------------------------------------------------------

def test_flags_read_from_cpuinfo_file(amx_file, plain_file, tmp_path):
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx2"} <= cpu_flags(amx_file)
    assert host_has_amx(amx_file)
    assert "avx2" in cpu_flags(plain_file) and not host_has_amx(plain_file)
    # unreadable (non-Linux): no flags, so no AMX assumed
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert not host_has_amx(tmp_path / "missing")
    assert host_has_amx(lambda: {"sse2", "amx_tile"})
    assert not host_has_amx(lambda: {"sse2", "avx512f"})


def test_this_host_matches_proc_cpuinfo():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert host_has_amx() == (" amx_" in text)


@pytest.mark.parametrize("choice, amx, expected", [
    ("auto", True, False), ("auto", False, True),
    ("on", True, True), ("on", False, True),
    ("off", True, False), ("off", False, False),
    (True, True, True), (False, False, False),
])
def test_decision(choice, amx, expected, amx_file, plain_file):
    flags = amx_file if amx else plain_file
    assert use_extra_bufts(choice, flags=flags) is expected


@pytest.mark.parametrize("bad", ["yes", "", "AUTO", None, 1])
def test_bad_choice_names_the_flag(bad):
    with pytest.raises(ValueError, match=r"repack \(--repack\) must be one of auto, on, off"):
        use_extra_bufts(bad)
    assert REPACK_CHOICES == ("auto", "on", "off")


def test_auto_reads_the_default_source(monkeypatch, amx_file, plain_file):
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))
    assert use_extra_bufts("auto") is False
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(plain_file))
    assert use_extra_bufts("auto") is True


# ---------------------------------------------------------------------------------------------
# the parameter reaches llama.cpp
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def llama_loads(monkeypatch):
    """Record ``use_extra_bufts`` (and ``vocab_only``) of every ``llama_model_load_from_file``."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from llama_cpp import _internals
    calls = []
    original = llama_cpp.llama_cpp.llama_model_load_from_file

    def spy(path, params):
        calls.append((bool(params.use_extra_bufts), bool(params.vocab_only)))
        return original(path, params)

    # _internals.LlamaModel calls it as llama_cpp.llama_model_load_from_file, llama_cpp being
    # the module llama_cpp.llama_cpp.
    monkeypatch.setattr(_internals.llama_cpp, "llama_model_load_from_file", spy)
    return calls


@pytest.fixture
def model_path():
    pytest.importorskip("llama_cpp")
    from ngramspec.llama.model import default_model_path
    return default_model_path()


@pytest.mark.parametrize("amx", [True, False], ids=["amx-host", "no-amx-host"])
def test_load_model_auto(monkeypatch, llama_loads, model_path, amx, amx_file, plain_file):
    from ngramspec.llama import load_model
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file if amx else plain_file))
    llm = load_model(model_path, n_ctx=256, n_threads=1)
    assert llama_loads == [(not amx, False)]
    assert bool(llm.model_params.use_extra_bufts) is (not amx)


@pytest.mark.parametrize("choice", ["on", "off"])
def test_load_model_override(monkeypatch, llama_loads, model_path, choice, amx_file):
    from ngramspec.llama import load_model
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))  # the override wins over auto
    load_model(model_path, n_ctx=256, n_threads=1, repack=choice)
    assert llama_loads == [(choice == "on", False)]


def test_load_model_bad_repack_fails_before_loading(llama_loads, model_path):
    from ngramspec.llama import load_model
    with pytest.raises(ValueError, match="--repack"):
        load_model(model_path, repack="maybe")
    assert llama_loads == []


def test_override_is_scoped(llama_loads, model_path):
    from llama_cpp import llama_cpp as lc   # the module Llama.__init__ calls through
    before = lc.llama_model_default_params
    with pytest.raises(RuntimeError):
        with extra_buffer_types(False):
            assert lc.llama_model_default_params().use_extra_bufts is False
            raise RuntimeError
    assert lc.llama_model_default_params is before
    assert lc.llama_model_default_params().use_extra_bufts is True  # llama.cpp's default


@pytest.mark.parametrize("choice", ["on", "off"])
def test_draft_model_from_path(monkeypatch, llama_loads, model_path, choice, amx_file,
                               plain_file):
    from ngramspec.llama.draft_model import DraftModelProposer
    DraftModelProposer(model_path, 1, n_ctx=64, n_threads=1, repack=choice)
    assert llama_loads == [(choice == "on", False)]
    llama_loads.clear()
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))
    DraftModelProposer(model_path, 1, n_ctx=64, n_threads=1)  # auto
    assert llama_loads == [(False, False)]


@pytest.mark.parametrize("flags, want", [([], None), (["--repack", "on"], True),
                                         (["--repack", "off"], False), (["--no-repack"], False)])
def test_generate_cli_loads_every_model_with_the_choice(monkeypatch, llama_loads, model_path,
                                                        capsys, amx_file, flags, want):
    """Target, the draft model's vocabulary check and the draft model itself."""
    from ngramspec.cli import main
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))
    # -n 0 and the fixed policy: every model is loaded, nothing is decoded (with extra buffer
    # types on, a real AMX host would crash in the first multi-token batch: issue 14).
    rc = main(["generate", "-p", "def f(x): return x + 1\ndef g(x): return x + 1\n", "-n", "0",
               "-c", "256", "-t", "1", "--spec-type", "ngram-simple", "--spec-policy", "fixed",
               "-md", model_path, *flags])
    assert rc == 0, capsys.readouterr().err
    want = False if want is None else want   # auto on the injected AMX host
    assert llama_loads == [(want, False), (want, True), (want, False)]


def test_generate_cli_bad_repack_choice(capsys):
    from ngramspec.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-p", "x", "--repack", "maybe"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "--repack" in err and "'auto', 'on', 'off'" in err


def test_cache_create_text_loads_vocab_with_the_decision(monkeypatch, llama_loads, model_path,
                                                         tmp_path, capsys, amx_file):
    from ngramspec.cli import main
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))
    text = tmp_path / "t.txt"
    text.write_text("one two three one two three\n")
    rc = main(["cache", "create", "--text", str(text), "-o", str(tmp_path / "s.bin"),
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert llama_loads == [(False, True)]


# ---------------------------------------------------------------------------------------------
# the plug-in: warns once when its Llama has extra buffer types on an AMX host
# ---------------------------------------------------------------------------------------------

def _plugin_run(model_path, choice, flags_file, monkeypatch):
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    from ngramspec.llama.repack import load_llama
    monkeypatch.setattr(repack, "_warned", False)
    draft = NgramspecDraftModel("ngram-simple", n_ctx=256)
    llm = load_llama(model_path, repack=choice, n_ctx=256, n_threads=1, n_threads_batch=1,
                     logits_all=True, verbose=False, draft_model=draft)
    # Only now is the host "AMX" (this one has none: loading with extra buffers is safe here).
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(flags_file))
    gen = dict(max_tokens=3, temperature=0.0, top_k=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.create_completion("a b c a b c a b", **gen)
        llm.create_completion("x y z x y z", **gen)
    assert draft.n_calls > 0
    return [w for w in caught if issubclass(w.category, RuntimeWarning)
            and "AMX" in str(w.message)]


# These runs decode multi-token batches with llama.cpp's extra buffer types on: on a real AMX
# host that is the crash of issue 14 (the whole test process dies), so they run elsewhere only.
CRASHES_HERE = pytest.mark.skipif(
    host_has_amx(), reason="decodes with AMX repacking on, which crashes llama.cpp on this "
                           "AMX host (llama.cpp issue 20824; ngramspec's auto choice avoids it)")


@CRASHES_HERE
def test_plugin_warns_once_on_amx_host_with_extra_buffers(model_path, monkeypatch, amx_file):
    got = _plugin_run(model_path, "on", amx_file, monkeypatch)
    assert len(got) == 1
    assert "load_llama" in str(got[0].message)


@pytest.mark.parametrize("choice, host", [("off", "amx"),
                                          pytest.param("on", "plain", marks=CRASHES_HERE)])
def test_plugin_silent_otherwise(model_path, monkeypatch, amx_file, plain_file, choice, host):
    assert _plugin_run(model_path, choice, amx_file if host == "amx" else plain_file,
                       monkeypatch) == []


def test_plugin_not_attached_warns_on_amx_hosts_only(monkeypatch, amx_file, plain_file):
    """A plug-in no load_llama attached (its Llama built with llama-cpp-python's defaults, or
    called directly) cannot see its Llama: it warns on an AMX host, naming load_llama."""
    import numpy as np

    from ngramspec.integrations.llama_cpp import NgramspecDraftModel
    ids = np.arange(20, dtype=np.intc) % 5
    for flags, n in ((plain_file, 0), (amx_file, 1)):
        monkeypatch.setattr(repack, "_warned", False)
        monkeypatch.setattr(repack, "CPUINFO_PATH", str(flags))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            NgramspecDraftModel("ngram-simple")(ids)
        got = [w for w in caught if issubclass(w.category, RuntimeWarning)
               and "AMX" in str(w.message)]
        assert len(got) == n
    assert "not loaded by load_llama" in str(got[0].message)


def test_plugin_attaches_only_to_its_own_llama():
    from ngramspec.integrations.llama_cpp import NgramspecDraftModel

    class NotItsLlama:
        draft_model = None
    with pytest.raises(ValueError, match="draft_model is not this draft model"):
        NgramspecDraftModel("ngram-simple").attach(NotItsLlama())


def test_draft_model_from_llama_warns(model_path, monkeypatch, amx_file):
    from ngramspec.llama.draft_model import DraftModelProposer
    from ngramspec.llama.repack import load_llama
    llm = load_llama(model_path, repack="on", n_ctx=256, verbose=False)
    monkeypatch.setattr(repack, "_warned", False)
    monkeypatch.setattr(repack, "CPUINFO_PATH", str(amx_file))
    with pytest.warns(RuntimeWarning, match="AMX"):
        DraftModelProposer(llm, 1, n_ctx=64, n_threads=1)
