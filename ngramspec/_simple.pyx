# cython: language_level=3
"""ngram-simple (common_ngram_simple_draft): the m tokens after the most recent earlier
occurrence of the last n tokens, by llama.cpp's backward scan or through a per-slot position index."""
from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memset

from ngramspec._hash cimport mod_hash, mod_pow, mod_roll, mod_step
from ngramspec._posindex cimport grow_positions, tab_slot
from ngramspec._proposer cimport Proposer, alloc_per_slot, malloc
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
# the n-gram's 64-bit hash (newest first), so the most recent occurrence is found in O(n)
# instead of O(L). It finds exactly the match the scan finds.


cdef struct SimpleIndex:
    Py_ssize_t next_j          # positions 1 .. next_j-1 are indexed (0 is never a candidate)
    Py_ssize_t cap             # room in prev
    int32_t* prev              # prev[j]: previous position with the same n-gram hash, -1 = none
    uint64_t* tab_hash         # open addressing on the hash ...
    int32_t* tab_pos           # ... -> newest position with it; -1 = empty entry
    Py_ssize_t tab_size        # a power of two, at least twice tab_used
    Py_ssize_t tab_used


cdef int index_table_grow(SimpleIndex* ix, Py_ssize_t size) noexcept nogil:
    cdef uint64_t* th = <uint64_t*>malloc(size * sizeof(uint64_t))
    cdef int32_t* tp = <int32_t*>malloc(size * sizeof(int32_t))
    cdef Py_ssize_t i, k
    if th == NULL or tp == NULL:
        free(th)
        free(tp)
        return -1
    memset(tp, 0xFF, size * sizeof(int32_t))
    for i in range(ix.tab_size):
        if ix.tab_pos[i] >= 0:
            k = tab_slot(ix.tab_hash[i], size)
            while tp[k] >= 0:
                k = (k + 1) & (size - 1)
            th[k] = ix.tab_hash[i]
            tp[k] = ix.tab_pos[i]
    free(ix.tab_hash)
    free(ix.tab_pos)
    ix.tab_hash = th
    ix.tab_pos = tp
    ix.tab_size = size
    return 0


cdef void index_clear(SimpleIndex* ix) noexcept nogil:
    ix.next_j = 1
    ix.tab_used = 0
    if ix.tab_pos != NULL:
        memset(ix.tab_pos, 0xFF, ix.tab_size * sizeof(int32_t))


cdef void index_free(SimpleIndex* ix) noexcept nogil:
    free(ix.prev)
    free(ix.tab_hash)
    free(ix.tab_pos)


cdef int index_extend(SimpleIndex* ix, const token_t* inp, Py_ssize_t last, Py_ssize_t n,
                      uint64_t a_pow) noexcept nogil:
    """Index positions next_j .. last (rolling hash). -1 when out of memory."""
    cdef Py_ssize_t j, k
    cdef uint64_t h
    if last < ix.next_j:
        return 0
    if last >= ix.cap and grow_positions(&ix.prev, &ix.cap, last) < 0:
        return -1
    h = mod_hash(inp + ix.next_j, n)
    for j in range(ix.next_j, last + 1):
        if 2 * (ix.tab_used + 1) > ix.tab_size:
            if index_table_grow(ix, ix.tab_size * 2 if ix.tab_size else 4096) < 0:
                ix.next_j = j
                return -1
        k = tab_slot(h, ix.tab_size)
        while ix.tab_pos[k] >= 0 and ix.tab_hash[k] != h:
            k = (k + 1) & (ix.tab_size - 1)
        if ix.tab_pos[k] < 0:
            ix.tab_hash[k] = h
            ix.tab_used += 1
        ix.prev[j] = ix.tab_pos[k]
        ix.tab_pos[k] = <int32_t>j
        if j < last:
            h = mod_roll(h, inp[j], inp[j + n], a_pow)
    ix.next_j = last + 1
    return 0


cdef Py_ssize_t simple_draft_indexed(SimpleIndex* ix, const token_t* inp, Py_ssize_t L,
                                     token_t sampled, Py_ssize_t n, Py_ssize_t m,
                                     uint64_t a_pow, token_t* out) noexcept nogil:
    """simple_draft's result through the index; -1 when out of memory."""
    if L <= n + m + 1:
        return 0
    cdef Py_ssize_t last = L - n - 1, j, k, match = 0, copy_max
    cdef uint64_t h
    if ix.next_j > last + 1:                 # the context shrank without begin(): start over
        index_clear(ix)
    if index_extend(ix, inp, last, n, a_pow) < 0:
        return -1
    h = mod_step(mod_hash(inp + L - n + 1, n - 1), sampled)
    if ix.tab_size == 0:
        return 0
    k = tab_slot(h, ix.tab_size)
    while ix.tab_pos[k] >= 0 and ix.tab_hash[k] != h:
        k = (k + 1) & (ix.tab_size - 1)
    j = ix.tab_pos[k]
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

    Memory: with the index, per slot 4 bytes per context token plus a hash table of 24 to 48
    bytes per distinct n-gram (12-byte entries, at most half full); the scan needs nothing.

    Thread-safety: one thread per slot at a time (the index is per slot; a second call on a
    busy slot raises RuntimeError). Drafts that index
    many new positions (the first after begin) release the GIL.
    """
    cdef readonly Py_ssize_t size_n, size_m, min_hits
    cdef readonly bint indexed
    cdef uint64_t a_pow
    cdef SimpleIndex* index

    def __cinit__(self):
        self.index = NULL

    def __init__(self, size_n=12, size_m=48, min_hits=1, n_slots=1, indexed=True):
        cdef Py_ssize_t i
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
            self.index = <SimpleIndex*>alloc_per_slot(n_slots, sizeof(SimpleIndex),
                                                      "ngram-simple's index")
        except MemoryError:
            self.forget_slots()
            raise
        for i in range(n_slots):
            self.index[i].next_j = 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.index != NULL:
            for i in range(self.n_slots):
                index_free(&self.index[i])
            free(self.index)

    def memory_bytes(self):
        cdef Py_ssize_t i
        cdef size_t total = 0
        for i in range(self.n_slots):
            total += (self.index[i].cap * sizeof(int32_t)
                      + self.index[i].tab_size * (sizeof(int32_t) + sizeof(uint64_t)))
        return total

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        with nogil:
            index_clear(&self.index[slot])   # rebuilt lazily by the next draft
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef Py_ssize_t r
        cdef SimpleIndex* ix = &self.index[slot]
        if not self.indexed:
            if n > NOGIL_MIN_TOKENS:
                with nogil:
                    r = simple_draft(inp, n, sampled, self.size_n, self.size_m, out)
                return r
            return simple_draft(inp, n, sampled, self.size_n, self.size_m, out)
        if n - ix.next_j > NOGIL_MIN_TOKENS:
            with nogil:
                r = simple_draft_indexed(ix, inp, n, sampled, self.size_n, self.size_m,
                                         self.a_pow, out)
        else:
            r = simple_draft_indexed(ix, inp, n, sampled, self.size_n, self.size_m, self.a_pow,
                                     out)
        if r < 0:
            raise MemoryError("out of memory while indexing ngram-simple's context")
        return r

