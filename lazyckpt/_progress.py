"""Progress of a long operation (bytes moved, or things done), shown on a stream.

On a terminal, :class:`Progress` redraws one line in place: a bar, the bytes done and due,
the rate and the time left. Anywhere else (a log file, a CI console, a pipe) redrawing only
makes noise, so it prints a plain line every ``interval`` seconds instead, and one last line
when the operation ends either way. The command line, the demo and the benchmarks share it.

The clock is injectable so that what is printed depends only on the calls made, never on how
fast the machine is.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "format_bytes", "format_duration"]

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: ``"512 B"``, ``"2.7 MiB"``, ``"1.0 TiB"``."""
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable: the last unit always returns")


def format_duration(seconds: float) -> str:
    """A duration as ``M:SS`` or ``H:MM:SS`` (rounded to whole seconds)."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


class Progress:
    """Counts bytes (or things, with ``unit``) towards a total and shows how far along an
    operation is.

    Use as a context manager; leaving it with an exception prints where it stopped::

        with Progress(total, "verify step 100") as bar:
            for chunk in chunks:
                ...
                bar.advance(len(chunk))

    Args:
        total: the bytes the operation will move (0 is allowed: it finishes at once).
        label: what the operation is, shown at the start of every line.
        unit: what is counted when it is not bytes, plural (``"snapshots"``): the numbers
            are then shown as counts (``3 of 40 snapshots``).
        summary: False prints the last line only when a progress line was shown before it
            (the operation was long enough to need one) or the operation failed, so a quick
            operation prints nothing.
        stream: where to write; ``None`` means ``sys.stderr`` at the time of the call,
            so that results on stdout stay clean for pipes.
        tty: draw a redrawn bar (True) or plain lines (False); ``None`` asks the stream.
        enabled: False prints nothing at all (``--quiet``).
        interval: seconds between plain lines when not on a terminal.
        redraw: the shortest time between two redraws of the bar on a terminal.
        clock: a monotonic clock in seconds.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str | None = None,
        summary: bool = True,
        stream: TextIO | None = None,
        tty: bool | None = None,
        enabled: bool = True,
        interval: float = 5.0,
        redraw: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(0, int(total))
        self.label = label
        self.unit = unit
        self.summary = summary
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self.enabled = enabled
        self._interval = interval if not tty else redraw
        self._clock = clock
        self._start = clock()
        self._last_shown = self._start
        self._closed = False
        self._shown = False
        self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)

    @property
    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return self._clock() - self._start

    def advance(self, amount: int) -> None:
        """Count ``amount`` more bytes (or things) as done, and show it if it is time to."""
        self.done += amount
        if not self.enabled or self._closed:
            return
        now = self._clock()
        if now - self._last_shown >= self._interval:
            self._last_shown = now
            self._show(now)

    def close(self, *, failed: bool = False) -> None:
        """Print the last line: the total and the mean rate, or where it stopped."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled or not (self.summary or self._shown or failed):
            return
        elapsed = self.elapsed
        if failed:
            text = f"{self.label}: stopped at {self._fraction_text()}, {self._amount(self.done)}"
        else:
            rate = self.done / elapsed if elapsed > 0 else None
            speed = f" ({self._rate(rate)})" if rate is not None and self.done else ""
            text = f"{self.label}: done, {self._amount(self.done)} in {elapsed:.1f} s{speed}"
        if self.tty:
            # Pad over the bar so no tail of it survives after the shorter summary.
            self._stream.write("\r" + text.ljust(self._width) + "\n")
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    # -- drawing -----------------------------------------------------------------------------

    def _amount(self, n: int) -> str:
        return format_bytes(n) if self.unit is None else f"{n} {self.unit}"

    def _rate(self, rate: float) -> str:
        return f"{format_bytes(rate)}/s" if self.unit is None else f"{rate:.1f} {self.unit}/s"

    def _fraction_text(self) -> str:
        if not self.total:
            return "100%"
        return f"{min(100.0, 100.0 * self.done / self.total):.0f}%"

    def _numbers(self, now: float) -> str:
        elapsed = now - self._start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.unit is None:
            parts = [f"{format_bytes(self.done)} of {format_bytes(self.total)}"]
        else:
            parts = [f"{self.done} of {self.total} {self.unit}"]
        if rate > 0:
            parts.append(self._rate(rate))
            parts.append(f"{format_duration(max(0, self.total - self.done) / rate)} left")
        return ", ".join(parts)

    def _show(self, now: float) -> None:
        self._shown = True
        if self.tty:
            self._draw_bar(now)
        else:
            self._stream.write(f"{self.label}: {self._fraction_text()}, {self._numbers(now)}\n")
        self._stream.flush()

    def _draw_bar(self, now: float) -> None:
        columns = shutil.get_terminal_size((80, 24)).columns
        tail = f" {self._fraction_text():>4} {self._numbers(now)}"
        room = columns - len(self.label) - len(tail) - 4
        if room >= 10:
            filled = room if not self.total else min(room, room * self.done // self.total)
            bar = " [" + "=" * filled + " " * (room - filled) + "]"
        else:  # too narrow for a bar: the numbers alone still say how far along it is
            bar = ""
        line = (self.label + bar + tail)[: max(1, columns - 1)]
        self._stream.write("\r" + line.ljust(self._width))
        self._width = len(line)
