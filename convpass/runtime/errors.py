"""Errors of the executor."""

from __future__ import annotations

from convpass.errors import ConvpassError


class ExecutorError(ConvpassError, RuntimeError):
    """A model the executor cannot run, or a run request it cannot serve (bad feeds, ...).

    The message names what is wrong and, where it can, what would be right. A ConvpassError, so the
    CLI prints it as an error line and exits 1.
    """
