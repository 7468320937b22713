# distutils: language = c++
# distutils: extra_compile_args = -std=c++17
"""ngram-cache: llama.cpp's lookup-decoding proposer (``common_speculative_impl_ngram_cache``
over common/ngram-cache.cpp), bit-exact.

Three n-gram caches per slot map an n-gram (1 to 4 tokens) to the counts of the tokens that
followed it: ``context`` (learned online from the slot's token stream), ``dynamic`` (loaded from
``--lookup-cache-dynamic``) and ``static`` (loaded from ``--lookup-cache-static``, 2-grams).

Bit-exactness hinges on one thing no formula states: when two candidate tokens tie, llama.cpp's
``try_draft`` keeps the one that comes first in the iteration order of libstdc++'s
``std::unordered_map<int32_t, int32_t>``. That order depends on the prime bucket
policy and on the insertion history, so this module keeps the counts in a table that reproduces
that container's node list, bucket walk and rehash policy (``_ordered_table.h``, built on
libstdc++'s own ``_Prime_rehash_policy``) and fills it with the same sequence of insertions as
llama.cpp: `cache_update` mirrors ``common_ngram_cache_update`` loop for loop, and file loading
inserts in file order. The outer table (n-gram -> part) is ordered by llama.cpp's own n-gram
hash, so iterating it, and therefore a saved file, comes out in the same order as
``common_ngram_cache_save``. Keys are never found through those two hashes, which crafted
input floods ((x, x) and (x, x, y, y) all hash to 0): a separate index keyed with a random
per-process SipHash finds them in O(1) whatever the tokens (issue 20).

Layout: C++ container primitives in ``_ngram_cache.h`` (they catch ``std::bad_alloc`` so
the Cython kernels can stay ``noexcept nogil``), the update and draft kernels in
``_ngram_cache.pxd``, the file kernels here, and two extension classes: `NgramCache` (one
cache, file I/O) and `NgramCacheProposer`.
"""
cimport numpy as cnp
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cython.operator cimport dereference as deref, preincrement as inc
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libcpp.vector cimport vector

from ngramspec._ngram_cache cimport (CACHE_N_DRAFT, NGRAM_MAX, NGRAM_MIN, TOKEN_NULL, cache_draft,
                                     cache_update, ngs_add, ngs_cache, ngs_copy_cache, ngs_find,
                                     ngs_free, ngs_insert_copy, ngs_new_part, ngs_ngram, ngs_part,
                                     ngs_part_emplace, ngs_slot, ngs_std_add, ngs_std_cache,
                                     ngs_std_merge, ngs_std_new_part, ngs_std_part)
from ngramspec._proposer cimport (Proposer, as_token, as_tokens, claim_slot, proposer_draft,
                                  raise_busy, tok_ptr)
from ngramspec._types cimport NOGIL_FREE_NGRAMS, NOGIL_MIN_TOKENS, token_t

import os
import weakref

import numpy as np

from ngramspec._proposer import check_int

cnp.import_array()


# llama.cpp's lookup-cache file format (common_ngram_cache_save / _load).
cdef enum:
    RECORD_HEAD = 20        # 4 int32 tokens + int32 count of pairs
    PAIR_SIZE = 8           # int32 token + int32 count

# vocab_end without a vocabulary bound: every int32 token id >= 0 is below it.
cdef int64_t VOCAB_UNBOUNDED = 1 << 31

# Error codes of parse_cache (also used by the Python-level message builder).
cdef enum:
    PARSE_OK = 0
    PARSE_TRUNC_HEAD = 1
    PARSE_BAD_NTOKENS = 2
    PARSE_TRUNC_PAIRS = 3
    PARSE_BAD_COUNT = 4
    PARSE_BAD_KEY = 5
    PARSE_BAD_TOKEN = 6
    PARSE_NOMEM = 7


# ---------------------------------------------------------------------------------------------
# File kernels (the update and draft kernels are in _ngram_cache.pxd)
# ---------------------------------------------------------------------------------------------

cdef inline int32_t rd_i32(const uint8_t* p) noexcept nogil:
    # little-endian on every host
    return <int32_t>(<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
                     | (<uint32_t>p[3] << 24))


