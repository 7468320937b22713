"""The package's layers point one way: base (`ngramspec.validation`) <- kernels <- registry/engine
<- loop/policy/cost <- drivers (replay, tune, `ngramspec.llama`: live, scheduler) <-
`ngramspec.server` <- `ngramspec.cli` <- `ngramspec.integrations` (ngramspec inside vLLM, SGLang,
llama-cpp-python).

Read from the sources (every import statement, function-local ones included, subpackages too),
so a cycle or an upward import fails here before it can fail at import time in some order."""
import ast
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PKG = ROOT / "ngramspec"
# _engine (the chain), one module per proposer, and the header-only .pxd helpers (_types, ...)
KERNELS = tuple(sorted({p.stem for p in PKG.glob("*.pyx")} | {p.stem for p in PKG.glob("*.pxd")}))
CIMPORT = re.compile(r"^\s*(?:from\s+(\.+\w*|ngramspec(?:\.\w+)?)\s+c?import\s+([\w, ()]+)"
                     r"|c?import\s+(ngramspec(?:\.\w+)?))", re.M)
SUBPACKAGES = ("llama", "server", "cli", "integrations")
# Rank of each layer: a module imports only modules of its own rank or below.
RANK = {"base": -1, "kernel": 0, "core": 1, "llama": 2, "server": 3, "cli": 4,
        "integrations": 5}
# Below the kernels: plain Python that every layer (the kernels too) may use; imports no ngramspec.
BASE = ("ngramspec.validation", "ngramspec.load_order")
# The deprecated import path of a moved module re-exports it from its new, higher home.
MOVED = {"ngramspec.llama.plugin": "ngramspec.integrations.llama_cpp"}
# Function-local imports are for optional dependencies only (imported when a feature is used):
# llama-cpp-python and its jinja2 (the live extra), fastapi/uvicorn (serve), matplotlib (tune's
# plots), fcntl (POSIX), redis (the store log's Redis backend, the `store` extra); the engines of
# ngramspec.integrations (vllm, sglang) are optional too.
OPTIONAL = ("llama_cpp", "jinja2", "matplotlib", "uvicorn", "fastapi", "starlette", "fcntl",
            "ngramspec.server", "vllm", "sglang", "redis")


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _py_files():
    return sorted(PKG.rglob("*.py"))


MODULES = {_name(p): p for p in _py_files()}


def _layer(module: str) -> str:
    if module == "ngramspec.__main__":    # python -m ngramspec: the command line
        return "cli"
    if module in BASE:
        return "base"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in SUBPACKAGES:
        return parts[1]
    return "kernel" if len(parts) > 1 and parts[1] in KERNELS else "core"


def _imports(path: pathlib.Path):
    """``(module, line, function_local)`` for each import of a Python source; names imported from
    a package resolve to its submodules where they are modules (``from ngramspec import cost``)."""
    this = _name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                if base == "__future__":
                    continue
                subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in MODULES
                        or f"{base}.{a.name}".split(".")[-1] in KERNELS]
                names = [a.name for a in child.names]
                found.extend((m, child.lineno, local) for m in subs)
                if len(subs) < len(names):
                    found.append((base, child.lineno, local))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def _graph(local: bool = True) -> dict:
    """module -> the ngramspec modules it imports (function-local ones too with ``local``)."""
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {m for m, _, is_local in _imports(path)
                       if m.startswith("ngramspec") and m != name and (local or not is_local)}
    return graph


