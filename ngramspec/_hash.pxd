# The n-gram hashes of llama.cpp's proposers, defined once. Header-only (inline): every
# function is pure, reads only the tokens it is given, and is safe from any thread without the
# GIL. All arithmetic wraps around (uint64 / uint32), which is part of the specification: the
# same values as llama.cpp's, so the same table slots.
from libc.stdint cimport int64_t, uint32_t, uint64_t

from ngramspec._types cimport token_t


# common_ngram_mod's LCG polynomial hash: h = h * A + t (uint64), A = 6364136223846793005.
cdef inline uint64_t mod_step(uint64_t h, token_t t) noexcept nogil:
    return h * 6364136223846793005ULL + <uint64_t><int64_t>t


# The hash of t[0 : n] continued from h (h = 0: the hash of the n tokens alone).
cdef inline uint64_t extend_hash(uint64_t h, const token_t* t, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        h = mod_step(h, t[i])
    return h


# ngram-mod's hash of n tokens (as common_ngram_mod computes it for every key).
cdef inline uint64_t mod_hash(const token_t* t, Py_ssize_t n) noexcept nogil:
    return extend_hash(0, t, n)


# A^k mod 2**64: the weight of the oldest of k + 1 tokens, which the rolling update removes.
cdef inline uint64_t mod_pow(Py_ssize_t k) noexcept nogil:
    cdef uint64_t a = 1
    cdef Py_ssize_t i
    for i in range(k):
        a *= 6364136223846793005ULL
    return a


# The rolling update: with h = mod_hash(t[i : i+n]) and a_pow = mod_pow(n - 1),
# mod_roll(h, t[i], t[i+n], a_pow) == mod_hash(t[i+1 : i+n+1]) in O(1).
cdef inline uint64_t mod_roll(uint64_t h, token_t oldest, token_t newest,
                              uint64_t a_pow) noexcept nogil:
    return mod_step(h - <uint64_t><int64_t>oldest * a_pow, newest)


# common_ngram_map's key hash: h = h * 2654435761 + t (uint32).
cdef inline uint32_t map_step(uint32_t h, token_t t) noexcept nogil:
    return h * 2654435761U + <uint32_t>t


cdef inline uint32_t map_hash(const token_t* t, Py_ssize_t n) noexcept nogil:
    cdef uint32_t h = 0
    cdef Py_ssize_t i
    for i in range(n):
        h = map_step(h, t[i])
    return h


# splitmix64's finalizer: the LCG polynomial's low bits are weak, so the open-addressing tables
# mix a hash before they mask it.
cdef inline uint64_t mix64(uint64_t h) noexcept nogil:
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL
    return h ^ (h >> 31)
