# ngram-cache's C-level side, header-only (cimported by _cache): the C++ containers of
# _ngram_cache.h and the kernels that update and read them, bit-exact with llama.cpp's
# common_ngram_cache_update, common_ngram_cache_draft and its try_draft (common/ngram-cache.cpp).
#
# Ownership: an ngs_cache owns its nodes (freed by ngs_free or its destructor); the kernels
# borrow the caches and token buffers they are given for the call. Sentinel: TOKEN_NULL (-1,
# llama.cpp's LLAMA_TOKEN_NULL) pads n-grams shorter than NGRAM_MAX and means "no token".
# Append-only context: a slot's context cache learns each token of its stream once
# (`ngs_slot.cache_size` tokens seen; llama.cpp never resets it, so a shorter new prompt teaches
# nothing until it outgrows it). Thread-safety: none here. A cache is written by one thread at
# a time and read by any number while nobody writes (_cache's NgramCache and the slot flags
# enforce it); no function takes the GIL, and the container primitives catch std::bad_alloc
# (they return -1 or NULL), so the kernels stay `noexcept nogil`.
from cython.operator cimport dereference as deref, preincrement as inc
from libc.stdint cimport int32_t, int64_t, uint32_t
from libcpp.utility cimport pair

from ngramspec._types cimport token_t

cdef extern from "_ngram_cache.h" nogil:
    cdef cppclass ngs_ngram:
        int32_t tokens[4]

    ctypedef pair[int32_t, int32_t] ngs_tc

    cdef cppclass ngs_part:
        cppclass iterator:
            ngs_tc& operator*()
            iterator operator++()
            bint operator==(iterator)
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        iterator find(int32_t&)
        size_t size()
        size_t bucket_count()
        size_t index_capacity()

    ctypedef pair[ngs_ngram, ngs_part] ngs_item

    cdef cppclass ngs_cache:
        cppclass iterator:
            ngs_item& operator*()
            iterator operator++()
            bint operator==(iterator)
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        size_t size()
        size_t bucket_count()
        size_t index_capacity()
        void clear()

    cdef cppclass ngs_slot:
        size_t cache_size
        ngs_cache context

    cdef cppclass ngs_std_part:
        cppclass iterator:
            ngs_tc& operator*()
            iterator operator++()
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        size_t size()
        size_t bucket_count()
        void emplace(int32_t, int32_t)

    ctypedef pair[ngs_ngram, ngs_std_part] ngs_std_item

    cdef cppclass ngs_std_cache:
        cppclass iterator:
            ngs_std_item& operator*()
            iterator operator++()
            bint operator!=(iterator)
        iterator begin()
        iterator end()
        size_t size()
        size_t bucket_count()
        void clear()

    void ngs_std_add(ngs_std_cache* c, const ngs_ngram& g, int32_t tok, int32_t count) except +
    void ngs_std_merge(ngs_std_cache* dst, const ngs_std_cache* src) except +
    ngs_std_part* ngs_std_new_part(ngs_std_cache* c, const ngs_ngram& g) except +

    ngs_part* ngs_find(ngs_cache* c, const ngs_ngram& g)
    int ngs_add(ngs_cache* c, const ngs_ngram& g, int32_t tok, int32_t count)
    ngs_part* ngs_new_part(ngs_cache* c, const ngs_ngram& g, int* is_new)
    int ngs_part_emplace(ngs_part* p, int32_t tok, int32_t count)
    int ngs_insert_copy(ngs_cache* c, const ngs_ngram& g, const ngs_part* p)
    int ngs_copy_cache(ngs_cache* dst, const ngs_cache* src)
    void ngs_free(ngs_cache* c)
    const int* ngs_min_n_lax
    const int* ngs_min_pct_lax
    const int* ngs_min_n_strict
    const int* ngs_min_pct_strict


# llama.cpp's constants (common/ngram-cache.h, common/speculative.cpp).
cdef enum:
    NGRAM_MIN = 1
    NGRAM_MAX = 4
    NGRAM_STATIC = 2
    CACHE_N_DRAFT = 8       # hard-coded n_draft of common_speculative_impl_ngram_cache
    TOKEN_NULL = -1         # LLAMA_TOKEN_NULL


cdef inline int32_t wrap_mul(int32_t a, int32_t b) noexcept nogil:
    # llama.cpp compares int32 products; g++ emits a 32-bit multiply that wraps. Doing the same
    # in unsigned arithmetic gives that result without relying on signed overflow.
    return <int32_t>(<uint32_t>a * <uint32_t>b)


cdef inline int32_t wrap_add(int32_t a, int32_t b) noexcept nogil:
    return <int32_t>(<uint32_t>a + <uint32_t>b)


cdef inline token_t seq_at(const token_t* a, Py_ssize_t na, token_t tail,
                           Py_ssize_t k) noexcept nogil:
    # The sequence a[0:na] + [tail] without materializing it (llama.cpp copies it).
    return a[k] if k < na else tail


cdef inline int cache_update(ngs_cache* cache, const token_t* a, Py_ssize_t na, token_t tail,
                             bint has_tail, int ngram_min, int ngram_max) noexcept nogil:
    """common_ngram_cache_update(cache, ngram_min, ngram_max, seq, nnew=len(seq)) over
    seq = a[0:na] (+ [tail] if has_tail). Loop order is llama.cpp's: size outer, position inner;
    it fixes the insertion sequence and so the tie order. Returns 0, or -1 when out of memory."""
    cdef Py_ssize_t m = na + (1 if has_tail else 0)
    cdef Py_ssize_t i, j
    cdef int size
    cdef ngs_ngram g
    for size in range(ngram_min, ngram_max + 1):
        for j in range(size, NGRAM_MAX):
            g.tokens[j] = TOKEN_NULL
        # i_start = max(len - nnew, size) = size, as nnew = len
        for i in range(size, m):
            for j in range(size):
                g.tokens[j] = seq_at(a, na, tail, i - size + j)
            if ngs_add(cache, g, seq_at(a, na, tail, i), 1) < 0:
                return -1
    return 0


