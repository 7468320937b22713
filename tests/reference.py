"""Pure-Python reference of llama.cpp's draftless n-gram proposers.

Written only from ``shared/spec/llamacpp-ngram.md`` (sections 1, 3, 4, 5, 7) as an executable
restatement of it: slow, but each function mirrors the spec's pseudocode line by line, quirks
included, so the Cython kernels can be checked against it (golden files + hypothesis).

Tokens are plain Python ints; integer widths are emulated with explicit masks where the spec
says wraparound matters.
"""
from __future__ import annotations

import numpy as np

from ngramspec.loop import run_recorded

MASK16 = 0xFFFF
MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF

MAX_VALUE_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT: uint16 counters saturate here
MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAP_HASH_SIZE = 1 << 18  # COMMON_NGRAM_HASH_MAP_SIZE
MAP_MUL = 2654435761
MOD_POOL_SIZE = 1 << 22
MOD_MUL = 6364136223846793005
EMPTY = -1

# llama.cpp instantiates the types in this order, whatever order --spec-type lists them (spec 1.1).
PRIORITY = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")

DEFAULTS = {
    "ngram_simple_size_n": 12,
    "ngram_simple_size_m": 48,
    "ngram_map_k_size_n": 12,
    "ngram_map_k_size_m": 48,
    "ngram_map_k_min_hits": 1,
    "ngram_map_k4v_size_n": 12,
    "ngram_map_k4v_size_m": 48,
    "ngram_map_k4v_min_hits": 1,
    "ngram_mod_n_match": 24,
    "ngram_mod_n_min": 48,
    "ngram_mod_n_max": 64,
}


def _int16(x: int) -> int:
    x &= MASK16
    return x - 0x10000 if x >= 0x8000 else x


# --------------------------------------------------------------------------------------------
# ngram-simple (spec 3)
# --------------------------------------------------------------------------------------------


class RefSimple:
    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.n = size_n
        self.m = size_m

    def begin(self, prompt) -> None:  # stateless
        pass

    def accept(self, n_accepted: int) -> None:
        pass

    def draft(self, inp: list, sampled: int) -> list:
        n, m = self.n, self.m
        L = len(inp)
        if L <= n + m + 1:  # <=, not <
            return []
        pattern = inp[L - n + 1 : L] + [sampled]
        first = pattern[0]
        match = 0
        for j in range(L - n - 1, 0, -1):  # position 0 is never tested
            # first-token test is only a speed-up of the slice comparison
            if inp[j] == first and inp[j : j + n] == pattern:
                match = j
                break
        if match == 0:
            return []
        copy_max = min(m, L - (match + n))
        if copy_max < n:  # minimum draft length is n, not 1
            return []
        return inp[match + n : match + n + copy_max]


# --------------------------------------------------------------------------------------------
# ngram-map-k / ngram-map-k4v (spec 4), one instance per slot
# --------------------------------------------------------------------------------------------


def map_hash(tokens, start: int, length: int) -> int:
    h = 0
    for i in range(length):
        h = (h * MAP_MUL + tokens[start + i]) & MASK32  # negative ids: same result mod 2^32
    return h


class _Value:
    __slots__ = ("value_idx", "value_num", "n_accepted")

    def __init__(self, value_idx: int, value_num: int, n_accepted: int):
        self.value_idx = value_idx
        self.value_num = value_num
        self.n_accepted = n_accepted

    def copy(self) -> "_Value":
        return _Value(self.value_idx, self.value_num, self.n_accepted)


class _Key:
    __slots__ = ("key_idx", "stat_idx", "key_num", "values")

    def __init__(self, key_idx: int, m: int):
        self.key_idx = key_idx
        self.stat_idx = 0
        self.key_num = 0
        self.values = [_Value(0, 0, m) for _ in range(MAX_VALUES)]