cdef inline void wr_i32(uint8_t* p, int32_t v) noexcept nogil:
    cdef uint32_t u = <uint32_t>v
    p[0] = u & 0xFF
    p[1] = (u >> 8) & 0xFF
    p[2] = (u >> 16) & 0xFF
    p[3] = (u >> 24) & 0xFF


cdef int parse_cache(ngs_cache* c, const uint8_t* buf, Py_ssize_t n,
                     Py_ssize_t* err_off, int64_t* err_val) noexcept nogil:
    """common_ngram_cache_load from a buffer: records inserted in file order (the order decides
    ties). Stricter than llama.cpp, which stops silently at a truncated record: every byte must
    belong to a well-formed record. On error returns a PARSE_* code with the byte offset."""
    cdef Py_ssize_t off = 0, rec, k, ntok
    cdef int j, size
    cdef int32_t tok, cnt
    cdef ngs_ngram g
    cdef ngs_part* part
    cdef int is_new
    while off < n:
        rec = off
        if n - off < RECORD_HEAD:
            err_off[0] = rec
            err_val[0] = n - off
            return PARSE_TRUNC_HEAD
        size = 0
        for j in range(NGRAM_MAX):
            g.tokens[j] = rd_i32(buf + off + 4 * j)
        # a key is 1..4 token ids (>= 0) followed by -1s, as llama.cpp writes them
        while size < NGRAM_MAX and g.tokens[size] >= 0:
            size += 1
        for j in range(size, NGRAM_MAX):
            if g.tokens[j] != TOKEN_NULL:
                size = 0
        if size == 0:
            err_off[0] = rec
            err_val[0] = 0
            return PARSE_BAD_KEY
        ntok = rd_i32(buf + off + 16)
        if ntok <= 0:
            err_off[0] = off + 16
            err_val[0] = ntok
            return PARSE_BAD_NTOKENS
        off += RECORD_HEAD
        if (n - off) // PAIR_SIZE < ntok:
            err_off[0] = off
            err_val[0] = ntok
            return PARSE_TRUNC_PAIRS
        part = ngs_new_part(c, g, &is_new)
        if is_new and part == NULL:
            return PARSE_NOMEM
        for k in range(ntok):
            tok = rd_i32(buf + off)
            cnt = rd_i32(buf + off + 4)
            if tok < 0:
                err_off[0] = off
                err_val[0] = tok
                return PARSE_BAD_TOKEN
            if cnt <= 0:
                err_off[0] = off + 4
                err_val[0] = cnt
                return PARSE_BAD_COUNT
            if part != NULL and ngs_part_emplace(part, tok, cnt) < 0:
                return PARSE_NOMEM
            off += PAIR_SIZE
    return PARSE_OK


cdef Py_ssize_t serialized_size(ngs_cache* c) noexcept nogil:
    cdef ngs_cache.iterator it = c.begin()
    cdef Py_ssize_t total = 0
    while it != c.end():
        total += RECORD_HEAD + PAIR_SIZE * <Py_ssize_t>deref(it).second.size()
        inc(it)
    return total


cdef void serialize(ngs_cache* c, uint8_t* out) noexcept nogil:
    """common_ngram_cache_save into a buffer: outer then inner iteration order."""
    cdef ngs_cache.iterator it = c.begin()
    cdef ngs_part.iterator jt
    cdef ngs_part* part
    cdef int j
    while it != c.end():
        for j in range(NGRAM_MAX):
            wr_i32(out + 4 * j, deref(it).first.tokens[j])
        part = &deref(it).second
        wr_i32(out + 16, <int32_t>part.size())
        out += RECORD_HEAD
        jt = part.begin()
        while jt != part.end():
            wr_i32(out, deref(jt).first)
            wr_i32(out + 4, deref(jt).second)
            out += PAIR_SIZE
            inc(jt)
        inc(it)


cdef int cache_merge(ngs_cache* target, ngs_cache* add) noexcept nogil:
    """common_ngram_cache_merge(target, add): counts add up; new n-grams get a copy of the part.
    Returns 0, or -1 when out of memory."""
    cdef ngs_cache.iterator it = add.begin()
    cdef ngs_part.iterator jt
    cdef ngs_part* part
    cdef ngs_part* dst
    while it != add.end():
        part = &deref(it).second
        dst = ngs_find(target, deref(it).first)
        if dst == NULL:
            if ngs_insert_copy(target, deref(it).first, part) < 0:
                return -1
        else:
            jt = part.begin()
            while jt != part.end():
                if ngs_add(target, deref(it).first, deref(jt).first, deref(jt).second) < 0:
                    return -1
                inc(jt)
        inc(it)
    return 0


