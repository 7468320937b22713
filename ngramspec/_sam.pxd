# ngram-suffix's suffix automaton with counted occurrences, header-only (cimported by _suffix).
#
# A `Sam` owns its arrays (allocated with the kernels' allocator, released by sam_free); the
# text it indexes only grows between two sam_clear calls (append-only, as a request's context).
# No function here takes the GIL or a lock: an automaton belongs to one slot (or to the global
# store under its lock), used by one thread at a time.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcpy, memmove, memset

from ngramspec._proposer cimport malloc, realloc
from ngramspec._types cimport token_t

cdef enum:
    # Global matches are tracked up to this length (longer ones count as this long); after the
    # store changed, a cursor re-reads this many tokens.
    MAX_GLOBAL_MATCH = 512
    # An occurrence is counted in the COUNT_DEPTH longest contexts ending with it only (the first
    # states of the suffix-link chain): this bounds the per-token cost on degenerate text
    # ("aaaa...", whose chain is as long as the text). Counts of shorter contexts then saturate.
    COUNT_DEPTH = 32
    # Smallest automaton allocation (tokens); capacities grow by doubling.
    MIN_CAP = 1024


# A state's fields, and a transition's, lie together: a step that reads one (the suffix-link
# walk that counts an occurrence, a transition followed) costs one cache line, not one per field.
# At 64-256 requests of 32k tokens the automata outgrow every cache, so lines missed, not
# instructions, are a draft step's cost.
cdef struct SamState:
    int32_t len            # longest string of the state
    int32_t link           # suffix link (-1 for the root)
    int32_t cnt            # occurrences counted (see COUNT_DEPTH)
    int32_t pos            # text position of the last token of the latest counted occurrence


cdef struct SamEdge:
    int32_t src            # source state
    token_t tok
    int32_t to             # target state
    int32_t next           # next transition of the same source, -1 = none


cdef struct Sam:
    SamState* st
    int32_t* sedge         # first outgoing transition, -1 = none (apart: the count walk never
                           # reads it, and 16-byte states never straddle a cache line)
    SamEdge* ed
    int32_t* htab          # (state, token) -> transition, linear probing; -1 = empty
    token_t* text
    int32_t hbits
    int32_t cap            # tokens the arrays hold
    int32_t max_cap        # tokens the arrays may grow to
    int32_t n              # tokens in text
    int32_t n_states
    int32_t n_edges
    int32_t last           # state of the whole text
    int32_t depth          # COUNT_DEPTH (a field so that tests may lower it)


cdef inline uint32_t sam_hash(const Sam* S, int32_t s, token_t c) noexcept nogil:
    # Fibonacci hashing of the 64-bit key (state, token): the top bits of the product.
    cdef uint64_t key = ((<uint64_t><uint32_t>s) << 32) | <uint64_t><uint32_t>c
    return <uint32_t>((key * 0x9E3779B97F4A7C15ULL) >> (64 - S.hbits))


cdef inline int32_t sam_find(const Sam* S, int32_t s, token_t c) noexcept nogil:
    """The transition (s, c), or -1."""
    cdef uint32_t mask = (<uint32_t>1 << S.hbits) - 1
    cdef uint32_t i = sam_hash(S, s, c)
    cdef int32_t e
    while True:
        e = S.htab[i]
        if e < 0:
            return -1
        if S.ed[e].src == s and S.ed[e].tok == c:
            return e
        i = (i + 1) & mask


cdef inline void sam_hash_insert(Sam* S, int32_t e) noexcept nogil:
    cdef uint32_t mask = (<uint32_t>1 << S.hbits) - 1
    cdef uint32_t i = sam_hash(S, S.ed[e].src, S.ed[e].tok)
    while S.htab[i] >= 0:
        i = (i + 1) & mask
    S.htab[i] = e


cdef inline void sam_add_edge(Sam* S, int32_t s, token_t c, int32_t t) noexcept nogil:
    cdef int32_t e = S.n_edges
    S.n_edges += 1
    S.ed[e].src = s
    S.ed[e].tok = c
    S.ed[e].to = t
    S.ed[e].next = S.sedge[s]
    S.sedge[s] = e
    sam_hash_insert(S, e)


