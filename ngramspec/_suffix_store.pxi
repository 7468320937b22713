# Included by _suffix.pyx (one C module: the kernels stay inlinable and share its DEF
# constants and imports); the global store and the per-slot state (local automaton, cursor,
# learning).

# ---------------------------------------------------------------------------------------------
# Global store
# ---------------------------------------------------------------------------------------------

cdef struct Store:
    Sam sam
    int32_t budget          # tokens, separators included; 0 = no global store
    uint64_t gen            # bumped at every change: the slots' cursors re-synchronize
    int64_t n_evictions


cdef int store_insert(Store* G, const token_t* t, int32_t n) noexcept nogil:
    """Append one sequence and its separator; evict the oldest sequences first when the budget
    would be exceeded. 0 ok, -1 out of memory."""
    cdef Sam* S = &G.sam
    cdef int32_t keep_from, i, room
    if G.budget < 2 or n <= 0:
        return 0
    if n > G.budget - 1:                 # only the newest part of an over-long sequence
        t += n - (G.budget - 1)
        n = G.budget - 1
    if S.n + n + 1 > G.budget:
        # Keep the newest whole sequences that leave room for this one within 3/4 of the
        # budget, so that a rebuild, O(budget), happens at most every budget/4 tokens.
        room = G.budget - G.budget // 4 - (n + 1)
        keep_from = S.n
        if room > 0:
            i = S.n - room
            while i < S.n and S.text[i - 1] != SEP:     # i > 0: S.n + n + 1 > budget > room
                i += 1
            keep_from = i
        G.n_evictions += 1
        sam_rebuild_tail(S, keep_from)
        G.gen += 1                       # the cursors' states are gone, even if reserve fails
    if sam_reserve(S, S.n + n + 1) < 0:
        return -1
    for i in range(n):
        sam_extend(S, t[i])
    sam_extend(S, SEP)
    G.gen += 1
    return 0


cdef int store_insert_locked(Store* G, PyThread_type_lock lock, const token_t* t,
                             int32_t n) noexcept nogil:
    """`store_insert` under the store's lock, waiting for it: a finished request of a slot
    and a sequence from the store log (`SuffixProposer.insert_global`) go in the same way.
    Called without the GIL (an insertion may rebuild the store, O(budget))."""
    cdef int rc
    PyThread_acquire_lock(lock, WAIT_LOCK)
    rc = store_insert(G, t, n)
    PyThread_release_lock(lock)
    return rc


# ---------------------------------------------------------------------------------------------
# Per slot
# ---------------------------------------------------------------------------------------------

cdef struct Params:
    int32_t max_draft
    uint32_t min_p          # Q16
    uint32_t gain_cost      # Q16
    uint32_t draft_cost     # Q16 per drafted token
    int32_t max_context
    int32_t global_prompt


cdef struct Slot:
    Sam loc                 # the current request (context positions loc_off ..)
    bint active
    int64_t ctx_len         # context tokens indexed (prompt + output so far, sampled included)
    int64_t loc_off         # context position of loc.text[0] (after re-indexing the tail)
    int64_t out_start       # context position where the output starts
    # global cursor: the longest suffix (<= MAX_GLOBAL_MATCH) of the context in the store
    int32_t g_state, g_len
    int64_t g_pos           # context tokens the cursor has read
    uint64_t g_gen
    # the last call's predictions, per source, scored against what arrives next
    int64_t pred_base       # context length when they were made; -1 = none
    int32_t n_pred[2]
    token_t* pred_tok       # 2 x (max_draft + 1)
    uint16_t* pred_cell     # 2 x (max_draft + 1)
    bint streak             # the last call's predictions foresaw every token that came
    # outcomes observed but not folded into the server's calibration yet (its lock was busy)
    uint32_t* pend          # 4 * (max_draft + 1) + 2 entries: two calls' outcomes
    int32_t n_pend, pend_cap
    # the last draft and its accepted length, for the end of the output
    token_t* last_draft
    int32_t n_last_draft
    int32_t last_src        # the walk it came from: 0 local, 1 global
    int32_t n_last_acc      # -1: no accept since the last draft
    # draft_tree's nodes (allocated on its first call, grown to the largest budget asked)
    TreeNode* tree
    int32_t tree_cap


cdef inline token_t ctx_at(const token_t* inp, Py_ssize_t n, token_t sampled,
                           int64_t i) noexcept nogil:
    return inp[i] if i < n else sampled


cdef void slot_restart(Slot* s) noexcept nogil:
    """Forget the current request (its pending outcomes stay: they are the server's)."""
    sam_clear(&s.loc)
    s.ctx_len = 0
    s.loc_off = 0
    s.out_start = 0
    s.g_state = 0
    s.g_len = 0
    s.g_pos = 0
    s.g_gen = 0
    s.pred_base = -1
    s.n_pred[0] = 0
    s.n_pred[1] = 0
    s.streak = False
    s.n_last_draft = 0
    s.n_last_acc = -1


cdef int slot_begin(Slot* s, const token_t* prompt, int64_t n, int64_t off) noexcept nogil:
    """Index a new request's prompt (its tokens from context position `off`)."""
    cdef int64_t i
    slot_restart(s)
    if sam_reserve(&s.loc, <int32_t>(n if n > 0 else 1)) < 0:
        return -1
    for i in range(n):
        sam_extend(&s.loc, prompt[i])
    s.loc_off = off
    s.ctx_len = off + n
    s.out_start = off + n
    s.active = True
    return 0