cdef Py_ssize_t cache_bytes(ngs_cache* c) noexcept nogil:
    """Approximate heap bytes of a cache (node, bucket and index sizes, malloc rounding)."""
    cdef ngs_cache.iterator it = c.begin()
    cdef Py_ssize_t total = 8 * <Py_ssize_t>(c.bucket_count() + c.index_capacity())
    while it != c.end():
        # outer node: next + hash code + key + part object -> 96; inner node: next + code +
        # pair -> 32
        total += 96 + 32 * <Py_ssize_t>deref(it).second.size()
        total += 8 * <Py_ssize_t>(deref(it).second.bucket_count()
                                  + deref(it).second.index_capacity())
        inc(it)
    return total


cdef int32_t cache_max_token(ngs_cache* c) noexcept nogil:
    """The largest token id in a cache's n-grams and parts, -1 if it is empty."""
    cdef ngs_cache.iterator it = c.begin()
    cdef ngs_part.iterator jt
    cdef int32_t m = -1
    cdef int j
    while it != c.end():
        for j in range(NGRAM_MAX):
            if deref(it).first.tokens[j] > m:
                m = deref(it).first.tokens[j]
        jt = deref(it).second.begin()
        while jt != deref(it).second.end():
            if deref(jt).first > m:
                m = deref(jt).first
            inc(jt)
        inc(it)
    return m


# ---------------------------------------------------------------------------------------------
# Python layer
# ---------------------------------------------------------------------------------------------

class CacheFileError(ValueError):
    """A corrupt or truncated n-gram cache file.

    Attributes ``path`` (the file, or a description of the buffer) and ``offset`` (the byte
    offset of the offending field) are set; the message names both.
    """

    def __init__(self, path, offset, message):
        super().__init__(f"{path}: {message} at byte offset {offset}")
        self.path = path
        self.offset = offset


cdef ngs_ngram make_key(object ngram) except *:
    cdef ngs_ngram g
    cdef int j
    items = tuple(ngram)
    if not 1 <= len(items) <= NGRAM_MAX:
        raise ValueError(f"an n-gram has 1 .. {NGRAM_MAX} tokens, got {len(items)}")
    for j in range(NGRAM_MAX):
        g.tokens[j] = TOKEN_NULL
    for j, t in enumerate(items):
        g.tokens[j] = as_token(t, f"n-gram token {j}")
    return g


cdef tuple key_tuple(const ngs_ngram& g):
    cdef int j
    return tuple([g.tokens[j] for j in range(NGRAM_MAX) if g.tokens[j] != TOKEN_NULL])


cdef list part_list(ngs_part* part):
    cdef ngs_part.iterator it = part.begin()
    out = []
    while it != part.end():
        out.append((deref(it).first, deref(it).second))
        inc(it)
    return out


