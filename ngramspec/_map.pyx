# cython: language_level=3
"""ngram-map-k / ngram-map-k4v (common_ngram_map_begin / _draft / _accept), quirks included."""
from libc.stdint cimport INT32_MAX, int16_t, int32_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memmove, memset

from ngramspec._hash cimport extend_hash, map_hash, map_step, mod_hash, mod_pow, mod_step
from ngramspec._hashtable cimport (HashTable, ht_bytes, ht_clear, ht_fill, ht_find_value, ht_free,
                                   ht_key, ht_reserve, ht_slot)
from ngramspec._posindex cimport (PosIndex, pos_bytes, pos_extend, pos_free, pos_indexed,
                                  pos_invalidate, pos_newest)
from ngramspec._proposer cimport Proposer, alloc_per_slot, calloc, malloc, realloc
from ngramspec._types cimport NOGIL_MIN_TOKENS, token_t

from ngramspec._proposer import check_int

DEF MAP_INDEX_SIZE = 262144                          # 2**18 uint32 slots per ngram-map slot
DEF MAP_INDEX_MASK = 262143
DEF MAP_MAX_VALUES = 4
DEF MAP_MAX_COUNT = 16380

# --------------------------------------------------------------------------------------------
# ngram-map-k / ngram-map-k4v (common_ngram_map_begin / _draft / _accept)
# --------------------------------------------------------------------------------------------

# k4v's statistics scan visits every earlier position from the key's stat_idx to the match:
# O(L) for each newly matched key, llama.cpp's cost at long contexts. Scans of at least
# STAT_INDEX_MIN positions go through a per-slot ScanIndex instead: a position index
# (_posindex.pxd: the positions of each n-gram by its hash, newest first), so a scan visits only
# the key's occurrences (checked against the text), in the same ascending order. The index is
# built lazily: a scan indexes at most as many new positions as it covers and scans the rest
# linearly, so no call costs more than about twice the plain scan.
# Once built, it also serves the shorter scans (16 positions or more) over indexed positions.
# begin() on a prompt of STAT_INDEX_MIN tokens or more indexes the prompt (without the GIL).
# STAT_INDEX_MIN is MapProposer's default `stat_index_min` (tests lower it).
DEF STAT_INDEX_MIN = 2048

cdef struct ScanIndex:
    PosIndex pos               # the positions of each n-gram (by its hash), newest first
    int32_t* hits              # scratch: one scan's occurrences, newest first
    Py_ssize_t hits_cap


cdef void scan_free(ScanIndex* x) noexcept nogil:
    pos_free(&x.pos)
    free(x.hits)


cdef struct MapValue:
    size_t value_idx           # start of this m-gram in inp; 0 = unused
    uint16_t value_num         # occurrences, saturating at 16380
    int16_t n_accepted         # accepted tokens the last time this value drafted


cdef struct MapKey:
    size_t key_idx             # position of the occurrence that created the key
    size_t stat_idx            # k4v statistics scanned up to here (inclusive)
    uint16_t key_num           # draft calls in which this key matched
    MapValue values[MAP_MAX_VALUES]


cdef struct MapParams:
    Py_ssize_t n
    Py_ssize_t m
    bint key_only
    Py_ssize_t min_hits
    bint reindex
    uint64_t a_pow             # A^(n-1) mod 2^64, to slide the ScanIndex's hash
    Py_ssize_t stat_index_min  # k4v scans this long or longer use the ScanIndex


cdef struct MapState:
    MapKey* keys               # append-only list, erased from only by begin's cleanup
    size_t n_keys
    size_t cap_keys
    size_t size_last_begin     # S
    bint last_draft_created
    size_t last_draft_key_idx
    uint16_t last_draft_value_idx
    size_t idx_last_check
    uint32_t* key_map          # MAP_INDEX_SIZE positions; 0 = empty
    uint32_t key_map_last_idx  # K
    # Lookup of key records by text, replacing llama.cpp's linear search (same result): the
    # smallest key index per table key (ht_key) of the key's text. Rebuilt after begin(), since a new
    # prompt changes the text found at each key_idx.
    HashTable keytab           # key text hash -> smallest index into keys
    bint kt_stale              # rebuild before the next lookup
    bint kt_linear             # some key's text lies past the context: search linearly
    # reindex option: fingerprint of the context seen so far, to tell an extension from a new
    # prompt at begin()
    uint64_t seen_hash
    size_t seen_len
    ScanIndex scan             # k4v's statistics scan (see stat_scan)


