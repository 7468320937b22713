# Included by _suffix.pyx (one C module: the kernels stay inlinable and share its DEF
# constants and imports); the shared calibration: cells, Q16 probabilities, folding and merging.

# The server's calibration is written under its lock and read by drafts without it: relaxed
# atomic loads and stores (a plain mov on x86 and ARM), so that a read racing with a fold is
# defined and sees a whole word, old or new.
cdef extern from *:
    """
    #include <stdint.h>
    #if defined(__GNUC__) || defined(__clang__)
    static inline uint32_t ngs_ld32(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void ngs_st32(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    static inline int64_t ngs_ld64(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void ngs_st64(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    #else
    static inline uint32_t ngs_ld32(const uint32_t* p) { return *(const volatile uint32_t*)p; }
    static inline void ngs_st32(uint32_t* p, uint32_t v) { *(volatile uint32_t*)p = v; }
    static inline int64_t ngs_ld64(const int64_t* p) { return *(const volatile int64_t*)p; }
    static inline void ngs_st64(int64_t* p, int64_t v) { *(volatile int64_t*)p = v; }
    #endif
    """
    uint32_t ld32 "ngs_ld32"(const uint32_t* p) noexcept nogil
    void st32 "ngs_st32"(uint32_t* p, uint32_t v) noexcept nogil
    int64_t ld64 "ngs_ld64"(const int64_t* p) noexcept nogil
    void st64 "ngs_st64"(int64_t* p, int64_t v) noexcept nogil


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------

cdef inline int length_bucket(int32_t l) noexcept nogil:
    # floor(log2(l)): <= 1 | 2-3 | 4-7 | ... | 256-511 | >= 512
    cdef int b = 0
    while l > 1 and b < N_LB - 1:
        l >>= 1
        b += 1
    return b


cdef inline int freq_bucket(int32_t a, int32_t n) noexcept nogil:
    # a = occurrences of the chosen continuation, n = occurrences of the context that went on
    if n == 1:
        return 0                      # seen once
    if a == n:
        return 1 if n < 4 else 2      # unanimous, 2-3 or >= 4 times
    if 4 * <int64_t>a >= 3 * <int64_t>n:
        return 3                      # >= 3/4
    if 2 * <int64_t>a >= n:
        return 4                      # >= 1/2
    return 5                          # (6 = N_FB - 1: copied past the end of the text)


cdef inline int stage_of(int32_t j, bint streak) noexcept nogil:
    # first token: after a miss | after a call that foresaw every token; then j = 1 | 2-3 |
    # 4-7 | >= 8 (a draft that survived j tokens is more likely to survive one more)
    if j == 0:
        return 1 if streak else 0
    if j == 1:
        return 2
    if j < 4:
        return 3
    if j < 8:
        return 4
    return 5


cdef inline int cell_index(int src, int32_t l, int fb, int stage, bint agree) noexcept nogil:
    return ((((src * N_LB + length_bucket(l)) * N_FB + fb) * N_ST + stage) * N_AG
            + (1 if agree else 0))


