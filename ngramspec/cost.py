"""Verify-cost curves: what one target decode of k tokens costs relative to a single token.

Speculation pays when the tokens a draft wins are worth more than the extra cost of verifying
it in one batch. That cost is c(k, n_past) = t(k, n_past) / t(1, n_past): the time of one decode
of a batch of k tokens over a KV cache holding n_past tokens, in single-token decodes. On a CPU
c(k) grows almost linearly in k (a small model on this project's 2-core machine: c(2) = 2.07,
c(16) = 9.9); on a GPU a batch of 16-32 tokens costs little more than one token.

A `CostModel` holds a table of measured seconds per decode at a few batch sizes k and KV lengths
n_past, and interpolates between them. It comes from

- `ngramspec.llama.calibration.calibrate`: a few seconds of decodes on the loaded llama model,
  cached on disk by :func:`cached_calibration` per model file, thread count, batch size and
  backend (a platform cache dir, `platformdirs`), measured at first use,
- :data:`PROFILES`: named curves (``gpu``, ``cpu-embedded``, ``local``),
- :func:`load_cost_model`: a calibration JSON file or a profile name (``--cost-model``).

This module imports no llama_cpp (the measuring is `ngramspec.llama.calibration`'s).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence

import numpy as np
import platformdirs

from ngramspec.files import atomic_write_bytes
from ngramspec.embedded import default_model_path
from ngramspec.validation import OutOfRange, check_int, range_text

__all__ = ["CostModel", "PROFILES", "FORMAT", "load_cost_model", "cached_calibration",
           "calibration_key", "cache_dir", "cache_path", "model_identity", "step_costs",
           "modeled_speedup", "oracle_speedup"]

#: Format tag of a cost model's JSON form (`CostModel.to_dict`).
FORMAT = "ngramspec-cost/1"

#: Environment variable that overrides the cache folder (tests, read-only homes).
CACHE_DIR_ENV = "NGRAMSPEC_CACHE_DIR"


class CostModel:
    """c(k, n_past): time of one decode of a batch of k tokens relative to a single-token decode.

    Parameters
    ----------
    ks : sequence of int
        Measured batch sizes, strictly increasing, the first one 1.
    n_pasts : sequence of int
        KV-cache lengths (tokens already in the cache) they were measured at, strictly
        increasing, >= 0.
    seconds : array-like, shape (len(n_pasts), len(ks))
        Seconds of one decode (the argmax of the logits included) per KV length and batch size.
    name : str
        Short name (a profile name, or ``"calibrated"``).
    source : str
        Where the numbers come from (a machine and command, or a publication).
    meta : dict, optional
        Free-form facts of the measurement (model, threads, n_batch, backend, date).

    Notes
    -----
    Interpolation: piecewise linear in k between the measured batch sizes, extended linearly
    beyond the largest (the last segment's slope); linear in n_past between the measured KV
    lengths, extended linearly beyond the largest (attention over the cache grows linearly with
    its length) and held constant below the smallest. A measured curve that decreases somewhere
    in k (timer noise) is raised to its running maximum first, so that a longer batch never
    looks cheaper than a shorter one; `to_dict` keeps the raw numbers.

    Memory: the table, a few hundred bytes.

    Thread-safety: immutable after construction; every method may be called from any thread.
    """

    __slots__ = ("ks", "n_pasts", "_raw", "_sec", "name", "source", "meta")

    def __init__(self, ks: Sequence[int], n_pasts: Sequence[int], seconds, *, name: str,
                 source: str, meta: Optional[dict] = None):
        ks_arr = np.asarray(ks)
        np_arr = np.asarray(n_pasts)
        sec = np.asarray(seconds, dtype=np.float64)
        if ks_arr.ndim != 1 or ks_arr.size == 0 or not np.issubdtype(ks_arr.dtype, np.integer):
            raise ValueError("cost model: ks must be a non-empty list of integers")
        if ks_arr[0] != 1 or np.any(np.diff(ks_arr) <= 0):
            raise ValueError(f"cost model: ks must start at 1 and increase strictly, "
                             f"got {ks_arr.tolist()}")
        if np_arr.ndim != 1 or np_arr.size == 0 or not np.issubdtype(np_arr.dtype, np.integer):
            raise ValueError("cost model: n_past must be a non-empty list of integers")
        if np_arr[0] < 0 or np.any(np.diff(np_arr) <= 0):
            raise ValueError(f"cost model: n_past must be >= 0 and increase strictly, "
                             f"got {np_arr.tolist()}")
        if sec.shape != (np_arr.size, ks_arr.size):
            raise ValueError(f"cost model: seconds must have shape (len(n_past), len(ks)) = "
                             f"({np_arr.size}, {ks_arr.size}), got {sec.shape}")
        if not np.all(np.isfinite(sec)) or np.any(sec <= 0):
            raise ValueError("cost model: seconds must be finite and > 0")
        self.ks = tuple(int(k) for k in ks_arr)
        self.n_pasts = tuple(int(p) for p in np_arr)
        self._raw = sec.copy()
        self._raw.setflags(write=False)
        self._sec = np.maximum.accumulate(sec, axis=1)
        self._sec.setflags(write=False)
        self.name = str(name)
        self.source = str(source)
        self.meta = dict(meta or {})

    # -- evaluation ------------------------------------------------------------------------

    def _rows(self, k: np.ndarray) -> np.ndarray:
        """Seconds at every measured KV length for batch sizes ``k``, shape
        (len(n_pasts), len(k))."""
        ks = np.asarray(self.ks, dtype=np.float64)
        out = np.empty((len(self.n_pasts), len(k)))
        beyond = k > ks[-1]
        for i, row in enumerate(self._sec):
            out[i] = np.interp(k, ks, row)
            if beyond.any():
                # one measured point: no batching gain assumed; else the last segment's slope
                slope = row[0] if len(ks) == 1 else (row[-1] - row[-2]) / (ks[-1] - ks[-2])
                out[i, beyond] = row[-1] + slope * (k[beyond] - ks[-1])
        return out

    def seconds_many(self, n_tokens, n_past) -> np.ndarray:
        """Vectorized `seconds`: arrays (or scalars) of batch sizes and KV lengths, broadcast.

        Parameters
        ----------
        n_tokens : int or array-like of int
            Batch sizes, >= 1.
        n_past : int or array-like of int
            KV cache lengths, >= 0.

        Returns
        -------
        numpy.ndarray
            Seconds, the broadcast shape.

        Raises
        ------
        TypeError
            Not integers.
        ValueError
            A batch size < 1 or a KV length < 0.
        """
        k, p = np.broadcast_arrays(np.asarray(n_tokens), np.asarray(n_past))
        if not (np.issubdtype(k.dtype, np.integer) and np.issubdtype(p.dtype, np.integer)):
            raise TypeError("n_tokens and n_past must be integers")
        if k.size and k.min() < 1:
            raise OutOfRange("n_tokens", int(k.min()), range_text(1))
        if p.size and p.min() < 0:
            raise OutOfRange("n_past", int(p.min()), range_text(0))
        shape = k.shape
        k = k.ravel().astype(np.float64)
        p = p.ravel().astype(np.float64)
        rows = self._rows(k)
        ps = np.asarray(self.n_pasts, dtype=np.float64)
        if len(ps) == 1:
            return rows[0].reshape(shape)
        # segment [ps[j-1], ps[j]] of each p; beyond the last length w > 1 extends the last
        # segment, below the first the first length's time holds
        j = np.clip(np.searchsorted(ps, p), 1, len(ps) - 1)
        cols = np.arange(len(k))
        lo, hi = rows[j - 1, cols], rows[j, cols]
        w = np.maximum((p - ps[j - 1]) / (ps[j] - ps[j - 1]), 0.0)
        # a growing KV cache never makes a decode faster than the smaller row says
        out = np.maximum(lo + w * (hi - lo), np.minimum(lo, hi))
        return out.reshape(shape)

    def cost_many(self, n_tokens, n_past) -> np.ndarray:
        """Vectorized `cost`: c(n_tokens, n_past) for arrays, broadcast.

        Parameters
        ----------
        n_tokens, n_past : int or array-like of int
            As `seconds_many`.

        Returns
        -------
        numpy.ndarray
        """
        k, p = np.broadcast_arrays(np.asarray(n_tokens), np.asarray(n_past))
        return self.seconds_many(k, p) / self.seconds_many(np.ones_like(k), p)

    def costs(self, n_max: int, n_past: int = 0) -> np.ndarray:
        """c(1, n_past) .. c(n_max, n_past).

        Parameters
        ----------
        n_max : int
            >= 1.
        n_past : int
            KV cache length.

        Returns
        -------
        numpy.ndarray
            float64, element i is c(i + 1).
        """
        n = check_int("n_max", n_max, 1)
        p = check_int("n_past", n_past)
        return self.cost_many(np.arange(1, n + 1), np.full(n, p))

    def seconds(self, n_tokens: int, n_past: int = 0) -> float:
        """Absolute seconds of one decode of `n_tokens` tokens over `n_past` cached ones."""
        return float(self.seconds_many(check_int("n_tokens", n_tokens),
                                       check_int("n_past", n_past)))

    def cost(self, n_tokens: int, n_past: int = 0) -> float:
        """c(n_tokens, n_past) = seconds(n_tokens, n_past) / seconds(1, n_past); c(1) == 1.0."""
        if check_int("n_tokens", n_tokens) == 1 and check_int("n_past", n_past) >= 0:
            return 1.0
        return self.seconds(n_tokens, n_past) / self.seconds(1, n_past)

    def curve(self, ks: Optional[Sequence[int]] = None, n_past: int = 0) -> Dict[int, float]:
        """``{k: c(k, n_past)}`` for some batch sizes.

        Parameters
        ----------
        ks : sequence of int, optional
            Default: the measured ones.
        n_past : int

        Returns
        -------
        dict of int to float
        """
        return {int(k): self.cost(int(k), n_past) for k in (ks or self.ks)}

    # -- serialization ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        """JSON-ready form: format tag, name, source, ks, n_past, seconds (raw), meta."""
        return {"format": FORMAT, "name": self.name, "source": self.source,
                "ks": list(self.ks), "n_past": list(self.n_pasts),
                "seconds": [[float(x) for x in row] for row in self._raw],
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d) -> "CostModel":
        """Inverse of `to_dict`.

        Parameters
        ----------
        d : Mapping
            A calibration file's JSON object.

        Returns
        -------
        CostModel

        Raises
        ------
        ValueError
            A missing or bad field (named).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"cost model: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ValueError(f"cost model: field 'format' must be {FORMAT!r}, "
                             f"got {d.get('format')!r}")
        for key in ("ks", "n_past", "seconds"):
            if not isinstance(d.get(key), list):
                raise ValueError(f"cost model: field {key!r} must be a list")
        meta = d.get("meta", {})
        if not isinstance(meta, Mapping):
            raise ValueError("cost model: field 'meta' must be an object")
        try:
            sec = np.asarray(d["seconds"], dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError("cost model: field 'seconds' must be a table of numbers") from None
        if any(isinstance(x, bool) or not isinstance(x, int) for x in d["ks"] + d["n_past"]):
            raise ValueError("cost model: fields 'ks' and 'n_past' must hold integers")
        return cls(d["ks"], d["n_past"], sec, name=str(d.get("name", "unnamed")),
                   source=str(d.get("source", "")), meta=meta)

    def __repr__(self) -> str:
        c = ", ".join(f"c({k})={v:.2f}" for k, v in list(self.curve().items())[1:4])
        return f"CostModel({self.name!r}, {c}, ...)"

    def __eq__(self, other) -> bool:
        return isinstance(other, CostModel) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable-looking value type: compare, do not hash


def step_costs(cost_model: CostModel, n_prompt: int, steps) -> np.ndarray:
    """Modeled cost of each verification step of one request, in single-token decodes.

    Step i decodes n_draft + 1 tokens over a KV cache of ``n_prompt + sum(1 + n_accepted)`` of the
    steps before it, so it costs c(n_draft + 1, L_i).

    Parameters
    ----------
    cost_model : CostModel
    n_prompt : int
    steps : sequence of [n_draft, n_accepted, draft_called]
        The loop's step records.

    Returns
    -------
    numpy.ndarray
        One float per step.
    """
    st = np.asarray(steps, dtype=np.int64).reshape(-1, 3)
    if len(st) == 0:
        return np.zeros(0)
    grown = np.cumsum(1 + st[:, 1])
    L = n_prompt + np.concatenate([[0], grown[:-1]])
    return cost_model.cost_many(st[:, 0] + 1, L)


def modeled_speedup(records, cost_model: CostModel) -> dict:
    """Speed-up over plain decoding that `cost_model` predicts for replayed requests.

    Plain decoding spends one single-token decode per output token after the first (which comes
    from the prompt pass); speculation spends sum c(k_i + 1, L_i) over its steps.

    Parameters
    ----------
    records : iterable of dict
        Golden-format request records (``n_prompt``, ``n_output``, ``steps``).
    cost_model : CostModel

    Returns
    -------
    dict
        ``cost_model`` (name), ``tokens`` (output tokens after the first), ``cost`` (single-token
        decodes spent), ``speedup`` = tokens / cost.
    """
    tokens = 0
    total = 0.0
    for rec in records:
        tokens += max(0, int(rec["n_output"]) - 1)
        total += float(step_costs(cost_model, int(rec["n_prompt"]), rec["steps"]).sum())
    return {"cost_model": cost_model.name, "tokens": tokens, "cost": round(total, 3),
            "speedup": round(tokens / total, 4) if total else 1.0}


def oracle_speedup(cost_model: CostModel, n_prompt: int, n_output: int,
                   k_max: int = 64) -> dict:
    """The most any drafter could gain on one request under `cost_model`.

    The oracle drafts the true continuation, so every drafted token is accepted, and it picks the
    draft length of every step to minimize the total cost (dynamic programming over the output
    position): the first of the `n_output` tokens comes from the prompt pass, each step verifies
    k <= `k_max` drafted tokens at c(k + 1, L) and emits k + 1.

    Parameters
    ----------
    cost_model : CostModel
    n_prompt : int
    n_output : int
    k_max : int
        Longest draft.

    Returns
    -------
    dict
        ``tokens`` (n_output - 1), ``cost`` (single-token decodes), ``speedup``, ``k_mean`` (mean
        drafted tokens per step of the best plan).
    """
    n = int(n_output) - 1
    if n <= 0:
        return {"tokens": 0, "cost": 0.0, "speedup": 1.0, "k_mean": 0.0}
    k_max = max(0, min(int(k_max), n - 1))
    ks = np.arange(k_max + 1)
    pos = np.arange(n)
    c = cost_model.cost_many(ks[None, :] + 1, n_prompt + pos[:, None])   # (n, k_max + 1)
    best = np.zeros(n + 1)
    choice = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        m = min(k_max, n - 1 - i)
        total = c[i, :m + 1] + best[i + 1:i + m + 2]
        choice[i] = int(np.argmin(total))
        best[i] = total[choice[i]]
    steps, i = [], 0
    while i < n:
        steps.append(choice[i])
        i += choice[i] + 1
    return {"tokens": n, "cost": round(float(best[0]), 3),
            "speedup": round(n / float(best[0]), 4), "k_mean": round(float(np.mean(steps)), 2)}


# ------------------------------------------------------------------------------------------
# Named profiles
# ------------------------------------------------------------------------------------------

def _from_ms(ks, ms_rows, n_pasts, name, source, **meta) -> CostModel:
    return CostModel(ks, n_pasts, np.asarray(ms_rows, dtype=np.float64) / 1e3, name=name,
                     source=source, meta=meta)


def _gpu_profile() -> CostModel:
    # llama.cpp PR #3726 ("perf : study batched decoding bottleneck", 2023-10-22): batched-bench,
    # LLaMA 7B F16 fully offloaded to a CUDA GPU, 512-token shared prompt, 128 generated tokens
    # per sequence, B = 1..32 sequences, first (unmodified, "normal") table. One TG step decodes
    # B tokens in one batch, so T_TG / 128 is the time of a B-token decode: 1.622 s / 128 =
    # 12.7 ms at B = 1, 1.920 s / 128 = 15.0 ms at B = 32. B parallel sequences attend to their
    # own shorter caches rather than to one longer one; the weight-bound matrix products, which
    # dominate a 7B decode, are the same.
    tg_s = {1: 1.622, 2: 1.649, 3: 1.645, 4: 1.723, 5: 1.683, 6: 1.666, 7: 1.674, 8: 1.689,
            16: 1.747, 32: 1.920}
    ks = sorted(tg_s)
    return _from_ms(ks, [[tg_s[k] / 128 * 1e3 for k in ks]], [640],
                    "gpu", "llama.cpp PR #3726 batched-bench, LLaMA 7B F16 on CUDA: T_TG/128 per "
                          "batch size (a GPU-like curve: c(8) = 1.04, c(32) = 1.18)",
                    model="LLaMA 7B F16", backend="CUDA")


def _gpu_h200_profile() -> CostModel:
    # bench/results/gpu.md (issue 30's device kit, bench/gpu/): ngramspec calibrate on
    # llama-3.1-8b q4_0 with random weights (bench/gpu/shapes.py), every layer offloaded;
    # NVIDIA H200, 580.159.04, 143771 MiB, llama-cpp-python 0.3.36 CUDA build, 2026-11-28;
    # ngramspec revision 3d3df43 + the load-order fix. FlashAttention's kernels were not built
    # (GGML_CUDA_FA=OFF, the kit's build time), which matters little at these KV lengths. Each
    # t(k) is a verification's: the decode, the logits of every position copied and arg-maxed
    # on the host. Steeper than the `gpu` profile's published LLaMA-7B F16 curve (c(8) 1.55
    # against 1.04, c(32) 2.48 against 1.18 at KV 32); `gpu` stays the default GPU profile
    # until the figures priced by it are rerun on this one.
    source = ("bench/results/gpu.md: llama-3.1-8b q4_0 (random weights), NVIDIA H200, "
              "llama-cpp-python 0.3.36 CUDA build, 2026-11-28")
    ks = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]
    n_pasts = [32, 256, 1024]
    ms = [  # ms per decode of k tokens, one row per KV length
        [4.9639, 5.7156, 5.6376, 5.8283, 6.7101, 7.6848, 9.2585, 9.5561, 12.3305, 16.7494],
        [5.3198, 5.6836, 5.7476, 5.7505, 6.6624, 7.6943, 9.3342, 9.607, 12.3925, 16.9161],
        [4.8147, 5.6079, 5.6254, 5.8917, 6.8719, 7.815, 9.5145, 9.868, 12.8605, 17.6324],
    ]
    return _from_ms(ks, ms, n_pasts, "gpu-h200", source,
                    model="llama-3.1-8b q4_0", backend="CUDA")