class RefMap:
    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1,
                 key_only: bool = True):
        self.n = size_n
        self.m = size_m
        self.min_hits = min_hits
        self.key_only = key_only
        self.keys: list[_Key] = []
        self.size_last_begin = 0  # S
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        self.idx_last_check = 0
        # 2^18 uint32 slots, 0 = empty; sparse: an absent slot is 0
        self.key_map: dict[int, int] = {}
        self.key_map_last_idx = 0  # K, uint32

    def _slot(self, tokens, start: int) -> int:
        return map_hash(tokens, start, self.n) & (MAP_HASH_SIZE - 1)

    def begin(self, tokens) -> None:
        n, m = self.n, self.m
        size_begin = len(tokens)
        cleanup = self.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < self.idx_last_check:
            self.key_map = {h: p for h, p in self.key_map.items() if not (p != 0 and p >= cleanup)}
            self.key_map_last_idx = ((cleanup - 1) & MASK32) if cleanup > 0 else 0
            for i in range(len(self.keys) - 1, -1, -1):
                key = self.keys[i]
                if key.key_idx >= cleanup:
                    del self.keys[i]
                    continue
                if self.key_only:
                    continue
                vals = key.values
                for j in range(MAX_VALUES - 1, -1, -1):
                    if vals[j].value_idx != 0 and vals[j].value_idx >= cleanup:
                        for t in range(j, MAX_VALUES - 1):  # whole-record shift left
                            vals[t] = vals[t + 1].copy()
                        # n_accepted of the last record is deliberately NOT reset (quirk)
                        vals[MAX_VALUES - 1].value_idx = 0
                        vals[MAX_VALUES - 1].value_num = 0
                if vals[0].value_idx == 0:
                    del self.keys[i]
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def draft(self, inp: list, sampled: int) -> list:
        n, m = self.n, self.m
        self.last_draft_created = False
        self.last_draft_key_idx = 0
        self.last_draft_value_idx = 0
        L = len(inp)
        if L < 2 * n + m:
            return []
        self.idx_last_check = L
        S = self.size_last_begin
        K = self.key_map_last_idx
        key = inp[L - n + 1 : L] + [sampled]

        # (a) lookup: index first (collision-checked), then the not-yet-indexed ranges A and B
        match = 0
        idx = self.key_map.get(map_hash(key, 0, n) & (MAP_HASH_SIZE - 1), 0)
        if idx != 0 and idx < L - n - m - 1 and inp[idx : idx + n] == key:
            match = idx
        range_a = range(S - n - m - 1, K, -1) if S > n + m + 1 else range(0)
        range_b = range(L - n - m - 1, max(S, K), -1)  # j > S and j > K
        if match == 0:
            for j in range_a:
                if inp[j : j + n] == key:
                    match = j
                    break
        if match == 0:
            for j in range_b:
                if inp[j : j + n] == key:
                    match = j
                    break

        # (b) index maintenance after the lookup: descending, first writer wins
        km = self.key_map
        for rng in (range_a, range_b):
            for j in rng:
                h = self._slot(inp, j)
                if km.get(h, 0) == 0:
                    km[h] = j
        self.key_map_last_idx = max((L - n - m - 1) & MASK32, K)
        if match == 0:
            return []

        # (c) key statistics record; linear search compares against the *current* inp
        off = len(self.keys)
        for i, k in enumerate(self.keys):
            if inp[k.key_idx : k.key_idx + n] == key:
                off = i
                break
        if off == len(self.keys):
            self.keys.append(_Key(match, m))
        ck = self.keys[off]
        ck.key_num = min(ck.key_num + 1, MAX_VALUE_COUNT)

        # (d1) ngram-map-k: min_hits is not checked
        if self.key_only:
            cnt = min(m, ck.values[0].n_accepted)
            self.last_draft_created = True
            self.last_draft_key_idx = off
            self.last_draft_value_idx = 0
            return inp[match + n : match + n + max(cnt, 0)]

        # (d2) ngram-map-k4v
        if ck.key_num < self.min_hits:
            return []
        vals = ck.values
        for i in range(ck.stat_idx, match + 1):  # inclusive at both ends
            if inp[i : i + n] != key:
                continue
            vb = i + n
            iv = -1
            for v in range(MAX_VALUES):
                if vals[v].value_idx == 0:
                    vals[v] = _Value(vb, 0, m)
                    iv = v
                    break
                vi = vals[v].value_idx
                if inp[vb : vb + m] == inp[vi : vi + m]:
                    iv = v
                    break
            if iv >= 0:  # a 5th distinct value is ignored
                vals[iv].value_num = min(vals[iv].value_num + 1, MAX_VALUE_COUNT)
        ck.stat_idx = match
        max_occur = 0
        slot_max = 0
        for v in range(MAX_VALUES):
            if vals[v].value_num > max_occur:  # ties -> lowest slot
                max_occur = vals[v].value_num
                slot_max = v
        sum_occur = sum(vals[v].value_num for v in range(MAX_VALUES) if v != slot_max)
        if sum_occur > 0 and max_occur < 2 * sum_occur:
            return []
        cnt = min(m, vals[slot_max].n_accepted)
        self.last_draft_created = True
        self.last_draft_key_idx = off
        self.last_draft_value_idx = slot_max
        # tokens after `match`, not after the winning value (quirk 4.6.4)
        return inp[match + n : match + n + max(cnt, 0)]

    def accept(self, n_accepted: int) -> None:
        if not self.last_draft_created:
            return
        v = self.keys[self.last_draft_key_idx].values[self.last_draft_value_idx]
        v.n_accepted = _int16(n_accepted & MASK16)  # uint16 in, stored as int16


