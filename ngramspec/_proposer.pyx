# cython: language_level=3
"""The proposers' common ground: the kernels' allocator (with the tests' fault-injection hook),
argument validation (the one boundary every public entry goes through) and the `Proposer` /
`PyProposer` base classes that `ngramspec._engine.Engine` chains. The C-level contracts are
declared in ``_proposer.pxd``; `ngramspec` re-exports the public names.
"""
import operator
import sys

import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from libc.stdint cimport SIZE_MAX
from libc.stdlib cimport free
from libc cimport stdlib
from libc.string cimport memcpy

from ngramspec._types cimport TOKEN_MAX_C, token_t
from ngramspec.validation import Refused, WrongType, check_int as _check_int

cnp.import_array()

# Python-visible constant: token ids are llama.cpp's llama_token (int32), never negative.
TOKEN_MAX = TOKEN_MAX_C

# --------------------------------------------------------------------------------------------
# The kernels' allocator (declared in _proposer.pxd; every kernel module uses it)
# --------------------------------------------------------------------------------------------

# Fault injection for tests: once armed, allocations are counted and number `fault_at` (1-based)
# fails as if memory ran out. Off (one predictable branch per allocation) unless a test arms
# it; not thread-safe, so tests arm it around single-threaded calls only.
cdef bint fault_armed = False
cdef long long fault_at = 0
cdef long long fault_seen = 0

cdef inline bint fault_now() noexcept nogil:
    global fault_seen
    if not fault_armed:
        return False
    fault_seen += 1
    return fault_seen == fault_at


cdef void* malloc(size_t n) noexcept nogil:
    return NULL if fault_now() else stdlib.malloc(n)


cdef void* calloc(size_t count, size_t size) noexcept nogil:
    return NULL if fault_now() else stdlib.calloc(count, size)


cdef void* realloc(void* p, size_t n) noexcept nogil:
    return NULL if fault_now() else stdlib.realloc(p, n)


def _fail_allocation(fail_at=None):
    """Testing only: arm (``fail_at`` >= 1: the kernels' allocation number `fail_at` from now
    fails; 0: count only) or disarm (None) the fault injection of ngramspec's kernels (every
    module that allocates through _proposer). Returns the number of allocations counted since it
    was last armed."""
    global fault_armed, fault_at, fault_seen
    seen = fault_seen
    fault_armed = fail_at is not None
    fault_at = check_int("fail_at", fail_at, 0) if fail_at is not None else 0
    fault_seen = 0
    return seen


cdef void* alloc_per_slot(Py_ssize_t n_slots, size_t each, str what) except NULL:
    """calloc(n_slots, each), zeroed; MemoryError naming n_slots when the size overflows or
    memory runs out."""
    cdef void* p
    if each and <size_t>n_slots > SIZE_MAX // each:
        raise MemoryError(f"n_slots = {n_slots} is too large: {what} would need more than "
                          f"2**64 bytes")
    p = calloc(n_slots, each)
    if p == NULL:
        raise MemoryError(f"n_slots = {n_slots}: out of memory for {what} "
                          f"({<size_t>n_slots * each} bytes)")
    return p


# --------------------------------------------------------------------------------------------
# Argument validation (the one boundary every public entry goes through)
# --------------------------------------------------------------------------------------------

cdef object _not_a_token(str field, object value):
    """The error of an integer that is no token id (``prompt[3] = -1 is not a token id``)."""
    return Refused(field, f"{value} is not a token id: ids must be in 0 .. {TOKEN_MAX}",
                   value=value, allowed=f"0 .. {TOKEN_MAX}", sep=" = ")


def _tokens_slow(obj, str name):
    """Convert any 1-D integer array-like to a C-contiguous int32 array, or raise.

    Byte strings (bytes, bytearray, a memoryview of them) are refused: they are text or raw
    data, not token ids; so are bools, as everywhere an integer is expected."""
    if isinstance(obj, (bytes, bytearray)) or (isinstance(obj, memoryview)
                                               and isinstance(obj.obj, (bytes, bytearray))):
        raise WrongType(name, obj, "a 1-D sequence of integer token ids", got=(
            f"{type(obj.obj if isinstance(obj, memoryview) else obj).__name__} (bytes are not "
            f"token ids: tokenize the text first)"))
    if isinstance(obj, (list, tuple)) and bool in map(type, obj):
        pos = list(map(type, obj)).index(bool)
        raise WrongType(f"{name}[{pos}]", obj[pos], "an integer token id", detail=(
            f" = {obj[pos]} is not a token id: ids must be integers, not bool"))
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as exc:
        raise WrongType(name, obj, "a 1-D sequence of integer token ids", detail=(
            f" must be a 1-D sequence of integer token ids ({exc})")) from None
    if arr.ndim != 1:
        raise Refused(name, f"must be a 1-D sequence of token ids, got shape {arr.shape}",
                      sep=" ")
    check_length(arr.size, name)
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if (arr.dtype.kind == "O" or arr.dtype.kind == "f" and isinstance(obj, (list, tuple))) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in obj):
        # ints too large for int64 / uint64: numpy makes an object array of them, or (numpy 2,
        # ints in [2**63, 2**64) mixed with small ones) a float64 array
        for pos, v in enumerate(obj):
            if v < 0 or v > TOKEN_MAX:
                raise _not_a_token(f"{name}[{pos}]", v)
    if arr.dtype.kind not in "iu":
        raise WrongType(name, obj, "integer token ids", detail=(
            f" must hold integer token ids, got dtype {arr.dtype}"))
    lo = int(arr.min())
    hi = int(arr.max())
    if lo < 0 or hi > TOKEN_MAX:
        bad = lo if lo < 0 else hi
        pos = int(np.flatnonzero(arr == bad)[0])
        raise _not_a_token(f"{name}[{pos}]", bad)
    # ascontiguousarray keeps a misaligned int32 buffer as it is: the kernels need int32
    # alignment (C's rules; vectorized loops may assume it)
    return np.require(arr, np.int32, ("C", "A"))


