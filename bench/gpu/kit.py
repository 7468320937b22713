"""What the GPU device kit holds and how it travels: the trimming rules for llama-cpp-python's
source, the size budget of one device call, and the model split into parts.

The device tool (DEVELOPERS.md) carries at most 64 MiB per call: the working tree plus the
ignored paths named in ``carry`` (8 at most). Files written outside the checkout (``/tmp``) stay
on the machine only while the next call follows within its idle window (~30 s). The kit is
therefore two carries:

- call 1 (``build``): the trimmed source, the wheels the device lacks, model part 1;
- call 2 (``live``): model part 2 and the traces; it joins the model with part 1 left in the
  device's state folder by call 1.

This module is plain Python with no third-party imports, so the tests and ``prepare.py`` share it.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import pathlib
import tarfile
from typing import Dict, Iterable, List

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: The git-ignored folder prepare.py fills (.gitignore: /bench/gpu/kit/).
KIT = HERE / "kit"
#: One device call's working tree and carried paths together (the tool's limit is 64 MiB).
CARRY_LIMIT = 64 * 2**20
#: What the checkout itself may take besides the kit (its tracked files are ~3 MB today).
TREE_RESERVE = 6 * 2**20

#: Paths in the llama-cpp-python sdist (relative to its top folder) that a CUDA build needs.
#: Everything else goes: the 75 MB of models/, 38 MB of docs/, tests, examples, tools, and the
#: ggml backends other than the CPU and CUDA ones.
KEEP = (
    "CMakeLists.txt", "pyproject.toml", "README.md", "LICENSE.md", "llama_cpp/*",
    "vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/LICENSE", "vendor/llama.cpp/cmake/*",
    "vendor/llama.cpp/include/*", "vendor/llama.cpp/src/*", "vendor/llama.cpp/common/*",
    "vendor/llama.cpp/ggml/*", "vendor/llama.cpp/vendor/*",
    # the GGUF reader that checks the random-shape models on the device
    "vendor/llama.cpp/gguf-py/gguf/*",
)
#: Exceptions to KEEP. ggml's CMake adds a backend's folder only when that backend is on, and
#: vendor/'s header-only libraries for audio and images (miniaudio 4 MB, stb) serve mtmd alone,
#: which the kit does not build (LLAVA_BUILD=OFF); their CMakeLists.txt stay, CMake reads them.
DROP = (
    "vendor/llama.cpp/ggml/src/ggml-*/*",
    "vendor/llama.cpp/vendor/miniaudio/*.h", "vendor/llama.cpp/vendor/stb/*.h",
    "*/__pycache__/*", "*.md", "*/.git*",
)
#: Backend folders of ggml/src that stay (ggml-cpu for the CPU dry run and the host side).
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
#: Files of KEEP that DROP's "*.md" would take but the build reads.
KEEP_ALWAYS = ("README.md",)


def keep(rel: str) -> bool:
    """Whether the sdist member at ``rel`` (below the sdist's top folder) goes into the kit."""
    if rel in KEEP_ALWAYS:
        return True
    if not any(fnmatch.fnmatchcase(rel, pat) for pat in KEEP):
        return False
    for backend in KEEP_BACKENDS:
        if rel.startswith(f"vendor/llama.cpp/ggml/src/{backend}/"):
            return not rel.endswith(".md")
    return not any(fnmatch.fnmatchcase(rel, pat) for pat in DROP)


def trim_sdist(sdist: pathlib.Path, out: pathlib.Path) -> Dict[str, int]:
    """Write the members of ``sdist`` (a .tar.gz) that :func:`keep` accepts to ``out``
    (.tar.gz, same top folder name). Returns ``{"files", "bytes", "packed"}``: files kept, their
    unpacked size, and ``out``'s size."""
    files = size = 0
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(sdist, "r:gz") as src, tarfile.open(tmp, "w:gz", compresslevel=9) as dst:
        for member in src:
            top, _, rel = member.name.partition("/")
            if not rel or not (member.isfile() or member.isdir()):
                continue
            if member.isdir() or not keep(rel):
                continue
            dst.addfile(member, src.extractfile(member))
            files += 1
            size += member.size
    os.replace(tmp, out)
    return {"files": files, "bytes": size, "packed": out.stat().st_size}


def split_file(path: pathlib.Path, first: int, dir1: pathlib.Path,
               dir2: pathlib.Path) -> List[pathlib.Path]:
    """Cut ``path`` into ``dir1/NAME.part1`` (its first ``first`` bytes) and ``dir2/NAME.part2``
    (the rest), and write ``dir2/NAME.sha256``, the whole file's digest, for :func:`join_parts`
    (the call that carries part 2 joins)."""
    size = path.stat().st_size
    if not 0 < first < size:
        raise ValueError(f"split point must be inside the file (1 .. {size - 1}), got {first}")
    for d in (dir1, dir2):
        d.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    parts = [dir1 / f"{path.name}.part1", dir2 / f"{path.name}.part2"]
    with open(path, "rb") as f:
        for part, n in zip(parts, (first, size - first)):
            with open(part, "wb") as g:
                while n:
                    chunk = f.read(min(n, 1 << 22))
                    digest.update(chunk)
                    g.write(chunk)
                    n -= len(chunk)
    (dir2 / f"{path.name}.sha256").write_text(digest.hexdigest() + "\n")
    return parts


def join_parts(parts: Iterable[pathlib.Path], out: pathlib.Path, sha256: str) -> pathlib.Path:
    """Concatenate ``parts`` into ``out`` and check the digest; a mismatch removes ``out`` and
    raises (a part left over from another kit, or cut short in transit)."""
    digest = hashlib.sha256()
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as g:
        for part in parts:
            with open(part, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    digest.update(chunk)
                    g.write(chunk)
    if digest.hexdigest() != sha256.strip():
        tmp.unlink()
        raise ValueError(f"{out.name}: joined parts have sha256 {digest.hexdigest()}, "
                         f"the kit recorded {sha256.strip()}")
    os.replace(tmp, out)
    return out


def tree_size(paths: Iterable[pathlib.Path]) -> int:
    """Bytes of the files under ``paths`` (files or folders)."""
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def split_point(model_size: int, call1_other: int, call2_other: int,
                tree: int = TREE_RESERVE, limit: int = CARRY_LIMIT) -> int:
    """Bytes of the model for part 1 so that both calls fit ``limit``: each call carries the
    checkout (``tree``) and its other files; the model's bytes are shared so that the two calls
    keep the same headroom. Raises when the model cannot fit in two calls."""
    room1 = limit - tree - call1_other
    room2 = limit - tree - call2_other
    if room1 + room2 < model_size or min(room1, room2) <= 0:
        raise ValueError(f"the model ({model_size / 2**20:.1f} MiB) does not fit two calls: "
                         f"{room1 / 2**20:.1f} + {room2 / 2**20:.1f} MiB of room")
    spare = room1 + room2 - model_size
    return room1 - spare // 2


#: Folders of the kit each call carries (README's run calls name them as bench/gpu/kit/NAME).
CARRY = {
    "build": ["src", "wheels", "model1"],
    "live": ["model2", "traces"],
}


def carry_paths(call: str) -> List[str]:
    """The ``carry`` argument of a device call, relative to the checkout."""
    return [f"bench/gpu/kit/{name}" for name in CARRY[call]]


def call_sizes(kit: pathlib.Path = KIT) -> Dict[str, int]:
    """Bytes each call carries besides the checkout, from the prepared kit."""
    return {call: tree_size(kit / name for name in names) for call, names in CARRY.items()}