cdef inline int coarse_index(int cell) noexcept nogil:
    cdef int st = (cell // N_AG) % N_ST
    cdef int src_lb = cell // (N_AG * N_ST * N_FB)
    return N_CELLS + src_lb * N_ST + st


cdef inline uint32_t cal_prob(const uint32_t* acc, const uint32_t* tried, int cell) noexcept nogil:
    """Q16 probability that a prediction of this cell comes true: the cell's record shrunk
    towards its coarse cell's (worth CAL_PRIOR observations), itself shrunk towards 1/2
    (worth 2). Sparse cells borrow strength; busy ones speak for themselves."""
    cdef int c = coarse_index(cell)
    cdef uint32_t ac = ld32(&acc[c]), tc = ld32(&tried[c])
    cdef uint32_t af = ld32(&acc[cell]), tf = ld32(&tried[cell])
    cdef uint64_t qc
    # a read racing with a fold may pair an old count with a new one: never above 1
    if ac > tc:
        ac = tc
    if af > tf:
        af = tf
    qc = ((<uint64_t>ac << 16) + ONE) // (tc + 2)
    return <uint32_t>(((<uint64_t>af << 16) + CAL_PRIOR * qc) // (tf + CAL_PRIOR))


cdef inline void cal_count(uint32_t* acc, uint32_t* tried, int cell, bint hit) noexcept nogil:
    # the only writer (under the calibration's lock); drafts read concurrently (cal_prob)
    cdef uint32_t t = tried[cell] + 1, a = acc[cell] + (1 if hit else 0)
    if t >= CAL_WINDOW:
        t >>= 1
        a >>= 1
    st32(&acc[cell], a)
    st32(&tried[cell], t)


cdef inline void cal_observe(uint32_t* acc, uint32_t* tried, int cell, bint hit) noexcept nogil:
    cal_count(acc, tried, cell, hit)
    cal_count(acc, tried, coarse_index(cell), hit)


cdef struct Calib:
    # What the proposer has learned about its drafts, shared by all slots (the server's): the
    # cells, then the tokens-per-step average. Written only under the calibration lock by
    # cal_fold, read by drafts without it (ld32 / ld64).
    uint32_t acc[N_CAL]     # fine cells, then coarse cells
    uint32_t tried[N_CAL]
    int64_t rate            # tokens per step, slow moving average, Q16
    int64_t n_folded        # outcomes folded in
    int64_t n_dropped       # outcomes a slot could not keep while the lock was busy
    # outcomes this proposer's slots folded in since the last take_calibration, per cell
    # (fine and coarse): what the store log hands to other replicas (saturating)
    uint32_t out_acc[N_CAL]
    uint32_t out_tried[N_CAL]
    int64_t out_steps       # steps folded into the rate since then, and their tokens
    int64_t out_tokens
    int64_t n_merged        # outcomes merged in from other replicas (fold_calibration)


# A slot's pending outcome: (cell << 1) | hit, or RATE_TAG | tokens of one step.
cdef extern from *:
    """
    #define NGS_RATE_TAG 0x80000000u
    """
    const uint32_t RATE_TAG "NGS_RATE_TAG"


cdef void cal_fold(Calib* C, const uint32_t* pend, int32_t n) noexcept nogil:
    """Fold a slot's pending outcomes into the server's calibration, in the order they came
    (caller holds the calibration lock). With one thread every outcome is folded by the call
    that observed it, so the table is what one table learning from every slot would be."""
    cdef int32_t i
    cdef uint32_t e
    cdef int64_t r
    for i in range(n):
        e = pend[i]
        if e & RATE_TAG:
            r = C.rate
            st64(&C.rate, r + (((<int64_t>(e & 0x7FFFFFFF) << 16) - r) >> RATE_SHIFT))
            C.out_steps += 1
            C.out_tokens += e & 0x7FFFFFFF
        else:
            cal_observe(C.acc, C.tried, <int>(e >> 1), e & 1)
            cal_export(C, <int>(e >> 1), e & 1)
            cal_export(C, coarse_index(<int>(e >> 1)), e & 1)
            C.n_folded += 1


cdef inline void cal_export(Calib* C, int cell, bint hit) noexcept nogil:
    # counted for take_calibration (caller holds the lock); saturates at DELTA_MAX, where the
    # cell's record is many forgetting horizons long anyway
    if C.out_tried[cell] < DELTA_MAX:
        C.out_tried[cell] += 1
        C.out_acc[cell] += 1 if hit else 0


cdef void rate_merge(Calib* C, int64_t steps, int64_t tokens) noexcept nogil:
    """Fold another replica's `steps` steps of `tokens` tokens in all into the tokens-per-step
    average, as if they had come one by one, each of the mean: r -> m + (r - m) * w**steps,
    w = 1 - 2**-RATE_SHIFT the weight a step leaves the past (in Q32 fixed point, by
    squaring: the same bits on every CPU). Approximates the order of the steps' sizes."""
    cdef uint64_t w = (<uint64_t>1 << 32) - (<uint64_t>1 << (32 - RATE_SHIFT))
    cdef uint64_t keep = <uint64_t>1 << 32
    cdef int64_t k = steps, m, r
    if steps <= 0:
        return
    while k > 0 and keep > 0:
        if k & 1:
            keep = (keep * w) >> 32
        w = (w * w) >> 32
        k >>= 1
    m = (tokens << 16) // steps
    r = C.rate
    st64(&C.rate, m + (((r - m) * <int64_t>keep) >> 32))


cdef void cal_merge(uint32_t* acc, uint32_t* tried, int cell, uint32_t dt, uint32_t da) noexcept nogil:
    """Fold another replica's dt outcomes of one cell, da of them hits, as if they had come
    one by one: the tried count follows exactly the path cal_count gives it (+1 each, halved
    at CAL_WINDOW), and the hits are spread evenly over the dt outcomes (the one thing a count
    delta does not say). Past MERGE_CYCLES halvings the older outcomes have been shifted out
    of the counts, so only the last MERGE_CYCLES windows' worth is replayed, from half a
    window at the delta's hit rate (O(1) per cell; when the outcomes all agree, exact, or within
    one hit past MERGE_CYCLES windows, where the old counts leave a rounding trace)."""
    cdef uint32_t t = tried[cell], a = acc[cell], step, share, drop
    cdef uint64_t cycles
    if a > t:
        a = t
    while dt > 0:
        if t >= CAL_WINDOW:
            t >>= 1
            a >>= 1
        if t == CAL_WINDOW // 2 and dt > MERGE_CYCLES * (CAL_WINDOW // 2):
            # what the cell held is shifted out by the MERGE_CYCLES halvings still to come:
            # start them from half a window at the delta's hit rate
            a = <uint32_t>((<uint64_t>da * (CAL_WINDOW // 2)) // dt)
            cycles = dt // (CAL_WINDOW // 2) - MERGE_CYCLES
            drop = <uint32_t>(cycles * (CAL_WINDOW // 2))
            share = <uint32_t>((<uint64_t>da * drop) // dt)
            dt -= drop
            da -= share
        step = CAL_WINDOW - t
        if step > dt:
            step = dt
        share = da if step == dt else <uint32_t>((<uint64_t>da * step) // dt)
        t += step
        a += share
        dt -= step
        da -= share
    if t >= CAL_WINDOW:
        t >>= 1
        a >>= 1
    st32(&acc[cell], a)
    st32(&tried[cell], t)
