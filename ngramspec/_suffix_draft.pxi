# Included by _suffix.pyx (one C module: the kernels stay inlinable and share its DEF
# constants and imports); the draft walk (a chain) and the draft tree.

# ---------------------------------------------------------------------------------------------
# The draft walk
# ---------------------------------------------------------------------------------------------

cdef struct Walker:
    # One source's draft, built a token at a time (see draft_walk).
    const Sam* S
    int src                 # 0 local, 1 global
    bint extrapolate        # S holds the context itself: copy the draft past its end
    bint alive
    int32_t v, l            # state and match length (context + draft so far)
    int64_t src_pos         # >= 0: copying the virtual text S.text + tok from here
    uint32_t p              # probability that the whole draft so far is accepted, Q16
    int32_t n_draft         # tokens at or above the threshold
    int32_t n_pred          # n_draft plus the first token under it (learned from, not drafted)
    uint64_t score          # expected accepted tokens, Q16
    token_t* tok
    uint16_t* cell
    token_t x               # candidate next token, its frequency bucket and state
    int fb
    int32_t next_v


cdef inline void walker_init(Walker* w, const Sam* S, int src, bint extrapolate, int32_t v,
                             int32_t l, token_t* tok, uint16_t* cell) noexcept nogil:
    w.S = S
    w.src = src
    w.extrapolate = extrapolate
    w.alive = v > 0 and l > 0
    w.v = v
    w.l = l
    w.src_pos = -1
    w.p = ONE
    w.n_draft = 0
    w.n_pred = 0
    w.score = 0
    w.tok = tok
    w.cell = cell
    w.x = 0
    w.fb = 0
    w.next_v = 0


cdef inline bint walker_next(Walker* w) noexcept nogil:
    """Find the candidate next token (x, fb); False when the source has no continuation."""
    cdef const Sam* S = w.S
    cdef int32_t best, bc, n
    if w.src_pos < 0:
        best = top_child(S, w.v, &bc, &n)
        if best < 0:
            # the only occurrence ends the text: its continuation is this very draft
            if not w.extrapolate or w.n_pred == 0:
                return False
            w.src_pos = <int64_t>S.st[w.v].pos + 1
        elif S.ed[best].tok == SEP:
            return False
        else:
            w.x = S.ed[best].tok
            w.fb = freq_bucket(bc, n)
            w.next_v = S.ed[best].to
            return True
    w.x = S.text[w.src_pos] if w.src_pos < S.n else w.tok[w.src_pos - S.n]
    w.fb = N_FB - 1
    return True


cdef inline void walker_take(Walker* w, const uint32_t* acc, const uint32_t* tried, int stage,
                             bint agree, uint64_t threshold) noexcept nogil:
    """Score the candidate; draft it if the whole draft stays at or above the threshold."""
    cdef int ce = cell_index(w.src, w.l, w.fb, stage, agree)
    w.p = <uint32_t>((<uint64_t>w.p * cal_prob(acc, tried, ce)) >> 16)
    w.tok[w.n_pred] = w.x
    w.cell[w.n_pred] = <uint16_t>ce
    w.n_pred += 1
    if w.p < threshold:
        w.alive = False
        return
    w.n_draft += 1
    w.score += w.p
    if w.src_pos < 0:
        w.v = w.next_v
    else:
        w.src_pos += 1
    w.l += 1


cdef void draft_walk(Walker* wl, Walker* wg, const uint32_t* acc, const uint32_t* tried,
                     bint streak, int32_t cap, uint32_t base, uint32_t step) noexcept nogil:
    """Both sources' drafts in lockstep (where they agree, each is trusted more); token j is
    drafted while the draft's probability stays >= base + step * j."""
    cdef int32_t j
    cdef bint hl, hg, agree = True
    cdef int st
    for j in range(cap):
        hl = wl.alive and walker_next(wl)
        hg = wg.alive and walker_next(wg)
        wl.alive = hl
        wg.alive = hg
        if not (hl or hg):
            break
        agree = agree and hl and hg and wl.x == wg.x
        st = stage_of(j, streak)
        if hl:
            walker_take(wl, acc, tried, st, agree, base + <uint64_t>step * j)
        if hg:
            walker_take(wg, acc, tried, st, agree, base + <uint64_t>step * j)


# ---------------------------------------------------------------------------------------------
# The draft tree (an engine that verifies a tree of a fixed number of tokens: SGLang)
# ---------------------------------------------------------------------------------------------