cdef object tokens_slow(object obj, str name):
    return _tokens_slow(obj, name)


cdef token_t token_slow(object value, str name) except? -1:
    cdef long long v
    if exact_int_in(value, 0, TOKEN_MAX_C, &v):
        return <token_t>v
    if isinstance(value, bool):              # an int subclass, refused as for every integer
        raise WrongType(name, value, "an integer token id")
    if PyLong_CheckExact(value):
        try:
            v = PyLong_AsLongLong(value)
        except OverflowError:
            raise _not_a_token(name, value) from None
    else:
        try:
            w = operator.index(value)
        except TypeError:
            raise WrongType(name, value, "an integer token id") from None
        if w < 0 or w > TOKEN_MAX:
            raise _not_a_token(name, w)
        v = w
    if v < 0 or v > TOKEN_MAX:
        raise _not_a_token(name, v)
    return <token_t>v


def check_int(name, value, lo, hi=None):
    """`ngramspec.validation.check_int` with a compiled fast path for the kernels' hot calls (a
    draft's ``n_max``, an accept's ``n_accepted``): an int in range returns here; anything else
    is converted or refused there, with the package's one message format."""
    if PyLong_CheckExact(value) and value >= lo and (hi is None or value <= hi):
        return value
    return _check_int(name, value, lo, hi)


# --------------------------------------------------------------------------------------------
# Proposer base classes
# --------------------------------------------------------------------------------------------

