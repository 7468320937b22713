"""The configurations ``python bench e2e`` measures, by name: ngramspec's own (`CONFIGS`, the
auto policy's in `AUTO`), llama-cpp-python's, and llama.cpp's llama-server with the same flags
(`SERVER_CONFIGS`). Shared by the measurement (e2e_report.py), its Markdown (e2e_markdown.py)
and the reports that reuse its prompts and names (policy_report.py)."""
from __future__ import annotations

PLAIN = "plain"                    # ngramspec's driver without drafts
LCP_PLAIN = "llama-cpp-python plain"
LCP_LOOKUP = "llama-cpp-python prompt lookup"
CHAIN = "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod"

# name -> (spec types, engine keywords). llama.cpp's defaults unless the name says otherwise.
CONFIGS = {
    "ngram-simple": ("ngram-simple", {}),
    "ngram-simple n_max 16": ("ngram-simple", {"ngram_simple_size_m": 16}),
    "ngram-map-k": ("ngram-map-k", {}),
    "ngram-map-k4v": ("ngram-map-k4v", {}),
    "ngram-mod": ("ngram-mod", {}),
    "ngram-mod 8/16": ("ngram-mod", {"ngram_mod_n_min": 8, "ngram_mod_n_max": 16}),
    "ngram-mod 8/32": ("ngram-mod", {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}),
    "ngram-cache": ("ngram-cache", {}),
    "ngram-suffix": ("ngram-suffix", {}),
    # its adaptive length with a CPU's cost: a draft token costs about half a decode (c(k) grows
    # by ~0.5 per token), so draft while the whole draft is accepted with probability >= 0.5
    "ngram-suffix min_prob 0.5": ("ngram-suffix", {"ngram_suffix_min_prob": 0.5}),
    "chain": (CHAIN, {}),
    # the cost-aware policy (ngramspec.policy.AutoPolicy) on the machine's calibrated c(k):
    # generate's default configuration, llama.cpp's default chain, ngram-suffix
    "ngram-mod 8/32 auto": ("ngram-mod", {"ngram_mod_n_min": 8, "ngram_mod_n_max": 32}),
    "chain auto": (CHAIN, {}),
    "ngram-suffix auto": ("ngram-suffix", {}),
}
AUTO = {"ngram-mod 8/32 auto", "chain auto", "ngram-suffix auto"}

# llama.cpp's own llama-server (bench/llama_server.py) with the same flags: plain, and every
# fixed configuration made of llama.cpp's types only (ngram-suffix is ngramspec's own).
LS_PREFIX = "llama-server "
LS_PLAIN = LS_PREFIX + "plain"
LLAMA_TYPES = {"ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"}
SERVER_CONFIGS = {LS_PLAIN: (None, {})} | {
    LS_PREFIX + name: (types, params) for name, (types, params) in CONFIGS.items()
    if name not in AUTO and set(types.split(",")) <= LLAMA_TYPES}
ALL_NAMES = [PLAIN, *CONFIGS, LCP_PLAIN, LCP_LOOKUP, *SERVER_CONFIGS]
BATCH_KS = (1, 2, 4, 8, 16, 32, 64)
