# Helpers of the per-slot position indexes (ngram-simple's SimpleIndex, k4v's ScanIndex): an
# open-addressing table from an n-gram's hash to its newest position, plus a per-position chain
# `prev[j]` to the previous position with the same hash (-1 = none). The chain array is owned by
# its index, allocated with the kernels' allocator and freed with free(). Not thread-safe: an
# index belongs to one slot, which one thread uses at a time.
from libc.stdint cimport int32_t, uint64_t

from ngramspec._hash cimport mix64
from ngramspec._proposer cimport realloc


# The table entry to probe first for hash h (size: a power of two).
cdef inline Py_ssize_t tab_slot(uint64_t h, Py_ssize_t size) noexcept nogil:
    return <Py_ssize_t>(mix64(h) & <uint64_t>(size - 1))


# Room for position `last` in a per-position chain array (doubling, so appending one token at a
# time stays amortized O(1)). -1 when out of memory, the array left as it was.
cdef inline int grow_positions(int32_t** prev, Py_ssize_t* cap, Py_ssize_t last) noexcept nogil:
    cdef Py_ssize_t n = cap[0] * 2 if cap[0] * 2 > last + 1 else last + 1024
    cdef void* grown = realloc(prev[0], n * sizeof(int32_t))
    if grown == NULL:
        return -1
    prev[0] = <int32_t*>grown
    cap[0] = n
    return 0
