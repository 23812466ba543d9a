"""Seconds per stage of a run, measured where the work runs and added up in the driver.

The stages (`STAGES`, the keys of a summary's `timings_s`): `ray_start` (the job started or
joined Ray), `discovery` (the output checked, rollouts listed), `freeze`, `read`, `build`
and `write` (summed over batches, on whichever process ran them: on several cores they
add up to more than the wall time), `commit` and `retire` (wall time in the driver).

A batch's stages are measured by `timed` around the functions that do them. A timed call
inside another counts only in its own stage (the outer one gets the rest), so nesting
never counts a second twice. The seconds accumulate in the process that ran them until
`take_batch_figures` hands them out: the shard writer attaches them to the shard it
returns, so they cross Ray with it. Byte counts (`bytes_read`) ride along.
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, TypeVar

STAGES = ("ray_start", "discovery", "freeze", "read", "build", "write", "commit", "retire")
BATCH_STAGES = ("freeze", "read", "build", "write")

_F = TypeVar("_F", bound=Callable[..., Any])
_lock = threading.Lock()
_pending: dict[str, float] = {}
_nesting = threading.local()


def add(key: str, amount: float) -> None:
    """Add to this process's pending figures (seconds of a stage, or a byte count)."""
    with _lock:
        _pending[key] = _pending.get(key, 0.0) + amount


def take_batch_figures() -> dict[str, float]:
    """This process's figures since the last take, and start again from zero."""
    global _pending
    with _lock:
        taken, _pending = _pending, {}
    return taken


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as stage `name`, less the time of timed blocks inside it."""
    stack = getattr(_nesting, "stack", None)
    if stack is None:
        stack = _nesting.stack = []
    inner = [0.0]
    stack.append(inner)
    started = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - started
        stack.pop()
        if stack:
            stack[-1][0] += elapsed
        add(name, elapsed - inner[0])


def timed(name: str) -> Callable[[_F], _F]:
    """A decorator: each call is timed as stage `name` (see `stage`)."""

    def wrap(function: _F) -> _F:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            with stage(name):
                return function(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


class StageClock:
    """A run's timings in the driver: wall seconds of its own stages plus the batches'
    seconds added up (`add_batch`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def add_batch(self, figures: Mapping[str, float] | None) -> None:
        """A batch's figures (`take_batch_figures`): its stage seconds count here."""
        for name in BATCH_STAGES:
            if figures and name in figures:
                self.add(name, figures[name])

    def as_dict(self) -> dict[str, float]:
        """The stages measured, in `STAGES` order, in seconds rounded to milliseconds."""
        return {name: round(self.seconds[name], 3) for name in STAGES if name in self.seconds}


def render(timings: Mapping[str, float]) -> str:
    """`ray_start 1.2 s  discovery 0.1 s  ...`: a summary's timings on one line."""
    return "  ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items())