cdef class NgramCache:
    """One llama.cpp n-gram cache: n-gram (1..4 token ids) -> {next token: count}.

    The iteration orders are those of llama.cpp's ``std::unordered_map`` (libstdc++) after the
    same sequence of updates, loads and merges: the order of every part breaks ties between
    equally likely tokens, the outer order is the saved file's. Lookups and insertions cost
    O(1) whatever the tokens (no hash flooding).

    Notes
    -----
    Memory: about 120 bytes per n-gram plus 40 bytes per (n-gram, token) entry. A static cache
    built from N corpus tokens holds at most N 2-grams; a context cache holds up to 4 n-grams
    per token seen.

    Thread-safety: reads (draft lookups, ``get``, ``to_bytes``, merging it into another
    cache) may run concurrently. ``update``, ``merge`` and ``clear`` release the GIL for long
    work and must not overlap any other call on the same cache: an overlap is detected and
    raises RuntimeError. A cache attached to a `NgramCacheProposer` is frozen: mutating it
    raises RuntimeError, so the proposer's lookups never race with a writer.
    """
    cdef ngs_cache c
    cdef bint _frozen
    cdef readonly object source     # the file it was loaded from (or from_bytes' source), or None
    cdef bint writing           # a mutating call is running (possibly without the GIL)
    cdef int readers            # reading calls running without the GIL
    cdef object __weakref__

    def __len__(self):
        return self.c.size()

    @property
    def n_entries(self):
        """Number of (n-gram, next token) pairs."""
        self._check_read()
        cdef ngs_cache.iterator it = self.c.begin()
        cdef Py_ssize_t total = 0
        while it != self.c.end():
            total += deref(it).second.size()
            inc(it)
        return total

    @property
    def frozen(self):
        """True once attached to a proposer (then read-only)."""
        return self._frozen

    def memory_bytes(self):
        """Approximate heap bytes held."""
        self._check_read()
        return cache_bytes(&self.c)

    # The flags are only read and written with the GIL held, which makes check-and-set atomic.
    cdef int _check_read(self) except -1:
        if self.writing:
            raise RuntimeError("NgramCache read while another thread modifies it")
        return 0

    cdef int _begin_write(self) except -1:
        if self._frozen:
            raise RuntimeError("this NgramCache is attached to a proposer and is read-only")
        if self.writing or self.readers:
            raise RuntimeError("NgramCache modified while another thread uses it")
        self.writing = True
        return 0

    def update(self, tokens, int ngram_min=NGRAM_MIN, int ngram_max=NGRAM_MAX):
        """Count the n-grams of one token sequence, like ``common_ngram_cache_update`` with
        ``nnew = len(tokens)``: every n-gram of size ngram_min..ngram_max inside ``tokens``
        (none crossing its ends) and the token after it. Releases the GIL."""
        if not 1 <= ngram_min <= ngram_max <= NGRAM_MAX:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max <= {NGRAM_MAX}")
        arr = as_tokens(tokens, "tokens")
        cdef const token_t[::1] view = arr
        cdef Py_ssize_t n = view.shape[0]
        cdef int rc
        if n == 0:
            return
        self._begin_write()
        try:
            with nogil:
                rc = cache_update(&self.c, &view[0], n, 0, False, ngram_min, ngram_max)
        finally:
            self.writing = False
        if rc < 0:
            raise MemoryError("out of memory while updating the n-gram cache")

    def merge(self, NgramCache other not None):
        """Add every count of ``other`` to this cache (``common_ngram_cache_merge``)."""
        cdef int rc
        if other is self:
            raise ValueError("cannot merge a cache into itself")
        other._check_read()
        self._begin_write()
        other.readers += 1
        try:
            with nogil:
                rc = cache_merge(&self.c, &other.c)
        finally:
            other.readers -= 1
            self.writing = False
        if rc < 0:
            raise MemoryError("out of memory while merging n-gram caches")

    def clear(self):
        """Remove every n-gram."""
        self._begin_write()
        self.c.clear()
        self.writing = False

    def copy(self):
        """An independent, unfrozen copy (same iteration order)."""
        self._check_read()
        cdef NgramCache dup = NgramCache()
        if ngs_copy_cache(&dup.c, &self.c) < 0:
            raise MemoryError("out of memory while copying an n-gram cache")
        return dup

    def get(self, ngram, default=None):
        """The ``[(token, count), ...]`` following ``ngram`` (a sequence of 1..4 ids), in the
        container's iteration order (the order that breaks ties), or ``default``."""
        self._check_read()
        cdef ngs_ngram g = make_key(ngram)
        cdef ngs_part* part = ngs_find(&self.c, g)
        if part == NULL:
            return default
        return part_list(part)

    def __contains__(self, ngram):
        self._check_read()
        cdef ngs_ngram g = make_key(ngram)
        return ngs_find(&self.c, g) != NULL

    def max_token(self):
        """The largest token id the cache holds (in an n-gram or as a next token), -1 if empty;
        e.g. to check that it fits a model's vocabulary. Releases the GIL."""
        cdef int32_t m
        self._check_read()
        self.readers += 1
        try:
            with nogil:
                m = cache_max_token(&self.c)
        finally:
            self.readers -= 1
        return m

    def _bucket_count(self, ngram=None):
        """Buckets of the outer table, or of the part of ``ngram`` (KeyError if absent): the
        counts libstdc++'s unordered_map would have. For tests."""
        self._check_read()
        if ngram is None:
            return self.c.bucket_count()
        cdef ngs_ngram g = make_key(ngram)
        cdef ngs_part* part = ngs_find(&self.c, g)
        if part == NULL:
            raise KeyError(tuple(ngram))
        return part.bucket_count()

    def items(self):
        """List of ``(ngram tuple, [(token, count), ...])`` in iteration (= file) order."""
        self._check_read()
        cdef ngs_cache.iterator it = self.c.begin()
        out = []
        while it != self.c.end():
            out.append((key_tuple(deref(it).first), part_list(&deref(it).second)))
            inc(it)
        return out

    def to_dict(self):
        """``{ngram tuple: {token: count}}`` (order-free view, for comparisons)."""
        return {k: dict(v) for k, v in self.items()}

    def to_bytes(self):
        """The cache in llama.cpp's file format, records in ``common_ngram_cache_save`` order:
        per n-gram 4 little-endian int32 ids (unused tail -1), int32 N, N (token, count)."""
        cdef Py_ssize_t size
        cdef uint8_t* buf
        self._check_read()
        size = serialized_size(&self.c)
        data = PyBytes_FromStringAndSize(NULL, size)
        buf = <uint8_t*>PyBytes_AS_STRING(data)
        self.readers += 1
        try:
            with nogil:
                serialize(&self.c, buf)
        finally:
            self.readers -= 1
        return data

    @classmethod
    def from_bytes(cls, data, source="<bytes>"):
        """Parse llama.cpp's file format (records inserted in file order, a repeated n-gram or
        token keeps its first occurrence, like ``common_ngram_cache_load``).

        Raises `CacheFileError` naming ``source`` and the byte offset for a truncated or
        corrupt buffer. Releases the GIL while parsing."""
        cdef const uint8_t[::1] view = memoryview(data).cast("B") if len(data) else b"\0"
        cdef Py_ssize_t n = len(data)
        cdef Py_ssize_t err_off = 0
        cdef int64_t err_val = 0
        cdef int rc
        cdef NgramCache cache = cls()
        with nogil:
            rc = parse_cache(&cache.c, &view[0], n, &err_off, &err_val)
        if rc == PARSE_OK:
            cache.source = source
            return cache
        if rc == PARSE_NOMEM:
            raise MemoryError(f"{source}: out of memory while loading the n-gram cache")
        if rc == PARSE_TRUNC_HEAD:
            msg = (f"truncated file: n-gram record needs {RECORD_HEAD} bytes, "
                   f"only {err_val} left")
        elif rc == PARSE_TRUNC_PAIRS:
            msg = (f"truncated file: {err_val} (token, count) pairs need {PAIR_SIZE * err_val} "
                   f"bytes, only {n - err_off} left")
        elif rc == PARSE_BAD_NTOKENS:
            msg = f"corrupt file: n-gram record with {err_val} tokens (must be > 0)"
        elif rc == PARSE_BAD_COUNT:
            msg = f"corrupt file: token count {err_val} (must be > 0)"
        elif rc == PARSE_BAD_TOKEN:
            msg = f"corrupt file: token id {err_val} (must be >= 0)"
        else:
            toks = [rd_i32(&view[0] + err_off + 4 * j) for j in range(NGRAM_MAX)]
            msg = (f"corrupt file: invalid n-gram key {toks} (1..4 token ids >= 0, "
                   f"then -1s)")
        if err_off <= RECORD_HEAD:
            # Not even the first record parses: the file is no n-gram cache at all (the format
            # has no magic number), which "truncated" would misreport.
            msg = (f"not an n-gram cache file (llama.cpp's lookup-cache format: records of 4 "
                   f"int32 tokens, an int32 count N, N int32 (token, count) pairs): {msg}")
        raise CacheFileError(source, err_off, msg)

    def __reduce__(self):
        return (_cache_from_bytes, (self.to_bytes(),))

    def __repr__(self):
        return f"<NgramCache {self.c.size()} n-grams>"