cdef bint slot_follows(const Slot* s, const token_t* inp, Py_ssize_t n) noexcept nogil:
    """Does inp extend the context indexed so far? (compares the last 8 tokens held)"""
    cdef int64_t i, lo
    if n < s.ctx_len:
        return False
    lo = s.ctx_len - 8
    if lo < s.loc_off:
        lo = s.loc_off
    for i in range(lo, s.ctx_len):
        if inp[i] != s.loc.text[i - s.loc_off]:
            return False
    return True


cdef inline void slot_pend(Slot* s, Calib* C, uint32_t e) noexcept nogil:
    if s.n_pend < s.pend_cap:
        s.pend[s.n_pend] = e
        s.n_pend += 1
    else:                                 # the lock busy for several calls: rare, counted
        C.n_dropped += 1                  # (a racy count: a statistic only)


cdef void slot_learn(Slot* s, Calib* C, const Params* P, const token_t* inp, Py_ssize_t n,
                     token_t sampled) noexcept nogil:
    """Score the last call's predictions against the tokens that came since (the outcomes go
    to the slot's pending list, for cal_fold)."""
    cdef int src, i
    cdef int64_t avail
    cdef bint hit
    cdef int32_t stride = P.max_draft + 1
    if s.pred_base < 0:
        return
    avail = n + 1 - s.pred_base           # accepted draft tokens + the target's own
    slot_pend(s, C, RATE_TAG | <uint32_t>min(avail, <int64_t>P.max_draft + 1))
    s.streak = False
    for src in range(N_SRC):
        hit = False
        for i in range(s.n_pred[src]):
            if i >= avail:
                break
            hit = s.pred_tok[src * stride + i] == ctx_at(inp, n, sampled, s.pred_base + i)
            slot_pend(s, C, (<uint32_t>s.pred_cell[src * stride + i] << 1) | (1 if hit else 0))
            if not hit:
                break
        if hit and s.n_pred[src] >= avail:
            s.streak = True
    s.pred_base = -1


cdef int slot_sync(Slot* s, Calib* C, const Params* P, const token_t* inp, Py_ssize_t n,
                   token_t sampled) noexcept nogil:
    """Learn from what came, then bring the local automaton up to inp + [sampled]."""
    cdef int64_t i, L = n + 1, start
    cdef Sam* S = &s.loc
    slot_learn(s, C, P, inp, n, sampled)
    if L - s.loc_off > P.max_context:
        # outgrown: re-index the newest half of the context (room first: out of memory leaves
        # the slot as it was)
        start = L - P.max_context // 2
        if sam_reserve(S, <int32_t>(L - start)) < 0:
            return -1
        sam_clear(S)
        s.loc_off = start
        for i in range(start, L):
            sam_extend(S, ctx_at(inp, n, sampled, i))
    else:
        if sam_reserve(S, <int32_t>(L - s.loc_off)) < 0:
            return -1
        for i in range(s.ctx_len, L):
            sam_extend(S, ctx_at(inp, n, sampled, i))
    s.ctx_len = L
    return 0


cdef void slot_cursor(Slot* s, const Store* G, const token_t* inp, Py_ssize_t n,
                      token_t sampled) noexcept nogil:
    """Advance the global cursor over the context's new tokens."""
    cdef int64_t L = n + 1, i
    if s.g_gen != G.gen or L - s.g_pos > MAX_GLOBAL_MATCH:
        # the store changed (or a long stretch is unread): re-read the newest tokens
        s.g_state = 0
        s.g_len = 0
        s.g_pos = L - MAX_GLOBAL_MATCH if L > MAX_GLOBAL_MATCH else 0
        s.g_gen = G.gen
    for i in range(s.g_pos, L):
        sam_step(&G.sam, &s.g_state, &s.g_len, ctx_at(inp, n, sampled, i))
    s.g_pos = L


cdef void slot_walk(Slot* s, const Calib* C, const Params* P, const Store* G,
                    const token_t* inp, Py_ssize_t n, token_t sampled) noexcept nogil:
    """Both walks (G = NULL: local only); leaves the predictions in pred_tok / n_pred."""
    cdef Sam* S = &s.loc
    cdef int32_t stride = P.max_draft + 1
    cdef int32_t v = S.st[S.last].link
    cdef Walker wl, wg
    cdef uint64_t gain, base
    cdef int64_t rate = ld64(&C.rate)
    walker_init(&wl, S, 0, True, v, S.st[v].len if v > 0 else 0, s.pred_tok, s.pred_cell)
    if G != NULL:
        slot_cursor(s, G, inp, n, sampled)
        walker_init(&wg, &G.sam, 1, False, s.g_state, s.g_len, s.pred_tok + stride,
                    s.pred_cell + stride)
    else:
        walker_init(&wg, S, 1, False, 0, 0, NULL, NULL)
    gain = <uint64_t>(rate - ONE) if rate > ONE else 0
    if gain > GAIN_CAP * ONE:
        gain = GAIN_CAP * ONE
    base = (P.gain_cost * gain) >> 16
    if base < P.min_p:
        base = P.min_p
    draft_walk(&wl, &wg, C.acc, C.tried, s.streak, P.max_draft, <uint32_t>base,
               P.draft_cost)
    s.n_pred[0] = wl.n_pred
    s.n_pred[1] = wg.n_pred
    s.pred_base = n + 1
    # the draft: the walk expecting more accepted tokens (local on ties)
    s.n_last_draft = wg.n_draft if wg.score > wl.score else wl.n_draft
    s.last_src = 1 if wg.score > wl.score else 0
    memcpy(s.last_draft, s.pred_tok + (stride if wg.score > wl.score else 0),
           s.n_last_draft * sizeof(token_t))
    s.n_last_acc = -1
