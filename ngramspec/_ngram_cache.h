// ngram-cache's C++ containers (included by _cache.pyx): llama.cpp's common_ngram and its
// count tables on `ngs::OrderedTable` (_ordered_table.h), and the primitives the Cython kernels
// call. Every primitive that allocates catches std::bad_alloc and reports it as a return value,
// so the kernels stay `noexcept nogil`; the `ngs_std_*` ones (llama.cpp's own containers, for
// tests) let it propagate (declared `except +` in _cache.pyx).
//
// Ownership: a cache owns its parts and their counts; ngs_free empties it. Thread-safety: none;
// _cache.pyx serializes access to each cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>
#include <unordered_map>
#include <vector>

#include "_ordered_table.h"

// llama.cpp's common_ngram: 4 token ids, the unused tail is LLAMA_TOKEN_NULL (-1).
struct ngs_ngram {
    int32_t tokens[4];
    bool operator==(const ngs_ngram & o) const {
        return tokens[0] == o.tokens[0] && tokens[1] == o.tokens[1]
            && tokens[2] == o.tokens[2] && tokens[3] == o.tokens[3];
    }
};

// llama.cpp's common_ngram_hash_function (Fibonacci hashing, XOR-combined). It only orders
// the outer table (and so a saved file) as llama.cpp's; it is never used to find a key:
// (x, x) and (x, x, y, y) all hash to 0.
struct ngs_ngram_hash {
    size_t operator()(const ngs_ngram & g) const {
        const uint64_t fib = 11400714819323198485ull;
        uint64_t h = (uint64_t)(int64_t)g.tokens[0] * fib;
        h ^= (uint64_t)(int64_t)g.tokens[1] * fib;
        h ^= (uint64_t)(int64_t)g.tokens[2] * fib;
        h ^= (uint64_t)(int64_t)g.tokens[3] * fib;
        return (size_t)h;
    }
};

// The index's hashes: CPython's keyed SipHash, so that no input can be crafted to collide.
struct ngs_ngram_index_hash {
    size_t operator()(const ngs_ngram & g) const {
        return ngs::keyed_hash(g.tokens, sizeof g.tokens);
    }
};
struct ngs_token_index_hash {
    size_t operator()(int32_t t) const { return ngs::keyed_hash(&t, sizeof t); }
};

// llama.cpp's common_ngram_cache_part (unordered_map<int32, int32>) and common_ngram_cache
// (unordered_map<common_ngram, part, common_ngram_hash_function>): the same iteration
// orders, which break ties and order saved files, but O(1) lookups (_ordered_table.h).
typedef ngs::ordered_table<int32_t, int32_t, std::hash<int32_t>, ngs_token_index_hash> ngs_part;
typedef ngs::ordered_table<ngs_ngram, ngs_part, ngs_ngram_hash, ngs_ngram_index_hash> ngs_cache;

struct ngs_slot {
    size_t cache_size = 0;   // tokens of the slot's stream already seen (llama.cpp never resets it)
    ngs_cache context;
};

// Counts saturate at INT32_MAX instead of overflowing (llama.cpp's int32 += is undefined
// there; a wrapped, negative count would also make the file unloadable).
static inline int32_t ngs_sat_add(int32_t a, int32_t b) {
    const int64_t s = (int64_t)a + (int64_t)b;
    return s > INT32_MAX ? INT32_MAX : (int32_t)s;
}

static inline ngs_part * ngs_find(ngs_cache * c, const ngs_ngram & g) {
    return c->get(g);
}

// cache[g][tok] += count, inserting absent keys. The same insertions, hence the same
// orders, as common_ngram_cache_update / _merge: a new n-gram gets a new part holding just
// {tok: count}; a new token is inserted into the existing part. 0 = ok, -1 = no memory
// (nothing changed then).
static inline int ngs_add(ngs_cache * c, const ngs_ngram & g, int32_t tok, int32_t count) {
    try {
        const ngs_cache::probe pg = c->lookup(g);
        if (pg.found == nullptr) {
            ngs_part p;
            p.insert_new(tok, std::move(count));
            c->insert_new(g, std::move(p), &pg);
            return 0;
        }
        ngs_part & part = pg.found->kv.second;
        const ngs_part::probe pt = part.lookup(tok);
        if (pt.found == nullptr) {
            part.insert_new(tok, std::move(count), &pt);
        } else {
            pt.found->kv.second = ngs_sat_add(pt.found->kv.second, count);
        }
        return 0;
    } catch (const std::bad_alloc &) {
        return -1;
    }
}

