"""The standard streams as the CLI meets them: closed by the caller (``>&-`` leaves Python's
``sys.stdout`` None when the CLI runs without ``main()``), or closed since (``ValueError``)."""

from __future__ import annotations

from typing import TextIO

__all__ = ["is_terminal"]


def is_terminal(stream: TextIO | None) -> bool:
    """Whether ``stream`` is a terminal; one that is absent or closed is not."""
    if stream is None:
        return False
    try:
        return stream.isatty()
    except ValueError:
        return False
