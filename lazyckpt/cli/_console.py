"""Where a command writes: results to stdout, progress and problems to stderr, as tables."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from .._progress import Progress


@dataclass
class Console:
    """Where a command writes: results to stdout, progress and problems to stderr."""

    quiet: bool = False

    def out(self, text: str = "") -> None:
        """Write a result line to stdout."""
        print(text, file=sys.stdout)

    def note(self, text: str) -> None:
        """Write a message (a summary, a problem) to stderr."""
        print(text, file=sys.stderr)

    def progress(self, total: int, label: str, *, unit: str | None = None) -> Progress:
        """A progress display on stderr (none with ``--quiet``): bytes moved, with a last
        line always; or things counted in ``unit``, with a last line only when the
        operation took long enough to show progress at all."""
        return Progress(
            total,
            label,
            unit=unit,
            summary=unit is None,
            stream=sys.stderr,
            enabled=not self.quiet,
        )


def local_time(created: float) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS``, for a table."""
    return datetime.fromtimestamp(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def iso_time(created: float) -> str:
    """A Unix time as local ISO 8601 to the second, for JSON."""
    return datetime.fromtimestamp(created).astimezone().isoformat(timespec="seconds")


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Rows as aligned columns; a row of two cells is a name and a free-form note."""
    full = [row for row in rows if len(row) == len(rows[0])]
    widths = [max(len(row[c]) for row in full) for c in range(len(rows[0]))]
    widths[0] = max(len(row[0]) for row in rows)
    lines = []
    for row in rows:
        if len(row) != len(rows[0]):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}".rstrip())
            continue
        cells = [
            cell.rjust(widths[c]) if c in right else cell.ljust(widths[c])
            for c, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
