// llama.cpp's draftless n-gram proposers as a C++ timing baseline for ngramspec.
//
// Written from ../shared/spec/llamacpp-ngram.md (sections 3, 4, 5 and 7), not copied from
// llama.cpp: ngram-simple, ngram-map-k, ngram-map-k4v and ngram-mod, and the
// common_speculative glue they run through (fixed priority order, first non-empty draft
// wins, n_max truncation after the implementation, per-implementation counters and timers).
// The data structures are llama.cpp's as the spec describes them (std::vector token lists,
// the linear key list of ngram-map, the non-rolling ngram-mod hash with a runtime modulo by
// the pool size), so the per-call cost is llama.cpp's algorithmic cost, not an optimised one.
//
// Built by bench/llamacpp_baseline/__init__.py with `g++ -O2` (the spec's section 9 flags,
// plus -falign-loops=64 for stable timing, see there) into a shared library and driven through ctypes. Each draft call is timed here, with
// std::chrono::steady_clock around the glue's draft (all implementations and the glue's
// bookkeeping, as the spec's figures are "including the glue"), so the ctypes call is not
// counted. The copy of the context into the slot's token vector happens before the timer
// starts, as llama-server copies the KV-cache tokens into the draft params before the call.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

using llama_token = int32_t;
using llama_tokens = std::vector<llama_token>;
using clk = std::chrono::steady_clock;

static int64_t ns_since(clk::time_point t0) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now() - t0).count();
}

// ----------------------------------------------------------------------------------------
// ngram-simple (spec 3): stateless backward scan for the most recent earlier occurrence.
// ----------------------------------------------------------------------------------------

static llama_tokens simple_draft(size_t n, size_t m, const llama_tokens & inp,
                                 llama_token sampled) {
    const size_t L = inp.size();
    if (L <= n + m + 1) {
        return {};
    }
    llama_tokens pattern(inp.begin() + (L - n + 1), inp.end());
    pattern.push_back(sampled);
    size_t match = 0;
    for (size_t j = L - n - 1; j > 0; --j) {
        bool same = true;
        for (size_t k = 0; k < n; ++k) {
            if (inp[j + k] != pattern[k]) {
                same = false;
                break;
            }
        }
        if (same) {
            match = j;
            break;
        }
    }
    if (match == 0) {
        return {};
    }
    const size_t copy_max = std::min(m, L - (match + n));
    if (copy_max < n) {
        return {};
    }
    return llama_tokens(inp.begin() + match + n, inp.begin() + match + n + copy_max);
}

// ----------------------------------------------------------------------------------------
// ngram-map-k / ngram-map-k4v (spec 4): per-slot key list, 2^18-slot position index.
// ----------------------------------------------------------------------------------------

constexpr size_t MAP_HASH_SIZE = 262144;
constexpr int MAP_MAX_VALUES = 4;
constexpr uint16_t MAP_MAX_COUNT = 16380;

struct map_value {
    size_t value_idx = 0;        // 0 = unused
    uint16_t value_num = 0;
    int16_t n_accepted = -1;
};

struct map_key {
    size_t key_idx = 0;
    size_t stat_idx = 0;
    uint16_t key_num = 0;
    map_value values[MAP_MAX_VALUES];
};

struct ngram_map {
    uint16_t n, m;
    bool key_only;
    uint16_t min_hits;
    std::vector<map_key> keys;
    size_t size_last_begin = 0;
    bool last_draft_created = false;
    size_t last_draft_key_idx = 0;
    uint16_t last_draft_value_idx = 0;
    size_t idx_last_check = 0;
    std::vector<uint32_t> key_map;
    uint32_t key_map_last_idx = 0;

    ngram_map(uint16_t n, uint16_t m, bool key_only, uint16_t min_hits)
        : n(n), m(m), key_only(key_only), min_hits(min_hits), key_map(MAP_HASH_SIZE, 0) {}
};

