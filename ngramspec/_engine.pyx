# cython: language_level=3
"""The engine that chains llama.cpp's draftless proposers (llama.cpp's glue:
``common_speculative_begin`` / ``_draft`` / ``_accept``, with its statistics); `ngramspec.engine`
builds its chains (`SpecEngine`).

The kernels are split by concern, each proposer in its own module: ``_proposer`` (allocator,
argument validation, the `Proposer` base classes), ``_simple`` (ngram-simple), ``_map``
(ngram-map-k / k4v), ``_mod`` (ngram-mod and its pool), ``_cache`` (ngram-cache) and
``_suffix`` (ngram-suffix); the shared inline helpers, with their contracts, are in
``_types.pxd`` (token type, thresholds), ``_hash.pxd`` (llama.cpp's n-gram hashes, the rolling
update), ``_hashtable.pxd`` (the open-addressing table) and ``_posindex.pxd`` (the position
index); ngram-cache's containers and kernels in ``_ngram_cache.pxd``, ngram-suffix's
automaton in ``_sam.pxd``. `ngramspec` re-exports their public names. The behaviour is
llama.cpp's at commit 3ce7da2c (b10102), quirks included: the comments name the llama.cpp
functions each kernel reproduces (``common/ngram-map.cpp``, ``common/ngram-mod.cpp``,
``common/speculative.cpp``).
"""
import numpy as np

cimport numpy as cnp
from cpython.long cimport PyLong_AsSsize_t, PyLong_CheckExact
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

# the base class is cimported as CProposer (its Python name is _proposer's Proposer)
from ngramspec._proposer cimport (Proposer as CProposer, alloc_per_slot, as_token, as_tokens,
                                  buffer_owner, calloc, claim_slot, copy_tokens, exact_int_in,
                                  proposer_accept, proposer_begin, proposer_draft, tok_ptr)
from ngramspec._types cimport token_t

from ngramspec._mod import ModPool, ModProposer
from ngramspec._proposer import _tokens_slow, check_int

cnp.import_array()

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


