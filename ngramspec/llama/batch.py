"""A multi-sequence ``llama_batch`` whose arrays are numpy buffers (one vectorized fill per step).

``llama_batch_init`` mallocs one ``seq_id`` array per token, which can only be filled token by
token through ctypes; this batch instead points every token's ``seq_id`` at one element of a
single numpy array, so a step's tokens, positions, sequence ids and output flags are four numpy
slice assignments. The struct is passed to ``llama_decode`` by value and never freed by llama.cpp.

The package's one ``llama_batch`` wrapper: the scheduler's steps (`ngramspec.llama.executor`),
the one-sequence `ngramspec.llama.decoder.Decoder` (live generation, the draft model, the
calibration) and the noise measurement of `ngramspec.llama.divergence` all decode through it.
"""
from __future__ import annotations

import ctypes
from typing import List, Tuple

import numpy as np

__all__ = ["MultiSeqBatch"]


class MultiSeqBatch:
    """Up to ``capacity`` tokens, each in one sequence, with a per-token logits flag.

    Fill with :meth:`add` (one run of consecutive positions of one sequence), decode with
    :meth:`decode`; :meth:`clear` starts the next step.

    Notes
    -----
    Memory: 17 bytes per token of capacity plus a pointer per token.

    Thread-safety: not thread-safe; owned by one thread (the scheduler's decode thread, a
    `Decoder`'s).
    """

    def __init__(self, capacity: int, *, min_run: int = 1):
        import llama_cpp as lc
        self._lc = lc
        n = int(capacity)
        if n < max(1, min_run):
            raise ValueError(f"n_batch = {n} is out of range: allowed >= {max(1, min_run)}")
        self.capacity = n
        #: fewest tokens (and rows of logits) of a run: the deterministic mode's 2
        #: (`ngramspec.llama.deterministic`); a shorter run is padded with copies of its last
        #: token, whose KV cells `decode` drops again
        self.min_run = int(min_run)
        self._pads: List[Tuple[int, int]] = []   # (seq, first pad position) of this batch
        self.token = np.zeros(n, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq = np.zeros(n, dtype=np.int32)
        self.logits = np.zeros(n, dtype=np.int8)
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * n)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n)])
        b = lc.llama_batch()
        b.n_tokens = 0
        b.token = self.token.ctypes.data_as(i32p)
        b.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        b.pos = self.pos.ctypes.data_as(i32p)
        b.n_seq_id = self.n_seq_id.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(i32p))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b
        self.n = 0

    def clear(self) -> None:
        self.n = 0
        self._pads.clear()

    @property
    def free(self) -> int:
        return self.capacity - self.n

    def add(self, seq_id: int, tokens, pos0: int, logits: str, pad_to: int = 0) -> int:
        """Append ``tokens`` of sequence ``seq_id`` at positions ``pos0 ..``.

        ``logits``: ``"all"`` (verification), ``"last"`` (last prompt chunk) or ``"none"``.
        Returns the batch index of the first appended token.

        With ``min_run`` > 1 a shorter run is padded to ``min_run`` tokens (or ``pad_to``: the
        deterministic mode decodes several slots' runs together only at one length; its last token
        repeated at the next positions; their rows follow the run's, their cells are dropped
        after the decode) and ``"last"`` asks for the last ``min_run`` rows (a padded run's
        rows: its own, then its pads'): every matrix product of the decode has two or more
        columns. Rows are found by batch index (the flags' running count), as before.
        """
        m = len(tokens)
        i = self.n
        n = max(m, self.min_run, int(pad_to))
        if m == 0 or i + n > self.capacity:
            raise ValueError(f"batch overflow: {i} + {n} > {self.capacity}")
        self.token[i:i + m] = tokens
        if n > m:
            self.token[i + m:i + n] = self.token[i + m - 1]
            self._pads.append((int(seq_id), pos0 + m))
        self.pos[i:i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[i:i + n] = seq_id
        self.logits[i:i + n] = 1 if logits == "all" else 0
        if logits == "last":
            self.logits[i + m - min(m, self.min_run):i + m] = 1
            self.logits[i + m:i + n] = 1   # a padded run: the pad's rows follow the last one
        self.n = i + n
        return i

    def decode(self, ctx) -> np.ndarray:
        """One ``llama_decode`` of the batch; returns the output rows (batch order of the tokens
        with a logits flag) as a ``(n_out, n_vocab)`` view, valid until the next decode."""
        self._batch.n_tokens = self.n
        rc = self._lc.llama_decode(ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}"
                               + (" (no KV cache slot for the batch)" if rc == 1 else ""))
        if self._pads:   # the logits are computed: the pads' cells go
            mem = self._lc.llama_get_memory(ctx)
            for seq, p0 in self._pads:
                self._lc.llama_memory_seq_rm(mem, seq, p0, -1)
        n_out = int(np.count_nonzero(self.logits[:self.n]))
        if n_out == 0:
            return np.empty((0, 0), dtype=np.float32)
        model = self._lc.llama_get_model(ctx)
        n_vocab = int(self._lc.llama_vocab_n_tokens(self._lc.llama_model_get_vocab(model)))
        ptr = self._lc.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, n_vocab))
