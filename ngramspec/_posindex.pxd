# The kernels' one position index, header-only (inline): every position i of a context, keyed
# by the hash of its n-gram inp[i : i+n] (common_ngram_mod's LCG, `mod_hash`), newest first.
# A HashTable (_hashtable.pxd) maps the hash to the newest position with it, and a chain
# `prev[i]` links each position to the previous one with the same hash (-1 = none). Used by
# ngram-simple (the match common_ngram_simple_draft's backward scan finds) and by
# ngram-map-k4v (the occurrences common_ngram_map_draft's statistics loop visits).
#
# A chain holds every position with the n-gram's table key (ht_key: 32 bits of the hash), so it
# may hold other n-grams' positions: users compare the tokens at each position, so the answer is
# exactly the scan's.
#
# Append-only context: positions are indexed in order (pos_extend) and stay valid while the
# context they were read from only grows, as llama-server's slot context does between two
# begin calls. When it may have changed (a new prompt, a shorter context), the owner calls
# pos_invalidate; the next pos_extend starts over from position 0.
#
# Ownership: a PosIndex owns its arrays (the kernels' allocator; pos_free releases them); a
# zeroed struct is a valid empty index. Thread-safety:
# none; an index belongs to one slot, which one thread uses at a time. No function takes the
# GIL, so long extensions may run without it.
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport free

from ngramspec._hash cimport mod_hash, mod_roll
from ngramspec._hashtable cimport (HashTable, ht_bytes, ht_clear, ht_fill, ht_find_value, ht_free,
                                   ht_key, ht_reserve, ht_slot)
from ngramspec._proposer cimport realloc
from ngramspec._types cimport token_t

cdef enum:
    POS_FIRST_TABLE = 4096     # entries of a position index's first hash table


cdef struct PosIndex:
    HashTable heads            # n-gram key -> newest position with it
    int32_t* prev              # prev[i]: the previous position with i's key, -1 = none
    Py_ssize_t cap             # room in prev
    Py_ssize_t next            # positions 0 .. next-1 are indexed (unless stale)
    bint stale                 # the indexed text may have changed: start over


# Positions indexed and still valid (0 when stale).
cdef inline Py_ssize_t pos_indexed(const PosIndex* x) noexcept nogil:
    return 0 if x.stale else x.next


cdef inline void pos_invalidate(PosIndex* x) noexcept nogil:
    x.stale = True


# Room for position `last` in prev (doubling, so appending one token at a time stays
# amortized O(1)). -1 when out of memory, the array left as it was.
cdef inline int pos_grow(PosIndex* x, Py_ssize_t last) noexcept nogil:
    cdef Py_ssize_t n = x.cap * 2 if x.cap * 2 > last + 1 else last + 1024
    cdef void* grown = realloc(x.prev, n * sizeof(int32_t))
    if grown == NULL:
        return -1
    x.prev = <int32_t*>grown
    x.cap = n
    return 0


# Index positions pos_indexed(x) .. last, whose n-grams must lie inside inp (last + n <= L).
# a_pow = mod_pow(n - 1), for the rolling update. -1 when out of memory: positions up to the
# failing one stay indexed.
cdef inline int pos_extend(PosIndex* x, const token_t* inp, Py_ssize_t last, Py_ssize_t n,
                           uint64_t a_pow) noexcept nogil:
    cdef Py_ssize_t i, k
    cdef uint64_t h
    cdef uint32_t key
    if x.stale:
        x.stale = False
        x.next = 0
        ht_clear(&x.heads)
    if last < x.next:
        return 0
    if last >= x.cap and pos_grow(x, last) < 0:
        return -1
    h = mod_hash(inp + x.next, n)
    for i in range(x.next, last + 1):
        if ht_reserve(&x.heads, POS_FIRST_TABLE) < 0:
            x.next = i
            return -1
        key = ht_key(h)
        k = ht_slot(&x.heads, key)
        if x.heads.e[k].value < 0:
            ht_fill(&x.heads, k, key, <int32_t>i)
            x.prev[i] = -1
        else:
            x.prev[i] = x.heads.e[k].value
            x.heads.e[k].value = <int32_t>i
        if i < last:
            h = mod_roll(h, inp[i], inp[i + n], a_pow)
    x.next = last + 1
    return 0


# The newest indexed position whose n-gram may have hash h (same table key), or -1; follow
# prev[] for older ones.
cdef inline int32_t pos_newest(const PosIndex* x, uint64_t h) noexcept nogil:
    return -1 if x.stale else ht_find_value(&x.heads, h)


cdef inline void pos_free(PosIndex* x) noexcept nogil:
    ht_free(&x.heads)
    free(x.prev)
    x.prev = NULL
    x.cap = 0


cdef inline size_t pos_bytes(const PosIndex* x) noexcept nogil:
    return <size_t>x.cap * sizeof(int32_t) + ht_bytes(&x.heads)
