"""`ngramspec.load_order`: a GPU build of llama-cpp-python is imported before numpy and the
kernels (the CUDA load died otherwise on the H200: bench/gpu/README.md §5); nothing else is."""
import importlib.util
import os
import subprocess
import sys
import textwrap

from ngramspec.load_order import gpu_build_libraries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, extra_path=None):
    path = [p for p in (extra_path, ROOT, os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def _package_like_a_cuda_build(tmp_path):
    """A ``llama_cpp`` folder laid out as a CUDA build's (``lib/libggml-cuda.so``) whose import
    records whether numpy was loaded before it."""
    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "lib" / "libggml-cuda.so").write_bytes(b"")
    (pkg / "__init__.py").write_text(
        "import sys\nNUMPY_BEFORE = 'numpy' in sys.modules\n")
    return tmp_path


def test_gpu_build_libraries(tmp_path):
    assert gpu_build_libraries(None) == []
    assert gpu_build_libraries(str(tmp_path)) == []          # no lib folder
    (tmp_path / "lib").mkdir()
    for name in ("libllama.so", "libggml-cpu.so", "libggml-base.so"):
        (tmp_path / "lib" / name).write_bytes(b"")
    assert gpu_build_libraries(str(tmp_path)) == []          # a CPU build
    (tmp_path / "lib" / "libggml-cuda.so.0").write_bytes(b"")
    assert gpu_build_libraries(str(tmp_path)) == ["libggml-cuda.so.0"]


def test_a_gpu_build_is_imported_before_numpy(tmp_path):
    folder = _package_like_a_cuda_build(tmp_path)
    out = _run("""
        import ngramspec, sys
        print('llama_cpp' in sys.modules, sys.modules['llama_cpp'].NUMPY_BEFORE)
    """, str(folder))
    assert out == ["True", "False"]


def test_after_numpy_nothing_is_imported(tmp_path):
    folder = _package_like_a_cuda_build(tmp_path)
    out = _run("""
        import numpy, ngramspec, sys
        print('llama_cpp' in sys.modules)
    """, str(folder))
    assert out == ["False"]


def test_the_installed_build_decides():
    # this machine's llama-cpp-python (if any): imported by `import ngramspec` exactly when it
    # is a GPU build
    spec = importlib.util.find_spec("llama_cpp")
    gpu = any(gpu_build_libraries(d) for d in (spec.submodule_search_locations or [])) \
        if spec else False
    assert _run("import ngramspec, sys; print('llama_cpp' in sys.modules)") == [str(gpu)]
