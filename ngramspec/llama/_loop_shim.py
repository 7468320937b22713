"""TEMPORARY stand-in for ``ngramspec.loop.SlotLoop`` (helper D's module) until it is merged.

Implements exactly the agreed interface (/work/briefs/loop-interface.md); deleted on merge.
"""
from __future__ import annotations

import numpy as np


class FixedPolicy:
    def before_draft(self, loop):
        return None

    def after_draft(self, loop, draft):
        return len(draft)

    def observe(self, loop, n_draft, n_acc):
        pass


_EMPTY = np.empty(0, dtype=np.int32)


class SlotLoop:
    def __init__(self, engine, slot, prompt, first_token, *, n_ctx=0, n_predict=-1, policy=None,
                 record_drafts=False):
        self.engine, self.slot = engine, slot
        self.policy = policy or FixedPolicy()
        self.n_ctx, self.n_predict = n_ctx, n_predict
        prompt = np.asarray(prompt, dtype=np.int32)
        self._buf = np.empty(max(n_ctx, prompt.size + 16), dtype=np.int32)
        self._buf[:prompt.size] = prompt
        self.L = prompt.size
        if engine is not None:
            engine.begin(slot, prompt)
        self.sampled = int(first_token)
        self.n_output = 1
        self.done = False
        self._draft = _EMPTY
        self._called = False

    @property
    def context(self):
        return self._buf[:self.L]

    def propose(self):
        bound = self.n_ctx - self.L - 2 if self.n_ctx > 0 else 1 << 30
        if self.n_predict >= 0:
            bound = min(bound, self.n_predict - self.n_output - 1)
        lower = self.policy.before_draft(self)
        if lower is not None:
            bound = min(bound, lower)
        self._called = False
        draft = _EMPTY
        if self.engine is not None and bound > 0:
            draft = self.engine.draft(self.slot, self.context, self.sampled, bound)
            self._called = True
            if len(draft):
                k = self.policy.after_draft(self, draft)
                draft = draft[:k]
                if k == 0:
                    self.engine.accept(self.slot, 0)
                    self._called = False
        self._draft = draft
        return draft

    def verify(self, target):
        draft = self._draft
        m = len(draft)
        n_acc = 0
        while n_acc < m and n_acc < len(target) and int(target[n_acc]) == int(draft[n_acc]):
            n_acc += 1
        if m and self._called:
            self.engine.accept(self.slot, n_acc)
        need = self.L + 1 + n_acc
        if need > self._buf.size:
            self._buf = np.concatenate([self._buf, np.empty(need, dtype=np.int32)])
        self._buf[self.L] = self.sampled
        self._buf[self.L + 1:need] = draft[:n_acc]
        self.L = need
        if n_acc < len(target):
            self.sampled = int(target[n_acc])
            self.n_output += n_acc + 1
        else:
            self.n_output += n_acc
            self.done = True
        self.policy.observe(self, m, n_acc)
        self._draft = _EMPTY
        return n_acc
