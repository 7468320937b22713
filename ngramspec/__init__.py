"""ngramspec: draftless speculative decoding.

llama.cpp's n-gram proposers (ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache),
bit-exact, in Cython kernels; ngramspec's own ngram-suffix proposer; an engine that chains them
as llama-server does; the one draft -> verify -> accept loop (`ngramspec.loop`) with its replay
and live targets (everything that talks to llama-cpp-python is in `ngramspec.llama`).
"""
__version__ = "0.1.0"

# before numpy and the kernels load libstdc++: a CUDA build of llama.cpp needs its libraries
# first (ngramspec.load_order)
from ngramspec.load_order import load_gpu_llama_first

load_gpu_llama_first()

try:
    from ngramspec._map import MapProposer
    from ngramspec._mod import ModPool, ModProposer
    from ngramspec._proposer import Proposer, PyProposer
    from ngramspec._simple import SimpleProposer
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
from ngramspec.loop import SlotLoop
from ngramspec.policy import AutoPolicy, FixedPolicy
from ngramspec.replay import replay
from ngramspec.stats import acceptance_line, statistics_line

from ngramspec.lazy import lazy_exports as _lazy_exports

# Live generation needs llama-cpp-python (the ``live`` extra): imported on first use.
__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "ngramspec.llama.live": ("generate_plain", "generate_speculative"),
    "ngramspec.llama.model": ("load_model",),
}, eager=(
    "AutoPolicy", "CacheFileError", "CostModel", "FixedPolicy", "MapProposer", "ModPool",
    "ModProposer", "NgramCache", "NgramCacheProposer", "Proposer", "PyProposer",
    "SimpleProposer", "SlotLoop", "SpecEngine", "SuffixProposer", "__version__",
    "acceptance_line", "load_cost_model", "replay", "statistics_line",
))