// 32-bit multiplicative hash: 64-bit multiply-add of the sign-extended token, truncated.
static uint32_t map_hash(const llama_token * t, size_t len) {
    uint32_t h = 0;
    for (size_t i = 0; i < len; ++i) {
        h = (uint32_t) ((uint64_t) h * 2654435761ULL + (uint64_t) (int64_t) t[i]);
    }
    return h;
}

static bool same_tokens(const llama_token * a, const llama_token * b, size_t len) {
    for (size_t i = 0; i < len; ++i) {
        if (a[i] != b[i]) {
            return false;
        }
    }
    return true;
}

static void map_begin(ngram_map & map, const llama_tokens & tokens) {
    const size_t size_begin = tokens.size();
    const size_t n = map.n, m = map.m;
    size_t cleanup = map.size_last_begin;
    if (cleanup > size_begin) {
        cleanup = size_begin > n + m ? size_begin - n - m : 0;
    }
    if (size_begin < map.idx_last_check) {
        for (size_t h = 0; h < MAP_HASH_SIZE; ++h) {
            if (map.key_map[h] != 0 && map.key_map[h] >= cleanup) {
                map.key_map[h] = 0;
            }
        }
        map.key_map_last_idx = cleanup > 0 ? (uint32_t) (cleanup - 1) : 0;
        for (size_t i = map.keys.size(); i-- > 0;) {
            map_key & key = map.keys[i];
            if (key.key_idx >= cleanup) {
                map.keys.erase(map.keys.begin() + i);
                continue;
            }
            if (map.key_only) {
                continue;
            }
            for (int j = MAP_MAX_VALUES - 1; j >= 0; --j) {
                if (key.values[j].value_idx != 0 && key.values[j].value_idx >= cleanup) {
                    for (int k = j; k < MAP_MAX_VALUES - 1; ++k) {
                        key.values[k] = key.values[k + 1];
                    }
                    // n_accepted of the last slot is left as it was (spec 4.3)
                    key.values[MAP_MAX_VALUES - 1].value_idx = 0;
                    key.values[MAP_MAX_VALUES - 1].value_num = 0;
                }
            }
            if (key.values[0].value_idx == 0) {
                map.keys.erase(map.keys.begin() + i);
            }
        }
    }
    map.idx_last_check = size_begin;
    map.size_last_begin = size_begin;
}

