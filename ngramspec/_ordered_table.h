// A hash map that iterates in exactly the order libstdc++'s std::unordered_map<K, V, OrderHash>
// would after the same insertions, while finding and inserting keys in O(1) whatever they are.
//
// Why: llama.cpp's ngram-cache breaks ties (and orders its saved files) by the iteration order
// of std::unordered_map with its own n-gram hash and with std::hash<int32_t>. That order is
// part of bit-exactness, but finding a key in the real container scans the key's bucket, and
// the order hashes are trivial to flood: llama.cpp's n-gram hash sends every (x, x) and
// (x, x, y, y) to 0, and std::hash<int32_t> is the identity, so a crafted token stream or
// cache file puts every key into one bucket and makes each insertion cost O(n).
//
// How: the order is kept in the very structure libstdc++ uses (a singly linked node list whose
// buckets point at the node before their first node, new nodes at the front of their bucket,
// the same rehash walk), with the bucket counts chosen by libstdc++'s own
// std::__detail::_Prime_rehash_policy, so it is the same order by construction. Bucket scans
// only find a key while the table holds at most SMALL entries (so a scan is short whatever the
// keys); above that, an open-addressing index keyed with CPython's per-process randomized
// SipHash (PyHash_GetFuncDef) finds it. libstdc++'s own insert scans the bucket before
// linking the node; linking a node known to be new needs no scan.
//
// Memory: the container object is 56 bytes, as std::unordered_map's; each node holds the
// cached order hash code (libstdc++ caches it for the n-gram hash too); above SMALL entries
// the index adds 8 bytes per slot, 2x to 4x the entries.
//
// Thread-safety: none; callers serialize access (see _cache.pyx). Allocation failures throw
// std::bad_alloc and leave the table as it was (strong guarantee).
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <unordered_map>
#include <utility>

namespace ngs {

// Hash of `n` bytes with CPython's keyed string hash (SipHash-1-3 or -2-4, random key per
// process unless PYTHONHASHSEED is set): colliding keys cannot be computed in advance. Pure
// computation on a key fixed at interpreter start-up, so it is safe without the GIL.
inline size_t keyed_hash(const void * p, Py_ssize_t n) {
    static const PyHash_FuncDef * def = PyHash_GetFuncDef();
    return (size_t)def->hash(p, n);
}

template <class K, class V, class OrderHash, class IndexHash>
class ordered_table {
  public:
    static const size_t SMALL = 8;    // up to this many entries, find walks the list

    struct node_base { node_base * next; };
    struct node : node_base {
        size_t code;                  // OrderHash of the key
        std::pair<K, V> kv;
        node(size_t c, const K & k, V && v) : node_base{nullptr}, code(c), kv(k, std::move(v)) {}
        node(size_t c, const std::pair<K, V> & p) : node_base{nullptr}, code(c), kv(p) {}
    };

    struct iterator {
        node * p;
        std::pair<K, V> & operator*() const { return p->kv; }
        iterator & operator++() { p = static_cast<node *>(p->next); return *this; }
        bool operator==(const iterator & o) const { return p == o.p; }
        bool operator!=(const iterator & o) const { return p != o.p; }
    };

    ordered_table() noexcept {}
    ~ordered_table() { release(); }

    ordered_table(const ordered_table & o)
        : bucket_count_(o.bucket_count_), count_(0), next_resize_(o.next_resize_) {
        try {
            assign_from(o);
        } catch (...) {
            release();
            throw;
        }
    }

    ordered_table(ordered_table && o) noexcept { steal(o); }

    ordered_table & operator=(const ordered_table & o) {
        if (this != &o) {
            ordered_table tmp(o);
            release();
            steal(tmp);
        }
        return *this;
    }

    ordered_table & operator=(ordered_table && o) noexcept {
        if (this != &o) {
            release();
            steal(o);
        }
        return *this;
    }

    iterator begin() const { return iterator{static_cast<node *>(before_begin_.next)}; }
    iterator end() const { return iterator{nullptr}; }
    size_t size() const { return count_; }
    size_t bucket_count() const { return bucket_count_; }
    size_t index_capacity() const { return index_ ? index_mask_ + 1 : 0; }

    // The result of a lookup: the node found (or nullptr) and the key's index hash if it was
    // computed, which an insertion of the key then reuses.
    struct probe {
        node * found;
        size_t index_hash;
        bool hashed;
    };