cdef inline bint map_key_at(const token_t* inp, Py_ssize_t L, Py_ssize_t j, Py_ssize_t n,
                            token_t sampled) noexcept nogil:
    """inp[j : j+n] == inp[L-n+1 : L] + [sampled]; False where the window leaves inp."""
    if j < 0 or j + n > L:
        return False
    return inp[j + n - 1] == sampled and memcmp(inp + j, inp + L - n + 1,
                                                (n - 1) * sizeof(token_t)) == 0


cdef inline void map_index(MapState* s, const token_t* inp, Py_ssize_t j, Py_ssize_t n) noexcept nogil:
    cdef uint32_t h = map_hash(inp + j, n) & MAP_INDEX_MASK
    if s.key_map[h] == 0:                    # first writer wins
        s.key_map[h] = <uint32_t>j


cdef inline void map_erase_key(MapState* s, size_t i) noexcept nogil:
    memmove(s.keys + i, s.keys + i + 1, (s.n_keys - i - 1) * sizeof(MapKey))
    s.n_keys -= 1


cdef int keytab_insert(MapState* s, uint64_t h, size_t idx) noexcept nogil:
    """Add (h -> idx) unless h is present (the smallest index stays). -1: out of memory (or an
    index past int32, which 2**31 key records of 112 bytes each would need)."""
    cdef Py_ssize_t k
    cdef uint32_t key = ht_key(h)
    if idx > <size_t>INT32_MAX or ht_reserve(&s.keytab, 256) < 0:
        return -1
    k = ht_slot(&s.keytab, key)
    if s.keytab.e[k].value < 0:
        ht_fill(&s.keytab, k, key, <int32_t>idx)
    return 0


cdef int keytab_rebuild(MapState* s, const token_t* inp, Py_ssize_t L, Py_ssize_t n) noexcept nogil:
    cdef size_t i
    ht_clear(&s.keytab)
    s.kt_linear = False
    s.kt_stale = False
    for i in range(s.n_keys):
        if <Py_ssize_t>s.keys[i].key_idx + n > L:
            s.kt_linear = True               # its text is not there yet: rare, stay exact
            return 0
        if keytab_insert(s, mod_hash(inp + s.keys[i].key_idx, n), i) < 0:
            s.kt_stale = True                # incomplete: rebuild at the next lookup
            return -1
    return 0


cdef void map_clear(MapState* s) noexcept nogil:
    """Back to a new map (what a fresh speculative context has), keeping the allocations."""
    memset(s.key_map, 0, MAP_INDEX_SIZE * sizeof(uint32_t))
    s.n_keys = 0
    s.key_map_last_idx = 0
    s.size_last_begin = 0
    s.idx_last_check = 0
    s.last_draft_created = False
    s.kt_stale = True


cdef void map_track(MapState* s, const token_t* inp, size_t L) noexcept nogil:
    """Fold the context's new tokens into the fingerprint (append-only between begins)."""
    if L > s.seen_len:
        s.seen_hash = extend_hash(s.seen_hash, inp + s.seen_len, L - s.seen_len)
        s.seen_len = L


cdef void map_begin_reindex(MapState* s, const token_t* prompt, size_t size_begin) noexcept nogil:
    """The reindex option: a prompt that does not extend the context seen so far starts the
    slot's map afresh, instead of keeping stale entries and skipping positions <= K."""
    if s.seen_len > 0 and (size_begin < s.seen_len or
                           extend_hash(0, prompt, s.seen_len) != s.seen_hash):
        map_clear(s)
    s.seen_hash = extend_hash(0, prompt, size_begin)
    s.seen_len = size_begin


