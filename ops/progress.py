"""Progress of a phase on the console: a bar with ETA on a terminal, plain lines otherwise.

`phase(description, total, unit)` is a context manager yielding a `Phase`; `update(done,
info=...)` moves it. On a TTY with `rich` installed (the `demo` extra) it is a rich bar
(elapsed, remaining, the last info text); otherwise one line when it starts, at most one every
`every_s` seconds, and one when it ends, so logs and CI output stay readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _rich_available() -> bool:
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    return True


def interactive(stream=None) -> bool:
    """Whether progress is drawn as a bar: `stream` (stdout) is a terminal and rich is there."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and _rich_available()


def _count(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 or float(x).is_integer() else f"{x:.1f}"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Phase:
    """One phase's progress (see the module doc); `total` None: no ETA, elapsed time only."""

    def __init__(self, description: str, total: float | None, unit: str, *, bar=None,
                 stream=None, every_s: float = 15.0):  # fmt: skip
        self.description, self.total, self.unit = description, total, unit
        self.done, self.info = 0.0, ""
        self.started = time.monotonic()
        self._bar, self._task = bar, None
        self._stream = stream or sys.stdout
        self._every_s, self._last_line = every_s, 0.0
        if bar is not None:
            self._task = bar.add_task(description, total=total, info="")
        else:
            self._line(f"{description}...")

    def update(self, done: float, *, total: float | None = None, info: str = "") -> None:
        """Progress is `done` of `total` (the phase's own when None); `info` a short status."""
        self.done, self.info = done, info or self.info
        if total is not None:
            self.total = total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=self.total, info=self.info)
        elif time.monotonic() - self._last_line >= self._every_s:
            self._line(self._status())

    def _status(self) -> str:
        elapsed = time.monotonic() - self.started
        parts = [f"{self.description}: "]
        if self.total:
            fraction = min(self.done / self.total, 1.0)
            if self.unit == "%":  # a percentage already: "62%", not "62/100 % (62%)"
                parts.append(f"{fraction:.0%}")
            else:
                parts.append(
                    f"{_count(self.done)}/{_count(self.total)} {self.unit} ({fraction:.0%})"
                )
            if 0 < fraction < 1:
                parts.append(f", ETA {_duration(elapsed * (1 - fraction) / fraction)}")
        else:
            parts.append(f"{_count(self.done)} {self.unit}")
        parts.append(f", {_duration(elapsed)} elapsed")
        if self.info:
            parts.append(f" | {self.info}")
        return "".join(parts)

    def _line(self, text: str) -> None:
        self._last_line = time.monotonic()
        print(text, file=self._stream, flush=True)

    def finish(self, info: str = "") -> float:
        """End the phase (a final plain line, or the bar at its end); its seconds."""
        self.info = info or self.info
        elapsed = time.monotonic() - self.started
        if self._bar is not None:
            total = self.total if self.total is not None else self.done
            self._bar.update(self._task, completed=total, total=total, info=self.info)
        else:
            tail = f" | {self.info}" if self.info else ""
            self._line(f"{self.description}: done in {_duration(elapsed)}{tail}")
        return elapsed


@contextmanager
def phase(description: str, total: float | None = None, unit: str = "",
          *, stream=None, every_s: float = 15.0) -> Iterator[Phase]:  # fmt: skip
    """A `Phase` drawn while the block runs (module doc); finished when the block ends."""
    stream = stream or sys.stdout
    if not interactive(stream):
        p = Phase(description, total, unit, stream=stream, every_s=every_s)
        yield p
        p.finish()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    done = [TaskProgressColumn()] if unit == "%" else [MofNCompleteColumn(), TextColumn(unit)]
    columns = [TextColumn("{task.description}"), BarColumn(), *done, TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]  # fmt: skip
    with Progress(*columns, console=Console(file=stream), transient=False) as bar:
        p = Phase(description, total, unit, bar=bar, stream=stream)
        yield p
        p.finish()
