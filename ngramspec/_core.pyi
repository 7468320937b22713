from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

TOKEN_MAX: int
EMPTY_DRAFT: npt.NDArray[np.int32]

Tokens = Sequence[int] | npt.NDArray[np.integer]

def check_int(name: str, value: Any, lo: int, hi: int | None = ...) -> int: ...

class Proposer:
    name: str
    n_slots: int
    max_draft: int
    def __init__(self, name: str, n_slots: int, max_draft: int) -> None: ...
    def memory_bytes(self) -> int: ...

class PyProposer(Proposer):
    def on_begin(self, slot: int, prompt: npt.NDArray[np.int32]) -> None: ...
    def on_draft(self, slot: int, inp: npt.NDArray[np.int32], sampled: int) -> Tokens: ...
    def on_accept(self, slot: int, n_accepted: int, is_other: bool) -> None: ...

class SimpleProposer(Proposer):
    size_n: int
    size_m: int
    min_hits: int
    indexed: bool
    def __init__(self, size_n: int = ..., size_m: int = ..., min_hits: int = ...,
                 n_slots: int = ..., indexed: bool = ...) -> None: ...

class MapProposer(Proposer):
    size_n: int
    size_m: int
    min_hits: int
    reindex: bool
    def __init__(self, size_n: int = ..., size_m: int = ..., min_hits: int = ...,
                 key_only: bool = ..., n_slots: int = ..., reindex: bool = ...,
                 stat_index_min: int = ...) -> None: ...
    def n_keys(self, slot: int) -> int: ...

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

class Engine:
    proposers: tuple[Proposer, ...]
    n_slots: int
    pool: ModPool | None
    types: list[str]
    def __init__(self, proposers: Sequence[Proposer], n_slots: int = ...,
                 pool: ModPool | None = ...) -> None: ...
    def begin(self, slot: int, prompt: Tokens) -> None: ...
    def draft(self, slot: int, context: Tokens, sampled: int,
              n_max: int | None = ...) -> npt.NDArray[np.int32]: ...
    def accept(self, slot: int, n_accepted: int) -> None: ...
    def stats(self) -> list[dict[str, Any]]: ...
    def memory_bytes(self) -> int: ...
