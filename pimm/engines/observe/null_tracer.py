"""Tracing switched off: :data:`NULL_TRACER`, the object every call site holds
when ``structured_logging.enabled`` is False. Each of its methods does nothing,
so the code that traces needs no ``if`` around its calls.
"""

from __future__ import annotations


class NullTracer:
    """Tracing switched off: every call does nothing (``now`` is the builtin
    ``float``, so it returns 0.0 without a Python frame)."""

    enabled = False
    step = 0
    epoch = 0
    trace_hooks = False
    batch_stats_every = 0
    now = staticmethod(float)

    def complete(self, name, t0, args=None, thread=None):
        """Does nothing (:meth:`Tracer.complete` when tracing is on)."""
        return 0.0

    def span(self, name, **args):
        """Does nothing (:meth:`Tracer.span` when tracing is on)."""
        return _NULL_SPAN

    def long_span(self, name, **args):
        """Does nothing (:meth:`Tracer.long_span` when tracing is on)."""
        return _NULL_SPAN

    def begin(self, name, **args):
        """Does nothing (:meth:`Tracer.begin` when tracing is on)."""

    def end(self, name, **args):
        """Does nothing (:meth:`Tracer.end` when tracing is on)."""

    def instant(self, name, **args):
        """Does nothing (:meth:`Tracer.instant` when tracing is on)."""

    def counter(self, name, **values):
        """Does nothing (:meth:`Tracer.counter` when tracing is on)."""

    def flush(self):
        """Does nothing (:meth:`Tracer.flush` when tracing is on)."""

    def close(self):
        """Does nothing (:meth:`Tracer.close` when tracing is on)."""


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()
NULL_TRACER = NullTracer()