// For loading: the part of a new n-gram, or nullptr (*is_new = false) if g is already there;
// a file's later duplicate is ignored, as common_ngram_cache_load's emplace ignores it.
static inline ngs_part * ngs_new_part(ngs_cache * c, const ngs_ngram & g, int * is_new) {
    const ngs_cache::probe pg = c->lookup(g);
    if (pg.found != nullptr) {
        *is_new = 0;
        return nullptr;
    }
    *is_new = 1;
    try {
        return c->insert_new(g, ngs_part(), &pg);
    } catch (const std::bad_alloc &) {
        return nullptr;
    }
}

// emplace (first occurrence wins). 0 = ok, -1 = no memory.
static inline int ngs_part_emplace(ngs_part * p, int32_t tok, int32_t count) {
    try {
        const ngs_part::probe pt = p->lookup(tok);
        if (pt.found == nullptr) p->insert_new(tok, std::move(count), &pt);
        return 0;
    } catch (const std::bad_alloc &) {
        return -1;
    }
}

// Insert a copy of part p under n-gram g (absent): a copy keeps p's bucket count and
// iteration order, exactly as common_ngram_cache_merge's emplace(ngram, part) does.
static inline int ngs_insert_copy(ngs_cache * c, const ngs_ngram & g, const ngs_part * p) {
    try {
        c->insert_new(g, ngs_part(*p));    // the caller's lookup found nothing
        return 0;
    } catch (const std::bad_alloc &) {
        return -1;
    }
}

// Empty a cache and give its memory back (clear() keeps the bucket array): the old
// contents move into a temporary that is destroyed here.
static inline void ngs_free(ngs_cache * c) {
    c->reset();
}

static inline int ngs_copy_cache(ngs_cache * dst, const ngs_cache * src) {
    try {
        *dst = *src;
        return 0;
    } catch (const std::bad_alloc &) {
        return -1;
    }
}

// For tests only: llama.cpp's containers themselves (libstdc++'s unordered_map with
// llama.cpp's hashes), to check that ngs_cache iterates in exactly their order.
typedef std::unordered_map<int32_t, int32_t> ngs_std_part;
typedef std::unordered_map<ngs_ngram, ngs_std_part, ngs_ngram_hash> ngs_std_cache;

static inline void ngs_std_add(ngs_std_cache * c, const ngs_ngram & g, int32_t tok,
                               int32_t count) {
    auto it = c->find(g);
    if (it == c->end()) {
        (*c)[g].emplace(tok, count);
        return;
    }
    auto jt = it->second.find(tok);
    if (jt == it->second.end()) it->second.emplace(tok, count);
    else jt->second = ngs_sat_add(jt->second, count);
}

// common_ngram_cache_merge, verbatim in its container operations.
static inline void ngs_std_merge(ngs_std_cache * dst, const ngs_std_cache * src) {
    for (const auto & kv : *src) {
        if (dst->find(kv.first) == dst->end()) {
            dst->emplace(kv.first, kv.second);
            continue;
        }
        for (const auto & tc : kv.second) ngs_std_add(dst, kv.first, tc.first, tc.second);
    }
}

// common_ngram_cache_load's insertions for one record.
static inline ngs_std_part * ngs_std_new_part(ngs_std_cache * c, const ngs_ngram & g) {
    auto r = c->try_emplace(g);
    return r.second ? &r.first->second : nullptr;
}

// Thresholds of common_ngram_cache_draft, indexed by n-gram size - 1.
static const int ngs_min_n_lax[4]    = { 2,  2,  1,  1};
static const int ngs_min_pct_lax[4]  = {66, 50, 50, 50};
static const int ngs_min_n_strict[4] = { 4,  3,  2,  2};
static const int ngs_min_pct_strict[4] = {75, 66, 66, 66};
