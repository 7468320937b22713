"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache),
bit-exact, in Cython kernels; ngramspec's own ngram-suffix proposer; an engine that chains them
as llama-server does; the one draft -> verify -> accept loop (`ngramspec.loop`) with its replay
and live targets (everything that talks to llama-cpp-python is in `ngramspec.llama`).
"""
import importlib as _importlib

__version__ = "0.1.0"

try:
    from ngramspec._core import (MapProposer, ModPool, ModProposer, Proposer, PyProposer,
                                 SimpleProposer)
    from ngramspec._cache import CacheFileError, NgramCache, NgramCacheProposer
    from ngramspec._suffix import SuffixProposer
except ModuleNotFoundError as _exc:
    if not (_exc.name or "").startswith("ngramspec._"):
        raise
    # Typically: Python started in a source checkout after a non-editable install, so this
    # uncompiled source folder shadows the installed package.
    raise ImportError(
        f"ngramspec's compiled kernels ({_exc.name}) are missing from {__path__[0]}: this is an "
        f"uncompiled source tree (e.g. Python was started in the repository root, which shadows "
        f"the installed package). Run from another directory, or build in place with "
        f"`python setup.py build_ext --inplace`, or install with `pip install -e .`",
        name=_exc.name) from None
from ngramspec.cost import CostModel, load_cost_model
from ngramspec.engine import SpecEngine
from ngramspec.loop import FixedPolicy, SlotLoop
from ngramspec.policy import AutoPolicy
from ngramspec.replay import replay
from ngramspec.stats import acceptance_line, statistics_line

# Live generation needs llama-cpp-python (the ``live`` extra): imported on first use.
_LAZY = {"generate_speculative": "ngramspec.llama.live",
         "generate_plain": "ngramspec.llama.live", "load_model": "ngramspec.llama.model"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(_importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ngramspec' has no attribute {name!r}")


__all__ = [
    "AutoPolicy", "CacheFileError", "CostModel", "FixedPolicy", "MapProposer", "ModPool",
    "ModProposer", "NgramCache", "NgramCacheProposer", "Proposer", "PyProposer",
    "SimpleProposer", "SlotLoop", "SpecEngine", "SuffixProposer", "__version__",
    "acceptance_line", "generate_plain", "generate_speculative", "load_cost_model",
    "load_model", "replay", "statistics_line",
]
