"""The GPU device kit (bench/gpu/) without a GPU and without compiling llama.cpp: the sdist
trimming rules, the size budget and the model split, the random-shape GGUF writer (tiny models
loaded and calibrated by the real llama.cpp), the report and the profile from a sample result,
and the device script's refusal to run the live call on a machine that lost the build call's
state."""
import gzip
import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "gpu"))
import kit      # noqa: E402
import profile_entry as gpu_profile  # noqa: E402
import report   # noqa: E402
import shapes   # noqa: E402

SDIST_TOP = "llama_cpp_python-0.3.36"
KEPT = ["CMakeLists.txt", "pyproject.toml", "README.md", "llama_cpp/llama.py",
        "llama_cpp/lib/.keep",
        "vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/cmake/common.cmake",
        "vendor/llama.cpp/src/llama.cpp", "vendor/llama.cpp/include/llama.h",
        "vendor/llama.cpp/common/common.cpp", "vendor/llama.cpp/ggml/CMakeLists.txt",
        "vendor/llama.cpp/ggml/src/ggml.c", "vendor/llama.cpp/ggml/src/CMakeLists.txt",
        "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu",
        "vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu",
        "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp",
        "vendor/llama.cpp/vendor/nlohmann/json.hpp",
        "vendor/llama.cpp/vendor/miniaudio/CMakeLists.txt",
        "vendor/llama.cpp/gguf-py/gguf/gguf_reader.py"]
DROPPED = ["vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf", "vendor/llama.cpp/docs/build.md",
           "vendor/llama.cpp/tests/test-backend-ops.cpp", "vendor/llama.cpp/tools/mtmd/clip.cpp",
           "vendor/llama.cpp/examples/simple/simple.cpp",
           "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
           "vendor/llama.cpp/ggml/src/ggml-metal/CMakeLists.txt",
           "vendor/llama.cpp/ggml/src/ggml-cuda/README.md",
           "vendor/llama.cpp/vendor/miniaudio/miniaudio.h",
           "vendor/llama.cpp/vendor/stb/stb_image.h",
           "vendor/llama.cpp/gguf-py/tests/test_quants.py", "docs/index.md",
           "llama_cpp/__pycache__/llama.cpython-312.pyc", "vendor/llama.cpp/CONTRIBUTING.md"]


@pytest.mark.parametrize("rel", KEPT)
def test_trim_keeps_what_a_cuda_build_reads(rel):
    assert kit.keep(rel)


@pytest.mark.parametrize("rel", DROPPED)
def test_trim_drops_models_docs_and_other_backends(rel):
    assert not kit.keep(rel)


