# C-level contract of ngramspec's kernels.
#
# Every proposer is a `Proposer` subclass. The engine (`Engine`) validates slot indices and
# token arrays once, then calls the `c_*` methods with raw pointers; a `c_*` method may trust
# `0 <= slot < n_slots`, `tokens` pointing at `n` valid ids in 0 .. 2**31-1, and `out` having room
# for `max_draft` tokens. Callers go through `proposer_begin` / `proposer_draft` /
# `proposer_accept`, which refuse a second call on a slot while one runs (RuntimeError), so a
# `c_*` method may also trust that no other thread uses its slot.
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t

# The one token type: llama.cpp's llama_token. tests/test_engine.py pins it to numpy.int32.
ctypedef int32_t token_t

# ngram-mod's pool (common_ngram_mod): 2**22 int32 entries, EMPTY = -1.
cdef enum:
    MOD_POOL_SIZE = 4194304
    MOD_POOL_MASK = 4194303
    MOD_EMPTY = -1


cdef class Proposer:
    # Per slot: 1 while a call on the slot runs (n_slots bytes; NULL until __init__ ran).
    cdef unsigned char* busy
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

    cdef int forget_slots(self) except -1


# The kernels' allocator: libc's, plus a fault-injection hook for tests (see
# `ngramspec._core._fail_allocation`).
cdef void* malloc(size_t n) noexcept nogil
cdef void* calloc(size_t count, size_t size) noexcept nogil
cdef void* realloc(void* p, size_t n) noexcept nogil
# calloc(n_slots, each) or MemoryError naming n_slots (also when the size overflows).
cdef void* alloc_per_slot(Py_ssize_t n_slots, size_t each, str what) except NULL
cdef int raise_busy(Proposer p, Py_ssize_t slot) except -1


# One call on a slot at a time: the flag is tested and set with the GIL held, so it needs no
# lock; kernels that release the GIL stay protected until the call returns.
cdef inline int proposer_begin(Proposer p, Py_ssize_t slot, const token_t* prompt,
                               Py_ssize_t n) except -1:
    if p.busy[slot]:
        raise_busy(p, slot)
    p.busy[slot] = 1
    try:
        return p.c_begin(slot, prompt, n)
    finally:
        p.busy[slot] = 0


cdef inline Py_ssize_t proposer_draft(Proposer p, Py_ssize_t slot, const token_t* inp,
                                      Py_ssize_t n, token_t sampled, token_t* out) except -1:
    if p.busy[slot]:
        raise_busy(p, slot)
    p.busy[slot] = 1
    try:
        return p.c_draft(slot, inp, n, sampled, out)
    finally:
        p.busy[slot] = 0


cdef inline int proposer_accept(Proposer p, Py_ssize_t slot, Py_ssize_t n_accepted,
                                bint is_other) except -1:
    if p.busy[slot]:
        raise_busy(p, slot)
    p.busy[slot] = 1
    try:
        return p.c_accept(slot, n_accepted, is_other)
    finally:
        p.busy[slot] = 0