cdef struct TreeNode:
    # One node of a draft tree under construction (node 0 is the root, the last verified token).
    int32_t v, l            # automaton state after the node's path (-1: none, nothing below)
                            # and the match length the calibration buckets it by
    int32_t depth           # tokens from the root (the draft position of the node's children)
    int32_t parent
    token_t tok
    uint32_t P              # probability that the path to this node is accepted, Q16
    token_t ref             # the reference child: the chain's next token on the chain's path,
                            # the most frequent continuation elsewhere; < 0 none (no children)
    uint32_t ref_p          # its probability given this node, Q16
    int32_t ref_cnt, n_tot  # its count (0: not a child of v) and the sum over v's children
    bint ref_pending        # the reference child is not in the tree yet: it is the candidate
    int32_t below_cnt, below_pos   # rank of the last other child offered
    int32_t chain_j         # >= 0: the node's path is the draft's first chain_j tokens
    int32_t merged          # its index in the merged tree (tree_merge), -1 root
    bint has_cand           # the candidate: the node's best child not in the tree yet
    token_t cand_tok
    int32_t cand_v
    uint32_t cand_p         # its path's probability, Q16


cdef inline void tree_ref_top(TreeNode* u, const Sam* S, int src, const uint32_t* acc,
                              const uint32_t* tried, bint streak) noexcept nogil:
    """u's reference child off the chain: its most frequent continuation, scored as the walk
    scores a token (one source, so never in agreement)."""
    cdef int32_t a, n, e
    u.ref = -1
    u.ref_pending = False
    if u.v < 0:
        return
    e = top_child(S, u.v, &a, &n)
    if e < 0 or S.ed[e].tok < 0:          # no continuation, or the end of a stored sequence
        return
    u.ref = S.ed[e].tok
    u.ref_cnt = a
    u.n_tot = n
    u.ref_p = cal_prob(acc, tried, cell_index(src, u.l, freq_bucket(a, n),
                                              stage_of(u.depth, streak), False))
    u.ref_pending = True


cdef inline void tree_offer(TreeNode* u, const Sam* S) noexcept nogil:
    """Set u's candidate: the reference child while it is pending, then the other children best
    first. An other child of count a gets the probability mass the reference leaves, shared in
    proportion to counts, and never more than the reference's in proportion to counts."""
    cdef int32_t e, a
    u.has_cand = False
    if u.ref < 0:
        return
    if u.ref_pending:
        e = sam_find(S, u.v, u.ref) if u.v >= 0 else -1
        u.cand_tok = u.ref
        u.cand_v = S.ed[e].to if e >= 0 else -1
        u.cand_p = <uint32_t>((<uint64_t>u.P * u.ref_p) >> 16)
        u.has_cand = True
        return
    if u.v < 0 or u.n_tot <= u.ref_cnt:
        return
    e = child_after(S, u.v, u.ref, u.below_cnt, u.below_pos, &a)
    if e < 0:
        return
    u.below_cnt = a
    u.below_pos = S.st[S.ed[e].to].pos
    tree_sibling(u, S, e, a)


cdef inline void tree_sibling(TreeNode* u, const Sam* S, int32_t e, int32_t a) noexcept nogil:
    """Make transition e, a child of u's state of count a other than the reference, u's
    candidate (probability as tree_offer says)."""
    cdef uint64_t p, q
    p = (<uint64_t>(ONE - u.ref_p) * <uint64_t>a) // <uint64_t>(u.n_tot - u.ref_cnt)
    if u.ref_cnt > 0:
        q = (<uint64_t>u.ref_p * <uint64_t>a) // <uint64_t>u.ref_cnt
        if q < p:
            p = q
    u.cand_tok = S.ed[e].tok
    u.cand_v = S.ed[e].to
    u.cand_p = <uint32_t>((<uint64_t>u.P * p) >> 16)
    u.has_cand = True


cdef int32_t top_children(const Sam* S, int32_t v, int32_t* out, int32_t k,
                          int32_t* tot) noexcept nogil:
    """v's k best children (their transitions, separators left out) in top_child's order, in
    one pass over v's transitions (for a state with very many: the empty context's); returns
    how many, tot = the sum of all the children's counts."""
    cdef int32_t f = S.sedge[v], n = 0, i, c, p, sum = 0
    while f >= 0:
        c = S.st[S.ed[f].to].cnt
        p = S.st[S.ed[f].to].pos
        if S.ed[f].tok >= 0:
            sum += c
            i = n if n < k else k
            while i > 0 and (c > S.st[S.ed[out[i - 1]].to].cnt
                             or (c == S.st[S.ed[out[i - 1]].to].cnt and p > S.st[S.ed[out[i - 1]].to].pos)):
                if i < k:
                    out[i] = out[i - 1]
                i -= 1
            if i < k:
                out[i] = f
                if n < k:
                    n += 1
        f = S.ed[f].next
    tot[0] = sum
    return n


