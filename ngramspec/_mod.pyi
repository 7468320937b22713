"""Type stubs for ngramspec._mod (ngram-mod and its pool)."""
from ngramspec._proposer import Proposer, Tokens

class ModPool:
    size: int
    nbytes: int
    used: int
    occupancy: float
    def reset(self) -> None: ...
    def get(self, key: Tokens) -> int: ...

class ModProposer(Proposer):
    pool: ModPool
    n_match: int
    n_min: int
    n_max: int
    def __init__(self, n_match: int = ..., n_min: int = ..., n_max: int = ...,
                 pool: ModPool | None = ..., n_slots: int = ...) -> None: ...
    def slot_state(self, slot: int) -> tuple[int, int, int]: ...
