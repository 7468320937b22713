# C-level contract of ngramspec's kernels.
#
# Every proposer is a `Proposer` subclass. The engine (`Engine`) validates slot indices and
# token arrays once, then calls the `c_*` methods with raw pointers; a `c_*` method may trust
# `0 <= slot < n_slots`, `tokens` pointing at `n` valid ids in 0 .. 2**31-1, and `out` having room
# for `max_draft` tokens.
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t

# The one token type: llama.cpp's llama_token. tests/test_engine.py pins it to numpy.int32.
ctypedef int32_t token_t

# ngram-mod's pool (common_ngram_mod): 2**22 int32 entries, EMPTY = -1.
cdef enum:
    MOD_POOL_SIZE = 4194304
    MOD_POOL_MASK = 4194303
    MOD_EMPTY = -1


cdef class Proposer:
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
