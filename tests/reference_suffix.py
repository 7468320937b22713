"""Pure-Python reference of the ngram-suffix proposer (ngramspec/_suffix.pyx).

Written for clarity, not speed: dict transitions, lists, plain integers. It makes the same
drafts as the Cython kernel for the same calls (tests/test_suffix.py checks it with
hypothesis). The integer arithmetic (Q16 probabilities, floor divisions, shifts) is the
kernel's, so the two agree bit for bit. The hash table, the transition lists and the memory
layout are implementation details of the kernel that cannot change a draft: children are
ranked by (count, latest position) and no two children share a position.
"""
from __future__ import annotations

ONE = 1 << 16
N_SRC, N_LB, N_FB, N_ST, N_AG = 2, 10, 7, 6, 2
N_CELLS = N_SRC * N_LB * N_FB * N_ST * N_AG
N_CAL = N_CELLS + N_SRC * N_LB * N_ST
CAL_PRIOR = 16
CAL_WINDOW = 1024
RATE_SHIFT = 10
GAIN_CAP = 8
MAX_GLOBAL_MATCH = 512
COUNT_DEPTH = 32
SEP = -1
ROOT_TOP = 16          # the most children a root without a match offers


class Sam:
    """Suffix automaton with occurrence counts kept in the `depth` longest contexts."""

    def __init__(self, depth=COUNT_DEPTH):
        self.depth = depth
        self.clear()

    def clear(self):
        self.length, self.link, self.cnt, self.pos, self.next = [0], [-1], [0], [-1], [{}]
        self.text = []
        self.last = 0

    def _new(self, length, link, cnt, pos, nxt):
        self.length.append(length)
        self.link.append(link)
        self.cnt.append(cnt)
        self.pos.append(pos)
        self.next.append(nxt)
        return len(self.length) - 1

    def extend(self, c):
        pos = len(self.text)
        self.text.append(c)
        cur = self._new(self.length[self.last] + 1, -1, 0, pos, {})
        p = self.last
        while p >= 0 and c not in self.next[p]:
            self.next[p][c] = cur
            p = self.link[p]
        if p < 0:
            self.link[cur] = 0
        else:
            q = self.next[p][c]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new(self.length[p] + 1, self.link[q], self.cnt[q], self.pos[q],
                                  dict(self.next[q]))
                while p >= 0 and self.next[p].get(c) == q:
                    self.next[p][c] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur
        s, k = cur, 0
        while s > 0 and k < self.depth:
            self.cnt[s] += 1
            self.pos[s] = pos
            s = self.link[s]
            k += 1

    def rebuild_tail(self, start):
        text = self.text[start:]
        self.clear()
        for c in text:
            self.extend(c)

    def step(self, v, l, c):
        """Matching statistics, capped at MAX_GLOBAL_MATCH."""
        while c not in self.next[v]:
            if v == 0:
                return 0, 0
            v = self.link[v]
            l = self.length[v]
        v = self.next[v][c]
        l += 1
        if l > MAX_GLOBAL_MATCH:
            l = MAX_GLOBAL_MATCH
            while self.length[self.link[v]] >= MAX_GLOBAL_MATCH:
                v = self.link[v]
        return v, l

    def top_child(self, v):
        """(token, child, count, total) of the most frequent child (latest breaks ties)."""
        best = None
        total = 0
        for c, t in self.next[v].items():
            total += self.cnt[t]
            key = (self.cnt[t], self.pos[t])
            if best is None or key > best[0]:
                best = (key, c, t)
        if best is None:
            return None
        return best[1], best[2], best[0][0], total


def length_bucket(l):
    b = 0
    while l > 1 and b < N_LB - 1:
        l >>= 1
        b += 1
    return b


def freq_bucket(a, n):
    if n == 1:
        return 0
    if a == n:
        return 1 if n < 4 else 2
    if 4 * a >= 3 * n:
        return 3
    if 2 * a >= n:
        return 4
    return 5


def stage_of(j, streak):
    if j == 0:
        return 1 if streak else 0
    return 2 if j == 1 else 3 if j < 4 else 4 if j < 8 else 5


def cell_index(src, l, fb, stage, agree):
    return (((src * N_LB + length_bucket(l)) * N_FB + fb) * N_ST + stage) * N_AG + int(agree)