cdef inline int32_t sam_new_state(Sam* S, int32_t length, int32_t link, int32_t cnt,
                                  int32_t pos) noexcept nogil:
    cdef int32_t v = S.n_states
    S.n_states += 1
    S.st[v].len = length
    S.st[v].link = link
    S.st[v].cnt = cnt
    S.st[v].pos = pos
    S.sedge[v] = -1
    return v


cdef inline void sam_clear(Sam* S) noexcept nogil:
    """Empty the automaton (root only): O(transitions), not O(table)."""
    cdef uint32_t mask, i
    cdef int32_t e
    if S.cap == 0:
        return
    mask = (<uint32_t>1 << S.hbits) - 1
    if <int64_t>S.n_edges * 8 > mask:
        memset(S.htab, 0xFF, (<size_t>mask + 1) * sizeof(int32_t))
    else:
        for e in range(S.n_edges):
            # Clearing may have opened holes before e's slot: skip them, e is further on.
            i = sam_hash(S, S.ed[e].src, S.ed[e].tok)
            while S.htab[i] != e:
                i = (i + 1) & mask
            S.htab[i] = -1
    S.n = 0
    S.n_states = 0
    S.n_edges = 0
    sam_new_state(S, 0, -1, 0, -1)
    S.last = 0


cdef inline size_t sam_bytes_for(size_t cap, int32_t hbits) noexcept nogil:
    # states (4 int32 + the first transition) + transitions (4 int32) + hash table + text
    return (2 * cap + 1) * 5 * 4 + 3 * cap * 4 * 4 + ((<size_t>1) << hbits) * 4 + cap * 4


cdef inline int sam_resize(void** array, size_t size) noexcept nogil:
    """realloc `*array` to `size` bytes: 0 ok, -1 out of memory (`*array` left as it was)."""
    cdef void* p = realloc(array[0], size)
    if p == NULL:
        return -1
    array[0] = p
    return 0


cdef inline int sam_reserve(Sam* S, int32_t need) noexcept nogil:
    """Grow the arrays to hold `need` <= max_cap tokens (doubling). 0 ok, -1 out of memory."""
    cdef int32_t cap = S.cap
    cdef int32_t hbits = 1
    cdef int32_t e
    cdef size_t ns, ne, nh
    if need <= cap:
        return 0
    if need > S.max_cap:
        return -1
    if cap < MIN_CAP:
        cap = MIN_CAP
    while cap < need:
        cap = cap * 2 if cap <= S.max_cap // 2 else S.max_cap
    if cap > S.max_cap:
        cap = S.max_cap
    ns = 2 * <size_t>cap + 1          # a SAM over n tokens has at most 2n - 1 states + root
    ne = 3 * <size_t>cap              # ... and at most 3n - 4 transitions (n >= 3)
    while (<size_t>1 << hbits) < 4 * <size_t>cap:      # load factor <= 3/4
        hbits += 1
    nh = <size_t>1 << hbits
    # each array is kept as soon as it is resized: on failure sam_free releases them all
    if (sam_resize(<void**>&S.st, ns * sizeof(SamState))
            or sam_resize(<void**>&S.sedge, ns * sizeof(int32_t))
            or sam_resize(<void**>&S.ed, ne * sizeof(SamEdge))
            or sam_resize(<void**>&S.text, <size_t>cap * sizeof(token_t))
            or sam_resize(<void**>&S.htab, nh * sizeof(int32_t))):
        return -1
    memset(S.htab, 0xFF, nh * sizeof(int32_t))
    S.hbits = hbits
    if S.cap == 0:
        S.cap = cap
        sam_clear(S)
    else:
        for e in range(S.n_edges):
            sam_hash_insert(S, e)
    S.cap = cap
    return 0


cdef inline void sam_free(Sam* S) noexcept nogil:
    free(S.st); free(S.sedge); free(S.ed); free(S.htab); free(S.text)
    S.st = NULL
    S.ed = NULL
    S.sedge = S.htab = NULL
    S.text = NULL
    S.cap = S.n = S.n_states = S.n_edges = S.last = S.hbits = 0


