"""The runtime's event log: :func:`recording` lists, in order, what the stage loops post, run, wait for, allocate
and free, so that tests can compare a replay with the plan's schedule."""

from __future__ import annotations

import contextlib


_EVENT_LOG: list | None = None


@contextlib.contextmanager
def recording():
    """Log what the runtime does, in order, while the block runs; yields the list of events.

    Events are tuples: ("prefetch", pass, stage, num_messages) (prefetch_kv), ("post", pass, stage, num_messages,
    pull rows whose results it pushes back), ("tile", pass,
    stage, tile rows of one kernel call, pull rows it reads),
    ("wait", pass, stage), ("alloc", pass, stage, tokens, live_tokens) and ("free", pass, stage, tokens,
    live_tokens), where live_tokens counts received buffers under the plan's liveness rule.
    """
    global _EVENT_LOG
    previous, _EVENT_LOG = _EVENT_LOG, []
    try:
        yield _EVENT_LOG
    finally:
        _EVENT_LOG = previous


def log_event(*event) -> None:
    """Append one event to the running :func:`recording`'s list, if one is running."""
    if _EVENT_LOG is not None:
        _EVENT_LOG.append(event)