cdef inline void tree_root_unmatched(TreeNode* u, const Sam* S, int src, const int32_t* top,
                                     int32_t n_top, const uint32_t* acc, const uint32_t* tried,
                                     bint streak) noexcept nogil:
    """The root when no earlier occurrence of the last token is known (the empty context):
    its children are the request's most frequent tokens, top[0 .. n_top), the first scored
    as the walk scores a token, the others as tree_offer's other children."""
    if n_top == 0:
        return
    u.ref = S.ed[top[0]].tok
    u.ref_cnt = S.st[S.ed[top[0]].to].cnt
    u.ref_p = cal_prob(acc, tried, cell_index(src, 0, freq_bucket(u.ref_cnt, u.n_tot),
                                              stage_of(0, streak), False))
    u.ref_pending = True
    u.below_pos = 1
    tree_offer(u, S)


cdef inline void tree_offer_top(TreeNode* u, const Sam* S, const int32_t* top,
                                int32_t n_top) noexcept nogil:
    """tree_offer for tree_root_unmatched's root: its next child from `top`."""
    u.has_cand = False
    if u.below_pos < n_top and u.n_tot > u.ref_cnt:
        tree_sibling(u, S, top[u.below_pos], S.st[S.ed[top[u.below_pos]].to].cnt)
        u.below_pos += 1


cdef inline void tree_node(TreeNode* u, int32_t parent, token_t tok, int32_t v, int32_t l,
                           int32_t depth, uint32_t P) noexcept nogil:
    u.parent = parent
    u.tok = tok
    u.v = v
    u.l = l
    u.depth = depth
    u.P = P
    u.ref = -1
    u.ref_pending = False
    u.ref_cnt = 0
    u.n_tot = 0
    u.below_cnt = 0x7FFFFFFF
    u.below_pos = 0x7FFFFFFF
    u.chain_j = -1
    u.has_cand = False


cdef inline void tree_refs(TreeNode* u, const Sam* S, int src, const token_t* chain,
                           const uint16_t* cells, int32_t n_chain, const uint32_t* acc,
                           const uint32_t* tried, bint streak) noexcept nogil:
    """u's reference child, then its candidate: on the draft's path (within the kept n_chain
    tokens) the draft's next token, as the walk scored it; elsewhere the most frequent
    continuation."""
    cdef int32_t e, a, n
    if 0 <= u.chain_j < n_chain:
        u.ref = chain[u.chain_j]
        u.ref_p = cal_prob(acc, tried, cells[u.chain_j])
        u.ref_pending = True
        if u.v >= 0:
            top_child(S, u.v, &a, &n)
            e = sam_find(S, u.v, u.ref)
            u.n_tot = n
            u.ref_cnt = S.st[S.ed[e].to].cnt if e >= 0 else 0
    else:
        tree_ref_top(u, S, src, acc, tried, streak)
    tree_offer(u, S)


# The most children a root without a match (tree_root_unmatched) offers.
DEF ROOT_TOP = 16


