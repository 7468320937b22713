"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod), bit-exact,
in Cython kernels; an engine that chains them as llama-server does; trace replay and live
generation drivers.
"""
__version__ = "0.1.0"

from ngramspec._core import (POOL_SIZE, MapProposer, ModPool, ModProposer, Proposer, PyProposer,
                             SimpleProposer, SpecEngine)
from ngramspec.stats import acceptance_line, statistics_line

try:  # the C++ ngram-cache module; absent only in a partial developer build
    from ngramspec._cache import CacheFileError, NgramCache, NgramCacheProposer
except ImportError:  # pragma: no cover
    pass

__all__ = [
    "POOL_SIZE", "MapProposer", "ModPool", "ModProposer", "Proposer", "PyProposer",
    "SimpleProposer", "SpecEngine", "CacheFileError", "NgramCache", "NgramCacheProposer", "acceptance_line", "statistics_line", "__version__",
]
