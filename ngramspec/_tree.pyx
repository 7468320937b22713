"""A step's draft trees laid out for SGLang in one call: ``bs * d`` tokens and ``bs * d * d``
ancestor-mask entries.

Row r of the batch is ``root, tokens...`` padded with token 0 to ``d``; node j's mask row is
its parent's row plus itself (parents come before children, so one pass in index order), and the
padding hangs off the root, as SGLang's own corpus pads. The trees themselves live in a 2-D
int32 buffer (one row per tree, at most ``d - 1`` nodes): `SuffixProposer.draft_tree` writes a
request's straight into its row, so the step allocates nothing per request.

Thread-safety: the kernel reads its inputs and writes only the arrays it returns, with the GIL
released over the rows; callers own the buffers.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy

from ngramspec.validation import OutOfRange

cnp.import_array()


cdef Py_ssize_t lay_out(const int64_t* roots, const Py_ssize_t* rows, const int32_t* lens,
                        const uint8_t* chain, const int32_t* tok, const int32_t* par,
                        Py_ssize_t width, Py_ssize_t bs, Py_ssize_t d, int64_t* out,
                        uint8_t* mask) noexcept nogil:
    """Fill `out` (``bs * d``, zeroed) and `mask` (``bs * d * d``, zeroed). Returns -1, or the
    first batch row whose parents are not each below their node (nothing written past it)."""
    cdef Py_ssize_t r, j, n, p
    cdef const int32_t* t
    cdef const int32_t* pa
    cdef int64_t* o
    cdef uint8_t* m
    for r in range(bs):
        o = out + r * d
        m = mask + r * d * d
        o[0] = roots[r]
        m[0] = 1
        n = lens[r]
        if n:
            t = tok + rows[r] * width
            pa = par + rows[r] * width
        for j in range(1, n + 1):
            o[j] = t[j - 1]
            p = j - 1 if chain[r] else pa[j - 1] + 1     # the parent's slot, 0 the root
            if p < 0 or p >= j:
                return r
            memcpy(m + j * d, m + p * d, j)                # its ancestors: the parent's row
            m[j * d + j] = 1
        for j in range(n + 1, d):                          # padding: under the root
            m[j * d] = 1
            m[j * d + j] = 1
    return -1


def lay_out_trees(const int64_t[::1] roots, const Py_ssize_t[::1] rows,
                  const int32_t[::1] lens, const uint8_t[::1] chain,
                  const int32_t[:, ::1] tokens, const int32_t[:, ::1] parents, Py_ssize_t d):
    """SGLang's flat draft trees of a step, one row per request.

    Parameters
    ----------
    roots : int64, ``bs``
        Each row's root (the last verified token).
    rows : intp, ``bs``
        The row of `tokens` / `parents` holding batch row r's tree (ignored where ``lens[r]``
        is 0).
    lens : int32, ``bs``
        Nodes of batch row r's tree, 0 .. ``d - 1``.
    chain : uint8, ``bs``
        Nonzero: row r is a chain (node i under node i - 1; `parents` not read).
    tokens, parents : int32, ``(n_rows, >= d - 1)``
        Node i of a tree hangs off node ``parents[i]`` (< i), or off the root when -1.
    d : int
        ``draft_token_num``: the tree's size, root included.

    Returns
    -------
    tokens : numpy.ndarray
        int64, ``bs * d``.
    mask : numpy.ndarray
        bool, ``bs * d * d``: row-major ``(bs, d, d)``, node j's row its ancestors and itself.

    Raises
    ------
    ValueError
        Arrays of different lengths, a row or length out of range, a parent not below its node
        (naming the batch row).
    """
    cdef Py_ssize_t bs = roots.shape[0], r, width = tokens.shape[1], n_rows = tokens.shape[0]
    cdef Py_ssize_t bad
    if d < 1:
        raise OutOfRange("d", d, "1 ..")
    if rows.shape[0] != bs or lens.shape[0] != bs or chain.shape[0] != bs:
        raise ValueError(f"roots, rows, lens and chain hold {bs}, {rows.shape[0]}, "
                         f"{lens.shape[0]} and {chain.shape[0]} rows: one each")
    if parents.shape[0] != n_rows or parents.shape[1] != width:
        raise ValueError(f"tokens {tokens.shape[0]} x {width} and parents {parents.shape[0]} x "
                         f"{parents.shape[1]}: the same shape")
    for r in range(bs):
        if lens[r] < 0 or lens[r] > d - 1 or lens[r] > width:
            raise OutOfRange(f"lens[{r}]", lens[r], f"0 .. {min(d - 1, width)}")
        if lens[r] and not 0 <= rows[r] < n_rows:
            raise OutOfRange(f"rows[{r}]", rows[r], f"0 .. {n_rows - 1}")
    out = np.zeros(bs * d, dtype=np.int64)
    mask = np.zeros(bs * d * d, dtype=np.bool_)
    cdef int64_t* op = <int64_t*>cnp.PyArray_DATA(out)
    cdef uint8_t* mp = <uint8_t*>cnp.PyArray_DATA(mask)
    # an empty tokens buffer has no data pointer to take: no row reads it then (lens are 0)
    cdef const int32_t* tp = &tokens[0, 0] if n_rows and width else NULL
    cdef const int32_t* pp = &parents[0, 0] if n_rows and width else NULL
    if bs == 0:
        return out, mask
    with nogil:
        bad = lay_out(&roots[0], &rows[0], &lens[0], &chain[0], tp, pp, width, bs, d, op, mp)
    if bad >= 0:
        raise ValueError(f"row {bad}: each node's parent must come before it (-1: the root)")
    return out, mask