cdef inline void sam_extend(Sam* S, token_t c) noexcept nogil:
    """Append one token (the caller reserved room). Amortized O(1) + O(COUNT_DEPTH)."""
    cdef int32_t pos = S.n
    cdef int32_t cur, p, q, cl, e, f, s, k
    S.text[pos] = c
    S.n += 1
    cur = sam_new_state(S, S.st[S.last].len + 1, -1, 0, pos)
    p = S.last
    while p >= 0 and sam_find(S, p, c) < 0:
        sam_add_edge(S, p, c, cur)
        p = S.st[p].link
    if p < 0:
        S.st[cur].link = 0
    else:
        q = S.ed[sam_find(S, p, c)].to
        if S.st[p].len + 1 == S.st[q].len:
            S.st[cur].link = q
        else:
            cl = sam_new_state(S, S.st[p].len + 1, S.st[q].link, S.st[q].cnt, S.st[q].pos)
            f = S.sedge[q]
            while f >= 0:
                sam_add_edge(S, cl, S.ed[f].tok, S.ed[f].to)
                f = S.ed[f].next
            while p >= 0:
                e = sam_find(S, p, c)
                if e < 0 or S.ed[e].to != q:
                    break
                S.ed[e].to = cl
                p = S.st[p].link
            S.st[q].link = cl
            S.st[cur].link = cl
    S.last = cur
    # the new occurrence, in the `depth` longest contexts that end with it
    s = cur
    k = 0
    while s > 0 and k < S.depth:
        S.st[s].cnt += 1
        S.st[s].pos = pos
        s = S.st[s].link
        k += 1


cdef inline void sam_rebuild_tail(Sam* S, int32_t start) noexcept nogil:
    """Rebuild S over its own text[start:]."""
    cdef int32_t n = S.n - start
    cdef int32_t i
    memmove(S.text, S.text + start, <size_t>n * sizeof(token_t))
    sam_clear(S)
    for i in range(n):
        sam_extend(S, S.text[i])


cdef inline void sam_step(const Sam* S, int32_t* v, int32_t* l, token_t c) noexcept nogil:
    """Matching statistics: (v, l) = the longest suffix (at most MAX_GLOBAL_MATCH tokens) of
    the tokens read so far that occurs in S, moved over one more token."""
    cdef int32_t e
    while True:
        e = sam_find(S, v[0], c)
        if e >= 0:
            v[0] = S.ed[e].to
            l[0] += 1
            break
        if v[0] == 0:
            l[0] = 0
            return
        v[0] = S.st[v[0]].link
        l[0] = S.st[v[0]].len
    if l[0] > MAX_GLOBAL_MATCH:
        l[0] = MAX_GLOBAL_MATCH
        while S.st[S.st[v[0]].link].len >= MAX_GLOBAL_MATCH:
            v[0] = S.st[v[0]].link


cdef inline int32_t top_child(const Sam* S, int32_t v, int32_t* a, int32_t* n) noexcept nogil:
    """The transition of v to its most frequent child (the latest occurrence breaks ties), or
    -1 if v has none; a = that child's count, n = the sum over all children."""
    cdef int32_t f = S.sedge[v], t, c, best = -1, bc = 0, bp = -1, tot = 0
    while f >= 0:
        t = S.ed[f].to
        c = S.st[t].cnt
        tot += c
        if c > bc or (c == bc and S.st[t].pos > bp):
            best = f
            bc = c
            bp = S.st[t].pos
        f = S.ed[f].next
    a[0] = bc
    n[0] = tot
    return best


cdef inline int32_t child_after(const Sam* S, int32_t v, token_t skip, int32_t below_cnt,
                                int32_t below_pos, int32_t* cnt) noexcept nogil:
    """The transition of v to its best child ranked strictly below (below_cnt, below_pos) in
    top_child's order (count, then latest occurrence), leaving out the token `skip` and the
    negative tokens (separators); -1 if none; cnt = that child's count. Children are enumerated
    best first by passing back the last one's (count, position): O(out-degree) per call."""
    cdef int32_t f = S.sedge[v], t, c, p, best = -1, bc = 0, bp = -1
    while f >= 0:
        t = S.ed[f].to
        c = S.st[t].cnt
        p = S.st[t].pos
        if (S.ed[f].tok >= 0 and S.ed[f].tok != skip
                and (c < below_cnt or (c == below_cnt and p < below_pos))
                and (best < 0 or c > bc or (c == bc and p > bp))):
            best = f
            bc = c
            bp = p
        f = S.ed[f].next
    cnt[0] = bc
    return best