cdef void map_begin(MapState* s, const MapParams* p, size_t size_begin) noexcept nogil:
    cdef size_t n = p.n, m = p.m
    cdef size_t cleanup = s.size_last_begin
    cdef Py_ssize_t i, j, k
    cdef MapKey* key
    if cleanup > size_begin:                 # the prompt shrank below the previous prompt
        cleanup = size_begin - n - m if size_begin > n + m else 0
    if size_begin < s.idx_last_check:        # history rewritten: drop what lies past cleanup
        for k in range(MAP_INDEX_SIZE):
            if s.key_map[k] != 0 and s.key_map[k] >= cleanup:
                s.key_map[k] = 0
        s.key_map_last_idx = <uint32_t>(cleanup - 1) if cleanup > 0 else 0
        i = <Py_ssize_t>s.n_keys - 1
        while i >= 0:
            key = &s.keys[i]
            if key.key_idx >= cleanup:
                map_erase_key(s, i)
                i -= 1
                continue
            if not p.key_only:
                for j in range(MAP_MAX_VALUES - 1, -1, -1):
                    if key.values[j].value_idx != 0 and key.values[j].value_idx >= cleanup:
                        for k in range(j, MAP_MAX_VALUES - 1):
                            key.values[k] = key.values[k + 1]
                        # n_accepted of the last record is kept, as in llama.cpp
                        key.values[MAP_MAX_VALUES - 1].value_idx = 0
                        key.values[MAP_MAX_VALUES - 1].value_num = 0
                if key.values[0].value_idx == 0:
                    map_erase_key(s, i)
            i -= 1
    s.idx_last_check = size_begin
    s.size_last_begin = size_begin
    s.last_draft_created = False
    s.kt_stale = True


cdef inline void stat_count(MapKey* ck, const token_t* inp, Py_ssize_t L, size_t i,
                            Py_ssize_t n, Py_ssize_t m) noexcept nogil:
    """Count the m-gram after the key's occurrence at i in the key's value records."""
    cdef int v, iv = -1
    for v in range(MAP_MAX_VALUES):
        if ck.values[v].value_idx == 0:
            ck.values[v].value_idx = i + n
            ck.values[v].value_num = 0
            ck.values[v].n_accepted = <int16_t>m
            iv = v
            break
        if (ck.values[v].value_idx + m <= <size_t>L and
                memcmp(inp + i + n, inp + ck.values[v].value_idx, m * sizeof(token_t)) == 0):
            iv = v
            break
    if iv >= 0 and ck.values[iv].value_num < MAP_MAX_COUNT:
        ck.values[iv].value_num += 1


cdef int stat_scan(MapKey* ck, ScanIndex* x, const MapParams* p, const token_t* inp,
                   Py_ssize_t L, Py_ssize_t match, token_t sampled) noexcept nogil:
    """k4v's statistics over the key's occurrences at stat_idx .. match (inclusive: the
    previous match is counted again), in ascending order. -1: out of memory."""
    cdef Py_ssize_t n = p.n, lo = <Py_ssize_t>ck.stat_idx, hi = match, i, j, top, cnt = 0
    cdef Py_ssize_t span = hi - lo + 1, indexed
    cdef void* grown
    indexed = pos_indexed(&x.pos)
    # long scans build the index; once built, shorter scans over indexed positions use it too
    if span >= p.stat_index_min or (lo < indexed and span >= 16):
        if indexed <= hi and pos_extend(&x.pos, inp, min(hi, indexed - 1 + span), n,
                                        p.a_pow) < 0:
            return -1
        if lo < x.pos.next:
            top = min(hi, x.pos.next - 1)
            j = pos_newest(&x.pos, mod_hash(inp + match, n))
            while j >= lo:                   # newest first; kept to be counted oldest first
                if j <= top and map_key_at(inp, L, j, n, sampled):
                    if cnt == x.hits_cap:
                        grown = realloc(x.hits, (x.hits_cap * 2 + 64) * sizeof(int32_t))
                        if grown == NULL:
                            return -1
                        x.hits = <int32_t*>grown
                        x.hits_cap = x.hits_cap * 2 + 64
                    x.hits[cnt] = <int32_t>j
                    cnt += 1
                j = x.pos.prev[j]
            for i in range(cnt - 1, -1, -1):
                stat_count(ck, inp, L, x.hits[i], n, p.m)
            lo = top + 1
    for i in range(lo, hi + 1):
        if map_key_at(inp, L, i, n, sampled):
            stat_count(ck, inp, L, i, n, p.m)
    return 0


