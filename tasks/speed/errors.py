"""The errors of speed runs; each message is one line."""

from __future__ import annotations


class BenchmarkError(RuntimeError):
    """A benchmark that cannot run as configured; the message is one line."""


class ServingError(RuntimeError):
    """A server or benchmark run that cannot start or finish; the message is one line."""