def _cpu_embedded_profile() -> CostModel:
    # bench/results/e2e-fixed.md, "Cost of verifying k tokens versus one": the embedded
    # SmolLM2-135M Q4_1, one decode thread, this project's 2-core CPU, KV cache holding 1468
    # tokens, median of 5 interleaved rounds (bench/e2e_report.py batch_costs).
    ms = {1: 9.5, 2: 19.7, 4: 32.7, 8: 52.2, 16: 94.2, 32: 176.6, 64: 344.6}
    ks = sorted(ms)
    return _from_ms(ks, [[ms[k] for k in ks]], [1468], "cpu-embedded",
                    "bench/results/e2e-fixed.md: SmolLM2-135M Q4_1, 1 thread, 2-core CPU, "
                    "KV 1468 tokens (bench/e2e_report.py batch_costs)",
                    model="SmolLM2-135M-Instruct.Q4_1.gguf", threads=1, backend="CPU")


class _Profiles(Mapping):
    """Name -> CostModel. ``local`` is present only when a calibration of the embedded model
    is cached (``ngramspec calibrate``)."""

    _fixed: Dict[str, Callable[[], CostModel]] = {
        "gpu": _gpu_profile,
        "gpu-h200": _gpu_h200_profile,
        "cpu-embedded": _cpu_embedded_profile,
    }

    def __getitem__(self, name: str) -> CostModel:
        if name in self._fixed:
            return self._fixed[name]()
        if name == "local":
            model = _local_calibration()
            if model is None:
                raise KeyError("local")
            return model
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._fixed
        if _local_calibration() is not None:
            yield "local"

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def names(self):
        """Every profile name, ``local`` included whether or not it is cached."""
        return [*self._fixed, "local"]