static llama_tokens map_draft(ngram_map & map, const llama_tokens & inp, llama_token sampled) {
    map.last_draft_created = false;
    map.last_draft_key_idx = 0;
    map.last_draft_value_idx = 0;
    const size_t L = inp.size();
    const size_t n = map.n, m = map.m;
    if (L < 2 * n + m) {
        return {};
    }
    map.idx_last_check = L;
    llama_tokens key(inp.begin() + (L - n + 1), inp.end());
    key.push_back(sampled);

    const size_t S = map.size_last_begin;
    const size_t K = map.key_map_last_idx;
    const size_t top = L - n - m - 1;        // highest candidate position

    // (a) lookup: the index, then the positions it does not cover yet
    size_t match = 0;
    const uint32_t idx = map.key_map[map_hash(key.data(), n) % MAP_HASH_SIZE];
    if (idx != 0 && idx < top && same_tokens(inp.data() + idx, key.data(), n)) {
        match = idx;
    }
    if (match == 0 && S > n + m + 1) {
        for (size_t j = S - n - m - 1; j > K; --j) {
            if (same_tokens(inp.data() + j, key.data(), n)) {
                match = j;
                break;
            }
        }
    }
    if (match == 0) {
        for (size_t j = top; j > S && j > K; --j) {
            if (same_tokens(inp.data() + j, key.data(), n)) {
                match = j;
                break;
            }
        }
    }

    // (b) index the same ranges, descending, first writer wins
    auto insert = [&](size_t j) {
        uint32_t & slot = map.key_map[map_hash(inp.data() + j, n) % MAP_HASH_SIZE];
        if (slot == 0) {
            slot = (uint32_t) j;
        }
    };
    if (S > n + m + 1) {
        for (size_t j = S - n - m - 1; j > K; --j) {
            insert(j);
        }
    }
    for (size_t j = top; j > S && j > K; --j) {
        insert(j);
    }
    map.key_map_last_idx = std::max((uint32_t) top, map.key_map_last_idx);
    if (match == 0) {
        return {};
    }

    // (c) the key's statistics record: linear search over every key seen so far
    size_t off = 0;
    for (; off < map.keys.size(); ++off) {
        if (same_tokens(inp.data() + map.keys[off].key_idx, key.data(), n)) {
            break;
        }
    }
    if (off == map.keys.size()) {
        map_key fresh;
        fresh.key_idx = match;
        for (auto & v : fresh.values) {
            v.n_accepted = (int16_t) m;
        }
        map.keys.push_back(fresh);
    }
    map_key & ck = map.keys[off];
    ck.key_num = std::min<uint16_t>(ck.key_num + 1, MAP_MAX_COUNT);

    size_t slot_max = 0;
    if (!map.key_only) {
        // (d2) k4v: values seen after the key, scanned from stat_idx to match inclusive
        if (ck.key_num < map.min_hits) {
            return {};
        }
        for (size_t i = ck.stat_idx; i <= match; ++i) {
            if (!same_tokens(inp.data() + i, key.data(), n)) {
                continue;
            }
            const size_t vb = i + n;
            int iv = -1;
            for (int v = 0; v < MAP_MAX_VALUES; ++v) {
                map_value & val = ck.values[v];
                if (val.value_idx == 0) {
                    val.value_idx = vb;
                    val.value_num = 0;
                    val.n_accepted = (int16_t) m;
                    iv = v;
                    break;
                }
                if (same_tokens(inp.data() + vb, inp.data() + val.value_idx, m)) {
                    iv = v;
                    break;
                }
            }
            if (iv >= 0) {
                ck.values[iv].value_num = std::min<uint16_t>(ck.values[iv].value_num + 1,
                                                             MAP_MAX_COUNT);
            }
        }
        ck.stat_idx = match;
        uint16_t max_occur = 0;
        for (int v = 0; v < MAP_MAX_VALUES; ++v) {
            if (ck.values[v].value_num > max_occur) {
                max_occur = ck.values[v].value_num;
                slot_max = v;
            }
        }
        uint32_t sum_occur = 0;
        for (int v = 0; v < MAP_MAX_VALUES; ++v) {
            if ((size_t) v != slot_max) {
                sum_occur += ck.values[v].value_num;
            }
        }
        if (sum_occur > 0 && max_occur < 2 * sum_occur) {
            return {};
        }
    }
    // (d1)/(d2) draft the m tokens after the match, as many as the value last had accepted
    const int cnt = std::min<int>(m, ck.values[slot_max].n_accepted);
    map.last_draft_created = true;
    map.last_draft_key_idx = off;
    map.last_draft_value_idx = (uint16_t) slot_max;
    return llama_tokens(inp.begin() + match + n, inp.begin() + match + n + std::max(cnt, 0));
}

static void map_accept(ngram_map & map, uint16_t n_accepted) {
    if (!map.last_draft_created) {
        return;
    }
    map.keys[map.last_draft_key_idx].values[map.last_draft_value_idx].n_accepted =
        (int16_t) n_accepted;
}

// ----------------------------------------------------------------------------------------
// ngram-mod (spec 5): one 2^22-entry pool of next tokens shared by every slot.
// ----------------------------------------------------------------------------------------

struct mod_pool {
    static constexpr llama_token EMPTY = -1;
    size_t n;
    size_t used = 0;
    std::vector<llama_token> entries;

    mod_pool(size_t n, size_t size) : n(n), entries(size, EMPTY) {}

    // not rolling: every lookup rehashes all n tokens; a runtime modulo by the pool size
    size_t idx(const llama_token * t) const {
        size_t h = 0;
        for (size_t i = 0; i < n; ++i) {
            h = h * 6364136223846793005ULL + (size_t) (int64_t) t[i];
        }
        return h % entries.size();
    }
    void add(const llama_token * t) {
        const size_t s = idx(t);
        if (entries[s] == EMPTY) {
            used++;
        }
        entries[s] = t[n];
    }
    llama_token get(const llama_token * t) const { return entries[idx(t)]; }
    void reset() {
        std::fill(entries.begin(), entries.end(), EMPTY);
        used = 0;
    }
};

