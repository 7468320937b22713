# The kernels' one open-addressing hash table: an n-gram's 64-bit hash to one int32 value (a
# position or a record index), header-only (inline). Used by the position index
# (_posindex.pxd: ngram-simple's match index, ngram-map-k4v's statistics index) and by
# ngram-map's key lookup (_map.pyx).
#
# Keys: ht_key(h), 32 bits of the mixed hash (splitmix64's finalizer, as the LCG hashes' low
# bits are weak), in 8-byte entries: half the memory traffic of a 64-bit key, and a table
# that doubles re-places its entries without hashing them again. Two n-grams may share a key:
# every user compares the tokens of what it finds (a shared key costs a longer walk or
# llama.cpp's own linear search, never another draft), so the lookup order llama.cpp's
# bit-exact drafts need is kept by the users, not by the table.
# Probing: linear, from key & (size - 1); size is a power of two, at least twice the number of
# keys, so a probe always ends at an empty entry. Keys are never removed (ht_clear empties the
# whole table).
#
# Ownership: a HashTable owns its entry array (the kernels' allocator; freed by ht_free). A
# zeroed struct is a valid empty table (size 0: ht_find_value answers "absent"; ht_reserve
# allocates the first array). Thread-safety: none; a table belongs to one slot, which one
# thread uses at a time (see _proposer.pxd). No function takes the GIL.
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memset

from ngramspec._hash cimport mix64
from ngramspec._proposer cimport malloc

cdef struct HEntry:
    uint32_t key               # ht_key(h)
    int32_t value              # -1 = empty entry (every stored value is >= 0)

cdef struct HashTable:
    HEntry* e                  # size entries; NULL while size is 0
    Py_ssize_t size            # 0 or a power of two
    Py_ssize_t used            # keys stored; 2 * used <= size


# The table key of hash h: 32 bits of its mix.
cdef inline uint32_t ht_key(uint64_t h) noexcept nogil:
    return <uint32_t>(mix64(h) >> 32)


# The entry holding `key` (= ht_key(h)), or the empty entry where it would go (size > 0).
cdef inline Py_ssize_t ht_slot(const HashTable* t, uint32_t key) noexcept nogil:
    cdef Py_ssize_t mask = t.size - 1
    cdef Py_ssize_t k = <Py_ssize_t>(key & <uint32_t>mask)
    while t.e[k].value >= 0 and t.e[k].key != key:
        k = (k + 1) & mask
    return k


# The value stored for hash h, or -1.
cdef inline int32_t ht_find_value(const HashTable* t, uint64_t h) noexcept nogil:
    if t.size == 0:
        return -1
    return t.e[ht_slot(t, ht_key(h))].value


# Room for one more key: doubles the table (first size `first_size`, a power of two) when it
# would be more than half full. -1 when out of memory, the table left as it was.
cdef inline int ht_reserve(HashTable* t, Py_ssize_t first_size) noexcept nogil:
    cdef Py_ssize_t size, i, k
    cdef HEntry* e
    if 2 * (t.used + 1) <= t.size:
        return 0
    size = t.size * 2 if t.size else first_size
    e = <HEntry*>malloc(size * sizeof(HEntry))
    if e == NULL:
        return -1
    memset(e, 0xFF, size * sizeof(HEntry))
    for i in range(t.size):                  # keys are distinct: no comparison needed
        if t.e[i].value >= 0:
            k = <Py_ssize_t>(t.e[i].key & <uint32_t>(size - 1))
            while e[k].value >= 0:
                k = (k + 1) & (size - 1)
            e[k] = t.e[i]
    free(t.e)
    t.e = e
    t.size = size
    return 0


# Store `value` (>= 0) under `key` (= ht_key(h)) in entry k, found empty by ht_slot(t, key)
# after ht_reserve.
cdef inline void ht_fill(HashTable* t, Py_ssize_t k, uint32_t key, int32_t value) noexcept nogil:
    t.e[k].key = key
    t.e[k].value = value
    t.used += 1


# Every key removed; the array is kept for reuse.
cdef inline void ht_clear(HashTable* t) noexcept nogil:
    t.used = 0
    if t.e != NULL:
        memset(t.e, 0xFF, t.size * sizeof(HEntry))


cdef inline void ht_free(HashTable* t) noexcept nogil:
    free(t.e)
    t.e = NULL
    t.size = 0
    t.used = 0


cdef inline size_t ht_bytes(const HashTable* t) noexcept nogil:
    return <size_t>t.size * sizeof(HEntry)