cdef class Proposer:
    """Base class of every proposer the engine chains.

    Subclasses implement the ``c_begin`` / ``c_draft`` / ``c_accept`` cdef methods (Cython) or,
    through `PyProposer`, ``on_begin`` / ``on_draft`` / ``on_accept`` (Python). Every proposer is
    used the same way: alone through `begin` / `draft` / `accept` (each checks its arguments), or
    chained by `Engine`, which adds llama.cpp's statistics and priority order.

    Notes
    -----
    Memory: 9 bytes per slot (the busy flag and the pending draft length of the Python API);
    each subclass documents its own state.

    Thread-safety: per-slot state may be used by one thread per slot at a time; state shared
    across slots is documented by each subclass. A second call on a slot while one runs (from
    another thread) raises RuntimeError instead of touching the slot. ``__init__`` runs once:
    calling it again raises RuntimeError.
    """

    def __init__(self, str name, n_slots, Py_ssize_t max_draft):
        cdef Py_ssize_t s
        if self.busy != NULL:
            raise RuntimeError(f"{type(self).__name__} is already initialised")
        n_slots = check_int("n_slots", n_slots, 1)
        if n_slots > sys.maxsize:
            raise MemoryError(f"n_slots = {n_slots} is too large: allowed 1 .. {sys.maxsize}")
        check_int("max_draft", max_draft, 1)
        self.busy = <unsigned char*>alloc_per_slot(n_slots, 1, f"{name}'s slot flags")
        try:
            self.pending = <Py_ssize_t*>alloc_per_slot(n_slots, sizeof(Py_ssize_t),
                                                       f"{name}'s pending drafts")
        except MemoryError:
            free(self.busy)          # back to uninitialised: __init__ may run again
            self.busy = NULL
            raise
        for s in range(n_slots):
            self.pending[s] = -1
        self.name = name
        self.n_slots = n_slots
        self.max_draft = max_draft

    def __dealloc__(self):
        free(self.busy)
        free(self.pending)

    cdef int forget_slots(self) except -1:
        """Back to uninitialised (n_slots 0), after a subclass freed its per-slot state: what
        an __init__ that failed half-way leaves (no slot to call, __init__ may run again)."""
        free(self.busy)
        free(self.pending)
        self.busy = NULL
        self.pending = NULL
        self.n_slots = 0
        return 0

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        return 0

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        return 0

    # -- Python API: every proposer is used the same way, one slot at a time ------------------
    # (The Engine chains proposers through the c_* methods and checks its own arguments; these
    # check theirs, so a proposer alone gets the same contract: begin, draft, accept once after
    # each non-empty draft with 0 <= n_accepted <= its length.)

    cdef Py_ssize_t slot_arg(self, slot) except -1:
        if self.busy == NULL:
            raise RuntimeError(f"{type(self).__name__} is not initialised")
        try:
            v = operator.index(slot)
        except TypeError:
            raise TypeError(f"slot must be an integer, got {type(slot).__name__}") from None
        if not 0 <= v < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return <Py_ssize_t>v

    cdef Py_ssize_t checked_prefix(self, Py_ssize_t slot):
        return 0

    def begin(self, slot, prompt):
        """Start a request on `slot` with its full prompt.

        Parameters
        ----------
        slot : int
            0 .. n_slots - 1.
        prompt : 1-D sequence of int
            Token ids in 0 .. TOKEN_MAX.
        """
        cdef Py_ssize_t s = self.slot_arg(slot)
        cdef cnp.ndarray arr = as_tokens(prompt, "prompt")
        self.pending[s] = -1
        proposer_begin(self, s, tok_ptr(arr), cnp.PyArray_DIMS(arr)[0])

    def draft(self, slot, context, sampled):
        """The draft to follow ``context + [sampled]``.

        Parameters
        ----------
        slot : int
            0 .. n_slots - 1.
        context : 1-D sequence of int
            The tokens in the KV cache (prompt and output so far, without `sampled`); between
            two `begin` calls each context extends the previous one (llama.cpp's contract).
        sampled : int
            The last token the target emitted.

        Returns
        -------
        numpy.ndarray
            int32, at most `max_draft` tokens; empty when there is no draft.
        """
        cdef Py_ssize_t s = self.slot_arg(slot)
        cdef cnp.ndarray arr = as_tokens(context, "context", self.checked_prefix(s))
        cdef token_t tok = as_token(sampled, "sampled")
        cdef cnp.ndarray out = np.empty(self.max_draft, dtype=np.int32)
        self.pending[s] = -1
        cdef Py_ssize_t k = proposer_draft(self, s, tok_ptr(arr), cnp.PyArray_DIMS(arr)[0], tok,
                                           <token_t*>cnp.PyArray_DATA(out))
        if k > self.max_draft:
            raise RuntimeError(f"{self.name} overflowed its draft buffer")
        if k > 0:
            self.pending[s] = k
        return out[:k]

    def accept(self, slot, n_accepted):
        """Report how many tokens of the slot's last non-empty draft the target accepted.

        Parameters
        ----------
        slot : int
            0 .. n_slots - 1.
        n_accepted : int
            0 .. the draft's length; once after each non-empty `draft`.
        """
        cdef Py_ssize_t s = self.slot_arg(slot)
        cdef Py_ssize_t last = self.pending[s]
        if last < 0:
            raise ValueError(f"accept() on slot {s} without a pending non-empty draft: call it "
                             f"once after each non-empty draft()")
        cdef Py_ssize_t n = check_int("n_accepted", n_accepted, 0, last)
        self.pending[s] = -1
        proposer_accept(self, s, n, False)

    def memory_bytes(self):
        """Bytes of memory this proposer holds (all slots; a shared ModPool not included)."""
        return 0

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} n_slots={self.n_slots}>"


cdef int raise_busy(str who, Py_ssize_t slot) except -1:
    raise RuntimeError(f"{who} slot {slot} used concurrently from two threads (one thread "
                       f"per slot at a time)")


cdef class PyProposer(Proposer):
    """A proposer written in Python (e.g. a draft model).

    Override ``on_begin(slot, prompt)``, ``on_draft(slot, inp, sampled) -> sequence of ids`` and
    ``on_accept(slot, n_accepted, is_other)``. ``prompt`` and ``inp`` are fresh int32 copies the
    method may keep. A draft longer than ``max_draft`` raises ValueError.

    Notes
    -----
    Memory: whatever the subclass keeps; the wrapper itself holds nothing per slot.

    Thread-safety: the ``on_*`` methods run with the GIL held; one thread per slot at a time (a
    second call on a busy slot raises RuntimeError, see `Proposer`).
    """

    def on_begin(self, slot, prompt):
        pass

    def on_draft(self, slot, inp, sampled):
        return ()

    def on_accept(self, slot, n_accepted, is_other):
        pass

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        self.on_begin(slot, copy_tokens(prompt, n))
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef cnp.ndarray arr = as_tokens(self.on_draft(slot, copy_tokens(inp, n), sampled),
                                         f"{self.name} draft")
        cdef Py_ssize_t length = cnp.PyArray_DIMS(arr)[0]
        if length > self.max_draft:
            raise ValueError(f"{self.name} drafted {length} tokens: allowed 0 .. {self.max_draft}")
        if length:
            memcpy(out, tok_ptr(arr), length * sizeof(token_t))
        return length

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        self.on_accept(slot, n_accepted, is_other)
        return 0


# Every empty draft is this one read-only array (saves an allocation per draftless step).