cdef Py_ssize_t map_lookup(MapState* s, const MapParams* p, const token_t* inp, Py_ssize_t L,
                           token_t sampled) noexcept nogil:
    """The earlier position of the key (the last n - 1 tokens and `sampled`), 0 when none, and the
    position index brought up to date over the same ranges (llama.cpp's search order)."""
    cdef Py_ssize_t n = p.n, m = p.m
    cdef Py_ssize_t S, K, j, top, match = 0, last_pos
    cdef uint32_t idx
    s.idx_last_check = L
    S = <Py_ssize_t>s.size_last_begin
    K = <Py_ssize_t>s.key_map_last_idx
    last_pos = L - n - m - 1                 # the last candidate whose m-gram lies inside inp

    # (a) lookup: hash index, then the positions not yet indexed (range A, then range B).
    # Range A is clamped to last_pos so a context shorter than the prompt stays in bounds.
    idx = s.key_map[(map_step(map_hash(inp + L - n + 1, n - 1), sampled))
                    & MAP_INDEX_MASK]
    if idx != 0 and idx < last_pos and map_key_at(inp, L, idx, n, sampled):
        match = idx
    top = S - n - m - 1 if S - n - m - 1 < last_pos else last_pos
    if match == 0 and S > n + m + 1:
        j = top
        while j > K:
            if map_key_at(inp, L, j, n, sampled):
                match = j
                break
            j -= 1
    if match == 0:
        j = last_pos
        while j > S and j > K:
            if map_key_at(inp, L, j, n, sampled):
                match = j
                break
            j -= 1

    # (b) index maintenance over the same ranges, descending, first writer wins
    if S > n + m + 1:
        j = top
        while j > K:
            map_index(s, inp, j, n)
            j -= 1
    j = last_pos
    while j > S and j > K:
        map_index(s, inp, j, n)
        j -= 1
    if <uint32_t>last_pos > s.key_map_last_idx:
        s.key_map_last_idx = <uint32_t>last_pos
    return match


cdef Py_ssize_t map_key_record(MapState* s, const MapParams* p, const token_t* inp, Py_ssize_t L,
                               token_t sampled, Py_ssize_t match) noexcept nogil:
    """(c) The index in `s.keys` of the key's statistics record (the first key whose text, read at
    its key_idx, equals the key), appended when there is none; -1 when out of memory."""
    cdef Py_ssize_t n = p.n, m = p.m
    cdef Py_ssize_t found
    cdef size_t off, v
    cdef MapKey* ck
    cdef MapKey* grown
    cdef uint64_t key_hash
    if s.kt_stale:
        if keytab_rebuild(s, inp, L, n) < 0:
            return -1
    key_hash = mod_step(mod_hash(inp + L - n + 1, n - 1), sampled)
    found = -1 if s.kt_linear else ht_find_value(&s.keytab, key_hash)
    if found >= 0 and map_key_at(inp, L, <Py_ssize_t>s.keys[found].key_idx, n, sampled):
        return found
    if found < 0 and not s.kt_linear:
        off = s.n_keys                       # no key has this text
    else:                                    # a shared table key, or kt_linear: llama.cpp's search
        off = 0
        while off < s.n_keys:
            if map_key_at(inp, L, <Py_ssize_t>s.keys[off].key_idx, n, sampled):
                return <Py_ssize_t>off
            off += 1
    if s.n_keys == s.cap_keys:
        grown = <MapKey*>realloc(s.keys, (s.cap_keys * 2 + 16) * sizeof(MapKey))
        if grown == NULL:
            return -1
        s.keys = grown
        s.cap_keys = s.cap_keys * 2 + 16
    ck = &s.keys[s.n_keys]
    s.n_keys += 1
    ck.key_idx = match
    ck.stat_idx = 0
    ck.key_num = 0
    for v in range(MAP_MAX_VALUES):
        ck.values[v].value_idx = 0
        ck.values[v].value_num = 0
        ck.values[v].n_accepted = <int16_t>m
    if not s.kt_linear and keytab_insert(s, key_hash, off) < 0:
        s.kt_stale = True                    # the new key is not in the table: rebuild
        return -1
    return <Py_ssize_t>off


cdef int map_value_choice(MapKey* ck, ScanIndex* x, const MapParams* p, const token_t* inp,
                          Py_ssize_t L, Py_ssize_t match, token_t sampled) noexcept nogil:
    """(d2) ngram-map-k4v: the most frequent value seen after the key, -1 when none dominates
    (no draft), -2 when out of memory."""
    cdef int slot_max = 0
    cdef size_t v
    cdef uint16_t max_occur = 0
    cdef uint32_t sum_occur = 0
    if ck.key_num < p.min_hits:
        return -1
    if stat_scan(ck, x, p, inp, L, match, sampled) < 0:
        return -2
    ck.stat_idx = match
    for v in range(MAP_MAX_VALUES):
        if ck.values[v].value_num > max_occur:
            max_occur = ck.values[v].value_num
            slot_max = v
    for v in range(MAP_MAX_VALUES):
        if v != <size_t>slot_max:
            sum_occur += ck.values[v].value_num
    if sum_occur > 0 and max_occur < 2 * sum_occur:
        return -1
    return slot_max