struct mod_slot {
    size_t i_last = 0;
    size_t n_draft_last = 0;
    int n_low = 0;
};

// ----------------------------------------------------------------------------------------
// The common_speculative glue (spec 7) and the implementations behind it.
// ----------------------------------------------------------------------------------------

enum impl_type { SIMPLE = 0, MAP_K = 1, MAP_K4V = 2, MOD = 3 };

struct draft_params {
    bool drafting = false;
    int64_t n_max = 0;
    const llama_tokens * prompt = nullptr;
    llama_token id_last = 0;
    llama_tokens result;
};

struct impl_base {
    uint64_t n_call_begin = 0, n_call_draft = 0, n_call_accept = 0;
    uint64_t n_gen_drafts = 0, n_acc_drafts = 0, n_gen_tokens = 0, n_acc_tokens = 0;
    std::vector<uint64_t> n_acc_tokens_per_pos;
    int64_t t_begin_ns = 0, t_draft_ns = 0, t_accept_ns = 0;

    virtual ~impl_base() = default;
    virtual void begin(int seq, const llama_tokens & prompt) = 0;
    virtual void draft(std::vector<draft_params> & dp) = 0;     // every slot still drafting
    virtual void accept(int seq, uint16_t n_accepted, bool is_other) = 0;
};

struct impl_simple : impl_base {
    size_t n, m;
    impl_simple(size_t n, size_t m) : n(n), m(m) {}
    void begin(int, const llama_tokens &) override {}
    void draft(std::vector<draft_params> & dp) override {
        for (auto & p : dp) {
            if (p.drafting) {
                p.result = simple_draft(n, m, *p.prompt, p.id_last);
            }
        }
    }
    void accept(int, uint16_t, bool) override {}
};

struct impl_map : impl_base {
    std::vector<ngram_map> maps;                 // one complete map per slot
    impl_map(int n_seq, uint16_t n, uint16_t m, bool key_only, uint16_t min_hits) {
        for (int s = 0; s < n_seq; ++s) {
            maps.emplace_back(n, m, key_only, min_hits);
        }
    }
    void begin(int seq, const llama_tokens & prompt) override { map_begin(maps[seq], prompt); }
    void draft(std::vector<draft_params> & dp) override {
        for (size_t s = 0; s < dp.size(); ++s) {
            if (dp[s].drafting) {
                dp[s].result = map_draft(maps[s], *dp[s].prompt, dp[s].id_last);
            }
        }
    }
    void accept(int seq, uint16_t n_accepted, bool is_other) override {
        if (!is_other) {
            map_accept(maps[seq], n_accepted);
        }
    }
};

struct impl_mod : impl_base {
    static constexpr size_t POOL_SIZE = 4 * 1024 * 1024;
    mod_pool pool;
    std::vector<mod_slot> slots;
    size_t n_min, n_max;

    impl_mod(int n_seq, size_t n_match, size_t n_min, size_t n_max)
        : pool(n_match, POOL_SIZE), slots(n_seq), n_min(n_min), n_max(n_max) {}

    void begin(int seq, const llama_tokens & prompt) override {
        mod_slot & st = slots[seq];
        st.i_last = 0;
        st.n_draft_last = 0;
        const size_t n = pool.n, P = prompt.size();
        if (P < n) {
            return;
        }
        for (size_t i = 0; i + n < P; ++i) {
            pool.add(prompt.data() + i);
        }
        st.i_last = P - n;
        if ((double) pool.used / (double) POOL_SIZE > 0.25) {   // checked after the insertion
            pool.reset();
        }
    }

