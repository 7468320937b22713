"""A finished request as the response reports it: OpenAI's finish reason and usage,
llama-server's timings.

Notes
-----
Thread-safety: pure functions.
"""
from __future__ import annotations

from ngramspec.server import schemas


def cancelled_message(done) -> str:
    """The 503 (or stream error) of a request the shutdown cancelled."""
    return (f"the server is shutting down: the request was cancelled after "
            f"{done.predicted_n} tokens; retry later")


def completion_usage(done, n_prompt: int, predicted: bool = False) -> schemas.Usage:
    """OpenAI's usage; with Predicted Outputs, the accepted and rejected prediction tokens."""
    details = schemas.CompletionTokensDetails(
        accepted_prediction_tokens=done.accepted_prediction_tokens,
        rejected_prediction_tokens=done.rejected_prediction_tokens) if predicted else None
    return schemas.Usage(prompt_tokens=n_prompt, completion_tokens=done.predicted_n,
                         total_tokens=n_prompt + done.predicted_n,
                         completion_tokens_details=details)


def completion_timings(done, hide_cache_n: bool = False) -> schemas.Timings:
    """llama-server's timings: ``prompt_n`` counts the prompt tokens decoded, ``cache_n`` those
    reused from the slot's KV cache. `hide_cache_n` leaves the prompt's fields out: each of
    them (count, time, rate) tells how much of the prompt a slot held."""
    def per_second(n, ms):
        return n / ms * 1e3 if ms > 0 else 0.0

    def per_token(n, ms):
        return ms / n if n > 0 else 0.0

    prompt_n = done.prompt_n - done.prompt_cached_n
    prompt = {} if hide_cache_n else dict(
        cache_n=done.prompt_cached_n, prompt_n=prompt_n, prompt_ms=done.prompt_ms,
        prompt_per_token_ms=per_token(prompt_n, done.prompt_ms),
        prompt_per_second=per_second(prompt_n, done.prompt_ms))
    return schemas.Timings(
        **prompt,
        predicted_n=done.predicted_n, predicted_ms=done.predicted_ms,
        predicted_per_token_ms=per_token(done.predicted_n, done.predicted_ms),
        predicted_per_second=per_second(done.predicted_n, done.predicted_ms),
        draft_n=done.n_draft_tokens, draft_n_accepted=done.n_acc_tokens)
