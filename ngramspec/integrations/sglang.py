"""ngramspec's proposers inside SGLang (tested with sglang 0.5.23): the algorithm ``NGRAMSPEC``.

::

    NGRAMSPEC_SPEC="--spec-type ngram-suffix" python -m sglang.launch_server --model-path MODEL \\
        --speculative-algorithm NGRAMSPEC --speculative-num-draft-tokens 16

The ``sglang.srt.plugins`` entry point (`register`, installed with ngramspec) registers the
algorithm ``NGRAMSPEC``: SGLang's own NGRAM worker with its corpus replaced by
`NgramspecCorpus`. Everything else (verification, KV bookkeeping, overlap scheduling) is the
NGRAM worker's. The worker hands the corpus each request's id, its last tokens (ending with the
last verified token, the draft's root) and its full length; a request's id leaving the batch
ends it (``erase_match_state``).

Cost per step is O(new tokens) per request, whatever the context: the worker
(`worker_class`) asks the corpus how many of a request's last tokens it lacks
(`NgramspecCorpus.tokens_needed`: the accepted tokens and the root, or everything for a request
it has not seen) and copies only those, from ``req.output_ids`` and, under overlap scheduling,
from the previous round's accepted tokens in ``spec_info`` (not yet in ``output_ids``). The
whole sequence is copied once per request, at first sight (or when its tokens stop continuing
what the corpus knows: SGLang retracted and re-ran it), and its engine slot begins on it then
(``SpecEngine.begin``: linear in the prompt). SGLang's own worker copies a tail of
``max_trie_depth`` tokens twice per step instead, which with a whole-context depth is O(context).
At 64-256 requests of 32k tokens the requests' suffix automata outgrow the CPU's caches and a
step's cost is its cache misses: `NgramspecCorpus.batch_get` first reads ahead for all its rows
at once (`SuffixProposer.prefetch`, their misses overlapped), then drafts row by row.

SGLang verifies a tree of ``--speculative-num-draft-tokens`` tokens (the root included), paying
for all of them whatever they hold. Under the root goes the request's draft of up to
``draft_token_num - 1`` tokens; with ngram-suffix alone (``--spec-type ngram-suffix``) the rest of
the budget goes to its next-best branches (`SuffixProposer.draft_tree`: the chain is the first
path, so the tree accepts at least what the chain would). Other types keep chains, padded as
SGLang pads (token 0 hanging off the root). SGLang's greedy verification walks a node's children
in index order and accepts the one the target chose; the chain comes first, so its sampling
verification tries the chain first too.
"""
from __future__ import annotations

import logging
from itertools import accumulate, chain
from typing import Callable, List, Optional, Tuple

import numpy as np

from ngramspec._tree import lay_out_trees
from ngramspec.integrations.request_args import checked_args, control_of
from ngramspec.integrations.requests import MAX_DRAFT, RequestLoops, engine_from_env
from ngramspec.tokens import token_array
from ngramspec.validation import OutOfRange, Refused, check_int

__all__ = ["ALGORITHM", "TESTED_SGLANG", "NgramspecCorpus", "TreeBatch", "chain_tree",
           "register", "tree_buffers", "tree_layout", "worker_class"]

#: The SGLang version the contract tests run against.
TESTED_SGLANG = "0.5.23"

_log = logging.getLogger(__name__)

#: The name of the algorithm `register` adds (``--speculative-algorithm NGRAMSPEC``).
ALGORITHM = "NGRAMSPEC"

#: Requests followed at once by a corpus whose worker does not say how many run together.
DEFAULT_MAX_REQUESTS = 256


def tree_layout(root: int, tokens, parents, d: int) -> Tuple[np.ndarray, np.ndarray]:
    """SGLang's draft tree: ``root, tokens...`` and its ``d x d`` ancestor mask.

    Row i has ones at i and its ancestors (SGLang takes the last one before i as its parent);
    the padding (token 0) hangs off the root, as SGLang's own corpus pads.

    Parameters
    ----------
    root : int
        The last verified token (slot 0).
    tokens, parents : 1-D int arrays
        At most ``d - 1`` tokens; token i hangs off token ``parents[i]`` (< i), or off the root
        when -1.
    d : int
        ``draft_token_num``.

    Returns
    -------
    tokens : numpy.ndarray
        int64, ``d`` tokens.
    mask : numpy.ndarray
        bool, ``(d, d)``.
    """
    layout = TreeBatch(1, d)
    layout.set(0, root, tokens, parents)
    flat, mask = layout.finish()
    return flat, mask.reshape(d, d)