def _find_cycle(graph):
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = visit(dep, stack + [dep])
                if cycle:
                    return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_the_sources_are_all_read():
    # the subpackages are part of the graph, so a cycle through one of them is seen
    assert {"ngramspec.llama.live", "ngramspec.llama.decoder", "ngramspec.cli",
            "ngramspec.cli.common", "ngramspec.server.app", "ngramspec.registry"} <= set(MODULES)
    assert not (PKG / "live.py").exists() and not (PKG / "cli.py").exists()
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    """No cycle among ngramspec's modules, subpackages included, function-local imports too."""
    cycle = _find_cycle(_graph(local=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_point_down():
    """kernels <- core (registry, engine, loop, policy, cost, replay, ...) <- llama <- server <-
    cli: no module imports a layer above its own, except an optional dependency imported in
    the function that needs it."""
    bad = []
    for name, path in MODULES.items():
        for module, line, local in _imports(path):
            if not module.startswith("ngramspec") or module == "ngramspec":
                continue
            if RANK[_layer(module)] > RANK[_layer(name)] and not (
                    local and module.startswith(OPTIONAL)) and MOVED.get(name) != module:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, bad


def test_function_local_imports_are_optional_dependencies():
    """A function-local import is there only to keep an optional dependency optional."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module} inside a function"
           for path in MODULES.values() for module, line, local in _imports(path)
           if local and not module.startswith(OPTIONAL)]
    assert not bad, bad


def test_llama_cpp_is_imported_in_the_llama_subpackage_only():
    for name, path in MODULES.items():
        uses = [(m, line, local) for m, line, local in _imports(path)
                if m.split(".")[0] == "llama_cpp"]
        if _layer(name) == "llama":
            # even there on first use, so the package and the command line import without it
            assert all(local for _, _, local in uses), uses
        elif name == "ngramspec.integrations.llama_cpp":
            continue            # the plug-in subclasses llama-cpp-python's draft model
        elif name == "ngramspec.load_order":
            # `import ngramspec` loads a GPU build of llama.cpp before numpy (its docstring
            # says why), inside the function that checks for one
            assert uses and all(local for _, _, local in uses), uses
        else:
            assert not uses, f"{path.relative_to(ROOT)} imports llama_cpp: {uses}"
    for path in sorted(PKG.glob("*.pyx")) + sorted(PKG.glob("*.px[di]")):
        assert "llama_cpp" not in path.read_text(encoding="utf-8"), path.name


def test_kernels_import_no_python_layer():
    assert {"_engine", "_proposer", "_simple", "_map", "_mod", "_suffix", "_cache"} <= set(KERNELS)
    for path in sorted(PKG.glob("*.pyx")) + sorted(PKG.glob("*.px[di]")):
        deps = set()
        for frm, names, plain in CIMPORT.findall(path.read_text(encoding="utf-8")):
            mod = plain or frm
            if mod.startswith("."):
                mod = "ngramspec" + (mod if mod != "." else "")
            if mod == "ngramspec" and names:
                deps |= {n.strip() for n in names.strip("()").split(",")}
            elif mod.startswith("ngramspec."):
                deps.add(mod.split(".")[1])
        deps -= {path.stem}
        allowed = set(KERNELS) | {m.split(".")[1] for m in BASE}
        assert deps <= allowed, f"{path.name} imports {sorted(deps - allowed)}"


def test_the_base_layer_imports_nothing_of_ngramspec():
    """The one validation helper sits under the kernels: it imports no ngramspec module."""
    for name in BASE:
        deps = [m for m, _, _ in _imports(MODULES[name]) if m.startswith("ngramspec")]
        assert not deps, (name, deps)


# The engine contract and the counter type: plain Python the loop may use (they import nothing
# of ngramspec themselves).
CONTRACTS = ("ngramspec.draft_engine", "ngramspec.stats")


def test_the_loop_needs_neither_llama_cpp_nor_kernels():
    text = (PKG / "loop.py").read_text(encoding="utf-8")
    assert {m for m, _, _ in _imports(PKG / "loop.py") if m.startswith("ngramspec")} \
        <= set(CONTRACTS + BASE)
    for name in CONTRACTS:
        assert not [m for m, _, _ in _imports(MODULES[name]) if m.startswith("ngramspec")], name
    assert "llama_cpp" not in re.sub(r'""".*?"""', "", text, flags=re.S)


# A policy's moments; the drivers call them (ngramspec.policy.DraftPolicy.draft / verify).
POLICY_MOMENTS = ("before_draft", "after_draft", "observe", "choose")


def _reaches_the_policy(cls: ast.ClassDef) -> list:
    """``line: name`` of each name, attribute, parameter or string (docstrings aside) in class
    `cls` that names a policy or one of its moments."""
    docs = {id(n.body[0].value) for n in ast.walk(cls)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n) is not None}
    found = []
    for node in ast.walk(cls):
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.arg):
            name = node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            name = node.value           # __slots__, getattr(self, "policy")
        else:
            continue
        if "policy" in name.lower() or name in POLICY_MOMENTS:
            found.append(f"{node.lineno}: {name}")
    return found


def test_the_loop_does_not_reach_the_policy():
    """Data flows driver -> policy -> loop -> engine, never back (issue 39): `SlotLoop` takes no
    policy, holds none and calls no policy moment; the drivers call the policy, which calls the
    loop. loop.py defines no policy either (its driver run_recorded takes one as a parameter)."""
    tree = ast.parse((PKG / "loop.py").read_text(encoding="utf-8"))
    (loop,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SlotLoop"]
    assert _reaches_the_policy(loop) == []
    assert not [n.name for n in tree.body if isinstance(n, ast.ClassDef) and "Policy" in n.name]
    # the check sees a loop that calls its policy back (main's before issue 39), not its docs
    calls_back = ast.parse('class SlotLoop:\n    """Drafts; a policy cuts."""\n'
                           '    __slots__ = ("_policy",)\n'
                           '    def verify(self, n):\n        """The policy learns."""\n'
                           '        self.hooks.observe(self, n)\n'
                           '    def __init__(self, p=None, *, policy=None):\n'
                           '        self._policy = policy\n')
    assert sorted(_reaches_the_policy(calls_back.body[0])) == [
        "3: _policy", "6: observe", "7: policy", "8: _policy", "8: policy"]


def test_importing_the_package_loads_no_llama_cpp():
    """Neither the package, nor the llama layer's modules, nor the whole command line (every
    subcommand's parser built) import llama_cpp: it is loaded on first use."""
    code = ("import sys, ngramspec, ngramspec.replay, ngramspec.loop, ngramspec.cli; "
            "import ngramspec.llama.live, ngramspec.llama.scheduler, ngramspec.llama.draft_model; "
            "ngramspec.cli.build_parser(); "
            "print('llama_cpp' in sys.modules); "
            "print(callable(ngramspec.replay), callable(ngramspec.generate_speculative))")
    out = " ".join(_python_lines(code)).split()
    assert out[0] == "False"                    # live generation is imported on first use
    assert out[1:] == ["True", "True"]


def _defining(pattern: str):
    """``path:line`` of each package source line that matches `pattern`."""
    rx = re.compile(pattern)
    return [f"{path.relative_to(ROOT)}:{i}" for path in MODULES.values()
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if rx.search(line)]


def test_one_policy_one_writer():
    """One draft-length policy module (policy.py: the moments' base DraftPolicy, llama.cpp's
    FixedPolicy, AutoPolicy), whose batch method is the scheduler's joint choice; one atomic
    writer (files.py)."""
    policies = _defining(r"^\s*class \w*Policy\b")
    assert sorted(policies) == sorted(_defining(r"^class (AutoPolicy|DraftPolicy|FixedPolicy)\b"))
    assert len(policies) == 3 and all(p.startswith("ngramspec/policy.py") for p in policies)
    assert not [p for p in _defining(r"StepCost|def \w*choose_lengths\b")]
    # the one decision of verified lengths, single or joint: AutoPolicy's (DraftPolicy's keeps all)
    assert sorted(p.split(":")[0] for p in _defining(r"def choose\b")) == [
        "ngramspec/policy.py", "ngramspec/policy.py"]
    assert [p.split(":")[0] for p in _defining(r"\bos\.replace\(")] == ["ngramspec/files.py"]


def test_integrations_know_only_the_engine_the_loop_and_the_policy():
    """ngramspec inside another engine is the engine, one loop per request and the policy,
    configured by serve's flags (`ngramspec.config.SpecConfig`, below the command line), its
    store shared with the other replicas through the store log; llama-cpp-python's plug-in also
    warns about AMX repacking. Their own parameters and the token ids the host hands them are
    checked by the package's one validator and token checker, under every layer. A request's
    prediction and ``speculative`` fields (issue 37) are drafted and checked as ``serve`` does:
    its prediction drafter, its parameter class and request models. SGLang's step lays its trees
    out in one kernel call (`ngramspec._tree`)."""
    allowed = {"ngramspec._tree", "ngramspec.engine", "ngramspec.loop", "ngramspec.policy", "ngramspec.config",
               "ngramspec.llama.repack", "ngramspec.validation", "ngramspec.store_log",
               "ngramspec.tokens", "ngramspec.prediction", "ngramspec.request_params",
               "ngramspec.draft_engine",
               "ngramspec.server.schemas", "ngramspec.server.errors", "ngramspec.server.fields"}
    bad = []
    for name, path in MODULES.items():
        if _layer(name) != "integrations":
            continue
        for module, line, _ in _imports(path):
            if module.startswith("ngramspec") and not module.startswith(
                    "ngramspec.integrations") and module not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, bad


def test_integrations_import_without_their_engines():
    """The vLLM and SGLang modules import without loading either engine (or torch); the
    llama-cpp-python plug-in's old path warns and gives the same class."""
    code = ("import sys, warnings; import ngramspec.integrations.vllm as v, "
            "ngramspec.integrations.sglang as s; "
            "print(any(m.split('.')[0] in ('vllm', 'sglang', 'torch') for m in sys.modules))\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            " warnings.simplefilter('always')\n"
            " from ngramspec.llama.plugin import NgramspecDraftModel as old\n"
            "from ngramspec.integrations.llama_cpp import NgramspecDraftModel as new\n"
            "print(old is new, [str(x.message) for x in w if x.category is DeprecationWarning])")
    out = _python_lines(code)
    assert out[0] == "False"
    assert out[1].startswith("True") and "ngramspec.integrations.llama_cpp" in out[1]


def _python_lines(code: str) -> list:
    """What ``python -c code`` prints in the repository root, line by line."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.splitlines()


# The commands of the command line share flags through cli.common and cli.live_flags, never
# through each other; run-batch is serve's models run on a batch file (serve's flags and app).
CLI_SHARED = {"ngramspec.cli", "ngramspec.cli.common", "ngramspec.cli.live_flags"}
CLI_SIBLINGS_ALLOWED = {("ngramspec.cli.run_batch", "ngramspec.cli.serve")}


def test_commands_do_not_import_each_other():
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("ngramspec.cli.") or name in CLI_SHARED:
            continue
        for module, line, _ in _imports(path):
            if (module.startswith("ngramspec.cli") and module not in CLI_SHARED
                    and module != name and (name, module) not in CLI_SIBLINGS_ALLOWED):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, bad


def test_plugin_finds_its_llama_without_inspecting_frames():
    """The llama-cpp-python plug-in is attached to its Llama (load_llama), not found on the
    call stack."""
    src = (PKG / "integrations" / "llama_cpp.py").read_text()
    assert "_getframe" not in src and "import inspect" not in src


MAX_FUNCTION_LINES = 100
LONG_FUNCTIONS_ALLOWED: set = set()   # (path, function) pairs; none today


def _long_functions(path: pathlib.Path, limit: int) -> list:
    """``(name, lines)`` of each function (methods and nested ones too) longer than `limit`
    lines, its decorators and docstring included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n = node.end_lineno - first + 1
            if n > limit:
                found.append((node.name, n))
    return found


# A Cython function: `def`, `cdef` or `cpdef`, a name, its parameters, a colon (a `cdef` variable
# declaration has no colon after its parentheses, a `cdef class` or `cdef struct` no parentheses
# after its first word).
CYTHON_DEF = re.compile(r"^([ \t]*)(?:cdef|cpdef|def)\s+(?!class\b|struct\b|enum\b|extern\b)"
                        r"[^=\n:]*?(\w+)\s*\(", re.M)


def _long_cython_functions(path: pathlib.Path, limit: int) -> list:
    """``(name, lines)`` of each Cython function longer than `limit` lines, from its first line to
    its last indented line (docstring included; trailing blank or comment lines not counted)."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    found = []
    for m in CYTHON_DEF.finditer(text):
        depth, i = 0, m.end() - 1
        while i < len(text):                 # the closing parenthesis of the parameters
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        first, head_end = text.count("\n", 0, m.start()), text.count("\n", 0, i)
        rest = text[i + 1:].split("\n", 1)[0].split("#")[0].strip()
        if not rest.endswith(":"):
            continue                         # a declaration, not a definition
        indent, last = len(m.group(1).expandtabs()), head_end
        for k in range(head_end + 1, len(lines)):
            stripped = lines[k].strip()
            if not stripped or stripped.startswith("#"):
                continue
            if len(lines[k]) - len(lines[k].lstrip()) <= indent:
                break
            last = k
        if last - first + 1 > limit:
            found.append((m.group(2), last - first + 1))
    return found


def test_long_cython_functions_are_found(tmp_path):
    path = tmp_path / "probe.pyx"
    path.write_text("cdef class C:\n    cdef int x\n"
                    "    cdef int f(self, int a,\n               int b) noexcept nogil:\n"
                    "        cdef int y = g(a)\n" + "        y += 1\n" * 97 + "        return y\n"
                    "\n# a comment\ncdef inline int g(int a) noexcept nogil:\n    return a\n")
    assert _long_cython_functions(path, MAX_FUNCTION_LINES) == [("f", 101)]
    assert _long_cython_functions(path, 101) == []


def test_no_cython_function_over_100_lines():
    """The same rule for the kernels (.pyx, .pxd and the .pxi files a .pyx includes)."""
    bad = [f"{p.name}: {name} ({n} lines)"
           for p in sorted(PKG.glob("*.pyx")) + sorted(PKG.glob("*.px[di]"))
           for name, n in _long_cython_functions(p, MAX_FUNCTION_LINES)]
    assert not bad, bad


def test_long_functions_are_found(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("@dec\ndef f():\n" + "    x = 1\n" * 99 + "def g():\n    pass\n")
    assert _long_functions(path, MAX_FUNCTION_LINES) == [("f", 101)]
    assert _long_functions(path, 101) == []


def test_no_function_over_100_lines():
    """No Python function of the package, the benchmarks or the tests over 100 lines, docstring
    and decorators included: a longer one is several concerns, split by concern."""
    bad = []
    for folder in ("ngramspec", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            bad += [f"{rel}: {name} ({n} lines)"
                    for name, n in _long_functions(path, MAX_FUNCTION_LINES)
                    if (rel, name) not in LONG_FUNCTIONS_ALLOWED]
    assert not bad, bad


MAX_FILE_LINES = 1000
# (path, why) of the files still over the limit (test_the_file_allowance_is_still_needed says
# when one no longer is).
LONG_FILES_ALLOWED: dict = {}
# Generated, never committed: the GPU device kit's unpacked sources (bench/gpu/prepare.py).
NOT_SOURCES = ("bench/gpu/kit/",)


def _long_files(root: pathlib.Path, limit: int) -> list:
    """``(path relative to root, lines)`` of each Python or Cython source (.py, .pyx, .pxd,
    .pxi) under the package, the benchmarks and the tests with more than `limit` lines."""
    found = []
    for folder in ("ngramspec", "bench", "tests"):
        for path in sorted((root / folder).rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.suffix not in (".py", ".pyx", ".pxd", ".pxi") or rel.startswith(NOT_SOURCES):
                continue
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > limit:
                found.append((rel, n))
    return found


def test_long_files_are_found(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "ngramspec" / "sub").mkdir(parents=True)
    (tmp_path / "ngramspec" / "sub" / "big.pyx").write_text("x = 1\n" * 1001)
    (tmp_path / "ngramspec" / "ok.py").write_text("x = 1\n" * 1000)
    (tmp_path / "tests" / "big.pxd").write_text("x = 1\n" * 1002)
    (tmp_path / "tests" / "notes.txt").write_text("x\n" * 2000)
    assert _long_files(tmp_path, MAX_FILE_LINES) == [("ngramspec/sub/big.pyx", 1001),
                                                     ("tests/big.pxd", 1002)]
    assert _long_files(tmp_path, 1002) == []


def test_no_file_over_1000_lines():
    """No source file of the package, the benchmarks or the tests over 1,000 lines: a longer
    one holds several concerns; split it along its seams (as bench/e2e_report.py's Markdown went
    to e2e_markdown.py, and tests/test_validation.py's token and command-line cases to their own
    files)."""
    bad = [f"{rel} ({n} lines)" for rel, n in _long_files(ROOT, MAX_FILE_LINES)
           if rel not in LONG_FILES_ALLOWED]
    assert not bad, bad


def test_the_file_allowance_is_still_needed():
    """An allowed file that is back under the limit leaves the allowance (so it cannot grow
    again unseen)."""
    over = {rel for rel, _ in _long_files(ROOT, MAX_FILE_LINES)}
    stale = sorted(set(LONG_FILES_ALLOWED) - over)
    assert not stale, f"under {MAX_FILE_LINES} lines now: remove from LONG_FILES_ALLOWED {stale}"
def test_the_server_imports_nothing_of_the_llama_backend():
    """The server sees its model through `ngramspec.backend.Backend` and the neutral request
    types (`ngramspec.request_params`, `ngramspec.request`), never `ngramspec.llama`: another
    backend implements the protocol and serves the same API."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for name, path in MODULES.items() if _layer(name) == "server"
           for module, line, _ in _imports(path)
           if module == "ngramspec.llama" or module.startswith("ngramspec.llama.")]
    assert not bad, bad
    assert _layer("ngramspec.backend") == _layer("ngramspec.request") == "core"


def test_the_llama_backend_implements_the_servers_protocol():
    """Every member of `Backend` is defined by `LlamaBackend` (read from the sources, so the
    check needs no model)."""
    def members(path, cls):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        found = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        found |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        for fn in (n for n in node.body if isinstance(n, ast.FunctionDef)
                   and n.name == "__init__"):
            found |= {t.attr for a in ast.walk(fn) if isinstance(a, ast.Assign)
                      for tup in a.targets for t in ast.walk(tup)
                      if isinstance(t, ast.Attribute)}
        return found - {"__init__"}

    wanted = members(PKG / "backend.py", "Backend")
    assert {"submit", "stats", "tokenize_prompt", "n_slots"} <= wanted
    missing = wanted - members(PKG / "llama" / "backend.py", "LlamaBackend")
    assert not missing, missing


def test_only_the_command_line_imports_the_command_line():
    """Configuration lives below the CLI (`ngramspec.config`): no module outside
    `ngramspec.cli` (and ``python -m ngramspec``) imports it, function-local imports included."""
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for name, path in MODULES.items() if _layer(name) != "cli"
           for module, line, _ in _imports(path)
           if module == "ngramspec.cli" or module.startswith("ngramspec.cli.")]
    assert not bad, bad
