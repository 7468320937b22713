# C-level contract of ngramspec's proposers (cimported by every kernel module).
#
# Every proposer is a `Proposer` subclass, one per llama.cpp speculative type: c_begin /
# c_draft / c_accept are llama.cpp's common_speculative_impl_*::begin / draft / accept (the
# engine, `ngramspec._engine.Engine`, is common_speculative_begin / _draft / _accept around them).
#
# Arguments: the engine validates slot indices and token arrays once (as_tokens / as_token
# below, the kernels' one validator), then calls the `c_*` methods with raw pointers; a `c_*`
# method may trust `0 <= slot < n_slots`, `tokens` pointing at `n` valid ids in
# 0 .. TOKEN_MAX_C (never negative: kernels may use negative values as sentinels, e.g.
# LLAMA_TOKEN_NULL = -1), and `out` having room for `max_draft` tokens.
#
# Ownership: the pointers are borrowed for the call only: a proposer copies what it keeps. Its
# own state is allocated with the allocator below and freed by the proposer.
#
# Append-only context: between two c_begin calls on a slot, the context passed to c_draft only
# grows (llama-server appends to the slot's KV cache): incremental state (position indexes,
# learned n-grams) may rely on the tokens it already saw staying as they were, but must survive
# a shorter or different context (start over) without a wrong draft or a bad memory access.
#
# Thread-safety: callers go through `proposer_begin` / `proposer_draft` / `proposer_accept`,
# which claim the slot (`claim_slot`: a second call on a slot while one runs raises
# RuntimeError), so a `c_*` method may also trust that no other thread uses its slot and may
# release the GIL (above NOGIL_MIN_TOKENS of work); state shared across slots needs the
# proposer's own lock.
cimport numpy as cnp
from cpython.long cimport PyLong_CheckExact
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t
from libc.string cimport memcpy

from ngramspec._types cimport TOKEN_MAX_C, token_t

cdef class Proposer:
    # Per slot: 1 while a call on the slot runs (n_slots bytes, owned; NULL until __init__ ran).
    cdef unsigned char* busy
    # Per slot, for the Python API (begin/draft/accept): the length of the last non-empty draft,
    # waiting for its accept(); -1 when none (n_slots entries, owned, with `busy`).
    cdef Py_ssize_t* pending
    # Type name as llama.cpp prints it ("ngram-mod", ...).
    cdef readonly str name
    cdef readonly Py_ssize_t n_slots
    # Upper bound on the length of one draft (the engine's output buffer size).
    cdef readonly Py_ssize_t max_draft

    # Called with the GIL held. Implementations may release it internally for long work.
    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1
    # Writes the untruncated draft into out[0 .. max_draft) and returns its length (0 = no draft).
    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1
    # is_other: the slot's last draft came from another proposer of the chain.
    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1

    # Back to uninitialised, after a subclass freed its per-slot state (a failed __init__).
    cdef int forget_slots(self) except -1
    # `slot` of a Python API call as an index (TypeError, IndexError naming the range).
    cdef Py_ssize_t slot_arg(self, slot) except -1
    # How many leading context tokens of `slot` the proposer already holds checked (the Python
    # API's draft validates only the rest); 0 by default.
    cdef Py_ssize_t checked_prefix(self, Py_ssize_t slot)


# The kernels' allocator: libc's, plus a fault-injection hook for tests (see
# `ngramspec._proposer._fail_allocation`). Memory from it is released with libc's free().
cdef void* malloc(size_t n) noexcept nogil
cdef void* calloc(size_t count, size_t size) noexcept nogil
cdef void* realloc(void* p, size_t n) noexcept nogil
# calloc(n_slots, each) or MemoryError naming n_slots (also when the size overflows).
cdef void* alloc_per_slot(Py_ssize_t n_slots, size_t each, str what) except NULL
cdef int raise_busy(str who, Py_ssize_t slot) except -1

# Argument validation: the full checks (any array-like, every error message); the inline fast
# paths below (as_tokens, as_token) fall back on them.
cdef object tokens_slow(object obj, str name)
cdef token_t token_slow(object value, str name) except? -1

cdef inline Py_ssize_t first_negative(const token_t* t, Py_ssize_t n) noexcept nogil:
    """Index of the first negative id, or -1. The OR-reduction vectorizes; the scan runs only
    when it found one."""
    cdef Py_ssize_t i
    cdef int32_t acc = 0
    for i in range(n):
        acc |= t[i]
    if acc >= 0:
        return -1
    for i in range(n):
        if t[i] < 0:
            return i
    return -1


