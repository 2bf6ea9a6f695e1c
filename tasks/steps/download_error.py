"""The download step's error and the one-line form of the exceptions its messages quote, shared by its paths
(download.py, download_gguf.py)."""

from __future__ import annotations

from quantgate.catalog.errors import QuantgateError


class DownloadError(QuantgateError, RuntimeError):
    """A model that cannot be fetched; the message is one line naming the model."""


def brief(e: BaseException) -> str:
    """`e` as its type and the first 200 characters of its message, on one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