cdef Py_ssize_t map_draft(MapState* s, const MapParams* p, const token_t* inp, Py_ssize_t L,
                          token_t sampled, token_t* out) noexcept nogil:
    """Returns the draft length, or -1 when the key list could not grow (out of memory)."""
    cdef Py_ssize_t n = p.n, m = p.m, match, off, cnt
    cdef int slot_max = 0
    cdef MapKey* ck
    s.last_draft_created = False
    s.last_draft_key_idx = 0
    s.last_draft_value_idx = 0
    if L < 2 * n + m:                        # nothing else is updated in this case
        return 0
    match = map_lookup(s, p, inp, L, sampled)
    if match == 0:
        return 0
    off = map_key_record(s, p, inp, L, sampled, match)
    if off < 0:
        return -1
    ck = &s.keys[off]
    if ck.key_num < MAP_MAX_COUNT:
        ck.key_num += 1
    if not p.key_only:
        slot_max = map_value_choice(ck, &s.scan, p, inp, L, match, sampled)
        if slot_max == -2:
            return -1
        if slot_max < 0:
            return 0
    # (d1/d2) the draft is always the m tokens after `match`; the value only sets its length
    cnt = ck.values[slot_max].n_accepted
    if cnt > m:
        cnt = m
    s.last_draft_created = True
    s.last_draft_key_idx = off
    s.last_draft_value_idx = <uint16_t>slot_max
    if cnt <= 0:
        return 0
    memcpy(out, inp + match + n, cnt * sizeof(token_t))
    return cnt


cdef void map_accept(MapState* s, uint16_t n_accepted) noexcept nogil:
    if not s.last_draft_created or s.last_draft_key_idx >= s.n_keys:
        return
    s.keys[s.last_draft_key_idx].values[s.last_draft_value_idx].n_accepted = <int16_t>n_accepted