# --------------------------------------------------------------------------------------------
# ngram-mod (spec 5)
# --------------------------------------------------------------------------------------------


class RefPool:
    """2^22 int32 entries, EMPTY = -1; sparse dict where an absent slot is EMPTY."""

    SIZE = MOD_POOL_SIZE

    def __init__(self):
        self.entries: dict[int, int] = {}
        self.used = 0

    def reset(self) -> None:
        self.entries = {}
        self.used = 0

    @staticmethod
    def idx(tokens, start: int, n: int) -> int:
        h = 0
        for i in range(n):  # not rolling: all n terms recomputed on every get/add
            h = (h * MOD_MUL + (tokens[start + i] & MASK64)) & MASK64  # sign-extend to 64 bit
        return h & (MOD_POOL_SIZE - 1)

    def add(self, tokens, start: int, n: int) -> None:
        s = self.idx(tokens, start, n)
        if self.entries.get(s, EMPTY) == EMPTY:
            self.used += 1
        self.entries[s] = tokens[start + n]  # last writer wins, no collision check

    def get(self, tokens, start: int, n: int) -> int:
        return self.entries.get(self.idx(tokens, start, n), EMPTY)


class _ModSlot:
    __slots__ = ("i_last", "n_draft_last", "n_low")

    def __init__(self):
        self.i_last = 0
        self.n_draft_last = 0
        self.n_low = 0


class RefMod:
    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64,
                 pool: RefPool | None = None):
        self.n = n_match
        self.n_min = n_min
        self.n_max = n_max
        self.pool = pool if pool is not None else RefPool()
        self.slots: dict[int, _ModSlot] = {}

    def _st(self, slot: int) -> _ModSlot:
        st = self.slots.get(slot)
        if st is None:
            st = self.slots[slot] = _ModSlot()
        return st

    def begin(self, slot: int, prompt) -> None:
        st = self._st(slot)
        st.i_last = 0
        st.n_draft_last = 0  # n_low is NOT reset
        n = self.n
        P = len(prompt)
        if P < n:
            return
        for i in range(P - n):  # every n-gram followed by a prompt token
            self.pool.add(prompt, i, n)
        st.i_last = P - n
        # occupancy check AFTER the insertion, so this prompt's n-grams are wiped too
        if float(self.pool.used) / float(MOD_POOL_SIZE) > 0.25:
            self.pool.reset()

    def draft(self, slot: int, inp: list, sampled: int) -> list:
        st = self._st(slot)
        n = self.n
        st.n_draft_last = 0
        L = len(inp)
        if L < n:
            return []
        if st.i_last + 32 < L:  # chunked insertion runs before the lookup
            for i in range(st.i_last, L - n):
                self.pool.add(inp, i, n)
            st.i_last = L - n
        buf = inp[L - n + 1 : L] + [sampled]
        for i in range(self.n_max):  # the window slides over its own output
            t = self.pool.get(buf, i, n)
            if t == EMPTY:
                if i < self.n_min:
                    return []
                break
            buf.append(t)
        draft = buf[n:]
        st.n_draft_last = len(draft)  # before any glue truncation
        return draft

    def accept(self, slot: int, n_accepted: int, is_other: bool = False) -> None:
        if is_other:
            return
        st = self._st(slot)
        if st.n_draft_last > 0:
            f_acc = float(n_accepted & MASK16) / float(st.n_draft_last)
            if f_acc < 0.25:
                st.n_low += 1  # increment first, then test
                if st.n_low >= 5:
                    self.pool.reset()  # the shared pool: wipes every slot's n-grams
                    st.n_low = 0
                    st.i_last = 0
            else:
                st.n_low = 0


