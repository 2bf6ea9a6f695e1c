"""The errors of speed runs; each message is one line."""

from __future__ import annotations

from quantgate.catalog.errors import QuantgateError


class BenchmarkError(QuantgateError, RuntimeError):
    """A benchmark that cannot run as configured; the message is one line."""


class ServingError(QuantgateError, RuntimeError):
    """A server or benchmark run that cannot start or finish; the message is one line."""

