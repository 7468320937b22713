"""The V1 model runner's side of vLLM's ``custom_class`` proposer contract, on recorded traces.

`RunnerSim` keeps what vLLM 0.33.0's ``InputBatch`` keeps for a proposer (``token_ids_cpu``,
``num_tokens_no_spec``, the rows' request ids) and changes it as ``GPUModelRunner`` does between
two ``propose`` calls: finished requests leave their rows, new ones take the lowest holes
(``InputBatch.add_request``), the last rows move into the remaining holes (``condense``), the
sampled tokens are written after each row's tokens (``_bookkeeping_sync``), a row with nothing
sampled gets ``[]`` (a partial prefill). The target is the recorded output under greedy
verification: a draft is accepted up to its first token that differs from it, then one token of
the target's; a step's token budget may verify only part of a draft.

`reference_drafts` gives what `SpecEngine` drafts for the same requests: one `SlotLoop` per
request on its own slot, driven in arrival order with the same targets.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from ngramspec.integrations.requests import engine_from_env
from ngramspec.loop import SlotLoop, common_prefix, draft_budget, run_recorded
from ngramspec.policy import FIXED


@dataclass
class SimRequest:
    rid: str
    prompt: np.ndarray
    output: np.ndarray
    arrival: int
    prefill_steps: int = 1          # steps with [] sampled before the first token
    after: Optional[str] = None     # the request it continues (its conversation's previous)
    extra_args: Optional[dict] = None   # its SamplingParams.extra_args (the runner's state)
    seq: int = 0
    drafts: List[List[int]] = field(default_factory=list)   # the drafts verified, in order
    targets: List[np.ndarray] = field(default_factory=list)  # the tokens each step added
    target_steps: List[int] = field(default_factory=list)    # the steps that added them
    steps: List[List[int]] = field(default_factory=list)     # [n_draft, n_accepted, 1] each
    n: int = 0                      # tokens in the row (prompt + output so far)
    pending: Optional[List[int]] = None
    steps_left_in_prefill: int = 0

    @property
    def done(self) -> bool:
        return self.n >= len(self.prompt) + len(self.output)


class RunnerSim:
    """Drive ``propose`` as vLLM 0.33.0's V1 runner calls it (module docstring).

    Parameters
    ----------
    requests : list of SimRequest
    max_num_seqs, max_model_len : int
        The batch rows and the row length.
    budget : callable, optional
        ``budget(step, rid, n_draft) -> int``: how many draft tokens the step verifies.
    shuffle : random.Random, optional
        Move rows around at random as well (beyond vLLM's condensing), at every step where no
        request arrives (new requests take rows in arrival order, as in vLLM).
    with_ids : bool
        Call ``set_request_ids`` before each step (the `register` hook's call).
    skip_every : int
        At every step divisible by it, the decoding requests of even arrival number sample
        nothing: their rows are skipped mid-request (0: never).
    """

    def __init__(self, requests, max_num_seqs: int, max_model_len: int, *,
                 budget: Optional[Callable] = None, shuffle: Optional[random.Random] = None,
                 with_ids: bool = False, skip_every: int = 0):
        self.waiting = sorted(requests, key=lambda r: r.arrival)
        for seq, r in enumerate(self.waiting):
            r.seq = seq
        self.max_num_seqs = max_num_seqs
        self.token_ids_cpu = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_seqs, dtype=np.int32)
        self.rows: List[Optional[SimRequest]] = []
        self.budget = budget
        self.shuffle = shuffle
        self.with_ids = with_ids
        self.skip_every = skip_every
        self.step = 0
        self.finished: List[str] = []
        self.done_ids: set = set()
        self.starts: List[int] = []     # per step, the requests that got their first token
        self.peak = 0                   # the most rows in use at once
        # the hook's request arguments, as the runner's request states hold them
        by_id = {r.rid: r.extra_args for r in self.waiting if r.extra_args is not None}
        self.args_of = by_id.get if by_id else None

    def _move(self, src: int, dst: int) -> None:
        n = int(self.num_tokens_no_spec[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        self.num_tokens_no_spec[dst] = n
        self.rows[dst], self.rows[src] = self.rows[src], None

    def _admit_and_condense(self) -> None:
        holes = sorted(i for i, r in enumerate(self.rows) if r is None)
        arrived = False
        while self.waiting and self.waiting[0].arrival <= self.step:
            if not holes and len(self.rows) >= self.max_num_seqs:
                break
            if self.waiting[0].after is not None and self.waiting[0].after not in self.done_ids:
                break           # a conversation's next turn waits for the previous answer
            r = self.waiting.pop(0)
            arrived = True
            if holes:
                i = holes.pop(0)
            else:
                i = len(self.rows)
                self.rows.append(None)
            p = len(r.prompt)
            self.token_ids_cpu[i, :p] = r.prompt
            self.num_tokens_no_spec[i] = r.n = p
            r.steps_left_in_prefill = r.prefill_steps
            self.rows[i] = r
        # condense: the last occupied rows fill the lowest holes
        while holes:
            last = max((i for i, r in enumerate(self.rows) if r is not None), default=-1)
            hole = holes[0]
            if hole >= last:
                break
            holes.pop(0)
            self._move(last, hole)
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
        if self.shuffle is not None and len(self.rows) > 1 and not arrived:
            order = list(range(len(self.rows)))
            self.shuffle.shuffle(order)
            tok = self.token_ids_cpu[:len(order)].copy()
            num = self.num_tokens_no_spec[:len(order)].copy()
            rows = list(self.rows)
            for dst, src in enumerate(order):
                self.token_ids_cpu[dst] = tok[src]
                self.num_tokens_no_spec[dst] = num[src]
                self.rows[dst] = rows[src]

    def _sample(self, r: SimRequest) -> List[int]:
        """What the target samples for r this step (written into its row)."""
        if r.steps_left_in_prefill > 1:
            r.steps_left_in_prefill -= 1
            return []
        if (self.skip_every and self.step % self.skip_every == 0 and not r.steps_left_in_prefill
                and r.seq % 2 == 0):
            return []
        produced = r.n - len(r.prompt)
        out = r.output
        if r.steps_left_in_prefill == 1:
            r.steps_left_in_prefill = 0
            new = out[:1]
        else:
            draft = r.pending or []
            k = len(draft)
            if self.budget is not None:
                k = min(k, self.budget(self.step, r.rid, k))
            r.drafts.append(list(draft))
            rest = out[produced:]
            acc = 0
            while acc < k and acc < len(rest) and draft[acc] == rest[acc]:
                acc += 1
            new = rest[:acc + 1]
            r.steps.append([k, acc, 1])
        r.targets.append(np.array(new, dtype=np.int32))
        r.target_steps.append(self.step)
        return [int(t) for t in new]

    def run(self, proposer, max_steps: int = 1_000_000) -> None:
        """Steps until every request is done; the drafts land in each request's ``drafts``."""
        while (self.waiting or self.rows) and self.step < max_steps:
            self.step += 1
            for i, r in enumerate(self.rows):
                if r is not None and r.done:
                    self.rows[i] = None
                    self.finished.append(r.rid)
                    self.done_ids.add(r.rid)
            self._admit_and_condense()
            sampled = []
            self.starts.append(sum(1 for r in self.rows if r.steps_left_in_prefill == 1))
            self.peak = max(self.peak, len(self.rows))
            for i, r in enumerate(self.rows):
                new = self._sample(r)
                n = int(self.num_tokens_no_spec[i])
                self.token_ids_cpu[i, n:n + len(new)] = new
                self.num_tokens_no_spec[i] = r.n = n + len(new)
                sampled.append(new)
            if self.with_ids:
                ids = [r.rid for r in self.rows]
                if self.args_of is None:
                    proposer.set_request_ids(ids, list(self.finished))
                else:
                    proposer.set_request_ids(ids, list(self.finished), self.args_of)
                self.finished = []
            drafts = proposer.propose(sampled, self.num_tokens_no_spec, self.token_ids_cpu)
            assert len(drafts) == len(self.rows)
            for r, s, d in zip(self.rows, sampled, drafts):
                if s:
                    r.pending = list(d)
                else:
                    assert d == [], "a draft for a row with nothing sampled"


def records(reqs) -> List[dict]:
    """Golden-format records (``n_prompt``, ``n_output``, ``steps``) of simulated requests, for
    `ngramspec.cost.modeled_speedup`."""
    out = []
    for r in reqs:
        prompt, output = (r.prompt, r.output) if hasattr(r, "prompt") else (
            r.trace.prompt, r.trace.output)
        out.append({"n_prompt": len(prompt), "n_output": len(output), "steps": r.steps})
    return out


def tokens_per_step(reqs) -> float:
    """Output tokens after the first per verification step."""
    recs = records(reqs)
    steps = sum(len(x["steps"]) for x in recs)
    return sum(x["n_output"] - 1 for x in recs) / steps if steps else 0.0


def tiny_vllm_config(model_dir, max_model_len: int, max_num_seqs: int, **spec):
    """A real vLLM VllmConfig for `vllm serve --speculative-config '{spec}'` on a tiny Llama
    whose config.json is written into `model_dir` (the proposers load no weights)."""
    import json
    import pathlib

    from vllm.config import (DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    path = pathlib.Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 50000, "max_position_embeddings": max_model_len,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=max_model_len,
                        dtype="float32")
    sc = SpeculativeConfig(target_model_config=model, target_parallel_config=ParallelConfig(),
                           **spec)
    return VllmConfig(model_config=model, speculative_config=sc,
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                       max_model_len=max_model_len,
                                                       is_encoder_decoder=False),
                      device_config=DeviceConfig(device="cpu"))


class VllmNgram:
    """vLLM's own numba ``NgramProposer`` behind the ``custom_class`` call (the runner passes it
    ``num_spec_tokens_to_schedule`` first)."""

    def __init__(self, vllm_config):
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer
        self.proposer = NgramProposer(vllm_config)
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def set_request_ids(self, ids, finished=()):
        """Nothing: vLLM's ngram proposer keeps no per-request state."""

    def propose(self, sampled, num_tokens, token_ids, slot_mappings=None):
        return self.proposer.propose(self.k, sampled, num_tokens, token_ids)


def sim_requests(trace, *, spread: int = 3, chunked_every: int = 3) -> List[SimRequest]:
    """The trace's requests arriving every `spread` steps, a conversation's next turn only once
    the previous one is answered (its prompt holds that answer); every `chunked_every`-th one
    takes two prefill steps (a first call with nothing sampled)."""
    out, last = [], {}
    for i, t in enumerate(trace):
        conv = t.extra.get("conversation")
        out.append(SimRequest(t.id, t.prompt, t.output, arrival=spread * i,
                              prefill_steps=2 if chunked_every and i % chunked_every == 1 else 1,
                              after=last.get(conv) if conv is not None else None))
        if conv is not None:
            last[conv] = t.id
    return out


def reference_drafts(engine_factory, sims: List[SimRequest], max_model_len: int, k: int,
                     policy=None) -> Dict[str, List[List[int]]]:
    """SpecEngine's drafts for the requests, one `SlotLoop` each, in the proposer's order.

    Per step: the requests gone from the batch since their last token free their slots; the
    new ones begin on the lowest free slots, in arrival order; then every request that sampled
    verifies and drafts, in arrival order. Request r's j-th target is what the j-th step with a
    token for it added (``targets``). Each list ends with the draft made after the request's
    last token (never verified).
    """
    import heapq
    engine = engine_factory(len(sims))
    policy = FIXED if policy is None else policy     # its moments around each loop's steps
    by_step: Dict[int, list] = {}
    for r in sims:
        for j, step in enumerate(r.target_steps):
            by_step.setdefault(step, []).append((r.seq, j, r))
    loops: Dict[str, SlotLoop] = {}
    slot_of: Dict[str, int] = {}
    free = list(range(len(sims)))
    out: Dict[str, List[List[int]]] = {r.rid: [] for r in sims}
    for step in sorted(by_step):
        for r in sims:
            if r.rid in slot_of and r.target_steps[-1] < step:
                heapq.heappush(free, slot_of.pop(r.rid))
        events = sorted(by_step[step], key=lambda e: e[0])
        for _, j, r in events:
            if j == 0:
                slot_of[r.rid] = heapq.heappop(free)
                loops[r.rid] = SlotLoop(engine, slot_of[r.rid], r.prompt, int(r.targets[0][0]),
                                        n_ctx=max_model_len)
        for _, j, r in events:
            loop = loops[r.rid]
            if j:
                t = r.targets[j]
                policy.verify(loop, t, n_verified=len(t) - 1)
            out[r.rid].append(policy.draft(loop, draft_budget(loop, k)).tolist())
    return out


# -- the contract checks, shared by the engine-free tests and the ones inside vLLM -------------

#: Proposers whose state is per request only, and ones with state shared across requests.
PER_REQUEST = "--spec-type ngram-simple,ngram-map-k4v --spec-ngram-map-k4v-reindex 1"
SHARED = "--spec-type ngram-suffix,ngram-mod"


def check_drafts_are_spec_engines(make, trace, k: int, max_len: int, flags=PER_REQUEST):
    """Requests arriving, finishing, prefilled in chunks, their rows condensed: each request's
    drafts are exactly SpecEngine's for that request alone (per-request proposers: nothing of
    another request's state can reach them). ``make(flags, max_num_seqs)`` builds the proposer."""
    sims = sim_requests(trace)
    RunnerSim(sims, 4, max_len, skip_every=5).run(make(flags, 4))
    for r in sims:
        engine = engine_from_env(1, flags)[0]
        ref = run_recorded(engine, 0, r.prompt, r.output, n_ctx=max_len, record_drafts=True,
                           n_max=k)
        assert ref.drafts == r.drafts, r.rid
    assert sum(len(d) for r in sims for d in r.drafts) > 0


def check_moving_rows_changes_nothing(make, trace, k: int, max_len: int, flags):
    """Rows shuffled at random every step, drafts cut by a token budget: the same drafts as
    SpecEngine's request by request in arrival order, shared state (ngram-mod's pool,
    ngram-suffix's store) included."""
    def budget(step, rid, n):
        return n if (step + len(rid)) % 3 else n // 2
    runs = []
    for shuffle in (None, random.Random(7)):
        sims = sim_requests(trace)
        RunnerSim(sims, 3, max_len, budget=budget, shuffle=shuffle,
                  skip_every=7).run(make(flags, 3))
        runs.append({r.rid: r.drafts for r in sims})
        ref = reference_drafts(lambda n: engine_from_env(n, flags)[0], sims, max_len, k,
                               policy=engine_from_env(1, flags)[1])
        for r in sims:
            assert ref[r.rid][:len(r.drafts)] == r.drafts, r.rid
            assert len(ref[r.rid]) == len(r.drafts) + 1
    assert runs[0] == runs[1]


def check_request_ids_match_token_following(make, trace, max_len: int):
    """With the runner hook's request ids the drafts are the same as by tokens."""
    out = []
    for with_ids in (False, True):
        sims = sim_requests(trace)
        RunnerSim(sims, 4, max_len, with_ids=with_ids).run(make(PER_REQUEST, 4))
        out.append({r.rid: r.drafts for r in sims})
    assert out[0] == out[1]


# -- SGLang: the NGRAM worker's corpus calls ---------------------------------------------------

def stub_cuda_only_kernels():
    """Let SGLang's ``ngram_worker`` import on a CPU-only host: ``sgl_kernel`` is a CUDA-only
    build, and the worker's corpus-calling methods never call it (a call would raise)."""
    import sys
    import types
    for name in ("sgl_kernel", "sgl_kernel.speculative"):
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__path__ = []

        def missing(attr, _name=name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def cuda_only(*args, **kwargs):
                raise RuntimeError(f"{_name}.{attr} is a CUDA-only kernel")
            return cuda_only
        module.__getattr__ = missing
        sys.modules[name] = module


def tree_paths(tokens, mask) -> set:
    """The draft tree's root-to-leaf paths below the root, as a set of tuples (sibling order is
    unspecified); SGLang's padding (a lone token 0 under the root) is no path."""
    d = len(tokens)
    parent = [-1] * d
    for i in range(1, d):
        anc = [j for j in range(i) if mask[i, j]]
        parent[i] = anc[-1] if anc else 0
    children = {p for p in parent[1:]}
    paths = set()
    for leaf in range(1, d):
        if leaf in children:
            continue
        path, node = [], leaf
        while node > 0:
            path.append(int(tokens[node]))
            node = parent[node]
        if path != [0]:
            paths.add(tuple(reversed(path)))
    return paths


def accepted_path(paths: set, rest) -> list:
    """Greedy tree verification: the longest path prefix the recorded continuation confirms."""
    best = []
    for path in paths:
        n = 0
        while n < len(path) and n < len(rest) and path[n] == rest[n]:
            n += 1
        if n > len(best):
            best = list(path[:n])
    return best


class _Req:
    def __init__(self, trace_req, sampling_params=None):
        from array import array
        from types import SimpleNamespace
        self.rid = trace_req.id
        # SGLang's SamplingParams (its custom_params: the request's fields) or no fields
        self.sampling_params = sampling_params or SimpleNamespace(custom_params=None)
        self.origin_input_ids_unpadded = list(trace_req.prompt)
        self.out = [int(trace_req.output[0])]   # every token produced so far
        self.output_ids = array("q", self.out)  # SGLang's: under overlap, a round behind
        self.trace = trace_req
        self.steps = []          # [n_draft verified, n_accepted, 1] per step (golden format)
        self.paths = []


class _Batch:
    def __init__(self, reqs):
        self.reqs = reqs
        self.spec_info = None

    def grammar_needs_sync(self):
        return False


def greedy_tree_verify(req, row, mask, rest) -> list:
    """The accepted tokens of greedy tree verification (`accepted_path` over the tree's
    paths)."""
    return accepted_path(tree_paths(row, mask), rest)


def _overlap_spec_info(live, d: int):
    """What SGLang's overlap scheduler hands the next step in ``batch.spec_info``: per request
    the tokens the last round produced (not yet in ``output_ids``), ``d`` slots each."""
    import torch
    from types import SimpleNamespace
    flat = torch.zeros(len(live) * d, dtype=torch.int64)
    lens = torch.zeros(len(live), dtype=torch.int32)
    for i, r in enumerate(live):
        lag = r.out[len(r.output_ids):]
        flat[i * d:i * d + len(lag)] = torch.tensor(lag, dtype=torch.int64)
        lens[i] = len(lag)
    return SimpleNamespace(accept_tokens=flat, accept_lens=lens)


def run_ngram_worker(worker_cls, corpus, trace, draft_token_num: int, max_trie_depth: int,
                     batch_size: int = 2, verify: Callable = greedy_tree_verify,
                     overlap: bool = False, admit=None, times: Optional[list] = None,
                     params: Optional[dict] = None):
    """Requests through SGLang's own ``_prepare_draft_tokens`` / ``_update_ngram_corpus`` with
    `corpus`, greedy tree verification against the recorded outputs; a request leaving the
    batch is erased as ``forward_batch_generation`` erases it. Returns the requests (``steps``,
    ``paths`` per step). A conversation's next turn joins once the previous one is answered.
    ``verify(req, row, mask, rest)`` gives a step's accepted tokens (``row``: the request's d
    tokens, ``mask``: its d x d mask, ``rest``: the recorded output still to come).

    `overlap`: SGLang's overlap scheduling, where a round's tokens reach ``req.output_ids``
    one round late and the next step reads them from ``batch.spec_info`` (a new request's
    first token too). `admit(n_live)`: how many waiting requests may join this step (default:
    up to `batch_size`). `times`: gets each step's seconds in the two corpus-calling calls, its
    batch size and how many requests joined the batch in it. `params`: request id -> its
    SGLang ``SamplingParams`` (``custom_params``: the request's fields)."""
    import time
    worker = ngram_worker(worker_cls, corpus, draft_token_num, max_trie_depth, overlap)
    queue = [_Req(t, (params or {}).get(t.id)) for t in trace]
    if overlap:
        for r in queue:
            del r.output_ids[:]
    before = {s.rid: s.after for s in sim_requests(trace)}
    done, live, prev_rids = [], [], set()
    d = draft_token_num
    while queue or live:
        room = batch_size - len(live) if admit is None else min(admit(len(live)),
                                                                 batch_size - len(live))
        room = room if live else max(room, 1)    # an empty batch waits for no one
        joined = 0
        while queue and room > 0 and (
                before[queue[0].rid] is None or before[queue[0].rid] in {r.rid for r in done}):
            live.append(queue.pop(0))
            room -= 1
            joined += 1
        if not live:
            continue
        batch = _Batch(live)
        if overlap:
            batch.spec_info = _overlap_spec_info(live, d)
        t0 = time.perf_counter()
        drafts, mask = worker._prepare_draft_tokens(batch)
        spent = time.perf_counter() - t0
        mask = np.asarray(mask).reshape(len(live), d, d)
        for i, r in enumerate(live):
            row = np.asarray(drafts)[i * d:(i + 1) * d]
            assert row[0] == r.out[-1]
            rest = r.trace.output[len(r.out):].tolist()
            acc = verify(r, row, mask[i], rest)
            r.paths.append(tree_paths(row, mask[i]))
            r.steps.append([d - 1, len(acc), 1])     # SGLang verifies the whole tree
            if overlap:      # the last round's tokens are processed now, this round's later
                r.output_ids.extend(r.out[len(r.output_ids):])
            r.out.extend(rest[:len(acc) + 1])
            if not overlap:
                r.output_ids.extend(rest[:len(acc) + 1])
        t0 = time.perf_counter()
        worker._update_ngram_corpus(batch)
        spent += time.perf_counter() - t0
        if times is not None:
            times.append((spent, len(live), joined))
        cur = {r.rid for r in live}
        departed = prev_rids - cur
        if departed:
            corpus.erase_match_state(list(departed))
        prev_rids = cur
        for r in [r for r in live if len(r.out) >= len(r.trace.output)]:
            live.remove(r)
            done.append(r)
    if prev_rids:
        corpus.erase_match_state(list(prev_rids))
    return done


# -- at the engines' scale: long synthetic requests, many in flight ----------------------------

def synthetic_tokens(rng, n: int, vocab: int = 32000) -> np.ndarray:
    """`n` repetitive token ids (what n-gram drafters live on): a random start, then segments
    of 8 .. 128 tokens copied from earlier in the stream, one in four followed by a fresh
    random token."""
    out = np.empty(n, dtype=np.int32)
    start = min(n, 256)
    out[:start] = rng.integers(0, vocab, start)
    i = start
    while i < n:
        m = min(int(rng.integers(8, 129)), n - i)
        src = int(rng.integers(0, i - m + 1)) if i >= m else 0
        out[i:i + m] = out[src:src + m]
        i += m
        if i < n and rng.random() < 0.25:
            out[i] = rng.integers(0, vocab)
            i += 1
    return out


def synthetic_trace(n_requests: int, prompt_len: int, out_len=(24, 96), seed: int = 0):
    """`n_requests` trace requests of `prompt_len`-token prompts (± 1/8) and outputs of
    ``out_len`` tokens (uniform), each output continuing its prompt's repetitive stream."""
    from ngramspec.traces import Request as TraceRequest
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_requests):
        p = int(prompt_len * rng.uniform(1.0, 1.125))
        o = int(rng.integers(out_len[0], out_len[1] + 1))
        toks = synthetic_tokens(rng, p + o)
        out.append(TraceRequest(f"syn-{seed}-{i}", toks[:p], toks[p:], {}))
    return out


def random_arrivals(trace, rng, mean_gap=1.0, chunked: bool = False
                    ) -> List[SimRequest]:
    """`SimRequest`s arriving at random (exponential gaps of `mean_gap` steps, one value or
    one per request); `chunked`:
    one in three prefilled in two steps (two requests may then start in one step in another
    order than they arrived, and shared-state drafts follow the order they start in)."""
    step, out = 0.0, []
    gaps = np.broadcast_to(np.asarray(mean_gap, dtype=float), (len(trace),))
    for i, t in enumerate(trace):
        step += rng.exponential(gaps[i])
        out.append(SimRequest(t.id, t.prompt, t.output, arrival=int(step),
                              prefill_steps=2 if chunked and i % 3 == 1 else 1))
    return out


class TimedProposer:
    """A proposer's ``propose`` (and ``set_request_ids``) with the wall time of each step."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.times: List[float] = []
        self._ids_s = 0.0

    def set_request_ids(self, ids, finished=()):
        import time
        if not hasattr(self.proposer, "set_request_ids"):
            return      # vLLM's own proposers read the input batch instead
        t0 = time.perf_counter()
        self.proposer.set_request_ids(ids, finished)
        self._ids_s = time.perf_counter() - t0

    def propose(self, sampled, num_tokens, token_ids, slot_mappings=None):
        import time
        t0 = time.perf_counter()
        out = self.proposer.propose(sampled, num_tokens, token_ids)
        self.times.append(time.perf_counter() - t0 + self._ids_s)
        self._ids_s = 0.0
        return out


class VllmSuffix:
    """vLLM's own ``suffix`` proposer (``SuffixDecodingProposer``, ArcticInference) behind the
    ``custom_class`` call, with the input batch it reads (request ids, prompt lengths) kept from
    the rows' request ids (`set_request_ids`, as the runner hook hands them)."""

    def __init__(self, vllm_config, prompt_lens: Dict[str, int]):
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer
        self.proposer = SuffixDecodingProposer(vllm_config)
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.prompt_lens = prompt_lens
        self.ids: List[str] = []

    def set_request_ids(self, ids, finished=()):
        self.ids = list(ids)

    def propose(self, sampled, num_tokens, token_ids, slot_mappings=None):
        from types import SimpleNamespace
        ids = self.ids
        batch = SimpleNamespace(
            req_ids=ids, num_tokens_no_spec=num_tokens, token_ids_cpu=token_ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            num_prompt_tokens=np.array([self.prompt_lens[r] for r in ids], dtype=np.int32))
        return self.proposer.propose(self.k, batch, sampled)


class SteadyRows:
    """vLLM's runner at steady state: `B` rows of `L`-token requests (synthetic streams), one
    new token per row per step (the target's; every draft rejected), the rows' request ids
    handed before each step. `step(proposer)` returns the seconds of that step's calls; the
    first step is every request's first sight."""

    def __init__(self, B: int, L: int, steps: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.tokens = np.zeros((B, L + steps + 2), dtype=np.int32)
        for i in range(B):
            self.tokens[i] = synthetic_tokens(rng, L + steps + 2)
        self.ids = [f"r{i}" for i in range(B)]
        self.prompt_lens = {rid: L for rid in self.ids}
        self.L = L
        self.n = 0

    def step(self, proposer) -> float:
        import time
        B = len(self.ids)
        num = np.full(B, self.L + 1 + self.n, dtype=np.int32)
        sampled = [[int(t)] for t in self.tokens[:, self.L + self.n]]
        t0 = time.perf_counter()
        if hasattr(proposer, "set_request_ids"):
            proposer.set_request_ids(self.ids, ())
        proposer.propose(sampled, num, self.tokens)
        self.n += 1
        return time.perf_counter() - t0


class SteadyBatch:
    """SGLang's NGRAM worker at steady state: `B` requests of `L` tokens in one decode batch
    (``origin_input_ids_unpadded`` and ``output_ids`` as SGLang keeps them), one new token per
    request per step. `step(worker)` times ``_prepare_draft_tokens`` + ``_update_ngram_corpus``
    (sync scheduling); the first step is every request's first sight."""

    def __init__(self, B: int, L: int, steps: int, seed: int = 0):
        from array import array
        from types import SimpleNamespace
        rng = np.random.default_rng(seed)
        self.streams = [synthetic_tokens(rng, L + steps + 2) for _ in range(B)]
        self.reqs = [SimpleNamespace(rid=f"r{i}",
                                     origin_input_ids_unpadded=array("i", s[:L].tobytes()),
                                     output_ids=array("q", [int(s[L])]))
                     for i, s in enumerate(self.streams)]
        self.batch = _Batch(self.reqs)
        self.L = L

    def step(self, worker) -> float:
        import time
        t0 = time.perf_counter()
        worker._prepare_draft_tokens(self.batch)
        t1 = time.perf_counter()
        for r, s in zip(self.reqs, self.streams):
            r.output_ids.append(int(s[self.L + len(r.output_ids)]))
        t2 = time.perf_counter()
        worker._update_ngram_corpus(self.batch)
        return time.perf_counter() - t2 + t1 - t0


def ngram_worker(worker_cls, corpus, draft_token_num: int, max_trie_depth: int,
                 overlap: bool = False):
    """An SGLang NGRAM worker (`worker_cls`) holding only what its corpus-calling methods
    read."""
    worker = worker_cls.__new__(worker_cls)
    worker.draft_token_num = draft_token_num
    worker.max_trie_depth = max_trie_depth
    worker.enable_overlap = overlap
    worker.ngram_corpus = corpus
    return worker


# -- Predicted Outputs and per-request control (issue 37) --------------------------------------

def word_tokenizer(words):
    """A real Hugging Face tokenizer (``PreTrainedTokenizerFast`` over a word-level model):
    the object an engine's front end holds (vLLM's API server, SGLang's tokenizer manager)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def edited(trace_req, insert: int = 12, at: float = 0.4):
    """A code edit whose prediction is the request's output without `insert` of its tokens at
    fraction `at`: the output leaves the prediction there (an inserted line) and must find its
    place again. Returns ``(prediction, where the insertion starts)``."""
    out = np.asarray(trace_req.output, dtype=np.int32)
    k = max(2, int(len(out) * at))
    return np.concatenate([out[:k], out[k + insert:]]), k


def refound_after(drafts_by_pos, prediction, k: int) -> bool:
    """Whether a draft made after output position `k` + 1 is the prediction's continuation
    from a place at or after `k` (the prediction found again past the insertion).
    `drafts_by_pos`: ``(output tokens known, draft)`` per step."""
    pred = prediction.tolist()
    for pos, draft in drafts_by_pos:
        if pos <= k + 1 or not draft:
            continue
        for j in range(k, len(pred) - len(draft) + 1):
            if pred[j:j + len(draft)] == list(draft):
                return True
    return False


def predicted_reference(prediction, flags: str, prompt, output, k: int, max_len: int = 0):
    """``serve``'s drafts for the request: its prediction first, the chain where it has nothing
    (`ngramspec.prediction.PredictedEngine`), one `SlotLoop` (the verification loop)."""
    from ngramspec.prediction import PredictedEngine, PredictionDrafter
    engine = PredictedEngine(PredictionDrafter(prediction), engine_from_env(1, flags)[0])
    return run_recorded(engine, 0, prompt, output, n_ctx=max_len, record_drafts=True, n_max=k)


def check_prediction_and_control(make, trace_req, args_of_kind, k: int, max_len: int,
                                 flags=PER_REQUEST):
    """Three copies of a code-edit request in the V1 runner's sequence (request ids and
    ``extra_args`` handed as the hook does): one with a prediction drafts exactly as ``serve``
    drafts it (prediction first, re-found after the insertion), one with speculation off gets no
    draft at any step, the plain one drafts as configured. ``args_of_kind(kind, prediction)``
    gives the request's ``extra_args`` (built through the engine's own request objects).
    Returns the requests."""
    pred, at = edited(trace_req)
    prompt, output = trace_req.prompt, trace_req.output
    sims = [SimRequest(f"{kind}-{trace_req.id}", prompt, output, arrival=i,
                       extra_args=args_of_kind(kind, pred))
            for i, kind in enumerate(("predicted", "off", "plain"))]
    RunnerSim(sims, 4, max_len, with_ids=True).run(make(flags, 4))
    predicted, off, plain = sims
    ref = predicted_reference(pred, flags, prompt, output, k, max_len)
    assert predicted.drafts == ref.drafts
    assert predicted.drafts[0] == pred[1:1 + min(k, 8)].tolist()    # the prediction first
    pos = np.cumsum([1] + [s[1] + 1 for s in predicted.steps])[:-1]
    assert refound_after(zip(pos, predicted.drafts), pred, at)
    assert all(d == [] for d in off.drafts) and len(off.steps) == len(output) - 1
    plain_ref = run_recorded(engine_from_env(1, flags)[0], 0, prompt, output, n_ctx=max_len,
                             record_drafts=True, n_max=k)
    assert plain.drafts == plain_ref.drafts and any(plain.drafts)
    assert tokens_per_step([predicted]) > tokens_per_step([plain]) > tokens_per_step([off])
    return sims


#: A request's own subset of PER_REQUEST's chain and bounds, and the flags of that subset alone.
SUBSET_ARGS = {"speculative": {"type": "ngram-map-k4v", "n_max": 3, "n_min": 2}}
SUBSET_FLAGS = "--spec-type ngram-map-k4v --spec-ngram-map-k4v-reindex 1"


def subset_reference(trace_req, max_len: int = 0):
    """What a request with `SUBSET_ARGS` drafts: its proposer alone, drafts of at most 3
    tokens, those under 2 dropped."""
    loop = SlotLoop(engine_from_env(1, SUBSET_FLAGS)[0], 0, trace_req.prompt,
                    int(trace_req.output[0]), n_ctx=max_len)
    drafts, out, n = [], trace_req.output, 1
    while n < len(out):
        draft = loop.propose(3, 2)
        drafts.append(draft.tolist())
        acc = common_prefix(draft, out[n:])
        target = out[n:n + acc + 1]
        loop.verify(target)
        n += len(target)
    return drafts