cdef class MapProposer(Proposer):
    """ngram-map-k (``key_only=True``) and ngram-map-k4v (``key_only=False``): common_ngram_map.

    Parameters
    ----------
    size_n : int, 1 .. 1024 (default 12) -- key length
    size_m : int, 1 .. 1024 (default 48) -- value (draft) length
    min_hits : int, >= 1 (default 1) -- k4v only; ngram-map-k ignores it, as llama.cpp does
    key_only : bool
    n_slots : int, >= 1
    reindex : bool (default False; not llama.cpp's behaviour)
        On begin(), a prompt that does not extend the slot's previous context resets the slot's
        map, so the new prompt is indexed from position 1. llama.cpp keeps the stale entries
        and never scans positions <= K of the new prompt (its "server-state collapse").
    stat_index_min : int, >= 1 (default 2048)
        ngram-map-k4v's statistics scans over at least this many positions go through the
        per-slot ScanIndex (same drafts; a speed knob, lowered by tests).

    Notes
    -----
    Memory: per slot a 2**18-entry uint32 hash index (1 MiB, zero pages until touched) plus,
    per distinct matched key (unbounded, as in llama.cpp), a 112-byte record and 16 to 32
    bytes of lookup table. ngram-map-k4v adds, once a statistics scan covers
    ``stat_index_min`` positions, a position index: 4 bytes per context token plus a table of
    16 to 32 bytes per distinct n-gram.

    Thread-safety: each slot's map is independent: one thread per slot at a time (a second
    call on a busy slot raises RuntimeError). A draft that indexes more than
    ``NOGIL_MIN_TOKENS`` (4096) new positions releases the GIL, and so does begin().
    """
    cdef MapParams params
    cdef MapState* states

    def __cinit__(self):
        self.states = NULL

    def __init__(self, size_n=12, size_m=48, min_hits=1, key_only=True, n_slots=1,
                 reindex=False, stat_index_min=STAT_INDEX_MIN):
        cdef Py_ssize_t i
        cdef MapParams params
        params.reindex = bool(reindex)
        params.n = check_int("size_n", size_n, 1, 1024)
        params.m = check_int("size_m", size_m, 1, 1024)
        params.min_hits = check_int("min_hits", min_hits, 1)
        params.key_only = bool(key_only)
        params.stat_index_min = check_int("stat_index_min", stat_index_min, 1)
        params.a_pow = mod_pow(params.n - 1)
        # first: it refuses a re-run, which would change the parameters under the slots' state
        Proposer.__init__(self, "ngram-map-k" if key_only else "ngram-map-k4v", n_slots,
                          params.m)
        self.params = params
        try:
            self.states = <MapState*>alloc_per_slot(n_slots, sizeof(MapState),
                                                    f"{self.name}'s per-slot state")
            for i in range(n_slots):
                self.states[i].key_map = <uint32_t*>calloc(MAP_INDEX_SIZE, sizeof(uint32_t))
                if self.states[i].key_map == NULL:
                    raise MemoryError(f"n_slots = {n_slots}: out of memory for {self.name}'s "
                                      f"hash index of slot {i} (1 MiB each)")
        except MemoryError:
            self.free_states()
            self.forget_slots()
            raise

    def __dealloc__(self):
        self.free_states()

    cdef void free_states(self) noexcept:
        cdef Py_ssize_t i
        if self.states != NULL:
            for i in range(self.n_slots):
                free(self.states[i].keys)
                free(self.states[i].key_map)
                ht_free(&self.states[i].keytab)
                scan_free(&self.states[i].scan)
            free(self.states)
            self.states = NULL

    @property
    def size_n(self):
        return self.params.n

    @property
    def size_m(self):
        return self.params.m

    @property
    def min_hits(self):
        return self.params.min_hits

    @property
    def reindex(self):
        return self.params.reindex

    def n_keys(self, Py_ssize_t slot):
        """Number of key records of `slot` (grows by one per distinct matched key)."""
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot = {slot} is out of range: allowed 0 .. {self.n_slots - 1}")
        return self.states[slot].n_keys

    def memory_bytes(self):
        cdef Py_ssize_t i
        cdef size_t total = 0
        for i in range(self.n_slots):
            total += (MAP_INDEX_SIZE * sizeof(uint32_t) + self.states[i].cap_keys * sizeof(MapKey)
                      + ht_bytes(&self.states[i].keytab) + pos_bytes(&self.states[i].scan.pos)
                      + self.states[i].scan.hits_cap * sizeof(int32_t))
        return total

    cdef int c_begin(self, Py_ssize_t slot, const token_t* prompt, Py_ssize_t n) except -1:
        cdef int r = 0
        with nogil:
            if self.params.reindex:
                map_begin_reindex(&self.states[slot], prompt, n)
            map_begin(&self.states[slot], &self.params, n)
            pos_invalidate(&self.states[slot].scan.pos)   # the new prompt is not indexed
            # k4v on a long prompt: index it now (GIL released) rather than in a draft call
            if not self.params.key_only and n >= self.params.stat_index_min:
                r = pos_extend(&self.states[slot].scan.pos, prompt, n - self.params.n,
                               self.params.n, self.params.a_pow)
        if r < 0:
            raise MemoryError(f"out of memory while indexing {self.name}'s prompt")
        return 0

    cdef Py_ssize_t c_draft(self, Py_ssize_t slot, const token_t* inp, Py_ssize_t n,
                            token_t sampled, token_t* out) except -1:
        cdef Py_ssize_t r
        cdef MapState* s = &self.states[slot]
        if self.params.reindex:
            map_track(s, inp, n)
        if pos_indexed(&s.scan.pos) - 1 + self.params.n > n:
            pos_invalidate(&s.scan.pos)      # the context shrank without begin()
        if n - <Py_ssize_t>s.key_map_last_idx > NOGIL_MIN_TOKENS:
            with nogil:
                r = map_draft(s, &self.params, inp, n, sampled, out)
        else:
            r = map_draft(s, &self.params, inp, n, sampled, out)
        if r < 0:
            raise MemoryError(f"out of memory while updating {self.name}'s map")
        return r

    cdef int c_accept(self, Py_ssize_t slot, Py_ssize_t n_accepted, bint is_other) except -1:
        if not is_other:
            map_accept(&self.states[slot], <uint16_t>n_accepted)
        return 0

