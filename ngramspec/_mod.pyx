# cython: language_level=3
"""ngram-mod (common_ngram_mod, common_speculative_impl_ngram_mod): one shared hash pool,
rolling LCG hash."""
cimport numpy as cnp
from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset
from posix.mman cimport (MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap,
                         munmap)

from ngramspec._hash cimport mod_hash, mod_pow, mod_roll
from ngramspec._proposer cimport Proposer, alloc_per_slot, as_tokens, malloc, tok_ptr
from ngramspec._types cimport (MOD_EMPTY, MOD_POOL_MASK, MOD_POOL_SIZE, NOGIL_MIN_TOKENS,
                               token_t)

from ngramspec._proposer import check_int

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


# --------------------------------------------------------------------------------------------
# ngram-mod (common_ngram_mod, common_speculative_impl_ngram_mod): one shared hash pool,
# rolling LCG hash
# --------------------------------------------------------------------------------------------

cdef class ModPool:
    """ngram-mod's table: 2**22 int32 entries (16 MiB), EMPTY = -1, shared by every slot and
    every ngram-mod proposer given it. Allocated once, never grown.

    Notes
    -----
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
            raise MemoryError("out of memory for ngram-mod's 16 MiB pool")
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
        cdef uint64_t h = mod_hash(t, cnp.PyArray_DIMS(arr)[0])
        cdef int32_t r
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
    """common_ngram_mod::add(t[i : i+n+1]) for i in [start, stop), sliding the hash in O(1)
    per position (`mod_roll`, _hash.pxd): the same slots as llama.cpp's recomputed hash. Caller
    holds the pool's lock."""
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
        h = mod_roll(h, t[i], t[i + n], a_pow)
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
        h = mod_roll(h, buf[i], t, a_pow)
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

    Notes
    -----
    Memory: the shared 16 MiB pool plus 24 bytes per slot and an (n_match + n_max)-token buffer
    per slot. Thread-safety: pool access is locked (see `ModPool`); per-slot state needs one
    thread per slot at a time (a second call on a busy slot raises RuntimeError). begin() releases the GIL while it inserts the prompt.
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
        n_match = check_int("n_match", n_match, 1, 1024)
        n_min = check_int("n_min", n_min, 0, 1024)
        n_max = check_int("n_max", n_max, 0, 1024)
        Proposer.__init__(self, "ngram-mod", n_slots, max(n_max, 1))   # first: refuses a re-run
        self.n_match = n_match
        self.n_min = n_min
        self.n_max = n_max
        self.a_pow = mod_pow(self.n_match - 1)
        try:
            self.pool = pool if pool is not None else ModPool()
            self.slots = <ModSlot*>alloc_per_slot(n_slots, sizeof(ModSlot),
                                                  "ngram-mod's per-slot state")
            self.bufs = <token_t*>alloc_per_slot(n_slots,
                                                 (self.n_match + self.n_max) * sizeof(token_t),
                                                 "ngram-mod's per-slot buffers")
        except MemoryError:
            free(self.slots)
            self.slots = NULL
            self.forget_slots()
            raise

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

