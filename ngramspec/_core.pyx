# cython: language_level=3
"""Kernels of llama.cpp's draftless proposers and the engine that chains them.

Two layers per proposer (house style): a C struct with the state plus free ``noexcept nogil``
functions over raw token pointers, and a thin ``cdef class`` that owns the memory. The engine
(`Engine`) validates every argument once, then calls the kernels through `Proposer`'s cdef
methods. The behaviour is llama.cpp's at commit 3ce7da2c (b10102), quirks included: the
comments name the llama.cpp functions each kernel reproduces (``common/ngram-map.cpp``,
``common/ngram-mod.cpp``, ``common/speculative.cpp``).
"""
import operator

import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsLongLong, PyLong_AsSsize_t, PyLong_CheckExact
from cpython.ref cimport PyObject
from libc.stdint cimport int16_t, int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcmp, memcpy, memmove, memset
from posix.mman cimport (MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap,
                         munmap)
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cnp.import_array()

# The pool's lock is taken twice per ngram-mod draft: a pthread mutex costs a few ns
# uncontended, where CPython's PyThread lock also reads the clock for a zero timeout.
cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_trylock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)

cdef extern from "<sys/mman.h>" nogil:
    """
    #ifndef MADV_HUGEPAGE
    #define MADV_HUGEPAGE 14
    #endif
    """
    int madvise(void*, size_t, int)
    int MADV_HUGEPAGE

# Python-visible constants: token ids are llama.cpp's llama_token (int32), never negative.
TOKEN_MAX = 2147483647
DEF TOKEN_MAX_C = 2147483647
cdef uint64_t MOD_LCG_A = 6364136223846793005ULL     # common_ngram_mod's hash multiplier
cdef uint32_t MAP_HASH_A = 2654435761U               # common_ngram_map's key hash
DEF MAP_INDEX_SIZE = 262144                          # 2**18 uint32 slots per ngram-map slot
DEF MAP_INDEX_MASK = 262143
DEF MAP_MAX_VALUES = 4
DEF MAP_MAX_COUNT = 16380
# Kernels whose work exceeds this many tokens release the GIL (below it the release costs more
# than it buys).
DEF NOGIL_MIN_TOKENS = 4096


cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


# The statistics' timers run on every call: on x86 they read the TSC (about 10 ns here, against
# 22 ns for a vDSO clock_gettime, two per call), converted to ns when stats() is read, from the
# ticks and ns elapsed since import. Elsewhere the ticks are clock_gettime's ns.
cdef extern from *:
    """
    #if defined(__x86_64__) || defined(__i386__)
    #include <x86intrin.h>
    static inline unsigned long long ngs_ticks(void) { return __rdtsc(); }
    #define NGS_TICKS_ARE_NS 0
    #else
    #include <time.h>
    static inline unsigned long long ngs_ticks(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
    }
    #define NGS_TICKS_ARE_NS 1
    #endif
    """
    uint64_t ngs_ticks() noexcept nogil
    bint NGS_TICKS_ARE_NS

cdef uint64_t TICKS_AT_IMPORT = ngs_ticks()
cdef int64_t NS_AT_IMPORT = now_ns()


cdef inline int64_t ticks_since(uint64_t t0) noexcept nogil:
    """Ticks since t0; 0 if the counter went back (a thread moved to a core whose TSC lags)."""
    cdef uint64_t t = ngs_ticks()
    return <int64_t>(t - t0) if t > t0 else 0


cdef double ns_per_tick():
    cdef uint64_t dt
    if NGS_TICKS_ARE_NS:
        return 1.0
    dt = ngs_ticks() - TICKS_AT_IMPORT
    return (now_ns() - NS_AT_IMPORT) / <double>dt if dt > 0 else 1.0


# --------------------------------------------------------------------------------------------
# Argument validation (the one boundary every public entry goes through)
# --------------------------------------------------------------------------------------------

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


def _tokens_slow(obj, str name):
    """Convert any 1-D integer array-like to a C-contiguous int32 array, or raise."""
    try:
        arr = np.asarray(obj)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a 1-D sequence of integer token ids ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int32)
    if (arr.dtype.kind == "O" or arr.dtype.kind == "f" and isinstance(obj, (list, tuple))) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in obj):
        # ints too large for int64 / uint64: numpy makes an object array of them, or (numpy 2,
        # ints in [2**63, 2**64) mixed with small ones) a float64 array
        for pos, v in enumerate(obj):
            if v < 0 or v > TOKEN_MAX:
                raise ValueError(f"{name}[{pos}] = {v} is not a token id: ids must be in "
                                 f"0 .. {TOKEN_MAX}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    lo = int(arr.min())
    hi = int(arr.max())
    if lo < 0 or hi > TOKEN_MAX:
        bad = lo if lo < 0 else hi
        pos = int(np.flatnonzero(arr == bad)[0])
        raise ValueError(f"{name}[{pos}] = {bad} is not a token id: ids must be in 0 .. {TOKEN_MAX}")
    # ascontiguousarray keeps a misaligned int32 buffer as it is: the kernels need int32
    # alignment (C's rules; vectorized loops may assume it)
    return np.require(arr, np.int32, ("C", "A"))


cdef cnp.ndarray as_tokens(object obj, str name, Py_ssize_t skip=0):
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
        if skip > n or skip < 0:
            skip = 0
        bad = first_negative(<const token_t*>cnp.PyArray_DATA(arr) + skip, n - skip)
        if bad >= 0:
            bad += skip
            raise ValueError(f"{name}[{bad}] = {arr[bad]} is not a token id: ids must be in "
                             f"0 .. {TOKEN_MAX}")
        return arr
    return _tokens_slow(obj, name)


cdef inline object buffer_owner(cnp.ndarray arr):
    """The array's base object (the buffer a view such as ``buf[:L]`` looks into), or the
    array itself; C-level, no attribute lookups."""
    cdef PyObject* base = cnp.PyArray_BASE(arr)
    return <object>base if base != NULL else arr


cdef inline const token_t* tok_ptr(cnp.ndarray arr) noexcept:
    return <const token_t*>cnp.PyArray_DATA(arr)


cdef token_t as_token(object value, str name) except? -1:
    cdef long long v
    if exact_int_in(value, 0, TOKEN_MAX_C, &v):
        return <token_t>v
    if PyLong_CheckExact(value):
        try:
            v = PyLong_AsLongLong(value)
        except OverflowError:
            raise ValueError(f"{name} = {value} is not a token id: ids must be in "
                             f"0 .. {TOKEN_MAX}") from None
    else:
        try:
            w = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer token id, got "
                            f"{type(value).__name__}") from None
        if w < 0 or w > TOKEN_MAX:
            raise ValueError(f"{name} = {w} is not a token id: ids must be in 0 .. {TOKEN_MAX}")
        v = w
    if v < 0 or v > TOKEN_MAX:
        raise ValueError(f"{name} = {v} is not a token id: ids must be in 0 .. {TOKEN_MAX}")
    return <token_t>v


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