#: Named cost profiles: ``gpu`` (a GPU-like curve from llama.cpp's published batched-bench
#: numbers), ``gpu-h200`` (ngramspec's verification of a Llama-3.1-8B Q4_0 measured on an
#: H200 by bench/gpu), ``cpu-embedded`` (this project's measured 2-core CPU curve for the
#: embedded model) and ``local`` (this machine's cached calibration of the embedded model, when present).
PROFILES = _Profiles()


def load_cost_model(spec: str) -> CostModel:
    """A cost model from a calibration JSON file or a profile name (``--cost-model``).

    Parameters
    ----------
    spec : str
        A file path or a name of `PROFILES` (``gpu``, ``gpu-h200``, ``cpu-embedded``, ``local``).

    Returns
    -------
    CostModel

    Raises
    ------
    ValueError
        Unknown name, missing ``local`` calibration, unreadable or malformed file (the message
        names the file or the names allowed).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError("--cost-model needs a file path or one of: " + ", ".join(PROFILES.names()))
    if spec in PROFILES.names():
        try:
            return PROFILES[spec]
        except KeyError:
            raise ValueError("--cost-model local: no calibration of the embedded model is cached "
                             f"in {cache_dir()}; run `ngramspec calibrate` first") from None
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--cost-model {spec}: neither a file nor a profile name "
                         f"({', '.join(PROFILES.names())})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--cost-model {spec}: cannot read a cost model: {exc}") from None
    try:
        return CostModel.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"--cost-model {spec}: {exc}") from None


# ------------------------------------------------------------------------------------------
# Calibration and its cache
# ------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    """Folder of cached calibrations.

    ``$NGRAMSPEC_CACHE_DIR`` or the platform's user cache folder
    (``platformdirs.user_cache_dir("ngramspec")``), subfolder ``cost``.

    Returns
    -------
    pathlib.Path
    """
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        root = platformdirs.user_cache_dir("ngramspec", appauthor=False)
    return Path(root) / "cost"


def model_identity(model_path: str) -> dict:
    """What identifies a model file for the cache: resolved path, size and mtime (ns).

    Parameters
    ----------
    model_path : str

    Returns
    -------
    dict

    Raises
    ------
    OSError
        The file cannot be stat'ed.
    """
    real = os.path.realpath(model_path)
    st = os.stat(real)
    return {"path": real, "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}


def calibration_key(model_path: str, n_threads: int, n_batch: int, backend: str) -> str:
    """Cache key of one calibration.

    A rewritten model file (new size or mtime), another thread count, batch size or llama.cpp
    build/backend gives another key, hence a fresh calibration.

    Parameters
    ----------
    model_path : str
    n_threads : int
    n_batch : int
    backend : str
        The llama.cpp build and backend.

    Returns
    -------
    str
        24 hex digits.
    """
    ident = {"format": FORMAT, "model": model_identity(model_path), "n_threads": int(n_threads),
             "n_batch": int(n_batch), "backend": str(backend)}
    blob = json.dumps(ident, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:24]


def cache_path(key: str) -> Path:
    """File of the calibration with cache key `key`.

    Parameters
    ----------
    key : str
        `calibration_key`'s result.

    Returns
    -------
    pathlib.Path
    """
    return cache_dir() / f"{key}.json"


def cached_calibration(key: str, measure: Optional[Callable[[], CostModel]] = None, *,
                       refresh: bool = False) -> Optional[CostModel]:
    """The cached cost model of `key`, or ``measure()`` stored under it.

    A cache file that cannot be read or parsed is measured again, with a `RuntimeWarning` naming
    the file. A cache folder that cannot be written only warns: the measured model is returned all
    the same.

    Parameters
    ----------
    key : str
    measure : callable, optional
        Returns a new `CostModel`; None only looks the key up.
    refresh : bool
        Always measure.

    Returns
    -------
    CostModel or None
        Its ``meta["key"]`` is `key`; None when nothing is cached and `measure` is None.

    Notes
    -----
    Memory: one small model.

    Thread-safety: the cache file is replaced atomically, so concurrent callers read a whole file
    or measure; two may measure at once (the last write wins).
    """
    path = cache_path(key)
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            model = CostModel.from_dict(data)
            if data.get("meta", {}).get("key") != key:
                raise ValueError("its key does not match its file name")
            return model
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            warnings.warn(f"cost model cache {path} is unusable ({exc}); calibrating again",
                          RuntimeWarning, stacklevel=2)
    if measure is None:
        return None
    model = measure()
    model.meta["key"] = key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(model.to_dict(), indent=1) + "\n"
        # readers see the old file or the new one, never half of one
        atomic_write_bytes(path, text.encode("utf-8"))
    except OSError as exc:
        warnings.warn(f"cannot write the cost model cache {path}: {exc}", RuntimeWarning,
                      stacklevel=2)
    return model


def _local_calibration() -> Optional[CostModel]:
    """The most recent cached calibration of the embedded model (any thread count)."""
    try:
        embedded = os.path.realpath(default_model_path())
    except FileNotFoundError:
        return None
    folder = cache_dir()
    if not folder.is_dir():
        return None
    best = None
    for path in folder.glob("*.json"):
        try:
            model = CostModel.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if model.meta.get("model", {}).get("path") != embedded:
            continue
        created = model.meta.get("created", 0)
        if best is None or created > best[0]:
            best = (created, model)
    if best is None:
        return None
    model = best[1]
    model.name = "local"
    return model
