"""Progress a person at a terminal and a job log can both read.

`ProgressLine` takes a run's progress (`done` of `total`, since `started`). On a terminal
it redraws one line with a bar, the rate and the ETA. Anywhere else (a job log under
`ray job submit`, `nohup`, a pipe) it prints whole plain lines, with no escape codes and
no carriage returns: one at each tenth of the work and one at least every
`RAYCAP_PROGRESS_INTERVAL` seconds (10 by default) while updates arrive, each with
done/total, the rate, the ETA and the rows masked so far. `finish()` prints the last line.

The job console (`job_console`, entered by every job) makes the other long steps of a job
say how far they are (`stage_line`: retirement's shards; `heartbeat`: a clear or a sweep
that is one long call), and keeps Ray's worker lines free of colour codes when stderr is
not a terminal (Ray reads RAY_COLOR_PREFIX=0 as it prints each line). Off a terminal each write
is one whole line, flushed, so a warning printed by a log handler or by Ray is never
glued to a progress line; on a terminal the job's log handlers blank the bar before a
record is printed. Outside a job, `stage_line` and `heartbeat` print nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, TextIO

INTERVAL_ENV = "RAYCAP_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0
COLOR_ENV = "RAY_COLOR_PREFIX"

_console: dict[str, Any] = {"on": False, "bar": None}  # the terminal line drawn now, if any


def log_interval() -> float:
    """Seconds between progress lines in a job log (RAYCAP_PROGRESS_INTERVAL, else 10)."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class _ProgressState(Protocol):
    total: int
    done: int
    started: float  # time.monotonic() at the start


class ProgressLine:
    """A run's progress display: call it with progress updates, then `finish()`.
    `masked` may be set by the run as its rows arrive; it is shown when set."""

    BAR_WIDTH = 24

    def __init__(
        self, label: str = "rebuild", stream: TextIO | None = None, *, interval: float = 0.2,
        every: float | None = None, unit: str = "rollouts",
    ) -> None:
        self.label, self.unit = label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream)
        self.interval = interval  # between redraws on a terminal
        self.every = log_interval() if every is None else every  # between lines in a log
        self.masked: int | None = None
        self._state: _ProgressState | None = None
        self._drawn_at = 0.0
        self._logged_at: float | None = None
        self._tenth = 0
        self._width = 0

    def __call__(self, state: _ProgressState) -> None:
        self._state = state
        now = time.monotonic()
        if not self.tty:
            self._log(state, now)
            return
        if now - self._drawn_at < self.interval and state.done < state.total:
            return
        self._drawn_at = now
        self._draw(self._bar(state, now), end="")
        _console["bar"] = self

    def erase(self) -> None:
        """Blank the terminal line drawn, so that a line printed next starts clean;
        the next update draws it again."""
        if self.tty and self._width:
            self._write("\r" + " " * self._width + "\r")
            self._width, self._drawn_at = 0, 0.0

    def _log(self, state: _ProgressState, now: float) -> None:
        if self._logged_at is None:
            self._logged_at = now
        if not 0 < state.done < state.total:
            return  # nothing done yet says nothing; the last line is finish()'s
        tenth = 10 * state.done // state.total
        if tenth > self._tenth or now - self._logged_at >= self.every:
            self._tenth, self._logged_at = max(tenth, self._tenth), now
            self._write(self._plain(state, now) + "\n")

    def _draw(self, text: str, end: str) -> None:
        # Pad over the previous line's tail: plain text, no terminal escape codes.
        padded = text.ljust(self._width)
        self._width = len(text)
        self._write(("\r" if self.tty else "") + padded + end)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _rate(self, state: _ProgressState, now: float) -> float:
        return state.done / max(now - state.started, 1e-9)

    def _eta(self, state: _ProgressState, rate: float) -> str:
        if 0 < state.done < state.total and rate > 0:
            return f"  ETA {(state.total - state.done) / rate:.0f} s"
        return ""

    def _bar(self, state: _ProgressState, now: float) -> str:
        rate = self._rate(state, now)
        filled = int(self.BAR_WIDTH * state.done / state.total) if state.total else self.BAR_WIDTH
        bar = "#" * filled + "." * (self.BAR_WIDTH - filled)
        line = f"{self.label} [{bar}] {state.done:,}/{state.total:,} {self.unit}  {rate:.1f} {self.unit}/s"
        return line + self._eta(state, rate)

    def _plain(self, state: _ProgressState, now: float) -> str:
        rate = self._rate(state, now)
        share = f" ({100 * state.done // state.total}%)" if state.total else ""
        line = f"{self.label}: {state.done:,}/{state.total:,} {self.unit}{share}  {rate:.1f} {self.unit}/s"
        line += self._eta(state, rate)
        return line + ("" if self.masked is None else f"  masked {self.masked:,}")

    def finish(self) -> None:
        """Print the final line (also when the stream is not a terminal)."""
        if self._state is None:
            return
        state = self._state
        if _console["bar"] is self:
            _console["bar"] = None
        elapsed = max(time.monotonic() - state.started, 1e-9)
        masked = "" if self.masked is None else f", {self.masked:,} masked"
        self._draw(
            f"{self.label}: {state.done:,}/{state.total:,} {self.unit} in {elapsed:.1f} s "
            f"({state.done / elapsed:.1f} {self.unit}/s{masked})",
            end="\n",
        )


@dataclass
class Progress:
    """Work done of the total, since `started`: what a run passes to its `progress`
    callback after each batch (rollouts), and a job's other long steps count (shards)."""

    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0


@contextmanager
def job_console() -> Iterator[None]:
    """A job's console for its run: progress of every long step, and Ray's worker lines
    without colour codes from then on when stderr is not a terminal (unless
    RAY_COLOR_PREFIX is set)."""
    if not is_terminal(sys.stderr):
        # Left set: Ray prints a worker's lines when they reach the driver, after the job's
        # summary at times, and the process is the job's.
        os.environ.setdefault(COLOR_ENV, "0")
    before = _console["on"]
    _console["on"] = True
    handlers = list(logging.getLogger("raycap").handlers)
    clear = _ClearBar()
    for handler in handlers:
        handler.addFilter(clear)
    try:
        yield
    finally:
        _console["on"] = before
        for handler in handlers:
            handler.removeFilter(clear)


class _ClearBar(logging.Filter):
    """Before a log record is printed: blank a progress bar drawn on the terminal, so the
    record never continues the bar's line."""

    def filter(self, record: logging.LogRecord) -> bool:
        bar = _console["bar"]
        if bar is not None:
            bar.erase()
        return True


def stage_line(label: str, total: int, unit: str) -> tuple[ProgressLine, Progress] | None:
    """In a job: a progress line for a step of `total` `unit`, and its state to update
    (call the line with it after each unit, then `finish()`); None outside a job."""
    if not _console["on"]:
        return None
    line, state = ProgressLine(label, unit=unit), Progress(total)
    line(state)
    return line, state


@contextmanager
def heartbeat(label: str, what: str, stream: TextIO | None = None, every: float | None = None) -> Iterator[None]:
    """In a job, around one long call: a line every interval saying it still runs."""
    if not _console["on"] and stream is None:
        yield
        return
    out = stream if stream is not None else sys.stderr
    period = log_interval() if every is None else every
    stop = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not stop.wait(period):
            out.write(f"{label}: {what}: still running after {time.monotonic() - started:.0f} s\n")
            out.flush()

    thread = threading.Thread(target=beat, name=f"raycap-{label}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