def check_int(name, value, lo, hi=None):
    """Validate an integer parameter against llama.cpp's range; return it as int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo} .. {hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} = {value} is out of range: allowed {rng}")
    return value


# --------------------------------------------------------------------------------------------
# Proposer base classes
# --------------------------------------------------------------------------------------------

cdef class Proposer:
    """Base class of every proposer the engine chains.

    Subclasses implement the ``c_begin`` / ``c_draft`` / ``c_accept`` cdef methods (Cython) or,
    through `PyProposer`, ``on_begin`` / ``on_draft`` / ``on_accept`` (Python). Use a proposer
    through `Engine`, which validates the arguments and keeps llama.cpp's statistics.

    Memory: the base class holds nothing per slot; each subclass documents its own.

    Thread-safety: per-slot state may be used by one thread per slot at a time; state shared
    across slots is documented by each subclass.
    """

    def __init__(self, str name, Py_ssize_t n_slots, Py_ssize_t max_draft):
        if n_slots < 1:
            raise ValueError(f"n_slots = {n_slots} is out of range: allowed >= 1")
        if max_draft < 1:
            raise ValueError(f"max_draft = {max_draft} is out of range: allowed >= 1")
        self.name = name
        self.n_slots = n_slots
        self.max_draft = max_draft

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        return 0

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        return 0

    def memory_bytes(self):
        """Bytes of memory this proposer holds (all slots; a shared ModPool not included)."""
        return 0

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} n_slots={self.n_slots}>"


cdef class PyProposer(Proposer):
    """A proposer written in Python (e.g. a draft model).

    Override ``on_begin(slot, prompt)``, ``on_draft(slot, inp, sampled) -> sequence of ids`` and
    ``on_accept(slot, n_accepted, is_other)``. ``prompt`` and ``inp`` are fresh int32 copies the
    method may keep. A draft longer than ``max_draft`` raises ValueError.

    Memory: whatever the subclass keeps; the wrapper itself holds nothing per slot.

    Thread-safety: the ``on_*`` methods run with the GIL held; one thread per slot at a time.
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
EMPTY_DRAFT = np.empty(0, dtype=np.int32)
EMPTY_DRAFT.setflags(write=False)
cdef cnp.ndarray EMPTY = EMPTY_DRAFT         # the same, without a module-dict lookup


cdef cnp.ndarray copy_tokens(const token_t* t, Py_ssize_t n):
    cdef cnp.npy_intp dims = n
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNew(1, &dims, cnp.NPY_INT32)
    if n:
        memcpy(cnp.PyArray_DATA(arr), t, n * sizeof(token_t))
    return arr


cdef inline uint64_t mod_hash(const token_t* t, Py_ssize_t n) noexcept nogil:
    """ngram-mod's LCG polynomial hash of n tokens (uint64 wraparound, as common_ngram_mod)."""
    cdef uint64_t h = 0
    cdef Py_ssize_t i
    for i in range(n):
        h = h * MOD_LCG_A + <uint64_t><int64_t>t[i]
    return h


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


cdef inline Py_ssize_t tab_slot(uint64_t h, Py_ssize_t size) noexcept nogil:
    # The LCG polynomial's low bits are weak: mix before masking (splitmix64's finalizer).
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL
    return <Py_ssize_t>((h ^ (h >> 31)) & <uint64_t>(size - 1))


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


cdef int grow_positions(int32_t** prev, Py_ssize_t* cap, Py_ssize_t last) noexcept nogil:
    """Room for position `last` in a per-position chain array (doubling, so appending one
    token at a time stays amortized O(1)). -1 when out of memory, the array left as it was."""
    cdef Py_ssize_t n = cap[0] * 2 if cap[0] * 2 > last + 1 else last + 1024
    cdef void* grown = realloc(prev[0], n * sizeof(int32_t))
    if grown == NULL:
        return -1
    prev[0] = <int32_t*>grown
    cap[0] = n
    return 0


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
            h = (h - <uint64_t><int64_t>inp[j] * a_pow) * MOD_LCG_A + <uint64_t><int64_t>inp[j + n]
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
    h = mod_hash(inp + L - n + 1, n - 1) * MOD_LCG_A + <uint64_t><int64_t>sampled
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

    Thread-safety: one thread per slot at a time (the index is per slot). Drafts that index
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
        self.size_n = check_int("size_n", size_n, 1, 1024)
        self.size_m = check_int("size_m", size_m, 1, 1024)
        self.min_hits = check_int("min_hits", min_hits, 1)
        Proposer.__init__(self, "ngram-simple", n_slots, self.size_m)
        self.indexed = bool(indexed)
        self.a_pow = 1
        for i in range(self.size_n - 1):
            self.a_pow *= MOD_LCG_A
        self.index = <SimpleIndex*>calloc(n_slots, sizeof(SimpleIndex))
        if self.index == NULL:
            raise MemoryError()
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
            raise MemoryError()
        return r


# --------------------------------------------------------------------------------------------
# ngram-map-k / ngram-map-k4v (common_ngram_map_begin / _draft / _accept)
# --------------------------------------------------------------------------------------------

# k4v's statistics scan visits every earlier position from the key's stat_idx to the match:
# O(L) for each newly matched key, llama.cpp's cost at long contexts. Scans of at least
# STAT_INDEX_MIN positions go through a per-slot ScanIndex instead: chains of the positions of
# each n-gram (by a 32-bit tag of its hash, newest first), so a scan visits only the key's
# occurrences (checked against the text), in the same ascending order. The index is built lazily: a scan indexes at most as many new positions as it
# covers and scans the rest linearly, so no call costs more than about twice the plain scan.
# Once built, it also serves the shorter scans (16 positions or more) over indexed positions.
# begin() on a prompt of STAT_INDEX_MIN tokens or more indexes the prompt (without the GIL).
# STAT_INDEX_MIN is MapProposer's default `stat_index_min` (tests lower it).
DEF STAT_INDEX_MIN = 2048

cdef struct ScanSlot:
    int32_t pos                # newest position of the n-grams with this tag; -1 = empty
    uint32_t tag               # 32 bits of the n-gram's 64-bit hash (they also pick the slot)

cdef struct ScanIndex:
    Py_ssize_t next_i          # positions 0 .. next_i-1 are indexed
    Py_ssize_t cap             # room in prev
    int32_t* prev              # prev[i]: the previous position with i's tag, -1 = none
    ScanSlot* tab              # open addressing on the tag; a power of two entries, at least
    Py_ssize_t tab_size        # twice tab_used. Different n-grams sharing a tag share a chain:
    Py_ssize_t tab_used        # the scan checks every position's text, so it stays exact
    int32_t* hits              # scratch: one scan's occurrences, newest first
    Py_ssize_t hits_cap
    bint stale                 # clear before the next use (begin, or the context shrank)


cdef void scan_free(ScanIndex* x) noexcept nogil:
    free(x.prev)
    free(x.tab)
    free(x.hits)


cdef inline uint32_t scan_tag(uint64_t h) noexcept nogil:
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL   # see tab_slot
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL
    return <uint32_t>((h ^ (h >> 31)) >> 32)


cdef inline Py_ssize_t scan_find(ScanIndex* x, uint32_t tag) noexcept nogil:
    """The table entry of `tag`, or the empty entry where it would go."""
    cdef Py_ssize_t k = tag & (x.tab_size - 1)
    while x.tab[k].pos >= 0 and x.tab[k].tag != tag:
        k = (k + 1) & (x.tab_size - 1)
    return k


cdef int scan_grow_table(ScanIndex* x) noexcept nogil:
    cdef Py_ssize_t size = x.tab_size * 2 if x.tab_size else 4096, i, k
    cdef ScanSlot* tab = <ScanSlot*>malloc(size * sizeof(ScanSlot))
    if tab == NULL:
        return -1
    memset(tab, 0xFF, size * sizeof(ScanSlot))
    for i in range(x.tab_size):              # distinct tags: no comparison needed
        if x.tab[i].pos >= 0:
            k = x.tab[i].tag & (size - 1)
            while tab[k].pos >= 0:
                k = (k + 1) & (size - 1)
            tab[k] = x.tab[i]
    free(x.tab)
    x.tab = tab
    x.tab_size = size
    return 0


