"""llama.cpp's ``statistics <type>: ...`` lines (``common/speculative.cpp``) and llama-server's
``draft acceptance`` line, from `SpecEngine.stats()` dicts."""
from __future__ import annotations


def statistics_line(s: dict) -> str:
    """``statistics <type>: #calls(b,g,a) = ...`` exactly as llama.cpp prints it.

    The line ``common_speculative_print_stats`` logs once per implementation (at TRACE level);
    the optional ``#mean acc len`` / ``#acc rate/pos`` part appears once there were accept
    calls.

    Parameters
    ----------
    s : dict
        One entry of ``SpecEngine.stats()``: ``type``, the counters ``calls_b``, ``calls_g``,
        ``calls_a``, ``gen_drafts``, ``acc_drafts``, ``gen_tokens``, ``acc_tokens``,
        ``acc_per_pos`` and the times ``t_begin_us``, ``t_draft_us``, ``t_accept_us``.

    Returns
    -------
    str
    """
    line = (f"statistics {s['type']:>16}: #calls(b,g,a) = {s['calls_b']:4d} {s['calls_g']:6d} "
            f"{s['calls_a']:6d}, #gen drafts = {s['gen_drafts']:6d}, #acc drafts = "
            f"{s['acc_drafts']:5d}, #gen tokens = {s['gen_tokens']:6d}, #acc tokens = "
            f"{s['acc_tokens']:5d}")
    if s["calls_a"] > 0:
        rates = ", ".join(f"{c / s['calls_a']:.3f}" for c in s["acc_per_pos"])
        line += (f", #mean acc len = {1 + s['acc_tokens'] / s['calls_a']:.2f}"
                 f", #acc rate/pos = ({rates})")
    line += (f", dur(b,g,a) = {s['t_begin_us'] / 1000:.3f}, {s['t_draft_us'] / 1000:.3f}, "
             f"{s['t_accept_us'] / 1000:.3f} ms")
    return line


def acceptance_line(accepted: int, generated: int, n_drafts: int) -> str:
    """llama-server's per-request ``draft acceptance`` line.

    ``draft acceptance = R (A accepted / G generated), mean len = M``.

    Parameters
    ----------
    accepted, generated : int
        Draft tokens accepted and drafted in the request.
    n_drafts : int
        Drafts verified; ``mean len`` is 1 + accepted per draft, the mean number of tokens a
        verified draft contributed (as ``#mean acc len`` of `statistics_line`).

    Returns
    -------
    str
    """
    rate = accepted / generated if generated else 0.0
    mean_len = 1 + accepted / n_drafts if n_drafts else 0.0
    return (f"draft acceptance = {rate:.5f} ({accepted:5d} accepted / {generated:5d} generated), "
            f"mean len = {mean_len:5.2f}")

