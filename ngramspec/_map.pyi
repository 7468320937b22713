"""Type stubs for ngramspec._map (ngram-map-k / ngram-map-k4v)."""
from ngramspec._proposer import Proposer

class MapProposer(Proposer):
    size_n: int
    size_m: int
    min_hits: int
    reindex: bool
    def __init__(self, size_n: int = ..., size_m: int = ..., min_hits: int = ...,
                 key_only: bool = ..., n_slots: int = ..., reindex: bool = ...,
                 stat_index_min: int = ...) -> None: ...
    def n_keys(self, slot: int) -> int: ...
