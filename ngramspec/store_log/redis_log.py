"""The store log on Redis Streams (Redis >= 7, or Valkey), for replicas on several nodes.

One stream holds the log: ``XADD NAME MAXLEN ~ N * e <entry>`` appends, ``XREAD COUNT``
follows it from the reader's last stream id (``0-0`` at first: a new replica ingests what
the log still holds), so a replica that lost the server catches up from where it stopped.
A gap (entries trimmed before the reader got to them) is seen when the entry the reader
stopped at is older than the stream's first (``XINFO STREAM``).

Needs the ``redis`` Python client (the ``store`` extra: ``pip install ngramspec[store]``).

Notes
-----
Memory: one XREAD reply (`count` entries) per call; the server holds the stream, bounded by
the appenders' MAXLEN.

Thread-safety: redis-py's client is thread-safe (a connection pool); one object may be used by
several threads.
"""
from __future__ import annotations

from urllib.parse import parse_qs, urlsplit, urlunsplit

from ngramspec.store_log.backends import LogUnavailable

__all__ = ["RedisLog", "split_url"]

#: The stream's name when the URL gives none.
DEFAULT_STREAM = "ngramspec-store"
FIELD = b"e"


def split_url(url: str):
    """``(connection URL, stream name)`` of ``redis://host:port/db?stream=NAME``."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    stream = query.pop("stream", [DEFAULT_STREAM])[-1]
    rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, rest, "")), stream


def _id(raw) -> tuple:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class RedisLog:
    """A store log on one Redis stream (``redis://host:port/db?stream=NAME``)."""

    def __init__(self, url: str, *, timeout: float = 2.0, field: str = "--store"):
        try:
            import redis
        except ImportError as exc:
            raise ImportError(f"{field} {url}: the Redis store log needs the redis client: "
                              f"pip install 'ngramspec[store]'") from exc
        self._errors = (redis.exceptions.RedisError, OSError)
        conn, self.stream = split_url(url)
        parts = urlsplit(url)
        # shown in warnings and metrics: without a password
        self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.name = self.url
        # short timeouts: the caller is a background thread that retries with back-off
        self._client = redis.Redis.from_url(conn, socket_timeout=timeout,
                                            socket_connect_timeout=timeout)

    def append(self, blobs, max_entries: int, max_bytes: int = 0) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for b in blobs:
                pipe.xadd(self.stream, {FIELD: bytes(b)}, maxlen=max(1, max_entries),
                          approximate=True)
            pipe.execute()
        except self._errors as exc:
            raise LogUnavailable(f"{self.url}: {exc}") from exc

    def read(self, after, count: int):
        start = after or "0-0"
        try:
            reply = self._client.xread({self.stream: start}, count=count)
            gap = False
            if after is not None and reply:
                # trimming deletes the oldest entries: when the one we stopped at is gone, the
                # ones after it may be too (the newest node, ours when caught up, is kept)
                first = self._client.xinfo_stream(self.stream).get("first-entry")
                gap = bool(first) and _id(first[0]) > _id(after)
        except self._errors as exc:
            raise LogUnavailable(f"{self.url}: {exc}") from exc
        out = []
        pos = after
        for _stream, items in reply or ():
            for sid, fields in items:
                out.append(fields.get(FIELD) if isinstance(fields, dict) else None)
                pos = sid.decode() if isinstance(sid, bytes) else sid
        return out, pos, gap

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