def _fake_sdist(path, names):
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = name.encode() * 10
            info = tarfile.TarInfo(f"{SDIST_TOP}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_trim_sdist_writes_the_kept_members_only(tmp_path):
    _fake_sdist(tmp_path / "in.tar.gz", KEPT + DROPPED)
    got = kit.trim_sdist(tmp_path / "in.tar.gz", tmp_path / "out.tar.gz")
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        names = sorted(m.name for m in tar)
    assert names == sorted(f"{SDIST_TOP}/{n}" for n in KEPT)
    assert got["files"] == len(KEPT)
    assert got["bytes"] == sum(len(n.encode()) * 10 for n in KEPT)
    assert got["packed"] == (tmp_path / "out.tar.gz").stat().st_size
    assert not (tmp_path / "out.tar.gz.part").exists()


def test_split_join_round_trip_is_exact(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 3_000_001, dtype=np.uint8).tobytes()
    src = tmp_path / "m.gguf"
    src.write_bytes(data)
    p1, p2 = kit.split_file(src, 1_234_567, tmp_path / "a", tmp_path / "b")
    assert (p1.stat().st_size, p2.stat().st_size) == (1_234_567, 3_000_001 - 1_234_567)
    digest = (tmp_path / "b" / "m.gguf.sha256").read_text()
    out = kit.join_parts([p1, p2], tmp_path / "joined.gguf", digest)
    assert out.read_bytes() == data


def test_join_refuses_a_wrong_part(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(bytes(range(256)) * 100)
    p1, p2 = kit.split_file(src, 1000, tmp_path / "a", tmp_path / "b")
    digest = (tmp_path / "b" / "m.gguf.sha256").read_text()
    p2.write_bytes(p2.read_bytes()[:-1])   # cut short in transit
    with pytest.raises(ValueError, match="sha256"):
        kit.join_parts([p1, p2], tmp_path / "joined.gguf", digest)
    assert not (tmp_path / "joined.gguf").exists()
    with pytest.raises(ValueError, match="inside the file"):
        kit.split_file(src, src.stat().st_size, tmp_path / "a", tmp_path / "b")


def test_split_point_keeps_both_calls_under_the_limit():
    mib = 2**20
    model, other1, other2 = 98 * 10**6, 6 * mib, 9 * mib
    first = kit.split_point(model, other1, other2)
    call1 = kit.TREE_RESERVE + other1 + first
    call2 = kit.TREE_RESERVE + other2 + model - first
    assert call1 <= kit.CARRY_LIMIT and call2 <= kit.CARRY_LIMIT
    assert abs((kit.CARRY_LIMIT - call1) - (kit.CARRY_LIMIT - call2)) <= 1   # same headroom
    with pytest.raises(ValueError, match="does not fit two calls"):
        kit.split_point(120 * mib, other1, other2)


def test_call_sizes_count_each_calls_folders(tmp_path):
    for name, size in (("src", 100), ("wheels", 20), ("model1", 3), ("model2", 4),
                       ("traces", 50)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x" * size)
    assert kit.call_sizes(tmp_path) == {"build": 123, "live": 54}
    assert kit.carry_paths("live") == ["bench/gpu/kit/model2", "bench/gpu/kit/traces"]


@pytest.mark.parametrize("name, params", [("llama-3.1-8b", 8_030_261_248),
                                          ("llama-3.2-1b", 1_235_814_400)])
def test_shapes_have_the_published_parameter_counts(name, params):
    assert sum(int(np.prod(d)) for _, d, _ in shapes.tensors(shapes.SHAPES[name], "q4_0")) \
        == params


@pytest.mark.parametrize("name, wtype", [("tiny", "q4_0"), ("tiny-untied", "q8_0"),
                                         ("tiny", "f16")])
def test_random_shape_model_loads_decodes_and_calibrates(tmp_path, name, wtype):
    pytest.importorskip("llama_cpp")
    from ngramspec.llama.calibration import calibrate
    from ngramspec.llama.model import load_model
    path = tmp_path / f"{name}-{wtype}.gguf"
    size = shapes.write(str(path), name, wtype)
    assert size == path.stat().st_size
    shape = shapes.SHAPES[name]
    llm = load_model(str(path), n_ctx=256, n_batch=64, n_threads=1)
    assert llm.n_vocab() == shape.n_vocab and llm.n_embd() == shape.n_embd
    assert llm.tokenize(b"hi", add_bos=False, special=False)   # byte fallback
    curve = calibrate(llm, ks=(1, 2, 8), n_pasts=(16, 64), reps=1, budget_s=5)
    assert curve.ks == (1, 2, 8) and curve.cost(1, 16) == 1.0
    assert all(np.isfinite(curve.seconds(k, 64)) and curve.seconds(k, 64) > 0 for k in (1, 8))


def test_shapes_reject_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="shape must be one of"):
        shapes.write(str(tmp_path / "x.gguf"), "llama-70b", "q4_0")
    with pytest.raises(ValueError, match="type must be one of"):
        shapes.write(str(tmp_path / "x.gguf"), "tiny", "q5_k")


def _sample_result():
    curve = {"format": "ngramspec-cost/1", "name": "calibrated", "source": "test",
             "ks": [1, 2, 4, 8, 16, 32, 64], "n_past": [32, 1024],
             "seconds": [[0.010, 0.0102, 0.0104, 0.011, 0.012, 0.014, 0.02],
                         [0.012, 0.0122, 0.0125, 0.013, 0.0145, 0.017, 0.025]],
             "meta": {"shape": "llama-3.1-8b", "type": "q4_0"}}
    return {"format": "ngramspec-gpu/1", "dry_run": False,
            "device": {"gpu": "NVIDIA H200, 580.159.03, 143771 MiB", "date": "2026-11-27",
                       "llama_cpp_python": "0.3.36", "revision": "abc1234"},
            "curves": {"llama-3.1-8b-q4_0": curve},
            "driver": {"n_predict": 256, "plain": {"tokens_per_s": 500.0, "n_decodes": 256,
                                                   "decode_ms_per_step": 1.5,
                                                   "driver_ms_per_step": 0.4}},
            "replay": {"cost_model": "8B", "outputs": "recorded", "names": ["ngram-mod"],
                       "summary": {"code-edit": {"oracle": {"geomean": 9.1, "min": 3.0},
                                                 "ngram-mod": {"geomean": 2.5, "min": 1.1}}}},
            "steps": {"calibrate llama-3.1-8b-q4_0": {"phase": "build", "rc": 0,
                                                      "seconds": 12.5}}}


def test_report_renders_the_curves_and_the_steps(tmp_path):
    md = report.render(_sample_result())
    assert "| llama-3.1-8b | q4_0 | 32 | 10.00 | 1.02 | 1.04 | 1.10 | 1.20 | 1.40 | 2.00 |" in md
    assert "| llama-3.1-8b | q4_0 | 1024 | 12.00 |" in md
    assert "| plain | 500.0 | 256 | 1.500 | 0.400 |" in md
    assert "| ngram-mod | 2.500 (1.100) |" in md
    assert "| calibrate llama-3.1-8b-q4_0 | build | 0 | 12.5 |" in md
    assert "CPU dry run" not in md
    src = tmp_path / "gpu.json"
    src.write_text(json.dumps(_sample_result()))
    assert report.main([str(src)]) == 0
    assert (tmp_path / "gpu.md").read_text() == md
    src.write_text(json.dumps({"format": "other"}))
    with pytest.raises(SystemExit, match="not a GPU kit result"):
        report.main([str(src)])


def test_profile_source_builds_the_measured_cost_model():
    from ngramspec import cost
    res = _sample_result()
    ns = {"CostModel": cost.CostModel, "_from_ms": cost._from_ms}
    exec(gpu_profile.profile_source(res), ns)
    model = ns["_gpu_profile"]()
    assert model.name == "gpu" and "NVIDIA H200" in model.source
    assert model.cost(8, 32) == pytest.approx(1.1) and model.cost(64, 1024) == pytest.approx(
        0.025 / 0.012)
    with pytest.raises(ValueError, match="no curve 'x'"):
        gpu_profile.profile_source(res, "x")
    with pytest.raises(ValueError, match="dry run"):
        gpu_profile.profile_source({**res, "dry_run": True})


def test_live_call_on_a_fresh_machine_says_to_rerun_the_build_call(tmp_path):
    env = {**os.environ, "GPU_KIT_STATE": str(tmp_path / "state"), "OUT": str(tmp_path / "out")}
    p = subprocess.run([sys.executable, str(HERE / "gpu" / "measure.py"), "live"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "did not run the build call" in p.stderr


def test_device_script_parses_and_names_its_phases(tmp_path):
    script = HERE / "gpu" / "run_device.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    p = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path / "out"), "GPU_KIT_CPU": "1",
                            "GPU_KIT_STATE": str(tmp_path / "state")})
    assert p.returncode == 2 and "build|live|all" in p.stderr


def test_steps_are_time_boxed_by_the_calls_budget_and_recorded(tmp_path, monkeypatch):
    """A step's time box is cut to the call's budget, a timeout and a failure are recorded with
    the output's tail, a step with no time left is skipped, and gpu.json/gpu.md are written to
    $OUT after every step."""
    import importlib
    import time
    monkeypatch.setenv("GPU_KIT_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPU_KIT_T0", str(time.time()))
    monkeypatch.setenv("GPU_KIT_BUDGET", "18")   # the last 10 s stay for the report
    import measure
    measure = importlib.reload(measure)    # it reads the environment at import
    run = measure.Run("build")
    py = sys.executable
    assert run.step("ok", [py, "-c", "print('hi')"], 100)
    assert not run.step("fails", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 100)
    assert not run.step("slow", [py, "-c", "import time; time.sleep(60)"], 100)
    assert not run.step("late", [py, "-c", "print('never')"], 100)
    steps = json.loads((tmp_path / "out" / "gpu.json").read_text())["steps"]
    assert steps["ok"]["rc"] == 0 and "tail" not in steps["ok"]
    assert steps["fails"]["rc"] == 3 and "boom" in steps["fails"]["tail"]
    assert steps["slow"]["rc"] == "timeout" and steps["slow"]["seconds"] < 9
    assert "no time left" in steps["late"]["skipped"]
    md = (tmp_path / "out" / "gpu.md").read_text()
    assert "| slow | build | timeout |" in md and "| late | build | no time left" in md
