"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache),
bit-exact, in Cython kernels; ngramspec's own ngram-suffix proposer; an engine that chains them
as llama-server does; the one draft -> verify -> accept loop (`ngramspec.loop`) with its replay
and live (llama-cpp-python) targets.
"""
__version__ = "0.1.0"

from ngramspec._core import MapProposer, ModPool, ModProposer, Proposer, PyProposer, SimpleProposer
from ngramspec._cache import CacheFileError, NgramCache, NgramCacheProposer
from ngramspec._suffix import SuffixProposer
from ngramspec.engine import SpecEngine
from ngramspec.loop import FixedPolicy, SlotLoop
from ngramspec.replay import replay
from ngramspec.stats import acceptance_line, statistics_line

# Live generation needs llama-cpp-python (the ``live`` extra): imported on first use.
_LAZY = {"generate_speculative": "ngramspec.live", "generate_plain": "ngramspec.live",
         "load_model": "ngramspec.live"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ngramspec' has no attribute {name!r}")


__all__ = [
    "CacheFileError", "FixedPolicy", "MapProposer", "ModPool", "ModProposer", "NgramCache",
    "NgramCacheProposer", "Proposer", "PyProposer", "SimpleProposer", "SlotLoop", "SpecEngine",
    "SuffixProposer", "__version__", "acceptance_line", "generate_plain", "generate_speculative",
    "load_model", "replay", "statistics_line",
]
