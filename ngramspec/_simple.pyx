# cython: language_level=3
"""ngram-simple (common_ngram_simple_draft): the m tokens after the most recent earlier
occurrence of the last n tokens, by llama.cpp's backward scan or through a per-slot position index."""
from libc.stdint cimport uint64_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy

from ngramspec._hash cimport mod_hash, mod_pow, mod_step
from ngramspec._posindex cimport (PosIndex, pos_bytes, pos_extend, pos_free, pos_indexed,
                                  pos_invalidate, pos_newest)
from ngramspec._proposer cimport Proposer, alloc_per_slot
from ngramspec._types cimport NOGIL_MIN_TOKENS, token_t

from ngramspec._proposer import check_int

# --------------------------------------------------------------------------------------------
# ngram-simple (common_ngram_simple_draft): stateless backward scan
# --------------------------------------------------------------------------------------------

cdef Py_ssize_t simple_draft(const token_t* inp, Py_ssize_t L, token_t sampled,
                             Py_ssize_t n, Py_ssize_t m, token_t* out) noexcept nogil:
    if L <= n + m + 1:                       # '<=' as in llama.cpp
        return 0
    cdef const token_t* pattern = inp + L - n + 1     # first n-1 tokens of the pattern
    cdef size_t head = (n - 1) * sizeof(token_t)
    cdef Py_ssize_t j, match = 0, copy_max
    j = L - n - 1                            # skips the overlapping positions L-n, L-n+1
    while j >= 1:                            # position 0 is never tested
        # Last pattern token first: a cheap filter that gives the same first match.
        if inp[j + n - 1] == sampled and memcmp(inp + j, pattern, head) == 0:
            match = j
            break
        j -= 1
    if match == 0:
        return 0
    copy_max = L - (match + n)
    if copy_max > m:
        copy_max = m
    if copy_max < n:                         # the minimum draft is n tokens, not 1
        return 0
    memcpy(out, inp + match + n, copy_max * sizeof(token_t))
    return copy_max


# The incremental index replacing the backward scan: every earlier n-gram position, grouped by
# the n-gram's hash (newest first), so the most recent occurrence is found in O(n)
# instead of O(L). It finds exactly the match the scan finds: a chain is walked newest first
# and each position's tokens are compared, as the scan compares them (position 0, which the
# scan never tests, ends every walk).


cdef Py_ssize_t simple_draft_indexed(PosIndex* ix, const token_t* inp, Py_ssize_t L,
                                     token_t sampled, Py_ssize_t n, Py_ssize_t m,
                                     uint64_t a_pow, token_t* out) noexcept nogil:
    """simple_draft's result through the index; -1 when out of memory."""
    if L <= n + m + 1:
        return 0
    cdef Py_ssize_t last = L - n - 1, j, match = 0, copy_max
    if pos_indexed(ix) > last + 1:           # the context shrank without begin(): start over
        pos_invalidate(ix)
    if pos_extend(ix, inp, last, n, a_pow) < 0:
        return -1
    j = pos_newest(ix, mod_step(mod_hash(inp + L - n + 1, n - 1), sampled))
    while j >= 1:                            # newest first: the first true match is the answer
        if inp[j + n - 1] == sampled and memcmp(inp + j, inp + L - n + 1,
                                                (n - 1) * sizeof(token_t)) == 0:
            match = j
            break
        j = ix.prev[j]
    if match == 0:
        return 0
    copy_max = L - (match + n)
    if copy_max > m:
        copy_max = m
    if copy_max < n:
        return 0
    memcpy(out, inp + match + n, copy_max * sizeof(token_t))
    return copy_max


cdef class SimpleProposer(Proposer):
    """ngram-simple: the m tokens after the most recent earlier occurrence of the last n tokens.

    Parameters
    ----------
    size_n : int, 1 .. 1024 (llama.cpp default 12)
    size_m : int, 1 .. 1024 (default 48)
    min_hits : int, >= 1 (default 1; parsed but unused, as in llama.cpp)
    n_slots : int, >= 1
    indexed : bool (default True)
        Find the match through a per-slot incremental index of earlier n-gram positions
        (O(n) per call) instead of llama.cpp's backward scan (O(L)). Same drafts either way.

    Notes
    -----
    Memory: with the index, per slot 4 bytes per context token plus a hash table of 16 to 32
    bytes per distinct n-gram (8-byte entries, at most half full); the scan needs nothing.

    Thread-safety: one thread per slot at a time (the index is per slot; a second call on a
    busy slot raises RuntimeError). Drafts that index more than ``NOGIL_MIN_TOKENS`` (4096)
    new positions (the first after begin on a long prompt) release the GIL.
    """
    cdef readonly Py_ssize_t size_n, size_m, min_hits
    cdef readonly bint indexed
    cdef uint64_t a_pow
    cdef PosIndex* index

    def __cinit__(self):
        self.index = NULL

    def __init__(self, size_n=12, size_m=48, min_hits=1, n_slots=1, indexed=True):
        size_n = check_int("size_n", size_n, 1, 1024)
        size_m = check_int("size_m", size_m, 1, 1024)
        min_hits = check_int("min_hits", min_hits, 1)
        Proposer.__init__(self, "ngram-simple", n_slots, size_m)   # first: it refuses a re-run
        self.size_n = size_n
        self.size_m = size_m
        self.min_hits = min_hits
        self.indexed = bool(indexed)
        self.a_pow = mod_pow(self.size_n - 1)
        try:
            self.index = <PosIndex*>alloc_per_slot(n_slots, sizeof(PosIndex),
                                                   "ngram-simple's index")
        except MemoryError:
            self.forget_slots()
            raise

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.index != NULL:
            for i in range(self.n_slots):
                pos_free(&self.index[i])
            free(self.index)

    def memory_bytes(self):
        cdef Py_ssize_t i
        cdef size_t total = 0
        for i in range(self.n_slots):
            total += pos_bytes(&self.index[i])
        return total

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        pos_invalidate(&self.index[slot])    # rebuilt lazily by the next draft
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef Py_ssize_t r
        cdef PosIndex* ix = &self.index[slot]
        if not self.indexed:
            if n > NOGIL_MIN_TOKENS:
                with nogil:
                    r = simple_draft(inp, n, sampled, self.size_n, self.size_m, out)
                return r
            return simple_draft(inp, n, sampled, self.size_n, self.size_m, out)
        if n - pos_indexed(ix) > NOGIL_MIN_TOKENS:
            with nogil:
                r = simple_draft_indexed(ix, inp, n, sampled, self.size_n, self.size_m,
                                         self.a_pow, out)
        else:
            r = simple_draft_indexed(ix, inp, n, sampled, self.size_n, self.size_m, self.a_pow,
                                     out)
        if r < 0:
            raise MemoryError("out of memory while indexing ngram-simple's context")
        return r