cdef inline int check_length(Py_ssize_t n, str name) except -1:
    # the kernels keep token positions in 32 bits (as llama.cpp's llama_pos)
    if n > TOKEN_MAX_C:
        raise ValueError(f"{name} holds {n} tokens: at most {TOKEN_MAX_C} are allowed")
    return 0


cdef inline object buffer_owner(cnp.ndarray arr):
    """The array's base object (the buffer a view such as ``buf[:L]`` looks into), or the
    array itself; C-level, no attribute lookups."""
    cdef PyObject* base = cnp.PyArray_BASE(arr)
    return <object>base if base != NULL else arr


cdef inline const token_t* tok_ptr(cnp.ndarray arr) noexcept:
    return <const token_t*>cnp.PyArray_DATA(arr)


cdef extern from "Python.h":
    # declared here without Cython's error check: it sets no error for an int argument
    long long long_and_overflow "PyLong_AsLongLongAndOverflow"(object, int*)


cdef inline bint exact_int_in(object value, long long lo, long long hi, long long* out) noexcept:
    """The fast path of every integer argument: a plain int in lo .. hi (anything else goes
    through the full check, which gives the errors)."""
    cdef int overflow = 0
    cdef long long v
    if not PyLong_CheckExact(value):
        return False
    v = long_and_overflow(value, &overflow)
    if overflow != 0 or v < lo or v > hi:
        return False
    out[0] = v
    return True


# The kernels' one slot-lock idiom: a per-slot byte (`Proposer.busy`, the engine's own, ...),
# tested and set with the GIL held, so it needs no lock; cleared in a `finally` once the call
# returns, so kernels that release the GIL stay protected. `who` names the owner in the error.
cdef inline int claim_slot(unsigned char* busy, Py_ssize_t slot, str who) except -1:
    if busy[slot]:
        raise_busy(who, slot)
    busy[slot] = 1
    return 0


# The entry points of a proposer's c_* methods: one call on a slot at a time.
cdef inline int proposer_begin(Proposer p, Py_ssize_t slot, const token_t* prompt,
                               Py_ssize_t n) except -1:
    claim_slot(p.busy, slot, p.name)
    try:
        return p.c_begin(slot, prompt, n)
    finally:
        p.busy[slot] = 0


cdef inline Py_ssize_t proposer_draft(Proposer p, Py_ssize_t slot, const token_t* inp,
                                      Py_ssize_t n, token_t sampled, token_t* out) except -1:
    claim_slot(p.busy, slot, p.name)
    try:
        return p.c_draft(slot, inp, n, sampled, out)
    finally:
        p.busy[slot] = 0


cdef inline int proposer_accept(Proposer p, Py_ssize_t slot, Py_ssize_t n_accepted,
                                bint is_other) except -1:
    claim_slot(p.busy, slot, p.name)
    try:
        return p.c_accept(slot, n_accepted, is_other)
    finally:
        p.busy[slot] = 0


cdef inline cnp.ndarray as_tokens(object obj, str name, Py_ssize_t skip=0):
    """`obj` as a validated C-contiguous int32 array (zero-copy when it already is one).

    The first `skip` tokens of a zero-copy array are taken as already validated (the engine
    validates each token of a growing context once).
    """
    cdef cnp.ndarray arr
    cdef Py_ssize_t bad, n
    if (cnp.PyArray_CheckExact(obj) and cnp.PyArray_TYPE(<cnp.ndarray>obj) == cnp.NPY_INT32
            and cnp.PyArray_NDIM(<cnp.ndarray>obj) == 1
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>obj)):
        arr = <cnp.ndarray>obj
        n = cnp.PyArray_DIMS(arr)[0]
        check_length(n, name)
        if skip > n or skip < 0:
            skip = 0
        bad = first_negative(<const token_t*>cnp.PyArray_DATA(arr) + skip, n - skip)
        if bad >= 0:
            bad += skip
            raise ValueError(f"{name}[{bad}] = {arr[bad]} is not a token id: ids must be in "
                             f"0 .. {TOKEN_MAX_C}")
        return arr
    return tokens_slow(obj, name)


cdef inline token_t as_token(object value, str name) except? -1:
    cdef long long v
    if exact_int_in(value, 0, TOKEN_MAX_C, &v):
        return <token_t>v
    return token_slow(value, name)


# A fresh int32 array holding a copy of t[0 : n] (the caller keeps its buffer).
cdef inline cnp.ndarray copy_tokens(const token_t* t, Py_ssize_t n):
    cdef cnp.npy_intp dims = n
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNew(1, &dims, cnp.NPY_INT32)
    if n:
        memcpy(cnp.PyArray_DATA(arr), t, n * sizeof(token_t))
    return arr
