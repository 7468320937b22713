"""The one greedy-equality check of the live tests: equal outputs, or a first difference at a tie
within llama.cpp's float noise as `divergence_report` measures it on this machine, along the
decode paths the drivers take (multi-token batches, chunked prompts, several sequences in one
unified KV cache). So no equality test depends on which CPU kernels (AVX2, AVX-512, AMX) run it.
"""
from ngramspec.llama.divergence import divergence_report


def assert_same_greedy(llm, prompt, got, want):
    """``got`` equals ``want``, or they first differ at a tie within float noise."""
    got, want = [int(t) for t in got], [int(t) for t in want]
    if got == want:
        return
    rep = divergence_report(llm, prompt, got, want)
    assert rep is not None and rep.within_noise(), (
        f"greedy output leaves the reference beyond float noise: {rep}")


def assert_same_greedy_prefix(llm, prompt, a, b):
    """`assert_same_greedy` on the shorter output and as many tokens of the longer one."""
    n = min(len(a), len(b))
    assert_same_greedy(llm, prompt, list(a)[:n], list(b)[:n])
