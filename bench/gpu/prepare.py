"""Prepare the GPU device kit: ``python bench gpu-prepare`` (bench/gpu/README.md).

Fills the git-ignored folder bench/gpu/kit/ with what the device run needs and cannot fetch there
(it has no network), each call's share within the 64 MiB a device call carries:

- ``src/``: llama-cpp-python's sdist, of the version installed here, trimmed to a CUDA build's
  needs (kit.KEEP / kit.DROP: 77 MB packed -> about 3 MB);
- ``wheels/``: the pure-Python and cp312 wheels of the packages the device image lacks
  (DEVICE_WHEELS), at the versions installed here;
- ``model1/``, ``model2/``: the embedded GGUF cut in two, so that each call carries one part;
  call 2 joins them and checks the digest (exact: the same model as every CPU figure);
- ``traces/``: ../shared/traces (the device gets only the checkout).

Prints the size of each call against the limit and fails when one does not fit.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kit  # noqa: E402

#: Runtime packages of ngramspec (serve extra) and llama-cpp-python, and their requirements, that
#: the device image does not hold (its package list: DEVELOPERS.md's device notes), or may hold
#: older than they require (typing-extensions: pydantic wants >= 4.16); the rest (numpy, jinja2,
#: httpx, anyio, click, h11, annotated-doc, prometheus-client, xxhash, tqdm, Cython,
#: scikit-build-core, cmake, ninja) is there.
DEVICE_WHEELS = ("platformdirs", "diskcache", "fastapi", "starlette", "pydantic", "pydantic-core",
                 "annotated-types", "typing-inspection", "uvicorn", "opentelemetry-api",
                 "typing-extensions")
#: The device's interpreter (CPython 3.12, x86-64 manylinux).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def _pip(*args) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch_sdist(version: str, cache: pathlib.Path) -> pathlib.Path:
    path = cache / f"llama_cpp_python-{version}.tar.gz"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # no build isolation: pip prepares the sdist's metadata with the scikit-build-core of this
        # environment instead of installing one (minutes on a busy machine)
        isolation = ["--no-build-isolation"] if _installed("scikit-build-core") else []
        _pip("download", "--no-deps", "--no-binary", ":all:", *isolation, "-q",
             f"llama-cpp-python=={version}", "-d", str(cache))
    return path


def _installed(name: str):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def fetch_wheels(out: pathlib.Path, python_version: str) -> list:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    specs = [f"{n}=={_installed(n)}" if _installed(n) else n for n in DEVICE_WHEELS]
    plats = [x for p in PLATFORMS for x in ("--platform", p)]
    _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         python_version, "--implementation", "cp", *plats, "-d", str(out), *specs)
    return sorted(p.name for p in out.glob("*.whl"))


def checkout_size() -> int:
    """Bytes of what the device tool sends of this checkout: tracked and untracked-not-ignored
    files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=kit.ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return kit.tree_size(kit.ROOT / n.decode() for n in names if n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench gpu-prepare",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-version", default=_installed("llama_cpp_python"),
                    help="llama-cpp-python version (default: the installed one, %(default)s)")
    ap.add_argument("--model", default=None,
                    help="GGUF to carry (default: the embedded SmolLM2-135M)")
    ap.add_argument("--traces", default=None,
                    help="trace folder to carry (default: $NGRAMSPEC_SHARED/traces or "
                         "../shared/traces)")
    ap.add_argument("--python-version", default="3.12",
                    help="the device interpreter's version for the wheels (default %(default)s)")
    ap.add_argument("--kit", default=str(kit.KIT), help="kit folder (default %(default)s)")
    args = ap.parse_args(argv)
    if not args.llama_version:
        ap.error("--llama-version: llama-cpp-python is not installed here; name a version")
    out = pathlib.Path(args.kit)
    sys.path.insert(0, str(HERE.parent))
    import benchlib  # first: it puts the checkout's ngramspec on sys.path, and knows ../shared
    if args.model is None:
        from ngramspec.llama.model import default_model_path
        args.model = default_model_path()
    model = pathlib.Path(args.model)
    if args.traces is None:
        args.traces = str(benchlib.TRACES)
    traces = pathlib.Path(args.traces)
    if not model.is_file():
        ap.error(f"--model: file not found: {model}")
    if not traces.is_dir():
        ap.error(f"--traces: folder not found: {traces}")

    sdist = fetch_sdist(args.llama_version, out / "cache")
    (out / "src").mkdir(parents=True, exist_ok=True)
    for old in (out / "src").glob("*.tar.gz"):
        old.unlink()
    trimmed = kit.trim_sdist(sdist, out / "src" / sdist.name)
    # the device's copy of the checkout has no .git: the revision travels with the source
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=kit.ROOT,
                         capture_output=True, text=True).stdout.strip()
    (out / "src" / "revision.txt").write_text(rev + "\n")
    print(f"src: {trimmed['files']} files, {trimmed['bytes'] / 2**20:.1f} MiB unpacked, "
          f"{trimmed['packed'] / 2**20:.1f} MiB packed (sdist {sdist.stat().st_size / 2**20:.1f}"
          " MiB)")
    wheels = fetch_wheels(out / "wheels", args.python_version)
    print(f"wheels: {', '.join(wheels)}")
    if (out / "traces").exists():
        shutil.rmtree(out / "traces")
    shutil.copytree(traces, out / "traces", ignore=shutil.ignore_patterns("README*"))

    for d in ("model1", "model2"):
        if (out / d).exists():
            shutil.rmtree(out / d)
    tree = checkout_size()
    if tree > kit.TREE_RESERVE:
        raise SystemExit(f"the checkout sends {tree / 2**20:.1f} MiB, more than the "
                         f"{kit.TREE_RESERVE / 2**20:.0f} MiB kit.TREE_RESERVE allows for")
    other = kit.call_sizes(out)
    first = kit.split_point(model.stat().st_size, other["build"], other["live"])
    kit.split_file(model, first, out / "model1", out / "model2")
    sizes = kit.call_sizes(out)
    manifest = {"llama_cpp_python": args.llama_version, "sdist": sdist.name,
                "trimmed": trimmed, "wheels": wheels, "model": model.name,
                "model_bytes": model.stat().st_size, "split_at": first,
                "checkout_bytes": tree, "calls": {}}
    print(f"checkout: {tree / 2**20:.1f} MiB (reserved {kit.TREE_RESERVE / 2**20:.0f} MiB)")
    for call, size in sizes.items():
        total = size + kit.TREE_RESERVE
        manifest["calls"][call] = {"carry": kit.carry_paths(call), "bytes": size}
        print(f"call {call}: carries {size / 2**20:.1f} MiB + checkout reserve = "
              f"{total / 2**20:.1f} of {kit.CARRY_LIMIT / 2**20:.0f} MiB; carry "
              f"{json.dumps(kit.carry_paths(call))}")
        if total > kit.CARRY_LIMIT:
            raise SystemExit(f"call {call} does not fit")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
