# Included by _suffix.pyx (one C module: the kernels stay inlinable and share its DEF
# constants and imports); reading ahead, for many slots at once, what their next draft reads.
#
# Why: at 64-256 requests of 32k tokens the slots' automata (~108 bytes a token) outgrow every
# cache, and a host's step visits them one after another, so each draft pays its misses one at
# a time: the count walk of sam_extend (COUNT_DEPTH states, each found through the one before),
# the draft walk and the tree (one state, then its transitions, then their targets). These are
# chains of dependent loads: within one slot nothing overlaps them. Across slots they are
# independent, so `slots_prefetch` follows the same chains for a group of slots round-robin, a
# step of each in turn, each step reading a line the slot's previous step prefetched (a
# software-pipelined walk: plain loads would stall the core at every data-dependent branch):
# the misses of the whole group are in flight at once, and the drafts that follow find their
# lines in cache. Read-only: no result depends on it. Measured at 256 slots x 32k tokens with
# the caches flushed between steps: the drafts' kernels ~15-35% faster, the read-ahead included.

# Slots walked in lockstep (misses in flight at once: a few per slot, bounded by the core's
# line-fill buffers anyway).
DEF PREFETCH_GROUP = 16
# Suffix links climbed looking for the new token's transition (sam_extend's first loop): on
# text that repeats, one or two.
DEF PREFETCH_FIND = 4
# Levels of the draft walk read ahead (the most frequent continuation each time).
DEF PREFETCH_WALK = 8

cdef extern from *:
    # GCC / Clang / ICC: a hint, never a fault (an address past an array is fine); the C
    # fallback for another compiler is a no-op.
    """
    #if defined(__GNUC__)
    #define NGS_PREFETCH(p) __builtin_prefetch((const void*)(p))
    #else
    #define NGS_PREFETCH(p) ((void)0)
    #endif
    """
    void prefetch_line "NGS_PREFETCH"(const void* p) noexcept nogil


cdef enum:
    TOUCH_PROBE = 0         # the new token's transition: the table slot h (prefetched) of s
    TOUCH_EDGE = 1          # ... the transition e in that slot (prefetched)
    TOUCH_COUNT = 2         # the count walk: state s (prefetched), then its suffix link
    TOUCH_HEAD = 3          # the draft walk: state s's first transition (sedge, prefetched)
    TOUCH_CHILD = 4         # ... its transitions f (prefetched), the target of pf (prefetched)
    TOUCH_DONE = 5


cdef struct Touch:
    # One slot's read-ahead, a step per round: each step reads only lines the step before
    # prefetched (by now in cache, the round's other slots having run in between), then
    # prefetches the next. No step waits on a miss, so a group's misses overlap.
    const Sam* S
    token_t c               # the token the slot's next draft appends
    int32_t s               # the state at hand
    int32_t q               # the new token's state's suffix link: where the draft walk starts
    uint32_t h              # table slot probed
    int32_t e, f, pf        # transition probed; walk: next transition, the one before
    int32_t best, bc        # walk: the most frequent child so far and its count
    int32_t phase
    int32_t k               # steps left in the phase


cdef inline void touch_start(Touch* t, const Sam* S, token_t c) noexcept nogil:
    t.S = S
    t.c = c
    t.s = S.last
    t.q = -1
    t.k = PREFETCH_FIND
    t.h = sam_hash(S, t.s, c)
    t.phase = TOUCH_PROBE
    prefetch_line(&S.htab[t.h])
    prefetch_line(&S.st[t.s])
    # the lines the extension writes: the text's end, the new state and transitions
    prefetch_line(&S.text[S.n])
    prefetch_line(&S.st[S.n_states])
    prefetch_line(&S.sedge[S.n_states])
    prefetch_line(&S.ed[S.n_edges])


cdef inline void touch_walk(Touch* t, int32_t s) noexcept nogil:
    """Start (or go on with) the draft walk's read-ahead at state s."""
    t.s = s
    t.phase = TOUCH_HEAD
    prefetch_line(&t.S.sedge[s])