def _cache_from_bytes(data):
    return NgramCache.from_bytes(data)


cdef class NgramCacheProposer(Proposer):
    """llama.cpp's ``ngram-cache`` speculative type (common_speculative_impl_ngram_cache),
    bit-exact.

    Each slot keeps a context cache learned online and ``cache_size`` (the length of the stream
    it has seen); the dynamic and static caches are read-only and shared by all slots (llama.cpp
    gives each slot an identical copy, which behaves the same). Drafts are at most 8 tokens.
    begin and accept are no-ops, and nothing is reset between requests (as in llama.cpp), unless
    ``restart`` is set.

    Parameters
    ----------
    n_slots : int
        Number of server slots.
    static, dynamic : NgramCache or None
        The ``--lookup-cache-static`` / ``--lookup-cache-dynamic`` caches (see
        `ngramspec.cache_file.load_cache`); they become frozen (read-only).
    restart : bool (default False; not llama.cpp's behaviour)
        begin() frees the slot's context cache and sets its size to 0, so the next draft
        learns the whole new prompt as a new proposer would (the golden files' "fresh" state).
        Without it, a server slot keeps counting n-grams of unrelated earlier requests and
        learns nothing from a prompt shorter than what it has already seen.
    n_vocab : int or None
        The target model's vocabulary size (see `set_vocab`): drafts never hold a token id
        >= n_vocab, and caches holding one are refused. None (default): no bound.

    Notes
    -----
    Memory: per slot, the context cache grows without bound in a long-lived slot (about four
    n-grams per token of new context, ~150 bytes each); with ``restart`` it holds one request.
    `reset` empties it. The static and dynamic caches are held once.

    Thread-safety: one thread per slot at a time. A draft whose unseen context is long (the
    first call of a request) hashes it without the GIL, and freeing a large context cache
    (begin with ``restart``, `reset`) also runs without it; another thread may then use other
    slots, while a second call on the same slot raises RuntimeError. The shared caches are
    frozen, so concurrent reads are safe. Call `set_vocab` before the slots are in use.
    """
    cdef vector[ngs_slot] slots
    cdef readonly NgramCache static_cache
    cdef readonly NgramCache dynamic_cache
    cdef readonly bint restart
    cdef readonly object n_vocab
    cdef int64_t vocab_end              # n_vocab, or 2**31 (no bound)
    cdef object max_tokens              # (static, dynamic) max_token(), computed once
    cdef ngs_cache* static_c
    cdef ngs_cache* dynamic_c

    def __cinit__(self):
        self.vocab_end = VOCAB_UNBOUNDED

    def __init__(self, n_slots=1, NgramCache static=None, NgramCache dynamic=None,
                 restart=False, n_vocab=None):
        super().__init__("ngram-cache", n_slots, CACHE_N_DRAFT)   # checks n_slots; runs once
        self.restart = bool(restart)
        self.static_cache = static if static is not None else NgramCache()
        self.dynamic_cache = dynamic if dynamic is not None else NgramCache()
        self.static_cache._frozen = True
        self.dynamic_cache._frozen = True
        self.static_c = &self.static_cache.c
        self.dynamic_c = &self.dynamic_cache.c
        self.max_tokens = None
        self.slots.clear()
        try:
            self.slots.resize(self.n_slots)
        except MemoryError:
            self.forget_slots()              # no slot to call (see Proposer.forget_slots)
            raise
        self.set_vocab(n_vocab)

    def set_vocab(self, n_vocab):
        """Bound the drafts to the target model's vocabulary, token ids 0 .. n_vocab - 1
        (e.g. ``llm.n_vocab()``); None removes the bound (llama.cpp's behaviour).

        Raises ValueError naming the cache file and the token if the static or dynamic cache
        holds a token id >= n_vocab, as a cache built with another tokenizer does: its drafts
        would be tokens the target cannot decode (llama_decode fails, older llama.cpp builds
        read out of bounds). The bound is then left as it was. Whatever their source (the
        slot's context cache learns whatever context the driver passes), drafts end before
        the first token >= n_vocab.
        """
        if n_vocab is None:
            self.n_vocab = None
            self.vocab_end = VOCAB_UNBOUNDED
            return
        n_vocab = check_int("n_vocab", n_vocab, 1, VOCAB_UNBOUNDED)
        if self.max_tokens is None:     # the shared caches are frozen: scan them once
            self.max_tokens = (self.static_cache.max_token(), self.dynamic_cache.max_token())
        for which, cache, top in (("static", self.static_cache, self.max_tokens[0]),
                                  ("dynamic", self.dynamic_cache, self.max_tokens[1])):
            if top >= n_vocab:
                source = cache.source if cache.source is not None else f"the {which} cache"
                raise ValueError(
                    f"{source}: token id {top} is outside the model's vocabulary (n_vocab = "
                    f"{n_vocab}: ids 0 .. {n_vocab - 1}); was this {which} n-gram cache "
                    f"built with another tokenizer?")
        self.n_vocab = n_vocab
        self.vocab_end = n_vocab

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        if self.restart:
            self._restart_slot(slot)
        return 0    # llama.cpp: begin is a no-op

    cdef int _restart_slot(self, Py_ssize_t slot) except -1:
        """Free the slot's context cache, cache_size 0: the state of a new proposer. The
        caller holds the slot (its busy flag, see `proposer_begin` and `reset`)."""
        cdef ngs_slot* st = &self.slots[slot]
        if st.context.size() >= NOGIL_FREE_NGRAMS:
            with nogil:
                ngs_free(&st.context)
        else:
            ngs_free(&st.context)
        st.cache_size = 0
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef ngs_slot* st = &self.slots[slot]
        cdef Py_ssize_t cs = <Py_ssize_t>st.cache_size, na
        cdef int rc = 0
        # Learn the n-grams inside the unseen chunk inp[cache_size:] + [sampled] only, as
        # common_speculative_impl_ngram_cache::draft's common_ngram_cache_update(..., n_new)
        # does: n-grams crossing the chunk boundary are never counted.
        if cs < n + 1:
            na = n - cs
            if na > NOGIL_MIN_TOKENS:
                with nogil:
                    rc = cache_update(&st.context, inp + cs, na, sampled, True,
                                      NGRAM_MIN, NGRAM_MAX)
            else:
                rc = cache_update(&st.context, inp + cs, na, sampled, True, NGRAM_MIN, NGRAM_MAX)
            if rc < 0:
                raise MemoryError("out of memory while updating the ngram-cache context cache")
            st.cache_size = n + 1
        return cache_draft(&st.context, self.dynamic_c, self.static_c, inp, n, sampled, out,
                           CACHE_N_DRAFT, self.vocab_end)

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        return 0    # llama.cpp: accept is a no-op

    cdef int _check_slot(self, Py_ssize_t slot) except -1:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return 0

    cdef ngs_slot* _slot(self, Py_ssize_t slot) except NULL:
        """A slot's state for reading, refused while a call on the slot runs."""
        self._check_slot(slot)
        if self.busy[slot]:
            raise_busy(self.name, slot)
        return &self.slots[slot]

    def reset(self, slot=None):
        """Forget what one slot (or every slot) has learned: context cache freed, cache_size 0.
        Equivalent to a new proposer with the same static and dynamic caches (the "fresh"
        state), without reloading them. A large cache is freed without the GIL."""
        cdef Py_ssize_t i
        for i in (range(self.n_slots) if slot is None else (slot,)):
            self._check_slot(i)
            claim_slot(self.busy, i, self.name)
            try:
                self._restart_slot(i)
            finally:
                self.busy[i] = 0

    def cache_size(self, Py_ssize_t slot=0):
        """Number of stream tokens the slot's context cache has seen (never reset by llama.cpp)."""
        return self._slot(slot).cache_size

    def context_cache(self, Py_ssize_t slot=0):
        """A copy of the slot's context cache, e.g. to merge into a dynamic cache file as
        llama.cpp's ``lookup`` example does at exit."""
        cdef ngs_slot* st = self._slot(slot)
        cdef NgramCache dup = NgramCache()
        if ngs_copy_cache(&dup.c, &st.context) < 0:
            raise MemoryError("out of memory while copying an n-gram cache")
        return dup

    def memory_bytes(self):
        """Approximate heap bytes: every slot's context cache plus the shared caches."""
        cdef Py_ssize_t i, total = 0
        for i in range(self.n_slots):
            total += cache_bytes(&self._slot(i).context)
        return total + cache_bytes(self.static_c) + cache_bytes(self.dynamic_c)

    def __repr__(self):
        return (f"<NgramCacheProposer n_slots={self.n_slots} static={len(self.static_cache)} "
                f"dynamic={len(self.dynamic_cache)} n-grams restart={bool(self.restart)}>")