    llama_tokens draft_one(mod_slot & st, const llama_tokens & inp, llama_token sampled) {
        st.n_draft_last = 0;
        const size_t n = pool.n, L = inp.size();
        if (L < n) {
            return {};
        }
        if (st.i_last + 32 < L) {
            for (size_t i = st.i_last; i + n < L; ++i) {
                pool.add(inp.data() + i);
            }
            st.i_last = L - n;
        }
        llama_tokens buf;
        buf.reserve(n + n_max);
        buf.insert(buf.end(), inp.begin() + (L - n + 1), inp.end());
        buf.push_back(sampled);
        for (size_t i = 0; i < n_max; ++i) {
            const llama_token t = pool.get(buf.data() + i);
            if (t == mod_pool::EMPTY) {
                if (i < n_min) {
                    return {};
                }
                break;
            }
            buf.push_back(t);
        }
        llama_tokens result(buf.begin() + n, buf.end());
        st.n_draft_last = result.size();
        return result;
    }

    void draft(std::vector<draft_params> & dp) override {
        for (size_t s = 0; s < dp.size(); ++s) {
            if (dp[s].drafting) {
                dp[s].result = draft_one(slots[s], *dp[s].prompt, dp[s].id_last);
            }
        }
    }

    void accept(int seq, uint16_t n_accepted, bool is_other) override {
        if (is_other) {
            return;
        }
        mod_slot & st = slots[seq];
        if (st.n_draft_last > 0) {
            const double f_acc = (double) n_accepted / (double) st.n_draft_last;
            if (f_acc < 0.25) {
                st.n_low += 1;
                if (st.n_low >= 5) {
                    pool.reset();
                    st.n_low = 0;
                    st.i_last = 0;
                }
            } else {
                st.n_low = 0;
            }
        }
    }
};

struct speculative {
    std::vector<std::unique_ptr<impl_base>> impls;   // in llama.cpp's fixed priority order
    std::vector<impl_base *> impl_last;              // per slot: producer of its last draft
    std::vector<draft_params> dp;
    std::vector<llama_tokens> prompts;               // per slot: the KV-cache tokens

    void begin(int seq, const llama_tokens & prompt) {
        for (auto & impl : impls) {
            const auto t0 = clk::now();
            impl->begin(seq, prompt);
            impl->n_call_begin++;
            impl->t_begin_ns += ns_since(t0);
        }
    }

    void draft() {
        bool any = false;
        for (auto & p : dp) {
            any = any || p.drafting;
        }
        if (!any) {
            return;
        }
        for (auto & impl : impls) {
            const auto t0 = clk::now();
            impl->draft(dp);
            impl->n_call_draft++;
            impl->t_draft_ns += ns_since(t0);
            bool still = false;
            for (size_t s = 0; s < dp.size(); ++s) {
                draft_params & p = dp[s];
                if (!p.drafting) {
                    continue;
                }
                if (p.result.empty()) {
                    still = true;
                    continue;
                }
                p.drafting = false;
                if (p.n_max > 0 && (int64_t) p.result.size() > p.n_max) {
                    p.result.resize(p.n_max);
                }
                impl_last[s] = impl.get();
                impl->n_gen_drafts++;
                impl->n_gen_tokens += p.result.size();
            }
            if (!still) {
                break;
            }
        }
        for (auto & p : dp) {
            p.drafting = false;
        }
    }

    void accept(int seq, uint16_t n_accepted) {
        impl_base * impl = impl_last[seq];
        if (impl == nullptr) {
            return;
        }
        const auto t0 = clk::now();
        if (impl->n_acc_tokens_per_pos.size() < n_accepted) {
            impl->n_acc_tokens_per_pos.resize(n_accepted, 0);
        }
        for (size_t i = 0; i < n_accepted; ++i) {
            impl->n_acc_tokens_per_pos[i]++;
        }
        if (n_accepted > 0) {
            impl->n_acc_drafts++;
            impl->n_acc_tokens += n_accepted;
        }
        impl->accept(seq, n_accepted, false);
        impl->n_call_accept++;
        impl->t_accept_ns += ns_since(t0);
        for (auto & other : impls) {
            if (other.get() != impl) {
                other->accept(seq, n_accepted, true);
            }
        }
    }
};

