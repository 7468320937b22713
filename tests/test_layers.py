"""The package's layers point one way: kernels <- registry/engine <- loop <- drivers.

Read from the sources (every import statement, function-local ones included), so a cycle or an
upward import fails here before it can fail at import time in some order."""
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PKG = ROOT / "ngramspec"
# _core (the engine), one module per proposer, and the header-only .pxd helpers (_types, _hash, ...)
KERNELS = tuple(sorted({p.stem for p in PKG.glob("*.pyx")} | {p.stem for p in PKG.glob("*.pxd")}))
IMPORT = re.compile(r"^\s*(?:from\s+(\.+\w*|ngramspec(?:\.\w+)?)\s+c?import\s+([\w, ()]+)"
                    r"|import\s+(ngramspec(?:\.\w+)?))", re.M)


def _imports(path: pathlib.Path) -> set:
    deps = set()
    for frm, names, plain in IMPORT.findall(path.read_text(encoding="utf-8")):
        mod = plain or frm
        if mod.startswith("."):
            mod = "ngramspec" + (mod if mod != "." else "")
        if mod == "ngramspec" and names:          # from ngramspec import registry, SpecEngine
            subs = {n.strip() for n in names.strip("()").split(",")}
            deps |= {n for n in subs if (PKG / f"{n}.py").exists()} or {"__init__"}
        elif mod.startswith("ngramspec."):
            deps.add(mod.split(".")[1])
    return deps - {path.stem}


def _graph() -> dict:
    files = [p for p in PKG.iterdir() if p.suffix in (".py", ".pyx")]
    return {p.stem: _imports(p) for p in files}


def test_no_import_cycle():
    graph = _graph()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if dep == "__init__":
                continue
            if state.get(dep) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_kernels_import_no_python_layer():
    assert {"_core", "_proposer", "_simple", "_map", "_mod", "_suffix", "_cache"} <= set(KERNELS)
    for path in sorted(PKG.glob("*.pyx")) + sorted(PKG.glob("*.pxd")):
        deps = _imports(path)
        assert deps <= set(KERNELS), f"{path.name} imports {sorted(deps - set(KERNELS))}"


def test_the_loop_needs_neither_llama_cpp_nor_kernels():
    text = (PKG / "loop.py").read_text(encoding="utf-8")
    assert _imports(PKG / "loop.py") == set()
    assert "llama_cpp" not in re.sub(r'""".*?"""', "", text, flags=re.S)


def test_importing_the_package_loads_no_llama_cpp():
    code = ("import sys, ngramspec, ngramspec.replay, ngramspec.loop; "
            "print('llama_cpp' in sys.modules); "
            "print(callable(ngramspec.replay), callable(ngramspec.generate_speculative))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "False"                    # live generation is imported on first use
    assert out[1:] == ["True", "True"]
