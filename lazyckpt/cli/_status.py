"""Exit statuses of the ``lazyckpt`` command, and the error a command reports as one line."""

from __future__ import annotations

EXIT_OK = 0
EXIT_DAMAGE = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORAGE = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class CommandError(Exception):
    """A failure the command reports as one line on stderr, with its exit status."""

    def __init__(self, message: str, code: int = EXIT_DAMAGE) -> None:
        super().__init__(message)
        self.code = code
