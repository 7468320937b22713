# cython: language_level=3
# distutils: language = c++
"""ngram-suffix: ngramspec's own draftless proposer (issue 7).

Compiled as C++ (setup.py's CPP_MODULES); it uses no C++ library, only the C++ toolchain.

Model
-----
*Local index.* Every slot keeps a suffix automaton (SAM) of its current request, prompt +
output so far, extended online one token at a time (amortized O(1) per token, never a rescan).
The state that the last token's suffix link points to is the longest earlier occurrence of the
current suffix, so the local match costs O(1) per call whatever its length.

*Global store.* One suffix automaton shared by all slots holds the outputs of finished
requests, each with the newest few tokens of its prompt (the chat template's assistant header),
concatenated with a separator that no token matches; a request's output is stored when it
ends (`end`, which the engine's `end` and the plug-ins call) or, failing that, when its slot
begins the next one. Each slot follows the store with a matching-statistics cursor
(amortized O(1) per new token). Its budget is fixed in tokens; when full it evicts whole
sequences, oldest first, and rebuilds over the rest.

*Continuations by frequency.* A draft walks an automaton down from the matched state, taking at
each step the continuation seen most often after the current context (the latest occurrence
breaks ties). A local walk that runs into the end of the text goes on copying its own draft
(the context read as periodic, an LZ77 copy overlapping itself), so a loop of period p is not
drafted p tokens at a time. The local and global walks run in lockstep.

*Adaptive length.* Every drafted token gets a probability from a calibration table
indexed by source, match-length bucket, continuation-frequency bucket, position in the draft
(for the first token: whether the last call foresaw what came) and whether the other source
agrees so far. The table learns online from every call, drafted or not (each source's walk is
scored against the tokens that arrive next), shrinks sparse cells towards coarser ones and
forgets with a horizon of ~1000 outcomes per cell. A token is drafted while the probability
that the whole draft so far is accepted stays at or above

    max(min_prob, gain_cost * min(G, 8)) + draft_cost * j

where j is the token's position and G the accepted draft tokens per step (a slow moving
average): a draft token costs verification work, worth less to a server that already gains a
lot per step, and more so the longer the draft. Of the two walks, the one with the larger
expected number of accepted tokens is the draft; at most ``max_draft`` tokens.

*Learned as a server.* The calibration table and G describe the workload, not the slot: one
of each serves all slots (issue 35). With a table per slot, N slots each learned from 1/N of
the traffic and drafted from sparse cells: replayed at 256 slots, ngram-suffix fell by a
third. A slot scores its last predictions at its next draft call and appends the outcomes to
a pending list of its own; the same call then *tries* the calibration's lock and, if free,
folds the list into the shared cells in order (cal_fold), else keeps it for its next call.
Drafts read the cells without any lock (relaxed atomic loads; a fold writes each word
whole). So the draft path never waits; with one thread every outcome is folded by the call
that observed it and the table is exactly one table learning from every slot in call order
(deterministic, and what tests/reference_suffix.py models); under contention a fold is late
by a call or two, and a slot whose list is full drops new outcomes, counted in
`calibration_stats`. Atomic increments were the alternative: the halving that forgets
touches two counters at once and would need a compare-and-swap loop per cell, for no gain
over a lock that is only ever tried.

*Learned as a fleet.* Data-parallel replicas of an engine (`ngramspec.store_log`) share the
table too: the fold also counts, per cell, the outcomes it added since the last
`take_calibration`, which hands them out as count deltas (at most one per cell: bounded by the
table's size, whatever the traffic); another replica's `fold_calibration` adds them as if its
own slots had observed them, the tried count following exactly the path the forgetting rule
gives it, so a cell's horizon stays ~1000 outcomes of the fleet's traffic (see its docstring
for what the merge approximates); the tokens-per-step average G likewise takes the other
replicas' steps (their count and tokens). Deltas merged in are not handed out again. Both calls take
the calibration's lock, which drafts only try: the log never makes a draft wait.

*Draft trees.* For an engine that verifies a tree of a fixed number of tokens whatever it holds
(SGLang), `SuffixProposer.draft_tree` builds the tree of at most that many tokens with the
largest expected accepted length: nodes best first by estimated path probability from the
root (the draft's tokens scored by the calibration, other continuations by their counts),
over both sources (one best-first tree each, merged by path probability). The chain
is not forced first: where the next token is uncertain, siblings near the root are worth
more than the chain's tail; where the last token was never seen before, the slot's tree
starts from the request's most frequent tokens. llama.cpp's paths never ask for one.

*Many slots of long contexts.* At 64-256 requests of 32k tokens the automata (~1 GB) outgrow
every cache and a draft's cost is its cache misses, chains of dependent loads (the count walk,
the draft walk, the tree) that one slot cannot overlap. A state's four fields and a
transition's four lie in one 16-byte struct each (one cache line per step of a walk), and a
host that drafts for many slots per step calls `SuffixProposer.prefetch` first: it follows
those chains for sixteen slots at once, round-robin with prefetch instructions, so that their
misses overlap and the drafts find their lines in cache (read-only: nothing depends on it).

Memory
------
An automaton over n tokens has at most 2n states (4 int32 and a first transition each) and
3n transitions (4 int32 each), plus a power-of-two hash table of at least 4n int32 and the n
tokens: ``sam_bytes(n)``, 108 bytes per token when n is a power of two, never more than 124. A slot's automaton is
allocated by doubling as its context grows (from 1024 tokens) and never beyond ``max_context``
tokens: a longer context is re-indexed over its newest half. The global store likewise grows
up to ``global_tokens``. Per slot besides: ~8 * (max_draft + 1) int32 of buffers (~8 KiB,
the pending outcomes included); once for the proposer: 3600 uint32 of calibration.
Defaults: at most 6.8 MiB per slot (65536 tokens) and 108 MiB for
a full store (2**20 tokens); `memory_bytes` reports what is held.

Thread-safety
-------------
One thread per slot at a time (the engine's rule); per-slot state is not shared. The
calibration is shared: written under its own PyThread lock, which a draft only tries, and
read without it (see *Learned as a server*). The global store is protected by a PyThread lock. ``begin`` inserts the slot's previous request under it
with the GIL released (an insertion may rebuild the store). A draft only *tries* the lock: when
another thread holds it, the draft uses the local index alone instead of waiting, so drafting
never blocks on the store. With one thread drafts are deterministic; with several, the shared
calibration makes them depend on the order of the calls.
"""
from collections import deque