    probe lookup(const K & k) const {
        if (!index_) return probe{scan_bucket(k), 0, false};
        const size_t h = IndexHash()(k);
        size_t i = h & index_mask_;
        for (node * n; (n = index_[i]) != nullptr; i = (i + 1) & index_mask_)
            if (n->kv.first == k) return probe{n, h, true};
        return probe{nullptr, h, true};
    }

    iterator find(const K & k) const { return iterator{lookup(k).found}; }

    V * get(const K & k) const {
        node * n = lookup(k).found;
        return n ? &n->kv.second : nullptr;
    }

    // Insert (k, v) where k is known to be absent (`pr`: its failed lookup, or nullptr): what
    // std::unordered_map's emplace does after its bucket scan found nothing. Returns the
    // stored value.
    V * insert_new(const K & k, V && v, const probe * pr = nullptr) {
        node * n = new node(OrderHash()(k), k, std::move(v));
        try {
            link(n, pr && pr->hashed ? pr->index_hash : 0, pr && pr->hashed);
        } catch (...) {
            delete n;
            throw;
        }
        return &n->kv.second;
    }

    // std::unordered_map::clear: nodes freed, bucket array and rehash state kept (the order of
    // later insertions depends on them).
    void clear() noexcept {
        free_nodes();
        if (buckets_) std::memset(buckets_, 0, bucket_count_ * sizeof(node_base *));
        std::free(index_);
        index_ = nullptr;
        index_mask_ = 0;
    }

    // Back to the state of a new table, memory returned.
    void reset() noexcept {
        release();
        before_begin_.next = nullptr;
        buckets_ = nullptr;
        bucket_count_ = 1;
        count_ = 0;
        next_resize_ = 0;
        index_ = nullptr;
        index_mask_ = 0;
    }

  private:
    node_base before_begin_{nullptr};
    node_base ** buckets_ = nullptr;  // nullptr: the single empty bucket of a new table
    size_t bucket_count_ = 1;
    size_t count_ = 0;
    size_t next_resize_ = 0;          // _Prime_rehash_policy's state (max load factor 1.0)
    node ** index_ = nullptr;         // open addressing, linear probing; nullptr up to SMALL
    size_t index_mask_ = 0;

    static node * as_node(node_base * b) { return static_cast<node *>(b); }
    size_t bucket_of(const node_base * n) const {
        return static_cast<const node *>(n)->code % bucket_count_;
    }

    // libstdc++'s _M_find_node: the key's bucket, scanned. Only used up to SMALL entries.
    node * scan_bucket(const K & k) const {
        if (!buckets_) return nullptr;
        const size_t bkt = OrderHash()(k) % bucket_count_;
        const node_base * before = buckets_[bkt];
        if (!before) return nullptr;
        for (node_base * p = before->next; p && bucket_of(p) == bkt; p = p->next)
            if (as_node(p)->kv.first == k) return as_node(p);
        return nullptr;
    }

    static void index_put(node ** index, size_t mask, node * n, size_t h) {
        size_t i = h & mask;
        while (index[i]) i = (i + 1) & mask;
        index[i] = n;
    }

    static void index_put(node ** index, size_t mask, node * n) {
        index_put(index, mask, n, IndexHash()(n->kv.first));
    }

    // Make room in the index for count_ + 1 entries (load factor <= 1/2). Throws bad_alloc
    // with the table unchanged.
    void reserve_index() {
        const size_t need = count_ + 1;
        if (need <= SMALL) return;
        size_t cap = index_ ? index_mask_ + 1 : 4 * SMALL;
        if (index_ && 2 * need <= cap) return;
        while (2 * need > cap) cap *= 2;
        node ** fresh = static_cast<node **>(std::calloc(cap, sizeof(node *)));
        if (!fresh) throw std::bad_alloc();
        for (node_base * p = before_begin_.next; p; p = p->next) index_put(fresh, cap - 1, as_node(p));
        std::free(index_);
        index_ = fresh;
        index_mask_ = cap - 1;
    }