cdef int32_t tree_build(TreeNode* T, const Sam* S, int src, int32_t v0, int32_t l0,
                        const token_t* chain, const uint16_t* cells, int32_t n_chain,
                        int32_t budget, const uint32_t* acc, const uint32_t* tried,
                        bint streak) noexcept nogil:
    """The draft tree of at most `budget` tokens below the root; returns its nodes, root
    included (T[1 ..] in the order added: parents before children, no two equal siblings).

    Contract: T has room for budget + 1 nodes; chain / cells hold the slot's last draft (as
    drafted, and their calibration cells), 0 <= n_chain <= its length; S is the automaton that
    draft came from (source `src`), unchanged since, and (v0, l0) the walk's start in it (S may
    be NULL: no alternatives, the tree is at most the chain). v0 = 0 (no earlier occurrence
    of the last token) in the slot's own automaton (src 0): the root is the empty context
    (tree_root_unmatched); in the store's, whose empty context has the whole vocabulary as
    children, no tree.
    Rule: best first from the root: repeatedly the candidate with the likeliest path, each node
    offering its best child not in the tree yet (tree_offer; ties: the node added first). The
    sum of the nodes' path probabilities is the expected accepted length, and a child is never
    likelier than its parent, so taking the likeliest frontier node each time maximises it
    for the estimates. O(budget * (budget + out-degree)), no allocation, no lock taken."""
    cdef int32_t m, u, best, n_top = 0
    cdef int32_t top[ROOT_TOP]
    cdef bint on_chain
    cdef TreeNode* t
    if S == NULL or v0 < 0 or (v0 == 0 and src != 0) or (v0 > 0 and l0 <= 0):
        v0 = -1
    tree_node(&T[0], -1, -1, v0, l0, 0, ONE)
    if v0 == 0:
        n_top = top_children(S, 0, top, budget if budget < ROOT_TOP else ROOT_TOP, &T[0].n_tot)
        tree_root_unmatched(&T[0], S, src, top, n_top, acc, tried, streak)
    else:
        T[0].chain_j = 0
        tree_refs(&T[0], S, src, chain, cells, n_chain, acc, tried, streak)
    m = 1
    while m <= budget:
        best = -1
        for u in range(m):
            if T[u].has_cand and (best < 0 or T[u].cand_p > T[best].cand_p):
                best = u
        if best < 0:
            break
        t = &T[best]
        on_chain = t.ref_pending and t.chain_j >= 0 and t.chain_j < n_chain
        tree_node(&T[m], best, t.cand_tok, t.cand_v, t.l + 1, t.depth + 1, t.cand_p)
        if on_chain:
            T[m].chain_j = t.chain_j + 1
        tree_refs(&T[m], S, src, chain, cells, n_chain, acc, tried, streak)
        t.ref_pending = False
        if best == 0 and v0 == 0:
            tree_offer_top(t, S, top, n_top)
        else:
            tree_offer(t, S)
        m += 1
    return m


cdef int32_t tree_merge(TreeNode* A, int32_t ma, TreeNode* B, int32_t mb, int32_t budget,
                        int32_t* tok, int32_t* par) noexcept nogil:
    """The two sources' trees as one: their nodes in order of path probability (A's first on
    ties), a node whose path is already in the tree merged into it (its children follow it
    there), at most `budget` tokens; writes tok / par (parents as in draft_tree), returns the
    count. Each tree's nodes come in non-increasing path probability (best first, a child
    never likelier than its parent), so the merge is the best-first tree of the two sources'
    candidates, parents before children. O(budget^2)."""
    cdef int32_t ia = 1, ib = 1, n = 0, j, p
    cdef TreeNode* x
    A[0].merged = -1
    B[0].merged = -1
    while n < budget and (ia < ma or ib < mb):
        if ia < ma and (ib >= mb or A[ia].P >= B[ib].P):
            x = &A[ia]
            p = A[x.parent].merged
            ia += 1
        else:
            x = &B[ib]
            p = B[x.parent].merged
            ib += 1
        x.merged = -2
        for j in range(p + 1, n):
            if par[j] == p and tok[j] == x.tok:
                x.merged = j
                break
        if x.merged == -2:
            tok[n] = x.tok
            par[n] = p
            x.merged = n
            n += 1
    return n


cdef int32_t* out_int32(object out, int k, Py_ssize_t offset, Py_ssize_t n) except NULL:
    """`draft_tree`'s ``out[k]`` checked (a writable C-contiguous int32 array holding ``offset +
    n`` entries), as a pointer to its entry `offset`."""
    name = ("tokens", "parents")[k]
    if not (isinstance(out, tuple) and len(out) == 2):
        raise WrongType("out", out, "a (tokens, parents) tuple of int32 arrays")
    a = out[k]
    # numpy's C macros: the attribute route (dtype, flags objects) was a third of the call
    if not (cnp.PyArray_Check(a) and cnp.PyArray_TYPE(<cnp.ndarray>a) == cnp.NPY_INT32
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a)
            and cnp.PyArray_ISWRITEABLE(<cnp.ndarray>a)):
        raise WrongType(f"out's {name}", a, "a writable C-contiguous int32 numpy array")
    cdef Py_ssize_t size = cnp.PyArray_SIZE(<cnp.ndarray>a)
    if offset < 0 or offset + n > size:
        raise OutOfRange("offset", offset, f"0 .. {size - n} (out's {name} holds {size}, "
                         f"the tree up to {n})")
    return <int32_t*>cnp.PyArray_DATA(<cnp.ndarray>a) + offset