// ----------------------------------------------------------------------------------------
// C interface for ctypes. Parameters are validated by the Python wrapper.
// ----------------------------------------------------------------------------------------

extern "C" {

// types: impl_type values in priority order; params: simple n, m; map-k n, m, min_hits;
// map-k4v n, m, min_hits; mod n_match, n_min, n_max (11 ints).
void * ngb_create(const int32_t * types, int32_t n_types, int32_t n_seq, const int32_t * p) {
    auto * spec = new speculative();
    for (int32_t i = 0; i < n_types; ++i) {
        impl_base * impl = nullptr;
        switch (types[i]) {
            case SIMPLE: impl = new impl_simple(p[0], p[1]); break;
            case MAP_K: impl = new impl_map(n_seq, p[2], p[3], true, p[4]); break;
            case MAP_K4V: impl = new impl_map(n_seq, p[5], p[6], false, p[7]); break;
            case MOD: impl = new impl_mod(n_seq, p[8], p[9], p[10]); break;
            default: delete spec; return nullptr;
        }
        spec->impls.emplace_back(impl);
    }
    spec->impl_last.assign(n_seq, nullptr);
    spec->dp.resize(n_seq);
    spec->prompts.resize(n_seq);
    return spec;
}

void ngb_free(void * h) { delete (speculative *) h; }

int64_t ngb_begin(void * h, int32_t seq, const int32_t * tokens, int64_t n) {
    auto * spec = (speculative *) h;
    llama_tokens prompt(tokens, tokens + n);
    const auto t0 = clk::now();
    spec->begin(seq, prompt);
    return ns_since(t0);
}

// Drafts for slot `seq` after `ctx[0:L]` and `sampled`; writes the draft into `out` (at most
// `cap` tokens) and returns its full length; `*ns` gets the time of the glue's draft call.
int64_t ngb_draft(void * h, int32_t seq, const int32_t * ctx, int64_t L, int32_t sampled,
                  int64_t n_max, int32_t * out, int64_t cap, int64_t * ns) {
    auto * spec = (speculative *) h;
    llama_tokens & prompt = spec->prompts[seq];
    prompt.assign(ctx, ctx + L);                     // the server's copy, not timed
    draft_params & p = spec->dp[seq];
    p.drafting = true;
    p.n_max = n_max;
    p.prompt = &prompt;
    p.id_last = sampled;
    p.result.clear();
    const auto t0 = clk::now();
    spec->draft();
    *ns = ns_since(t0);
    const int64_t len = (int64_t) p.result.size();
    if (len > 0) {
        std::memcpy(out, p.result.data(), sizeof(int32_t) * (size_t) std::min(len, cap));
    }
    return len;
}

int64_t ngb_accept(void * h, int32_t seq, int32_t n_accepted) {
    const auto t0 = clk::now();
    ((speculative *) h)->accept(seq, (uint16_t) n_accepted);
    return ns_since(t0);
}

int32_t ngb_n_impls(void * h) { return (int32_t) ((speculative *) h)->impls.size(); }

// calls_b, calls_g, calls_a, gen_drafts, acc_drafts, gen_tokens, acc_tokens of impl i.
void ngb_stats(void * h, int32_t i, uint64_t * out) {
    const impl_base & s = *((speculative *) h)->impls[i];
    const uint64_t v[7] = {s.n_call_begin, s.n_call_draft, s.n_call_accept, s.n_gen_drafts,
                           s.n_acc_drafts, s.n_gen_tokens, s.n_acc_tokens};
    std::memcpy(out, v, sizeof v);
}

// What an empty steady_clock interval reads (ns, minimum of `reps`).
int64_t ngb_timer_ns(int32_t reps) {
    int64_t best = INT64_MAX;
    for (int32_t i = 0; i < reps; ++i) {
        const auto t0 = clk::now();
        best = std::min(best, ns_since(t0));
    }
    return best;
}

}  // extern "C"