import numpy as np

cimport numpy as cnp
from cpython.pythread cimport (NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock,
                               PyThread_allocate_lock, PyThread_free_lock, PyThread_release_lock,
                               PyThread_type_lock)
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memmove, memset

from ngramspec._proposer cimport (Proposer, alloc_per_slot, as_token, as_tokens, claim_slot,
                                  malloc, proposer_accept, proposer_begin, proposer_draft,
                                  realloc, tok_ptr)
from ngramspec._sam cimport (COUNT_DEPTH, MAX_GLOBAL_MATCH, Sam, child_after, sam_bytes_for, sam_hash,
                             sam_clear, sam_extend, sam_find, sam_free, sam_rebuild_tail,
                             sam_reserve, sam_step, top_child)
from ngramspec._types cimport NOGIL_MIN_TOKENS, token_t

from ngramspec._proposer import check_int
from ngramspec.validation import OutOfRange, Refused, WrongType, check_real

cnp.import_array()

# Calibration cells: source (local, global) x match-length bucket x frequency bucket x stage
# x agreement; coarse cells: source x match-length bucket x stage.
DEF N_SRC = 2
DEF N_LB = 10
DEF N_FB = 7
DEF N_ST = 6
DEF N_AG = 2
DEF N_CELLS = 1680
DEF N_COARSE = 120
DEF N_CAL = 1800
# Probabilities are Q16 fixed point, so the kernel and the Python reference agree bit for bit
# on every platform (no float contraction or rounding-mode questions).
DEF ONE = 65536
# Weight, in observations, of the coarse estimate in a fine cell's.
DEF CAL_PRIOR = 16
# A cell's counts are halved once it has seen this many outcomes (forgetting).
DEF CAL_WINDOW = 1024
# A per-cell delta handed to other replicas counts at most this many outcomes.
DEF DELTA_MAX = 0x7FFFFFFF
# cal_merge replays at most this many forgetting windows of a delta: older outcomes are gone
# from the counts (a count < CAL_WINDOW halved this often is 0).
DEF MERGE_CYCLES = 32
# The slot's tokens-per-step average forgets with weight 2**-10 per step (~ the last 1000
# steps: a property of the workload, not of the current sentence).
DEF RATE_SHIFT = 10
# The gain term of the threshold saturates at this many accepted tokens per step.
DEF GAIN_CAP = 8
# Separator between the global store's sequences: never a valid token, so no match spans two.
DEF SEP = -1
# Prompts longer than NOGIL_MIN_TOKENS (see _types.pxd) are indexed with the GIL released.

N_CALIBRATION_CELLS = N_CELLS


# The kernels, one concern a file (textual includes: see each file's first lines).
include "_suffix_calibration.pxi"
include "_suffix_draft.pxi"
include "_suffix_store.pxi"
include "_suffix_prefetch.pxi"


# ---------------------------------------------------------------------------------------------
# The proposer
# ---------------------------------------------------------------------------------------------