def _draft_once(Proposer p, Py_ssize_t slot, inp, sampled):
    """One ``c_draft`` call through `proposer_draft` (the slot flag, no engine, no statistics);
    for tests. Returns a list."""
    cdef cnp.ndarray arr = as_tokens(inp, "inp")
    cdef token_t tok = as_token(sampled, "sampled")
    cdef vector[token_t] out
    cdef token_t dummy = 0
    cdef Py_ssize_t k, i, n = cnp.PyArray_DIMS(arr)[0]
    if not 0 <= slot < p.n_slots:
        raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {p.n_slots - 1}")
    out.resize(p.max_draft)
    k = proposer_draft(p, slot, tok_ptr(arr) if n else &dummy, n, tok, out.data())
    return [out[i] for i in range(k)]


# ---------------------------------------------------------------------------------------------
# For tests: llama.cpp's own containers
# ---------------------------------------------------------------------------------------------

cdef class _StdCache:
    """The same operations as `NgramCache` (update, merge, load, clear, copy) on llama.cpp's
    containers themselves, libstdc++'s ``std::unordered_map`` with llama.cpp's n-gram hash,
    whose lookups scan buckets: the reference for `NgramCache`'s iteration orders. For tests
    only (crafted input makes it quadratic).

    Notes
    -----
    Memory: libstdc++'s nodes, about 100 bytes per n-gram and 32 per (n-gram, token) entry.

    Thread-safety: none (tests use it from one thread); every method holds the GIL.
    """
    cdef ngs_std_cache c

    def update(self, tokens, int ngram_min=NGRAM_MIN, int ngram_max=NGRAM_MAX):
        """common_ngram_cache_update over ``tokens`` (size outer, position inner)."""
        arr = as_tokens(tokens, "tokens")
        cdef const token_t[::1] v = arr
        cdef Py_ssize_t i, n = v.shape[0]
        cdef int size, j
        cdef ngs_ngram g
        for size in range(ngram_min, ngram_max + 1):
            for j in range(NGRAM_MAX):
                g.tokens[j] = TOKEN_NULL
            for i in range(size, n):
                for j in range(size):
                    g.tokens[j] = v[i - size + j]
                ngs_std_add(&self.c, g, v[i], 1)

    def merge(self, _StdCache other not None):
        ngs_std_merge(&self.c, &other.c)

    def load(self, records):
        """common_ngram_cache_load's insertions for ``[(ngram, [(token, count), ...]), ...]``:
        a repeated n-gram or token keeps its first occurrence."""
        cdef ngs_ngram g
        cdef ngs_std_part* part
        for ngram, pairs in records:
            g = make_key(ngram)
            part = ngs_std_new_part(&self.c, g)
            if part != NULL:
                for tok, cnt in pairs:
                    part.emplace(tok, cnt)

    def clear(self):
        self.c.clear()

    def copy(self):
        cdef _StdCache dup = _StdCache()
        dup.c = self.c
        return dup

    def bucket_count(self, ngram=None):
        """Buckets of the outer map, or of the part of ``ngram``."""
        cdef ngs_std_cache.iterator it = self.c.begin()
        if ngram is None:
            return self.c.bucket_count()
        key = tuple(ngram)
        while it != self.c.end():
            if key_tuple(deref(it).first) == key:
                return deref(it).second.bucket_count()
            inc(it)
        raise KeyError(key)

    def items(self):
        """Like `NgramCache.items`: iteration order, outer and inner."""
        cdef ngs_std_cache.iterator it = self.c.begin()
        cdef ngs_std_part.iterator jt
        out = []
        while it != self.c.end():
            pairs = []
            jt = deref(it).second.begin()
            while jt != deref(it).second.end():
                pairs.append((deref(jt).first, deref(jt).second))
                inc(jt)
            out.append((key_tuple(deref(it).first), pairs))
            inc(it)
        return out