cdef inline void touch_step(Touch* t) noexcept nogil:
    cdef const Sam* S = t.S
    cdef int32_t c
    if t.phase == TOUCH_PROBE:
        t.e = S.htab[t.h]
        if t.e >= 0:
            t.phase = TOUCH_EDGE
            prefetch_line(&S.ed[t.e])
            return
        # no transition: sam_extend climbs the suffix link
        t.s = S.st[t.s].link
        t.k -= 1
        if t.s < 0 or t.k == 0:
            t.phase = TOUCH_DONE
            return
        t.h = sam_hash(S, t.s, t.c)
        prefetch_line(&S.htab[t.h])
        prefetch_line(&S.st[t.s])
    elif t.phase == TOUCH_EDGE:
        if S.ed[t.e].src == t.s and S.ed[t.e].tok == t.c:
            t.q = S.ed[t.e].to
            t.s = t.q
            t.k = S.depth
            t.phase = TOUCH_COUNT
            prefetch_line(&S.st[t.s])
        else:                       # the probe goes on
            t.h = (t.h + 1) & ((<uint32_t>1 << S.hbits) - 1)
            t.phase = TOUCH_PROBE
            prefetch_line(&S.htab[t.h])
    elif t.phase == TOUCH_COUNT:
        t.s = S.st[t.s].link
        t.k -= 1
        if t.s <= 0 or t.k == 0:
            t.k = PREFETCH_WALK
            touch_walk(t, t.q)
        else:
            prefetch_line(&S.st[t.s])
    elif t.phase == TOUCH_HEAD:
        t.f = S.sedge[t.s]
        t.pf = -1
        t.best = -1
        t.bc = -1
        t.phase = TOUCH_CHILD
        if t.f < 0:
            t.phase = TOUCH_DONE
        else:
            prefetch_line(&S.ed[t.f])
    else:
        if t.pf >= 0:
            c = S.st[S.ed[t.pf].to].cnt
            if c > t.bc:
                t.best = t.pf
                t.bc = c
        if t.f >= 0:
            prefetch_line(&S.st[S.ed[t.f].to])
            prefetch_line(&S.sedge[S.ed[t.f].to])   # the tree expands siblings too
            t.pf = t.f
            t.f = S.ed[t.f].next
            if t.f >= 0:
                prefetch_line(&S.ed[t.f])
            return
        t.k -= 1
        if t.best < 0 or S.ed[t.best].tok < 0 or t.k == 0:
            t.phase = TOUCH_DONE
            return
        # the table slot the tree's lookup of this child reads
        prefetch_line(&S.htab[sam_hash(S, t.s, S.ed[t.best].tok)])
        touch_walk(t, S.ed[t.best].to)


cdef inline bint touch_ready(const Slot* s) noexcept nogil:
    """Whether the slot has an automaton its next token does not grow (reallocate)."""
    return s.active and s.loc.cap > s.loc.n


cdef int64_t slots_prefetch(Slot* slots, const int32_t* which, const token_t* tokens,
                            Py_ssize_t n) noexcept nogil:
    """Read ahead, for slot which[i] about to append tokens[i] (i < n), what its next draft
    reads; returns the steps taken. PREFETCH_GROUP slots at a time, round-robin, a slot that
    is done replaced by the next (so the group stays full); slots not `touch_ready` skipped."""
    cdef Touch T[PREFETCH_GROUP]
    cdef Py_ssize_t nxt = 0
    cdef int m = 0, j, live = 1
    cdef int64_t steps = 0
    while m < PREFETCH_GROUP and nxt < n:
        if touch_ready(&slots[which[nxt]]):
            touch_start(&T[m], &slots[which[nxt]].loc, tokens[nxt])
            m += 1
        nxt += 1
    while live:
        live = 0
        for j in range(m):
            if T[j].phase == TOUCH_DONE:
                while nxt < n and not touch_ready(&slots[which[nxt]]):
                    nxt += 1
                if nxt == n:
                    continue
                touch_start(&T[j], &slots[which[nxt]].loc, tokens[nxt])
                nxt += 1
            else:
                touch_step(&T[j])
            live += 1
        steps += live
    return steps
