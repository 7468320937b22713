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
from typing import List, Optional, Tuple

import numpy as np

from ngramspec.integrations.requests import RequestLoops, engine_from_env
from ngramspec.validation import check_int

__all__ = ["ALGORITHM", "TESTED_SGLANG", "NgramspecCorpus", "chain_tree", "register",
           "tree_layout", "worker_class"]

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
    n = len(tokens)
    flat = np.zeros(d, dtype=np.int64)
    flat[0] = root
    flat[1:n + 1] = tokens
    mask = np.zeros((d, d), dtype=bool)
    mask[:, 0] = True
    mask[np.arange(d), np.arange(d)] = True
    for i in range(n):
        p = int(parents[i])
        if p >= 0:
            mask[i + 1, 1:] |= mask[p + 1, 1:]
    return flat, mask


def chain_tree(root: int, draft, d: int) -> Tuple[np.ndarray, np.ndarray]:
    """`tree_layout` of a chain: ``root, draft...`` (at most ``d - 1`` tokens), each token
    under the one before."""
    return tree_layout(root, draft, np.arange(-1, len(draft) - 1), d)


class NgramspecCorpus:
    """SGLang's ``NgramCorpus`` interface over an ngramspec `SpecEngine`.

    Parameters
    ----------
    draft_token_num : int
        SGLang's ``--speculative-num-draft-tokens``: the tree's size, root included.
    max_trie_depth : int
        How many of a request's last tokens the worker passes (all of them with `register`'s
        worker); a request first seen with fewer than its full length begins on what it got.
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
    Memory: the engine's, plus a copy of each live request's tokens and its pending tree
    (at most ``draft_token_num`` tokens).

    Thread-safety: not thread-safe; SGLang calls it from its scheduler thread.
    """

    def __init__(self, draft_token_num: int = 8, max_trie_depth: int = 18,
                 max_requests: int = DEFAULT_MAX_REQUESTS, spec: Optional[str] = None,
                 tree: bool = True, **ignored):
        self.draft_token_num = check_int("draft_token_num", draft_token_num, 1)
        self.max_trie_depth = check_int("max_trie_depth", max_trie_depth, 1)
        self.max_requests = check_int("max_requests", max_requests, 1)
        self._spec = spec
        self._tree = bool(tree)
        self._build()

    def _build(self) -> None:
        self.engine, policy = engine_from_env(self.max_requests, self._spec)
        self.requests = RequestLoops(self.engine, self.max_requests,
                                     n_max=self.draft_token_num - 1, policy=policy)
        props = self.engine.proposers
        #: The proposer whose trees fill the budget (None: chains): a lone proposer that
        #: drafts trees (ngram-suffix's ``draft_tree``).
        self.tree_proposer = (props[0] if self._tree and len(props) == 1
                              and hasattr(props[0], "draft_tree") else None)

    def batch_get(self, req_ids: List[str], batch_tokens: List[List[int]],
                  total_lens: List[int]) -> Tuple[np.ndarray, np.ndarray]:
        """Each request's draft tree, flat: ``bs * d`` tokens and ``bs * d * d`` mask entries.

        Parameters
        ----------
        req_ids : list of str
        batch_tokens : list of list of int
            Per request, its last tokens, ending with the last verified one (the root).
        total_lens : list of int
            Per request, its full length (prompt + output).
        """
        d = self.draft_token_num
        rl = self.requests
        rl.step += 1
        bs = len(req_ids)
        tokens = np.zeros((bs, d), dtype=np.int64)
        masks = np.zeros((bs, d, d), dtype=bool)
        for i, rid in enumerate(req_ids):
            tail = np.asarray(batch_tokens[i], dtype=np.int32)
            if len(tail) == 0:
                raise ValueError(f"batch_tokens[{i}] is empty: the root token is missing")
            total = int(total_lens[i])
            req = rl.get(rid)
            new = None
            if req is not None:
                g = total - req.n
                if 0 <= g <= len(tail):
                    new = tail[len(tail) - g:]
                    if not req.continues(new):
                        new = None
            if new is None:
                req = rl.begin(rid, tail[:-1], int(tail[-1]))
                new = tail[:0]
            calls = req.loop.n_draft_calls
            draft = rl.advance(req, new)
            if self.tree_proposer is not None and req.loop.n_draft_calls != calls:
                req.tree = self.tree_proposer.draft_tree(req.loop.slot, len(draft), d - 1)
            if req.tree is not None:
                tokens[i], masks[i] = tree_layout(int(tail[-1]), *req.tree, d)
            else:
                tokens[i], masks[i] = chain_tree(int(tail[-1]), draft, d)
        return tokens.reshape(-1), masks.reshape(-1)

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

def _context_len(target_worker) -> int:
    runner = getattr(target_worker, "model_runner", None)
    config = getattr(runner, "model_config", None)
    return int(getattr(config, "context_len", 0) or 1 << 30)


def worker_class():
    """SGLang's ``NGRAMWorker`` with `NgramspecCorpus` (the class is built on first use)."""
    global _WORKER
    if _WORKER is not None:
        return _WORKER
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    class NgramspecWorker(NGRAMWorker):
        """SGLang's NGRAM worker drafting with `NgramspecCorpus`."""

        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            spec = get_spec()
            self.ngram_corpus = NgramspecCorpus(
                draft_token_num=spec.speculative_num_draft_tokens,
                max_trie_depth=spec.speculative_ngram_max_trie_depth,
                max_requests=max(1, int(getattr(target_worker.model_runner,
                                                "max_running_requests", 0) or
                                        DEFAULT_MAX_REQUESTS)))
            # the corpus sees a request's every token (its proposers look back over all of them)
            self.max_trie_depth = _context_len(target_worker)

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