def chain_tree(root: int, draft, d: int) -> Tuple[np.ndarray, np.ndarray]:
    """`tree_layout` of a chain: ``root, draft...`` (at most ``d - 1`` tokens), each token
    under the one before."""
    return tree_layout(root, draft, np.arange(-1, len(draft) - 1), d)


class TreeBatch:
    """A step's draft trees, laid out for SGLang at once (`tree_layout` for every request).

    `roots`: every row's root, given at once (a step's are read in one numpy call); `set`
    gives one row's root with its tokens, `add` the tokens alone (copied into a row of the
    tree buffers), `place` a tree already written in a row of them (`SuffixProposer.draft_tree`
    writes straight there). `finish` writes all rows in one kernel call
    (`ngramspec._tree.lay_out_trees`: a node's mask row is its parent's plus itself, with the
    GIL released): no numpy call per request, which at 64-256 requests was a tenth of the step.

    Parameters
    ----------
    bs, d : int
        Rows, and ``draft_token_num``.
    roots : list of int, optional
    buffers : (tokens, parents), optional
        int32 ``(n_rows, d - 1)`` arrays holding the trees (a corpus keeps one row per engine
        slot across steps); default: ``bs`` rows of the batch's own.

    Thread-safety: not thread-safe; one step's scratch.
    """

    def __init__(self, bs: int, d: int, roots: Optional[List[int]] = None, buffers=None):
        self.d = d
        self.bs = bs
        self._roots = [0] * bs if roots is None else roots
        #: Whether the buffers are the caller's (rows are its, e.g. slots) or the batch's own.
        self.shared = buffers is not None
        if buffers is None:
            buffers = tree_buffers(bs, d)
        self._tok, self._par = buffers
        # lists until `finish` (an item set is a third of a numpy scalar write)
        self._rows = [0] * bs
        self._lens = [0] * bs
        self._chain = [0] * bs

    def set(self, i: int, root: int, tokens, parents=None) -> None:
        """Row i: `root`, then `tokens` (at most ``d - 1``) under `parents` (indices into
        `tokens`, -1 the root); None: a chain, each token under the one before."""
        self._roots[i] = root
        self.add(i, tokens, parents)

    def add(self, i: int, tokens, parents=None, row: Optional[int] = None) -> None:
        """Row i's `tokens` and `parents` under the root it was built with (`set`'s), copied
        into the buffers' `row` (default i)."""
        n = len(tokens)
        if n >= self.d:
            raise OutOfRange("len(tokens)", n, f"0 .. {self.d - 1} (the tree's size less the root)")
        row = i if row is None else row
        if n:
            self._tok[row, :n] = tokens
            if parents is not None:
                self._par[row, :n] = parents
        self.place(i, row, n, parents is None)

    def place(self, i: int, row: int, n: int, chain: bool = False) -> None:
        """Row i's tree: the first `n` nodes of the buffers' `row` (a chain: parents not read)."""
        self._rows[i] = row
        self._lens[i] = n
        self._chain[i] = chain

    def finish(self) -> Tuple[np.ndarray, np.ndarray]:
        """The flat ``bs * d`` tokens and ``bs * d * d`` mask entries."""
        roots = np.asarray(self._roots, dtype=np.int64)
        return lay_out_trees(roots, np.array(self._rows, dtype=np.intp),
                             np.array(self._lens, dtype=np.int32),
                             np.array(self._chain, dtype=np.uint8), self._tok, self._par, self.d)


def tree_buffers(n_rows: int, d: int) -> Tuple[np.ndarray, np.ndarray]:
    """Token and parent buffers for `n_rows` trees of at most ``d - 1`` nodes (`TreeBatch`)."""
    width = max(d - 1, 0)
    return (np.zeros((n_rows, width), dtype=np.int32),
            np.full((n_rows, width), -1, dtype=np.int32))


def batch_tails(batch_tokens) -> Tuple[np.ndarray, List[int]]:
    """Every request's tail as one int32 array and each tail's end offset in it: one
    conversion and one range check for the step, not one per request (a tenth of the step at
    64 requests). A bad tail raises that tail's own error (`token_array` naming
    ``batch_tokens[i]``; empty ones included)."""
    try:
        lens = list(map(len, batch_tokens))
        if 0 not in lens:
            flat = token_array(list(chain.from_iterable(batch_tokens)), "batch_tokens")
            return flat, list(accumulate(lens))
    except (TypeError, ValueError):
        pass
    # one tail at a time: the error names the bad one
    tails = [token_array(tail, f"batch_tokens[{i}]", non_empty=True)
             for i, tail in enumerate(batch_tokens)]
    flat = np.concatenate(tails) if tails else np.empty(0, dtype=np.int32)
    return flat, list(accumulate(map(len, tails)))