cdef int scan_extend(ScanIndex* x, const token_t* inp, Py_ssize_t last, Py_ssize_t n,
                     uint64_t a_pow) noexcept nogil:
    """Index positions next_i .. last (their n-grams must lie inside inp). -1: out of memory."""
    cdef Py_ssize_t i, k
    cdef uint64_t h
    cdef uint32_t tag
    if x.stale:
        x.stale = False
        x.next_i = 0
        x.tab_used = 0
        if x.tab != NULL:
            memset(x.tab, 0xFF, x.tab_size * sizeof(ScanSlot))
    if last < x.next_i:
        return 0
    if last >= x.cap and grow_positions(&x.prev, &x.cap, last) < 0:
        return -1
    h = mod_hash(inp + x.next_i, n)
    for i in range(x.next_i, last + 1):
        if 2 * (x.tab_used + 1) > x.tab_size:
            if scan_grow_table(x) < 0:
                x.next_i = i
                return -1
        tag = scan_tag(h)
        k = scan_find(x, tag)
        if x.tab[k].pos < 0:
            x.tab[k].tag = tag
            x.tab_used += 1
        x.prev[i] = x.tab[k].pos
        x.tab[k].pos = <int32_t>i
        if i < last:
            h = (h - <uint64_t><int64_t>inp[i] * a_pow) * MOD_LCG_A + <uint64_t><int64_t>inp[i + n]
    x.next_i = last + 1
    return 0


cdef struct MapValue:
    size_t value_idx           # start of this m-gram in inp; 0 = unused
    uint16_t value_num         # occurrences, saturating at 16380
    int16_t n_accepted         # accepted tokens the last time this value drafted

cdef struct MapKey:
    size_t key_idx             # position of the occurrence that created the key
    size_t stat_idx            # k4v statistics scanned up to here (inclusive)
    uint16_t key_num           # draft calls in which this key matched
    MapValue values[MAP_MAX_VALUES]

cdef struct MapParams:
    Py_ssize_t n
    Py_ssize_t m
    bint key_only
    Py_ssize_t min_hits
    bint reindex
    uint64_t a_pow             # A^(n-1) mod 2^64, to slide the ScanIndex's hash
    Py_ssize_t stat_index_min  # k4v scans this long or longer use the ScanIndex

cdef struct MapState:
    MapKey* keys               # append-only list, erased from only by begin's cleanup
    size_t n_keys
    size_t cap_keys
    size_t size_last_begin     # S
    bint last_draft_created
    size_t last_draft_key_idx
    uint16_t last_draft_value_idx
    size_t idx_last_check
    uint32_t* key_map          # MAP_INDEX_SIZE positions; 0 = empty
    uint32_t key_map_last_idx  # K
    # Lookup of key records by text, replacing llama.cpp's linear search (same result): the
    # smallest key index per 64-bit hash of the key's text. Rebuilt after begin(), since a new
    # prompt changes the text found at each key_idx.
    uint64_t* kt_hash
    int64_t* kt_idx            # -1 = empty entry
    Py_ssize_t kt_size         # a power of two, at least twice kt_used
    Py_ssize_t kt_used
    bint kt_stale              # rebuild before the next lookup
    bint kt_linear             # some key's text lies past the context: search linearly
    # reindex option: fingerprint of the context seen so far, to tell an extension from a new
    # prompt at begin()
    uint64_t seen_hash
    size_t seen_len
    ScanIndex scan             # k4v's statistics scan (see stat_scan)


cdef inline uint32_t map_hash(const token_t* t, Py_ssize_t n) noexcept nogil:
    cdef uint32_t h = 0
    cdef Py_ssize_t i
    for i in range(n):
        h = h * MAP_HASH_A + <uint32_t>t[i]      # uint32 wraparound is the spec
    return h


cdef inline bint map_key_at(const token_t* inp, Py_ssize_t L, Py_ssize_t j, Py_ssize_t n,
                            token_t sampled) noexcept nogil:
    """inp[j : j+n] == inp[L-n+1 : L] + [sampled]; False where the window leaves inp."""
    if j < 0 or j + n > L:
        return False
    return inp[j + n - 1] == sampled and memcmp(inp + j, inp + L - n + 1,
                                                (n - 1) * sizeof(token_t)) == 0


cdef inline void map_index(MapState* s, const token_t* inp, Py_ssize_t j, Py_ssize_t n) noexcept nogil:
    cdef uint32_t h = map_hash(inp + j, n) & MAP_INDEX_MASK
    if s.key_map[h] == 0:                    # first writer wins
        s.key_map[h] = <uint32_t>j


cdef inline void map_erase_key(MapState* s, size_t i) noexcept nogil:
    memmove(s.keys + i, s.keys + i + 1, (s.n_keys - i - 1) * sizeof(MapKey))
    s.n_keys -= 1


cdef Py_ssize_t keytab_find(MapState* s, uint64_t h) noexcept nogil:
    cdef Py_ssize_t k
    if s.kt_size == 0:
        return -1
    k = tab_slot(h, s.kt_size)
    while s.kt_idx[k] >= 0:
        if s.kt_hash[k] == h:
            return <Py_ssize_t>s.kt_idx[k]
        k = (k + 1) & (s.kt_size - 1)
    return -1


cdef int keytab_insert(MapState* s, uint64_t h, int64_t idx) noexcept nogil:
    """Add (h -> idx) unless h is present (the smallest index stays). -1: out of memory."""
    cdef Py_ssize_t k, size, i
    cdef uint64_t* th
    cdef int64_t* ti
    if 2 * (s.kt_used + 1) > s.kt_size:
        size = s.kt_size * 2 if s.kt_size else 256
        th = <uint64_t*>malloc(size * sizeof(uint64_t))
        ti = <int64_t*>malloc(size * sizeof(int64_t))
        if th == NULL or ti == NULL:
            free(th)
            free(ti)
            return -1
        memset(ti, 0xFF, size * sizeof(int64_t))
        for i in range(s.kt_size):
            if s.kt_idx[i] >= 0:
                k = tab_slot(s.kt_hash[i], size)
                while ti[k] >= 0:
                    k = (k + 1) & (size - 1)
                th[k] = s.kt_hash[i]
                ti[k] = s.kt_idx[i]
        free(s.kt_hash)
        free(s.kt_idx)
        s.kt_hash = th
        s.kt_idx = ti
        s.kt_size = size
    k = tab_slot(h, s.kt_size)
    while s.kt_idx[k] >= 0:
        if s.kt_hash[k] == h:
            return 0
        k = (k + 1) & (s.kt_size - 1)
    s.kt_hash[k] = h
    s.kt_idx[k] = idx
    s.kt_used += 1
    return 0


cdef int keytab_rebuild(MapState* s, const token_t* inp, Py_ssize_t L, Py_ssize_t n) noexcept nogil:
    cdef size_t i
    s.kt_used = 0
    s.kt_linear = False
    s.kt_stale = False
    if s.kt_idx != NULL:
        memset(s.kt_idx, 0xFF, s.kt_size * sizeof(int64_t))
    for i in range(s.n_keys):
        if <Py_ssize_t>s.keys[i].key_idx + n > L:
            s.kt_linear = True               # its text is not there yet: rare, stay exact
            return 0
        if keytab_insert(s, mod_hash(inp + s.keys[i].key_idx, n), i) < 0:
            return -1
    return 0


cdef void map_clear(MapState* s) noexcept nogil:
    """Back to a new map (what a fresh speculative context has), keeping the allocations."""
    memset(s.key_map, 0, MAP_INDEX_SIZE * sizeof(uint32_t))
    s.n_keys = 0
    s.key_map_last_idx = 0
    s.size_last_begin = 0
    s.idx_last_check = 0
    s.last_draft_created = False
    s.kt_stale = True


