"""The one entry point of the benchmarks: ``python bench SUBCOMMAND`` and ``--tree``."""
import importlib
import inspect
import os
import pathlib
import subprocess
import sys

import benchlib

BENCH = pathlib.Path(__file__).resolve().parent


def bench(*args, **env):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                          cwd=BENCH.parent, env=dict(os.environ, **env), timeout=300)


def commands():
    spec = importlib.util.spec_from_file_location("bench_main", BENCH / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.COMMANDS


def test_every_subcommand_is_a_report_with_main():
    names = commands()
    scripts = {p.stem for p in BENCH.glob("[!t]*.py")
               if p.stem.endswith(("_report", "_baseline", "_steady", "_load", "_index"))}
    # the GPU device kit's subcommands live in bench/gpu/ (its other modules run on the device)
    gpu = {module for module, _ in names.values() if module and module.startswith("gpu.")}
    assert all((BENCH / "gpu" / f"{module[4:]}.py").exists() for module in gpu)
    assert scripts == {module for module, _ in names.values() if module} - gpu
    for module, _ in names.values():
        if module:
            main = importlib.import_module(module).main
            assert list(inspect.signature(main).parameters) == ["argv"]


def test_help_lists_subcommands_and_forwards_help():
    top = bench("--help")
    assert top.returncode == 0
    for name in commands():
        assert name in top.stdout
    sub = bench("kernels", "--help")
    assert sub.returncode == 0
    assert sub.stdout.startswith("usage: python bench kernels")
    assert benchlib.result_path("kernels.json") in sub.stdout.replace("\n", "").replace(" ", "")


def test_unknown_subcommand_and_bad_tree_are_usage_errors(tmp_path):
    bad = bench("kernel")
    assert bad.returncode == 2 and "invalid choice: 'kernel'" in bad.stderr
    tree = bench("--tree", str(tmp_path), "cpp-baseline")
    assert tree.returncode == 2
    assert f"NGRAMSPEC_TREE={tmp_path}: no ngramspec package there" in tree.stderr


def test_tree_selects_the_measured_checkout(tmp_path):
    # another "checkout": this one's package under another root; benchlib must import it from there
    (tmp_path / "ngramspec").symlink_to(BENCH.parent / "ngramspec", target_is_directory=True)
    probe = ("import benchlib, ngramspec; print(ngramspec.__file__); "
             "print(benchlib.ROOT)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=BENCH, env=dict(os.environ, NGRAMSPEC_TREE=str(tmp_path)),
                         timeout=300)
    assert run.returncode == 0, run.stderr
    module, root = run.stdout.split()
    assert module == str(tmp_path / "ngramspec" / "__init__.py")
    assert root == str(tmp_path.resolve())
    # and through the entry point, from another directory
    run = bench("--tree", str(tmp_path), "cpp-baseline", "--files",
                "chat.simple-small.fresh.jsonl.gz")
    assert run.returncode == 0, run.stderr
    assert "1 of 1 golden files reproduced exactly" in run.stdout