cdef class SuffixProposer(Proposer):
    """ngram-suffix: drafts from a suffix automaton of the request and a global store of past
    outputs, by continuation frequency, with a calibrated, adaptive length.

    Parameters
    ----------
    n_slots : int, >= 1
    max_draft : int, 1 .. 4096
        Longest draft (``--spec-ngram-suffix-max-draft``).
    min_prob : float, 0 .. 1
        Lowest probability that the whole draft is accepted (``--spec-ngram-suffix-min-prob``).
    gain_cost : float, 0 .. 1
        The threshold is at least this times the slot's accepted draft tokens per step (at
        most 8): a slot that already gains a lot per step drafts only likelier tokens.
    draft_cost : float, 0 .. 1
        The threshold rises by this much per token already in the draft.
    max_context : int, 256 .. 2**26
        Tokens of a request a slot indexes; a longer context is re-indexed over its newest half.
    global_tokens : int, 0 .. 2**26
        Budget of the global store in tokens, separators included (0 or 1: no global store).
    global_prompt : int, 0 .. 2**20
        Newest prompt tokens stored with each finished request's output (0 = outputs only).
        A few cover the chat template's assistant header, so that the start of an answer is
        matched against the starts of earlier answers; whole prompts mostly repeat what the
        local index already holds and skew the counts.
    _count_depth : int
        Testing only: lowers COUNT_DEPTH (the contexts an occurrence is counted in).

    Notes
    -----
    Memory: per slot a suffix automaton of 108-124 bytes per context token (allocated by
    doubling as the context grows, at most ``max_context`` tokens: 6.8 MiB by default),
    ~8 * (max_draft + 1) int32 of buffers, and once `draft_tree` is used, 2 * 76 bytes per
    node of the largest tree asked. Once: 3600 uint32 of calibration, shared by the slots. The
    global store: 108-124 bytes per token, up to ``global_tokens`` tokens (108 MiB by
    default; allocated by doubling), oldest sequences evicted first. `memory_bytes` reports
    what is held, `sam_bytes` the bound.

    Thread-safety: one thread per slot at a time (a second call on a busy slot raises
    RuntimeError, also through the engine, and leaves the slot alone). The global store is
    shared by all slots and protected by a lock: ``begin`` and ``end`` insert under it with the
    GIL released; a draft only tries it and, when another thread holds it, drafts from the
    local index alone (drafts never wait). The calibration is shared too: a draft folds its
    slot's outcomes in when its lock is free (else at a later call) and reads it lock-free.
    """
    cdef Params P
    cdef Slot* slots
    cdef Store store
    cdef PyThread_type_lock lock
    cdef Calib* cal
    cdef PyThread_type_lock cal_lock
    # The store log's outbox (`publish_finished`): None, or a bounded deque of the sequences
    # begin() inserted, oldest first; appended and popped with the GIL held.
    cdef object outbox
    cdef int64_t n_outbox_dropped

    def __cinit__(self):
        self.slots = NULL
        self.lock = NULL
        self.cal = NULL
        self.cal_lock = NULL
        memset(&self.store, 0, sizeof(Store))
        self.outbox = None
        self.n_outbox_dropped = 0

    def __init__(self, n_slots=1, max_draft=256, min_prob=0.005, gain_cost=0.02,
                 draft_cost=0.0078125, max_context=65536, global_tokens=1048576,
                 global_prompt=8, *, _count_depth=COUNT_DEPTH):
        max_draft = check_int("max_draft", max_draft, 1, 4096)
        min_prob = check_real("min_prob", min_prob, 0.0, 1.0)
        gain_cost = check_real("gain_cost", gain_cost, 0.0, 1.0)
        draft_cost = check_real("draft_cost", draft_cost, 0.0, 1.0)
        max_context = check_int("max_context", max_context, 256, 1 << 26)
        global_tokens = check_int("global_tokens", global_tokens, 0, 1 << 26)
        global_prompt = check_int("global_prompt", global_prompt, 0, 1 << 20)
        _count_depth = check_int("_count_depth", _count_depth, 1, 1 << 20)
        Proposer.__init__(self, "ngram-suffix", n_slots, max_draft)   # first: refuses a re-run
        self.P.max_draft = <int32_t>max_draft
        self.P.min_p = <uint32_t>(min_prob * ONE + 0.5)
        self.P.gain_cost = <uint32_t>(gain_cost * ONE + 0.5)
        self.P.draft_cost = <uint32_t>(draft_cost * ONE + 0.5)
        self.P.max_context = <int32_t>max_context
        self.P.global_prompt = <int32_t>global_prompt
        self.store.budget = <int32_t>global_tokens
        self.store.sam.max_cap = <int32_t>global_tokens
        self.store.sam.depth = <int32_t>_count_depth
        self.store.gen = 1
        try:
            self.init_state(self.n_slots, max_draft, max_context, global_tokens, _count_depth)
        except MemoryError:
            self.free_state()
            self.forget_slots()              # no slot to call; __init__ may run again
            raise

    cdef int init_state(self, Py_ssize_t n_slots, Py_ssize_t max_draft, Py_ssize_t max_context,
                        Py_ssize_t global_tokens, Py_ssize_t _count_depth) except -1:
        """The allocations of __init__ (the caller frees them all if one fails)."""
        cdef Py_ssize_t i
        self.lock = PyThread_allocate_lock()
        if self.lock == NULL:
            raise MemoryError("out of memory for ngram-suffix's store lock")
        self.cal_lock = PyThread_allocate_lock()
        self.cal = <Calib*>malloc(sizeof(Calib))
        if self.cal_lock == NULL or self.cal == NULL:
            raise MemoryError("out of memory for ngram-suffix's calibration")
        memset(self.cal, 0, sizeof(Calib))
        self.cal.rate = ONE
        if global_tokens >= 2 and sam_reserve(&self.store.sam, 1) < 0:
            raise MemoryError("out of memory for ngram-suffix's global store")
        self.slots = <Slot*>alloc_per_slot(n_slots, sizeof(Slot), "ngram-suffix's per-slot state")
        for i in range(n_slots):
            self.slots[i].loc.max_cap = <int32_t>max_context
            self.slots[i].loc.depth = <int32_t>_count_depth
            self.slots[i].pred_base = -1
            self.slots[i].n_last_acc = -1
            self.slots[i].pend_cap = <int32_t>(4 * (max_draft + 1) + 2)
            self.slots[i].pend = <uint32_t*>malloc(self.slots[i].pend_cap * sizeof(uint32_t))
            self.slots[i].pred_tok = <token_t*>malloc(2 * (max_draft + 1) * sizeof(token_t))
            self.slots[i].pred_cell = <uint16_t*>malloc(2 * (max_draft + 1) * sizeof(uint16_t))
            self.slots[i].last_draft = <token_t*>malloc((max_draft + 1) * sizeof(token_t))
            if (self.slots[i].pred_tok == NULL or self.slots[i].pred_cell == NULL
                    or self.slots[i].last_draft == NULL or self.slots[i].pend == NULL):
                raise MemoryError(f"n_slots = {n_slots}: out of memory for ngram-suffix's "
                                  f"buffers of slot {i}")
        return 0

    def __dealloc__(self):
        self.free_state()

    cdef void free_state(self) noexcept:
        cdef Py_ssize_t i
        if self.slots != NULL:
            for i in range(self.n_slots):
                sam_free(&self.slots[i].loc)
                free(self.slots[i].pred_tok)
                free(self.slots[i].pred_cell)
                free(self.slots[i].last_draft)
                free(self.slots[i].tree)
                free(self.slots[i].pend)
            free(self.slots)
            self.slots = NULL
        sam_free(&self.store.sam)
        if self.lock != NULL:
            PyThread_free_lock(self.lock)
            self.lock = NULL
        if self.cal_lock != NULL:
            PyThread_free_lock(self.cal_lock)
            self.cal_lock = NULL
        free(self.cal)
        self.cal = NULL

    # -- the engine's interface ---------------------------------------------------------------

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        cdef Slot* s = &self.slots[slot]
        cdef int rc
        cdef int64_t off = 0
        if s.active:
            self.finish(s)
        if n > self.P.max_context:           # index the newest half, as on outgrowing
            off = n - self.P.max_context // 2
        if n - off > NOGIL_MIN_TOKENS:
            with nogil:
                rc = slot_begin(s, prompt + off, n - off, off)
        else:
            rc = slot_begin(s, prompt + off, n - off, off)
        if rc < 0:
            raise MemoryError("out of memory while indexing ngram-suffix's prompt")
        return 0

    cdef int finish(self, Slot* s) except -1:
        """Insert the slot's finished request (output, prompt tail) into the global store."""
        cdef Sam* S = &s.loc
        cdef int64_t a = s.out_start - s.loc_off
        cdef int32_t n_pr, n_out, k
        cdef token_t* buf
        cdef int rc
        s.active = False
        if self.store.budget < 2:
            return 0
        if a < 0:
            a = 0
        n_pr = <int32_t>min(<int64_t>self.P.global_prompt, a)
        n_out = <int32_t>(S.n - a)
        # the last draft's accepted tokens never reached a context
        k = s.n_last_acc if s.n_last_acc > 0 else 0
        if n_out + k == 0:                   # no output: nothing to learn from
            return 0
        buf = <token_t*>malloc((n_pr + n_out + k) * sizeof(token_t))
        if buf == NULL:
            raise MemoryError("out of memory while storing a finished ngram-suffix request")
        memcpy(buf, S.text + a - n_pr, (n_pr + n_out) * sizeof(token_t))
        memcpy(buf + n_pr + n_out, s.last_draft, k * sizeof(token_t))
        with nogil:
            rc = store_insert_locked(&self.store, self.lock, buf, n_pr + n_out + k)
        if rc == 0 and self.outbox is not None:
            self.keep_finished(buf, n_pr + n_out + k)
        free(buf)
        if rc < 0:
            raise MemoryError("out of memory while storing a finished ngram-suffix request")
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef Slot* s = &self.slots[slot]
        if not s.active or not slot_follows(s, inp, n):
            # a context that did not grow from the last one: start over with it as the prompt
            if s.active:
                self.finish(s)
            slot_restart(s)
            s.active = True
            s.out_start = n
        if slot_sync(s, self.cal, &self.P, inp, n, sampled) < 0:
            # the slot may be half-synced (e.g. its output start set past an empty automaton):
            # forget the request, so that the next call starts over cleanly
            slot_restart(s)
            s.active = False
            raise MemoryError("out of memory while indexing ngram-suffix's context")
        if s.n_pend and PyThread_acquire_lock(self.cal_lock, NOWAIT_LOCK):
            cal_fold(self.cal, s.pend, s.n_pend)
            s.n_pend = 0
            PyThread_release_lock(self.cal_lock)
        if self.store.budget >= 2 and PyThread_acquire_lock(self.lock, NOWAIT_LOCK):
            slot_walk(s, self.cal, &self.P, &self.store, inp, n, sampled)
            PyThread_release_lock(self.lock)
        else:
            slot_walk(s, self.cal, &self.P, NULL, inp, n, sampled)
        memcpy(out, s.last_draft, s.n_last_draft * sizeof(token_t))
        return s.n_last_draft

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        cdef Slot* s = &self.slots[slot]
        if not is_other:
            s.n_last_acc = <int32_t>min(n_accepted, <Py_ssize_t>s.n_last_draft)
        return 0

    # -- The Python API (`Proposer.begin` / `draft` / `accept`) ------------------------------

    cdef int32_t build_tree(self, Slot* sl, int32_t nc, int32_t bud, int32_t* tkp,
                            int32_t* pap) noexcept nogil:
        """`draft_tree`'s work, the GIL released and the slot claimed: one tree per source, the
        draft's chain in its own source's, the global one only from a cursor this draft call
        brought up to date; then one tree of both, the draft's source first on ties. Returns
        the merged tree's size."""
        cdef int32_t m, m1, stride = self.P.max_draft + 1, gv = 0, gl = 0, lv
        cdef int32_t src = sl.last_src, cap = bud + 1
        cdef const Sam* G = NULL
        cdef const Sam* L = &sl.loc
        cdef bint locked
        lv = L.st[L.last].link
        locked = (self.store.budget >= 2 and PyThread_acquire_lock(self.lock, NOWAIT_LOCK))
        if locked and sl.g_gen == self.store.gen and sl.g_pos == sl.ctx_len:
            G = &self.store.sam
            gv = sl.g_state
            gl = sl.g_len
        m = tree_build(sl.tree, L, 0, lv, L.st[lv].len if lv > 0 else 0, sl.pred_tok,
                       sl.pred_cell, nc if src == 0 else 0, bud, self.cal.acc,
                       self.cal.tried, sl.streak)
        m1 = tree_build(sl.tree + cap, G, 1, gv, gl, sl.pred_tok + stride,
                        sl.pred_cell + stride, nc if src == 1 else 0, bud,
                        self.cal.acc, self.cal.tried, sl.streak)
        if locked:
            PyThread_release_lock(self.lock)
        if src == 0:
            return tree_merge(sl.tree, m, sl.tree + cap, m1, bud, tkp, pap)
        return tree_merge(sl.tree + cap, m1, sl.tree, m, bud, tkp, pap)

    def draft_tree(self, slot, n_chain, budget, out=None, Py_ssize_t offset=0):
        """The slot's last draft as a tree of at most `budget` tokens, for an engine that
        verifies a tree of a fixed size whatever it holds (SGLang's ``draft_token_num``).

        The tree that maximises the expected number of accepted tokens (the sum of its nodes'
        path probabilities), as estimated: nodes are chosen best first from the root, each
        time the continuation whose path is likeliest to be accepted, width near the root
        where the next token is uncertain, depth where it is not (issue 37). Both sources
        offer continuations they have seen after the same contexts: the slot's automaton (the
        request), and the global store (past outputs) when the draft call read it. Each builds
        its best-first tree of `budget` tokens; the two are merged by path probability (the
        draft's source first on ties), a path both hold kept once, and cut at `budget`. Along the
        draft's first `n_chain` tokens (in the draft's source's tree) a token's probability is
        the calibrated one the draft was made with; a most frequent continuation elsewhere is
        scored as the walk scores a token; another child of count a gets ``min(p_ref * a /
        a_ref, (1 - p_ref) * a / (n - a_ref))``, with p_ref and a_ref its most frequent
        sibling's (on the chain: the chain token's) probability and count, n the count of all
        the children. Where the last token occurs nowhere before in the request, the slot's
        tree starts from the empty context: the request's 16 most frequent tokens at most,
        scored the same way (a budget the engine verifies anyway, at no cost when no source
        has a match). Ties go to the node added first. No threshold: the engine verifies the
        whole budget anyway. The chain itself, what `draft` returns, is unchanged.

        Parameters
        ----------
        slot : int
            0 .. n_slots - 1; its last call was `draft` (or the engine's draft).
        n_chain : int
            0 .. the last draft's length: the draft's tokens the caller kept (after a
            draft-length policy's cut), the path its probabilities score; past it a path goes
            on by frequency. At most `budget` of them are used.
        budget : int, 0 .. 4096
            Tokens in the tree, the root (the last verified token) not counted.
        out, offset : (tokens, parents) of C-contiguous int32 arrays, int; optional
            Write the tree there from flat index `offset` on (a host's buffers: no allocation).

        Returns
        -------
        tokens, parents : numpy.ndarray
            int32, as long as each other (at most `budget`): token i hangs off token
            ``parents[i]`` (< i), or off the root when -1. No two siblings are equal. With
            `out`: the tree's size alone.

        Raises
        ------
        ValueError
            The slot's last call was not a draft (none since its `begin`, or a `begin`
            since), or an argument out of range.
        MemoryError
            Out of memory for the slot's tree nodes (2 * (budget + 1) * 76 bytes).

        Notes
        -----
        Memory: the outputs, and per slot a node buffer grown to two trees of the largest
        budget asked (76 bytes a node), kept until the proposer is freed. Cost: two trees of
        O(budget * (budget + out-degree)) each and their O(budget^2) merge, with the GIL
        released (~4-6 µs at budget 15 on the trace families, `python bench trees`).

        Thread-safety: claims the slot as `draft` does. The global store's tree reads it under
        its lock, only tried, as a draft does: when another thread holds it, or the store
        changed since the draft, its tree is the draft's chain alone (if the draft came from
        the store) or empty. Deterministic otherwise.
        """
        cdef Py_ssize_t s = self.slot_arg(slot)
        cdef Slot* sl = &self.slots[s]
        cdef int32_t m = 0, bud, nc
        cdef TreeNode* grown
        if not sl.active or sl.pred_base < 0:
            raise ValueError(f"draft_tree() on slot {s} without a draft: call it after the "
                             f"slot's draft(), before its next begin()")
        bud = <int32_t>check_int("budget", budget, 0, 4096)
        nc = <int32_t>check_int("n_chain", n_chain, 0, sl.n_last_draft)
        if nc > bud:
            nc = bud
        cdef int32_t* tkp
        cdef int32_t* pap
        if out is None:
            tokens = np.empty(bud, dtype=np.int32)
            parents = np.empty(bud, dtype=np.int32)
            tkp = <int32_t*>cnp.PyArray_DATA(tokens)
            pap = <int32_t*>cnp.PyArray_DATA(parents)
        else:
            tkp = out_int32(out, 0, offset, bud)
            pap = out_int32(out, 1, offset, bud)
        claim_slot(self.busy, s, self.name)
        try:
            if 2 * (bud + 1) > sl.tree_cap:
                grown = <TreeNode*>realloc(sl.tree, 2 * (bud + 1) * sizeof(TreeNode))
                if grown == NULL:
                    raise MemoryError(f"budget = {budget}: out of memory for the tree's nodes")
                sl.tree = grown
                sl.tree_cap = 2 * (bud + 1)
            with nogil:
                m = self.build_tree(sl, nc, bud, tkp, pap)
        finally:
            self.busy[s] = 0
        if out is not None:
            return m
        return tokens[:m], parents[:m]

    def prefetch(self, slots, tokens):
        """Read ahead, for many slots at once, what each one's next draft will read: slot
        ``slots[i]`` about to index ``tokens[i]`` (its next `draft`'s ``sampled``).

        A host that drafts for 64-256 requests of long contexts per step calls it once per
        step, before their drafts: their automata outgrow the caches, and a draft's reads (the
        occurrence counts along the new token's suffix links, the draft walk, the tree) are
        chains of dependent misses that one slot cannot overlap. This follows the same chains
        for groups of slots in lockstep, so their misses overlap, and the drafts after it find
        the lines in cache (`python bench engines-overhead`). Nothing is written: no draft,
        tree or statistic depends on whether, or with which tokens, it was called.

        Parameters
        ----------
        slots : 1-D int array-like
            Slots, each 0 .. n_slots - 1. Idle slots, slots busy in another thread and slots
            whose automaton grows at the next token are skipped.
        tokens : 1-D int array-like
            Token ids in 0 .. 2**31-1, one per slot.

        Raises
        ------
        ValueError, TypeError
            A slot or token out of range, or the two of different lengths (the message names
            the argument).

        Notes
        -----
        Memory: none. Cost: O(COUNT_DEPTH + 8 levels of continuations) reads per slot,
        mostly cache misses overlapped sixteen at a time.

        Thread-safety: keeps the GIL and only reads slots no other thread has claimed; the
        global store is not read.
        """
        cdef cnp.ndarray sl = as_tokens(slots, "slots")
        cdef cnp.ndarray tok = as_tokens(tokens, "tokens")
        cdef Py_ssize_t n = cnp.PyArray_DIMS(sl)[0], i
        cdef int32_t* sp = <int32_t*>cnp.PyArray_DATA(sl)
        if cnp.PyArray_DIMS(tok)[0] != n:
            raise Refused("tokens", f"{cnp.PyArray_DIMS(tok)[0]} tokens for {n} slots: one each")
        for i in range(n):
            if sp[i] >= self.n_slots:
                raise OutOfRange(f"slots[{i}]", int(sp[i]), f"0 .. {self.n_slots - 1}")
        if self.slots == NULL:
            raise RuntimeError("SuffixProposer is not initialised")
        # a slot claimed by a thread that released the GIL is skipped (its arrays may move)
        cdef cnp.ndarray free_ = np.empty(n, dtype=np.int32)
        cdef cnp.ndarray free_tok = np.empty(n, dtype=np.int32)
        cdef int32_t* fp = <int32_t*>cnp.PyArray_DATA(free_)
        cdef token_t* ft = <token_t*>cnp.PyArray_DATA(free_tok)
        cdef const token_t* tp = tok_ptr(tok)
        cdef Py_ssize_t m = 0
        for i in range(n):
            if not self.busy[sp[i]]:
                fp[m] = sp[i]
                ft[m] = tp[i]
                m += 1
        return slots_prefetch(self.slots, fp, ft, m)

    def end(self, slot):
        """The slot's request is over: store its output in the global store now, not when the
        slot's next request begins (a server with many slots may not reuse this one for a long
        time, and every other slot would draft without it until then). The slot is idle
        afterwards; its next request starts with `begin` (a `draft` without one starts over
        from its context). No-op on an idle slot.

        Parameters
        ----------
        slot : int
            0 .. n_slots - 1.

        Raises
        ------
        MemoryError
            Out of memory while storing the output (the slot is idle all the same).

        Notes
        -----
        Thread-safety: claims the slot as `draft` does; waits for the store's lock with the GIL
        released, as `begin` does.
        """
        cdef Py_ssize_t s = self.slot_arg(slot)
        claim_slot(self.busy, s, self.name)
        try:
            if self.slots[s].active:
                self.finish(&self.slots[s])
        finally:
            self.busy[s] = 0

    cdef Py_ssize_t checked_prefix(self, Py_ssize_t slot):
        # Of an int32 array, only the tokens the slot has not indexed yet are checked, as the
        # engine does (`Proposer.draft`).
        return self.slots[slot].ctx_len if self.slots[slot].active else 0

    cdef int lock_store(self) except -1:
        """Take the store's lock (waiting without the GIL)."""
        if self.lock == NULL:
            raise RuntimeError("SuffixProposer is not initialised")
        with nogil:
            PyThread_acquire_lock(self.lock, WAIT_LOCK)
        return 0

    def _check_slot(self, Py_ssize_t slot):
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")

    def memory_bytes(self):
        """Bytes held now: every slot and the global store."""
        cdef size_t total = sizeof(Calib)
        cdef Py_ssize_t i
        self.lock_store()
        if self.store.sam.cap:
            total += sam_bytes_for(self.store.sam.cap, self.store.sam.hbits)
        PyThread_release_lock(self.lock)
        for i in range(self.n_slots):
            if self.slots[i].loc.cap:
                total += sam_bytes_for(self.slots[i].loc.cap, self.slots[i].loc.hbits)
            total += sizeof(Slot) + (self.max_draft + 1) * (3 * sizeof(token_t)
                                                            + 2 * sizeof(uint16_t))
            total += self.slots[i].pend_cap * sizeof(uint32_t)
            total += self.slots[i].tree_cap * sizeof(TreeNode)
        return total

    def global_stats(self):
        """The global store: {'tokens', 'capacity', 'budget', 'states', 'transitions',
        'evictions', 'generation'}."""
        self.lock_store()
        try:
            return dict(tokens=self.store.sam.n, capacity=self.store.sam.cap,
                        budget=self.store.budget, states=self.store.sam.n_states,
                        transitions=self.store.sam.n_edges, evictions=self.store.n_evictions,
                        generation=self.store.gen)
        finally:
            PyThread_release_lock(self.lock)

    def global_text(self):
        """The global store's tokens (sequences separated by -1), oldest first: a copy."""
        cdef cnp.ndarray out
        self.lock_store()
        try:
            out = np.empty(self.store.sam.n, dtype=np.int32)
            if self.store.sam.n:
                memcpy(cnp.PyArray_DATA(out), self.store.sam.text,
                       self.store.sam.n * sizeof(token_t))
            return out
        finally:
            PyThread_release_lock(self.lock)

    def slot_stats(self, Py_ssize_t slot):
        """One slot: {'context', 'indexed', 'capacity', 'tokens_per_step'}; tokens_per_step is
        the server's average (every slot's steps: it is learned as one)."""
        self._check_slot(slot)
        cdef Slot* s = &self.slots[slot]
        return dict(context=s.ctx_len, indexed=s.loc.n, capacity=s.loc.cap,
                    tokens_per_step=ld64(&self.cal.rate) / <double>ONE)

    def calibration_stats(self):
        """The shared calibration: {'outcomes' folded in, 'dropped' (observed while the lock was
        busy for longer than a slot's pending list lasts), 'merged' (fine-cell outcomes folded
        in from other replicas, `fold_calibration`), 'tokens_per_step'}."""
        return dict(outcomes=self.cal.n_folded, dropped=self.cal.n_dropped,
                    merged=self.cal.n_merged, tokens_per_step=ld64(&self.cal.rate) / <double>ONE)

    def draft_probs(self, Py_ssize_t slot):
        """Per-token probabilities of the slot's last draft and the evidence behind them.

        Returns ``(probs, tried)``, float64 arrays as long as the draft: ``probs[j]`` is the
        calibrated probability that token j is accepted given that tokens 0 .. j-1 were (the
        product of the first j + 1 is the probability the walk drafted by); ``tried[j]`` the
        record count (fading) of that token's calibration cell. Cells of late draft positions
        stay sparse while the slot's drafts are cut short (only tokens that arrive are scored),
        and their probability is then mostly the prior. Valid until the slot's next draft
        call, which updates the calibration."""
        self._check_slot(slot)
        cdef Slot* s = &self.slots[slot]
        cdef int32_t j, cell, off = s.last_src * (self.P.max_draft + 1)
        probs = np.empty(s.n_last_draft, dtype=np.float64)
        tried = np.empty(s.n_last_draft, dtype=np.float64)
        cdef double[::1] p = probs, t = tried
        for j in range(s.n_last_draft):
            cell = s.pred_cell[off + j]
            p[j] = cal_prob(self.cal.acc, self.cal.tried, cell) / <double>ONE
            t[j] = ld32(&self.cal.tried[cell])
        return probs, tried

    def calibration(self):
        """(acc, tried) of the fine calibration cells, shared by all slots, uint32 arrays of
        shape (source, length bucket, frequency bucket, stage, agreement) = (2, 10, 7, 6, 2).
        A consistent copy (taken under the calibration's lock); outcomes a slot has observed
        but not folded in yet (only while another thread folds) are not in it."""
        cdef Py_ssize_t i
        acc = np.empty(N_CELLS, dtype=np.uint32)
        tried = np.empty(N_CELLS, dtype=np.uint32)
        cdef uint32_t[::1] a = acc, t = tried
        with nogil:
            PyThread_acquire_lock(self.cal_lock, WAIT_LOCK)
        for i in range(N_CELLS):
            a[i] = self.cal.acc[i]
            t[i] = self.cal.tried[i]
        PyThread_release_lock(self.cal_lock)
        shape = (N_SRC, N_LB, N_FB, N_ST, N_AG)
        return acc.reshape(shape), tried.reshape(shape)

    def take_calibration(self):
        """What this proposer's slots taught the calibration since the last call, as per-cell
        count deltas, for another replica's `fold_calibration` (the store log carries them);
        the deltas restart from zero.

        Returns
        -------
        cells, tried, accepted : numpy.ndarray
            The cells that saw outcomes (int32, ascending, fine cells 0 .. 1679 then coarse
            cells 1680 .. 1799; at most 1800 of them), and for each the outcomes folded in
            (uint32) and how many came true (uint32, <= tried). Exactly what `cal_fold` added,
            before forgetting; outcomes merged from other replicas are not in it (a replica
            never echoes what it was sent). A cell counts at most 2**31 - 1 outcomes.
        steps, tokens : int
            The steps folded into the tokens-per-step average, and their tokens in all.

        Notes
        -----
        Memory: two uint32 arrays of 1800 counts inside the proposer; the outputs.

        Thread-safety: takes the calibration's lock, waiting without the GIL; a draft only
        tries that lock, so a draft never waits for this call. Any thread.
        """
        cells = np.empty(N_CAL, dtype=np.int32)
        tried = np.empty(N_CAL, dtype=np.uint32)
        acc = np.empty(N_CAL, dtype=np.uint32)
        cdef int32_t[::1] c = cells
        cdef uint32_t[::1] t = tried, a = acc
        cdef int32_t i, m = 0
        cdef int64_t steps, tokens
        if self.cal_lock == NULL:
            raise RuntimeError("SuffixProposer is not initialised")
        with nogil:
            PyThread_acquire_lock(self.cal_lock, WAIT_LOCK)
            for i in range(N_CAL):
                if self.cal.out_tried[i]:
                    c[m] = i
                    t[m] = self.cal.out_tried[i]
                    a[m] = self.cal.out_acc[i]
                    m += 1
            memset(self.cal.out_tried, 0, sizeof(self.cal.out_tried))
            memset(self.cal.out_acc, 0, sizeof(self.cal.out_acc))
            steps, tokens = self.cal.out_steps, self.cal.out_tokens
            self.cal.out_steps = self.cal.out_tokens = 0
            PyThread_release_lock(self.cal_lock)
        return cells[:m].copy(), tried[:m].copy(), acc[:m].copy(), steps, tokens

    def fold_calibration(self, cells, tried, accepted, steps=0, tokens=0):
        """Fold another replica's calibration deltas (its `take_calibration`) into this one's
        shared table, so that the replicas of a fleet learn as one server.

        Each cell's `tried` outcomes are added as if they had come one at a time after this
        proposer's own: the cell's tried count takes exactly the path of the forgetting rule
        (+1 per outcome, both counts halved at 1024), so a cell's horizon (~1000 outcomes)
        means the same whichever replica observed them. Sound because a cell's counts are
        sufficient statistics of its outcomes, the same for every replica (the cells describe
        the workload, not the replica), and the forgetting rule depends on the count only.
        What it approximates: where in the sequence the hits fell (spread evenly over the
        delta, which matters only when the delta crosses a halving) and the interleaving with
        this replica's outcomes of the same period (the delta arrives as a block, a log
        interval late). The tokens-per-step average (G, the draft threshold's gain term)
        takes the other replica's steps as if they had come one by one, each of their mean
        (`steps`, `tokens`): its horizon (~1000 steps) is the fleet's too.

        Parameters
        ----------
        cells : 1-D int array-like
            Cell numbers, 0 .. 1799; at most 1800 of them (repeats are folded in turn).
        tried : 1-D int array-like
            Outcomes per cell, 0 .. 2**31 - 1.
        accepted : 1-D int array-like
            Hits per cell, 0 .. its `tried`.
        steps : int, 0 .. 2**40
            Steps behind the tokens-per-step delta (0: none).
        tokens : int, 0 .. 4097 * steps
            Their tokens in all (a step yields at most max_draft + 1 <= 4097).

        Raises
        ------
        OutOfRange, WrongType, Refused
            A value out of range, not integers, or arrays of different lengths (the message
            names the argument); nothing is folded then.

        Notes
        -----
        Memory: none kept. Cost: O(len(cells)) (at most 34 forgetting windows per cell).

        Thread-safety: takes the calibration's lock, waiting without the GIL; drafts only try
        it (a slot whose draft finds it busy folds its own outcomes at its next call), so a
        draft never waits. Any thread.
        """
        c = _cal_counts("cells", cells, N_CAL - 1)
        t = _cal_counts("tried", tried, DELTA_MAX)
        a = _cal_counts("accepted", accepted, DELTA_MAX)
        if not (len(c) == len(t) == len(a)):
            raise Refused("cells", f"cells, tried and accepted must be as long as each other, "
                                   f"got {len(c)}, {len(t)} and {len(a)}")
        if len(c) > N_CAL:
            raise OutOfRange("len(cells)", len(c), f"0 .. {N_CAL}")
        n_steps = check_int("steps", steps, 0, 1 << 40)
        n_tokens = check_int("tokens", tokens, 0, 4097 * n_steps)
        bad = np.flatnonzero(a > t)
        if len(bad):
            raise OutOfRange(f"accepted[{bad[0]}]", int(a[bad[0]]), f"0 .. tried[{bad[0]}] "
                             f"= {int(t[bad[0]])}")
        cdef int64_t[::1] cv = c, tv = t, av = a
        cdef Py_ssize_t i, n = len(c)
        cdef int64_t total = 0, st = n_steps, tk = n_tokens
        if self.cal_lock == NULL:
            raise RuntimeError("SuffixProposer is not initialised")
        with nogil:
            PyThread_acquire_lock(self.cal_lock, WAIT_LOCK)
            for i in range(n):
                cal_merge(self.cal.acc, self.cal.tried, <int>cv[i], <uint32_t>tv[i],
                          <uint32_t>av[i])
                if cv[i] < N_CELLS:
                    total += tv[i]
            self.cal.n_merged += total
            rate_merge(self.cal, st, tk)
            PyThread_release_lock(self.cal_lock)

    # -- The store log (`ngramspec.store_log`): the global store's sequences in and out ------

    def insert_global(self, tokens):
        """Insert a finished sequence from elsewhere (another replica's request, as the store
        log carries it) into the global store, as `begin` inserts the slot's finished request:
        the same insertion, evicting the oldest sequences past ``global_tokens``.

        Parameters
        ----------
        tokens : 1-D int array-like
            Token ids in 0 .. 2**31-1: the request's newest ``global_prompt`` prompt tokens and
            its output, as `take_finished` hands them out. Longer than ``global_tokens - 1``:
            only the newest part is kept, as for a slot's request. Empty: nothing happens.

        Returns
        -------
        bool
            False when the proposer has no global store (``global_tokens`` < 2): nothing kept.

        Raises
        ------
        ValueError, TypeError
            Not a 1-D sequence of token ids (the message names ``tokens`` and the range).
        MemoryError
            Out of memory growing the store.

        Notes
        -----
        Memory: the store's, within ``global_tokens``. Not recorded by `publish_finished`
        (a sequence from the log is never published again).

        Thread-safety: takes the store's lock, waiting for it with the GIL released (the
        insertion may rebuild the store, O(global_tokens)); safe from any thread, beside calls
        on any slot. A draft that finds the lock taken drafts from its local index alone.
        """
        cdef cnp.ndarray arr = as_tokens(tokens, "tokens")
        cdef const token_t* t = tok_ptr(arr)
        cdef Py_ssize_t n = cnp.PyArray_DIMS(arr)[0]
        cdef int rc
        if self.lock == NULL:
            raise RuntimeError("SuffixProposer is not initialised")
        if self.store.budget < 2:
            return False
        with nogil:
            rc = store_insert_locked(&self.store, self.lock, t, <int32_t>n)
        if rc < 0:
            raise MemoryError("out of memory while inserting into ngram-suffix's global store")
        return True

    def publish_finished(self, max_pending):
        """Record, from now on, each sequence `begin` inserts into the global store (a slot's
        finished request), for `take_finished` to hand out; 0 stops recording.

        Parameters
        ----------
        max_pending : int, 0 .. 2**20
            The most sequences kept until taken: past it the oldest is dropped and counted
            (`take_finished`'s second value), so a publisher that stalls bounds the memory.

        Notes
        -----
        Memory: up to `max_pending` sequences (``global_prompt`` + output tokens each).

        Thread-safety: with the GIL held; any thread.
        """
        max_pending = check_int("max_pending", max_pending, 0, 1 << 20)
        old = self.outbox
        self.outbox = deque(old or (), maxlen=max_pending) if max_pending else None

    cdef int keep_finished(self, const token_t* t, int32_t n) except -1:
        """Record a sequence begin() inserted (with the GIL, `finish`); never raises: a
        sequence that cannot be copied is counted as dropped, as one the bound pushes out."""
        cdef object box = self.outbox
        cdef cnp.ndarray seq
        try:
            seq = np.empty(n, dtype=np.int32)
        except MemoryError:
            self.n_outbox_dropped += 1
            return 0
        memcpy(cnp.PyArray_DATA(seq), t, n * sizeof(token_t))
        if len(box) == box.maxlen:
            self.n_outbox_dropped += 1
        box.append(seq)
        return 0

    def take_finished(self):
        """The sequences `begin` inserted since the last call (recorded by
        `publish_finished`), oldest first, and how many were dropped in all.

        Returns
        -------
        sequences : list of numpy.ndarray
            int32 copies, exactly what went into the global store (``global_prompt`` prompt
            tokens, then the output). Empty when recording is off.
        dropped : int
            Sequences lost since the proposer was built: past ``max_pending``, or no memory.

        Thread-safety: with the GIL held; any thread, beside calls on any slot (a sequence is
        handed out once).
        """
        box = self.outbox
        out = []
        if box is not None:
            while box:
                out.append(box.popleft())
        return out, self.n_outbox_dropped


def _cal_counts(name, values, hi):
    """`values` as a 1-D int64 array of integers in 0 .. hi, else the error naming `name`."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise WrongType(name, values, "a 1-D array of integers",
                        got=f"{arr.ndim}-D {arr.dtype}")
    arr = arr.astype(np.int64) if arr.size else np.empty(0, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > hi):
        i = int(np.flatnonzero((arr < 0) | (arr > hi))[0])
        raise OutOfRange(f"{name}[{i}]", int(arr[i]), f"0 .. {hi}")
    return np.ascontiguousarray(arr)


def sam_bytes(n_tokens):
    """Bytes one automaton holds once grown to `n_tokens` tokens (its bound: max_context for a
    slot, global_tokens for the store)."""
    cdef int32_t hbits = 1
    while (1 << hbits) < 4 * n_tokens:
        hbits += 1
    return sam_bytes_for(n_tokens, hbits)