cdef inline uint64_t extend_hash(uint64_t h, const token_t* t, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        h = h * MOD_LCG_A + <uint64_t><int64_t>t[i]
    return h


cdef void map_track(MapState* s, const token_t* inp, size_t L) noexcept nogil:
    """Fold the context's new tokens into the fingerprint (append-only between begins)."""
    if L > s.seen_len:
        s.seen_hash = extend_hash(s.seen_hash, inp + s.seen_len, L - s.seen_len)
        s.seen_len = L


cdef void map_begin_reindex(MapState* s, const token_t* prompt, size_t size_begin) noexcept nogil:
    """The reindex option: a prompt that does not extend the context seen so far starts the
    slot's map afresh, instead of keeping stale entries and skipping positions <= K."""
    if s.seen_len > 0 and (size_begin < s.seen_len or
                           extend_hash(0, prompt, s.seen_len) != s.seen_hash):
        map_clear(s)
    s.seen_hash = extend_hash(0, prompt, size_begin)
    s.seen_len = size_begin


cdef void map_begin(MapState* s, const MapParams* p, size_t size_begin) noexcept nogil:
    cdef size_t n = p.n, m = p.m
    cdef size_t cleanup = s.size_last_begin
    cdef Py_ssize_t i, j, k
    cdef MapKey* key
    if cleanup > size_begin:                 # the prompt shrank below the previous prompt
        cleanup = size_begin - n - m if size_begin > n + m else 0
    if size_begin < s.idx_last_check:        # history rewritten: drop what lies past cleanup
        for k in range(MAP_INDEX_SIZE):
            if s.key_map[k] != 0 and s.key_map[k] >= cleanup:
                s.key_map[k] = 0
        s.key_map_last_idx = <uint32_t>(cleanup - 1) if cleanup > 0 else 0
        i = <Py_ssize_t>s.n_keys - 1
        while i >= 0:
            key = &s.keys[i]
            if key.key_idx >= cleanup:
                map_erase_key(s, i)
                i -= 1
                continue
            if not p.key_only:
                for j in range(MAP_MAX_VALUES - 1, -1, -1):
                    if key.values[j].value_idx != 0 and key.values[j].value_idx >= cleanup:
                        for k in range(j, MAP_MAX_VALUES - 1):
                            key.values[k] = key.values[k + 1]
                        # n_accepted of the last record is kept, as in llama.cpp
                        key.values[MAP_MAX_VALUES - 1].value_idx = 0
                        key.values[MAP_MAX_VALUES - 1].value_num = 0
                if key.values[0].value_idx == 0:
                    map_erase_key(s, i)
            i -= 1
    s.idx_last_check = size_begin
    s.size_last_begin = size_begin
    s.last_draft_created = False
    s.kt_stale = True


cdef inline void stat_count(MapKey* ck, const token_t* inp, Py_ssize_t L, size_t i,
                            Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    """Count the m-gram after the key's occurrence at i in the key's value records."""
    cdef int v, iv = -1
    for v in range(MAP_MAX_VALUES):
        if ck.values[v].value_idx == 0:
            ck.values[v].value_idx = i + n
            ck.values[v].value_num = 0
            ck.values[v].n_accepted = <int16_t>m
            iv = v
            break
        if (ck.values[v].value_idx + m <= <size_t>L and
                memcmp(inp + i + n, inp + ck.values[v].value_idx, m * sizeof(token_t)) == 0):
            iv = v
            break
    if iv >= 0 and ck.values[iv].value_num < MAP_MAX_COUNT:
        ck.values[iv].value_num += 1


cdef int stat_scan(MapKey* ck, ScanIndex* x, const MapParams* p, const token_t* inp,
                   Py_ssize_t L, Py_ssize_t match, token_t sampled) noexcept nogil:
    """k4v's statistics over the key's occurrences at stat_idx .. match (inclusive: the
    previous match is counted again), in ascending order. -1: out of memory."""
    cdef Py_ssize_t n = p.n, lo = <Py_ssize_t>ck.stat_idx, hi = match, i, j, top, cnt = 0
    cdef Py_ssize_t span = hi - lo + 1, indexed
    cdef void* grown
    indexed = 0 if x.stale else x.next_i
    # long scans build the index; once built, shorter scans over indexed positions use it too
    if span >= p.stat_index_min or (lo < indexed and span >= 16):
        if indexed <= hi and scan_extend(x, inp, min(hi, indexed - 1 + span), n, p.a_pow) < 0:
            return -1
        if lo < x.next_i:
            top = min(hi, x.next_i - 1)
            j = x.tab[scan_find(x, scan_tag(mod_hash(inp + match, n)))].pos
            while j >= lo:                   # newest first; kept to be counted oldest first
                if j <= top and map_key_at(inp, L, j, n, sampled):
                    if cnt == x.hits_cap:
                        grown = realloc(x.hits, (x.hits_cap * 2 + 64) * sizeof(int32_t))
                        if grown == NULL:
                            return -1
                        x.hits = <int32_t*>grown
                        x.hits_cap = x.hits_cap * 2 + 64
                    x.hits[cnt] = <int32_t>j
                    cnt += 1
                j = x.prev[j]
            for i in range(cnt - 1, -1, -1):
                stat_count(ck, inp, L, x.hits[i], n, p.m)
            lo = top + 1
    for i in range(lo, hi + 1):
        if map_key_at(inp, L, i, n, sampled):
            stat_count(ck, inp, L, i, n, p.m)
    return 0


cdef Py_ssize_t map_draft(MapState* s, const MapParams* p, const token_t* inp, Py_ssize_t L,
                          token_t sampled, token_t* out) noexcept nogil:
    """Returns the draft length, or -1 when the key list could not grow (out of memory)."""
    cdef Py_ssize_t n = p.n, m = p.m
    cdef Py_ssize_t S, K, j, top, match = 0, last_pos, cnt
    cdef size_t off, i, v
    cdef uint32_t idx
    cdef MapKey* ck
    cdef MapKey* grown
    cdef uint64_t key_hash
    cdef Py_ssize_t found
    cdef int iv, slot_max
    cdef uint16_t max_occur
    cdef uint32_t sum_occur
    s.last_draft_created = False
    s.last_draft_key_idx = 0
    s.last_draft_value_idx = 0
    if L < 2 * n + m:                        # nothing else is updated in this case
        return 0
    s.idx_last_check = L
    S = <Py_ssize_t>s.size_last_begin
    K = <Py_ssize_t>s.key_map_last_idx
    last_pos = L - n - m - 1                 # the last candidate whose m-gram lies inside inp

    # (a) lookup: hash index, then the positions not yet indexed (range A, then range B).
    # Range A is clamped to last_pos so a context shorter than the prompt stays in bounds.
    idx = s.key_map[(map_hash(inp + L - n + 1, n - 1) * MAP_HASH_A + <uint32_t>sampled)
                    & MAP_INDEX_MASK]
    if idx != 0 and idx < last_pos and map_key_at(inp, L, idx, n, sampled):
        match = idx
    top = S - n - m - 1 if S - n - m - 1 < last_pos else last_pos
    if match == 0 and S > n + m + 1:
        j = top
        while j > K:
            if map_key_at(inp, L, j, n, sampled):
                match = j
                break
            j -= 1
    if match == 0:
        j = last_pos
        while j > S and j > K:
            if map_key_at(inp, L, j, n, sampled):
                match = j
                break
            j -= 1

    # (b) index maintenance over the same ranges, descending, first writer wins
    if S > n + m + 1:
        j = top
        while j > K:
            map_index(s, inp, j, n)
            j -= 1
    j = last_pos
    while j > S and j > K:
        map_index(s, inp, j, n)
        j -= 1
    if <uint32_t>last_pos > s.key_map_last_idx:
        s.key_map_last_idx = <uint32_t>last_pos
    if match == 0:
        return 0

    # (c) the key's statistics record: first key whose text (read at key_idx) equals the key
    if s.kt_stale:
        if keytab_rebuild(s, inp, L, n) < 0:
            return -1
    key_hash = mod_hash(inp + L - n + 1, n - 1) * MOD_LCG_A + <uint64_t><int64_t>sampled
    found = -1 if s.kt_linear else keytab_find(s, key_hash)
    if found >= 0 and map_key_at(inp, L, <Py_ssize_t>s.keys[found].key_idx, n, sampled):
        off = found
    elif found < 0 and not s.kt_linear:
        off = s.n_keys                       # no key has this text
    else:                                    # a 64-bit collision, or kt_linear: llama.cpp's search
        off = 0
        while off < s.n_keys:
            if map_key_at(inp, L, <Py_ssize_t>s.keys[off].key_idx, n, sampled):
                break
            off += 1
    if off == s.n_keys:
        if s.n_keys == s.cap_keys:
            grown = <MapKey*>realloc(s.keys, (s.cap_keys * 2 + 16) * sizeof(MapKey))
            if grown == NULL:
                return -1
            s.keys = grown
            s.cap_keys = s.cap_keys * 2 + 16
        ck = &s.keys[s.n_keys]
        s.n_keys += 1
        ck.key_idx = match
        ck.stat_idx = 0
        ck.key_num = 0
        for v in range(MAP_MAX_VALUES):
            ck.values[v].value_idx = 0
            ck.values[v].value_num = 0
            ck.values[v].n_accepted = <int16_t>m
        if not s.kt_linear and keytab_insert(s, key_hash, off) < 0:
            return -1
    ck = &s.keys[off]
    if ck.key_num < MAP_MAX_COUNT:
        ck.key_num += 1

    slot_max = 0
    if not p.key_only:                       # (d2) ngram-map-k4v: values seen after the key
        if ck.key_num < p.min_hits:
            return 0
        if stat_scan(ck, &s.scan, p, inp, L, match, sampled) < 0:
            return -1
        ck.stat_idx = match
        max_occur = 0
        for v in range(MAP_MAX_VALUES):
            if ck.values[v].value_num > max_occur:
                max_occur = ck.values[v].value_num
                slot_max = v
        sum_occur = 0
        for v in range(MAP_MAX_VALUES):
            if v != <size_t>slot_max:
                sum_occur += ck.values[v].value_num
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return 0
    # (d1/d2) the draft is always the m tokens after `match`; the value only sets its length
    cnt = ck.values[slot_max].n_accepted
    if cnt > m:
        cnt = m
    s.last_draft_created = True
    s.last_draft_key_idx = off
    s.last_draft_value_idx = <uint16_t>slot_max
    if cnt <= 0:
        return 0
    memcpy(out, inp + match + n, cnt * sizeof(token_t))
    return cnt


cdef void map_accept(MapState* s, uint16_t n_accepted) noexcept nogil:
    if not s.last_draft_created or s.last_draft_key_idx >= s.n_keys:
        return
    s.keys[s.last_draft_key_idx].values[s.last_draft_value_idx].n_accepted = <int16_t>n_accepted


cdef class MapProposer(Proposer):
    """ngram-map-k (``key_only=True``) and ngram-map-k4v (``key_only=False``): common_ngram_map.

    Parameters
    ----------
    size_n : int, 1 .. 1024 (default 12) -- key length
    size_m : int, 1 .. 1024 (default 48) -- value (draft) length
    min_hits : int, >= 1 (default 1) -- k4v only; ngram-map-k ignores it, as llama.cpp does
    key_only : bool
    n_slots : int, >= 1
    reindex : bool (default False; not llama.cpp's behaviour)
        On begin(), a prompt that does not extend the slot's previous context resets the slot's
        map, so the new prompt is indexed from position 1. llama.cpp keeps the stale entries
        and never scans positions <= K of the new prompt (its "server-state collapse").
    stat_index_min : int, >= 1 (default 2048)
        ngram-map-k4v's statistics scans over at least this many positions go through the
        per-slot ScanIndex (same drafts; a speed knob, lowered by tests).

    Memory: per slot a 2**18-entry uint32 hash index (1 MiB, zero pages until touched) plus,
    per distinct matched key (unbounded, as in llama.cpp), a 112-byte record and at most 32
    bytes of lookup table. ngram-map-k4v adds, once a statistics scan covers 2048 positions, a
    ScanIndex: 4 bytes per context token plus a table of 16-32 bytes per distinct n-gram.

    Thread-safety: each slot's map is independent: one thread per slot at a time.
    """
    cdef MapParams params
    cdef MapState* states

    def __cinit__(self):
        self.states = NULL

    def __init__(self, size_n=12, size_m=48, min_hits=1, key_only=True, n_slots=1,
                 reindex=False, stat_index_min=STAT_INDEX_MIN):
        cdef Py_ssize_t i
        self.params.reindex = bool(reindex)
        self.params.n = check_int("size_n", size_n, 1, 1024)
        self.params.m = check_int("size_m", size_m, 1, 1024)
        self.params.min_hits = check_int("min_hits", min_hits, 1)
        self.params.key_only = bool(key_only)
        self.params.stat_index_min = check_int("stat_index_min", stat_index_min, 1)
        self.params.a_pow = 1
        for i in range(self.params.n - 1):
            self.params.a_pow *= MOD_LCG_A
        Proposer.__init__(self, "ngram-map-k" if key_only else "ngram-map-k4v", n_slots,
                          self.params.m)
        self.states = <MapState*>calloc(n_slots, sizeof(MapState))
        if self.states == NULL:
            raise MemoryError()
        for i in range(n_slots):
            self.states[i].key_map = <uint32_t*>calloc(MAP_INDEX_SIZE, sizeof(uint32_t))
            if self.states[i].key_map == NULL:
                raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.states != NULL:
            for i in range(self.n_slots):
                free(self.states[i].keys)
                free(self.states[i].key_map)
                free(self.states[i].kt_hash)
                free(self.states[i].kt_idx)
                scan_free(&self.states[i].scan)
            free(self.states)

    @property
    def size_n(self):
        return self.params.n

    @property
    def size_m(self):
        return self.params.m

    @property
    def min_hits(self):
        return self.params.min_hits

    @property
    def reindex(self):
        return self.params.reindex

    def n_keys(self, Py_ssize_t slot):
        """Number of key records of `slot` (grows by one per distinct matched key)."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return self.states[slot].n_keys

    def memory_bytes(self):
        cdef Py_ssize_t i
        cdef size_t total = 0
        for i in range(self.n_slots):
            total += (MAP_INDEX_SIZE * sizeof(uint32_t) + self.states[i].cap_keys * sizeof(MapKey)
                      + self.states[i].kt_size * (sizeof(uint64_t) + sizeof(int64_t))
                      + (self.states[i].scan.cap + self.states[i].scan.hits_cap) * sizeof(int32_t)
                      + self.states[i].scan.tab_size * sizeof(ScanSlot))
        return total

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        cdef int r = 0
        with nogil:
            if self.params.reindex:
                map_begin_reindex(&self.states[slot], prompt, n)
            map_begin(&self.states[slot], &self.params, n)
            self.states[slot].scan.stale = True   # the new prompt's text is not indexed
            # k4v on a long prompt: index it now (GIL released) rather than in a draft call
            if not self.params.key_only and n >= self.params.stat_index_min:
                r = scan_extend(&self.states[slot].scan, prompt, n - self.params.n,
                                self.params.n, self.params.a_pow)
        if r < 0:
            raise MemoryError()
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef Py_ssize_t r
        cdef MapState* s = &self.states[slot]
        if self.params.reindex:
            map_track(s, inp, n)
        if s.scan.next_i > 0 and s.scan.next_i - 1 + self.params.n > n:
            s.scan.stale = True              # the context shrank without begin()
        if n - <Py_ssize_t>s.key_map_last_idx > NOGIL_MIN_TOKENS:
            with nogil:
                r = map_draft(s, &self.params, inp, n, sampled, out)
        else:
            r = map_draft(s, &self.params, inp, n, sampled, out)
        if r < 0:
            raise MemoryError()
        return r

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        if not is_other:
            map_accept(&self.states[slot], <uint16_t>n_accepted)
        return 0


# --------------------------------------------------------------------------------------------
# ngram-mod (common_ngram_mod, common_speculative_impl_ngram_mod): one shared hash pool,
# rolling LCG hash
# --------------------------------------------------------------------------------------------

cdef class ModPool:
    """ngram-mod's table: 2**22 int32 entries (16 MiB), EMPTY = -1, shared by every slot and
    every ngram-mod proposer given it. Allocated once, never grown.

    Memory: exactly ``nbytes`` = 16 MiB, whatever the number of slots.

    Thread-safety: every read or write of the table takes the pool's lock, acquired without the
    GIL when contended; `reset` may run while other threads draft or begin.
    """
    cdef int32_t* entries
    cdef size_t n_used
    cdef pthread_mutex_t mutex
    cdef bint has_mutex
    cdef void* map_base                      # the mmap'ed region (NULL: entries came from malloc)
    cdef size_t map_len

    def __cinit__(self):
        self.entries = NULL
        self.map_base = NULL
        self.has_mutex = False
        self.alloc_entries()
        if pthread_mutex_init(&self.mutex, NULL) != 0:
            raise MemoryError()
        self.has_mutex = True
        memset(self.entries, 0xFF, MOD_POOL_SIZE * sizeof(int32_t))   # all EMPTY (-1)
        self.n_used = 0

    cdef int alloc_entries(self) except -1:
        """16 MiB at a 2 MiB boundary with MADV_HUGEPAGE: a draft chains up to n_max reads at
        random places in the table, so huge pages save a TLB miss per read. malloc where mmap
        is refused."""
        cdef size_t nbytes = MOD_POOL_SIZE * sizeof(int32_t), huge = 2 * 1024 * 1024
        cdef size_t start, lead
        cdef void* base = mmap(NULL, nbytes + huge, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if base != MAP_FAILED:
            start = (<size_t>base + huge - 1) & ~(huge - 1)
            lead = start - <size_t>base
            if lead:
                munmap(base, lead)
            if huge - lead:
                munmap(<void*>(start + nbytes), huge - lead)
            self.map_base = <void*>start
            self.map_len = nbytes
            madvise(self.map_base, nbytes, MADV_HUGEPAGE)   # advice only: may be refused
            self.entries = <int32_t*>self.map_base
            return 0
        self.entries = <int32_t*>malloc(nbytes)
        if self.entries == NULL:
            raise MemoryError()
        return 0

    def __dealloc__(self):
        if self.map_base != NULL:
            munmap(self.map_base, self.map_len)
        else:
            free(self.entries)
        if self.has_mutex:
            pthread_mutex_destroy(&self.mutex)

    @property
    def size(self):
        """Number of entries (2**22)."""
        return MOD_POOL_SIZE

    @property
    def nbytes(self):
        """Bytes of the table (16 MiB)."""
        return MOD_POOL_SIZE * sizeof(int32_t)

    @property
    def used(self):
        """Entries written since the last reset."""
        return self.n_used

    @property
    def occupancy(self):
        """used / size."""
        return self.n_used / <double>MOD_POOL_SIZE

    def reset(self):
        """Set every entry to EMPTY (releases the GIL while it runs)."""
        with nogil:
            self.lock_nogil()
            self.reset_locked()
            self.unlock()

    def get(self, key):
        """The entry the n-gram `key` hashes to (-1 = EMPTY): llama.cpp's recomputed hash."""
        cdef cnp.ndarray arr = as_tokens(key, "key")
        cdef const token_t* t = tok_ptr(arr)
        cdef uint64_t h = 0
        cdef Py_ssize_t i
        cdef int32_t r
        for i in range(cnp.PyArray_DIMS(arr)[0]):
            h = h * MOD_LCG_A + <uint64_t><int64_t>t[i]
        self.lock_gil()
        r = self.entries[h & MOD_POOL_MASK]
        self.unlock()
        return r

    def __reduce__(self):
        raise TypeError("ModPool cannot be pickled (it is one 16 MiB table shared in-process)")

    cdef inline void lock_nogil(self) noexcept nogil:
        pthread_mutex_lock(&self.mutex)

    cdef inline void lock_gil(self) noexcept:
        """Take the lock from a thread holding the GIL, dropping the GIL only to wait."""
        if pthread_mutex_trylock(&self.mutex) != 0:
            with nogil:
                pthread_mutex_lock(&self.mutex)

    cdef inline void unlock(self) noexcept nogil:
        pthread_mutex_unlock(&self.mutex)

    cdef void reset_locked(self) noexcept nogil:
        memset(self.entries, 0xFF, MOD_POOL_SIZE * sizeof(int32_t))
        self.n_used = 0


cdef void mod_insert(ModPool pool, const token_t* t, Py_ssize_t start, Py_ssize_t stop,
                     Py_ssize_t n, uint64_t a_pow) noexcept nogil:
    """pool_add(t[i : i+n+1]) for i in [start, stop), sliding the hash in O(1) per position.

    h_i = sum_k t[i+k] * A^(n-1-k) (mod 2^64), so h_{i+1} = (h_i - t[i] * A^(n-1)) * A + t[i+n]:
    the same slots as llama.cpp's recomputed hash. Caller holds the pool's lock.
    """
    if start >= stop:
        return
    cdef int32_t* entries = pool.entries
    cdef uint64_t h = mod_hash(t + start, n)
    cdef size_t used = pool.n_used
    cdef uint64_t s
    cdef Py_ssize_t i
    for i in range(start, stop):
        s = h & MOD_POOL_MASK
        if entries[s] == MOD_EMPTY:
            used += 1
        entries[s] = t[i + n]                # last writer wins, no collision check
        h = (h - <uint64_t><int64_t>t[i] * a_pow) * MOD_LCG_A + <uint64_t><int64_t>t[i + n]
    pool.n_used = used


cdef Py_ssize_t mod_chain(const int32_t* entries, token_t* buf, Py_ssize_t n,
                          Py_ssize_t n_max, uint64_t a_pow) noexcept nogil:
    """Follow the pool from the key buf[0 : n] for at most n_max tokens, appending them to buf;
    returns how many were found before an EMPTY entry. Caller holds the pool's lock."""
    cdef uint64_t h = mod_hash(buf, n)
    cdef Py_ssize_t i
    cdef int32_t t
    for i in range(n_max):
        t = entries[h & MOD_POOL_MASK]
        if t == MOD_EMPTY:
            return i
        buf[n + i] = t
        h = (h - <uint64_t><int64_t>buf[i] * a_pow) * MOD_LCG_A + <uint64_t><int64_t>t
    return n_max


cdef struct ModSlot:
    Py_ssize_t i_last          # next chunked insertion starts here
    Py_ssize_t n_draft_last    # last draft's length before the glue's truncation
    int n_low                  # consecutive low-acceptance drafts


cdef class ModProposer(Proposer):
    """ngram-mod: an LCG hash of the last n tokens -> the next token, chained greedily.

    Parameters
    ----------
    n_match : int, 1 .. 1024 (default 24) -- n-gram length
    n_min : int, 0 .. 1024 (default 48) -- shorter chains give no draft
    n_max : int, 0 .. 1024 (default 64) -- chain length cap
    pool : ModPool or None -- the shared table (a new one when None)
    n_slots : int, >= 1

    Memory: the shared 16 MiB pool plus 24 bytes per slot and an (n_match + n_max)-token buffer
    per slot. Thread-safety: pool access is locked (see `ModPool`); per-slot state needs one
    thread per slot at a time. begin() releases the GIL while it inserts the prompt.
    """
    cdef readonly ModPool pool
    cdef readonly Py_ssize_t n_match, n_min, n_max
    cdef uint64_t a_pow                      # A^(n-1) mod 2^64, to slide the hash
    cdef ModSlot* slots
    cdef token_t* bufs                       # per slot n_match + n_max tokens

    def __cinit__(self):
        self.slots = NULL
        self.bufs = NULL

    def __init__(self, n_match=24, n_min=48, n_max=64, ModPool pool=None, n_slots=1):
        cdef Py_ssize_t i
        self.n_match = check_int("n_match", n_match, 1, 1024)
        self.n_min = check_int("n_min", n_min, 0, 1024)
        self.n_max = check_int("n_max", n_max, 0, 1024)
        Proposer.__init__(self, "ngram-mod", n_slots, max(self.n_max, 1))
        self.pool = pool if pool is not None else ModPool()
        self.a_pow = 1
        for i in range(self.n_match - 1):
            self.a_pow *= MOD_LCG_A
        self.slots = <ModSlot*>calloc(n_slots, sizeof(ModSlot))
        self.bufs = <token_t*>malloc(n_slots * (self.n_match + self.n_max) * sizeof(token_t))
        if self.slots == NULL or self.bufs == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.slots)
        free(self.bufs)

    def memory_bytes(self):
        return self.n_slots * (sizeof(ModSlot) + (self.n_match + self.n_max) * sizeof(token_t))

    def slot_state(self, Py_ssize_t slot):
        """(i_last, n_draft_last, n_low) of `slot`, for tests and diagnostics."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return (self.slots[slot].i_last, self.slots[slot].n_draft_last, self.slots[slot].n_low)

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t P) except -1:
        cdef ModSlot* st = &self.slots[slot]
        cdef ModPool pool = self.pool
        cdef Py_ssize_t n = self.n_match
        st.i_last = 0
        st.n_draft_last = 0                  # n_low is kept across requests
        if P < n:
            return 0
        with nogil:
            pool.lock_nogil()
            mod_insert(pool, prompt, 0, P - n, n, self.a_pow)
            st.i_last = P - n
            # occupancy is checked after the insertion: this prompt's n-grams go too
            if <double>pool.n_used / <double>MOD_POOL_SIZE > 0.25:
                pool.reset_locked()
            pool.unlock()
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t L,
                            token_t sampled, token_t* out) except -1:
        cdef ModSlot* st = &self.slots[slot]
        cdef ModPool pool = self.pool
        cdef Py_ssize_t n = self.n_match, length
        cdef token_t* buf = self.bufs + slot * (n + self.n_max)
        st.n_draft_last = 0
        if L < n:
            return 0
        pool.lock_gil()
        if st.i_last + 32 < L:               # chunked insertion of the new n-grams
            if L - n - st.i_last > NOGIL_MIN_TOKENS:
                with nogil:
                    mod_insert(pool, inp, st.i_last, L - n, n, self.a_pow)
            else:
                mod_insert(pool, inp, st.i_last, L - n, n, self.a_pow)
            st.i_last = L - n
        # key = last n tokens of inp + [sampled]; the window then slides over its own output
        memcpy(buf, inp + L - n + 1, (n - 1) * sizeof(token_t))
        buf[n - 1] = sampled
        length = mod_chain(pool.entries, buf, n, self.n_max, self.a_pow)
        pool.unlock()
        # a chain cut short by an EMPTY entry before n_min tokens gives no draft (a full one of
        # n_max < n_min tokens does, as in llama.cpp)
        if length == 0 or (length < self.n_max and length < self.n_min):
            return 0
        st.n_draft_last = length             # before the glue's truncation
        memcpy(out, buf + n, length * sizeof(token_t))
        return length

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        cdef ModSlot* st = &self.slots[slot]
        cdef ModPool pool = self.pool
        if is_other or st.n_draft_last <= 0:
            return 0
        if <double>n_accepted / <double>st.n_draft_last < 0.25:
            st.n_low += 1
            if st.n_low >= 5:                # 5 poor drafts in a row wipe the shared pool
                with nogil:
                    pool.lock_nogil()
                    pool.reset_locked()
                    pool.unlock()
                st.n_low = 0
                st.i_last = 0
        else:
            st.n_low = 0
        return 0


# --------------------------------------------------------------------------------------------
# The engine: llama.cpp's glue (common_speculative_begin / _draft / _accept)
# --------------------------------------------------------------------------------------------

cdef struct Counters:
    uint64_t calls_b, calls_g, calls_a
    uint64_t gen_drafts, acc_drafts, gen_tokens, acc_tokens
    int64_t t_begin, t_draft, t_accept     # in ticks (see ngs_ticks)
    Py_ssize_t n_pos           # positions used in acc_per_pos
    uint64_t* acc_per_pos      # accepts with k > i, for i < max_draft


cdef class Engine:
    """A chain of proposers driven as llama-server drives them (``common_speculative_begin``,
    ``common_speculative_draft``, ``common_speculative_accept``): the compiled half of
    `ngramspec.SpecEngine`, which builds the chain from ``--spec-type`` and its parameters.

    Parameters
    ----------
    proposers : sequence of Proposer
        The chain in priority order; the first non-empty draft wins.
    n_slots : int, >= 1
        Server slots. Per-slot state is separate; the ngram-mod pool is shared by all slots.
    pool : ModPool, optional
        The ngram-mod table the chain uses (default: the first ModProposer's).

    Methods ``begin(slot, prompt)``, ``draft(slot, context, sampled, n_max=None)`` and
    ``accept(slot, n_accepted)`` follow llama-server: begin once per request with the full
    prompt; draft with the tokens in the KV cache and the last sampled token; accept after every
    non-empty draft (also with 0). Token arrays may be any 1-D integer array-like; ids must be
    in 0 .. TOKEN_MAX.

    Between two begin() calls a slot's context only grows (llama-server appends to the KV
    cache), which is what the proposers' incremental state relies on, as in llama.cpp. The
    engine therefore checks each context token once: when a call passes the same int32 buffer
    as the previous call on the slot (same data address and owner, e.g. growing views
    ``buf[:L]``), only the tokens past the previous length are validated; any other array-like
    is converted and checked whole.

    Notes
    -----
    Memory: see each proposer; the engine adds ``n_slots * max_draft`` int32 of output buffers.

    Thread-safety: calls for different slots may come from different threads at once (one
    thread per slot at a time); statistics are updated with the GIL held.
    """
    cdef readonly tuple proposers
    cdef readonly Py_ssize_t n_slots
    cdef readonly object pool
    cdef Py_ssize_t n_prop
    cdef Py_ssize_t max_draft
    cdef Counters* counters
    cdef int* impl_last                      # per slot: proposer of the last non-empty draft
    cdef Py_ssize_t* pending                 # per slot: length of a draft awaiting accept, or -1
    cdef Py_ssize_t* checked                 # per slot: leading context tokens already validated
    cdef list checked_owner                  # per slot: the buffer those tokens are in (kept
    cdef size_t* checked_data                # alive, so its address cannot be reused) and its
                                             # data address; any other array is checked whole
    cdef token_t* out                        # per slot output buffer of max_draft tokens

    def __cinit__(self):
        self.counters = NULL
        self.impl_last = NULL
        self.pending = NULL
        self.checked = NULL
        self.checked_data = NULL
        self.out = NULL

    def __init__(self, proposers, n_slots=1, pool=None):
        cdef Py_ssize_t i
        n_slots = check_int("n_slots", n_slots, 1)
        if pool is not None and not isinstance(pool, ModPool):
            raise TypeError(f"pool must be a ModPool, got {type(pool).__name__}")
        proposers = tuple(proposers)
        for p in proposers:
            if not isinstance(p, Proposer):
                raise TypeError(f"proposers must be Proposer instances, got {type(p).__name__}")
            if (<Proposer>p).n_slots < n_slots:
                raise ValueError(f"proposer {p.name} has {p.n_slots} slots, the engine needs "
                                 f"{n_slots}")
        self.proposers = proposers
        self.n_slots = n_slots
        if pool is None:
            pool = next((p.pool for p in proposers if isinstance(p, ModProposer)), None)
        self.pool = pool
        self.n_prop = len(proposers)
        self.max_draft = max([(<Proposer>p).max_draft for p in proposers] or [1])
        self.counters = <Counters*>calloc(max(self.n_prop, 1), sizeof(Counters))
        self.impl_last = <int*>malloc(n_slots * sizeof(int))
        self.pending = <Py_ssize_t*>malloc(n_slots * sizeof(Py_ssize_t))
        self.checked = <Py_ssize_t*>calloc(n_slots, sizeof(Py_ssize_t))
        self.checked_data = <size_t*>calloc(n_slots, sizeof(size_t))
        self.checked_owner = [None] * n_slots
        self.out = <token_t*>malloc(n_slots * self.max_draft * sizeof(token_t))
        if (self.counters == NULL or self.impl_last == NULL or self.pending == NULL
                or self.checked == NULL or self.checked_data == NULL or self.out == NULL):
            raise MemoryError()
        for i in range(self.n_prop):
            self.counters[i].acc_per_pos = <uint64_t*>calloc(self.max_draft, sizeof(uint64_t))
            if self.counters[i].acc_per_pos == NULL:
                raise MemoryError()
        for i in range(n_slots):
            self.impl_last[i] = -1
            self.pending[i] = -1

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.counters != NULL:
            for i in range(self.n_prop):
                free(self.counters[i].acc_per_pos)
            free(self.counters)
        free(self.impl_last)
        free(self.pending)
        free(self.checked)
        free(self.checked_data)
        free(self.out)

    @property
    def types(self):
        """Proposer type names in priority order."""
        return [p.name for p in self.proposers]

    cdef inline Py_ssize_t slot_index(self, object slot) except -1:
        cdef Py_ssize_t s = -1
        cdef long long v
        if exact_int_in(slot, 0, self.n_slots - 1, &v):
            return <Py_ssize_t>v
        if PyLong_CheckExact(slot):
            try:
                s = PyLong_AsSsize_t(slot)
            except OverflowError:
                s = -1
        elif isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"slot must be an integer, got {type(slot).__name__}")
        else:
            s = int(slot) if -1 <= slot < self.n_slots else -1
        if not 0 <= s < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return s

    def begin(self, slot, prompt):
        """Start a request on `slot` with its full prompt (calls every proposer's begin)."""
        cdef Py_ssize_t s = self.slot_index(slot), k
        cdef cnp.ndarray arr = as_tokens(prompt, "prompt")
        cdef const token_t* t = tok_ptr(arr)
        cdef Py_ssize_t n = cnp.PyArray_DIMS(arr)[0]
        cdef uint64_t t0
        cdef Proposer p
        self.pending[s] = -1
        self.checked[s] = 0                  # the next context is checked whole
        self.checked_owner[s] = None
        for k in range(self.n_prop):
            p = <Proposer>self.proposers[k]
            t0 = ngs_ticks()
            p.c_begin(s, t, n)
            self.counters[k].t_begin += ticks_since(t0)
            self.counters[k].calls_b += 1

    def draft(self, slot, context, sampled, n_max=None):
        """Draft tokens to follow `sampled` (first non-empty draft of the chain wins).

        Parameters
        ----------
        slot : int, 0 .. n_slots-1
        context : 1-D int array-like -- the tokens in the KV cache (prompt + output so far,
            without `sampled`)
        sampled : int -- the last token the target emitted
        n_max : int >= 0 or None -- the server's bound (``n_draft_max``): applied after the
            proposer ran; 0 returns an empty draft without calling any proposer.

        Returns
        -------
        numpy.ndarray of int32 (empty: no draft).
        """
        cdef Py_ssize_t s = self.slot_index(slot), k, length = 0, bound = 0
        cdef Py_ssize_t skip = 0
        cdef long long v
        if (self.checked[s] > 0 and cnp.PyArray_CheckExact(context)
                and <size_t>cnp.PyArray_DATA(<cnp.ndarray>context) == self.checked_data[s]
                and buffer_owner(<cnp.ndarray>context) is self.checked_owner[s]):
            skip = self.checked[s]           # the same buffer, grown: check the new tokens
        cdef cnp.ndarray arr = as_tokens(context, "context", skip)
        cdef token_t tok = as_token(sampled, "sampled")
        cdef const token_t* t = tok_ptr(arr)
        cdef Py_ssize_t L = cnp.PyArray_DIMS(arr)[0]
        cdef token_t* out = self.out + s * self.max_draft
        cdef uint64_t t0
        cdef Counters* c
        cdef Proposer p
        if n_max is not None:
            # any bound >= max_draft truncates nothing (and fits a Py_ssize_t)
            if exact_int_in(n_max, 0, 1LL << 62, &v):
                bound = min(<Py_ssize_t>v, self.max_draft)
            else:
                bound = min(check_int("n_max", n_max, 0), self.max_draft)
        # every argument is valid: only now change the slot's state
        if arr is context:
            self.checked[s] = L
            self.checked_data[s] = <size_t>cnp.PyArray_DATA(arr)
            self.checked_owner[s] = buffer_owner(arr)
        else:
            self.checked[s] = 0
            self.checked_owner[s] = None
        self.pending[s] = -1
        if n_max is not None and bound == 0:
            return EMPTY
        for k in range(self.n_prop):
            p = <Proposer>self.proposers[k]
            c = &self.counters[k]
            t0 = ngs_ticks()
            length = p.c_draft(s, t, L, tok, out)
            c.t_draft += ticks_since(t0)
            c.calls_g += 1
            if length > 0:
                if length > p.max_draft:
                    raise RuntimeError(f"{p.name} overflowed its draft buffer")
                if bound > 0 and length > bound:
                    length = bound
                self.impl_last[s] = k
                self.pending[s] = length
                c.gen_drafts += 1
                c.gen_tokens += length
                break
        if length <= 0:
            return EMPTY
        return copy_tokens(out, length)

    def accept(self, slot, n_accepted):
        """Report how many tokens of the slot's last (non-empty) draft the target accepted."""
        cdef Py_ssize_t s = self.slot_index(slot), i, k
        cdef Py_ssize_t last = self.pending[s]
        if last < 0:
            raise ValueError(f"accept() on slot {s} without a pending non-empty draft: call it "
                             f"once after each non-empty draft()")
        cdef long long v
        cdef Py_ssize_t n
        if exact_int_in(n_accepted, 0, last, &v):
            n = <Py_ssize_t>v
        else:
            n = check_int("n_accepted", n_accepted, 0, last)
        cdef int which = self.impl_last[s]
        cdef Counters* c = &self.counters[which]
        cdef Proposer p
        cdef uint64_t t0 = ngs_ticks()
        self.pending[s] = -1
        for i in range(n):
            c.acc_per_pos[i] += 1
        if n > c.n_pos:
            c.n_pos = n
        if n > 0:
            c.acc_drafts += 1
            c.acc_tokens += n
        (<Proposer>self.proposers[which]).c_accept(s, n, False)
        c.calls_a += 1
        c.t_accept += ticks_since(t0)
        for k in range(self.n_prop):
            if k != which:
                (<Proposer>self.proposers[k]).c_accept(s, n, True)

    def stats(self):
        """llama.cpp's per-proposer counters (``n_call_begin`` ... ``t_accept_us`` of
        common/speculative.cpp), one dict per proposer in priority order.

        Keys: type, calls_b, calls_g, calls_a, gen_drafts, acc_drafts, gen_tokens, acc_tokens,
        acc_per_pos (list), t_begin_us, t_draft_us, t_accept_us.
        """
        cdef Py_ssize_t k, i
        cdef Counters* c
        cdef double scale = ns_per_tick()
        result = []
        for k in range(self.n_prop):
            c = &self.counters[k]
            result.append({
                "type": self.proposers[k].name,
                "calls_b": c.calls_b, "calls_g": c.calls_g, "calls_a": c.calls_a,
                "gen_drafts": c.gen_drafts, "acc_drafts": c.acc_drafts,
                "gen_tokens": c.gen_tokens, "acc_tokens": c.acc_tokens,
                "acc_per_pos": [c.acc_per_pos[i] for i in range(c.n_pos)],
                "t_begin_us": int(c.t_begin * scale) // 1000,
                "t_draft_us": int(c.t_draft * scale) // 1000,
                "t_accept_us": int(c.t_accept * scale) // 1000,
            })
        return result

    def memory_bytes(self):
        """Bytes held by the proposers and the engine (the shared ModPool not included)."""
        return (sum(p.memory_bytes() for p in self.proposers)
                + self.n_slots * self.max_draft * sizeof(token_t))

    def __repr__(self):
        return f"<{type(self).__name__} {','.join(self.types) or 'none'} n_slots={self.n_slots}>"