class NgramspecCorpus:
    """SGLang's ``NgramCorpus`` interface over an ngramspec `SpecEngine`.

    Parameters
    ----------
    draft_token_num : int
        SGLang's ``--speculative-num-draft-tokens``: the tree's size, root included.
    max_trie_depth : int
        SGLang's ``--speculative-ngram-max-trie-depth`` (unused: `register`'s worker passes
        what `tokens_needed` asks for; under SGLang's own worker a request first seen with
        fewer tokens than its full length begins on what it got).
    max_requests : int
        Requests followed at once (the engine's slots); past it, the one seen least recently
        is dropped.
    spec : str, optional
        llama-server flags instead of ``$NGRAMSPEC_SPEC``.
    tree : bool
        With ngram-suffix alone, fill the budget with its next-best branches (the default);
        False keeps its chains. Other types always draft chains.
    **ignored
        SGLang's other ``NgramCorpus`` keywords (``min_bfs_breadth``, ``capacity``, ...), so
        the worker builds either corpus the same way.

    Notes
    -----
    Memory: the engine's, plus a copy of each live request's tokens, and each slot's pending
    tree (``8 * (draft_token_num - 1)`` bytes a slot, `tree_buffers`); `batch_get` returns
    ``bs * d * (d + 8)`` bytes.

    Cost per step: per request its new tokens and one draft (`RequestLoops.advance`), plus the
    ``d x d`` tree layout; at first sight ``SpecEngine.begin`` on its whole sequence.

    Thread-safety: not thread-safe; SGLang calls it from its scheduler thread.
    """

    def __init__(self, draft_token_num: int = 8, max_trie_depth: int = 18,
                 max_requests: int = DEFAULT_MAX_REQUESTS, spec: Optional[str] = None,
                 tree: bool = True, **ignored):
        # a step's trees are max_requests * d * d mask bytes: bound d before anything is built
        self.draft_token_num = check_int("draft_token_num", draft_token_num, 1, MAX_DRAFT + 1)
        self.max_trie_depth = check_int("max_trie_depth", max_trie_depth, 1)
        self.max_requests = check_int("max_requests", max_requests, 1)
        self._spec = spec
        self._tree = bool(tree)
        self._build()

    def _build(self) -> None:
        self.engine, policy = engine_from_env(self.max_requests, self._spec)
        self.requests = RequestLoops(self.engine, self.max_requests,
                                     n_max=self.draft_token_num - 1, policy=policy)
        self._known = self.requests.requests    # the live requests by id (the table's dict)
        props = self.engine.proposers
        self.chain = tuple(self.engine.types)
        #: The proposer whose trees fill the budget (None: chains): a lone proposer that
        #: drafts trees (ngram-suffix's ``draft_tree``).
        self.tree_proposer = (props[0] if self._tree and len(props) == 1
                              and hasattr(props[0], "draft_tree") else None)
        #: Proposers that read ahead for a whole step (`SuffixProposer.prefetch`).
        self._prefetchers = [p for p in props if hasattr(p, "prefetch")]
        #: Each engine slot's pending tree (row = slot), `draft_tree` writing straight in;
        #: a request's `Request.tree` views its slot's row.
        self._trees = tree_buffers(self.max_requests, self.draft_token_num)
        #: Per slot, its row's first m nodes as ``(tokens, parents)`` views, made on first use
        #: of each m and kept (two numpy slices a row and step less; at most d views a slot).
        self._tree_views = [[None] * self.draft_token_num for _ in range(self.max_requests)]

    def tokens_needed(self, req_id, total_len: int) -> int:
        """How many of request `req_id`'s last tokens the next `batch_get` needs, when its full
        length is `total_len`: the tokens it has not seen (at least the root), or `total_len`
        for a request it does not follow (first sight)."""
        req = self._known.get(req_id)
        if req is None:
            return total_len
        g = total_len - req.n
        return max(g, 1) if 0 <= g <= self.draft_token_num else total_len

    def batch_get(self, req_ids: List[str], batch_tokens: List[List[int]],
                  total_lens: List[int], full_tokens: Optional[Callable] = None,
                  args_of: Optional[Callable] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Each request's draft tree, flat: ``bs * d`` tokens and ``bs * d * d`` mask entries.

        Parameters
        ----------
        req_ids : list of str
        batch_tokens : list of list of int
            Per request, its last tokens, ending with the last verified one (the root): at
            least `tokens_needed` of them.
        total_lens : list of int
            Per request, its full length (prompt + output).
        full_tokens : callable, optional
            ``full_tokens(i)``: request i's whole sequence, asked for when its tail does not
            continue what the corpus knows of it and is shorter than its full length (the
            request lost track: SGLang re-ran it). Without it (SGLang's own call) the request
            begins on the tail it got.
        args_of : callable, optional
            ``args_of(i)``: request i's ``custom_params`` (or None), asked for when it begins:
            its ``prediction`` and ``speculative`` fields
            (`ngramspec.integrations.request_args`). A request with a prediction, a subset of
            the chain or its own ``n_max`` drafts a chain (its prediction first); with
            ``enabled: false``, a tree of padding only.

        Raises
        ------
        ValueError
            The three lists of different lengths, an empty token list, an id outside 0 ..
            2**31-1 (naming ``batch_tokens[i][pos]``), a full length below the tail's.
        TypeError
            A token that is not an integer.
        """
        rl = self.requests
        bs = len(req_ids)
        if len(batch_tokens) != bs or len(total_lens) != bs:
            raise Refused("batch_tokens", f"{len(batch_tokens)} token lists and "
                          f"{len(total_lens)} total_lens for {bs} req_ids: one each")
        rl.step += 1
        flat, ends = batch_tails(batch_tokens)
        # every root at once, as Python ints: no numpy scalar per row
        roots = flat[np.asarray(ends, dtype=np.intp) - 1].tolist() if bs else []
        # trees stay in their slots' rows unless a slot could change hands within the step
        # (more rows than slots, an id twice): then each row is copied into the batch's own
        shared = bs <= self.max_requests and len(set(req_ids)) == bs
        layout = TreeBatch(bs, self.draft_token_num, roots, self._trees if shared else None)
        # every row's request looked up once (None: not followed)
        reqs = list(map(self._known.get, req_ids))
        if self._prefetchers and bs:
            self._prefetch(reqs, flat, ends, total_lens)
        start = 0
        for i, req in enumerate(reqs):
            end = ends[i]
            total = total_lens[i]
            if type(total) is not int or total < end - start:
                total = check_int(f"total_lens[{i}]", total, end - start)
            g = -1 if req is None else total - req.n
            if g == 1:                  # the common step: the target's token alone
                new = roots[i:i + 1]
            elif not (0 <= g <= end - start and req.continues(new := flat[end - g:end])):
                req, new = self._begin_row(req_ids[i], flat[start:end], total, full_tokens,
                                           args_of, i)
            start = end
            self._draft_row(layout, i, req, new)
        return layout.finish()

    def _prefetch(self, reqs, flat, ends, total_lens) -> None:
        """Read ahead, for every known request at once, what its draft will read (its
        automaton outgrows the caches at long contexts, and the rows' misses overlap only when
        read together: `SuffixProposer.prefetch`), with the first token it has not indexed.
        Rows that will begin anew (`reqs`: each row's request, None where not followed), or
        whose lengths are bad (`batch_get` raises for them), are left out."""
        slots, at = [], []
        start = 0
        for req, end, total in zip(reqs, ends, total_lens):
            if req is not None and type(total) is int and 0 < total - req.n <= end - start:
                slots.append(req.loop.slot)
                at.append(end - total + req.n)
            start = end
        if slots:
            first = flat[at]                      # one gather: an int32 array
            for p in self._prefetchers:
                p.prefetch(slots, first)

    def _begin_row(self, rid, tail, total: int, full_tokens, args_of, i: int):
        """Request `rid` begun anew, with no new tokens: first sight, or tokens that do not
        continue what the corpus knows (its whole sequence asked for when `tail` is shorter,
        its ``custom_params`` read then, once)."""
        rl = self.requests
        if len(tail) < total and full_tokens is not None:
            tail = token_array(full_tokens(i), f"batch_tokens[{i}]", non_empty=True)
        control = None if args_of is None else control_of(
            args_of(i), self.chain, auto=rl.auto, key=rid)
        return rl.begin(rid, tail[:-1], int(tail[-1]), control), tail[:0]

    def _draft_row(self, layout: TreeBatch, i: int, req, new) -> None:
        """Request `req` verifies its pending draft against `new` and drafts; its tree (or
        chain) goes to `layout`'s row i. A tree is rebuilt only after a new draft call, and
        only for a request drafting with the whole configured engine (its prediction or
        proposer subset drafts chains)."""
        loop = req.loop
        counts = loop.counts
        calls = counts.n_draft_calls
        draft = self.requests.advance(req, new)
        tp = self.tree_proposer
        slot = loop.slot
        if tp is not None and req.plain and counts.n_draft_calls != calls:
            width = self.draft_token_num - 1
            m = tp.draft_tree(slot, len(draft), width, self._trees, slot * width)
            views = self._tree_views[slot]
            req.tree = views[m] or self._tree_view(views, slot, m)
        tree = req.tree
        if tree is None:                # a chain: copied into the row the layout reads
            layout.add(i, draft, row=slot if layout.shared else i)
        elif layout.shared:             # the common row: its tree is in its slot's row already
            layout.place(i, slot, len(tree[0]))
        else:
            layout.add(i, tree[0], tree[1])

    def _tree_view(self, views, slot: int, m: int):
        """Slot `slot`'s first `m` tree nodes as views, kept in `views` (its list)."""
        views[m] = (self._trees[0][slot, :m], self._trees[1][slot, :m])
        return views[m]

    def batch_put(self, batch_tokens) -> None:
        """Nothing: the requests' loops learn from `batch_get`'s growing tokens."""

    def synchronize(self) -> None:
        """Nothing: inserts are not deferred."""

    def erase_match_state(self, req_ids) -> None:
        """End these requests (they left the batch)."""
        for rid in req_ids:
            self.requests.end(rid)

    def reset(self) -> None:
        """Forget everything, cross-request state included (SGLang's cache flush)."""
        self.requests.clear()
        self._build()


# -- the plug-in -------------------------------------------------------------------------------

def stage_accepted_tokens(worker, batch):
    """The previous round's accepted tokens and counts under overlap scheduling (not yet in
    ``req.output_ids``), staged on the worker as SGLang's NGRAM worker stages them
    (``prev_token_ids``, ``prev_accept_lens``); ``([], [0] * bs)`` otherwise. As SGLang's
    ``_prepare_draft_tokens``: sync mode and grammar batches have every token in ``output_ids``
    already."""
    bs = len(batch.reqs)
    if worker.enable_overlap and not batch.grammar_needs_sync():
        ids, lens = batch.spec_info.accept_tokens, batch.spec_info.accept_lens
        if not ids.is_cpu:
            ids, lens = ids.cpu(), lens.cpu()
        worker.prev_token_ids, worker.prev_accept_lens = ids.tolist(), lens.tolist()
        if len(worker.prev_accept_lens) != bs:
            raise RuntimeError(f"spec_info holds {len(worker.prev_accept_lens)} requests' "
                               f"accepted tokens for a batch of {bs}")
    else:
        worker.prev_token_ids, worker.prev_accept_lens = [], [0] * bs
    return worker.prev_token_ids, worker.prev_accept_lens


def last_tokens(req, extra, m: int):
    """The last `m` tokens of an SGLang request's ``origin_input_ids_unpadded + output_ids +
    extra``, copying only those `m` (O(m), whatever the request's length): a list, or a slice
    of ``output_ids`` when they hold all `m` (sync scheduling's common step)."""
    if not extra:
        ids = req.output_ids
        if m <= len(ids):
            return ids[len(ids) - m:]
    out = list(extra[len(extra) - m:]) if m < len(extra) else list(extra)
    m -= len(out)
    if m > 0:
        ids = req.output_ids
        out[:0] = ids[max(len(ids) - m, 0):]
        m -= min(m, len(ids))
    if m > 0:
        ids = req.origin_input_ids_unpadded
        out[:0] = ids[max(len(ids) - m, 0):]
    return out


def worker_class():
    """SGLang's ``NGRAMWorker`` with `NgramspecCorpus` (the class is built on first use)."""
    global _WORKER
    if _WORKER is not None:
        return _WORKER
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class NgramspecWorker(NGRAMWorker):
        """SGLang's NGRAM worker drafting with `NgramspecCorpus`, O(new tokens) per step (the
        module docstring)."""

        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            spec = get_spec()
            self.ngram_corpus = NgramspecCorpus(
                draft_token_num=spec.speculative_num_draft_tokens,
                max_trie_depth=spec.speculative_ngram_max_trie_depth,
                max_requests=max(1, int(getattr(target_worker.model_runner,
                                                "max_running_requests", 0) or
                                        DEFAULT_MAX_REQUESTS)))

        def _prepare_draft_tokens(self, batch):
            """SGLang's: each request's draft tree from the corpus, given only its new tokens."""
            prev, prev_lens = stage_accepted_tokens(self, batch)
            corpus = self.ngram_corpus
            corpus.synchronize()
            stride = self.draft_token_num
            reqs = batch.reqs
            req_ids, tails, totals = [], [], []
            for i, req in enumerate(reqs):
                extra = prev[i * stride:i * stride + prev_lens[i]] if prev else ()
                total = len(req.origin_input_ids_unpadded) + len(req.output_ids) + len(extra)
                req_ids.append(req.rid)
                tails.append(last_tokens(req, extra, corpus.tokens_needed(req.rid, total)))
                totals.append(total)

            def full_tokens(i):
                extra = prev[i * stride:i * stride + prev_lens[i]] if prev else ()
                return last_tokens(reqs[i], extra, totals[i])
            def args_of(i):
                return getattr(getattr(reqs[i], "sampling_params", None), "custom_params",
                               None)
            drafts, mask = corpus.batch_get(req_ids, tails, totals, full_tokens, args_of)
            assert len(drafts) == len(reqs) * stride, (len(drafts), len(reqs), stride)
            return drafts, mask

        def _update_ngram_corpus(self, batch):
            """Nothing: the corpus learns a request's accepted tokens from the next
            `_prepare_draft_tokens` (they are its new tokens there); SGLang's would copy each
            request's last ``max_trie_depth`` tokens."""

    _WORKER = NgramspecWorker
    return _WORKER


_WORKER = None


def register() -> None:
    """``sglang.srt.plugins`` entry point: register the speculative algorithm ``NGRAMSPEC``.

    Its worker is `worker_class` (SGLang's NGRAM worker with `NgramspecCorpus`); it is an
    n-gram algorithm to the rest of SGLang (server-argument handling, KV sizing), with overlap
    scheduling. Registering twice is a no-op. On another SGLang version it registers too (the
    corpus interface is small) and logs that the version is untested.
    """
    import sglang
    from sglang.srt.speculative import spec_registry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    _hook_front_end()
    if ALGORITHM in spec_registry._REGISTRY:
        return
    version = getattr(sglang, "__version__", "unknown")
    if version != TESTED_SGLANG:
        _log.warning("ngramspec: SGLang %s is not the tested %s; %s may not work",
                     version, TESTED_SGLANG, ALGORITHM)

    class NgramspecAlgorithm(spec_registry.CustomSpecAlgo):
        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def handle_server_args(self, server_args) -> None:
            SpeculativeAlgorithm.NGRAM.handle_server_args(server_args)

    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                  spec_class=NgramspecAlgorithm)(lambda server_args:
                                                                 worker_class())


def _hook_front_end() -> None:
    """The tokenizer manager's half of `register`: a request's ``custom_params`` fields
    (``prediction``, ``speculative``) checked where SGLang checks its sampling parameters,
    a text prediction tokenized with the model's tokenizer there (``SamplingParams.normalize``)
    and its ids checked against the vocabulary (``SamplingParams.verify``); a bad value raises
    a `ParamError` (a ValueError or TypeError: SGLang's 400) naming the field
    (`ngramspec.integrations.request_args`). Hooked once."""
    from sglang.srt.sampling.sampling_params import SamplingParams
    normalize, verify = SamplingParams.normalize, SamplingParams.verify
    if getattr(normalize, "_ngramspec_hook", False):
        return

    def checked_normalize(self, tokenizer, *args, **kwargs):
        normalize(self, tokenizer, *args, **kwargs)
        tokenize = None if tokenizer is None else (
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.custom_params = checked_args(self.custom_params, tokenize=tokenize)

    def checked_verify(self, vocab_size, *args, **kwargs):
        verify(self, vocab_size, *args, **kwargs)
        self.custom_params = checked_args(self.custom_params, n_vocab=vocab_size)

    for name, hook, original in (("normalize", checked_normalize, normalize),
                                 ("verify", checked_verify, verify)):
        hook._ngramspec_hook = True
        hook.__wrapped__ = original
        setattr(SamplingParams, name, hook)