# -- issue 39: one engine contract ----------------------------------------------------------------

def _engine_probes(tree) -> list:
    """``(line, call)`` of each getattr/hasattr whose object is an engine (a name or attribute
    ending in ``engine``): the engine contract (`ngramspec.draft_engine.DraftEngine`) declares
    every part, so a driver calls it instead of asking."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            obj = ast.unparse(node.args[0])
            if re.search(r"engine\)?$", obj, re.I):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_engine_probes_are_found():
    code = "a = getattr(loop.engine, 'x', None)\nb = hasattr(engine, 'y')\nc = getattr(p, 'z')\n"
    assert [line for line, _ in _engine_probes(ast.parse(code))] == [1, 2]


def test_no_getattr_probe_of_an_engine():
    bad = [f"{path.relative_to(ROOT)}:{line}: {call}" for path in MODULES.values()
           for line, call in _engine_probes(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, bad


# The drivers hold an engine, never None: "no speculation" is `NO_DRAFT` (`as_engine` turns a
# public API's None into it at the boundary).
ENGINE_HOLDERS = ("ngramspec/loop.py", "ngramspec/policy.py", "ngramspec/engine.py",
                  "ngramspec/prediction.py", "ngramspec/llama/decoder.py",
                  "ngramspec/llama/live.py", "ngramspec/llama/scheduler.py")


def test_no_none_engine_in_the_drivers():
    rx = re.compile(r"engine\w*\s+is\s+(not\s+)?None|engine\w*\s+else\s+None|else\s+None\b.*engine")
    bad = [f"{rel}:{i}: {line.strip()}" for rel in ENGINE_HOLDERS
           for i, line in enumerate((ROOT / rel).read_text(encoding="utf-8").splitlines(), 1)
           if rx.search(line)]
    assert not bad, bad


# -- issue 39: the scheduler only schedules -------------------------------------------------------

def _class_lines(path: pathlib.Path, name: str) -> int:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.end_lineno - node.lineno + 1
    raise AssertionError(f"no class {name} in {path}")


def test_the_scheduler_class_is_at_most_300_lines():
    """The llama context, the request checks, the engines, the queue, the slots, the output and
    the counters live in their own modules (ngramspec.llama.scheduler's docstring lists them)."""
    assert _class_lines(PKG / "llama" / "scheduler.py", "Scheduler") <= 300


def test_the_scheduler_makes_no_llama_call_and_checks_no_request_itself():
    """llama.cpp's C API only through the slot context and the executor; a request's checks only
    through ngramspec.llama.request_checks (one wording for the live driver and the scheduler)."""
    text = (PKG / "llama" / "scheduler.py").read_text(encoding="utf-8")
    assert not re.search(r"\blc\.llama_|import llama_cpp|def _check_", text)
    assert "def check_prompt" not in (PKG / "llama" / "decoder.py").read_text(encoding="utf-8")


# -- issue 39: configuration below the CLI, one counter type --------------------------------------

# The speculation's parts that `ngramspec.config.SpecConfig` carries as one object.
SPEC_PARTS = ("spec_type", "spec_params", "draft_model", "policy", "cost_model")


def _init_parameters(path: pathlib.Path, name: str) -> dict:
    """``{parameter: annotation}`` of class `name`'s ``__init__``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            init = next(f for f in node.body
                        if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            a = init.args
            return {p.arg: ast.unparse(p.annotation) if p.annotation else ""
                    for p in a.posonlyargs + a.args + a.kwonlyargs}
    raise AssertionError(f"no class {name} in {path}")


def test_the_scheduler_takes_a_spec_config():
    """The scheduler's speculation is one `SpecConfig` (serve, run-batch and the library build
    it from their flags or keywords), never its parts keyword by keyword."""
    params = _init_parameters(PKG / "llama" / "scheduler.py", "Scheduler")
    assert "SpecConfig" in params.get("spec", ""), params
    assert not set(params) & set(SPEC_PARTS), sorted(set(params) & set(SPEC_PARTS))


def _draft_counter_names() -> tuple:
    for node in ast.parse((PKG / "stats.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == "DraftCounts":
            return tuple(n.target.id for n in node.body if isinstance(n, ast.AnnAssign))
    raise AssertionError("no DraftCounts in ngramspec/stats.py")


def _own_draft_counters(tree, names) -> list:
    """``(line, code)`` of each draft counter a class keeps itself: a field or class attribute
    of one of `names` (a ``property`` reading an embedded `DraftCounts` is fine), or an
    assignment to ``self.<name>``."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            is_property = (isinstance(getattr(node, "value", None), ast.Call)
                           and ast.unparse(node.value.func) == "property")
            if not is_property and any(isinstance(t, ast.Name) and t.id in names
                                       for t in targets):
                found.append((node.lineno, ast.unparse(node)))
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if any(isinstance(t, ast.Attribute) and t.attr in names and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_own_draft_counters_are_found():
    code = ("class A:\n    n_acc_tokens: int = 0\n"
            "class B:\n    n_drafts = property(lambda self: self.counts.n_drafts)\n"
            "    def f(self):\n        self.n_draft_tokens += 1\n        self.counts.n_drafts += 1\n")
    names = _draft_counter_names()
    assert "n_acc_tokens" in names and "n_draft_tokens" in names
    assert [line for line, _ in _own_draft_counters(ast.parse(code), names)] == [2, 6]


def test_one_draft_counter_type():
    """Every report (the loop, the live result, a completion, the scheduler's counters,
    run-batch's summary) embeds `ngramspec.stats.DraftCounts` instead of declaring the counts
    again."""
    names = _draft_counter_names()
    bad = [f"{path.relative_to(ROOT)}:{line}: {code}" for path in MODULES.values()
           if path != PKG / "stats.py"
           for line, code in _own_draft_counters(ast.parse(path.read_text(encoding="utf-8")),
                                                 names)]
    assert not bad, bad
