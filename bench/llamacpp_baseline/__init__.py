"""llama.cpp's n-gram proposers in C++ (``baseline.cpp``), built on first use and driven by ctypes.

`CppEngine` has the engine interface the benchmarks and ``ngramspec.replay.replay_request`` use
(``begin``, ``draft``, ``accept``, ``stats``), so the same plans and replay loops run through
ngramspec and through llama.cpp's algorithms. Every draft call is timed inside C++
(steady_clock around the common_speculative glue's draft); ``last_ns`` holds that time and
``times`` collects it when recording is on, so the ctypes call is never part of the C++ figure.

The library is compiled with ``g++ -O2`` (the flags of the spec's section 9 measurements; no
-march) into ``build/`` beside the source, named by the hash of the source, the flags and the
compiler version, so an edit or another compiler rebuilds it. ``-falign-loops=64`` is added for
stable timing: without it ngram-simple's backward scan ran in one of two speeds (about 25 %
apart) depending on where the loop landed after an unrelated edit, and from run to run; aligned
to 64 bytes it runs at the faster one, which gives llama.cpp its best case.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import subprocess

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "baseline.cpp"
BUILD = HERE / "build"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-O2", "-falign-loops=64", "-DNDEBUG", "-std=c++17", "-fPIC", "-shared"]

# impl_type codes of baseline.cpp, in llama.cpp's fixed priority order
TYPES = {"ngram-simple": 0, "ngram-map-k": 1, "ngram-map-k4v": 2, "ngram-mod": 3}
# the 11 integer parameters of ngb_create, with llama.cpp's defaults and ranges (spec 2)
PARAMS = (("ngram_simple_size_n", 12, 1, 1024), ("ngram_simple_size_m", 48, 1, 1024),
          ("ngram_map_k_size_n", 12, 1, 1024), ("ngram_map_k_size_m", 48, 1, 1024),
          ("ngram_map_k_min_hits", 1, 1, 65535),
          ("ngram_map_k4v_size_n", 12, 1, 1024), ("ngram_map_k4v_size_m", 48, 1, 1024),
          ("ngram_map_k4v_min_hits", 1, 1, 65535),
          ("ngram_mod_n_match", 24, 1, 1024), ("ngram_mod_n_min", 48, 0, 1024),
          ("ngram_mod_n_max", 64, 0, 1024))
MAX_DRAFT = 1024        # no proposer here drafts more than size_m / n_max <= 1024 tokens
UNBOUNDED = 1 << 62     # n_max when the caller gives no bound (the golden files' case)

_lib = None


def compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]


def library_path() -> pathlib.Path:
    """The shared library for the current source, flags and compiler (built if missing)."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                         + compiler_version().encode()).hexdigest()[:16]
    path = BUILD / f"baseline-{key}.so"
    if not path.exists():
        BUILD.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([CXX, *FLAGS, str(SOURCE), "-o", str(tmp)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the C++ baseline failed:\n{proc.stderr}")
        os.replace(tmp, path)          # atomic: concurrent builders never see half a library
    return path


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        dll = ctypes.CDLL(str(library_path()))
        i32, i64, p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        dll.ngb_create.argtypes = [p, i32, i32, p]
        dll.ngb_create.restype = p
        dll.ngb_free.argtypes = [p]
        dll.ngb_free.restype = None
        dll.ngb_begin.argtypes = [p, i32, p, i64]
        dll.ngb_begin.restype = i64
        dll.ngb_draft.argtypes = [p, i32, p, i64, i32, i64, p, i64, p]
        dll.ngb_draft.restype = i64
        dll.ngb_accept.argtypes = [p, i32, i32]
        dll.ngb_accept.restype = i64
        dll.ngb_n_impls.argtypes = [p]
        dll.ngb_n_impls.restype = i32
        dll.ngb_stats.argtypes = [p, i32, p]
        dll.ngb_stats.restype = None
        dll.ngb_timer_ns.argtypes = [i32]
        dll.ngb_timer_ns.restype = i64
        _lib = dll
    return _lib


def timer_overhead_ns(reps: int = 100000) -> int:
    """What an empty steady_clock interval reads inside the library (ns, minimum)."""
    return int(lib().ngb_timer_ns(reps))


def _tokens(arr) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype=np.int32)


class CppEngine:
    """A llama.cpp ``common_speculative`` over the given n-gram types (C++, one per engine).

    `spec_type` is a comma-separated ``--spec-type`` list; the types run in llama.cpp's
    priority order whatever the list's order. `params` are ngramspec's engine keywords
    (``ngram_simple_size_n`` ...); like llama.cpp, a fresh engine has an empty ngram-mod pool.
    """

    def __init__(self, spec_type: str = "ngram-simple", n_slots: int = 1, **params):
        names = [s.strip() for s in spec_type.split(",") if s.strip()]
        for name in names:
            if name not in TYPES:
                raise ValueError(f"spec_type {name!r} has no C++ baseline: allowed "
                                 f"{', '.join(TYPES)}")
        if not names:
            raise ValueError("spec_type names no proposer")
        if not 1 <= n_slots <= 4096:
            raise ValueError(f"n_slots = {n_slots} is out of range: allowed 1..4096")
        values = []
        for key, default, lo, hi in PARAMS:
            v = int(params.pop(key, default))
            if not lo <= v <= hi:
                raise ValueError(f"{key} = {v} is out of range: allowed {lo}..{hi}")
            values.append(v)
        params.pop("ngram_map_k_reindex", None)       # ngramspec-only options, off
        params.pop("ngram_map_k4v_reindex", None)
        if params:
            raise ValueError(f"unknown parameter(s) for the C++ baseline: {', '.join(params)}")
        self.types = sorted({TYPES[n] for n in names})
        self.type_names = [n for n in TYPES if TYPES[n] in self.types]
        self.n_slots = n_slots
        self._lib = lib()
        t = (ctypes.c_int32 * len(self.types))(*self.types)
        p = (ctypes.c_int32 * len(values))(*values)
        self._h = self._lib.ngb_create(t, len(self.types), n_slots, p)
        if not self._h:
            raise RuntimeError("ngb_create failed")
        self._out = np.empty(MAX_DRAFT, dtype=np.int32)
        self._out_ptr = self._out.ctypes.data
        self._ns = ctypes.c_int64(0)
        self._ns_ref = ctypes.byref(self._ns)
        self.last_ns = 0                        # C++ time of the last draft call (ns)
        self.last_begin_ns = 0                  # C++ time of the last begin (ns)
        self.times: list[int] | None = None     # set to [] to record every draft's ns

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.ngb_free(h)

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot = {slot} is out of range: allowed 0..{self.n_slots - 1}")
        return slot

    def begin(self, slot: int, prompt) -> None:
        a = _tokens(prompt)
        self.last_begin_ns = self._lib.ngb_begin(self._h, self._slot(slot), a.ctypes.data,
                                                 len(a))

    def draft(self, slot: int, context, sampled: int, n_max=None) -> np.ndarray:
        a = context if (isinstance(context, np.ndarray) and context.dtype == np.int32
                        and context.flags.c_contiguous) else _tokens(context)
        bound = UNBOUNDED if n_max is None else int(n_max)
        n = self._lib.ngb_draft(self._h, self._slot(slot), a.ctypes.data, len(a),
                                int(sampled), bound, self._out_ptr, MAX_DRAFT, self._ns_ref)
        self.last_ns = self._ns.value
        if self.times is not None:
            self.times.append(self.last_ns)
        if n > MAX_DRAFT:
            raise RuntimeError(f"draft of {n} tokens exceeds the {MAX_DRAFT}-token buffer")
        return self._out[:n].copy()

    def accept(self, slot: int, n_accepted: int) -> None:
        if not 0 <= n_accepted <= 65535:
            raise ValueError(f"n_accepted = {n_accepted} is out of range: allowed 0..65535")
        self._lib.ngb_accept(self._h, self._slot(slot), n_accepted)

    def stats(self) -> list[dict]:
        """llama.cpp's counters per implementation, in priority order (golden ``llama_stats``)."""
        out = (ctypes.c_uint64 * 7)()
        rows = []
        for i, name in enumerate(self.type_names):
            self._lib.ngb_stats(self._h, i, out)
            rows.append(dict(zip(("calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts",
                                  "gen_tokens", "acc_tokens"), map(int, out)), type=name))
        return rows