# --------------------------------------------------------------------------------------------
# glue (spec 7)
# --------------------------------------------------------------------------------------------


class _Impl:
    """Uniform (slot-aware) adapter plus the per-implementation counters of spec 7."""

    def __init__(self, type_: str, n_slots: int, p: dict, pool: RefPool | None):
        self.type = type_
        self.calls_b = self.calls_g = self.calls_a = 0
        self.gen_drafts = self.acc_drafts = self.gen_tokens = self.acc_tokens = 0
        self.acc_per_pos: list[int] = []
        if type_ == "ngram-simple":
            self.simple = RefSimple(p["ngram_simple_size_n"], p["ngram_simple_size_m"])
        elif type_ in ("ngram-map-k", "ngram-map-k4v"):
            pre = type_.replace("-", "_")
            self.maps = [RefMap(p[pre + "_size_n"], p[pre + "_size_m"], p[pre + "_min_hits"],
                                key_only=(type_ == "ngram-map-k")) for _ in range(n_slots)]
        elif type_ == "ngram-mod":
            self.mod = RefMod(p["ngram_mod_n_match"], p["ngram_mod_n_min"], p["ngram_mod_n_max"],
                              pool)
        else:
            raise ValueError(f"unsupported type {type_!r}")

    def begin(self, slot, prompt):
        if self.type == "ngram-simple":
            self.simple.begin(prompt)
        elif self.type == "ngram-mod":
            self.mod.begin(slot, prompt)
        else:
            self.maps[slot].begin(prompt)

    def draft(self, slot, inp, sampled):
        if self.type == "ngram-simple":
            return self.simple.draft(inp, sampled)
        if self.type == "ngram-mod":
            return self.mod.draft(slot, inp, sampled)
        return self.maps[slot].draft(inp, sampled)

    def accept(self, slot, n_accepted, is_other):
        if self.type == "ngram-mod":
            self.mod.accept(slot, n_accepted, is_other)
        elif self.type != "ngram-simple" and not is_other:  # the map wrapper drops is_other
            self.maps[slot].accept(n_accepted)

    def stats(self) -> dict:
        return {
            "type": self.type, "calls_b": self.calls_b, "calls_g": self.calls_g,
            "calls_a": self.calls_a, "gen_drafts": self.gen_drafts,
            "acc_drafts": self.acc_drafts, "gen_tokens": self.gen_tokens,
            "acc_tokens": self.acc_tokens, "acc_per_pos": list(self.acc_per_pos),
        }


class RefChain:
    """common_speculative for the n-gram types; one object for all slots.

    ``types``: comma string or iterable of type names (any order; PRIORITY applies).
    ``params``: flat dict named after the server flags (see DEFAULTS); missing keys default.
    """

    def __init__(self, types, n_slots: int = 1, params: dict | None = None,
                 pool: RefPool | None = None):
        if isinstance(types, str):
            types = [t.strip() for t in types.split(",") if t.strip()]
        types = set(types)
        unknown = types - set(PRIORITY)
        if unknown:
            raise ValueError(f"unsupported types {sorted(unknown)}")
        p = dict(DEFAULTS)
        p.update(params or {})
        self.n_slots = n_slots
        self.pool = pool if pool is not None else RefPool()  # one pool per chain (spec 5.1)
        self.impls = [_Impl(t, n_slots, p, self.pool) for t in PRIORITY if t in types]
        self.impl_last: list[_Impl | None] = [None] * n_slots

    def begin(self, slot: int, prompt) -> None:
        prompt = np.asarray(prompt).tolist()     # Python ints: the spec's arithmetic is exact
        for impl in self.impls:
            impl.begin(slot, prompt)
            impl.calls_b += 1

    def draft(self, slot: int, inp, sampled: int, n_max: int | None = None) -> list:
        """``n_max`` is the server's n_draft_max: None = unbounded; <= 0 = the server makes no
        draft call at all (spec 1.2); otherwise the draft is truncated after the impl ran."""
        if n_max is not None and n_max <= 0:
            return []
        inp = np.asarray(inp).tolist()
        for impl in self.impls:
            res = impl.draft(slot, inp, sampled)
            impl.calls_g += 1
            if res:
                if n_max is not None and len(res) > n_max:
                    res = res[:n_max]  # after the impl ran: its state saw the full draft
                self.impl_last[slot] = impl
                impl.gen_drafts += 1
                impl.gen_tokens += len(res)
                return res
        return []  # later impls were not reached only when an earlier one drafted

    def accept(self, slot: int, n_accepted: int) -> None:
        impl = self.impl_last[slot]
        if impl is None:
            raise RuntimeError("accept without a prior non-empty draft on this slot")
        k = n_accepted & MASK16
        while len(impl.acc_per_pos) < k:
            impl.acc_per_pos.append(0)
        for i in range(k):
            impl.acc_per_pos[i] += 1
        if k > 0:
            impl.acc_drafts += 1
            impl.acc_tokens += k
        impl.accept(slot, k, False)
        impl.calls_a += 1
        for o in self.impls:
            if o is not impl:
                o.accept(slot, k, True)

    def stats(self) -> list[dict]:
        return [impl.stats() for impl in self.impls]


