"""Type stubs for ngramspec._simple (ngram-simple)."""
from ngramspec._proposer import Proposer

class SimpleProposer(Proposer):
    size_n: int
    size_m: int
    min_hits: int
    indexed: bool
    def __init__(self, size_n: int = ..., size_m: int = ..., min_hits: int = ...,
                 n_slots: int = ..., indexed: bool = ...) -> None: ...