# Every empty draft is this one read-only array (saves an allocation per draftless step).
EMPTY_DRAFT = np.empty(0, dtype=np.int32)
EMPTY_DRAFT.setflags(write=False)
cdef cnp.ndarray EMPTY = EMPTY_DRAFT         # the same, without a module-dict lookup

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
    thread per slot at a time: a call on a slot while another runs on it raises RuntimeError and
    leaves the slot alone); statistics are updated with the GIL held. ``__init__`` runs once:
    calling it again raises RuntimeError.
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
    cdef unsigned char* busy                 # per slot: 1 while a call on the slot runs

    def __cinit__(self):
        # the pointers start NULL (Cython zeroes C attributes); until __init__ the engine is an
        # empty chain without slots
        self.proposers = ()

    def __init__(self, proposers, n_slots=1, pool=None):
        cdef Py_ssize_t i
        if self.busy != NULL:
            raise RuntimeError("SpecEngine is already initialised")
        n_slots = check_int("n_slots", n_slots, 1)
        if pool is not None and not isinstance(pool, ModPool):
            raise TypeError(f"pool must be a ModPool, got {type(pool).__name__}")
        proposers = tuple(proposers)
        for p in proposers:
            if not isinstance(p, CProposer):
                raise TypeError(f"proposers must be Proposer instances, got {type(p).__name__}")
            if (<CProposer>p).n_slots < n_slots:
                raise ValueError(f"proposer {p.name} has {p.n_slots} slots, the engine needs "
                                 f"{n_slots}")
        self.proposers = proposers
        if pool is None:
            pool = next((p.pool for p in proposers if isinstance(p, ModProposer)), None)
        self.pool = pool
        self.n_prop = len(proposers)
        self.max_draft = max([(<CProposer>p).max_draft for p in proposers] or [1])
        try:
            self.counters = <Counters*>calloc(max(self.n_prop, 1), sizeof(Counters))
            if self.counters == NULL:
                raise MemoryError("out of memory for the engine's statistics")
            for i in range(self.n_prop):
                self.counters[i].acc_per_pos = <uint64_t*>calloc(self.max_draft,
                                                                 sizeof(uint64_t))
                if self.counters[i].acc_per_pos == NULL:
                    raise MemoryError("out of memory for the engine's statistics")
            self.impl_last = <int*>alloc_per_slot(n_slots, sizeof(int), "the engine's slots")
            self.pending = <Py_ssize_t*>alloc_per_slot(n_slots, sizeof(Py_ssize_t),
                                                       "the engine's slots")
            self.checked = <Py_ssize_t*>alloc_per_slot(n_slots, sizeof(Py_ssize_t),
                                                       "the engine's slots")
            self.checked_data = <size_t*>alloc_per_slot(n_slots, sizeof(size_t),
                                                         "the engine's slots")
            self.out = <token_t*>alloc_per_slot(n_slots, self.max_draft * sizeof(token_t),
                                                "the engine's draft buffers")
            self.checked_owner = [None] * n_slots
            self.busy = <unsigned char*>alloc_per_slot(n_slots, 1, "the engine's slots")
        except MemoryError:
            self.free_state()                # no slot to call; __init__ may run again
            raise
        self.n_slots = n_slots
        for i in range(n_slots):
            self.impl_last[i] = -1
            self.pending[i] = -1

    def __dealloc__(self):
        self.free_state()

    cdef void free_state(self) noexcept:
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
        free(self.busy)
        self.counters = NULL
        self.impl_last = NULL
        self.pending = NULL
        self.checked = NULL
        self.checked_data = NULL
        self.out = NULL
        self.busy = NULL
        self.n_prop = 0
        self.n_slots = 0

    @property
    def types(self):
        """Proposer type names in priority order."""
        return [p.name for p in self.proposers]

    def set_vocab(self, n_vocab):
        """Bound the drafts to the target model's vocabulary, token ids 0 .. n_vocab - 1
        (e.g. ``llm.n_vocab()``; None: no bound), in every proposer that drafts tokens from
        outside the request (ngram-cache's cache files: `NgramCacheProposer.set_vocab`).
        Raises ValueError naming the cache file and the token if a loaded cache holds a
        token id >= n_vocab (built with another tokenizer).

        Thread-safety: call while no slot is drafting (before serving, between requests).
        """
        if n_vocab is not None:
            check_int("n_vocab", n_vocab, 1, 1 << 31)
        for p in self.proposers:
            setter = getattr(p, "set_vocab", None)
            if setter is not None:
                setter(n_vocab)

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
        cdef CProposer p
        claim_slot(self.busy, s, "engine")
        self.pending[s] = -1
        self.checked[s] = 0                  # the next context is checked whole
        self.checked_owner[s] = None
        try:
            for k in range(self.n_prop):
                p = <CProposer>self.proposers[k]
                t0 = ngs_ticks()
                proposer_begin(p, s, t, n)
                self.counters[k].t_begin += ticks_since(t0)
                self.counters[k].calls_b += 1
        finally:
            self.busy[s] = 0

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
        cdef Py_ssize_t s = self.slot_index(slot), bound = 0
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
        if n_max is not None:
            # any bound >= max_draft truncates nothing (and fits a Py_ssize_t)
            if exact_int_in(n_max, 0, 1LL << 62, &v):
                bound = min(<Py_ssize_t>v, self.max_draft)
            else:
                bound = min(check_int("n_max", n_max, 0), self.max_draft)
        # every argument is valid: only now change the slot's state
        claim_slot(self.busy, s, "engine")
        try:
            return self.draft_chain(s, arr, context, t, L, tok, out, n_max is not None, bound)
        finally:
            self.busy[s] = 0

    cdef object draft_chain(self, Py_ssize_t s, cnp.ndarray arr, object context,
                            const token_t* t, Py_ssize_t L, token_t tok, token_t* out,
                            bint bounded, Py_ssize_t bound):
        """draft()'s work on a validated call, with the slot marked busy."""
        cdef Py_ssize_t k, length = 0
        cdef uint64_t t0
        cdef Counters* c
        cdef CProposer p
        if arr is context:
            self.checked[s] = L
            self.checked_data[s] = <size_t>cnp.PyArray_DATA(arr)
            self.checked_owner[s] = buffer_owner(arr)
        else:
            self.checked[s] = 0
            self.checked_owner[s] = None
        self.pending[s] = -1
        if bounded and bound == 0:
            return EMPTY
        for k in range(self.n_prop):
            p = <CProposer>self.proposers[k]
            c = &self.counters[k]
            t0 = ngs_ticks()
            length = proposer_draft(p, s, t, L, tok, out)
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
        cdef CProposer p
        cdef uint64_t t0 = ngs_ticks()
        claim_slot(self.busy, s, "engine")
        try:
            self.pending[s] = -1
            for i in range(n):
                c.acc_per_pos[i] += 1
            if n > c.n_pos:
                c.n_pos = n
            if n > 0:
                c.acc_drafts += 1
                c.acc_tokens += n
            proposer_accept(<CProposer>self.proposers[which], s, n, False)
            c.calls_a += 1
            c.t_accept += ticks_since(t0)
            for k in range(self.n_prop):
                if k != which:
                    proposer_accept(<CProposer>self.proposers[k], s, n, True)
        finally:
            self.busy[s] = 0

    def last_proposer(self, slot):
        """Index in `proposers` of the proposer that made the slot's last non-empty draft (the
        one its next `accept` goes to), or -1 before its first. Lets a draft-length policy
        weigh a draft by its proposer's record."""
        return self.impl_last[self.slot_index(slot)]

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