# --------------------------------------------------------------------------------------------
# replay loop (golden/README.md)
# --------------------------------------------------------------------------------------------


STAT_KEYS = ("calls_b", "calls_g", "calls_a", "gen_drafts", "acc_drafts", "gen_tokens",
             "acc_tokens")


def replay_request(chain, slot: int, prompt, output):
    """One request under greedy verification, driven by the package's one slot loop
    (``ngramspec.loop.run_recorded``, itself pinned by the golden files); returns
    (steps, drafts)."""
    loop = run_recorded(chain, slot, np.asarray(prompt, dtype=np.int32),
                        np.asarray(output, dtype=np.int32), record_drafts=True)
    return loop.steps, loop.drafts


def drive_recorded(prompt, output, draft, accept=None, forced=None):
    """llama-server's slot loop over a recorded output, test-side (``ngramspec.loop.run_recorded``
    is the package's, through `SlotLoop`; the kernel tests check state between the calls):
    ``draft(context, sampled)`` proposes and each draft is yielded as it is made; the recording
    accepts its longest matching prefix (or ``min(forced, len(draft))`` tokens of the recording
    when `forced` is given) and ``accept(k)`` is told it after every non-empty draft."""
    if not len(output):
        return
    cache, sampled, produced = list(prompt), output[0], 1
    while produced < len(output):
        d = draft(cache, sampled)
        yield d
        k, rest = 0, output[produced:]
        if forced is not None:
            k = min(forced, len(d))
        else:
            while k < len(d) and k < len(rest) and d[k] == rest[k]:
                k += 1
        if len(d) and accept is not None:
            accept(k)
        cache += [sampled] + list(output[produced:produced + k])
        produced += k
        if produced >= len(output):
            break
        sampled = output[produced]
        produced += 1


def ref_replay(chain_factory, requests, state: str = "shared", n_slots: int = 1):
    """Replay ``requests`` (each a (prompt, output) pair or a dict with those keys).

    state 'shared': one chain for all requests, request t on slot t % n_slots;
    'fresh': a new chain per request (slot 0), with the statistics summed over requests.
    Returns (per_request, stats), per_request = [{"slot", "steps", "drafts"}, ...].
    """
    if state not in ("shared", "fresh"):
        raise ValueError(state)
    per_request = []
    chain = chain_factory() if state == "shared" else None
    totals: list[dict] | None = None
    for t, req in enumerate(requests):
        prompt, output = (req["prompt"], req["output"]) if isinstance(req, dict) else req
        if state == "fresh":
            c, slot = chain_factory(), 0
        else:
            c, slot = chain, t % n_slots
        steps, drafts = replay_request(c, slot, prompt, output)
        per_request.append({"slot": slot, "steps": steps, "drafts": drafts})
        if state == "fresh":
            totals = _add_stats(totals, c.stats())
    stats = chain.stats() if state == "shared" else (totals or [])
    return per_request, stats


def _add_stats(acc, stats):
    if acc is None:
        return [dict(s) for s in stats]
    for a, s in zip(acc, stats):
        for k in STAT_KEYS:
            a[k] += s[k]
        pa, ps = a["acc_per_pos"], s["acc_per_pos"]
        a["acc_per_pos"] = [(pa[i] if i < len(pa) else 0) + (ps[i] if i < len(ps) else 0)
                            for i in range(max(len(pa), len(ps)))]
    return acc