cdef inline token_t try_primary(ngs_cache* cache, const ngs_ngram* grams, int n_sizes,
                                ngs_part* part_static, const int* min_n,
                                const int* min_pct) noexcept nogil:
    """try_draft(nc_primary, ngrams, part_static, min_sample_size, min_percent) of llama.cpp,
    without copying the parts: a part is walked in place, in its own iteration order."""
    cdef int i
    cdef ngs_part* part
    cdef ngs_part.iterator it, st
    cdef int32_t c, s, maxc, maxs, total, tok
    cdef token_t best
    if cache.size() == 0:
        return TOKEN_NULL
    for i in range(n_sizes - 1, -1, -1):    # longest n-gram first
        part = ngs_find(cache, grams[i])
        if part == NULL:
            continue
        best = TOKEN_NULL
        maxc = 0
        maxs = 0
        total = 0
        it = part.begin()
        while it != part.end():
            tok = deref(it).first
            c = deref(it).second
            s = 1
            if part_static != NULL:
                st = part_static.find(tok)
                if st != part_static.end():
                    s = wrap_mul(100, deref(st).second)
            # strict '>': the first token in iteration order wins a tie
            if wrap_mul(c, s) > wrap_mul(maxc, maxs):
                best = tok
                maxc = c
                maxs = s
            total = wrap_add(total, c)
            inc(it)
        if total < min_n[i]:
            continue
        if wrap_mul(100, maxc) < wrap_mul(min_pct[i], total):
            continue
        # llama.cpp's loop runs on while the result is LLAMA_TOKEN_NULL, which `best` still is
        # if no product was positive
        if best != TOKEN_NULL:
            return best
    return TOKEN_NULL


cdef inline token_t try_static(ngs_part* part_static) noexcept nogil:
    """try_draft(nc_static, ngram_static) of llama.cpp, given the part it looks up."""
    cdef ngs_part.iterator it
    cdef int32_t c, maxc = 0, total = 0
    cdef token_t best = TOKEN_NULL
    if part_static == NULL:
        return TOKEN_NULL
    it = part_static.begin()
    while it != part_static.end():
        c = deref(it).second
        if c > maxc:
            best = deref(it).first
            maxc = c
        total = wrap_add(total, c)
        inc(it)
    if total < ngs_min_n_lax[NGRAM_STATIC - 1]:
        return TOKEN_NULL
    if wrap_mul(100, maxc) < wrap_mul(ngs_min_pct_lax[NGRAM_STATIC - 1], total):
        return TOKEN_NULL
    return best


cdef inline Py_ssize_t cache_draft(ngs_cache* context, ngs_cache* dynamic, ngs_cache* static_,
                                   const token_t* inp, Py_ssize_t L, token_t sampled,
                                   token_t* out, Py_ssize_t n_draft,
                                   int64_t vocab_end) noexcept nogil:
    """common_speculative_impl_ngram_cache::draft's loop (common_ngram_cache_draft) over
    X = inp + [sampled] + out[0:nd], read in place.

    The draft ends before the first token >= vocab_end (the target's vocabulary size; 2**31
    for no bound), which the target could not take.

    Tiny contexts: for len(inp) + 1 in {2, 3}, llama.cpp builds the 3- and 4-grams from
    positions before the start of the buffer (undefined behaviour in llama.cpp). Here an
    n-gram longer than X does not exist: that size is skipped and the shorter ones are tried,
    exactly as if its lookup had found nothing. Once the draft has made X long enough, the
    size is used again.
    """
    cdef Py_ssize_t n_e = L + 1
    cdef Py_ssize_t nd = 0, n_x, j, pos
    cdef int size, n_sizes
    cdef token_t tail[NGRAM_MAX]
    cdef ngs_ngram grams[NGRAM_MAX]
    cdef ngs_ngram g_static
    cdef ngs_part* part_static
    cdef token_t t
    if n_e < NGRAM_STATIC:
        return 0
    while nd < n_draft:
        n_x = n_e + nd
        n_sizes = NGRAM_MAX if n_x >= NGRAM_MAX else <int>n_x
        # tail[j] = X[n_x - NGRAM_MAX + j]; entries before the start of X stay unused
        for j in range(NGRAM_MAX - n_sizes, NGRAM_MAX):
            pos = n_x - NGRAM_MAX + j
            if pos < L:
                tail[j] = inp[pos]
            elif pos == L:
                tail[j] = sampled
            else:
                tail[j] = out[pos - n_e]
        for size in range(1, n_sizes + 1):
            for j in range(NGRAM_MAX):
                grams[size - 1].tokens[j] = tail[NGRAM_MAX - size + j] if j < size else TOKEN_NULL
        g_static = grams[NGRAM_STATIC - 1]
        part_static = ngs_find(static_, g_static) if static_.size() else NULL
        t = try_primary(context, grams, n_sizes, part_static, ngs_min_n_lax, ngs_min_pct_lax)
        if t == TOKEN_NULL:
            t = try_primary(dynamic, grams, n_sizes, part_static,
                            ngs_min_n_strict, ngs_min_pct_strict)
        if t == TOKEN_NULL:
            t = try_static(part_static)
        if t == TOKEN_NULL or t >= vocab_end:
            break
        out[nd] = t
        nd += 1
    return nd