    // libstdc++'s _M_insert_unique_node: rehash if the policy says so, then put the node at the
    // front of its bucket.
    void link(node * n, size_t index_hash, bool hashed) {
        const bool had_index = index_ != nullptr;
        reserve_index();
        std::__detail::_Prime_rehash_policy policy;
        policy._M_reset(next_resize_);
        const std::pair<bool, size_t> r = policy._M_need_rehash(bucket_count_, count_, 1);
        if (r.first) rehash(r.second);     // may throw: next_resize_ is not yet updated then
        next_resize_ = policy._M_state();
        insert_bucket_begin(n->code % bucket_count_, n);
        if (index_) {
            if (had_index && hashed) index_put(index_, index_mask_, n, index_hash);
            else index_put(index_, index_mask_, n);
        }
        ++count_;
    }

    // libstdc++'s _M_insert_bucket_begin.
    void insert_bucket_begin(size_t bkt, node * n) {
        if (!buckets_) {                   // a new table's single bucket (never reached with
            buckets_ = static_cast<node_base **>(std::calloc(1, sizeof(node_base *)));
            if (!buckets_) throw std::bad_alloc();   // libstdc++'s policy, kept for safety)
        }
        if (buckets_[bkt]) {
            n->next = buckets_[bkt]->next;
            buckets_[bkt]->next = n;
        } else {
            n->next = before_begin_.next;
            before_begin_.next = n;
            if (n->next) buckets_[bucket_of(n->next)] = n;
            buckets_[bkt] = &before_begin_;
        }
    }

    // libstdc++'s _M_rehash_aux for unique keys.
    void rehash(size_t nb) {
        node_base ** fresh = static_cast<node_base **>(std::calloc(nb, sizeof(node_base *)));
        if (!fresh) throw std::bad_alloc();
        node_base * p = before_begin_.next;
        before_begin_.next = nullptr;
        size_t bbegin_bkt = 0;
        while (p) {
            node_base * next = p->next;
            const size_t bkt = as_node(p)->code % nb;
            if (!fresh[bkt]) {
                p->next = before_begin_.next;
                before_begin_.next = p;
                fresh[bkt] = &before_begin_;
                if (p->next) fresh[bbegin_bkt] = p;
                bbegin_bkt = bkt;
            } else {
                p->next = fresh[bkt]->next;
                fresh[bkt]->next = p;
            }
            p = next;
        }
        std::free(buckets_);
        buckets_ = fresh;
        bucket_count_ = nb;
    }

    // libstdc++'s _M_assign: the same bucket count, nodes copied in iteration order. Expects
    // bucket_count_ and next_resize_ set, nothing allocated.
    void assign_from(const ordered_table & o) {
        if (o.buckets_) {
            buckets_ = static_cast<node_base **>(std::calloc(bucket_count_, sizeof(node_base *)));
            if (!buckets_) throw std::bad_alloc();
        }
        node_base * prev = &before_begin_;
        for (node_base * p = o.before_begin_.next; p; p = p->next) {
            node * n = new node(as_node(p)->code, as_node(p)->kv);
            prev->next = n;
            ++count_;
            const size_t bkt = bucket_of(n);
            if (!buckets_[bkt]) buckets_[bkt] = prev;
            prev = n;
        }
        if (o.index_) {
            index_ = static_cast<node **>(std::calloc(o.index_mask_ + 1, sizeof(node *)));
            if (!index_) throw std::bad_alloc();
            index_mask_ = o.index_mask_;
            for (node_base * p = before_begin_.next; p; p = p->next)
                index_put(index_, index_mask_, as_node(p));
        }
    }

    void steal(ordered_table & o) noexcept {
        before_begin_.next = o.before_begin_.next;
        buckets_ = o.buckets_;
        bucket_count_ = o.bucket_count_;
        count_ = o.count_;
        next_resize_ = o.next_resize_;
        index_ = o.index_;
        index_mask_ = o.index_mask_;
        // the first node's bucket points at the before-begin node, which has moved
        if (before_begin_.next) buckets_[bucket_of(before_begin_.next)] = &before_begin_;
        o.before_begin_.next = nullptr;
        o.buckets_ = nullptr;
        o.bucket_count_ = 1;
        o.count_ = 0;
        o.next_resize_ = 0;
        o.index_ = nullptr;
        o.index_mask_ = 0;
    }

    void free_nodes() noexcept {
        node_base * p = before_begin_.next;
        while (p) {
            node_base * next = p->next;
            delete as_node(p);
            p = next;
        }
        before_begin_.next = nullptr;
        count_ = 0;
    }

    void release() noexcept {
        free_nodes();
        std::free(buckets_);
        std::free(index_);
        buckets_ = nullptr;
        index_ = nullptr;
    }
};

}  // namespace ngs
