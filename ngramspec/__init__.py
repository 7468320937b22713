"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache),
bit-exact, in Cython kernels; ngramspec's own ngram-suffix proposer; an engine that chains them
as llama-server does; trace replay and live generation drivers.
"""
__version__ = "0.1.0"

try:
    from ngramspec._core import (POOL_SIZE, MapProposer, ModPool, ModProposer, Proposer,
                                 PyProposer, SimpleProposer, SpecEngine)
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
from ngramspec.stats import acceptance_line, statistics_line

__all__ = [
    "POOL_SIZE", "CacheFileError", "MapProposer", "ModPool", "ModProposer", "NgramCache",
    "NgramCacheProposer", "Proposer", "PyProposer", "SimpleProposer", "SpecEngine",
    "SuffixProposer", "__version__", "acceptance_line", "statistics_line",
]
