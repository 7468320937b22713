"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache),
bit-exact, in Cython kernels; ngramspec's own ngram-suffix proposer; an engine that chains them
as llama-server does; trace replay and live generation drivers.
"""
__version__ = "0.1.0"

from ngramspec._core import (POOL_SIZE, MapProposer, ModPool, ModProposer, Proposer, PyProposer,
                             SimpleProposer, SpecEngine)
from ngramspec.stats import acceptance_line, statistics_line

from ngramspec._cache import CacheFileError, NgramCache, NgramCacheProposer
from ngramspec._suffix import SuffixProposer
from ngramspec.cost import CostModel, load_cost_model
from ngramspec.policy import AutoPolicy

__all__ = [
    "POOL_SIZE", "AutoPolicy", "CacheFileError", "CostModel", "MapProposer", "ModPool",
    "ModProposer", "NgramCache", "NgramCacheProposer", "Proposer", "PyProposer", "SimpleProposer", "SpecEngine",
    "SuffixProposer", "__version__", "acceptance_line", "load_cost_model", "statistics_line",
]