def coarse_index(cell):
    st = (cell // N_AG) % N_ST
    return N_CELLS + (cell // (N_AG * N_ST * N_FB)) * N_ST + st


def cal_prob(acc, tried, cell):
    c = coarse_index(cell)
    qc = ((acc[c] << 16) + ONE) // (tried[c] + 2)
    return ((acc[cell] << 16) + CAL_PRIOR * qc) // (tried[cell] + CAL_PRIOR)


def cal_observe(acc, tried, cell, hit):
    for c in (cell, coarse_index(cell)):
        tried[c] += 1
        acc[c] += hit
        if tried[c] >= CAL_WINDOW:
            tried[c] >>= 1
            acc[c] >>= 1


class Walker:
    def __init__(self, sam, src, extrapolate, v, l):
        self.sam, self.src, self.extrapolate = sam, src, extrapolate
        self.alive = v > 0 and l > 0
        self.v, self.l = v, l
        self.src_pos = -1
        self.p = ONE
        self.n_draft = 0
        self.score = 0
        self.tok, self.cell = [], []

    def next(self):
        S = self.sam
        if self.src_pos < 0:
            top = S.top_child(self.v)
            if top is None:
                if not self.extrapolate or not self.tok:
                    return False
                self.src_pos = S.pos[self.v] + 1
            elif top[0] == SEP:
                return False
            else:
                self.x, self.next_v = top[0], top[1]
                self.fb = freq_bucket(top[2], top[3])
                return True
        n = len(S.text)
        self.x = S.text[self.src_pos] if self.src_pos < n else self.tok[self.src_pos - n]
        self.fb = N_FB - 1
        return True

    def take(self, acc, tried, stage, agree, threshold):
        ce = cell_index(self.src, self.l, self.fb, stage, agree)
        self.p = (self.p * cal_prob(acc, tried, ce)) >> 16
        self.tok.append(self.x)
        self.cell.append(ce)
        if self.p < threshold:
            self.alive = False
            return
        self.n_draft += 1
        self.score += self.p
        if self.src_pos < 0:
            self.v = self.next_v
        else:
            self.src_pos += 1
        self.l += 1


def draft_walk(wl, wg, acc, tried, streak, cap, base, step):
    agree = True
    for j in range(cap):
        hl = wl.alive and wl.next()
        hg = wg.alive and wg.next()
        wl.alive, wg.alive = hl, hg
        if not (hl or hg):
            break
        agree = agree and hl and hg and wl.x == wg.x
        st = stage_of(j, streak)
        if hl:
            wl.take(acc, tried, st, agree, base + step * j)
        if hg:
            wg.take(acc, tried, st, agree, base + step * j)


class Store:
    def __init__(self, budget, depth):
        self.sam = Sam(depth)
        self.budget = budget
        self.gen = 1
        self.evictions = 0

    def insert(self, t):
        S = self.sam
        if self.budget < 2 or not t:
            return
        t = list(t)[-(self.budget - 1):]
        n = len(t)
        if len(S.text) + n + 1 > self.budget:
            room = self.budget - self.budget // 4 - (n + 1)
            keep_from = len(S.text)
            if room > 0:
                i = len(S.text) - room
                while i < len(S.text) and S.text[i - 1] != SEP:
                    i += 1
                keep_from = i
            self.evictions += 1
            S.rebuild_tail(keep_from)
        for c in t:
            S.extend(c)
        S.extend(SEP)
        self.gen += 1


class Slot:
    def __init__(self, depth):
        self.loc = Sam(depth)
        self.active = False
        self.restart()

    def restart(self):
        self.loc.clear()
        self.ctx_len = self.loc_off = self.out_start = 0
        self.g_state = self.g_len = self.g_pos = self.g_gen = 0
        self.pred_base = -1
        self.pred = [[], []]          # per source: (tokens, cells)
        self.pred_cells = [[], []]
        self.streak = False
        self.last_draft = []
        self.n_last_acc = -1


class ReferenceSuffix:
    """Same constructor arguments and begin/draft/accept as ngramspec._suffix.SuffixProposer."""

    def __init__(self, n_slots=1, max_draft=256, min_prob=0.005, gain_cost=0.02,
                 draft_cost=0.0078125, max_context=65536, global_tokens=1048576,
                 global_prompt=8, *, _count_depth=COUNT_DEPTH):
        self.max_draft = max_draft
        # the kernel converts with (x * ONE + 0.5) truncated
        self.min_p = int(min_prob * ONE + 0.5)
        self.gain_cost = int(gain_cost * ONE + 0.5)
        self.draft_cost = int(draft_cost * ONE + 0.5)
        self.max_context = max_context
        self.global_prompt = global_prompt
        self.store = Store(global_tokens, _count_depth)
        self.slots = [Slot(_count_depth) for _ in range(n_slots)]
        # the calibration and the tokens-per-step average are the server's: one for all slots
        # (one thread: every outcome reaches it by the call that observed it, as in the kernel)
        self.acc = [0] * N_CAL
        self.tried = [0] * N_CAL
        self.rate = ONE

    # -- begin ------------------------------------------------------------------------------

    def begin(self, slot, prompt):
        s = self.slots[slot]
        prompt = [int(t) for t in prompt]
        if s.active:
            self._finish(s)
        n = len(prompt)
        off = n - self.max_context // 2 if n > self.max_context else 0
        s.restart()
        for c in prompt[off:]:
            s.loc.extend(c)
        s.loc_off = off
        s.ctx_len = s.out_start = n
        s.active = True

    def _finish(self, s):
        s.active = False
        if self.store.budget < 2:
            return
        a = max(s.out_start - s.loc_off, 0)
        n_pr = min(self.global_prompt, a)
        output = s.loc.text[a:] + s.last_draft[:max(s.n_last_acc, 0)]
        if output:
            self.store.insert(s.loc.text[a - n_pr:a] + output)

    # -- draft ------------------------------------------------------------------------------

    def draft(self, slot, context, sampled):
        s = self.slots[slot]
        ctx = [int(t) for t in context] + [int(sampled)]
        n = len(ctx) - 1
        if not s.active or not self._follows(s, ctx, n):
            if s.active:
                self._finish(s)
            s.restart()
            s.active = True
            s.out_start = n
        self._learn(s, ctx)
        self._sync(s, ctx)
        return self._walk(s, ctx)

    @staticmethod
    def _follows(s, ctx, n):
        if n < s.ctx_len:
            return False
        for i in range(max(s.ctx_len - 8, s.loc_off), s.ctx_len):
            if ctx[i] != s.loc.text[i - s.loc_off]:
                return False
        return True

    def _learn(self, s, ctx):
        if s.pred_base < 0:
            return
        avail = len(ctx) - s.pred_base
        self.rate += ((min(avail, self.max_draft + 1) << 16) - self.rate) >> RATE_SHIFT
        s.streak = False
        for src in range(N_SRC):
            hit = False
            toks, cells = s.pred[src], s.pred_cells[src]
            for i in range(min(len(toks), avail)):
                hit = toks[i] == ctx[s.pred_base + i]
                cal_observe(self.acc, self.tried, cells[i], hit)
                if not hit:
                    break
            if hit and len(toks) >= avail:
                s.streak = True
        s.pred_base = -1

    def _sync(self, s, ctx):
        L = len(ctx)
        if L - s.loc_off > self.max_context:
            start = L - self.max_context // 2
            s.loc.clear()
            s.loc_off = start
            for c in ctx[start:]:
                s.loc.extend(c)
        else:
            for c in ctx[s.ctx_len:]:
                s.loc.extend(c)
        s.ctx_len = L

    def _walk(self, s, ctx):
        S = s.loc
        v = S.link[S.last]
        wl = Walker(S, 0, True, v, S.length[v] if v > 0 else 0)
        G = self.store
        if G.budget >= 2:
            L = len(ctx)
            if s.g_gen != G.gen or L - s.g_pos > MAX_GLOBAL_MATCH:
                s.g_state, s.g_len = 0, 0
                s.g_pos = max(L - MAX_GLOBAL_MATCH, 0)
                s.g_gen = G.gen
            for c in ctx[s.g_pos:]:
                s.g_state, s.g_len = G.sam.step(s.g_state, s.g_len, c)
            s.g_pos = L
            wg = Walker(G.sam, 1, False, s.g_state, s.g_len)
        else:
            wg = Walker(S, 1, False, 0, 0)
        gain = min(max(self.rate - ONE, 0), GAIN_CAP * ONE)
        base = max((self.gain_cost * gain) >> 16, self.min_p)
        draft_walk(wl, wg, self.acc, self.tried, s.streak, self.max_draft, base, self.draft_cost)
        s.pred = [wl.tok, wg.tok]
        s.pred_cells = [wl.cell, wg.cell]
        s.pred_base = len(ctx)
        best = wg if wg.score > wl.score else wl
        s.last_src = best.src
        s.last_draft = best.tok[:best.n_draft]
        s.n_last_acc = -1
        return list(s.last_draft)

    # -- the draft tree ---------------------------------------------------------------------

    def draft_tree(self, slot, n_chain, budget):
        """The kernel's draft_tree, one candidate list per call: per source (the slot's
        automaton, the store when the draft call read it), best first from the root:
        repeatedly the (node, child) not in the tree with the likeliest path (ties: the node
        added first, then the child ranked first); the draft's chain (its first n_chain tokens)
        is the reference path of the draft's source. The two trees are merged by path
        probability (the draft's source first on ties), a path both hold kept once."""
        s = self.slots[slot]
        if not s.active or s.pred_base < 0:
            raise ValueError("no draft")
        n_chain = min(n_chain, budget)
        S = s.loc
        v = S.link[S.last]
        trees = [self._tree(s, 0, S, v, S.length[v] if v > 0 else 0,
                            n_chain if s.last_src == 0 else 0, budget)]
        G = self.store
        if G.budget >= 2 and s.g_gen == G.gen and s.g_pos == s.ctx_len:
            src1 = (G.sam, s.g_state, s.g_len)
        else:
            src1 = (None, -1, 0)
        trees.append(self._tree(s, 1, *src1, n_chain if s.last_src == 1 else 0, budget))
        first, second = trees[s.last_src], trees[1 - s.last_src]
        # (path probability, tree rank, order in its tree, node): a stable best-first merge
        order = sorted([(-w[5], 0, i, w) for i, w in enumerate(first[1:], 1)]
                       + [(-w[5], 1, i, w) for i, w in enumerate(second[1:], 1)],
                       key=lambda x: x[:3])
        path_of = [{0: ()}, {0: ()}]           # per tree: node index -> its token path
        where, tokens, parents = {(): -1}, [], []
        for _, rank, i, w in order:
            path = path_of[rank][w[1]] + (w[0],)
            path_of[rank][i] = path
            if path not in where and len(tokens) < budget:
                where[path] = len(tokens)
                tokens.append(w[0])
                parents.append(where[path[:-1]])
        return tokens, parents

    def _tree(self, s, src, S, v0, l0, n_chain, budget):
        """One source's best-first tree: its nodes, the root first."""
        chain, cells = s.pred[src], s.pred_cells[src]
        if S is None or v0 < 0 or (v0 == 0 and src != 0) or (v0 > 0 and l0 <= 0):
            v0 = -1
        self._root_top = min(budget, ROOT_TOP)
        # a node: [token, parent, state, length, depth, path probability, chain position]
        nodes = [[None, -1, v0, l0, 0, ONE, 0]]
        while len(nodes) - 1 < budget:
            best = None
            for u, (_, _, v, l, depth, P, cj) in enumerate(nodes):
                for c, p, t in self._children(s, src, S, v, l, depth, cj, chain, cells,
                                              n_chain):
                    if any(w[1] == u and w[0] == c for w in nodes):
                        continue                 # in the tree already
                    cand = (P * p) >> 16
                    if best is None or cand > best[0]:
                        on_chain = 0 <= cj < n_chain and c == chain[cj]
                        best = (cand, u, c, t, cj + 1 if on_chain else -1)
                    break                        # a node offers its best child not taken
            if best is None:
                break
            cand, u, c, t, cj = best
            nodes.append([c, u, t, nodes[u][3] + 1, nodes[u][4] + 1, cand, cj])
        return nodes

    def _children(self, s, src, S, v, l, depth, cj, chain, cells, n_chain):
        """A node's children, best first: (token, probability given the node, state)."""
        if v == 0:              # the local root without a match: the empty context's best
            kids = sorted(((S.cnt[t], S.pos[t], c, t) for c, t in S.next[0].items() if c >= 0),
                          reverse=True)
            if not kids:
                return
            n, a_ref = sum(k[0] for k in kids), kids[0][0]
            p_ref = cal_prob(self.acc, self.tried, cell_index(src, 0, freq_bucket(a_ref, n),
                                                              stage_of(0, s.streak), False))
            yield kids[0][2], p_ref, kids[0][3]
            for a, _, c, t in kids[1:self._root_top] if n > a_ref else ():
                p = ((ONE - p_ref) * a) // (n - a_ref)
                yield c, min(p, (p_ref * a) // a_ref) if a_ref else p, t
            return
        if 0 <= cj < n_chain:
            ref, p_ref = chain[cj], cal_prob(self.acc, self.tried, cells[cj])
        elif v >= 0 and S.next[v]:
            top = S.top_child(v)
            if top[0] == SEP:
                return
            ref = top[0]
            p_ref = cal_prob(self.acc, self.tried, cell_index(src, l, freq_bucket(top[2], top[3]),
                                                              stage_of(depth, s.streak), False))
        else:
            return
        yield ref, p_ref, S.next[v].get(ref, -1) if v >= 0 else -1
        if v < 0:
            return
        kids = sorted(((S.cnt[t], S.pos[t], c, t) for c, t in S.next[v].items()), reverse=True)
        n = sum(k[0] for k in kids)
        a_ref = S.cnt[S.next[v][ref]] if ref in S.next[v] else 0
        for a, _, c, t in kids:
            if c == ref or c < 0:
                continue
            p = ((ONE - p_ref) * a) // (n - a_ref)
            if a_ref:
                p = min(p, (p_ref * a) // a_ref)
            yield c, p, t

    def end(self, slot):
        s = self.slots[slot]
        if s.active:
            self._finish(s)

    def accept(self, slot, n_accepted):
        s = self.slots[slot]
        s.n_last_acc = min(n_accepted, len(s.last_draft))

